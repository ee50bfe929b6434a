"""The specification of score_centering.loss, as tests: closed forms (the gradient expected under
the sampler, by enumerating every token; the centred gradient), properties (q = p or k = V changes
nothing, masked tokens contribute nothing, A and q are constants, the token mean, extreme inputs
stay finite, the metrics), masked importance sampling against step 9 written densely in numpy, -inf
logits, array-likes, bad input named, and the README's snippet. Each checks a closed form or an
independent reference, never the code's own output; CPU only, seconds. conftest.py sets up XLA and
jax before this file is imported; the corrections (PPO, DAPO, CISPO, GSPO, TOPR) are tested in
tests/test_corrections.py, the rest of the suite (model, checkpoints, sampler, runs, ...) in tests/.
B batch rows, T query length, V vocab, k the sampler's top-k head size."""

import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import score_centering as sc


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
        dict(head=full, correction=sc.tis(1.5)),
        dict(head=full, correction=sc.tis(0.5)),
        dict(head=one_tail),
        dict(head=one_tail, correction=sc.tis(1.5)),
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


def test_the_derivations_worked_case_by_hand():
    """score_centering.py's case to check by hand: V = 3, p = (0.5, 0.3, 0.2), q = (0.6, 0.3, 0.1),
    a head of token 0, the sampled token 1 (r = 1), A = 1. Top-1 subtracts c_0 (e_0 − p) =
    (0.1, −0.06, −0.04) = q̂ − p from the uncentred score (c_0 = 0.2; TIS at C = 1: 0.1; MIS in
    [0.5, 1.2]: 0.5), exact centring q − p; the loss's value is −(log p(y) − Σ_v q̂(v) log p(v))."""
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.6, 0.3, 0.1])
    z, logq, e = jnp.log(jnp.asarray(p)), jnp.log(jnp.asarray(q)), np.eye(3)
    top1 = dict(head_logprobs=logq[:1], head_ids=jnp.array([0]))
    uncentred = _grad_logits(z, 1, logq, center=False)
    np.testing.assert_allclose(uncentred, -(e[1] - p), atol=1e-6)
    q_hat = np.array([0.6, 0.24, 0.16])  # ρ p off the head, ρ = 0.8
    g = _grad_logits(z, 1, logq, head=top1)  # −A · [(e_y − p) − c_0 (e_0 − p)]
    np.testing.assert_allclose(g - uncentred, [0.1, -0.06, -0.04], atol=1e-6)  # c_0 = 0.2
    np.testing.assert_allclose(g - uncentred, q_hat - p, atol=1e-6)
    g = _grad_logits(z, 1, logq, head=top1, correction=sc.tis(1.0))  # f(r_y) = min(1, 1)
    np.testing.assert_allclose(g - uncentred, [0.05, -0.03, -0.02], atol=1e-6)  # c_0 = 0.1
    g = _grad_logits(z, 1, logq, head=top1, correction=sc.mis(0.5, 1.2))  # r_y = 1: in the band
    np.testing.assert_allclose(g - uncentred, [0.25, -0.15, -0.1], atol=1e-6)  # c_0 = 0.5
    exact = _grad_logits(z, 1, logq, head=dict(head_logprobs=logq))
    np.testing.assert_allclose(exact - uncentred, [0.1, 0.0, -0.1], atol=1e-6)  # = q − p
    args = (
        z[None, None],
        jnp.array([[1]]),
        jnp.ones((1, 1), bool),
        jnp.ones(1),
        logq[1][None, None],
    )
    value, metrics = sc.loss(*args, **{k: v[None, None] for k, v in top1.items()})
    np.testing.assert_allclose(value, -(np.log(0.3) - q_hat @ np.log(p)), atol=1e-6)
    np.testing.assert_allclose(metrics["drift_size"], 0.2, atol=1e-6)  # Σ|q̂ − p|
    np.testing.assert_allclose(metrics["tail_ratio_log"], np.log(0.8), atol=1e-6)  # ρ = .4 / .5


