"""train.py's train step and what feeds it: 1 device against 4 (FSDP, replicated, LoRA),
--plan's bytes per device, two processes against one, micro-batches, group advantages, LoRA's
gradient and merge, --correction reaching the loss (TIS, and PPO's weight at each token's sign),
and devices.join's coordinator timeout."""

import inspect
import json
import os
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import qwen3
import score_centering as sc
import train
from helpers import LLAMA, STOP, _prompts, _strip, arange_pos, write_tiny_checkpoint
from lab import devices, grouped, harness, hf_checkpoint, lora, plan, rollouts, run, tasks
from lab import train_step as lab_step
from lab.devices import shardings
from lab.train_step import make_train_step

# the project root, where train.py is (run as a script by the multi-process tests)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("use_lora", [False, True])
def test_one_device_and_four_devices_give_the_same_step(tiny, use_lora, monkeypatch):
    """Two steps of SGD with momentum on 4 devices, FSDP (weights, gradients, momentum split; LoRA:
    the frozen base split, the adapters whole) and replicated: the loss, metrics and weights of 1
    device; the outputs placed as the inputs came (no recompile). Tolerances: reduction order alone
    (1/2/4/8 devices x one/replicated/FSDP x micro-batch 16/8/4/2, the suite's and XLA's default
    flags, 1 and 2 threads) moved the metrics by <= 1.3e-6 and the weights and momentum (|x| <= 2)
    by <= 3.1e-7; atol 10x that, rounded up."""
    assert jax.device_count() == 4
    prompt, pos = _prompts(tiny.tokenizer, 16)
    out = grouped.make_sampler(tiny.cfg, 8, 8, STOP)(
        train.sampler_weights(tiny.weights, "int8"), prompt, pos, jax.random.PRNGKey(0)
    )
    batch = dict(out, prompt=prompt, pos=pos, adv=jnp.linspace(-1, 1, 16))
    fsdp, res = shardings, {}
    for layout, chips in [
        ("one", jax.devices()[:1]),
        ("replicated", jax.devices()),
        ("fsdp", jax.devices()),
    ]:
        mesh, opt = Mesh(np.array(chips), ("data",)), optax.sgd(0.1, momentum=0.9)
        replicated = NamedSharding(mesh, PartitionSpec())
        monkeypatch.setattr(
            lab_step,
            "shardings",
            (lambda t, m: NamedSharding(m, PartitionSpec())) if layout == "replicated" else fsdp,
        )
        place = lab_step.shardings
        w = jax.tree.map(jnp.copy, jax.device_put(tiny.weights, place(tiny.weights, mesh)))
        # LoRA: they train, w is the frozen base
        adapters = lora.init(w, 4, jax.random.PRNGKey(1), train.INPUT_AXES)
        params = jax.device_put(adapters, replicated) if use_lora else w
        state = opt.init(params)
        state = jax.device_put(state, replicated if use_lora else place(state, mesh))
        step = make_train_step(
            tiny.cfg, opt, 8, mesh, True, sc.tis(2.0), lora_scale=use_lora and 2.0
        )
        placed, metrics = [x.sharding for x in jax.tree.leaves((params, state))], []
        for _ in range(2):  # the second step takes the first one's outputs as they are placed
            params, state, m = step(
                params,
                state,
                jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data"))),
                w if use_lora else None,
            )
            metrics.append(m)
        assert all(
            x.sharding.is_equivalent_to(s, x.ndim)
            for x, s in zip(jax.tree.leaves((params, state)), placed, strict=True)
        )
        res[layout] = params, state, metrics
    gate, mu = (
        (res["fsdp"][0] if not use_lora else w)["layers"]["gate"],
        jax.tree.leaves(res["fsdp"][1]),
    )
    # [L, D, F]: F split over the 4 devices
    assert gate.sharding.shard_shape(gate.shape) == (2, 32, 16)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(res["fsdp"][0]) if use_lora)
    assert use_lora or {
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


@pytest.mark.parametrize("model_type, name", [("qwen3", "Qwen3"), ("llama", "Llama")])
def test_plan_prints_the_bytes_per_device_from_config_json_alone(
    model_type, name, tmp_path, monkeypatch, capsys
):
    """--plan on 4 devices from a folder with config.json only: the weights are split 4 ways
    (matrices) or whole (vectors: a Llama has no QK-norm), Adam holds two of them, and XLA's train
    step takes exactly them plus a quarter batch."""
    kind = LLAMA if model_type == "llama" else {}
    cfg = json.load(open(write_tiny_checkpoint(str(tmp_path / "tiny"), **kind) + "/config.json"))
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
    vectors = D + L * (2 * D + (2 * H if model_type == "qwen3" else 0))
    B, T0, M, k = 8, inspect.signature(plan.plan).parameters["T0"].default, 4, 8
    for rank in (None, 2):
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
            + ["--lora", str(rank)] * bool(rank)
        )
        assert f"--plan: 2-layer {name}" in capsys.readouterr().out
        assert rows["weights"] == 4 * (matrices // 4 + vectors)
        # Σ (in + out) x r
        adapters = 4 * L * rank * (7 * D + 2 * N * H + 2 * K * H + 3 * F) if rank else 0
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
        os.path.join(ROOT, "train.py"),
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
    """Gradient accumulation over micro-batches of sequences of unequal lengths == one batch: the
    same weights, and the same metrics, each a token mean over the batch."""
    prompt, pos = _prompts(tiny.tokenizer, 8)
    out = grouped.make_sampler(tiny.cfg, 10, 4, STOP)(
        train.sampler_weights(tiny.weights, "bf16"), prompt, pos, jax.random.PRNGKey(1)
    )
    batch = dict(out, prompt=prompt, pos=pos, adv=jnp.linspace(-1, 1, 8))
    # micro-batches of 2 rows: pass i holds rows i and i + 4, of unequal numbers of tokens
    tokens = np.asarray(out["mask"]).sum(1)
    assert len(set((tokens[:4] + tokens[4:]).tolist())) > 2, tokens
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    res = [
        make_train_step(tiny.cfg, optax.sgd(1.0), mb, mesh, center=True)(
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
    # the metrics, token means over the batch (a _max: the largest): micro-batches of 2 rows against
    # 8 moved them by <= 6.3e-7 (a sum over the head; kl_q_p 2.7e-7), a mean of the passes' token
    # means instead by 1.2e-3 (the head's sum) to 0.19 (entropy), kl_q_p by 1.9e-3; atol 1e-5
    assert set(res[0][2]) >= {"kl_q_p", "entropy", "drift_size", "tail_ratio_max", "grad_norm"}
    for k in res[0][2]:
        np.testing.assert_allclose(res[0][2][k], res[1][2][k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_masked_tokens_past_the_longest_completion_change_no_step(tiny):
    """A record with 22 more tokens a row, masked, holding random tokens and log q: the same step as
    the record alone (what lets rollouts.generate cut a record after its longest completion)."""
    prompt, pos = _prompts(tiny.tokenizer, 8)
    out = grouped.make_sampler(tiny.cfg, 10, 4, STOP)(
        train.sampler_weights(tiny.weights, "bf16"), prompt, pos, jax.random.PRNGKey(1)
    )
    batch = dict(out, prompt=prompt, pos=pos, adv=jnp.linspace(-1, 1, 8))
    rng = np.random.default_rng(0)

    def more(x):  # 22 more columns of random values of x's kind, masked off
        extra = rng.integers(0, 50, (8, 22, *x.shape[2:])) if x.dtype == jnp.int32 else None
        extra = -rng.exponential(1.0, (8, 22, *x.shape[2:])) if extra is None else extra
        return jnp.concatenate([x, jnp.asarray(extra, x.dtype)], 1)

    longer = dict(batch, **{k: more(batch[k]) for k in ("tokens", "logq", "head_logq", "head_ids")})
    longer["mask"] = jnp.concatenate([batch["mask"], jnp.zeros((8, 22), bool)], 1)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    res = [
        make_train_step(tiny.cfg, optax.sgd(1.0), 4, mesh, center=True)(
            jax.tree.map(jnp.copy, tiny.weights), optax.sgd(1.0).init(tiny.weights), b
        )
        for b in (batch, longer)
    ]
    # tolerances as in the micro-batch test below (the record's length changes the matmuls' shapes
    # and so their reduction order, nothing more)
    for a, b in zip(jax.tree.leaves(res[0][0]), jax.tree.leaves(res[1][0]), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6)
    for k in res[0][2]:
        np.testing.assert_allclose(res[0][2][k], res[1][2][k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_group_advantages():
    r = np.array([1.0, 0, 0, 1, 1, 1])
    np.testing.assert_allclose(train.advantage(r, 3, "group"), [2 / 3, -1 / 3, -1 / 3, 0, 0, 0])
    np.testing.assert_allclose(train.advantage(r, 3, "none"), r)


@pytest.mark.parametrize("b_scale", [0.0, 0.3])
def test_lora_starts_at_the_base_and_its_gradient_is_the_chain_rule(tiny, b_scale):
    """The adapters' gradients are the chain rule of the full gradient at the merged weights W:
    dL/dlora_a = scale · dL/dW lora_bᵀ, dL/dlora_b = scale · lora_aᵀ dL/dW (at lora_b = 0, as
    lora_init starts, merge gives the base and lora_a's gradient is 0)."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    adapters = lora.init(tiny.weights, 4, jax.random.PRNGKey(0), train.INPUT_AXES)
    keys = iter(jax.random.split(jax.random.PRNGKey(1), len(adapters["layers"])))
    for ab in adapters["layers"].values():
        ab["lora_b"] = b_scale * jax.random.normal(next(keys), ab["lora_b"].shape)
    merged = lora.merge(adapters, tiny.weights, 2.0)
    assert b_scale or all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(tiny.weights), strict=True)
    )
    prompt, pos = _prompts(tiny.tokenizer, 8)
    out = grouped.make_sampler(tiny.cfg, 8, 4, STOP)(
        train.sampler_weights(merged, "int8"), prompt, pos, jax.random.PRNGKey(0)
    )
    batch = dict(out, prompt=prompt, pos=pos, adv=jnp.linspace(-1, 1, 8))
    opt = optax.sgd(1.0)  # the update is minus the gradient
    new, _, _ = make_train_step(tiny.cfg, opt, 8, mesh, center=True, lora_scale=2.0)(
        jax.tree.map(jnp.copy, adapters), opt.init(adapters), batch, tiny.weights
    )
    full, _, _ = make_train_step(tiny.cfg, opt, 8, mesh, center=True)(
        jax.tree.map(jnp.copy, merged), opt.init(merged), batch
    )
    new = new["layers"]  # qwen3's one stack of layers
    assert set(new) == {"q", "k", "v", "o", "gate", "up", "down"} and set(new["q"]) == {
        "lora_a",
        "lora_b",
    }
    for name, ab in new.items():
        a, b = adapters["layers"][name]["lora_a"], adapters["layers"][name]["lora_b"]
        gw = (merged["layers"][name] - full["layers"][name]).reshape(*a.shape[:2], -1)
        for got, was, expected in (
            (ab["lora_a"], a, 2.0 * jnp.einsum("lio,lro->lir", gw, b)),
            (ab["lora_b"], b, 2.0 * jnp.einsum("lir,lio->lro", a, gw)),
        ):
            np.testing.assert_allclose(was - got, expected, atol=1e-5, rtol=1e-4, err_msg=name)
        assert float(jnp.abs(ab["lora_b"] - b).max()) > 1e-4, name
        assert b_scale or np.array_equal(ab["lora_a"], a)


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
    script = os.path.join(ROOT, "train.py")
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


def uncentred_step(correction):
    """An uncentred train step of --task sequence, --correction TEXT (None: no flag), on a batch of
    an int8 sampler (advantages -1 to 1): its metrics, the trainer's log p [B, M] and the batch."""
    base = "--task sequence --prompts 2 --group 4 --max-tokens 6".split()
    args = harness.parse_args(base + ([] if correction is None else ["--correction", correction]))
    task = tasks.sequence_task(0, 8, 8)
    fn = run.build(train, args, task.cfg, task.eos)
    w_sampler = train.sampler_weights(task.weights, "int8")
    prompts = [task.train[i // 4][0] for i in range(8)]  # 2 prompts, 4 rows each, as a run's
    data = NamedSharding(fn.mesh, PartitionSpec("data"))
    batch = rollouts.generate(
        fn.samplers(args.sampler), w_sampler, prompts, 0, jax.random.PRNGKey(3), data, 8
    )
    batch["adv"] = np.linspace(-1, 1, 8).astype(np.float32)
    logp = np.asarray(fn.logp(task.weights, batch), np.float64)  # [B, M]
    weights = jax.tree.map(jnp.copy, task.weights)
    state = fn.opt.init(weights)
    _, _, metrics = fn.train_steps[False](weights, state, jax.device_put(batch, data))
    return metrics, logp, batch


def test_tis_cap_flag_reaches_the_loss():
    """--correction tis:C: the uncentred step's loss is the closed form
    -mean_t A min(p/q, C) log p(y), from the trainer's log p and the sampler's recorded log q;
    without the flag, the plain one."""
    values = {}
    for cap in (None, 0.5):
        m, logp, batch = uncentred_step(None if cap is None else f"tis:{cap}")
        ratio = np.exp(logp - batch["logq"])
        w = np.ones_like(ratio) if cap is None else np.minimum(ratio, cap)  # TIS: min(p/q, C)
        mask = batch["mask"]
        expected = -(batch["adv"][:, None] * w * logp * mask).sum() / mask.sum()
        np.testing.assert_allclose(float(m["loss"]), expected, rtol=1e-4, atol=1e-6)
        values[cap] = float(m["loss"])
    assert abs(values[None] - values[0.5]) > 1e-3  # the cap changes the loss here


def test_ppo_flag_reaches_the_loss_at_each_tokens_sign():
    """--correction ppo:EPS_LOW,EPS_HIGH,DUAL_CLIP: the uncentred step's loss is the closed form
    -mean_t A f(r, sign A) log p(y), f from PPO's published objective by autograd: Schulman et
    al.'s clipped surrogate, with Ye et al.'s dual clip c where A < 0,
        L(r) = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), and max(L, c A) where A < 0,
    whose gradient L'(r) r s_y weighs the score s_y by f = r L'(r) / A (r on [0, 1 + eps_high]
    where A > 0, on [1 - eps_low, c] where A < 0, 0 outside). A narrow band, as the ratios here
    lie in 0.78 to 1.16 (or near 0): each of its three bounds drops a token of this batch, and the
    step's `clipped` is the share of tokens dropped."""
    eps_low, eps_high, c = 0.1, 0.02, 1.1

    def surrogate(r, a):
        clipped = jnp.minimum(r * a, jnp.clip(r, 1 - eps_low, 1 + eps_high) * a)
        return jnp.where(a < 0, jnp.maximum(clipped, c * a), clipped)

    m, logp, batch = uncentred_step(f"ppo:{eps_low},{eps_high},{c}")
    r = np.exp(logp - batch["logq"])  # [B, M]
    a = np.broadcast_to(batch["adv"][:, None], r.shape)
    slope = jax.vmap(jax.grad(surrogate))(r.ravel(), a.ravel())  # L'(r): A or 0
    f = r * (np.asarray(slope, np.float64).reshape(r.shape) / a)  # L'(r) / A: 1 or 0
    mask = batch["mask"]
    expected = -(a * f * logp * mask).sum() / mask.sum()
    np.testing.assert_allclose(float(m["loss"]), expected, rtol=1e-4, atol=1e-6)
    for dropped in (a > 0) & (r > 1 + eps_high), (a < 0) & (r < 1 - eps_low), (a < 0) & (r > c):
        assert (dropped & mask).any()  # each bound matters here
    share = ((f != r) & mask).sum() / mask.sum()  # tokens weighted other than by their ratio
    np.testing.assert_allclose(float(m["clipped"]), share, atol=1e-6)


def test_lora_alpha_flag_scales_the_merge_by_alpha_over_rank():
    args = harness.parse_args("--task sequence --lora 4 --lora-alpha 8".split())
    task = tasks.sequence_task(0, 8, 8)
    fn = run.build(train, args, task.cfg, task.eos)
    params = lora.init(task.weights, 4, jax.random.PRNGKey(0), train.INPUT_AXES)
    for k, ab in params["layers"].items():  # B starts at 0: give it values, so the merge shows
        ab["lora_b"] = jax.random.normal(jax.random.PRNGKey(len(k)), ab["lora_b"].shape)
    merged = fn.policy(params, task.weights)
    params = params["layers"]  # qwen3's one stack of layers
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


def test_lora_train_step_and_sampler_merge_with_the_same_alpha_over_rank():
    """--lora 2 --lora-alpha 8 (scale 4): a float32 sampler of the policy's weights (build's
    merge) records log q equal to the train step's log p, token by token, so the step's kl_q_p, the
    token mean of log q - log p, is 0; a step merging with alpha instead of alpha / rank is off."""
    flags = "--task sequence --lora 2 --lora-alpha 8 --prompts 2 --group 4 --max-tokens 6"
    args = harness.parse_args(flags.split())
    task = tasks.sequence_task(0, 8, 8)
    fn = run.build(train, args, task.cfg, task.eos)
    params = lora.init(task.weights, 2, jax.random.PRNGKey(0), train.INPUT_AXES)
    for k, ab in params["layers"].items():  # B starts at 0: give it values, so the merge shows
        ab["lora_b"] = 0.1 * jax.random.normal(jax.random.PRNGKey(len(k)), ab["lora_b"].shape)
    merged = fn.policy(params, task.weights)
    sampler = grouped.make_sampler(
        task.cfg, args.max_tokens, args.topk, task.eos, dict(dtype=jnp.float32, kv_quant=None)
    )
    data = NamedSharding(fn.mesh, PartitionSpec("data"))
    prompts = [task.train[i // 4][0] for i in range(8)]  # 2 prompts, 4 rows each, as a run's
    batch = rollouts.generate(sampler, merged, prompts, 0, jax.random.PRNGKey(3), data, 8)
    batch["adv"] = np.linspace(-1, 1, 8).astype(np.float32)
    _, _, m = fn.train_steps[True](
        params, fn.opt.init(params), jax.device_put(batch, data), task.weights
    )
    # a float32 sampler's log q is the trainer's log p to <= 1e-4 a token (the zero-mismatch test):
    # measured kl_q_p 8e-9, logprob_gap 1.1e-7; the step merging with scale 8, not 4: 3.5 and 3.6
    assert abs(float(m["kl_q_p"])) < 1e-4 and float(m["logprob_gap"]) < 1e-4, m


def assert_a_group_shares_its_prompts_forward(model, n, M, steps=True):
    """n prompts (n even) of unequal lengths, each 4 times, sampled: the trainer's logits with
    group=4 (a prompt's forward once, its cache shared by its 4 rows) are train.py's one plain pass
    over each row's prompt and completion; and (steps) lab/train_step.py's step, of the whole batch
    at group=1, at group=4 on 1 device with a group a micro-batch, and on 4 with micro-batches of 8
    rows (runs of 2 rows on each device), moves the weights as train.py's reference step does."""
    cfg, w = model.cfg, model.weights
    prompt, pos = (np.repeat(x, 4, 0) for x in _prompts(model.tokenizer, n))  # [4n, T0]
    out = grouped.make_sampler(cfg, M, 8, STOP, group=4)(
        train.sampler_weights(w, "bf16"), prompt, pos, jax.random.PRNGKey(2)
    )

    def one_pass(w):  # train.py's reference
        return train.completion_logits(cfg, w, prompt, pos, out["tokens"])

    def shared(w):
        return grouped.completion_logits(cfg, w, prompt, pos, out["tokens"], group=4)

    logits = [jax.jit(f)(w) for f in (one_pass, shared)]
    np.testing.assert_allclose(*logits, atol=1e-4)  # |logits| <= 15; apart: <= 5e-6
    if not steps:
        return
    batch = dict(out, prompt=prompt, pos=pos, adv=jnp.linspace(-1, 1, 4 * n))
    opt = optax.sgd(1.0)
    whole = train.make_train_step(cfg, opt, True)(jax.tree.map(jnp.copy, w), opt.init(w), batch)[0]
    drop_ins = [  # lab/train_step.py's, as the runs take it
        make_train_step(cfg, opt, mb, Mesh(jax.devices()[:d], ("data",)), True, group=g)(
            jax.tree.map(jnp.copy, w), opt.init(w), batch
        )[0]
        for mb, g, d in ((4 * n, 1, 1), (4, 4, 1), (8, 4, 4))
    ]
    # reduction order alone (micro-batches of 8, 4, 2, 1 rows at group=1) moved the weights
    # (|w| <= 2) by <= 1.8e-6 (Qwen3.5; Qwen3: 1.2e-7); the step moves them by 0.1 to 0.3
    for step in drop_ins:
        for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(step), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_group_shares_its_prompts_forward_in_the_train_step(tiny):
    assert_a_group_shares_its_prompts_forward(tiny, 4, 12)
