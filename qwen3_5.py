"""Qwen3.5 (not MoE) in pure JAX, the model only, with qwen3.py's forward contract (its checkpoint's
weight names: lab/models.py). A hybrid: config layer_types makes each layer Gated DeltaNet (linear
attention: a causal conv, then the gated delta rule's recurrent state) or gated full attention, each
kind's weights stacked on a leading axis of their own: w["linear"], w["full"]. B batch rows, T
query length, S key/KV-cache length, D model width, F MLP hidden, V vocab; full attention: N query
heads, K key/value heads, R = N/K, H head dimension; linear attention: J key heads of dimension E,
U value heads of dimension Y (value head u reads key head u // (U / J)), C = 2·J·E + U·Y
channels."""

from functools import partial

import jax
import jax.numpy as jnp

F32 = jnp.float32


def normed(x, eps):  # x / rms(x), in float32
    x32 = x.astype(F32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def rms_norm(x, w, eps):  # Qwen3.5's: times (1 + w) in float32, then back to x's dtype
    return (normed(x, eps) * (1 + jnp.broadcast_to(w.astype(F32), x.shape))).astype(x.dtype)


def rope(x, pos, base, rotary):  # rotate-half RoPE on the first `rotary` channels; x [B, T, N, H]
    half = rotary // 2
    angle = jnp.einsum("bt,h->bth", pos.astype(F32), 1 / base ** (jnp.arange(half) / half))
    cos, sin = (f(angle)[:, :, None, :].astype(x.dtype) for f in (jnp.cos, jnp.sin))
    x1, x2 = x[..., :half], x[..., half:rotary]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary:]], axis=-1)


# ---- the gated delta rule: per value head a state M [E, Y]; each token decays it by exp(g),
# writes beta times the part of v that M does not yet predict from k, and reads it with q:
#   M <- exp(g) M;  M <- M + beta k (v - M^T k)^T;  o = M^T q
def recurrent_delta_rule(q, k, v, g, beta, M):
    """One token: q, k [B, U, E], v [B, U, Y], g and beta [B, U], the state M [B, U, E, Y], all
    float32. Returns o [B, U, Y] and the new M."""
    M = M * jnp.exp(g)[..., None, None]
    write = (v - jnp.einsum("bue,buey->buy", k, M)) * beta[..., None]
    M = M + jnp.einsum("bue,buy->buey", k, write)
    return jnp.einsum("bue,buey->buy", q, M), M


def delta_rule(q, k, v, g, beta, state):
    """The same over a call's T tokens (a T axis after B), a token at a time: o [B, T, U, Y] and
    the state, taken and returned at the dtype its cache holds it in."""

    def token(M, x):
        o, M = recurrent_delta_rule(*x, M)
        return M, o

    # a call (a prefill, the trainer's pass, one decoded token) works on the state in float32 and
    # rounds it to its dtype once, at its end (as vLLM's prefill stores FLA's float32 final state)
    over_t = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)]  # T first, as scan takes it
    M, o = jax.lax.scan(token, state.astype(F32), over_t)
    return jnp.moveaxis(o, 0, 1), M.astype(state.dtype)


