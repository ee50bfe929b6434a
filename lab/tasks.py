"""What train.py trains on: a model, prompts to train on and held-out ones, each with its gold
answer, the drift meter's probe prompts, and a batch reward. With a checkpoint: GSM8K, and
arithmetic of its kind (lab/problems.py); on a CPU, on a tiny Qwen3, the sequence task (a reward
per token) that shows what drift costs, and the chain task (GSM8K's shape: one binary reward after a
long completion), also on a tiny Qwen3.5 (chain-hybrid: a recurrent state to hold in low precision).
B rows, M completion tokens, V vocabulary, L layers."""

import math
import re
from collections import namedtuple
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from lab import hf_checkpoint, models, problems

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
RECIPE["chain-hybrid"] = RECIPE["chain"]
# --sweep on the tiny tasks: 8 seeds; on the sequence task about 8 minutes on 2 cores
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
SWEEP_LEVELS["chain-hybrid"] = SWEEP_LEVELS["chain"]

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
HYBRID = dict(  # a tiny Qwen3.5: three Gated DeltaNet layers, then one of gated attention
    model_type="qwen3_5_text",
    vocab_size=1024,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    hidden_size=64,
    intermediate_size=128,
    head_dim=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_num_value_heads=4,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=True,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_parameters=dict(rope_theta=1e4, partial_rotary_factor=0.25),
)
SHARPEN = 6.0  # the final norm's scale: entropy ~1 nat, top-128 mass > 0.99, as a trained LM
HYBRID_SHARPEN = 8.0  # the hybrid's: 0.9 nat (at 6: 1.3)
TEACHER_TOP = 3  # a completion token earns its reward when p_0 ranks it in its top 3


def good_share(cfg, w, tokens, mask, prompt):  # p_0's w; completions [B, M], prompts [B, 8] -> [B]
    seq, V = jnp.concatenate([prompt, tokens], 1), cfg["vocab_size"]
    pos = jnp.broadcast_to(jnp.arange(seq.shape[1]), seq.shape)
    with jax.default_matmul_precision("highest"):  # p_0's logits where each token was chosen
        logits = models.model(cfg).forward(cfg, w, seq, pos, last=tokens.shape[1] + 1)[0]
    logits = logits[:, :-1]  # [B, M, V]
    chosen = jnp.take_along_axis(logits, tokens[..., None], -1)
    rank = (logits > chosen).sum(-1)  # how many tokens p_0 prefers to the chosen one
    good = (tokens < V // 2) & (rank < TEACHER_TOP) & mask
    return good.sum(1) / jnp.maximum(mask.sum(1), 1)


def init(cfg, rng):
    """Random weights: matrices N(0, 1/fan-in), norms at their identity (Qwen3.5's multiply by
    1 + w: w = 0, but its gated norm's by w), the final norm's scale SHARPEN; Qwen3.5's decays
    exp(-A dt) a token as Mamba2's and FLA's initialisations draw them (A uniform in [1, 16], dt
    log-uniform in [1e-3, 0.1]): 0.2 to 0.999, state that lasts up to hundreds of tokens."""
    hybrid = cfg["model_type"] == "qwen3_5_text"

    def one(name, shape, hf_shape):
        if len(hf_shape) > 1:  # a matrix (torch's [out, in]), or the conv's [C, 1, kernel]
            return rng.standard_normal(shape, np.float32) * hf_shape[-1] ** -0.5
        if name == "A_log":
            return np.log(rng.uniform(1, 16, shape)).astype(np.float32)
        if name == "dt_bias":  # dt = softplus(a + dt_bias) at a = 0
            dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), shape))
            return np.log(np.expm1(dt)).astype(np.float32)
        one_plus_w = hybrid and name != "norm"
        return np.full(shape, 0.0 if one_plus_w else 1.0, np.float32)

    top, stacks = models.layout(cfg)
    w = {name: one(name, shape, hf) for name, (_, hf, shape) in top.items()}
    w["norm"] = np.full_like(w["norm"], HYBRID_SHARPEN - 1 if hybrid else SHARPEN)
    for stack, (ids, layer) in stacks.items():
        w[stack] = {k: one(k, (len(ids), *shape), hf) for k, (_, hf, shape) in layer.items()}
    return jax.tree.map(jnp.asarray, w)


def sequence_task(seed, eval_n, probe_n, cfg=SEQUENCE):
    """A tiny p_0 from the seed (a Qwen3, or cfg's Qwen3.5); prompts of 8 random tokens: 512 to
    train on, eval_n held out, then probe_n for the probe. The reward: the fraction of completion
    tokens in the lower half of V that p_0 ranks in its top 3 at the prefix the policy wrote, a
    preference to learn while staying fluent by p_0's standard (the stand-in for a pretrained LM's
    competence, which drift erodes)."""
    rng = np.random.default_rng(seed)
    w = init(cfg, rng)
    n = 512 + eval_n
    prompts = rng.integers(0, cfg["vocab_size"], (n + probe_n, 8)).tolist()
    prompts = [(p, p) for p in prompts]  # a prompt is its own "gold": the reward reads it
    share = jax.jit(partial(good_share, cfg))

    def reward_of(tokens, mask, golds):
        return share(w, tokens, mask, np.array(golds, np.int32))

    train, test, probe = prompts[:512], prompts[512:n], [p for p, _ in prompts[n:]]
    return Task(cfg, w, (-1,), 0, train, test, probe, reward_of, None)


CHAIN_PASS = 0.6  # the fraction of good tokens a completion needs: p_0 samples pass 28-36%
# the hybrid's p_0 samples vary less in their share from prompt to prompt (the middle half of its
# completions: 0.41 to 0.53): at 0.5 they pass 27-46% (seeds 0-2)
HYBRID_PASS = 0.5


def chain_task(seed, eval_n, probe_n, cfg=SEQUENCE, bar=CHAIN_PASS):
    """The sequence task's p_0, prompts and good tokens, with GSM8K's shape of reward: one bit per
    completion, 1 when at least `bar` of its tokens are good (a chain of reasoning is right
    only when most of its steps are). One token barely moves that bit: the longer the completion,
    the less signal per token, while the drift per token stays (score_centering.py, step 4)."""
    task = sequence_task(seed, eval_n, probe_n, cfg)

    def reward_of(tokens, mask, golds):
        return (task.reward(tokens, mask, golds) >= bar).astype(jnp.float32)

    return task._replace(reward=reward_of)


# the tasks whose model comes from the seed, and that model's config
TINY = dict(sequence=sequence_task, chain=chain_task)
TINY["chain-hybrid"] = partial(chain_task, cfg=HYBRID, bar=HYBRID_PASS)
TINY_CONFIGS = dict(sequence=SEQUENCE, chain=SEQUENCE, **{"chain-hybrid": HYBRID})


# -------------------------------------------------------------------------------------------------
# Loading: every check that config.json allows, before any download of data or weights


def load(args, place=None):
    """The task of the flags (--plan: the model's config.json). A bad checkpoint or data file: one
    line, no traceback."""
    try:
        cfg = TINY_CONFIGS[args.task] if args.task in TINY else hf_checkpoint.config(args.model)[0]
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
