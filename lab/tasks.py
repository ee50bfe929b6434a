"""What train.py trains on: a model, prompts to train on and held-out ones, each with its gold
answer, the drift meter's probe prompts, and a batch reward. With a checkpoint: GSM8K, and
arithmetic of its kind (lab/problems.py); on a CPU, on a tiny Qwen3, the sequence task (a reward
per token) that shows what drift costs, and the chain task (GSM8K's shape: one binary reward after a
long completion).
B rows, M completion tokens, V vocabulary, L layers."""

import math
import re
from collections import namedtuple

import jax
import jax.numpy as jnp
import numpy as np

import qwen3
from lab import hf_checkpoint, problems

# train, test: [(prompt tokens, gold)]; probe: [prompt tokens];
# reward(tokens [B, M], mask [B, M], golds) -> [B]; path: the checkpoint's folder (or None)
Task = namedtuple("Task", "cfg weights eos pad train test probe reward path")

RECIPE = {  # per task, the defaults of the flags that depend on it
    "gsm8k": dict(
        steps=100,
        lr=0.01,
        prompts=32,
        max_tokens=512,
        eval_every=10,
        eval_n=500,
        sampler="bf16",  # the mismatch: a clean bf16 sampler
        weight_noise=0.0,
        workers=1,  # runs at once: each needs the accelerator's memory
        topk=128,  # the sampler's recorded head; the tail beyond it modelled as p
    ),
    "arithmetic": dict(  # lab/problems.py: SmolLM2-135M gets 12% of it, sampled
        steps=100,
        lr=1e-4,
        prompts=8,
        max_tokens=128,
        eval_every=10,
        eval_n=400,  # every held-out problem
        sampler="bf16",
        weight_noise=0.0,
        workers=1,
        topk=128,
    ),
    "sequence": dict(
        steps=150,
        lr=0.1,
        prompts=4,
        max_tokens=16,
        eval_every=10,
        eval_n=256,
        sampler="int8",  # the mismatch: W8A8 and 10% fixed weight noise
        weight_noise=0.1,
        workers=3,  # runs at once: its steps are too small to fill a CPU's cores
        topk=128,  # as GSM8K's (a --sweep: exact, below)
    ),
    "chain": dict(
        steps=150,
        lr=0.1,
        prompts=4,
        max_tokens=64,  # a completion is long: each token moves its one reward little
        eval_every=25,
        eval_n=512,  # a held-out score of one bit a prompt: more prompts than the sequence task's
        sampler="int8",
        weight_noise=0.0,
        workers=3,
        topk=0,  # exact centring: V is 1,024
    ),
}
# --sweep on the tiny tasks: 8 seeds; on the sequence task about 10 minutes on 2 cores
# (docs/sweep.md); exact centring over V = 1,024 (no tail model, and faster on a CPU than top-128)
SWEEP_RECIPE = dict(seeds=tuple(range(8)), steps=150, eval_every=25, topk=0)
# --sweep's levels of mismatch (harness.levels): bf16 with fixed weight noise σ, W8A8 int8 or fp8,
# each with a quantised KV cache or not. The chain task's: what real engines run (bf16, int8 W8A8,
# fp8 with an fp8 cache as in verl's collapse, int8 with an int4 cache as in the paper's 30B run)
# and a noise whose kl_q_p is near 0.05, the top of the band measured on fp8 engines
SWEEP_LEVELS = dict(
    gsm8k="0,0.01,0.03,0.1,int8",
    arithmetic="0,fp8+kv_fp8",
    sequence="0,0.01,0.03,0.1,int8",
    chain="0,int8,fp8+kv_fp8,int8+kv_int4,0.02",
)

# -------------------------------------------------------------------------------------------------
# GSM8K: grade-school maths in the checkpoint's chat template, rewarded 1 when the last number
# is the answer

INSTRUCTION = (
    "\nSolve the problem step by step, then give the final answer as a number on the last line."
)


def reward(completion, gold):  # 1 when the completion's last number is the gold answer
    numbers = re.findall(r"-?\$?\d[\d,]*(?:\.\d+)?", completion)
    return float(bool(numbers) and problems.normalise(numbers[-1]) == gold)


def gsm8k_task(model, splits, eval_n, probe_n, place=None):
    """Problems (train, test) of GSM8K's kind, [(question, gold)] each, in the checkpoint's chat
    template; the first eval_n test problems are held out, the first probe_n are the probe.
    place(shapes): the weights' shardings, read straight from the checkpoint."""
    train_set, test_set = splits
    ckpt = hf_checkpoint.load(model, place=place)
    tok = ckpt.tokenizer
    if tok is None:
        raise ValueError(f"{model} has no tokenizer files (vocab.json or tokenizer.json)")
    if tok.chat is None:
        raise ValueError(
            f"{model} has no chat template (chat_template.jinja, or tokenizer_config.json's "
            "chat_template): add the checkpoint's own"
        )

    def chat(problems):
        return [(tok.chat(question + INSTRUCTION), gold) for question, gold in problems]

    def batch_reward(tokens, mask, golds):  # each completion's text ends at its EOS
        texts = [
            tok.decode([t for t in row[m] if t not in tok.eos_ids])
            for row, m in zip(tokens, mask, strict=True)
        ]
        return [reward(text, gold) for text, gold in zip(texts, golds, strict=True)]

    probe = [prompt for prompt, _ in chat(test_set[:probe_n])]
    train, test = chat(train_set), chat(test_set[:eval_n])
    return Task(
        ckpt.cfg, ckpt.weights, tok.eos_ids, tok.pad_id, train, test, probe, batch_reward, ckpt.path
    )


