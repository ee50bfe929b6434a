"""'GRPO' on GSM8K or a CPU task, with a sampler of other numerics than the trainer's.

    python train.py --center                       # Qwen3-0.6B on GSM8K, score-centred
    python train.py --compare --out runs/gsm8k     # centring off, then on: same seed and noise
    python train.py --task sequence --compare      # what drift costs, on a CPU: 1 to 3 min
    python train.py --task chain --compare         # GSM8K's shape: one reward after a long answer

What it is: REINFORCE with a group-mean baseline, whose rollouts come from a copy of the policy that
runs with other numerics (bf16 / int8 / fp8 weights, int8 / int4 / fp8 KV cache, fixed weight noise,
staleness), trained with `score_centering.loss`. How it differs from textbook GRPO, and why:
- no KL penalty to a reference model: it would pull toward the start and hide the drift under study;
- no PPO clipping unless --correction asks: one step a batch, so only the sampler is off-policy;
- a token mean over the whole batch, not a mean of per-sequence means (score_centering.py, step 8);
- advantages are rewards minus the group mean, not divided by the group's std (the paper's recipe);
- plain SGD at a constant learning rate on float32 master weights (the paper's; Adam: --optimizer).

In order: the sampler and its mismatch, the train step, the GRPO loop. This file is the reference,
the simplest code that computes what the runs compute; lab/run.py runs it with drop-ins tested equal
to it (a group's prompt computed once; micro-batches, FSDP, LoRA, a non-finite guard) and the flags,
data, logs and resume. Shapes: P prompts a step, G rollouts a prompt, B = P·G rows, T0 prompt
length, M completion length, V vocabulary, k the top-k head size, K key/value heads, H head size.
"""

import sys
from collections import namedtuple
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

import score_centering as sc
from lab import run
from lab.models import INPUT_AXES, model  # each weight's contracted axes; model(cfg): its file

TEMPERATURE = 1.0  # q's and p's (completion_logits divides by it too); log q recorded after it
# the sampler's compute dtype (int8, fp8: bf16 holding fake-quantised values); float32: trainer's
SAMPLER_DTYPES = dict(float32=jnp.float32, bf16=jnp.bfloat16, int8=jnp.bfloat16, fp8=jnp.bfloat16)

# -------------------------------------------------------------------------------------------------
# The sampler: a copy of the weights in its own numerics; KV-cache decoding that records q

QMAX = dict(int8=127.0, int4=7.0, fp8=448.0)  # the symmetric range's top: a scale maps |x| here


def fake_quant(x, axes, kind):  # symmetric, one scale per slice reduced over `axes`
    x32, qmax = x.astype(jnp.float32), QMAX[kind]
    scale = jnp.maximum(jnp.abs(x32).max(axes, keepdims=True), 1e-12) / qmax
    levels = x32 / scale  # in the format's range, then rounded to a value it holds
    levels = levels.astype(jnp.float8_e4m3fn) if kind == "fp8" else jnp.round(levels)
    return (levels.astype(jnp.float32) * scale).astype(x.dtype)


def kv_quant(kind):
    """fn(keys or values [B, T, K, H]) -> them as a quantised cache holds them (int8, int4: a scale
    per token and head; fp8: e4m3 at unit scale, saturating); None: a plain cache."""

    def fp8(a):
        return jnp.clip(a.astype(jnp.float32), -448, 448).astype(jnp.float8_e4m3fn).astype(a.dtype)

    per_head = {k: partial(fake_quant, axes=(3,), kind=k) for k in ("int8", "int4")}
    return dict(per_head, fp8=fp8).get(kind)


@partial(jax.jit, static_argnums=(1, 2))
def sampler_weights(w, kind, sigma=0.0, key=None):
    """w ⊙ (1 + σε) in the kind's SAMPLER_DTYPES, ε a standard normal draw from `key` (one key per
    weight): the same at each refresh, a persistent bias; kind int8 or fp8 fake-quantises every
    matmul weight per output channel, the embedding and the output head included (W8A8's W8)."""
    if sigma:
        leaves, tree = jax.tree.flatten(w)
        keys = tree.unflatten(list(jax.random.split(key, len(leaves))))  # a key a weight
        w = jax.tree.map(lambda x, key: x * (1 + sigma * jax.random.normal(key, x.shape)), w, keys)

    def quant(path, x):  # a weight at the top or in a stack of layers, by its name
        name = path[-1].key
        return fake_quant(x, INPUT_AXES[name], kind) if name in INPUT_AXES else x

    if kind in QMAX:
        w = jax.tree_util.tree_map_with_path(quant, w)
    return jax.tree.map(lambda x: x.astype(SAMPLER_DTYPES[kind]), w)


