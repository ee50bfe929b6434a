"""The machinery train.py's runs stand on; the ideas are in the files above this folder.

The rule: the top-level files are the reference, the simplest code that computes what the runs
compute. What makes a run fast, big, cheaper or observed lives here, as a drop-in for a top-level
function (the same signature, the same numbers up to the order of float32 sums) or a wrapper around
it, chosen when run.py builds a run, each with a test that holds it equal to the reference. A new
capability lands here, never by widening a top-level file; nothing here imports train.py but the
`python -m` entry points, which pass it in.

run            one run of train.py: its programs, the policy, data, evaluation, grpo with logs
grouped        drop-ins for the sampler and trainer logits that compute a group's prompt once
train_step     the drop-in train step: micro-batches, FSDP or LoRA, the non-finite guard
models         the model file a config.json names, as the runs call it; weight names, input axes
chunked        Qwen3.5's delta rule in chunks of 64 tokens, a drop-in for its token-by-token one
hf_checkpoint  Hugging Face checkpoints: safetensors, config.json, the tokenizer; load and save
tokenizer      byte-level BPE through tiktoken, and the checkpoint's own chat template
gguf           python -m lab.gguf FILE OUT: a GGUF file as a checkpoint folder
tasks          the tasks and their rewards: GSM8K and arithmetic, the sequence and chain tasks
problems       GSM8K's files; arithmetic a small model gets right some of the time (held out)
rollouts       sampling many prompts in device-sized calls; the drift meter
lora           LoRA adapters: their start, the merged weights, the trainer's unmerged matmul
devices        the FSDP layout of the weights; several processes (jax.distributed)
harness        flags and their checks, logs, resumable state, Ctrl-C
compare        --compare: centring off and on from the same start, per seed and level
sweep          --sweep's statistics: paired intervals, verdicts, the figures
report         python -m lab.report DIR: a --compare recomputed from its files, with intervals
corrections    python -m lab.corrections DIR: sweeps of each --correction, a table a level
plan           --plan: the bytes each device holds, from config.json alone
bench          python -m lab.bench: how fast train.py samples and trains, against the limits
step           python -m lab.step: one GRPO step of train.py, part by part
measure        python -m lab.measure: a real checkpoint's mismatch, drift term and accuracy
"""
