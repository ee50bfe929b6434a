"""The fixtures shared by tests/: the tiny checkpoint loaded (`tiny`), its forward pass compiled
(`fwd`), a tiny checkpoint beside a tiny GSM8K folder (`gsm`), and a --compare of the sequence task
(`sequence_compare`). Session-scoped: built once per process (per xdist worker), as they were when
every test lived in one module; the --compare once per test run, by the worker that asks first. The
top-level conftest.py sets up XLA and jax (4 CPU devices) before this file is imported.
B batch rows, T query length, D model width, F MLP hidden, H head dimension, N query heads, K
key/value heads, L layers, V vocab, M completion length, k the sampler's top-k head size."""

import contextlib
import fcntl
import io
import json
import os
import pathlib

import jax
import pytest

import qwen3
import train
from helpers import spy_loss, write_gsm8k, write_tiny_checkpoint
from lab import grouped, hf_checkpoint


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return hf_checkpoint.load(write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny"))))


@pytest.fixture(scope="session")
def fwd(tiny):  # qwen3.forward on the tiny model, compiled once per shape
    return jax.jit(
        lambda tokens, pos, kv=None, t0=0: qwen3.forward(
            tiny.cfg, tiny.weights, tokens, pos, kv, t0
        )
    )


@pytest.fixture(scope="session")
def gsm(tmp_path_factory):  # a tiny checkpoint and a tiny GSM8K folder
    root = tmp_path_factory.mktemp("gsm")
    return write_tiny_checkpoint(str(root / "ckpt")), write_gsm8k(root / "gsm8k")


@pytest.fixture(scope="session")
def sequence_compare(tmp_path_factory):
    """The sequence task's --compare of seeds 0 and 1, 8 steps evaluated every 4: what drift costs
    (test_runs), and the numbers lab.report recomputes from its files (test_report), one run for
    both, whichever xdist worker each runs on: the first to ask runs it and writes what it found to
    a JSON file, which a lock keeps the other from reading before it is whole. A dict, as every
    worker reads it back: its flags (less --seeds and --out), folder, summary, printed lines, the
    `center` of each train step it traced, and how many times the greedy sampler really ran."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's folder, above each worker's
    with open(shared / "compare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (shared / "compare.json").exists():
            found = run_sequence_compare(shared / "compare")
            (shared / "compare.json").write_text(json.dumps(found))
    found = json.loads((shared / "compare.json").read_text())
    return found | dict(out=pathlib.Path(found["out"]))


def run_sequence_compare(out):  # sequence_compare's run, into the new folder out
    flags = "--task sequence --compare --steps 8 --eval-every 4 --lr 0.4 --eval-n 128 --probe-n 8"
    greedy_calls, make = [], grouped.make_sampler

    def counted(*a, greedy=False, **k):  # the greedy sampler's real calls (not remembered ones)
        sample = make(*a, greedy=greedy, **k)
        return (lambda *x: greedy_calls.append(1) or sample(*x)) if greedy else sample

    with pytest.MonkeyPatch.context() as m, contextlib.redirect_stdout(io.StringIO()) as printed:
        seen = spy_loss(m)
        m.setattr(grouped, "make_sampler", counted)
        summary = train.main([*flags.split(), "--seeds", "0,1", "--out", str(out)])
    lines = printed.getvalue().splitlines()
    found = dict(flags=flags.split(), out=str(out), summary=summary, lines=lines, seen=seen)
    return found | dict(greedy_calls=len(greedy_calls))
