"""All tests: CPU only, no network, seconds. Each checks a mathematical property or an independent reference."""
import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_numpy_rank_promotion", "raise")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import score_centering as sc  # noqa: E402

# ---------------------------------------------------------------------------------------------------------
# score_centering.loss


def _dist(key, V, scale=1.0):  # a random distribution as log-probs [V]
    return jax.nn.log_softmax(scale * jax.random.normal(key, (V,)))


def _grad_logits(logits, token, logq, A=1.0, **kw):
    """Gradient of the loss wrt the logits of one position (B = T = 1), for sampled token `token`."""
    tok = jnp.array([[token]])
    head = {k: v[None, None] for k, v in kw.pop("head", {}).items()}

    def f(z):
        return sc.loss(z[None, None], tok, jnp.ones((1, 1), bool), jnp.array([A]),
                       logq[token][None, None], **head, **kw)[0]
    return jax.grad(f)(logits)


def _expected_grad(logits, logq, **kw):
    """Σ_y q(y) ∇_z loss(y): the gradient expected under the sampler, by enumerating every token."""
    V = logits.shape[0]
    return sum(jnp.exp(logq[y]) * _grad_logits(logits, y, logq, **kw) for y in range(V))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_expected_gradient_by_enumeration(seed):
    V, A = 7, 1.7
    kz, kq = jax.random.split(jax.random.PRNGKey(seed))
    z, logq = 2.0 * jax.random.normal(kz, (V,)), _dist(kq, V, 2.0)
    p, q = jax.nn.softmax(z), jnp.exp(logq)
    full = dict(head_logprobs=logq)
    order = jnp.argsort(-logq)
    one_tail = dict(head_ids=order[:-1], head_logprobs=logq[order[:-1]])  # top-(V-1): a one-token tail
    # plain REINFORCE under q: A (p − q), the drift of step 3
    plain = _expected_grad(z, logq, A=A, center=False)
    np.testing.assert_allclose(plain, A * (p - q), atol=1e-6)
    assert float(jnp.abs(plain).max()) > 1e-2  # the mismatch is real, so the zero below means something
    for kw in (dict(head=full), dict(head=full, tis_cap=1.5), dict(head=full, tis_cap=0.5),
               dict(head=one_tail), dict(head=one_tail, tis_cap=1.5)):
        np.testing.assert_allclose(_expected_grad(z, logq, A=A, **kw), 0.0, atol=1e-6, err_msg=str(kw))


def test_centred_gradient_closed_form():
    B, T, V = 2, 3, 11
    k = jax.random.split(jax.random.PRNGKey(3), 4)
    z = jax.random.normal(k[0], (B, T, V))
    logq = jax.nn.log_softmax(jax.random.normal(k[1], (B, T, V)))
    y = jax.random.randint(k[2], (B, T), 0, V)
    A = jax.random.normal(k[3], (B, T))
    logq_y = jnp.take_along_axis(logq, y[..., None], -1)[..., 0]
    g = jax.grad(lambda z: sc.loss(z, y, jnp.ones((B, T), bool), A, logq_y, head_logprobs=logq)[0])(z)
    expected = -A[..., None] * (jax.nn.one_hot(y, V) - jnp.exp(logq)) / (B * T)
    np.testing.assert_allclose(g, expected, atol=1e-6)


def _batch(seed, B=2, T=5, V=13, K=4):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    z = 3.0 * jax.random.normal(k[0], (B, T, V))
    logq = jax.nn.log_softmax(z + jax.random.normal(k[1], (B, T, V)))
    y = jax.random.categorical(k[2], logq)
    ids = jnp.argsort(-logq, axis=-1)[..., :K]
    return dict(z=z, logq=logq, y=y, ids=ids, A=jax.random.normal(k[3], (B,)),
                mask=jax.random.uniform(k[4], (B, T)) < 0.8,
                logq_y=jnp.take_along_axis(logq, y[..., None], -1)[..., 0],
                logq_H=jnp.take_along_axis(logq, ids, -1))


def _value_grad(d, logits=None, **kw):
    f = lambda z: sc.loss(z, d["y"], d["mask"], d["A"], d["logq_y"], **kw)[0]  # noqa: E731
    return jax.value_and_grad(f)(d["z"] if logits is None else logits)


def test_q_equal_p_centring_changes_nothing():
    d = _batch(4)
    logp = jax.nn.log_softmax(d["z"])
    d["logq_y"] = jnp.take_along_axis(logp, d["y"][..., None], -1)[..., 0]
    _, g_plain = _value_grad(d, center=False)
    _, g_exact = _value_grad(d, head_logprobs=logp)
    _, g_topk = _value_grad(d, head_ids=d["ids"], head_logprobs=jnp.take_along_axis(logp, d["ids"], -1))
    np.testing.assert_allclose(g_exact, g_plain, atol=1e-6)
    np.testing.assert_allclose(g_topk, g_plain, atol=1e-6)


@pytest.mark.parametrize("cap", [None, 2.0, 0.7])
def test_topk_with_k_equal_v_is_exact(cap):
    d = _batch(5)
    perm = jnp.argsort(-d["logq"], axis=-1)  # all V ids, in the sampler's order
    v_exact, g_exact = _value_grad(d, head_logprobs=d["logq"], tis_cap=cap)
    v_topk, g_topk = _value_grad(d, head_ids=perm, head_logprobs=jnp.take_along_axis(d["logq"], perm, -1),
                                 tis_cap=cap)
    np.testing.assert_allclose(v_topk, v_exact, rtol=1e-5)
    np.testing.assert_allclose(g_topk, g_exact, atol=1e-6)


