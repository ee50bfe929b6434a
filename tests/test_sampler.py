"""The sampler side of train.py and rollouts.py: with no mismatch its recorded log q is the
trainer's log p, the mask ends at the first EOS, left padding, inverse-CDF sampling, the weight and
KV-cache quantisation and their errors, the drift meter, and --weight-noise's persistent bias."""

from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import qwen3
import train
from helpers import STOP, _prompts, write_tiny_checkpoint
from lab import grouped, hf_checkpoint, rollouts, tasks


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("where", [train, grouped])  # the reference, and the runs' drop-ins
def test_zero_mismatch_sampler_logq_equals_trainer_logp(tiny, monkeypatch, temperature, where):
    """--sampler float32 (its weights, matmuls and dtype) without noise: recorded log q == the
    train step's log p == one plain pass."""
    # read at trace time by sampler and trainer
    monkeypatch.setattr(where, "TEMPERATURE", temperature)
    prompt, pos = _prompts(tiny.tokenizer, 6)
    numerics = dict(mm=train.quant_mm("float32"), dtype=train.SAMPLER_DTYPES["float32"])
    sample = where.make_sampler(tiny.cfg, 24, 8, STOP, numerics)
    out = sample(train.sampler_weights(tiny.weights, "float32"), prompt, pos, jax.random.PRNGKey(0))
    lengths = np.asarray(out["mask"]).sum(1)
    # stops at different steps
    assert len(set(lengths.tolist())) > 2 and lengths.min() < 24, lengths
    assert len(set((pos >= 0).sum(1).tolist())) > 2  # prompts of different lengths
    logp = jax.nn.log_softmax(
        where.completion_logits(tiny.cfg, tiny.weights, prompt, pos, out["tokens"])
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


def assert_a_group_prefilled_once_samples_as_each(model, n, M, kind, kv, state=None):
    """n prompts, each 4 times: sampled with group=4 (a prompt prefilled once, its cache copied to
    its 4 rows) and with group=1, at W8A8 `kind`, a KV cache of kind `kv` and (Qwen3.5) the state
    at `state`: the same record, and each prompt's 4 rows not all alike."""
    prompt, pos = (np.repeat(x, 4, 0) for x in _prompts(model.tokenizer, n))  # [4n, T0]
    numerics = dict(mm=train.quant_mm(kind), kv_quant=train.kv_quant(kv))
    if state:
        numerics["state_dtype"] = state
    w = train.sampler_weights(model.weights, kind)
    one, shared = (
        grouped.make_sampler(model.cfg, M, 8, STOP, numerics, group=g)(
            w, prompt, pos, jax.random.PRNGKey(1)
        )
        for g in (1, 4)
    )
    for name in one:
        np.testing.assert_allclose(shared[name], one[name], atol=1e-5, err_msg=name)
    tokens = np.asarray(one["tokens"]).reshape(n, 4, -1)
    assert all(len({tuple(r) for r in copies}) > 1 for copies in tokens)  # rows of their own


def test_a_group_of_copies_prefilled_once_samples_as_rows_prefilled_each(tiny):
    """group=4: each run of 4 copies of a prompt is prefilled once and its cache copied; the rows
    sample, and record, what rows prefilled one by one do (bf16, int8 W8A8 with an int4 cache)."""
    for kind, kv in (("bf16", None), ("int8", "int4")):
        assert_a_group_prefilled_once_samples_as_each(tiny, 3, 16, kind, kv)


def on_one_device_and_on_four():  # rows split over 1 device, and over the suite's 4
    meshes = (Mesh(np.array(chips), ("data",)) for chips in (jax.devices()[:1], jax.devices()))
    return [NamedSharding(mesh, PartitionSpec("data")) for mesh in meshes]


@pytest.mark.parametrize("kind, kv", [("bf16", None), ("int8", "int4"), ("fp8", "fp8")])
def test_one_device_and_four_sample_alike(kind, kv):
    """The sequence task's rollouts (2 prompts x 4, a group prefilled once, at the sweep's kinds):
    4 devices that each hold the one device's 8 rows (lab/run.py's probe) record what 1 device
    does, to the bit; the 8 rows split over the 4 (lab/run.py's rollouts), the same tokens and log q
    within float32 rounding (a row's sums follow the rows its device holds: measured <= 3.8e-6;
    atol 2e-5). Without grouped.ROUNDING, log q a bf16 step or more apart (0.3 to 34) and at fp8
    other tokens."""
    task, (one, four) = tasks.sequence_task(0, 8, 8), on_one_device_and_on_four()
    assert four.mesh.size == 4
    numerics = dict(mm=train.quant_mm(kind), kv_quant=train.kv_quant(kv))
    numerics["dtype"] = train.SAMPLER_DTYPES[kind]
    sampler = grouped.make_sampler(task.cfg, 8, 0, task.eos, numerics, group=4)
    w, key = train.sampler_weights(task.weights, kind), jax.random.PRNGKey(1)
    prompts = [p for p, _ in task.train[:2] for _ in range(4)]
    ref, each, split = (
        rollouts.generate(sampler, w, prompts, task.pad, key, data, n)
        for data, n in ((one, 8), (four, 32), (four, 8))
    )
    for name in ref:
        np.testing.assert_array_equal(each[name], ref[name], err_msg=name)
    np.testing.assert_array_equal(split["tokens"], ref["tokens"])
    for name in ("logq", "head_logq"):
        np.testing.assert_allclose(split[name], ref[name], rtol=0, atol=2e-5, err_msg=name)


def test_one_device_and_four_score_alike():
    """The greedy evaluation (clean bf16) of the sequence task's 128 held-out prompts, 64 rows on
    each device a call as lab/run.py lays it out: 4 devices (one call of 4 x 64 rows: the set and
    128 copies of its first prompt) record what 1 device does in two calls, to the bit. Seen
    otherwise: without grouped.ROUNDING, 6 of the 128 rows decode other tokens (log q 0.31 apart
    before they part); with it, the 64 rows of a call split over the 4 (16 a device) put log q up
    to a bf16 step (0.125) apart."""
    task, (one, four) = tasks.sequence_task(0, 128, 8), on_one_device_and_on_four()
    sampler = grouped.make_sampler(task.cfg, 8, 0, task.eos, greedy=True)
    w, test = train.sampler_weights(task.weights, "bf16"), [p for p, _ in task.test]
    ref, each = (
        rollouts.generate(sampler, w, test, task.pad, None, data, n)
        for data, n in ((one, 64), (four, 256))
    )
    for name in ref:
        np.testing.assert_array_equal(each[name], ref[name], err_msg=name)


def test_mask_ends_at_the_first_eos(tiny):
    """The mask holds the completion up to and including its first EOS token, nothing after it."""
    prompt, pos = _prompts(tiny.tokenizer, 8)
    out = grouped.make_sampler(tiny.cfg, 20, 4, STOP)(
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


def test_generate_cuts_the_record_after_its_longest_completion_rounded_up_to_32():
    """Completions of at most 5, 33 and 128 tokens from a sampler of M = 128: records of 32, 64
    and 128 tokens, every masked-in token kept, the rest of each row as the sampler wrote it."""
    for longest, M in [(5, 32), (33, 64), (128, 128)]:
        lengths = np.array([3, longest, 0, 1])

        def sampler(w, prompt, pos, key, lengths=lengths):  # a record of 128 tokens a row
            mask = np.arange(128)[None, :] < lengths[:, None]
            tokens = np.arange(4 * 128).reshape(4, 128)
            return dict(tokens=tokens, mask=mask, head_logq=np.ones((4, 128, 3)))

        key, data = jax.random.PRNGKey(0), jax.devices()[0]
        out = rollouts.generate(sampler, None, [[1, 2]] * 4, 0, key, data, 4)
        assert out["tokens"].shape == out["mask"].shape == (4, M) and out["head_logq"].shape[1] == M
        assert out["mask"].sum(1).tolist() == lengths.tolist()
        assert out["tokens"].tolist() == np.arange(4 * 128).reshape(4, 128)[:, :M].tolist()


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
        out = grouped.make_sampler(
            tiny.cfg, 12, 4, (), dict(dtype=jnp.float32, kv_quant=train.kv_quant(kind))
        )(tiny.weights, prompt, pos, jax.random.PRNGKey(0))
        logp = grouped.token_logp(tiny.cfg, tiny.weights, dict(out, prompt=prompt, pos=pos))
        gaps.append(float(jnp.abs(logp - out["logq"]).mean()))
    assert all(1e-5 < g < 0.5 for g in gaps), gaps


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


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_w8a8_quantises_every_matmul_weight_the_embedding_and_untied_head_included(tmp_path, kind):
    """W8A8 (--sampler int8 / fp8): every value of an output channel of each matmul weight, the
    embedding and an untied output head included, is k s rounded to bf16, s = the channel's
    max |w| / qmax and k an int8 level (an integer, |k| <= 127: at most 255 values a channel) or a
    float8 e4m3 value."""
    w = hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path), tie=False)).weights
    assert {"embed", "lm_head"} <= set(w) and {"embed", "lm_head"} <= set(train.INPUT_AXES)
    out = train.sampler_weights(w, kind)
    qmax = dict(int8=127, fp8=448)[kind]
    for name, axes in train.INPUT_AXES.items():
        if name not in w and name not in w["layers"]:  # Qwen3.5's (tests/test_qwen3_5_train.py)
            continue
        x, y = (w, out) if name in w else (w["layers"], out["layers"])
        x, y = np.asarray(x[name], np.float32), np.asarray(y[name])  # y: bf16
        s = np.abs(x).max(axis=axes, keepdims=True) / np.float32(qmax)  # a scale a channel
        levels = y.astype(np.float32) / s  # within bf16's rounding (2^-8) of k
        if kind == "int8":
            k = np.round(levels)
            assert np.abs(k).max() <= 127, name
        else:
            k = levels.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        # bf16 rounds k s by at most 2^-8 of it; k s can be a tie (k m / qmax, m a bf16 max) that
        # the last bit of s, computed in float32 as x / qmax or x · (1 / qmax), sends either way
        err = np.abs(y.astype(np.float32) - k * s)
        assert (err <= 2.0**-8 * np.abs(k * s) * (1 + 1e-6)).all(), (name, err.max())
        assert not np.array_equal(y, x.astype(ml_dtypes.bfloat16)), name  # bf16 alone is not it


