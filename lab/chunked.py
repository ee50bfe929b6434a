"""Qwen3.5's delta rule in chunks of 64 tokens, a drop-in for qwen3_5.delta_rule (the same signature
and values up to float32 rounding): where the reference takes a token at a time, a chunk takes two
triangular solves, then matmuls (docs/qwen3_5.md derives it). Its solve has a backward pass of its
own: autodiff through the forward substitution keeps x after each of a chunk's 64 rows, two solves a
layer; the transposed solve keeps A and the solution alone (docs/speed.md, item 7, measures it).
lab/models.py's model(cfg) hands delta_rule to qwen3_5.forward, so train.py's runs take it. B
batch rows, T tokens, U value heads, E key and Y value dimension (qwen3_5.py's letters); n chunks
of 64 tokens, t and s tokens in a chunk."""

import jax
import jax.numpy as jnp

import qwen3_5

F32 = jnp.float32


def forward_substitution(A, x):  # (I + A)^-1 x, A [..., t, s] strictly lower, x [..., t, Y]
    # a row a step, not LAPACK's solve: its gradient hangs XLA's CPU runtime on several devices
    def row(i, x):  # x_i <- x_i - Σ_s<i A[i, s] x_s, rows before i solved
        return x.at[..., i, :].add(-jnp.einsum("...s,...sy->...y", A[..., i, :], x))

    return jax.lax.fori_loop(0, A.shape[-1], row, x)


@jax.custom_vjp
def unit_lower_solve(A, x):  # the same, with the backward pass below
    return forward_substitution(A, x)


def solve_forward(A, x):  # u and what the backward pass keeps: A and u
    u = unit_lower_solve(A, x)
    return u, (A, u)


def solve_backward(kept, du):  # u = (I + A)^-1 x: x̄ = (I + A)^-T ū, Ā = -x̄ uᵀ below the diagonal
    A, u = kept
    flipped = jnp.flip(jnp.swapaxes(A, -1, -2), (-2, -1))  # P Aᵀ P, P the reversal: lower
    dx = jnp.flip(unit_lower_solve(flipped, jnp.flip(du, -2)), -2)  # P (I + P Aᵀ P)^-1 P ū
    return -jnp.tril(jnp.einsum("...ty,...sy->...ts", dx, u), -1), dx  # (Ā, x̄), as (A, x)


unit_lower_solve.defvjp(solve_forward, solve_backward)


def chunked_delta_rule(q, k, v, g, beta, state, size=64):
    """qwen3_5.delta_rule over T tokens, 64 a chunk: in a chunk two triangular solves, then
    matmuls; the state in float32 across the chunks, rounded to its dtype once, at the end."""
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
    u_0 = unit_lower_solve(A, v * beta[..., None])  # the writes if M = 0
    u_M = unit_lower_solve(A, k * (beta * jnp.exp(gam))[..., None])  # u = u_0 - u_M M
    attn = jnp.einsum("nbute,nbuse->nbuts", q, k) * decay  # step 3's (q_t · k_s) decay[t, s]

    def step(M, xs):  # steps 3-4 across chunks, M the state at a chunk's start: its o, M at its end
        u_0, u_M, attn, q, k, gam = xs
        u = u_0 - jnp.einsum("bute,buey->buty", u_M, M)
        o = jnp.einsum("bute,buey->buty", q * jnp.exp(gam)[..., None], M)  # e^gam_t M^T q_t
        o = o + jnp.einsum("buts,busy->buty", attn, u)
        k_to_end = k * jnp.exp(gam[..., -1:] - gam)[..., None]  # step 1 at the chunk's end
        M = M * jnp.exp(gam[..., -1])[..., None, None] + jnp.einsum("buse,busy->buey", k_to_end, u)
        return M, o

    M, o = jax.lax.scan(step, state.astype(F32), (u_0, u_M, attn, q, k, gam))
    o = jnp.moveaxis(o, (0, 2), (1, 3))  # [B, n, size, U, Y]
    return o.reshape(B, n * size, *o.shape[3:])[:, :T], M.astype(state.dtype)


def delta_rule(q, k, v, g, beta, state):
    """The drop-in the runs take: a decoded token (T = 1) by qwen3_5's recurrence, as the
    reference computes it but outside a scan (XLA keeps a scan of one step a loop); more tokens in
    chunks."""
    if g.shape[1] > 1:
        return chunked_delta_rule(q, k, v, g, beta, state)
    o, M = qwen3_5.recurrent_delta_rule(*(x[:, 0] for x in (q, k, v, g, beta)), state.astype(F32))
    return o[:, None], M.astype(state.dtype)
