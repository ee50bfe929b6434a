"""qwen3_5.py and its checkpoints: logits against transformers' Qwen3.5 in both layouts (the text
model's and the vision-language wrapper's), greedy generation against transformers', the runs'
prefill and decode against the reference's one pass, left padding against each prompt alone, the
state's precision, the mm hook, gradients through padding; the runs' chunked delta rule
(lab/chunked.py) against the reference's token-by-token one (values, gradients, a bf16 state, the
forward), its memory-saving solve against the plain one; save() read back by transformers; the
config checks, on Qwen3.5-0.8B's config.json and on what they refuse. B batch rows, T query length,
V vocab."""

import json
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qwen3_5
from helpers import QWEN3_5_LAYERS, arange_pos, write_tiny_qwen3_5
from lab import chunked, hf_checkpoint, models

# measured on 6 tiny checkpoints x 3 inputs (logits |z| <= 15; 1 and 2 threads, the suite's and
# XLA's default flags), the delta rule then chunked: ours and transformers' float32 logits <= 9.3e-5
# apart (T = 70), the recurrent decode and the chunked forward <= 1.3e-4; tolerance ~10x: 1e-3
ATOL = 1e-3
S = 80  # every cache's length: one compiled decode step for all the tests


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # the text model's checkpoint: untied head, layer_types not default
    return hf_checkpoint.load(write_tiny_qwen3_5(str(tmp_path_factory.mktemp("qwen3_5"))))


@pytest.fixture(scope="module")
def fwd(tiny):  # fwd(w, tokens, pos, kv, start, last=): compiled once per shape
    return jax.jit(partial(qwen3_5.forward, tiny.cfg), static_argnames=("last",))


@pytest.fixture(scope="module")
def runs_fwd(tiny):  # the same, as the runs call it: lab/chunked.py's delta rule
    return jax.jit(partial(models.model(tiny.cfg).forward, tiny.cfg), static_argnames=("last",))


def reference(path, vl=False):  # transformers' model of a checkpoint, in float32
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cls = transformers.Qwen3_5ForConditionalGeneration if vl else transformers.Qwen3_5ForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def torch_logits(model, tokens):
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def same(a, b):  # two weight trees, equal leaf by leaf
    return jax.tree.all(jax.tree.map(lambda x, y: bool((x == y).all()), a, b))


# --------------------------------------------------------------------------------------------------
# against transformers
@pytest.mark.parametrize("vl", [False, True], ids=["text", "vision-language"])
def test_logits_match_transformers(tmp_path, tiny, fwd, vl):
    """The checkpoint, and the folder transformers writes of it with save_pretrained (the
    wrapper's: model.language_model.*, model.visual.*), read as tiny's weights, whose logits over
    70 tokens are transformers'."""
    src = write_tiny_qwen3_5(str(tmp_path / "src"), vl=vl)  # tiny's weights, in either layout
    ref = reference(src, vl)
    ref.save_pretrained(tmp_path / "hf")
    for path in (src, tmp_path / "hf"):  # src has an MTP tensor, both a vision tower if vl
        m = hf_checkpoint.load(path)
        assert m.cfg["layer_types"] == QWEN3_5_LAYERS and m.cfg["model_type"] == "qwen3_5_text"
        assert same(m.weights, tiny.weights)
    tokens = np.random.default_rng(1).integers(0, 300, (2, 70))
    expected = torch_logits(ref, tokens)
    logits, kv = fwd(tiny.weights, jnp.array(tokens), arange_pos(2, 70))
    assert kv is None and logits.dtype == jnp.float32 and logits.shape == (2, 70, 300)
    assert np.abs(np.asarray(logits) - expected).max() < ATOL
    assert np.abs(expected).max() > 1  # not vacuous


