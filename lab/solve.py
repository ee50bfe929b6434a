"""A drop-in for qwen3_5.unit_lower_solve, the chunked delta rule's (I + A)^-1 x, with the same
signature and values and a backward pass of its own: autodiff through the forward substitution
keeps x after each of a chunk's 64 rows, two solves a layer; this backward pass is the transposed
solve, which keeps A and the solution alone (docs/qwen3_5.md derives it; docs/speed.md, item 7,
measures it). lab/models.py's model(cfg) hands it to qwen3_5.forward, so train.py's runs take it.
A strictly lower triangular [..., t, s] (t, s: tokens of a chunk), x [..., t, Y]."""

import jax
import jax.numpy as jnp

import qwen3_5


@jax.custom_vjp
def unit_lower_solve(A, x):  # qwen3_5's, a row a step
    return qwen3_5.unit_lower_solve(A, x)


def solve_forward(A, x):  # u and what the backward pass keeps: A and u
    u = unit_lower_solve(A, x)
    return u, (A, u)


def solve_backward(kept, du):  # u = (I + A)^-1 x: x̄ = (I + A)^-T ū, Ā = -x̄ uᵀ below the diagonal
    A, u = kept
    flipped = jnp.flip(jnp.swapaxes(A, -1, -2), (-2, -1))  # P Aᵀ P, P the reversal: lower
    dx = jnp.flip(unit_lower_solve(flipped, jnp.flip(du, -2)), -2)  # P (I + P Aᵀ P)^-1 P ū
    return -jnp.tril(jnp.einsum("...ty,...sy->...ts", dx, u), -1), dx  # (Ā, x̄), as (A, x)


unit_lower_solve.defvjp(solve_forward, solve_backward)