# -------------------------------------------------------------------------------------------------
# The sequence task: what drift costs, on the LLM code path, on a CPU

SEQUENCE = dict(  # a tiny Qwen3
    model_type="qwen3",
    vocab_size=1024,
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    head_dim=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
)
SHARPEN = 6.0  # the final norm's weight: entropy ~1 nat, top-128 mass > 0.99, as a trained LM
TEACHER_TOP = 3  # a completion token earns its reward when p_0 ranks it in its top 3


@jax.jit
def sequence_reward(w, tokens, mask, prompt):  # p_0's w; completions [B, M], prompts [B, 8] -> [B]
    seq, V = jnp.concatenate([prompt, tokens], 1), SEQUENCE["vocab_size"]
    pos = jnp.broadcast_to(jnp.arange(seq.shape[1]), seq.shape)
    with jax.default_matmul_precision("highest"):  # p_0's logits where each token was chosen
        logits = qwen3.forward(SEQUENCE, w, seq, pos, last=tokens.shape[1] + 1)[0]
    logits = logits[:, :-1]  # [B, M, V]
    chosen = jnp.take_along_axis(logits, tokens[..., None], -1)
    rank = (logits > chosen).sum(-1)  # how many tokens p_0 prefers to the chosen one
    good = (tokens < V // 2) & (rank < TEACHER_TOP) & mask
    return good.sum(1) / jnp.maximum(mask.sum(1), 1)


def sequence_task(seed, eval_n, probe_n):
    """A tiny Qwen3 p_0 from the seed; prompts of 8 random tokens: 512 to train on, eval_n held out,
    then probe_n for the probe. The reward: the fraction of completion tokens in the lower half of V
    that p_0 ranks in its top 3 at the prefix the policy wrote, a preference to learn while staying
    fluent by p_0's standard (the stand-in for a pretrained LM's competence, which drift erodes)."""
    cfg, rng = dict(SEQUENCE), np.random.default_rng(seed)
    V, L = cfg["vocab_size"], cfg["num_hidden_layers"]
    top, layers = qwen3.layout(cfg)

    def init(shape, hf_shape):  # a norm's weight: ones (the final norm: SHARPEN); N(0, 1/fan-in)
        if len(hf_shape) == 1:
            return np.ones(shape, np.float32)
        return rng.standard_normal(shape, np.float32) * hf_shape[-1] ** -0.5  # torch's [out, in]

    w = {name: init(shape, hf) for name, (_, hf, shape) in top.items()}
    w["norm"] = w["norm"] * SHARPEN
    w["layers"] = {name: init((L, *shape), hf) for name, (_, hf, shape) in layers.items()}
    w = jax.tree.map(jnp.asarray, w)
    n = 512 + eval_n
    prompts = rng.integers(0, V, (n + probe_n, 8)).tolist()
    prompts = [(p, p) for p in prompts]  # a prompt is its own "gold": the reward reads it

    def reward_of(tokens, mask, golds):
        return sequence_reward(w, tokens, mask, np.array(golds, np.int32))

    train, test, probe = prompts[:512], prompts[512:n], [p for p, _ in prompts[n:]]
    return Task(cfg, w, (-1,), 0, train, test, probe, reward_of, None)


CHAIN_PASS = 0.6  # the fraction of good tokens a completion needs: p_0 samples pass 28-36%


def chain_task(seed, eval_n, probe_n):
    """The sequence task's p_0, prompts and good tokens, with GSM8K's shape of reward: one bit per
    completion, 1 when at least CHAIN_PASS of its tokens are good (a chain of reasoning is right
    only when most of its steps are). One token barely moves that bit: the longer the completion,
    the less signal per token, while the drift per token stays (score_centering.py, step 4)."""
    task = sequence_task(seed, eval_n, probe_n)

    def reward_of(tokens, mask, golds):
        return (task.reward(tokens, mask, golds) >= CHAIN_PASS).astype(jnp.float32)

    return task._replace(reward=reward_of)


TINY = dict(sequence=sequence_task, chain=chain_task)  # the tasks whose model comes from the seed


# -------------------------------------------------------------------------------------------------
# Loading: every check that config.json allows, before any download of data or weights


def load(args, place=None):
    """The task of the flags (--plan: the model's config.json). A bad checkpoint or data file: one
    line, no traceback."""
    try:
        cfg = SEQUENCE if args.task in TINY else hf_checkpoint.config(args.model)[0]
        check_against_model(cfg, args)
        if args.plan:
            return cfg
        if args.task in TINY:
            return TINY[args.task](args.seed, args.eval_n, args.probe_n)
        made = problems.arithmetic() if args.task == "arithmetic" else problems.gsm8k(args.data_dir)
        return gsm8k_task(args.model, made, args.eval_n, args.probe_n, place)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None


def check_against_model(cfg, args):  # the flags that the model's config.json can refuse
    V, n_pos = cfg["vocab_size"], cfg.get("max_position_embeddings", math.inf)
    name = f"the {args.task} task" if args.task in TINY else args.model
    if args.topk > V:
        raise ValueError(f"--topk {args.topk} exceeds the {V} tokens of {name}")
    if args.topk == 0 and V > 4096:
        raise ValueError(f"--topk 0 records q over all {V} tokens of {name}: use --topk 128")
    if args.state_dtype and cfg["model_type"] != "qwen3_5_text":  # no linear attention
        raise ValueError(
            f"--state-dtype {args.state_dtype}: {name} has no recurrent state: drop it"
        )
    if args.max_tokens >= n_pos:
        raise ValueError(
            f"--max-tokens {args.max_tokens} reaches past the {n_pos} positions of {name}"
        )