def greedy(fwd, tiny, prompt, steps):
    """As train.py's sampler: the prompt [B, T0] into a fresh cache (last=1), then the argmax
    token at each step, fed back one at a time. Returns the tokens [B, steps], their logits."""
    B, T0 = prompt.shape
    kv = qwen3_5.init_kv(tiny.cfg, B, S)
    logits, kv = fwd(tiny.weights, prompt, arange_pos(B, T0), kv, 0, last=1)
    outs = [logits]
    for t in range(T0, T0 + steps - 1):
        y = jnp.argmax(outs[-1][:, -1], -1)[:, None]
        logits, kv = fwd(tiny.weights, y, jnp.full((B, 1), t), kv, t)
        outs.append(logits)
    logits = jnp.concatenate(outs, 1)  # [B, steps, V]
    return jnp.argmax(logits, -1), logits


def test_greedy_generation_matches_transformers(tiny, fwd):
    """transformers' generate: its own cache, and its own recurrent delta rule."""
    torch = pytest.importorskip("torch")
    prompt = np.random.default_rng(2).integers(0, 275, (2, 40))
    with torch.no_grad():
        expected = reference(tiny.path).generate(
            torch.tensor(prompt),
            attention_mask=torch.ones(2, 40, dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=299,
        )[:, 40:]
    tokens, logits = greedy(fwd, tiny, jnp.array(prompt), 12)
    top2 = jax.lax.top_k(logits, 2)[0]
    assert float((top2[..., 0] - top2[..., 1]).min()) > 10 * ATOL  # no near-tie to flip
    np.testing.assert_array_equal(np.asarray(tokens), expected.numpy())


# --------------------------------------------------------------------------------------------------
# the cache: the recurrent decode, a prefill in parts, left padding, the state's precision
def test_recurrent_decode_matches_chunked_forward(tiny, fwd, runs_fwd):
    """As the runs compute it: a prefill of 40 tokens, 21 more continuing from the cache (the
    chunked rule from a state), then 9 one at a time (the recurrence): the logits of the
    reference's one pass over all 70, a token at a time."""
    tokens = jax.random.randint(jax.random.key(0), (2, 70), 0, 300)
    full, _ = fwd(tiny.weights, tokens, arange_pos(2, 70))
    kv = qwen3_5.init_kv(tiny.cfg, 2, S)
    outs = []
    for a, b in [(0, 40), (40, 61)] + [(t, t + 1) for t in range(61, 70)]:
        logits, kv = runs_fwd(tiny.weights, tokens[:, a:b], arange_pos(2, b)[:, a:], kv, a)
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=ATOL)
    assert (kv["pos"] == jnp.array([list(range(70)) + [-1] * (S - 70)] * 2)).all()
    assert kv["state"].shape == (2, 2, 4, 8, 12)  # [linear layers, B, U, E, Y]
    assert kv["conv"].shape == (2, 2, 3, 2 * 2 * 8 + 4 * 12)  # the last kernel - 1 inputs
    assert kv["k"].shape == (2, 2, S, 2, 16)  # [full layers, B, S, K, H]