def test_tail_ratio_metrics_by_hand():
    """Two tokens, head {0}: p = (.5, .3, .2), q = (.6, .3, .1) has ρ = .4 / .5 = 0.8; p = (.9, .05,
    .05), q = (.7, .15, .15) has ρ = .3 / .1 = 3. Mean log ρ, the largest, the share above 2."""
    p = np.array([[0.5, 0.3, 0.2], [0.9, 0.05, 0.05]])
    q = np.array([[0.6, 0.3, 0.1], [0.7, 0.15, 0.15]])
    logq = np.log(q)[None]
    one = (np.zeros((1, 2), int), np.ones((1, 2), bool), np.ones(1), logq[..., 1])
    _, m = sc.loss(np.log(p)[None], *one, logq[..., :1], np.zeros((1, 2, 1), int))
    np.testing.assert_allclose(m["tail_ratio_log"], (np.log(0.8) + np.log(3)) / 2, atol=1e-6)
    np.testing.assert_allclose(m["tail_ratio_max"], 3, atol=1e-5)
    np.testing.assert_allclose(m["tail_ratio_over_2"], 0.5, atol=1e-6)
    q_hat = np.where(np.arange(3) == 0, q, [[0.8], [3]] * p)
    want = np.abs(q_hat - p).sum(-1).mean()  # the drift term's size, Σ_v |q̂ − p|, a token mean
    np.testing.assert_allclose(m["drift_size"], want, atol=1e-6)


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


def _topk_loss(d, **kw):  # (loss, metrics) of the batch d with its top-k head
    return sc.loss(d["z"], d["y"], d["mask"], d["A"], d["logq_y"], d["logq_H"], d["ids"], **kw)


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
    tis = None if cap is None else sc.tis(cap)
    d = _batch(5)
    perm = jnp.argsort(-d["logq"], axis=-1)  # all V ids, in the sampler's order
    v_exact, g_exact = _value_grad(d, head_logprobs=d["logq"], correction=tis)
    v_topk, g_topk = _value_grad(
        d, head_ids=perm, head_logprobs=jnp.take_along_axis(d["logq"], perm, -1), correction=tis
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
    tis = None if cap is None else sc.tis(cap)
    v, g = _value_grad(d, head_ids=d["ids"], head_logprobs=d["logq_H"], correction=tis)
    np.testing.assert_allclose(v, value, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g, grad, atol=1e-6)


@pytest.mark.parametrize(
    "kw",
    [
        dict(center=False),
        dict(center=False, correction=sc.tis(1.5)),
        dict(correction=sc.tis(1.5)),
        dict(),
    ],
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


@pytest.mark.parametrize("kw", [dict(center=False), dict(correction=sc.tis(1.5)), dict()])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_garbage_token_advantages_at_masked_tokens_change_nothing(kw, bad):
    """[B, T] advantages that are NaN or inf at masked tokens: the value and the gradient are
    finite and those with 0 there."""
    d = _batch(12)
    head = dict(head_ids=d["ids"], head_logprobs=d["logq_H"]) if kw.get("center", True) else {}
    m = d["mask"]
    assert bool(m.any()) and not bool(m.all())  # trained and masked tokens both
    A = jax.random.normal(jax.random.PRNGKey(1), m.shape)
    v, g = _value_grad(dict(d, A=jnp.where(m, A, 0.0)), **head, **kw)
    v2, g2 = _value_grad(dict(d, A=jnp.where(m, A, bad)), **head, **kw)
    assert _finite((v2, g2)) and float(jnp.abs(g).max()) > 1e-3
    np.testing.assert_allclose(v2, v, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(g2, g, atol=1e-7)


def test_advantages_and_sampler_inputs_are_constants():
    """sg(A) and sg(q): only the logits get a gradient, whatever A and q were computed from."""
    d = _batch(11)

    def f(A, lq, lq_H):
        return sc.loss(d["z"], d["y"], d["mask"], A, lq, lq_H, d["ids"], correction=sc.tis(2.0))[0]

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
@pytest.mark.parametrize("tis", [None, sc.tis(2.0)])
def test_extreme_inputs_stay_finite(case, tis):
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
                z, d["y"], d["mask"], d["A"], d["logq_y"], d["logq_H"], d["ids"], correction=tis
            ),
            has_aux=True,
        )
    )
    (v, metrics), g = f(d["z"])
    assert _finite((v, metrics, g)), (v, metrics)
    assert g.dtype == d["z"].dtype