def quant_mm(kind):  # W8A8: the activation is fake-quantised per token (over the contracted axes)
    def mm(spec, x, w):  # spec "btd,dnh->btnh": x's letters, w's, then the output's
        x_axes, out = spec.split(",")[0], spec.split("->")[1]
        # the axes of x the einsum sums over (here d): one scale per (b, t), i.e. per token
        per_token = tuple(i for i, c in enumerate(x_axes) if c not in out)
        return jnp.einsum(spec, fake_quant(x, per_token, kind), w)

    return mm if kind in QMAX else jnp.einsum


# the decode loop's state: step i, the logits predicting token i, KV cache, rows ended, record, key
Decoding = namedtuple("Decoding", "i logits cache done out key")


def make_sampler(cfg, max_tokens, topk, eos_ids, numerics=None, greedy=False):
    """fn(weights, prompt [B, T0], pos [B, T0], key) -> dict of tokens, logq, mask [B, M] and the
    head: head_ids, head_logq [B, M, k], log q after temperature over all V (topk 0: the full log q
    [B, M, V], no ids), decoded until every row has ended its turn, or M. numerics: forward's mm
    (quant_mm), dtype (SAMPLER_DTYPES), kv_quant, Qwen3.5's state_dtype (lab/models.py's)."""
    numerics = dict(dtype=SAMPLER_DTYPES["bf16"]) | (numerics or {})
    fwd, eos = partial(model(cfg).forward, cfg, **numerics), jnp.array(eos_ids)

    def sample(w, prompt, pos, key):
        B, T0 = prompt.shape
        M, k = max_tokens, topk or cfg["vocab_size"]

        # prefill: the prompts into the KV cache; last=1: the last position's logits [B, 1, V]
        cache = model(cfg).init_kv(cfg, B, T0 + M, numerics["dtype"])
        logits, cache = fwd(w, prompt, pos, cache, 0, last=1)  # they predict token 0

        # decode: a token a step, drawn from q and recorded with log q and the head of q
        def body(state):
            i, logits, cache, done, out, key = state  # a Decoding
            key, k_sample = jax.random.split(key)
            logq = jax.nn.log_softmax(logits[:, -1] / TEMPERATURE)  # [B, V]
            y = jnp.argmax(logq, -1) if greedy else jax.random.categorical(k_sample, logq)  # [B]
            logq_y = jnp.take_along_axis(logq, y[:, None], -1)[:, 0]
            rec = dict(tokens=y, logq=logq_y, mask=~done, head_logq=logq)  # mask: EOS included
            if topk:
                rec["head_logq"], rec["head_ids"] = jax.lax.top_k(logq, topk)
            out = {name: x.at[i].set(rec[name]) for name, x in out.items()}
            # token i at the position one past the prompt's last + i, in cache slot T0 + i
            logits, cache = fwd(w, y[:, None].astype(jnp.int32), pos[:, -1:] + 1 + i, cache, T0 + i)
            return Decoding(i + 1, logits, cache, done | jnp.isin(y, eos), out, key)

        def running(state):  # until M tokens, or every row has ended its turn
            return (state.i < M) & ~state.done.all()

        out = dict(  # [M, B, ...]: each step writes one contiguous slab
            tokens=jnp.zeros((M, B), jnp.int32),
            logq=jnp.zeros((M, B)),
            mask=jnp.zeros((M, B), bool),
            head_logq=jnp.zeros((M, B, k)),
        )
        if topk:
            out["head_ids"] = jnp.zeros((M, B, k), jnp.int32)
        start = Decoding(0, logits, cache, jnp.zeros(B, bool), out, key)
        out = jax.lax.while_loop(running, body, start).out
        return {name: x.swapaxes(0, 1) for name, x in out.items()}  # [B, M, ...]

    return jax.jit(sample)