def test_left_padded_rows_equal_each_prompt_alone(tiny, fwd):
    """Padding (position -1) changes no row's conv window or state: a left-padded batch computes
    each prompt's logits, prefilled and decoded, and without a cache (the trainer's pass) too. The
    short prompt's padding fills the conv's window. Alone: unpadded, the rest of its row after it
    (which causality hides)."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 300, n).tolist() for n in (2, 7)]
    cont = rng.integers(0, 300, (2, 4))  # tokens decoded after each prompt
    pad = [7 - len(p) for p in prompts]
    tokens = jnp.array([[0] * n + p for n, p in zip(pad, prompts, strict=True)])
    pos = jnp.array([[i - n for i in range(7)] for n in pad], dtype=jnp.int32)
    prefill, kv = fwd(tiny.weights, tokens, pos, qwen3_5.init_kv(tiny.cfg, 2, S), 0)
    # the short row's conv window: its 2 inputs after a padding token's, which wrote zero
    assert (kv["conv"][:, 0, 0] == 0).all() and (kv["conv"][:, 0, 1:] != 0).all()
    decoded = []
    for i in range(4):
        logits, kv = fwd(
            tiny.weights, jnp.array(cont[:, i : i + 1]), pos[:, -1:] + 1 + i, kv, 7 + i
        )
        decoded.append(logits)
    decoded = jnp.concatenate(decoded, 1)  # [B, 4, V]
    seq = jnp.concatenate([tokens, jnp.array(cont)], 1)
    no_cache, _ = fwd(
        tiny.weights, seq, jnp.concatenate([pos, pos[:, -1:] + 1 + arange_pos(2, 4)], 1)
    )
    rows = [p + c.tolist() for p, c in zip(prompts, cont, strict=True)]
    alone, _ = fwd(
        tiny.weights, jnp.array([r + [0] * (11 - len(r)) for r in rows]), arange_pos(2, 11)
    )
    assert np.isfinite(np.asarray(prefill)).all() and np.isfinite(np.asarray(no_cache)).all()
    for b, p in enumerate(prompts):
        n = len(p)
        np.testing.assert_allclose(prefill[b, 7 - n :], alone[b, :n], atol=ATOL)
        np.testing.assert_allclose(decoded[b], alone[b, n : n + 4], atol=ATOL)
        np.testing.assert_allclose(no_cache[b, 7 - n :], alone[b, : n + 4], atol=ATOL)


def test_state_dtype_is_the_precision_the_state_is_held_at(tiny, fwd):
    """Decoding from a cache that holds the state in bfloat16 (as an engine holding it so): each
    state written is a bfloat16 value, read at the next token, and the logits move a little;
    float32, init_kv's default, is the plain decode."""
    prompt = jax.random.randint(jax.random.key(4), (2, 44), 0, 300)
    _, kv = fwd(tiny.weights, prompt[:, :40], arange_pos(2, 40), qwen3_5.init_kv(tiny.cfg, 2, S), 0)
    runs = {}
    for name, dtype in [("plain", None), ("f32", jnp.float32), ("bf16", jnp.bfloat16)]:
        cache = kv if dtype is None else dict(kv, state=kv["state"].astype(dtype))
        outs = []
        for t in range(40, 44):  # the prompt's last 4 tokens, one at a time
            logits, cache = fwd(tiny.weights, prompt[:, t : t + 1], jnp.full((2, 1), t), cache, t)
            outs.append(logits)
        runs[name] = jnp.concatenate(outs, 1), cache["state"]
    np.testing.assert_array_equal(runs["plain"][0], runs["f32"][0])
    assert runs["plain"][1].dtype == jnp.float32 and runs["bf16"][1].dtype == jnp.bfloat16
    state = np.asarray(runs["bf16"][1], np.float32)  # held in bfloat16 from token 40 on
    assert not np.array_equal(np.asarray(runs["f32"][1]), state)
    gap = np.abs(np.asarray(runs["bf16"][0] - runs["f32"][0])).max()
    assert 1e-4 < gap < 0.1  # a small change that reaches the logits


def test_every_weight_matmul_goes_through_mm(tiny):
    """What train.py quantises and adapts: every projection of both kinds of layer and the head,
    through mm; the depthwise conv is not a matmul."""
    seen = []

    def mm(spec, x, w):
        seen.append(w.shape)
        return jnp.einsum(spec, x, w)

    jax.eval_shape(
        partial(qwen3_5.forward, tiny.cfg, mm=mm),
        tiny.weights,
        jnp.zeros((1, 3), int),
        arange_pos(1, 3),
    )
    matmuls = dict(
        full=("q", "k", "v", "o", "gate", "up", "down"),
        linear=("qkv", "z", "b", "a", "out", "gate", "up", "down"),
    )
    expected = [tiny.weights["lm_head"].shape]
    for kind, names in matmuls.items():
        stack = tiny.weights[kind]
        expected += [stack[k].shape[1:] for k in names for _ in range(len(stack[k]))]
    assert sorted(seen) == sorted(expected)


