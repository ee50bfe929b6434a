"""'GRPO' on GSM8K, a CPU sequence task or a toy bandit, with a sampler of other numerics than the
trainer's.

    python train.py --center                       # Qwen3-0.6B on GSM8K, score-centred
    python train.py --compare --out runs/gsm8k     # centring off, then on: same seed and noise
    python train.py --task sequence --compare      # what drift costs, on a CPU: about 40 s
    python train.py --task bandit --baseline none --compare   # the mechanism in seconds

What it is: REINFORCE with a group-mean baseline, whose rollouts come from a copy of the policy that
runs with other numerics (bf16 / int8 / fp8 weights and KV cache, fixed weight noise, staleness),
trained with `score_centering.loss`. How it differs from textbook GRPO, and why:
- no KL penalty to a reference model: it would pull toward the start and hide the drift under study;
- no PPO ratio clipping: one optimizer step per batch, so the only off-policyness is the mismatch;
- a token-mean loss over the whole batch, not a mean of per-sequence means (score_centering.py, 8);
- advantages are rewards minus the group mean, not divided by the group's std (the paper's recipe);
- plain SGD at a constant learning rate on float32 master weights (the paper's; --optimizer adam).

The file reads in order: what we train on (tasks and rewards), how rollouts are made (the sampler
and its mismatch), how the policy learns (the loss and the train step), one run, --compare and
--plan, main; the bandit lives in bandit.py. Letters: P prompts per step, G rollouts per prompt,
B = P·G rows, T0 prompt length, M completion length, V vocabulary, k the top-k head size, L layers.
"""

import argparse
import concurrent.futures
import functools
import math
import os
import re
import time
from collections import namedtuple
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental.multihost_utils import process_allgather
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import bandit
import harness
import hf_checkpoint
import qwen3
import score_centering as sc
import sweep

TEMPERATURE = 1.0  # the sampler's; the recorded log q is the post-temperature distribution
RECIPE = {  # per task, the defaults of the flags that depend on it
    "gsm8k": dict(steps=100, lr=0.01, prompts=32, max_tokens=512, eval_every=10, eval_n=500),
    "sequence": dict(steps=150, lr=0.1, prompts=4, max_tokens=16, eval_every=10, eval_n=256),
    "bandit": dict(steps=200, lr=0.5, prompts=32, max_tokens=1, eval_every=10),
}
RECIPE["gsm8k"] |= dict(sampler="bf16", weight_noise=0.0)  # the mismatch: a clean bf16 sampler
RECIPE["sequence"] |= dict(sampler="int8", weight_noise=0.1)  # W8A8 and 10% fixed weight noise
RECIPE["bandit"] |= dict(sampler="bf16", weight_noise=0.5)  # a logit offset of std 0.5
RECIPE["gsm8k"]["workers"], RECIPE["sequence"]["workers"] = 1, 3  # runs at once: tiny steps
# the input (contracted) axes of each matmul weight in qwen3.layout, after the stacked layer axis:
# fan-in at initialisation, per-output-channel quantisation, LoRA's A
INPUT_AXES = dict(q=(1,), k=(1,), v=(1,), o=(1, 2), gate=(1,), up=(1,), down=(1,))
INPUT_AXES |= dict(embed=(1,), lm_head=(1,))

# -------------------------------------------------------------------------------------------------
# What we train on: a model, training and test prompts (token lists) with their gold answers, the
# drift meter's probe prompts, and a batch reward(tokens [B, M], mask [B, M], golds) -> [B]

Task = namedtuple("Task", "cfg weights eos pad train test probe reward path")
INSTRUCTION = (
    "\nSolve the problem step by step, then give the final answer as a number on the last line."
)


def normalise(number):  # "$1,234.50" -> "1234.5", "18.0" -> "18"
    s = number.strip().replace(",", "").replace("$", "")
    return s.rstrip("0").rstrip(".") if "." in s else s


def reward(completion, gold):  # 1 when the completion's last number is the gold answer
    numbers = re.findall(r"-?\$?\d[\d,]*(?:\.\d+)?", completion)
    return float(bool(numbers) and normalise(numbers[-1]) == gold)