def gated_delta_net(cfg, lw, h, real, kv, i, mm, rule):
    """Gated DeltaNet, layer i of the linear stack, on h [B, T, D] (real [B, T, 1]: False at
    padding): its output [B, T, D] and kv, whose conv inputs and state it continues and updates."""
    J, E = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    U, Y = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    B, T, _ = h.shape
    # projections; g = -exp(A_log) softplus(a + dt_bias) ≤ 0; padding zeroes conv input, beta, g
    qkv = jnp.where(real, mm("btd,dc->btc", h, lw["qkv"]), 0)  # [B, T, C]
    z = mm("btd,duy->btuy", h, lw["z"])
    beta = jnp.where(real, jax.nn.sigmoid(mm("btd,du->btu", h, lw["b"])).astype(F32), 0)
    a = mm("btd,du->btu", h, lw["a"]).astype(F32) + lw["dt_bias"][None, None]
    g = jnp.where(real, -jnp.exp(lw["A_log"].astype(F32))[None, None] * jax.nn.softplus(a), 0)

    # causal conv, depthwise (its last tap: the token itself), SiLU; q, k L2-normed in float32
    width = lw["conv"].shape[0]
    window = jnp.zeros((B, width - 1, qkv.shape[-1])) if kv is None else kv["conv"][i]
    window = jnp.concatenate([window.astype(h.dtype), qkv], axis=1)  # [B, width - 1 + T, C]
    conv = sum(window[:, j : j + T] * lw["conv"][None, None, j] for j in range(width))
    q, k, v = jnp.split(jax.nn.silu(conv), [J * E, 2 * J * E], axis=-1)
    q, k = (jnp.repeat(x.reshape(B, T, J, E).astype(F32), U // J, 2) for x in (q, k))
    q, k = (x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6) for x in (q, k))  # as HF
    xs = (q * E**-0.5, k, v.reshape(B, T, U, Y).astype(F32), g, beta)  # the delta rule's inputs

    # delta rule, from the cache's state (at the precision the cache holds it) or zeros
    state = jnp.zeros((B, U, E, Y), F32) if kv is None else kv["state"][i]
    o, state = rule(*xs, state)  # [B, T, U, Y]
    if kv is not None:
        conv = kv["conv"].at[i].set(window[:, T:].astype(kv["conv"].dtype))
        kv = dict(kv, conv=conv, state=kv["state"].at[i].set(state))

    # gated RMSNorm: normed in float32, back to h's dtype, times w (not 1 + w), then silu(z)
    o = normed(o.astype(h.dtype), cfg["rms_norm_eps"]).astype(h.dtype)
    o = (o * lw["norm"][None, None, None] * jax.nn.silu(z.astype(F32))).astype(h.dtype)
    return mm("btuy,uyd->btd", o, lw["out"]), kv


def init_kv(cfg, B, S, dtype=F32, state_dtype=F32):
    """An empty cache: per linear-attention layer the conv's last inputs and the state, held at
    state_dtype; per full-attention layer K and V [B, S, K, H]; position -1: an empty slot."""
    J, E = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    U, Y = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    n_linear = cfg["layer_types"].count("linear_attention")
    shape = (len(cfg["layer_types"]) - n_linear, B, S, cfg["num_key_value_heads"], cfg["head_dim"])
    conv = jnp.zeros((n_linear, B, cfg["linear_conv_kernel_dim"] - 1, 2 * J * E + U * Y), dtype)
    state = jnp.zeros((n_linear, B, U, E, Y), state_dtype)
    k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    return dict(conv=conv, state=state, k=k, v=v, pos=jnp.full((B, S), -1, jnp.int32))


def forward(
    cfg,
    w,
    tokens,
    pos,
    kv=None,
    start=0,
    *,
    mm=jnp.einsum,
    dtype=F32,
    last=None,
    kv_quant=None,
    rule=delta_rule,
):
    """As qwen3.forward: logits float32 [B, T, V] (or [B, last, V]) and the updated kv; pos < 0 is
    padding, left only. With kv, linear attention goes on from the cache's conv inputs and state.
    rule: delta_rule, or a drop-in (the runs': lab/chunked.py's, in chunks, mostly matmuls)."""
    eps, H = cfg["rms_norm_eps"], cfg["head_dim"]
    base = cfg["rope_parameters"]["rope_theta"]
    rotary = int(H * cfg["rope_parameters"]["partial_rotary_factor"])  # mRoPE is plain RoPE on text
    kpos = pos if kv is None else jax.lax.dynamic_update_slice(kv["pos"], pos, (0, start))
    mask = (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= pos[:, :, None])  # [B, T, S]
    x = w["embed"][tokens].astype(dtype)  # [B, T, D]

    def write(cache, a, i):  # a [B, T, K, H] into layer i of the cache, in place
        return jax.lax.dynamic_update_slice(cache, a[None].astype(cache.dtype), (i, 0, start, 0, 0))

    def full_attention(h, lw, kv, i):
        # projections: lw["q"] [D, N, 2H], per head H query then H gate channels; QK-norm, RoPE
        q, gate = jnp.split(mm("btd,dnh->btnh", h, lw["q"]), 2, axis=-1)
        q = rope(rms_norm(q, lw["q_norm"], eps), pos, base, rotary)
        k = rope(rms_norm(mm("btd,dkh->btkh", h, lw["k"]), lw["k_norm"], eps), pos, base, rotary)
        v = mm("btd,dkh->btkh", h, lw["v"])
        # KV cache: this call's keys and values in (as a quantised cache stores them), then all out
        if kv is not None:
            k, v = (kv_quant(k), kv_quant(v)) if kv_quant else (k, v)
            kv = dict(kv, k=write(kv["k"], k, i), v=write(kv["v"], v, i))
            k, v = kv["k"][i].astype(dtype), kv["v"][i].astype(dtype)
        q = q.reshape(*q.shape[:2], k.shape[2], -1, H)  # [B, T, K, R, H]
        s = jnp.einsum("btkrh,bskh->bkrts", q, k, preferred_element_type=F32) * H**-0.5
        s = jnp.where(mask[:, None, None], s, -1e30)  # finite: a padding query averages, no NaN
        probs = jax.nn.softmax(s, axis=-1).astype(dtype)  # [B, K, R, T, S]
        o = jnp.einsum("bkrts,bskh->btkrh", probs, v).reshape(gate.shape)  # [B, T, N, H]
        return mm("btnh,nhd->btd", o * jax.nn.sigmoid(gate), lw["o"]), kv

    @partial(jax.checkpoint, static_argnums=(3, 4))  # recomputed in the backward pass, not stored
    def layer(x, kv, stack, kind, i):  # the i-th layer of its kind
        lw = jax.tree.map(lambda a: a[i].astype(dtype), stack)  # A_log, dt_bias too (as HF)
        h = rms_norm(x, lw["attn_norm"], eps)
        if kind == "full_attention":
            h, kv = full_attention(h, lw, kv, i)
        else:
            h, kv = gated_delta_net(cfg, lw, h, pos[..., None] >= 0, kv, i, mm, rule)
        x = x + h
        # MLP
        h = rms_norm(x, lw["mlp_norm"], eps)
        h = jax.nn.silu(mm("btd,df->btf", h, lw["gate"])) * mm("btd,df->btf", h, lw["up"])
        return x + mm("btf,fd->btd", h, lw["down"]), kv

    # the layers in config order, a Python loop: the kinds interleave, each with its own weights
    kv = None if kv is None else dict(kv, pos=kpos)
    for j, kind in enumerate(cfg["layer_types"]):
        stack = w["full"] if kind == "full_attention" else w["linear"]
        x, kv = layer(x, kv, stack, kind, cfg["layer_types"][:j].count(kind))
    x = rms_norm(x if last is None else x[:, -last:], w["norm"], eps)
    head = w["embed"] if cfg.get("tie_word_embeddings") else w["lm_head"]  # [V, D]
    return mm("btd,vd->btv", x, head.astype(dtype)).astype(F32), kv
