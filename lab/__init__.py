"""The machinery train.py's runs stand on; the ideas are in the files above this folder.

models         the model file a config.json names; weight stacks, Qwen3.5's layout, input axes
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
