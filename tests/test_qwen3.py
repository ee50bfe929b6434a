"""qwen3.py: the forward pass against transformers, the KV cache against a full pass, left
padding against each prompt alone, causality, the mm hook, gradients through padding, bf16 compute,
forward's kv_quant hook (what the cache stores) and rms_norm against its formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qwen3
from helpers import LLAMA, arange_pos, write_tiny_checkpoint
from lab import hf_checkpoint


def left_padded(prompts, T):
    # tokens and positions of left-padded prompts; padding has position < 0
    pad = [T - len(p) for p in prompts]
    tokens = jnp.array([[0] * n + list(p) for n, p in zip(pad, prompts, strict=True)])
    return tokens, jnp.array([[i - n for i in range(T)] for n in pad], dtype=jnp.int32)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("arch", [{}, LLAMA], ids=["qwen3", "llama"])
def test_logits_match_transformers(tmp_path, tie, arch):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = write_tiny_checkpoint(str(tmp_path), tie=tie, **arch)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    tokens = np.random.default_rng(1).integers(0, 300, (2, 12))
    with torch.no_grad():
        expected = ref(torch.tensor(tokens)).logits.numpy()
    assert type(ref).__name__ == ("LlamaForCausalLM" if arch else "Qwen3ForCausalLM")
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


# --------------------------------------------------------------------------------------------------
# forward's kv_quant: what the cache stores of each K and V
def decode(m, tokens, kv_quant):  # prefill 5 tokens, then decode the rest one at a time
    B, T = tokens.shape
    fwd = jax.jit(lambda *a: qwen3.forward(m.cfg, m.weights, *a, kv_quant=kv_quant))  # t0 traced
    logits, kv = fwd(tokens[:, :5], arange_pos(B, 5), qwen3.init_kv(m.cfg, B, T), 0)
    outs = [logits]
    for t in range(5, T):
        logits, kv = fwd(tokens[:, t : t + 1], jnp.full((B, 1), t), kv, t)
        outs.append(logits)
    return jnp.concatenate(outs, 1), kv


def test_kv_quant_none_and_identity_are_the_plain_cache(tiny, fwd):
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 300)
    full, _ = fwd(tokens, arange_pos(2, 8))
    plain, kv = decode(tiny, tokens, None)
    same, kv_same = decode(tiny, tokens, lambda a: a)
    np.testing.assert_array_equal(plain, same)
    np.testing.assert_array_equal(kv["k"], kv_same["k"])
    np.testing.assert_allclose(plain, full, atol=1e-5)
    seen = []  # without a cache, kv_quant is never called (nor traced)
    jax.eval_shape(
        lambda: qwen3.forward(
            tiny.cfg, tiny.weights, tokens, arange_pos(2, 8), kv_quant=lambda a: seen.append(a) or a
        )
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