def test_weight_noise_is_drawn_independently_for_each_weight(tiny):
    """--weight-noise σ: the copy is w (1 + σ ε) with its own ε ~ N(0, 1) for each weight: gate and
    up given the same values get uncorrelated relative noise, each of mean 0 and std σ."""
    layers = tiny.weights["layers"]
    w = dict(tiny.weights, layers=dict(layers, up=layers["gate"]))  # the same array twice
    out = train.sampler_weights(w, "bf16", 0.1, jax.random.PRNGKey(0))
    x = np.asarray(layers["gate"], np.float32)  # [L, D, F]: 4,096 values, none 0
    assert np.abs(x).min() > 0
    eps = [(np.asarray(out["layers"][k], np.float32) / x - 1) / 0.1 for k in ("gate", "up")]
    for e in eps:  # bf16 rounding adds <= 2^-9 / 0.1 = 0.02 to each ε; sampling: std 1/64
        assert abs(e.mean()) < 0.1 and 0.9 < e.std() < 1.1, (e.mean(), e.std())
    # independent draws: a correlation of std 1/64 around 0; one key for both: 1
    assert abs(np.corrcoef(eps[0].ravel(), eps[1].ravel())[0, 1]) < 0.1


def test_fake_quantisation_error_is_bounded():
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 32))
    for kind, rel in (("int8", 0.5 / 127), ("fp8", 2.0**-4)):
        y = train.fake_quant(x, (1,), kind)
        amax = jnp.abs(x).max(1, keepdims=True)
        assert 0 < float(jnp.abs(y - x).max()) and bool(
            (jnp.abs(y - x) <= rel * amax + 1e-6).all()
        ), kind