def test_gradients_finite_through_padding(tiny):
    """The runs' trainer pass, left padding included: the chunked rule's masked decays (clipped at
    0 before exp) give finite gradients, and the linear attention's own weights get some."""
    cfg = dict(tiny.cfg, layer_types=["linear_attention"])  # one layer: a cheaper compile
    tokens = jnp.array([[0, 0, 0, 5, 6, 7], [8, 9, 10, 11, 12, 13]])
    pos = jnp.array([[-3, -2, -1, 0, 1, 2], list(range(6))])

    def loss(w):  # every position, padding included
        return jax.nn.log_softmax(models.model(cfg).forward(cfg, w, tokens, pos)[0]).mean()

    grads = jax.jit(jax.grad(loss))(tiny.weights)["linear"]
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    for name in ("A_log", "dt_bias", "conv", "qkv", "b", "a"):
        assert np.abs(np.asarray(grads[name][0])).max() > 0, name


# measured on 8 random chunks of 64 rows (|u| <= 60, gradients <= 216), apart by at most this share
# of the largest entry: the plain solve's values and LU's 1.3e-6; the memory-saving solve's
# gradients and autodiff's through the plain one 5e-7, LU's 2.2e-6. Tolerances ~10x
def test_the_memory_saving_solve_is_the_plain_solve():
    """lab/chunked.py's unit_lower_solve, the chunked rule's: the values of its forward
    substitution, and its backward pass (the transposed solve) the gradient autodiff takes through
    the forward substitution and through jnp.linalg.solve (LU) of I + A, for x and for A below its
    diagonal (A is taken as strictly lower: its gradient elsewhere is defined 0), keeping far
    less."""
    kA, kx, kc = jax.random.split(jax.random.key(0), 3)
    A = jnp.tril(jax.random.normal(kA, (3, 64, 64)) * 0.3, -1)  # a chunk of 64 tokens
    x, cotangent = jax.random.normal(kx, (3, 64, 5)), jax.random.normal(kc, (3, 64, 5))
    eye = jnp.eye(64)[None]

    def lu(A, x):
        return jnp.linalg.solve(eye + A, x)

    u = chunked.forward_substitution(A, x)
    np.testing.assert_array_equal(chunked.unit_lower_solve(A, x), u)
    np.testing.assert_allclose(u, lu(A, x), atol=1e-5 * np.abs(u).max())

    def grad(solver):  # of x and of A below its diagonal, and the compiled gradient's memory
        def loss(A, x):
            return (solver(A, x) * cotangent).sum()

        compiled = jax.jit(jax.grad(loss, (0, 1))).lower(A, x).compile()
        dA, dx = compiled(A, x)
        return jnp.tril(dA, -1), dx, compiled.memory_analysis().temp_size_in_bytes

    *ours, ours_temp = grad(chunked.unit_lower_solve)
    *plain, plain_temp = grad(chunked.forward_substitution)
    dA, dx = jax.grad(lambda A, x: (lu(A, x) * cotangent).sum(), (0, 1))(A, x)
    for name, a, b, c in zip("Ax", ours, plain, (jnp.tril(dA, -1), dx), strict=True):
        big = np.abs(b).max()
        assert big > 10, name  # gradients to check
        np.testing.assert_allclose(a, b, atol=5e-6 * big, err_msg=name)
        np.testing.assert_allclose(a, c, atol=2e-5 * big, err_msg=name)
    # the plain solve's backward pass keeps x after each of the 64 rows: 64 x 3,840 bytes
    assert ours_temp * 8 < plain_temp


