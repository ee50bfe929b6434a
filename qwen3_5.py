"""Qwen3.5 (not MoE) in pure JAX, the model only, with qwen3.py's forward contract (its checkpoint's
weight names: lab/models.py). A hybrid: config layer_types makes each layer Gated DeltaNet (linear
attention: a causal conv, then the gated delta rule's recurrent state) or gated full attention, each
kind's weights stacked on a leading axis of their own: w["linear"], w["full"]. B batch rows, T
query length, S key/KV-cache length, D model width, F MLP hidden, V vocab; full attention: N query
heads, K key/value heads, R = N/K, H head dimension; linear attention: J key heads of dimension E,
U value heads of dimension Y (value head u reads key head u // (U / J)), C = 2·J·E + U·Y channels;
the chunked delta rule: n chunks of 64 tokens, t and s tokens in a chunk."""

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
def recurrent_delta_rule(q, k, v, g, beta, state):
    """One token: q, k [B, U, E], v [B, U, Y], g and beta [B, U], all float32, and the state [B, U,
    E, Y] in the dtype it is held at. Returns o [B, U, Y] (read before rounding), the new state."""
    M = state.astype(F32) * jnp.exp(g)[..., None, None]
    write = (v - jnp.einsum("bue,buey->buy", k, M)) * beta[..., None]
    M = M + jnp.einsum("bue,buy->buey", k, write)
    return jnp.einsum("bue,buey->buy", q, M), M.astype(state.dtype)


def unit_lower_solve(A, x):  # (I + A)^-1 x, A strictly lower triangular [..., t, s], a row a step
    # (not LAPACK's triangular solve: differentiated, it hangs XLA's CPU runtime on several devices)
    def row(i, x):  # forward substitution: x_i <- x_i - Σ_s<i A[i, s] x_s, rows before i solved
        return x.at[..., i, :].add(-jnp.einsum("...s,...sy->...y", A[..., i, :], x))

    return jax.lax.fori_loop(0, A.shape[-1], row, x)


def chunked_delta_rule(q, k, v, g, beta, state, solve=unit_lower_solve, size=64):
    """The same over T tokens (a T axis after B), 64 a chunk (docs/qwen3_5.md derives it): in a
    chunk two triangular solves, then matmuls; the state rounded to its dtype after each chunk."""
    B, T = g.shape[:2]
    n = -(-T // size)

    def chunks(a):  # [B, T, U, ...] -> [n, B, U, size, ...], zeros at the end: g = beta = 0 there
        a = jnp.pad(a, [(0, 0), (0, n * size - T)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(B, n, size, *a.shape[2:]), (1, 3), (0, 2))

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    # step 1 (docs): exp(gam) decays from the chunk's start to t, decay[t, s] from s to t (≤ 1, as
    # g ≤ 0); the cap at 0 bites only above the diagonal, where exp's inf would NaN the gradients
    gam = jnp.cumsum(g, axis=-1)  # [n, B, U, size]
    decay = jnp.tril(jnp.exp(jnp.minimum(gam[..., :, None] - gam[..., None, :], 0)))
    # step 2: a write u_t = beta_t (v_t - (e^g_t M_{t-1})^T k_t) reads the chunk's earlier writes:
    # (I + A) u = beta (v - exp(gam) M^T k), M the chunk's start, A[t, s] = beta_t decay k_t·k_s
    A = jnp.tril(jnp.einsum("nbute,nbuse->nbuts", k, k) * decay, -1) * beta[..., None]
    u_0 = solve(A, v * beta[..., None])  # the writes if M = 0
    u_M = solve(A, k * (beta * jnp.exp(gam))[..., None])  # u = u_0 - u_M M
    attn = jnp.einsum("nbute,nbuse->nbuts", q, k) * decay  # step 3's (q_t · k_s) decay[t, s]

    def step(M, xs):  # steps 3-4 across chunks, M the state at a chunk's start: its o, M at its end
        u_0, u_M, attn, q, k, gam = xs
        u = u_0 - jnp.einsum("bute,buey->buty", u_M, M)
        o = jnp.einsum("bute,buey->buty", q * jnp.exp(gam)[..., None], M)  # e^gam_t M^T q_t
        o = o + jnp.einsum("buts,busy->buty", attn, u)
        k_to_end = k * jnp.exp(gam[..., -1:] - gam)[..., None]  # step 1 at the chunk's end
        M = M * jnp.exp(gam[..., -1])[..., None, None] + jnp.einsum("buse,busy->buey", k_to_end, u)
        return M.astype(state.dtype).astype(F32), o

    M, o = jax.lax.scan(step, state.astype(F32), (u_0, u_M, attn, q, k, gam))
    o = jnp.moveaxis(o, (0, 2), (1, 3))  # [B, n, size, U, Y]
    return o.reshape(B, n * size, *o.shape[3:])[:, :T], M.astype(state.dtype)


def gated_delta_net(cfg, lw, h, real, kv, i, mm, solve):
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
    if T == 1:  # a decoded token (the sampler): the recurrence, O(1) a token
        o, state = recurrent_delta_rule(*(x[:, 0] for x in xs), state)
        o = o[:, None]  # [B, T, U, Y]
    else:  # a sequence (the trainer, a prefill): 64 tokens a chunk, mostly matmuls
        o, state = chunked_delta_rule(*xs, state, solve)
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
    solve=unit_lower_solve,
):
    """As qwen3.forward: logits float32 [B, T, V] (or [B, last, V]) and the updated kv; pos < 0 is
    padding, left only. With kv, linear attention goes on from the cache's conv inputs and state.
    solve(A, x): the chunked delta rule's triangular solve (lab/solve.py's saves memory)."""
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
            h, kv = gated_delta_net(cfg, lw, h, pos[..., None] >= 0, kv, i, mm, solve)
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
