"""Sampling helpers: a token drawn from q by inverse CDF; a compiled sampler run over many prompts
(left-padded, cut into calls of n rows, each call's rows split over the devices, gathered from
every process as numpy arrays), its calls remembered by their inputs' bytes; the drift meter on
fixed completions.
B rows, T0 prompt length, M completion length, V vocabulary."""

import hashlib
import threading

import jax
import jax.numpy as jnp
import numpy as np

from lab.devices import host


def categorical(key, logq, block=128):
    """y ~ q [B, V] by inverse CDF, a block of ids then an id in it: two uniforms a row, not V
    Gumbels."""
    B, V = logq.shape
    q = jnp.pad(jnp.exp(logq), ((0, 0), (0, -V % block)))
    q = q.reshape(B, -1, block)  # [B, V/block, block]

    def pick(key, w):  # i with probability w_i / Σ w; rounding never reaches past the last w_i > 0
        c = jnp.cumsum(w, -1)
        i = (c <= jax.random.uniform(key, (B, 1)) * c[:, -1:]).sum(-1)
        return jnp.minimum(i, w.shape[-1] - 1 - jnp.argmax(w[:, ::-1] > 0, -1))

    k_block, k_id = jax.random.split(key)
    i = pick(k_block, q.sum(-1))
    return i * block + pick(k_id, jnp.take_along_axis(q, i[:, None, None], 1)[:, 0])


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


def generate(sampler, w, prompts, pad_id, key, data, n, say=None):
    """Every prompt through sampler(w, prompt, pos, key), n rows (one program) a call, each call's
    rows split over the devices (`data`). The last call is padded with copies of the first prompt,
    cut from the result. Returns the sampler's record [B, M, ...] with prompt and pos [B, T0], M
    the longest completion rounded up to a multiple of 32 (at most the sampler's).
    say(text): told the prompts done after each call, when there are several. key None: a sampler
    that draws nothing (greedy), given one fixed key."""
    key = jax.random.PRNGKey(0) if key is None else key
    pad = -len(prompts) % n
    prompt, pos = [np.concatenate([x, np.repeat(x[:1], pad, 0)]) for x in left_pad(prompts, pad_id)]
    outs = []
    for i in range(0, len(prompt), n):
        rows = jax.device_put((prompt[i : i + n], pos[i : i + n]), data)
        outs.append(host(sampler(w, *rows, jax.random.fold_in(key, i))))
        if say and len(prompt) > n:
            say(f"  {min(i + n, len(prompts))} of {len(prompts)} prompts")
    out = {k: np.concatenate([o[k] for o in outs])[: len(prompts)] for k in outs[0]}
    # cut after the longest completion, rounded up to a multiple of 32 (few shapes, few compiles):
    # what is cut is masked, so the trainer and the drift meter compute the same on fewer tokens
    M = max(-(-out["mask"].sum(1).max() // 32) * 32, 32)
    out = {k: x[:, :M] for k, x in out.items()}
    return out | dict(prompt=prompt[: len(prompts)], pos=pos[: len(prompts)])


def remembered(fn):
    """fn(*arrays), each call's result kept by the bytes of its inputs (pytrees of arrays, raw
    keys): the held-out score of weights equal to a bit, as at step 0 of every arm of a --compare
    (LoRA's adapters start at 0), is computed once, also by runs at once in threads: one call at a
    time. Results are kept as numpy, on the host: a few MB an evaluation. Every process hashes the
    same gathered bytes."""
    seen, one_at_a_time = {}, threading.Lock()

    def call(*inputs):
        digest = hashlib.blake2b()
        for x in jax.tree.leaves(host(inputs)):
            digest.update(str((x.dtype, x.shape)).encode() + np.ascontiguousarray(x).tobytes())
        with one_at_a_time:
            if (key := digest.hexdigest()) not in seen:
                seen[key] = host(fn(*inputs))
            return seen[key]

    return call


def drift_meter(logp, probe, w0, micro_batch, data):
    """fn(w) -> the token mean of log p_0(y) - log p_w(y) over the probe's completions (generate's
    record), an estimate of KL(p_0 || p_w). logp(w, rows) -> [B, M]: the trainer's log p of the
    completion tokens; micro_batch rows a call, split over the devices."""
    n, pad = len(probe["mask"]), -len(probe["mask"]) % micro_batch  # the last call's rows: copies
    keep = ("prompt", "pos", "tokens", "mask")
    probe = {k: np.concatenate([probe[k], np.repeat(probe[k][:1], pad, 0)]) for k in keep}

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