def test_metrics_are_the_documented_quantities():
    d = _batch(10)
    _, m = _topk_loss(d, correction=sc.tis(1.2))
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
        m["clipped"], (-gap >= np.log(1.2))[mask].mean(), rtol=1e-6, atol=1e-7
    )
    p_H = np.exp(np.take_along_axis(logp, np.asarray(d["ids"]), -1))
    q_H = np.exp(np.asarray(d["logq_H"], np.float64))
    np.testing.assert_allclose(m["head_mass_q"], q_H.sum(-1)[mask].mean(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["head_mass_p"], p_H.sum(-1)[mask].mean(), rtol=1e-5, atol=1e-7)
    want = _np_drift_size(d, lambda r: np.minimum(r, 1.2))
    np.testing.assert_allclose(m["drift_size"], want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("tis", [None, 1.2])
def test_exact_drift_size_has_no_tail_when_log_q_sums_to_1_only_roughly(tis):
    """Exact centring's head is the vocabulary, so there is no tail (ρ = 1, α = m(1, 1)) even
    when the sampler's log q, rounded to bf16, sums to 1 ± 1e-3: drift_size is Σ|m − (Σ m) p|."""
    d = _batch(11, V=64)
    logq = d["logq"].astype(jnp.bfloat16)
    q, p = np.exp(np.asarray(logq, np.float64)), np.exp(np.asarray(jax.nn.log_softmax(d["z"])))
    assert np.abs(1 - q.sum(-1)).max() > 1e-4  # the tails' masses are rounding, far above FLOOR
    corr = None if tis is None else sc.tis(tis)
    _, m = sc.loss(d["z"], d["y"], d["mask"], d["A"], d["logq_y"], logq, correction=corr)
    mass = q if tis is None else np.minimum(p, tis * q)  # m = q f(p / q)
    want = np.abs(mass - mass.sum(-1, keepdims=True) * p).sum(-1)[np.asarray(d["mask"])].mean()
    np.testing.assert_allclose(m["drift_size"], want, rtol=1e-4, atol=1e-6)


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
        (dict(correction=sc.tis(0.0)), "correction"),
        (dict(correction=sc.tis(-1.0)), "correction"),
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


def _np_loss(d, w, center=True, w_neg=None):
    """Step 9 written densely in float64 numpy, with q̂ = q on the head and ρ p off it: (value,
    gradient). w is f of step 9 (None: no importance weight), w_neg its form where A ≤ 0 (None: the
    same). A token with p = 0 has m = 0 (m ≤ p for the f of the tests that have one)."""
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
    f_neg = f if w_neg is None else w_neg
    positive = (A > 0)[:, None]  # [B, 1]: which form of f a row's tokens take
    # ρ = 0/0 when the head is every token: unused
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = (1 - (q * head).sum(-1, keepdims=True)) / (1 - (p * head).sum(-1, keepdims=True))
        q_hat = np.where(head, q, rho * p)
        f_hat = np.where(positive[..., None], f(p / q_hat), f_neg(p / q_hat))
        m_hat = np.where(p > 0, q_hat * f_hat, 0.0)
        centring_value = np.where(m_hat > 0, m_hat * logp, 0.0).sum(-1)
    logp_y = np.take_along_axis(logp, y[..., None], -1)[..., 0]
    r_y = np.exp(logp_y - np.asarray(d["logq_y"], np.float64))
    w_y = np.where(positive, f(r_y), f_neg(r_y))
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


def _np_drift_size(d, f):
    """The drift's size Σ_v |m̂_v − (Σ m̂) p_v|, m̂ = q̂ f(p / q̂), over all V: a token mean."""
    p = np.exp(np.asarray(jax.nn.log_softmax(np.asarray(d["z"], np.float64))))
    q, mask = np.exp(np.asarray(d["logq"], np.float64)), np.asarray(d["mask"])
    head = np.zeros_like(p, bool)
    np.put_along_axis(head, np.asarray(d["ids"]), True, -1)
    rho = (1 - (q * head).sum(-1, keepdims=True)) / (1 - (p * head).sum(-1, keepdims=True))
    m_hat = np.where(head, q, rho * p) * f(p / np.where(head, q, rho * p))
    return np.abs(m_hat - m_hat.sum(-1, keepdims=True) * p).sum(-1)[mask].mean()


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
        plain = _expected_grad(z, logq, A=A, center=False, correction=sc.mis(*band))
        if not out.all():  # MIS alone leaves drift, so the zero below means something
            assert float(jnp.abs(plain).max()) > 1e-2, band
        for head in (full, one_tail):
            np.testing.assert_allclose(
                _expected_grad(z, logq, A=A, head=head, correction=sc.mis(*band)),
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
        v, g = _value_grad(
            d, head_ids=d["ids"], head_logprobs=d["logq_H"], correction=sc.mis(*band)
        )
        np.testing.assert_allclose(v, value, rtol=1e-5, atol=1e-6, err_msg=str(band))
        np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-6, err_msg=str(band))
        perm = jnp.argsort(-d["logq"], axis=-1)  # k = V: the exact formula, whatever α
        v, g = _value_grad(
            d,
            head_ids=perm,
            head_logprobs=jnp.take_along_axis(d["logq"], perm, -1),
            correction=sc.mis(*band),
        )
        value, grad = _np_loss({**d, "ids": perm}, _mis_w(*band))
        np.testing.assert_allclose(v, value, rtol=1e-5, atol=1e-6, err_msg=str(band))
        np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-6, err_msg=str(band))


@pytest.mark.parametrize("band", BANDS)
def test_mis_tokens_outside_the_band_contribute_nothing_to_the_sampled_term(band):
    d = _batch(13, T=8)
    _, r_y, _ = _ratios(d)
    out = _out(r_y, band) & np.asarray(d["mask"])
    # both kinds of trained token are present
    assert out.any() and (~out & np.asarray(d["mask"])).any()
    v, g = _value_grad(d, center=False, correction=sc.mis(*band))
    value, grad = _np_loss(d, _mis_w(*band), center=False)
    np.testing.assert_allclose(v, value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-6)
    # exactly nothing, not rounding
    assert float(jnp.abs(jnp.where(out[..., None], g, 0.0)).max()) == 0.0


def test_mis_metrics_are_the_documented_quantities():
    d = _batch(10, T=8)
    band = (0.5, 2.0)
    _, m = _topk_loss(d, correction=sc.mis(*band))
    r_H, r_y, r_tail = _ratios(d)
    mask = np.asarray(d["mask"])
    assert 0 < _out(r_y, band)[mask].mean() < 1
    np.testing.assert_allclose(m["clipped"], _out(r_y, band)[mask].mean(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        m["drift_size"], _np_drift_size(d, _mis_w(*band)), rtol=1e-4, atol=1e-6
    )


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(correction=sc.mis(2.0, 1.0)), "mis"),
        (dict(correction=sc.mis(1.0, 1.0)), "mis"),
        (dict(correction=sc.mis(-0.1, 2.0)), "mis"),
        (dict(correction=sc.mis(float("nan"), 2.0)), "mis"),
        (dict(correction=sc.mis(0.5, float("nan"))), "mis"),
        (dict(correction=sc.mis(INF, INF)), "mis"),
        (dict(correction=sc.Correction("mis", (0.5,), (0.5,))), "mis"),
        (dict(correction=sc.Correction("mis", (0.5, 2.0, 3.0), (0.5, 2.0))), "mis"),
        (dict(correction=(0.5, 5.0)), "correction"),
        (dict(correction=sc.ppo(1.5, 0.2)), "ppo"),
        (dict(correction=sc.cispo(0.2, -1.5)), "cispo"),
        (dict(correction=sc.Correction("gspo", (0, 2), (0, 2), level="row")), "gspo"),
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
    "kw",
    [dict(center=False), dict(), dict(correction=sc.tis(2.0)), dict(correction=sc.mis(0.5, 5.0))],
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
        lambda z: sc.loss(z, d["y"], d["mask"], d["A"], d["logq_y"], d["logq_H"], d["ids"], **kw),
        has_aux=True,
    )
    (v, metrics), g = f(d["z"])
    for name, x in [("value", v), ("gradient", g), *metrics.items()]:
        assert bool(jnp.isfinite(x).all()), (name, x)
    w = {"tis": lambda r: np.minimum(r, 2.0), "mis": _mis_w(0.5, 5.0)}
    name = kw["correction"].name if "correction" in kw else None
    value, grad = _np_loss(d, w.get(name), center=kw.get("center", True))
    np.testing.assert_allclose(v, value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-6)
    logp = np.asarray(jax.nn.log_softmax(np.asarray(d["z"], np.float64)))
    with np.errstate(invalid="ignore"):
        entropy = -np.where(np.isinf(logp), 0, np.exp(logp) * logp).sum(-1)  # 0 log 0 = 0
    np.testing.assert_allclose(
        metrics["entropy"], entropy[np.asarray(d["mask"])].mean(), rtol=1e-5, atol=1e-7
    )