def gsm8k_task(model, data_dir, eval_n, probe_n, place=None):
    """GSM8K in Qwen3's chat markup; the first eval_n test problems are held out, the first probe_n
    are the probe. place(shapes): the weights' shardings, read straight from the checkpoint."""
    train_set = harness.read_gsm8k(data_dir, "train", normalise)
    test_set = harness.read_gsm8k(data_dir, "test", normalise)
    ckpt = hf_checkpoint.load(model, place=place)
    tok = ckpt.tokenizer
    if tok is None:
        raise ValueError(f"{model} has no tokenizer files (vocab.json or tokenizer.json)")

    def chat(problems):
        return [(tok.chat(question + INSTRUCTION), gold) for question, gold in problems]

    def batch_reward(tokens, mask, golds):  # each completion's text ends at its EOS
        texts = [
            tok.decode([t for t in row[m] if t not in tok.eos_ids])
            for row, m in zip(tokens, mask, strict=True)
        ]
        return [reward(text, gold) for text, gold in zip(texts, golds, strict=True)]

    train, test, probe = chat(train_set), chat(test_set[:eval_n]), chat(test_set[:probe_n])
    eos, pad, probe = tok.eos_ids, tok.pad_id, [p for p, _ in probe]
    return Task(ckpt.cfg, ckpt.weights, eos, pad, train, test, probe, batch_reward, ckpt.path)


SEQUENCE = dict(model_type="qwen3", vocab_size=1024, num_hidden_layers=2)  # a tiny Qwen3
SEQUENCE |= dict(hidden_size=64, intermediate_size=128, head_dim=16, max_position_embeddings=256)
SEQUENCE |= dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
SEQUENCE |= dict(rms_norm_eps=1e-6, rope_theta=1e4)
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
    V, L, (top, layers) = cfg["vocab_size"], cfg["num_hidden_layers"], qwen3.layout(cfg)

    def init(shape, fan_in):
        return rng.standard_normal(shape, np.float32) * fan_in**-0.5

    w = {}
    for name, (_, _, shape) in top.items():
        norm = np.full(shape, SHARPEN if name == "norm" else 1, np.float32)
        w[name] = norm if len(shape) == 1 else init(shape, shape[-1])
    w["layers"] = {}
    for name, (_, _, shape) in layers.items():
        if len(shape) == 1:  # a norm's weight
            w["layers"][name] = np.ones((L, *shape), np.float32)
        else:
            w["layers"][name] = init((L, *shape), math.prod(shape[: len(INPUT_AXES[name])]))
    w, n = jax.tree.map(jnp.asarray, w), 512 + eval_n
    prompts = rng.integers(0, V, (n + probe_n, 8)).tolist()
    prompts = [(p, p) for p in prompts]  # a prompt is its own "gold": the reward reads it

    def reward_of(tokens, mask, golds):
        return sequence_reward(w, tokens, mask, np.array(golds, np.int32))

    train, test, probe = prompts[:512], prompts[512:n], [p for p, _ in prompts[n:]]
    return Task(cfg, w, (-1,), 0, train, test, probe, reward_of, None)


# -------------------------------------------------------------------------------------------------
# How rollouts are made: a bf16 copy of the trainer's weights with its own numerics (W8A8, noise, a
# quantised KV cache), and jitted KV-cache decoding that records what score_centering.loss needs


def fake_quant(x, axes, kind):  # symmetric, one scale per slice reduced over `axes`: int8 or fp8
    x32, qmax = x.astype(jnp.float32), 127.0 if kind == "int8" else 448.0
    scale = jnp.maximum(jnp.abs(x32).max(axes, keepdims=True), 1e-12) / qmax
    y = x32 / scale
    y = y.astype(jnp.float8_e4m3fn) if kind == "fp8" else jnp.clip(jnp.round(y), -qmax, qmax)
    return (y.astype(jnp.float32) * scale).astype(x.dtype)


def kv_quant(kind):
    """K, V [B, T, K, H] as a quantised cache keeps them: int8 per token and head, or fp8 (e4m3) at
    unit scale, saturating at its largest value; None: a plain cache."""

    def int8(a):
        return fake_quant(a, (3,), "int8")

    def fp8(a):
        return jnp.clip(a.astype(jnp.float32), -448, 448).astype(jnp.float8_e4m3fn).astype(a.dtype)

    return dict(int8=int8, fp8=fp8).get(kind)


@partial(jax.jit, static_argnums=(1, 2))
def sampler_weights(w, kind, sigma=0.0, key=None):
    """bf16 copy of w ⊙ (1 + σε), ε ~ N(0, 1) from `key`: the same at each refresh, a persistent
    bias; kind int8 or fp8 fake-quantises every matmul weight per output channel."""
    if sigma:
        leaves, tree = jax.tree.flatten(w)
        keys = tree.unflatten(list(jax.random.split(key, len(leaves))))  # a key a weight
        w = jax.tree.map(lambda x, k: x * (1 + sigma * jax.random.normal(k, x.shape)), w, keys)
    if kind != "bf16":

        def quant(d):
            return {
                k: fake_quant(x, INPUT_AXES[k], kind) if k in INPUT_AXES else x
                for k, x in d.items()
            }

        w = dict(quant(w), layers=quant(w["layers"]))
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), w)