@pytest.mark.parametrize("cap", [None, 2.0, 0.7])
def test_topk_multi_token_tail_equals_exact_formula_on_modelled_q(cap):
    """Top-k (K = 4 of V = 13) equals step 9 written densely, in numpy, with q̂ = q on H and ρ p off H."""
    d = _batch(6)
    z, logq = np.asarray(d["z"], np.float64), np.asarray(d["logq"], np.float64)
    y, ids, mask, A = map(np.asarray, (d["y"], d["ids"], d["mask"], d["A"]))
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    p, q = np.exp(logp), np.exp(logq)
    head = np.zeros_like(p, bool)
    np.put_along_axis(head, ids, True, -1)
    rho = (1 - (q * head).sum(-1, keepdims=True)) / (1 - (p * head).sum(-1, keepdims=True))
    q_hat = np.where(head, q, rho * p)
    w = lambda r: np.ones_like(r) if cap is None else np.minimum(r, cap)  # noqa: E731  (f of step 9)
    m_hat = q_hat * w(p / q_hat)
    w_y = w(np.exp(np.take_along_axis(logp - logq, y[..., None], -1)[..., 0]))
    y_hot = np.eye(z.shape[-1])[y]
    value = -(A[:, None] * (w_y * (logp * y_hot).sum(-1) - (m_hat * logp).sum(-1)))[mask].sum() / mask.sum()
    grad_token = -A[:, None, None] * (w_y[..., None] * (y_hot - p) - (m_hat - m_hat.sum(-1, keepdims=True) * p))
    grad = np.where(mask[..., None], grad_token, 0) / mask.sum()
    v, g = _value_grad(d, head_ids=d["ids"], head_logprobs=d["logq_H"], tis_cap=cap)
    np.testing.assert_allclose(v, value, rtol=1e-5)
    np.testing.assert_allclose(g, grad, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(center=False), dict(center=False, tis_cap=1.5), dict(tis_cap=1.5),
                                dict()])
def test_masked_tokens_contribute_nothing(kw):
    d = _batch(7)
    head = dict(head_ids=d["ids"], head_logprobs=d["logq_H"]) if kw.get("center", True) else {}
    v, g = _value_grad(d, **head, **kw)
    noise = 5.0 * jax.random.normal(jax.random.PRNGKey(0), d["z"].shape)
    v2, g2 = _value_grad(d, logits=jnp.where(d["mask"][..., None], d["z"], noise), **head, **kw)
    np.testing.assert_allclose(v2, v, rtol=1e-6)
    np.testing.assert_allclose(g2, g, atol=1e-7)
    assert float(jnp.abs(jnp.where(d["mask"][..., None], 0.0, g)).max()) == 0.0


def test_token_mean_across_sequences_of_different_lengths():
    """loss(batch) · N = Σ_b loss(sequence b) · n_b: every token weighs the same, whatever its length."""
    d = _batch(8, B=3, T=6)
    d["mask"] = jnp.arange(6)[None, :] < jnp.array([2, 6, 4])[:, None]
    head = dict(head_ids=d["ids"], head_logprobs=d["logq_H"])
    for kw in (dict(center=False), dict(**head)):
        total = sc.loss(d["z"], d["y"], d["mask"], d["A"], d["logq_y"], **kw)[0] * 12
        parts = sum(sc.loss(d["z"][b:b + 1], d["y"][b:b + 1], d["mask"][b:b + 1], d["A"][b:b + 1],
                            d["logq_y"][b:b + 1], **{k: v[b:b + 1] for k, v in kw.items() if k != "center"},
                            center=kw.get("center", True))[0] * n for b, n in enumerate([2, 6, 4]))
        np.testing.assert_allclose(total, parts, rtol=1e-5)


def _finite(tree):
    return all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("case", ["bf16", "peaked", "head_holds_all"])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_extreme_inputs_stay_finite(case, cap):
    d = _batch(9, V=64, K=8)
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
    f = jax.jit(jax.value_and_grad(lambda z: sc.loss(z, d["y"], d["mask"], d["A"], d["logq_y"], d["ids"],
                                                      d["logq_H"], tis_cap=cap), has_aux=True))
    (v, metrics), g = f(d["z"])
    assert _finite((v, metrics, g)), (v, metrics)
    assert g.dtype == d["z"].dtype


def test_metrics_are_the_documented_quantities():
    d = _batch(10)
    _, m = sc.loss(d["z"], d["y"], d["mask"], d["A"], d["logq_y"], d["ids"], d["logq_H"], tis_cap=1.2)
    logp = np.asarray(jax.nn.log_softmax(d["z"]), np.float64)
    mask = np.asarray(d["mask"])
    gap = np.asarray(d["logq_y"]) - np.take_along_axis(logp, np.asarray(d["y"])[..., None], -1)[..., 0]
    np.testing.assert_allclose(m["kl_q_p"], gap[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(m["logprob_gap"], np.abs(gap)[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(m["entropy"], -(np.exp(logp) * logp).sum(-1)[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(m["head_mass_q"], np.exp(np.asarray(d["logq_H"])).sum(-1)[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(m["tis_capped"], (-gap >= np.log(1.2))[mask].mean(), rtol=1e-6)


def _good(B=2, T=3, V=5, K=2):
    return dict(logits=jnp.zeros((B, T, V)), tokens=jnp.zeros((B, T), int), mask=jnp.ones((B, T), bool),
                advantages=jnp.ones(B), sampler_logprobs=jnp.zeros((B, T)),
                head_ids=jnp.zeros((B, T, K), int), head_logprobs=jnp.zeros((B, T, K)))


@pytest.mark.parametrize("change, match", [
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
])
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