@pytest.mark.parametrize(
    "kw",
    [
        dict(correction=sc.mis(0.5, 5.0)),
        dict(correction=sc.mis(0.0, 1.0)),
        dict(correction=sc.tis(2.0)),
    ],
)
@pytest.mark.parametrize("head", ["top-k", "exact"])
def test_a_sampled_token_the_trainer_rules_out_has_weight_0_and_contributes_0(kw, head):
    """Two sampled tokens (one in the head, one off it) whose trainer logit is -inf: p(y) = 0, so
    r = 0 and MIS and TIS weight them f(0) = 0, and f(r) log p(y) = 0 · log 0 counts as 0 (not
    NaN). The loss, gradient and metrics are their limit, the logit 60 below its row's lowest
    (p(y) < e^-60); only the estimates of KL(q ‖ p) are +inf, as KL is when p(y) = 0 <
    q(y); the share weighted below r counts f(r) < r, which r = 0 is not. Uncentred, such a token
    adds what a token of advantage 0 adds (nothing, and it counts in the token mean); centred, its
    centring term stays: it does not depend on y."""
    d = _batch(26)  # trained tokens sampled in the head and off it
    y, ids, mask = np.asarray(d["y"]), np.asarray(d["ids"]), np.asarray(d["mask"])
    in_head = (ids == y[..., None]).any(-1)
    dead = [np.argwhere(mask & in_head)[0], np.argwhere(mask & ~in_head)[0]]  # (b, t) each
    low, ruled_out = np.asarray(d["z"]).copy(), np.asarray(d["z"]).copy()
    for b, t in dead:
        low[b, t, y[b, t]] = low[b, t].min() - 60.0
        ruled_out[b, t, y[b, t]] = -np.inf
    full = dict(head_logprobs=d["logq"])
    top_k = dict(head_ids=d["ids"], head_logprobs=d["logq_H"])
    heads = full if head == "exact" else top_k

    def value_grad(z, center=True, A=d["A"]):
        def f(z):
            return sc.loss(z, d["y"], d["mask"], A, d["logq_y"], **heads, center=center, **kw)

        return jax.value_and_grad(f, has_aux=True)(z)

    # centred and uncentred: the limit of a low finite logit
    for center in (True, False):
        (v, metrics), g = value_grad(jnp.asarray(ruled_out), center)
        (v_low, metrics_low), g_low = value_grad(jnp.asarray(low), center)
        np.testing.assert_allclose(v, v_low, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g, g_low, rtol=1e-5, atol=1e-6)
        for name, x in metrics.items():
            if name in ("kl_q_p", "logprob_gap"):
                assert float(x) == np.inf, (name, x)
            elif name == "clipped":
                assert 0 <= float(x) <= 1, (name, x)
            else:
                np.testing.assert_allclose(x, metrics_low[name], rtol=1e-5, atol=1e-6, err_msg=name)

    # uncentred: the same batch with the tokens' advantage 0 (their logits finite)
    A = jnp.broadcast_to(d["A"][:, None], mask.shape)
    for b, t in dead:
        A = A.at[b, t].set(0.0)
    (v0, _), g0 = value_grad(d["z"], False, A)
    np.testing.assert_allclose(v, v0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kw", [dict(), dict(correction=sc.tis(2.0)), dict(correction=sc.mis(0.5, 5.0))]
)
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
        return sc.loss(z, y, mask, A, logq_y, logq, **kw)[0]

    (v, g), (v_cut, g_cut) = (
        jax.value_and_grad(f)(z, logq),
        jax.value_and_grad(f)(z[..., :-2], logq[..., :-2]),
    )
    np.testing.assert_allclose(v, v_cut, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(g[..., :-2], g_cut, rtol=1e-6, atol=1e-7)
    assert not np.asarray(g[..., -2:]).any()


@pytest.mark.parametrize("kw", [dict(center=False), dict(correction=sc.mis(0.5, 5.0))])
def test_array_likes_give_the_same_result_as_arrays(kw):
    d = _batch(15)
    args = (d["z"], d["y"], d["mask"], d["A"], d["logq_y"], d["logq_H"], d["ids"])
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


@pytest.mark.parametrize("weight", ["advantage 0", "gspo", "topr"])
@pytest.mark.parametrize("head", ["top-k", "exact", "none"])
def test_a_token_weighted_0_through_its_advantage_contributes_0_even_at_p_0(weight, head):
    """A weight 0 that comes through A, not f(r_y): a token of advantage 0, or a row of A < 0 that
    GSPO (geometric-mean ratio below 1 − ε_low) or TOPR (product of ratios, at most 1) weighs 0.
    With p(y) = 0 there (a -inf trainer logit) the loss and gradient are their limit, the logit 60
    below its row's lowest; not 0 · log 0 = NaN."""
    d = _batch(26)
    y, mask = np.asarray(d["y"]), np.asarray(d["mask"])
    b, t = np.argwhere(mask)[0]
    A = np.broadcast_to(np.asarray(d["A"])[:, None], mask.shape).copy()
    A[b] = -np.abs(A[b])  # the row's advantage below 0: GSPO and TOPR weigh it 0 (r = 0 or e^-60)
    A[b, t] = 0.0 if weight == "advantage 0" else A[b, t]
    kw = dict(
        correction={"advantage 0": None, "gspo": sc.gspo(0.2, 0.2), "topr": sc.topr()}[weight]
    )
    heads = dict(exact=dict(head_logprobs=d["logq"]), none={})  # none: uncentred only
    kw |= heads.get(head, dict(head_ids=d["ids"], head_logprobs=d["logq_H"]))
    low, ruled_out = np.asarray(d["z"]).copy(), np.asarray(d["z"]).copy()
    low[b, t, y[b, t]] = low[b, t].min() - 60.0
    ruled_out[b, t, y[b, t]] = -np.inf
    for center in (True, False)[head == "none" :]:

        def f(z, center=center):
            return sc.loss(z, d["y"], d["mask"], A, d["logq_y"], center=center, **kw)

        (v, metrics), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(ruled_out))
        (v_low, metrics_low), g_low = jax.value_and_grad(f, has_aux=True)(jnp.asarray(low))
        np.testing.assert_allclose(v, v_low, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g, g_low, rtol=1e-5, atol=1e-6)
        for name in set(metrics) - {"kl_q_p", "logprob_gap", "clipped"}:  # inf; r = 0 not clipped
            np.testing.assert_allclose(metrics[name], metrics_low[name], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# the README's snippet
def test_readme_use_it_in_your_codebase_snippet_runs(capsys):
    text = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")).read()
    code = text.split("## Use it in your codebase")[1].split("```python\n")[1].split("```")[0]
    ns = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert capsys.readouterr().out.startswith("loss ")
    assert _finite((ns["loss"], ns["metrics"], ns["grads"]))
    assert set(ns["metrics"]) >= {"kl_q_p", "clipped"}