def quant_mm(kind):  # W8A8: the activation is fake-quantised per token (over the contracted axes)
    def mm(spec, x, w):
        x_axes, out = spec.split(",")[0], spec.split("->")[1]
        per_token = tuple(i for i, c in enumerate(x_axes) if c not in out)
        return jnp.einsum(spec, fake_quant(x, per_token, kind), w)

    return jnp.einsum if kind == "bf16" else mm


def categorical(key, logq, block=128):
    """y ~ q [B, V] by inverse CDF, a block of ids then an id in it: two uniforms a row, not V
    Gumbels."""
    B, V = logq.shape
    p = jnp.pad(jnp.exp(logq), ((0, 0), (0, -V % block)))
    p = p.reshape(B, -1, block)  # [B, V/block, block]

    def pick(key, w):  # i with probability w_i / Σ w; rounding never reaches past the last w_i > 0
        c = jnp.cumsum(w, -1)
        i = (c <= jax.random.uniform(key, (B, 1)) * c[:, -1:]).sum(-1)
        return jnp.minimum(i, w.shape[-1] - 1 - jnp.argmax(w[:, ::-1] > 0, -1))

    k_block, k_id = jax.random.split(key)
    i = pick(k_block, p.sum(-1))
    return i * block + pick(k_id, jnp.take_along_axis(p, i[:, None, None], 1)[:, 0])


def make_sampler(
    cfg, max_tokens, topk, eos_ids, mm=jnp.einsum, dtype=jnp.bfloat16, greedy=False, kv=None
):
    """fn(weights, prompt [B, T0], pos [B, T0], key) -> dict of tokens, logq, mask [B, M] and the
    head: head_ids, head_logq [B, M, k], log q after temperature over the whole vocabulary (topk 0:
    the full [B, M, V] log q, no ids). Prefills once, then decodes a token a step until every row
    has ended its turn. mm: the matmuls (quant_mm); kv: the cache's quantiser (kv_quant)."""
    fwd, eos = partial(qwen3.forward, cfg, mm=mm, dtype=dtype, kv_quant=kv), jnp.array(eos_ids)

    def sample(w, prompt, pos, key):
        B, T0 = prompt.shape
        M, k = max_tokens, topk or cfg["vocab_size"]
        logits, cache = fwd(w, prompt, pos, qwen3.init_kv(cfg, B, T0 + M, dtype), 0, last=1)
        out = dict(  # [M, B, ...]: each step writes one contiguous slab
            tokens=jnp.zeros((M, B), jnp.int32),
            logq=jnp.zeros((M, B)),
            mask=jnp.zeros((M, B), bool),
            head_logq=jnp.zeros((M, B, k)),
        )
        if topk:
            out["head_ids"] = jnp.zeros((M, B, k), jnp.int32)

        def body(carry):
            i, logits, cache, done, out, key = carry
            key, k_sample = jax.random.split(key)
            logq = jax.nn.log_softmax(logits[:, -1] / TEMPERATURE)  # [B, V]
            y = jnp.argmax(logq, -1) if greedy else categorical(k_sample, logq)  # [B]
            logq_y = jnp.take_along_axis(logq, y[:, None], -1)[:, 0]
            rec = dict(tokens=y, logq=logq_y, mask=~done, head_logq=logq)
            if topk:
                rec["head_logq"], rec["head_ids"] = jax.lax.top_k(logq, topk)
            out = {name: x.at[i].set(rec[name]) for name, x in out.items()}
            logits, cache = fwd(w, y[:, None].astype(jnp.int32), pos[:, -1:] + 1 + i, cache, T0 + i)
            return i + 1, logits, cache, done | jnp.isin(y, eos), out, key

        def running(carry):
            return (carry[0] < max_tokens) & ~carry[3].all()

        start = (0, logits, cache, jnp.zeros(B, bool), out, key)
        out = jax.lax.while_loop(running, body, start)[4]
        return {name: x.swapaxes(0, 1) for name, x in out.items()}  # [B, M, ...]

    return jax.jit(sample)