# measured on 8 seeds of random inputs (T 1, 5, 64 and 150), apart by at most this share of the
# largest entry: outputs 1.7e-6, final states 2.6e-6; held at bfloat16, the final state the float32
# one's rounded, bit for bit (a float32 ulp may yet flip one). On a one-layer model (3 checkpoints x
# 2 inputs, 70 tokens): the runs' logits and the reference's 1.9e-5 apart (|z| <= 15), gradients
# 2.3e-5 of a weight's largest; prefilled into a bfloat16 state, the same state and next logits,
# bit for bit. Tolerances ~10x
@pytest.mark.parametrize("T", [1, 64, 150], ids=["a token", "a chunk", "three chunks"])
def test_the_chunked_rule_is_the_reference(T):
    """lab/chunked.py's delta_rule, the runs' drop-in for qwen3_5.delta_rule: the same outputs and
    final state to float32 rounding. With the state held at bfloat16 each reads it in float32 from
    the call's start to its end (the float32 call's outputs) and rounds it once, at the end, not at
    each chunk's: the float32 final state rounded."""
    *xs, state = delta_rule_inputs(jax.random.key(T), T)
    ref_o, ref_M = jax.jit(qwen3_5.delta_rule)(*xs, state)
    o, M = jax.jit(qwen3_5.delta_rule)(*xs, state.astype(jnp.bfloat16))  # the reference's rounding
    np.testing.assert_array_equal(o, ref_o)
    np.testing.assert_array_equal(M, ref_M.astype(jnp.bfloat16))
    for held, step in [(jnp.float32, 0), (jnp.bfloat16, 2**-8)]:  # step: a bfloat16 one
        o, M = jax.jit(chunked.delta_rule)(*xs, state.astype(held))
        assert M.dtype == held
        np.testing.assert_allclose(o, ref_o, atol=2e-5 * np.abs(ref_o).max())
        rounded = np.asarray(ref_M.astype(held), np.float32)
        big = np.abs(rounded).max()
        np.testing.assert_allclose(np.asarray(M, np.float32), rounded, rtol=step, atol=3e-5 * big)


def delta_rule_inputs(key, T, B=2, U=3, E=8, Y=6):
    """q, k (L2-normed) [B, T, U, E], v [B, T, U, Y], g (log decays) and beta [B, T, U], and a
    state [B, U, E, Y] whose entries are bfloat16 values, held in float32."""
    keys = jax.random.split(key, 6)
    q, k = (l2_norm_rows(jax.random.normal(key, (B, T, U, E))) for key in keys[:2])
    v = jax.random.normal(keys[2], (B, T, U, Y))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (B, T, U)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, U)))
    state = jax.random.normal(keys[5], (B, U, E, Y)).astype(jnp.bfloat16) * 0.3
    return q, k, v, g, beta, state.astype(jnp.float32)


def l2_norm_rows(x):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def test_the_runs_forward_is_the_reference(tiny):
    """lab/models.py's forward for Qwen3.5, the one train.py's runs call: qwen3_5.forward with
    lab/chunked.py's delta rule. Over 70 tokens (two chunks) the trainer's logits and gradient,
    to float32 rounding; as a sampler with the state held at bfloat16, a 70-token prefill's state
    to within a bfloat16 step, and the next token's logits."""
    cfg = dict(tiny.cfg, layer_types=["linear_attention"])  # one layer: a cheaper compile
    tokens, pos = jax.random.randint(jax.random.key(2), (2, 71), 0, 300), arange_pos(2, 71)
    runs = {}
    for name, forward in [("runs", models.model(cfg).forward), ("reference", qwen3_5.forward)]:

        def loss(w, forward=forward):  # the trainer's pass: a loss and the logits
            logits = forward(cfg, w, tokens[:, :70], pos[:, :70])[0]
            return jax.nn.log_softmax(logits).mean(), logits

        def sample(w, forward=forward):  # a prefill into a bfloat16 state, then a token
            kv = qwen3_5.init_kv(cfg, 2, S, state_dtype=jnp.bfloat16)
            _, kv = forward(cfg, w, tokens[:, :70], pos[:, :70], kv, 0)
            logits, kv = forward(cfg, w, tokens[:, 70:], pos[:, 70:], kv, 70)
            return logits, kv["state"].astype(jnp.float32)

        grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(tiny.weights)
        runs[name] = grads, jax.jit(sample)(tiny.weights)
    ((_, logits_runs), ours), (next_runs, state_runs) = runs["runs"]
    ((_, logits_ref), ref), (next_ref, state_ref) = runs["reference"]
    np.testing.assert_allclose(logits_runs, logits_ref, atol=2e-4)
    for name, g in ref["linear"].items():
        big = np.abs(g).max()
        assert big > 1e-3, name
        np.testing.assert_allclose(ours["linear"][name], g, atol=2e-4 * big, err_msg=name)
    np.testing.assert_allclose(state_runs, state_ref, rtol=2**-8, atol=1e-6)
    np.testing.assert_allclose(next_runs, next_ref, atol=ATOL)