def test_drift_meter_is_zero_at_the_start_and_the_definition_after(tiny):
    prompt, pos = _prompts(tiny.tokenizer, 6)
    out = grouped.make_sampler(tiny.cfg, 10, 1, STOP)(
        train.sampler_weights(tiny.weights, "bf16"), prompt, pos, jax.random.PRNGKey(0)
    )
    probe = dict(
        prompt=prompt, pos=pos, tokens=np.asarray(out["tokens"]), mask=np.asarray(out["mask"])
    )
    logp = jax.jit(partial(grouped.token_logp, tiny.cfg))
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


def test_a_remembered_call_runs_again_only_when_an_input_differs_by_a_bit_dtype_or_shape():
    """rollouts.remembered (the held-out score at step 0, computed once in a --compare): equal
    copies of the inputs reuse the first result; a flipped bit, another dtype with the same bytes,
    or another shape of the same bytes is a new call."""
    calls = []

    def fn(w, x):
        calls.append(1)
        return {"y": np.asarray(w["a"]).sum() + np.asarray(x).sum()}

    f = rollouts.remembered(fn)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    first = f({"a": jnp.asarray(a)}, jnp.zeros(2, jnp.float32))
    assert f({"a": jnp.asarray(a.copy())}, jnp.zeros(2, jnp.float32)) is first and len(calls) == 1
    flipped = a.copy()
    flipped.view(np.uint32)[0, 0] ^= 1  # 0.0 -> the smallest subnormal
    others = [
        ({"a": jnp.asarray(flipped)}, jnp.zeros(2, jnp.float32)),
        ({"a": jnp.asarray(a)}, jnp.zeros(2, jnp.int32)),  # the same bytes as float32 zeros
        ({"a": jnp.asarray(a.reshape(3, 2))}, jnp.zeros(2, jnp.float32)),
    ]
    for n, inputs in enumerate(others, 2):
        f(*inputs)
        assert len(calls) == n, inputs
