"""Drop-ins for train.py's sampler and trainer logits that compute a group's prompt once: the G
rollouts of a prompt share one prefill (sampler) or one prompt pass (trainer), its cache copied to
their rows. The same numbers as train.make_sampler and train.completion_logits up to the order of
float32 sums (tests/test_grouped.py), and a token drawn by inverse CDF (rollouts.categorical), the
same distribution as jax.random.categorical's draw; the sampler compiled to make every bf16
rounding it writes (ROUNDING), whatever the devices. The drift meter's log p is here too.
B rows, T0 prompt length, M completion length, V vocabulary, k the head's size, G the group."""

from collections import namedtuple
from functools import partial

import jax
import jax.numpy as jnp

from lab import rollouts
from lab.models import model

TEMPERATURE = 1.0  # train.py's (the tests hold the two equal through their logits and records)
# every bf16 rounding the code writes, none skipped: by default XLA may keep a bf16 value in float32
# where its fusions allow, and a program split over devices fuses otherwise than one device's, so
# the same rows decoded other tokens on 4 devices than on 1 (tests/test_sampler.py, *_alike)
ROUNDING = dict(xla_allow_excess_precision=False)

# the decode loop's state: step i, the logits predicting token i, KV cache, rows ended, record, key
Decoding = namedtuple("Decoding", "i logits cache done out key")


def make_sampler(cfg, max_tokens, topk, eos_ids, numerics=None, greedy=False, group=1):
    """train.make_sampler, whose rows come in runs of `group` copies of one prompt, each run
    prefilled once and its cache repeated to its rows."""
    numerics = dict(dtype=jnp.bfloat16) | (numerics or {})
    fwd, eos = partial(model(cfg).forward, cfg, **numerics), jnp.array(eos_ids)

    def sample(w, prompt, pos, key):
        B, T0 = prompt.shape
        M, k = max_tokens, topk or cfg["vocab_size"]

        # prefill: each run's prompt into the KV cache once, then copied to its rows; last=1: the
        # last position's logits alone, [B / group, 1, V], which predict token 0
        cache = model(cfg).init_kv(cfg, B // group, T0 + M, numerics["dtype"])
        logits, cache = fwd(w, prompt[::group], pos[::group], cache, 0, last=1)

        # each cache entry holds its rows on axis 1, after a layer axis; pos [B, S] on axis 0
        cache = {name: jnp.repeat(x, group, 0 if name == "pos" else 1) for name, x in cache.items()}
        logits = jnp.repeat(logits, group, 0)  # [B, 1, V]

        # decode: a token a step, drawn from q and recorded with log q and the head of q
        def body(state):
            i, logits, cache, done, out, key = state  # a Decoding
            key, k_sample = jax.random.split(key)
            logq = jax.nn.log_softmax(logits[:, -1] / TEMPERATURE)  # [B, V]
            y = jnp.argmax(logq, -1) if greedy else rollouts.categorical(k_sample, logq)  # [B]
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

    return jax.jit(sample, compiler_options=ROUNDING)


def completion_logits(cfg, w, prompt, pos, tokens, mm=jnp.einsum, group=1):
    """train.completion_logits, whose rows come in runs of `group` copies of a prompt (unchecked):
    a run's first row runs once, as the sampler's prefill (taken by a reshape: [::group] hung XLA's
    CPU collectives), its cache (K, V; Qwen3.5 conv window, state) repeated to its rows, repeat's
    backward summing gradients; then the completions' pass over that cache. mm: LoRA's matmul."""
    (B, T0), M = prompt.shape, tokens.shape[1]
    fwd = partial(model(cfg).forward, cfg, w, mm=mm)
    with jax.default_matmul_precision("highest"):  # a float32 trainer, not TF32 or bf16 passes
        cache = model(cfg).init_kv(cfg, B // group, T0 + M)
        runs = [x.reshape(B // group, group, T0)[:, 0] for x in (prompt, pos)]  # a run's first row
        first, cache = fwd(*runs, cache, 0, last=1)  # predicts token 0
        cache = {name: jnp.repeat(x, group, 0 if name == "pos" else 1) for name, x in cache.items()}
        rest, _ = fwd(tokens, pos[:, -1:] + 1 + jnp.arange(M)[None, :], cache, T0)
    # cache slot T0 - 1 + t predicts token t: `first` for t = 0, then rest[:, t - 1] (not its last)
    return jnp.concatenate([jnp.repeat(first, group, 0), rest[:, :-1]], 1) / TEMPERATURE


def token_logp(cfg, w, b):  # the trainer's log p [B, M] of the completion tokens of b
    logp = jax.nn.log_softmax(completion_logits(cfg, w, b["prompt"], b["pos"], b["tokens"]))
    return jnp.take_along_axis(logp, b["tokens"][..., None], -1)[..., 0]
