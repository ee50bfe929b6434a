"""score_centering.loss with the corrections users run (step 9): PPO and DAPO clipping, CISPO, GSPO,
TOPR beside TIS and MIS, each against its published formula (PPO's and GSPO's by autograd of the
clipped surrogate), the gradient expected under the sampler at either sign of A, step 9 written
densely in numpy, and row weights as scaled advantages. The loss's other tests, and the helpers
used here, are in test_score_centering.py, its specification."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import score_centering as sc
import test_score_centering as spec
from test_score_centering import _batch, _np_loss

# the spec's gradients jitted, each compiled once a correction rather than an op at a time eagerly
_expected_grad = jax.jit(spec._expected_grad, static_argnames=("center", "correction"))
_value_grad = jax.jit(spec._value_grad, static_argnames=("center", "correction"))


# --------------------------------------------------------------------------------------------------
# the other corrections: PPO and DAPO clipping, CISPO, GSPO, TOPR (step 9)
def _ppo_weight(r, A, eps_low, eps_high, dual_clip=None):
    """f(r) = ∂J/∂log p / A of PPO's clipped surrogate as published, J = min(r A, clip(r, 1 − ε_low,
    1 + ε_high) A), and with a dual clip J = max(J, c A) where A < 0: by autograd, not by bands."""

    def J(log_r):
        r = jnp.exp(log_r)
        j = jnp.minimum(r * A, jnp.clip(r, 1 - eps_low, 1 + eps_high) * A)
        return jnp.maximum(j, dual_clip * A) if dual_clip is not None and A < 0 else j

    return float(jax.grad(J)(jnp.log(jnp.float32(r)))) / A


# name: (the correction, its published weight f(r, A) of one token's or row's ratio r)
PUBLISHED = {
    "tis": (sc.tis(1.2), lambda r, A: min(r, 1.2)),
    "mis": (sc.mis(0.5, 2.0), lambda r, A: r * (0.5 <= r <= 2.0)),
    "ppo": (sc.ppo(0.2, 0.2), partial(_ppo_weight, eps_low=0.2, eps_high=0.2)),
    "dapo": (sc.ppo(0.2, 0.28), partial(_ppo_weight, eps_low=0.2, eps_high=0.28)),
    "dual": (
        sc.ppo(0.2, 0.28, 3.0),
        partial(_ppo_weight, eps_low=0.2, eps_high=0.28, dual_clip=3.0),
    ),
    "cispo": (sc.cispo(0.2, 0.28), lambda r, A: min(max(r, 0.8), 1.28)),
    "gspo": (sc.gspo(0.2, 0.28), partial(_ppo_weight, eps_low=0.2, eps_high=0.28)),
    "topr": (sc.topr(), lambda r, A: 1.0 if A > 0 else min(r, 1.0)),
}
TOKEN_LEVEL = [name for name, (c, _) in PUBLISHED.items() if c.level == "token"]
RATIOS = [0.01, 0.3, 0.5001, 0.79, 0.81, 0.95, 1.0, 1.05, 1.19, 1.21, 1.27, 1.29, 1.99, 2.01, 2.9]
RATIOS += [3.1, 30.0]  # none on a band's edge, where the surrogate's gradient is one-sided


@pytest.mark.parametrize("name", PUBLISHED)
def test_each_correction_weighs_a_token_as_its_published_formula(name):
    """One-token rows, r on a grid and A of both signs: the weight `loss` gives each, read off its
    uncentred gradient ∂loss/∂z_y = −A f(r) (1 − p(y)) / B, is the published f(r, A). With one
    token a row's geometric mean (GSPO) and product (TOPR) of ratios are the token's r."""
    correction, published = PUBLISHED[name]
    r = np.array(RATIOS * 2)
    A = np.repeat([1.5, -0.7], len(RATIOS))
    B, V = len(r), 1000
    y, mask = jnp.zeros((B, 1), int), jnp.ones((B, 1), bool)
    logq_y = jnp.asarray(np.log(1 / V) - np.log(r), jnp.float32)[:, None]  # p(y) = 1/V: q ≤ 1

    def f(z):
        return sc.loss(z, y, mask, A, logq_y, center=False, correction=correction)[0]

    g = jax.grad(f)(jnp.zeros((B, 1, V)))
    weight = -np.asarray(g[:, 0, 0]) * B / (A * (1 - 1 / V))
    expected = [published(float(ri), float(ai)) for ri, ai in zip(r, A, strict=True)]
    np.testing.assert_allclose(weight, expected, rtol=1e-4, atol=1e-6)
    assert len(set(np.round(expected, 6))) > 3  # the grid crosses the band's edges


@pytest.mark.parametrize("A", [1.7, -1.3])
@pytest.mark.parametrize("name", TOKEN_LEVEL)
def test_corrections_expected_gradient_by_enumeration(name, A):
    """Under a constant advantage of either sign, Σ_y q(y) ∇ loss(y) is zero for the centred loss,
    exact and top-(V−1) (a sign-dependent f's mass taken at the token's sign), and for the
    uncentred loss the closed form −A (m − p Σ_v m_v), m_v = q(v) f(r_v) with f as published."""
    correction, published = PUBLISHED[name]
    V = 9
    kz, kq = jax.random.split(jax.random.PRNGKey(21))
    z = jax.random.normal(kz, (V,))
    logq = jax.nn.log_softmax(z + 0.5 * jax.random.normal(kq, (V,)))  # p/q from 0.74 to 2.9
    p, q = np.exp(np.asarray(jax.nn.log_softmax(z), np.float64)), np.exp(np.asarray(logq))
    f = np.array([published(float(ri), A) for ri in p / q])
    assert len(set(np.round(f / (p / q), 6))) > 1, f  # some tokens weighed r, some not
    m = q * f
    plain = _expected_grad(z, logq, A=A, center=False, correction=correction)
    np.testing.assert_allclose(plain, -A * (m - p * m.sum()), atol=1e-6)
    assert float(jnp.abs(plain).max()) > 1e-3  # drift is there to remove, 1000 times atol
    order = jnp.argsort(-logq)
    for head in (
        dict(head_logprobs=logq),
        dict(head_ids=order[:-1], head_logprobs=logq[order[:-1]]),
    ):
        centred = _expected_grad(z, logq, A=A, head=head, correction=correction)
        np.testing.assert_allclose(centred, 0.0, atol=1e-6, err_msg=str(len(head)))


@pytest.mark.parametrize("name", TOKEN_LEVEL)
def test_corrections_topk_equals_step_9_on_modelled_q(name):
    """Top-k (k = 4 of V = 13), rows of both signs, equals step 9 written densely in numpy with the
    published f at each row's sign; and a one-token tail equals exact centring."""
    correction, published = PUBLISHED[name]
    d = _batch(27, B=4)
    d["A"] = jnp.array([1.0, -0.6, 0.4, -1.2])
    d["logq"] = jax.nn.log_softmax(
        d["z"] + 0.3 * jax.random.normal(jax.random.PRNGKey(5), d["z"].shape)
    )
    d["logq_y"] = jnp.take_along_axis(d["logq"], d["y"][..., None], -1)[..., 0]
    d["logq_H"] = jnp.take_along_axis(d["logq"], d["ids"], -1)
    w_pos, w_neg = (
        np.vectorize(partial(lambda r, A: published(float(r), A), A=a)) for a in (1.0, -1.0)
    )
    value, grad = _np_loss(d, w_pos, w_neg=w_neg)
    v, g = _value_grad(d, head_ids=d["ids"], head_logprobs=d["logq_H"], correction=correction)
    np.testing.assert_allclose(v, value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-6)
    order = jnp.argsort(-d["logq"], axis=-1)[..., :-1]  # a one-token tail
    v_tail, g_tail = _value_grad(
        d,
        head_ids=order,
        head_logprobs=jnp.take_along_axis(d["logq"], order, -1),
        correction=correction,
    )
    v_exact, g_exact = _value_grad(d, head_logprobs=d["logq"], correction=correction)
    np.testing.assert_allclose(v_tail, v_exact, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_tail, g_exact, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["gspo", "topr"])