def test_chunked_delta_rules_gradient_is_the_recurrences():
    """The trainer's gradient: of the runs' chunked delta rule (70 tokens, two chunks, from a
    state) against the reference's token by token, for every input (q, k, v, g, beta, the state)."""
    B, T, U, E, Y = 2, 70, 3, 8, 6
    keys = jax.random.split(jax.random.key(1), 7)
    q, k = (l2_norm_rows(jax.random.normal(key, (B, T, U, E))) for key in keys[:2])
    v = jax.random.normal(keys[2], (B, T, U, Y))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (B, T, U)))  # log decays
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, U)))
    state = jax.random.normal(keys[5], (B, U, E, Y)) * 0.3
    cotangent = jax.random.normal(keys[6], (B, T, U, Y))

    def loss(rule):  # of the outputs and the final state
        def of(*xs):
            o, end = rule(*xs)
            return (o * cotangent).sum() + end.sum()

        return of

    xs = (q, k, v, g, beta, state)
    rules = (chunked.delta_rule, qwen3_5.delta_rule)
    ours, ref = (jax.jit(jax.grad(loss(rule), range(6)))(*xs) for rule in rules)
    for name, a, b in zip("q k v g beta state".split(), ours, ref, strict=True):
        assert np.abs(b).max() > 0.1, name
        np.testing.assert_allclose(a, b, atol=2e-3 * np.abs(b).max(), err_msg=name)


# --------------------------------------------------------------------------------------------------
# saving: transformers reads what save() writes
@pytest.mark.parametrize("vl, tie", [(False, False), (True, True)], ids=["text", "vl-tied"])
def test_save_is_read_by_transformers_as_the_same_model(tmp_path, vl, tie):
    src = write_tiny_qwen3_5(str(tmp_path / "src"), vl=vl, tie=tie)
    m = hf_checkpoint.load(src)
    hf_checkpoint.save(str(tmp_path / "out"), m.cfg, m.weights)
    assert same(hf_checkpoint.load(str(tmp_path / "out")).weights, m.weights)  # bf16: exact
    saved = reference(str(tmp_path / "out"))
    assert type(saved).__name__ == "Qwen3_5ForCausalLM"
    tokens = np.random.default_rng(5).integers(0, 300, (2, 12))
    np.testing.assert_array_equal(
        torch_logits(saved, tokens), torch_logits(reference(src, vl), tokens)
    )


# --------------------------------------------------------------------------------------------------
# config checks
QWEN3_5_0_8B = {  # Qwen/Qwen3.5-0.8B's config.json, as published
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "image_token_id": 248056,
    "model_type": "qwen3_5",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "initializer_range": 0.02,
        "intermediate_size": 3584,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 8,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "use_cache": True,
        "vocab_size": 248320,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
        },
    },
    "tie_word_embeddings": True,
    "video_token_id": 248057,
    "vision_config": {
        "deepstack_visual_indexes": [],
        "depth": 12,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 768,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 3072,
        "model_type": "qwen3_5",
        "num_heads": 12,
        "num_position_embeddings": 2304,
        "out_hidden_size": 1024,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 248054,
    "vision_start_token_id": 248053,
}
QWEN3_5_0_8B["text_config"]["layer_types"] *= 6


