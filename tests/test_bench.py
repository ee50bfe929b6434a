"""bench.py: the timing rounds, the sampler and train-step figures on faked timings, the bytes a
decode step reads and the FLOPs of a train step counted by hand, and bad flags; lab/accelerator.sh,
which runs it on a GPU, run whole at toy size."""

import importlib.util
import json
import os
import subprocess
import sys
from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qwen3_5
from lab import bench, tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project's folder


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


def test_bench_measures_a_cpus_peaks_from_the_median_rounds(monkeypatch):
    """No spec sheet for a CPU: FLOP/s = 2 x 2048³ / the 2048 x 2048 matmul's median time, and
    bytes/s = 2 x 1 GiB / the copy's median time (a copy reads its bytes and writes them)."""
    seen, made = [], []

    def fake_rounds(calls, repeats):  # the figures from these times, none from a clock
        seen.append((sorted(calls), repeats))
        times = dict(matmul=[0.5, 0.1, 0.2, 9.0, 0.4], copy=[0.3, 0.01, 0.05, 0.02, 0.6])
        return dict.fromkeys(calls, 99.0), times

    def zeros(shape):  # jnp's float32, not filled (numpy's pages come zeroed when touched)
        made.append(np.zeros(shape, np.float32))
        return made[-1]

    monkeypatch.setattr(bench, "timed_rounds", fake_rounds)
    fast = dict(zeros=zeros, ones=lambda shape: np.ones(shape, np.float32))
    monkeypatch.setattr(bench, "jnp", SimpleNamespace(**vars(jnp) | fast))
    assert not any(name in jax.devices()[0].device_kind for name in bench.PEAKS)
    flops, bandwidth, source = bench.peaks(5)
    assert seen == [(["copy", "matmul"], 5)] and source == "measured"
    assert flops == pytest.approx(2 * 2048**3 / 0.4)  # medians: 0.4 s, 0.05 s
    assert len(made) == 1 and made[0].nbytes == 2**30  # the copy's 1 GiB
    assert bandwidth == pytest.approx(2 * 2**30 / 0.05)


def test_bench_decode_reads_weights_head_and_both_k_and_v():
    # L 2, D 8, N 2, K 1, H 4, V 16, bf16: 2 bytes a number
    layers = dict(
        q=jnp.zeros((2, 8, 2, 4), jnp.bfloat16),  # 128 numbers
        k=jnp.zeros((2, 8, 1, 4), jnp.bfloat16),  # 64
        norm=jnp.zeros((2, 8), jnp.bfloat16),  # 16
    )
    w = dict(embed=jnp.zeros((16, 8), jnp.bfloat16), norm=jnp.zeros(8), layers=layers)
    # B 3, T0 5, M 2: a cache of 7 positions, K and V each 2 x 3 x 7 x 1 x 4 numbers
    cache = dict(k=jnp.zeros((2, 3, 7, 1, 4), jnp.bfloat16), pos=jnp.zeros((3, 7), jnp.int32))
    cache["v"] = cache["k"]
    kv = 2 * (2 * 3 * 7 * 1 * 4) * 2
    assert kv == 672
    # the layers, the final norm (float32), the head (tied: the embedding), K and V
    assert bench.decode_bytes(w, cache) == (128 + 64 + 16) * 2 + 8 * 4 + 16 * 8 * 2 + kv
    untied = dict(w, lm_head=jnp.zeros((8, 16)))  # the head read instead of the embedding: float32
    assert bench.decode_bytes(untied, cache) == (128 + 64 + 16) * 2 + 8 * 4 + 16 * 8 * 4 + kv


