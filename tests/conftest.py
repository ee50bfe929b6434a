"""The fixtures shared by tests/: the tiny checkpoint loaded (`tiny`), its forward pass compiled
(`fwd`), and a tiny checkpoint beside a tiny GSM8K folder (`gsm`). Session-scoped: built once per
process (per xdist worker), as they were when every test lived in one module. The top-level
conftest.py sets up XLA and jax (4 CPU devices) before this file is imported.
B batch rows, T query length, D model width, F MLP hidden, H head dimension, N query heads, K
key/value heads, L layers, V vocab, M completion length, k the sampler's top-k head size."""

import jax
import pytest

import qwen3
from helpers import write_gsm8k, write_tiny_checkpoint
from lab import hf_checkpoint


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