def test_qwen3_5_0_8b_config_is_accepted_and_its_layout_counts_its_parameters(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_5_0_8B))
    cfg, _ = hf_checkpoint.config(tmp_path)
    assert cfg["model_type"] == "qwen3_5_text" and cfg["architectures"] == ["Qwen3_5ForCausalLM"]
    assert cfg["tie_word_embeddings"] and cfg["rope_parameters"]["rope_theta"] == 1e7
    top, stacks = models.qwen3_5_layout(cfg)
    assert stacks["full"][0] == [3, 7, 11, 15, 19, 23] and len(stacks["linear"][0]) == 18
    names = {hf: s for hf, s, _ in top.values()}
    names |= {hf.format(i): s for ids, w in stacks.values() for hf, s, _ in w.values() for i in ids}
    count = sum(int(np.prod(s)) for s in names.values())
    # V·D tied, 6 full-attention layers of 18,352,640, 18 linear of 21,555,360, the final norm
    assert count == 248320 * 1024 + 6 * 18_352_640 + 18 * 21_555_360 + 1024 == 752_393_024
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        ref = transformers.Qwen3_5ForCausalLM(
            transformers.Qwen3_5TextConfig(**QWEN3_5_0_8B["text_config"], tie_word_embeddings=True)
        )
    assert {k: tuple(p.shape) for k, p in ref.named_parameters()} == names


@pytest.mark.parametrize(
    "edit, match",
    [
        (dict(attn_output_gate=False), "attn_output_gate = False"),
        (dict(attention_bias=True), "attention_bias = True"),
        (dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
        (
            dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)),
            "rope_type = 'yarn'",
        ),
        (
            dict(layer_types=["sliding_attention"] + QWEN3_5_LAYERS[1:]),
            "layer_types holds full_attention, linear_attention, sliding_attention",
        ),
        (dict(layer_types=["linear_attention"] * 4), "layer_types holds linear_attention"),
        (dict(linear_num_value_heads=3), "linear_num_value_heads is not a multiple"),
        (dict(linear_key_head_dim=None), "linear_key_head_dim is missing"),
        (dict(num_experts=8), "num_experts = 8"),
    ],
)
def test_unsupported_qwen3_5_configs_are_refused_by_name_before_any_read(
    tmp_path, monkeypatch, edit, match
):
    path = write_tiny_qwen3_5(str(tmp_path), vl=True)
    cfg = json.load(open(f"{path}/config.json"))
    cfg["text_config"] = {k: v for k, v in (cfg["text_config"] | edit).items() if v is not None}
    json.dump(cfg, open(f"{path}/config.json", "w"))
    monkeypatch.setattr(
        np, "memmap", lambda *a, **k: pytest.fail("read a tensor before the checks")
    )
    with pytest.raises(ValueError, match=f"config.json: {match}.*and dense Qwen3.5"):
        hf_checkpoint.load(path)


def test_other_qwen3_5_models_are_refused_by_model_type(tmp_path):
    path = write_tiny_qwen3_5(str(tmp_path), vl=True)
    cfg = json.load(open(f"{path}/config.json"))
    json.dump(dict(cfg, model_type="qwen3_5_moe"), open(f"{path}/config.json", "w"))
    with pytest.raises(ValueError, match="config.json: model_type = 'qwen3_5_moe'"):
        hf_checkpoint.load(path)