def test_bench_decode_reads_qwen3_5s_conv_window_and_float32_state():
    """tasks.HYBRID (3 linear layers: J 2, E 16, U 4, Y 16, kernel 4; 1 full: K 2, H 16) at B 3,
    T0 5, M 2, its cache's shapes as the bf16 sampler makes it, counted by hand."""
    cfg = tasks.HYBRID
    cache = jax.eval_shape(partial(qwen3_5.init_kv, cfg, 3, 7, jnp.bfloat16))
    conv = 3 * 3 * (4 - 1) * (2 * 2 * 16 + 4 * 16) * 2  # the last 3 inputs of C = 128 channels
    state = 2 * 3 * 3 * 4 * 16 * 16 * 4  # float32, whatever the sampler's dtype: read and written
    kv = 2 * 1 * 3 * 7 * 2 * 16 * 2
    w = dict(embed=jnp.zeros((1024, 64), jnp.bfloat16))  # the head, and no other weight
    assert bench.decode_bytes(w, cache) == 1024 * 64 * 2 + conv + state + kv


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
    assert bench.train_flops({}, w, 3, 5, 2) == 3 * 3 * forward  # forward, and backward's 2 x


def test_bench_train_flops_of_qwen3_5_count_both_kinds_of_layer():
    """tasks.HYBRID (D 64, F 128, V 1,024; 3 linear layers: J 2, E 16, U 4, Y 16, C 128, kernel 4;
    1 full: N 4 (q and its gate), K 2, H 16) at B 2, T0 6, M 4 (T 10), counted by hand."""
    w = jax.eval_shape(partial(tasks.init, tasks.HYBRID, np.random.default_rng(0)))
    mlp = 3 * 64 * 128
    linear = 64 * 128 + 64 * 4 * 16 + 2 * 64 * 4 + 4 * 128 + 4 * 16 * 64 + mlp  # qkv z b a conv out
    full = 64 * 4 * 32 + 2 * 64 * 2 * 16 + 4 * 16 * 64 + mlp  # q (with its gate), k, v, o
    forward = 2 * 10 * (3 * linear + full) + 2 * 5 * 1024 * 64  # matmuls, the head at M + 1
    forward += 4 * 1 * 10 * 10 * 4 * 16  # one full layer's scores and mix
    forward += 6 * 10 * 3 * 4 * 16 * 16  # the delta rule: M^T k, the write, q^T M a value head
    assert bench.train_flops(tasks.HYBRID, w, 2, 6, 4) == 3 * 2 * forward


@pytest.mark.parametrize(
    "argv", [["--repeats", "0"], ["--new", "1"], ["--batch", "1,x"], ["--rows", "3"]]
)
def test_bench_refuses_a_bad_flag_in_one_line(argv, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    error = capsys.readouterr().err.splitlines()[-1]
    assert "error: " in error and argv[0] in error


def test_the_accelerator_script_runs_at_toy_size(gsm, tmp_path):
    """lab/accelerator.sh, the prepared first run on a GPU, end to end on the CPU with
    ACCELERATOR_TOY: the tiny checkpoint in place of both models (so benched once: the loop's one
    pass runs the line both benches take), every part shrunk. The bench writes its tables, the
    comparison trains both arms on --task arithmetic at fp8 + fp8 KV and prints the verdict: a
    step that no longer runs fails here, not after a GPU's minutes."""
    out = tmp_path / "out"
    env = dict(os.environ, ACCELERATOR_TOY=gsm[0], JAX_PLATFORMS="cpu")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # this python
    env["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir  # the benches share
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    done = subprocess.run(
        ["bash", "lab/accelerator.sh", str(out)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    bench_json = json.load(open(out / "bench-smollm2.json"))
    assert [r["sampler"] for r in bench_json["sampler"]] == ["bf16", "bf16", "int8"]
    assert {r["train"] for r in bench_json["train"]} == {"uncentred", "centred"}
    run = json.load(open(out / "compare" / "run.json"))
    assert (run["task"], run["sampler"], run["kv_quant"], run["lr"]) == (
        "arithmetic",
        "fp8",
        "fp8",
        0.01,
    )
    summary = json.load(open(out / "compare" / "summary.json"))
    assert "verdict: " in open(out / "compare.txt").read() and summary["verdict"]
    assert os.path.exists(out / "compare.png") == bool(importlib.util.find_spec("matplotlib"))