def left_pad(prompts, pad_id, multiple=32):
    """Token lists -> tokens, positions [B, T0] left-padded (position -1); T0 rounded up to a power
    of two up to `multiple`, then to a multiple of it: few shapes (compiles), little padding."""
    n = max(map(len, prompts))
    T0 = -(-n // multiple) * multiple if n > multiple else 1 << (n - 1).bit_length()
    tokens = np.full((len(prompts), T0), pad_id, np.int32)
    pos = np.full((len(prompts), T0), -1, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, T0 - len(p) :], pos[b, T0 - len(p) :] = p, np.arange(len(p))
    return tokens, pos


def host(tree):  # numpy copies of (global) arrays: every row, on every process
    return jax.tree.map(lambda x: np.asarray(process_allgather(x, tiled=True)), tree)


def generate(sampler, w, prompts, pad_id, key, data, n):
    """Every prompt, n rows (one program) a call, each call's rows split over the devices (`data`).
    The last call is padded with copies of the first prompt, cut from the result."""
    pad = -len(prompts) % n
    prompt, pos = [np.concatenate([x, np.repeat(x[:1], pad, 0)]) for x in left_pad(prompts, pad_id)]
    outs = []
    for i in range(0, len(prompt), n):
        rows = jax.device_put((prompt[i : i + n], pos[i : i + n]), data)
        outs.append(host(sampler(w, *rows, jax.random.fold_in(key, i))))
    out = {k: np.concatenate([o[k] for o in outs])[: len(prompts)] for k in outs[0]}
    return out | dict(prompt=prompt[: len(prompts)], pos=pos[: len(prompts)])


# -------------------------------------------------------------------------------------------------
# How the policy learns: float32 logits on prompt + completion, score_centering.loss, the FSDP
# layout, optionally LoRA adapters


def completion_logits(cfg, w, prompt, pos, tokens):
    """The trainer's float32 logits [B, M, V] at the positions that predicted the completion tokens
    [B, M]."""
    M = tokens.shape[1]
    seq_pos = jnp.concatenate([pos, pos[:, -1:] + 1 + jnp.arange(M)[None, :]], 1)
    seq = jnp.concatenate([prompt, tokens], 1)
    with jax.default_matmul_precision("highest"):  # a float32 trainer, not TF32 or bf16 passes
        logits = qwen3.forward(cfg, w, seq, seq_pos, last=M + 1)[0]
    return logits[:, :-1] / TEMPERATURE  # the logits at position t predict token t + 1


def advantage(r, group, baseline):  # r [B] -> [B]: minus the mean of its group of G, or raw
    if baseline == "none":
        return r
    return r - r.reshape(-1, group).mean(1).repeat(group)


def lora_init(w, rank, key):  # A ~ N(0, 1/fan-in), B = 0: the merged model starts at the base
    def init(key, x, n_in):  # x [L, in..., out...]
        fan_in = math.prod(x.shape[1 : 1 + n_in])
        a = jax.random.normal(key, (x.shape[0], fan_in, rank)) * fan_in**-0.5
        return dict(a=a, b=jnp.zeros((x.shape[0], rank, x[0].size // fan_in)))

    names = ("q", "k", "v", "o", "gate", "up", "down")  # every attention and MLP projection
    keys = jax.random.split(key, 7)
    return {
        n: init(k, w["layers"][n], len(INPUT_AXES[n])) for n, k in zip(names, keys, strict=True)
    }


def merge(params, base, scale):
    """The policy's weights: base + scale · A B per projection (no base: params are the weights)."""
    if base is None:
        return params
    layers = dict(base["layers"])
    for k, ab in params.items():
        delta = scale * jnp.einsum("lir,lro->lio", ab["a"], ab["b"])
        layers[k] = layers[k] + delta.reshape(layers[k].shape)
    return dict(base, layers=layers)


def shardings(tree, mesh=None):
    """FSDP: each matrix of a weight tree (or of its optimizer state: the same names) split over
    the mesh (default: every device) on its largest axis that the device count divides, never the
    stacked layer axis L that lax.scan slices; vectors and scalars whole on every device. On one
    device this is the replicated layout."""
    mesh = mesh or Mesh(np.array(jax.devices()), ("data",))

    def spec(path, x):
        stacked = any(getattr(k, "key", None) == "layers" for k in path)  # [L, ...]
        if x.ndim - stacked < 2:
            return NamedSharding(mesh, PartitionSpec())
        axes = [i for i in range(stacked, x.ndim) if x.shape[i] % mesh.size == 0]
        if not axes:
            return NamedSharding(mesh, PartitionSpec())
        split = max(axes, key=lambda i: x.shape[i])
        return NamedSharding(mesh, PartitionSpec(*[None] * split, "data"))

    return jax.tree_util.tree_map_with_path(spec, tree)


def make_train_step(cfg, opt, micro_batch, mesh, center, tis_cap=None, mis=None, lora_scale=None):
    """fn(params, opt_state, batch, base=None) -> (params, opt_state, metrics); params are the
    weights, or LoRA adapters on the frozen `base`; batch: the sampler's record plus prompt, pos
    [B, T0] and adv [B]. Gradients accumulate over micro-batches, each split over the mesh's data
    axis, and the loss is the token mean over the whole batch: the numbers of one large batch.
    Weights, gradients and optimizer state stay split as `shardings` says (LoRA: the base; the
    adapters and their state whole on every device)."""
    rows = NamedSharding(mesh, PartitionSpec(None, "data"))

    options = dict(center=center, tis_cap=tis_cap, mis=mis)  # all that --center changes: a keyword

    def token_sum_loss(params, base, b):
        w = merge(params, base, lora_scale)
        logits = completion_logits(cfg, w, b["prompt"], b["pos"], b["tokens"])
        head = b.get("head_ids"), b["head_logq"]  # the sampler's top-k ids (topk 0: none) and log q
        loss, metrics = sc.loss(
            logits, b["tokens"], b["mask"], b["adv"], b["logq"], *head, **options
        )
        return loss * b["mask"].sum(), (metrics, b["mask"].sum())  # token sums: divided by N below

    def micro_batches(x):  # [B, ...] -> [B / mb, mb, ...]
        x = x.reshape(micro_batch, -1, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, rows)

    def step(params, opt_state, batch, base=None):
        def keep(tree):  # FSDP shards (LoRA adapters: whole), outputs as inputs came: one compile
            where = shardings(tree, mesh) if base is None else NamedSharding(mesh, PartitionSpec())
            return jax.lax.with_sharding_constraint(tree, where)

        def accumulate(grads, b):
            loss_grad = jax.value_and_grad(token_sum_loss, has_aux=True)
            (loss, (metrics, n)), g = loss_grad(params, base, b)
            return keep(jax.tree.map(jnp.add, grads, g)), (loss, metrics, n)

        zeros = keep(jax.tree.map(jnp.zeros_like, params))
        parts = jax.tree.map(micro_batches, batch)
        grads, (loss, metrics, n) = jax.lax.scan(accumulate, zeros, parts)
        N = jnp.maximum(n.sum(), 1)
        grads = jax.tree.map(lambda g: g / N, grads)
        updates, new_state = opt.update(grads, opt_state, params)
        new = optax.apply_updates(params, updates)
        metrics = {k: (v * n).sum() / N for k, v in metrics.items()}
        metrics |= dict(loss=loss.sum() / N, grad_norm=optax.tree.norm(grads))
        # a loss, gradient or weight that is not finite: the update is skipped, the run told
        leaves = jax.tree.leaves((metrics["loss"], grads, new))
        finite = jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))
        new, new_state = jax.tree.map(
            partial(jnp.where, finite), (new, new_state), (params, opt_state)
        )
        return *keep((new, new_state)), metrics | dict(finite=finite)

    return jax.jit(step, donate_argnums=(0, 1))


# -------------------------------------------------------------------------------------------------
# One GRPO run: greedy evaluation and the drift meter, rollouts, the train step, a resumable state


def token_logp(cfg, w, b):  # the trainer's log p [B, M] of the completion tokens of b
    logp = jax.nn.log_softmax(completion_logits(cfg, w, b["prompt"], b["pos"], b["tokens"]))
    return jnp.take_along_axis(logp, b["tokens"][..., None], -1)[..., 0]


def drift_meter(logp, probe, w0, micro_batch, data):
    """fn(w) -> the token mean of log p_0(y) - log p_w(y) over the probe completions: an estimate of
    KL(p_0 || p_w). logp: jitted token_logp; micro_batch rows a call, split over the devices."""
    n, pad = len(probe["mask"]), -len(probe["mask"]) % micro_batch  # the last call's rows: copies
    probe = {k: np.concatenate([x, np.repeat(x[:1], pad, 0)]) for k, x in probe.items()}

    def probe_logp(w):  # [B, M]
        calls = []
        for i in range(0, n + pad, micro_batch):
            rows = {k: x[i : i + micro_batch] for k, x in probe.items()}
            calls.append(host(logp(w, jax.device_put(rows, data))))
        return np.concatenate(calls)[:n]

    logp0, mask = probe_logp(w0), probe["mask"][:n]

    def drift(w):
        return float(((logp0 - probe_logp(w)) * mask).sum() / max(mask.sum(), 1))

    return drift


def build(args, cfg, eos):
    """The jitted functions, compiled once and shared by every run of a --compare."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    opt = getattr(optax, args.optimizer)(args.lr)  # sgd, adam or adamw (optax's decay: 1e-4)
    scale = args.lora and args.lora_alpha / args.lora
    loss_flags = dict(tis_cap=args.tis_cap, mis=args.mis, lora_scale=scale)
    steps = {
        center: make_train_step(cfg, opt, args.micro_batch, mesh, center, **loss_flags)
        for center in (False, True)
    }

    @functools.cache
    def samplers(kind):  # the rollouts' sampler for each kind of numerics, compiled once
        mm, kv = quant_mm(kind), kv_quant(args.kv_quant)
        return make_sampler(cfg, args.max_tokens, args.topk, eos, mm, kv=kv)

    return dict(
        mesh=mesh,
        opt=opt,
        scale=scale,
        steps=steps,
        sampler=samplers(args.sampler),
        samplers=samplers,
        logp=jax.jit(partial(token_logp, cfg)),
        merge=jax.jit(merge, static_argnums=2) if args.lora else merge,  # each device its part
        evaluator=make_sampler(cfg, args.max_tokens, 1, eos, greedy=True),
        prober=make_sampler(cfg, args.max_tokens, 1, eos),
    )


def run(args, task, fn, center, seed, out, prefix=""):
    """One GRPO run into `out` (resumed from its state when there is one); returns its summary.
    prefix: on each line it prints."""
    if harness.finished(out):  # a --resume of a finished run
        return harness.finished(out)
    n, opt, scale = args.prompts * args.group, fn["opt"], fn["scale"]
    data = NamedSharding(fn["mesh"], PartitionSpec("data"))  # rows split over the devices
    replicated = NamedSharding(fn["mesh"], PartitionSpec())
    key, noise_key, probe_key, lora_key = jax.random.split(jax.random.PRNGKey(seed), 4)
    # FSDP-split weights (LoRA: the frozen base), copied: the step donates them, device_put may not
    w = jax.tree.map(jnp.copy, jax.device_put(task.weights, shardings(task.weights, fn["mesh"])))
    params, base = w, None
    if args.lora:
        params, base = jax.device_put(lora_init(w, args.lora, lora_key), replicated), w
    where = replicated if args.lora else shardings(jax.eval_shape(opt.init, params), fn["mesh"])
    opt_state = jax.jit(opt.init, out_shardings=where)(params)  # no device holds all of Adam's

    def copy(w, kind, sigma=0.0, key=None):  # the sampler's: whole on every device, once a refresh
        return jax.device_put(sampler_weights(w, kind, sigma, key), replicated)

    # the drift meter: probe completions drawn once from the initial policy (bf16, temperature 1)
    w0 = fn["merge"](params, base, scale)
    probe = generate(fn["prober"], copy(w0, "bf16"), task.probe, task.pad, probe_key, data, n)
    probe = {k: probe[k] for k in ("prompt", "pos", "tokens", "mask")}
    drift = drift_meter(fn["logp"], probe, w0, args.micro_batch, data)
    stale = copy(w0, "bf16") if args.staleness else None  # the template of the sampler's copy
    hist = dict(step=0, acc={}, drift={}, kl_q_p=[], reward=[])
    hist, (params, opt_state, w_sampler) = harness.resume(out, hist, params, opt_state, stale)
    order = np.random.default_rng(seed).permutation(len(task.train))
    columns = [c for c in harness.COLUMNS if c != "acc" or task.test]

    def measure(row, w):  # the drift, and the mean reward of greedy test completions (clean bf16)
        hist["drift"][str(row["step"])] = row["drift"] = drift(w)
        if task.test:
            test, golds = [p for p, _ in task.test], [gold for _, gold in task.test]
            out = generate(fn["evaluator"], copy(w, "bf16"), test, task.pad, key, data, n)
            acc = float(np.mean(task.reward(out["tokens"], out["mask"], golds)))
            hist["acc"][str(row["step"])] = row["acc"] = acc

    last = args.steps  # sooner if an update is not finite: the run stops at its step
    for step in range(hist["step"], args.steps + 1):
        harness.at_step(step, out, args.out, hist["step"])
        row, w = {"step": step}, fn["merge"](params, base, scale)
        refresh = step % (args.staleness + 1) == 0
        w_sampler = None if refresh else w_sampler  # dropped before the new copy: one at a time
        if step % args.eval_every == 0 or step == args.steps:
            measure(row, w)
        if step < args.steps:
            t0 = time.perf_counter()
            if refresh:
                w_sampler = copy(w, args.sampler, args.weight_noise, noise_key)
            first = step * args.prompts
            problems = [task.train[order[(first + i // args.group) % len(order)]] for i in range(n)]
            step_key = jax.random.fold_in(key, step)
            prompts, golds = [p for p, _ in problems], [gold for _, gold in problems]
            batch = generate(fn["sampler"], w_sampler, prompts, task.pad, step_key, data, n)
            r = np.asarray(task.reward(batch["tokens"], batch["mask"], golds))
            t1 = time.perf_counter()
            batch["adv"] = advantage(r.astype(np.float32), args.group, args.baseline)
            on_devices = jax.device_put(batch, data)
            params, opt_state, m = fn["steps"][center](params, opt_state, on_devices, base)
            finite = bool(m.pop("finite"))
            row |= {k: float(v) for k, v in m.items()}
            t2 = time.perf_counter()
            row |= dict(reward=float(r.mean()), length=float(batch["mask"].sum(1).mean()))
            row |= dict(sample_seconds=t1 - t0, train_seconds=t2 - t1, seconds=t2 - t0)
            if finite:
                hist["kl_q_p"].append(row["kl_q_p"])
                hist["reward"].append(row["reward"])
            else:  # the update was skipped: the weights stay this step's, and the run stops
                last = hist["diverged_at_step"] = step
                if "drift" not in row:
                    measure(row, fn["merge"](params, base, scale))
        harness.log_step(row, args.steps, columns, out, prefix)
        if step == last:
            break
        if out and args.save_every and (step + 1) % args.save_every == 0:
            hist["step"] = step + 1
            trees = host((params, opt_state, w_sampler if args.staleness else None))
            harness.save_state(os.path.join(out, "state.npz"), hist, *trees)
    if args.save:
        weights = host(fn["merge"](params, base, scale))  # every process takes part
        if not jax.process_index():  # process 0 writes
            hf_checkpoint.save(args.save, task.cfg, weights, task.path)
    return harness.finish(out, hist, last, args.lr, prefix)


# -------------------------------------------------------------------------------------------------
# --compare: centring off, then on, from the same seed, weights, data, noise and keys; --plan; main


def compare(args, task):
    """Centring off, then on, for each seed; with --sweep, at each level of mismatch. --workers runs
    at once, threads that share the compiled programs: the numbers of one run after another."""
    fn, seeds = build(args, task.cfg, task.eos), args.seeds or [args.seed]
    start = time.perf_counter()  # the sweep's wall-clock time, compiling included
    tasks = dict.fromkeys(seeds, task)
    if args.task == "sequence":  # its model comes from the seed (GSM8K's does not)
        tasks = {seed: sequence_task(seed, args.eval_n, args.probe_n) for seed in seeds}
    results, pool = {}, concurrent.futures.ThreadPoolExecutor(args.workers)
    for sampler, noise in args.sweep or [(args.sampler, args.weight_noise)]:
        level = sampler + (f"_noise{noise:g}" if noise else "")
        level_args = argparse.Namespace(**vars(args) | dict(sampler=sampler, weight_noise=noise))
        level_fn = fn | dict(sampler=fn["samplers"](sampler))
        res = results[level] = {}
        for seed in seeds:
            for center in (False, True):
                name = "centered" if center else "uncentered"
                name += f"_seed{seed}" if len(seeds) > 1 else ""
                out = args.out and os.path.join(args.out, level if args.sweep else "", name)
                prefix = f"{level} {name}: " if args.sweep else f"{name}: "
                job = (level_args, tasks[seed], level_fn, center, seed, out, prefix)
                res[name] = pool.submit(run, *job)
    pool.shutdown()  # waits for every run
    results = {level: {k: job.result() for k, job in res.items()} for level, res in results.items()}
    if args.sweep:
        return sweep.report(args, results, time.perf_counter() - start)
    return harness.report(args, task.cfg, results[level])


def plan(args, cfg, T0=256):  # T0: the prompt tokens planned for (GSM8K's chat prompts: 100 to 250)
    """--plan: the sampler and the train step compiled on shapes and shardings alone; MiB per
    device."""
    fn, (top, layers), L = build(args, cfg, (0,)), qwen3.layout(cfg), cfg["num_hidden_layers"]
    mesh, B, M, key = fn["mesh"], args.prompts * args.group, args.max_tokens, jax.random.PRNGKey(0)

    def placed(tree, where):  # abstract arrays: the shapes and dtypes of tree, on `where` shardings
        return jax.tree.map(lambda x, s: x.update(sharding=s), tree, where)

    def everywhere(spec, tree):
        return jax.tree.map(lambda _: NamedSharding(mesh, spec), tree)

    def size(tree):  # bytes per device
        leaves = jax.tree.leaves(tree)
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)

    def trained(tree):  # FSDP shards; LoRA: the adapters and their state whole on every device
        return everywhere(PartitionSpec(), tree) if args.lora else shardings(tree, mesh)

    w = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, (_, _, s) in top.items()}
    w["layers"] = {k: jax.ShapeDtypeStruct((L, *s), jnp.float32) for k, (_, _, s) in layers.items()}
    w16 = jax.tree.map(lambda x: x.update(dtype=jnp.bfloat16), w)
    w16 = placed(w16, everywhere(PartitionSpec(), w16))  # the sampler's copy
    w = placed(w, shardings(w, mesh))
    params = jax.eval_shape(partial(lora_init, rank=args.lora), w, key=key) if args.lora else w
    state = jax.eval_shape(fn["opt"].init, params)
    params, state = placed(params, trained(params)), placed(state, trained(state))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    prompt = jax.ShapeDtypeStruct((B, T0), jnp.int32, sharding=rows)  # and pos
    batch = jax.eval_shape(fn["sampler"], w16, prompt, prompt, key)
    batch |= dict(prompt=prompt, pos=prompt, adv=jax.ShapeDtypeStruct((B,), jnp.float32))
    batch = placed(batch, everywhere(PartitionSpec("data"), batch))
    s = fn["sampler"].lower(w16, prompt, prompt, key).compile().memory_analysis()
    step = fn["steps"][args.center]
    t = step.lower(params, state, batch, w if args.lora else None).compile().memory_analysis()
    kv = 2 * L * B // mesh.size * (T0 + M) * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    rows = {  # kv: K and V in bf16
        "weights": size(w),
        "adapters": size(params) * bool(args.lora),
        "gradients": size(params),
        "optimizer state": size(state),
        "sampler weights": size(w16),
        "kv cache": kv,
        "sampler temporaries": s.temp_size_in_bytes,
        "train step arguments": t.argument_size_in_bytes,
        "train step temporaries": t.temp_size_in_bytes,
    }  # the peaks add what is resident meanwhile
    sampling = s.argument_size_in_bytes + s.output_size_in_bytes + s.temp_size_in_bytes
    stepping = t.argument_size_in_bytes + t.output_size_in_bytes - t.alias_size_in_bytes
    resident = rows["weights"] + rows["adapters"] + rows["optimizer state"]
    rows["peak while sampling"] = resident + sampling
    rows["peak in the train step"] = rows["sampler weights"] + stepping + t.temp_size_in_bytes
    lora = f", LoRA {args.lora}" if args.lora else ""
    shape = f"{B} rollouts x ({T0} + {M} tokens), micro-batch {args.micro_batch}"
    print(f"--plan: {L}-layer Qwen3, {shape}, {args.optimizer}{lora}, {mesh.size} devices")
    harness.table(
        "per device", {k: dict(MiB=v / 2**20) for k, v in rows.items()}, dict(MiB="{:10,.1f}")
    )
    return rows


def parse_args(argv=None):
    return harness.parse_args(argv, RECIPE, __doc__.split("\n\n")[0].replace("\n", " "))


def main(argv=None):
    args = parse_args(argv)
    harness.start(args)

    def work():
        if args.task == "bandit":
            return bandit.run(args)
        try:
            if args.plan:
                cfg = hf_checkpoint.config(args.model)[0] if args.task == "gsm8k" else SEQUENCE
                return plan(args, dict(cfg))
            if args.task == "gsm8k":
                task = gsm8k_task(args.model, args.data_dir, args.eval_n, args.probe_n, shardings)
            else:
                task = sequence_task(args.seed, args.eval_n, args.probe_n)
            name = args.model if args.task == "gsm8k" else "the sequence task"
            harness.check_against_model(task.cfg, name, args.topk, args.max_tokens)
        except (ValueError, OSError) as e:  # bad data or checkpoint: one line, no traceback
            raise SystemExit(f"error: {e}") from None
        if args.compare:
            return compare(args, task)
        fn = build(args, task.cfg, task.eos)
        return run(args, task, fn, args.center, args.seed, args.out)

    return harness.interruptible(work)


if __name__ == "__main__":
    main()