# --------------------------------------------------------------------------------------------------
# the state's precision from a prefill, and the order of reading and rounding in the recurrence
def test_a_prefill_hands_on_its_state_at_the_samplers_precision(tiny, fwd):
    """With a bfloat16 state the sampler holds it so from the prompt on, not only while decoding:
    a 40-token prefill (whose outputs read the state in float32: float32's logits) leaves a
    bfloat16-valued state in the cache, the float32 prefill's rounded once, at its end; the
    next token decodes from it, as from the float32 prefill's state rounded here by ml_dtypes."""
    prompt = jax.random.randint(jax.random.key(5), (2, 41), 0, 300)
    pos = arange_pos(2, 41)
    empty = qwen3_5.init_kv(tiny.cfg, 2, S)
    empty_bf16 = qwen3_5.init_kv(tiny.cfg, 2, S, state_dtype=jnp.bfloat16)
    logits_f32, kv_f32 = fwd(tiny.weights, prompt[:, :40], pos[:, :40], empty, 0)
    logits_bf16, kv_bf16 = fwd(tiny.weights, prompt[:, :40], pos[:, :40], empty_bf16, 0)
    np.testing.assert_allclose(logits_bf16, logits_f32, atol=1e-5)
    assert kv_bf16["state"].dtype == jnp.bfloat16
    state, exact = np.asarray(kv_bf16["state"], np.float32), np.asarray(kv_f32["state"])
    rounded = exact.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_allclose(state, rounded, rtol=2**-8)  # within a bfloat16 step
    assert np.abs(state - exact).max() > 1e-4  # rounded, not float32's

    # the next token, decoded from each cache
    token = prompt[:, 40:], pos[:, 40:]
    ours, _ = fwd(tiny.weights, *token, kv_bf16, 40)
    by_hand, _ = fwd(
        tiny.weights, *token, dict(kv_f32, state=jnp.asarray(rounded, jnp.bfloat16)), 40
    )
    unrounded, _ = fwd(tiny.weights, *token, kv_f32, 40)
    np.testing.assert_allclose(ours, by_hand, atol=1e-5)
    assert np.abs(np.asarray(unrounded - by_hand)).max() > 1e-4  # the rounding reaches the logits


def test_a_decoded_tokens_output_reads_the_state_before_it_is_rounded():
    """One token of the recurrence with a bfloat16 state, against float64 numpy on the same
    inputs: the output is q read from the updated state in full precision, and only the state
    handed on is rounded (to within half a bfloat16 step). The order engines use: a fused recurrent
    kernel (flash-linear-attention's, which vLLM and SGLang run for these layers) updates the
    state in float32 registers, computes the output from them, and rounds only the copy it stores
    back in the cache's dtype."""
    B, U, E, Y = 2, 3, 8, 6
    rng = np.random.default_rng(6)
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in rng.normal(size=(2, B, U, E)))
    g = -np.log1p(np.exp(rng.normal(size=(B, U))))  # log decays <= 0
    beta = 1 / (1 + np.exp(-rng.normal(size=(B, U))))
    inputs = [np.float32(x) for x in (q, k, rng.normal(size=(B, U, Y)), g, beta)]
    M = np.float32(rng.normal(size=(B, U, E, Y)).astype(ml_dtypes.bfloat16))  # as a cache holds it
    token = (jnp.asarray(x)[:, None] for x in inputs)  # a T axis of 1: a decoded token
    o, new = qwen3_5.delta_rule(*token, jnp.asarray(M, jnp.bfloat16))
    o = o[:, 0]

    # float64: decay, write, read
    q, k, v, g, beta = (np.float64(x) for x in inputs)
    M = np.float64(M) * np.exp(g)[..., None, None]
    write = (v - np.einsum("bue,buey->buy", k, M)) * beta[..., None]
    M = M + np.einsum("bue,buy->buey", k, write)
    expected = np.einsum("bue,buey->buy", q, M)
    np.testing.assert_allclose(o, expected, atol=1e-5)
    M_bf16 = M.astype(ml_dtypes.bfloat16).astype(np.float64)
    assert np.abs(np.einsum("bue,buey->buy", q, M_bf16) - expected).max() > 1e-3  # if read after
    assert new.dtype == jnp.bfloat16
    new = np.asarray(new, np.float32)
    assert (np.abs(new - M) <= 2**-8 * np.abs(M) + 1e-6).all()