# -------------------------------------------------------------------------------------------------
# The train step: float32 logits over prompt + completion, score_centering.loss, one update
def completion_logits(cfg, w, prompt, pos, tokens):
    """The trainer's float32 logits [B, M, V] at the positions that predict tokens [B, M]: one pass
    over prompt + completion, in which position T0 − 1 + t predicts token t."""
    T0, M = prompt.shape[1], tokens.shape[1]
    seq = jnp.concatenate([prompt, tokens], 1)  # [B, T0 + M]
    seq_pos = jnp.concatenate([pos, pos[:, -1:] + 1 + jnp.arange(M)[None, :]], 1)
    with jax.default_matmul_precision("highest"):  # a float32 trainer, not TF32 or bf16 passes
        logits, _ = model(cfg).forward(cfg, w, seq, seq_pos)
    return logits[:, T0 - 1 : -1] / TEMPERATURE


def advantage(rewards, group, baseline):  # [..., B] -> [..., B]: minus its group's mean, or raw
    if baseline == "none":
        return rewards
    means = rewards.reshape(*rewards.shape[:-1], -1, group).mean(-1)  # [..., P]
    return rewards - means.repeat(group, -1)


def make_train_step(cfg, opt, center, correction=None):
    """fn(w, opt_state, batch) -> (w, opt_state, metrics): one optimizer update on the batch, the
    sampler's record with its prompt, pos [B, T0] and adv [B]; the loss a token mean over it."""

    def loss(w, b):
        logits = completion_logits(cfg, w, b["prompt"], b["pos"], b["tokens"])
        head = b["head_logq"], b.get("head_ids")  # the sampler's top-k log q and ids (topk 0: none)
        args = logits, b["tokens"], b["mask"], b["adv"], b["logq"], *head
        return sc.loss(*args, center=center, correction=correction)  # all that --center changes

    def step(w, opt_state, batch):
        (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(w, batch)
        updates, opt_state = opt.update(grads, opt_state, w)
        metrics |= dict(loss=value, grad_norm=optax.tree.norm(grads))
        return optax.apply_updates(w, updates), opt_state, metrics

    return jax.jit(step)


# -------------------------------------------------------------------------------------------------
# The GRPO loop: sample, score, advantages, step, measure
def grpo(
    state,
    *,
    start,
    steps,
    staleness,
    eval_every,
    group,
    baseline,
    refresh,
    sample,
    reward,
    train_step,
    evaluate,
    record,
):
    """'GRPO': updates at steps start..steps - 1, `steps` only evaluated; state: the params, their
    optimizer state and the sampler's copy (None: made first). refresh(params) -> the copy;
    sample(w_sampler, step) -> the batch (the sampler's record, prompt, pos) and golds;
    reward(tokens, mask, golds) -> [B]; train_step(params, opt_state, batch) -> (params, opt_state,
    metrics); evaluate(params) -> {drift, acc}; record(row, params, opt_state, copy) ->
    whether the run goes on (lab/run.py's logs, saves, stops after an update not finite)."""
    params, opt_state, w_sampler = state
    for step in range(start, steps + 1):
        row = dict(step=step)
        if step % (staleness + 1) == 0:  # a refresh is due: the old copy goes, its memory freed
            w_sampler = None

        # evaluate: drift from p_0 and the held-out score, every eval_every steps and at the end
        if step % eval_every == 0 or step == steps:
            row |= evaluate(params)
        if step == steps:
            record(row, params, opt_state, w_sampler)
            break

        # sample: G completions of each of the step's P prompts, with log q and its top-k head
        if w_sampler is None:
            w_sampler = refresh(params)
        rollout, golds = sample(w_sampler, step)

        # score, and advantages: each reward minus its group's mean (--baseline none: the reward)
        rewards = np.asarray(reward(rollout["tokens"], rollout["mask"], golds))
        rollout["adv"] = advantage(rewards.astype(np.float32), group, baseline)

        # step: score_centering.loss, its token mean over the batch, one optimizer update
        params, opt_state, metrics = train_step(params, opt_state, rollout)

        # measure
        row |= metrics | dict(reward=rewards.mean(), length=rollout["mask"].sum(-1).mean())
        if not record(row, params, opt_state, w_sampler):
            break
    return params, opt_state


# -------------------------------------------------------------------------------------------------
def main(argv=None):  # the flags, then one run, --compare or --plan, with lab/'s drop-ins
    return run.main(argv, sys.modules[__name__])


if __name__ == "__main__":
    main()
