"""Qwen3 (dense) in pure JAX, the model only: a dict of weights and pure functions; the checkpoint's
weight names are in lab/models.py. Llama is Qwen3 without QK-norm: its checkpoints have no q_norm
and k_norm weights, and forward skips them.
B batch rows, T query length, S key/KV-cache length, D model width, F MLP hidden, H head dimension,
N query heads, K key/value heads, R query heads per key/value head (N = K·R), L layers, V vocab.
Every layer weight is stacked along a leading L axis, and the layers run with lax.scan."""

import jax
import jax.numpy as jnp


def rms_norm(x, w, eps):  # in float32, back to x's dtype before the weight (as transformers does)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32.astype(x.dtype) * jnp.broadcast_to(w.astype(x.dtype), x.shape)


def rope(x, pos, base):  # rotate-half RoPE at the real positions; x [B, T, N, H], pos [B, T]
    half = x.shape[-1] // 2
    angle = jnp.einsum("bt,h->bth", pos.astype(jnp.float32), 1 / base ** (jnp.arange(half) / half))
    cos = jnp.cos(angle)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(angle)[:, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def init_kv(cfg, B, S, dtype=jnp.float32):  # an empty KV cache; position -1 marks an empty slot
    shape = (cfg["num_hidden_layers"], B, S, cfg["num_key_value_heads"], cfg["head_dim"])
    return dict(
        k=jnp.zeros(shape, dtype),  # [L, B, S, K, H]
        v=jnp.zeros(shape, dtype),  # [L, B, S, K, H]
        pos=jnp.full((B, S), -1, jnp.int32),  # [B, S]
    )


def forward(
    cfg,
    w,
    tokens,
    pos,
    kv=None,
    start=0,
    *,
    mm=jnp.einsum,
    dtype=jnp.float32,
    last=None,
    kv_quant=None,
):
    """Logits float32 [B, T, V] (or [B, last, V], the last positions) and the updated kv. tokens
    [B, T] at positions pos [B, T] (< 0: padding); a query at p sees keys at 0..p. With kv, this
    call's keys, values (as kv_quant(a), if given) and positions go into cache slots [start, start
    + T), and the queries attend over the whole cache. A weight matmul: mm(spec, activation, w)."""
    eps, H = cfg["rms_norm_eps"], cfg["head_dim"]
    # rope_theta: at the top of config.json, or in rope_parameters (recent transformers)
    base = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    kpos = pos if kv is None else jax.lax.dynamic_update_slice(kv["pos"], pos, (0, start))
    mask = (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= pos[:, :, None])  # [B, T, S]
    x = w["embed"][tokens].astype(dtype)  # [B, T, D]

    @jax.checkpoint  # recompute the layer in the backward pass instead of storing its activations
    def layer(x, xs):
        lw, cache = xs  # cache: this layer's keys and values [B, S, K, H], or None
        lw = jax.tree.map(lambda a: a.astype(dtype), lw)
        # attention: Qwen3 gives q and k their own RMSNorm, before RoPE (QK-norm); Llama does not
        h = rms_norm(x, lw["attn_norm"], eps)
        q, k = mm("btd,dnh->btnh", h, lw["q"]), mm("btd,dkh->btkh", h, lw["k"])
        if "q_norm" in lw:
            q, k = rms_norm(q, lw["q_norm"], eps), rms_norm(k, lw["k_norm"], eps)
        q, k, v = rope(q, pos, base), rope(k, pos, base), mm("btd,dkh->btkh", h, lw["v"])
        # KV cache: this call's keys and values into the layer's slice, attend over the slice
        new = None  # this call's keys and values, as the cache holds them
        if cache is not None:
            if kv_quant:  # as a quantised cache stores them
                k, v = kv_quant(k), kv_quant(v)
            new = dict(k=k.astype(cache["k"].dtype), v=v.astype(cache["v"].dtype))
            k, v = [jax.lax.dynamic_update_slice(cache[a], new[a], (0, start, 0, 0)) for a in "kv"]
            k, v = k.astype(dtype), v.astype(dtype)  # the layer's whole slice, this call's in it
        q = q.reshape(*q.shape[:2], k.shape[2], -1, H)  # [B, T, K, R, H]: R query heads per kv head
        s = jnp.einsum("btkrh,bskh->bkrts", q, k, preferred_element_type=jnp.float32) * H**-0.5
        s = jnp.where(mask[:, None, None], s, -1e30)  # finite: a padding query averages, no NaN
        probs = jax.nn.softmax(s, axis=-1).astype(dtype)  # [B, K, R, T, S]
        o = jnp.einsum("bkrts,bskh->btkrh", probs, v)  # [B, T, K, R, H]
        x = x + mm("btnh,nhd->btd", o.reshape(*o.shape[:2], -1, H), lw["o"])
        # MLP
        h = rms_norm(x, lw["mlp_norm"], eps)
        h = jax.nn.silu(mm("btd,df->btf", h, lw["gate"])) * mm("btd,df->btf", h, lw["up"])
        return x + mm("btf,fd->btd", h, lw["down"]), new

    # the layers. Each reads its slice of the cache and returns this call's keys and values, put
    # in once after the scan (a cache carried through it is copied a layer); a decoded token unrolls
    # the scan, so that each layer's slice of the stacked weights is read in place, not copied first
    cache = None if kv is None else dict(k=kv["k"], v=kv["v"])
    x, new = jax.lax.scan(layer, x, (w["layers"], cache), unroll=tokens.shape[1] == 1)
    if kv is not None:
        at = (0, 0, start, 0, 0)
        kv = {a: jax.lax.dynamic_update_slice(kv[a], new[a], at) for a in "kv"} | dict(pos=kpos)
    x = rms_norm(x if last is None else x[:, -last:], w["norm"], eps)
    head = w["embed"] if cfg.get("tie_word_embeddings") else w["lm_head"]  # [V, D]
    return mm("btd,vd->btv", x, head.astype(dtype)).astype(jnp.float32), kv