@pytest.mark.parametrize("center", [True, False])
def test_a_sequence_weight_scales_the_rows_advantage(name, center):
    """GSPO and TOPR: the loss equals the uncorrected loss with each row's advantage times its
    published weight of the row's ratio (GSPO: exp of the mean log r over its trained tokens; TOPR:
    of their sum), in value and gradient; the centring mass stays q. GSPO's band is narrowed to
    [0.99, 1.02] so that this batch's rows (geometric means 0.92 to 1.08) fall on both sides."""
    gspo = (sc.gspo(0.01, 0.02), partial(_ppo_weight, eps_low=0.01, eps_high=0.02))
    correction, published = gspo if name == "gspo" else PUBLISHED[name]
    d = _batch(28, B=6, T=5)
    d["A"] = jnp.array([1.0, -0.6, 0.4, -1.2, 0.8, -0.3])
    d["logq"] = jax.nn.log_softmax(
        d["z"] + 0.15 * jax.random.normal(jax.random.PRNGKey(6), d["z"].shape)
    )
    d["logq_y"] = jnp.take_along_axis(d["logq"], d["y"][..., None], -1)[..., 0]
    d["logq_H"] = jnp.take_along_axis(d["logq"], d["ids"], -1)
    logp = np.asarray(jax.nn.log_softmax(np.asarray(d["z"], np.float64)))
    log_r = np.take_along_axis(logp, np.asarray(d["y"])[..., None], -1)[..., 0] - np.asarray(
        d["logq_y"]
    )
    mask = np.asarray(d["mask"])
    row = (log_r * mask).sum(-1) / (mask.sum(-1) if name == "gspo" else 1)
    w = np.array([published(float(np.exp(x)), float(a)) for x, a in zip(row, d["A"], strict=True)])
    assert 0 < (w == 0).sum() < len(w) if name == "gspo" else 0 < (w < 1).sum() < len(w), w
    head = dict(head_ids=d["ids"], head_logprobs=d["logq_H"]) if center else {}
    v, g = _value_grad(d, **head, center=center, correction=correction)
    v_scaled, g_scaled = _value_grad({**d, "A": d["A"] * w}, **head, center=center)
    np.testing.assert_allclose(v, v_scaled, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g, g_scaled, rtol=1e-5, atol=1e-7)


def test_mis_full_band_is_untruncated_is_and_centring_changes_nothing():
    """The band [0, ∞) is untruncated IS: m = p, so c = 0: centring changes no gradient (step 9)."""
    d = _batch(12)
    band = (0.0, np.inf)
    _, g_plain = _value_grad(d, center=False, correction=sc.mis(*band))
    _, g_exact = _value_grad(d, head_logprobs=d["logq"], correction=sc.mis(*band))
    _, g_topk = _value_grad(
        d, head_ids=d["ids"], head_logprobs=d["logq_H"], correction=sc.mis(*band)
    )
    np.testing.assert_allclose(g_exact, g_plain, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_topk, g_plain, rtol=1e-5, atol=1e-6)
    _, grad = _np_loss(d, lambda r: r, center=False)  # w = p/q on every token
    np.testing.assert_allclose(g_plain, grad, rtol=1e-5, atol=1e-6)
    _, m = spec._topk_loss(d, correction=sc.mis(*band))
    assert float(m["drift_size"]) < 1e-6 and float(m["clipped"]) == 0.0
