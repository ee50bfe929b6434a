"""The chain task (GSM8K's shape: one binary reward after a long completion) against a brute-force
reward, and the mismatch kinds of the field's collapses: an int4 KV cache, sweep levels that pair
W8A8 weights with a quantised cache, and the mismatch between evaluations in each run's summary."""

import argparse
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train
from lab import compare, harness, models, tasks


def jitted_forward(cfg):  # the model's forward at the last position, compiled a shape at a time
    return jax.jit(partial(models.model(cfg).forward, cfg, last=1))


def brute_force_good(task, seq, T0):
    """good [B, M]: token t of each row is in the lower half of V and in p_0's top 3 at its prefix,
    from one forward pass per prefix (no cache)."""
    good = []
    for t in range(T0, seq.shape[1]):
        pos = np.broadcast_to(np.arange(t), (seq.shape[0], t))
        with jax.default_matmul_precision("highest"):
            logits = np.asarray(jitted_forward(task.cfg)(task.weights, seq[:, :t], pos)[0])
        chosen = logits[np.arange(len(seq)), 0, seq[:, t]]
        rank = (logits[:, 0] > chosen[:, None]).sum(-1)
        good.append((seq[:, t] < task.cfg["vocab_size"] // 2) & (rank < tasks.TEACHER_TOP))
    return np.stack(good, 1)


@pytest.mark.parametrize("cfg", [tasks.SEQUENCE, tasks.HYBRID], ids=["qwen3", "qwen3_5"])
def test_chain_reward_is_one_bit_for_the_share_of_good_tokens(cfg):
    """Completions that aim at a pattern of good and bad tokens (good: the best lower-half token in
    p_0's top 3; bad: p_0's rank-8 token), some cut short by the mask: the reward is 1 exactly when
    at least CHAIN_PASS of the kept tokens are good, counted one prefix at a time; the cases
    include shares just under, at and above the bar. On the tiny Qwen3 and Qwen3.5 (chain-hybrid's
    model: its own bar, HYBRID_PASS, is a number like this one)."""
    task = tasks.chain_task(1, 8, 8, cfg)
    cfg, V, B, M = task.cfg, task.cfg["vocab_size"], 12, 5
    rng = np.random.default_rng(1)
    prompts = np.array([p for p, _ in task.train[:B]], np.int32)
    aim = rng.random((B, M)) < np.linspace(0.2, 1.0, B)[:, None]  # [B, M] good wanted
    aim[:6] = [[1, 1, 1, 0, 0], [0, 1, 0, 1, 1], [1, 0, 1, 1, 0], [1, 1, 0, 0, 0], [1] * 5, [0] * 5]
    seq = prompts
    for t in range(M):
        pos = np.broadcast_to(np.arange(seq.shape[1]), seq.shape)
        with jax.default_matmul_precision("highest"):
            logits = np.asarray(jitted_forward(cfg)(task.weights, seq, pos)[0])[:, 0]
        order = np.argsort(-logits, axis=-1, kind="stable")  # [B, V]: p_0's ranking
        top = order[:, : tasks.TEACHER_TOP]
        lower = np.where(top < V // 2, top, top[:, :1])  # a lower-half top-3 token, if any
        best = lower[np.arange(B), np.argmax(top < V // 2, 1)]
        pick = np.where(aim[:, t], best, order[:, 8])
        seq = np.concatenate([seq, pick[:, None]], 1).astype(np.int32)
    tokens = seq[:, 8:]
    mask = np.arange(M)[None] < np.where(np.arange(B) < 8, M, rng.integers(2, M, B))[:, None]
    share = (brute_force_good(task, seq, 8) & mask).sum(1) / mask.sum(1)
    expected = (share >= tasks.CHAIN_PASS).astype(np.float32)
    golds = [list(p) for p in prompts]
    np.testing.assert_array_equal(np.asarray(task.reward(tokens, mask, golds)), expected)
    assert (share == tasks.CHAIN_PASS).any() and (share < tasks.CHAIN_PASS).any()  # the bar itself
    assert set(expected) == {0.0, 1.0}


def test_chain_task_is_the_sequence_task_with_a_binary_reward():
    """The same p_0, prompts and probe as the sequence task of the seed; the held-out and probe
    prompts are none of the training prompts."""
    seq, chain = tasks.sequence_task(2, 16, 8), tasks.chain_task(2, 16, 8)
    assert chain.train == seq.train and chain.test == seq.test and chain.probe == seq.probe
    for name in ("embed", "norm"):
        np.testing.assert_array_equal(chain.weights[name], seq.weights[name])
    trained = {tuple(p) for p, _ in chain.train}
    assert not trained & {tuple(p) for p, _ in chain.test} and not trained & set(
        map(tuple, chain.probe)
    )


def test_int4_kv_cache_holds_15_levels_per_token_and_head():
    """int4: one scale per token and head, max|a| / 7; every value a multiple of it in [-7, 7]."""
    a = 3 * jax.random.normal(jax.random.PRNGKey(0), (2, 5, 2, 16))  # [B, T, K, H]
    int4 = np.asarray(train.kv_quant("int4")(a), np.float64)
    scale = np.asarray(jnp.abs(a).max(3, keepdims=True), np.float64) / 7
    levels = int4 / scale
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)
    assert np.abs(np.round(levels)).max() == 7 and len(np.unique(np.round(levels))) <= 15
    assert 0 < np.abs(int4 - np.asarray(a)).max() and (np.abs(int4 - a) <= scale / 2 + 1e-6).all()
    int8_gap = np.abs(np.asarray(train.kv_quant("int8")(a)) - np.asarray(a)).mean()
    assert np.abs(int4 - np.asarray(a)).mean() > 5 * int8_gap  # 7 levels a side, not 127


def test_sweep_levels_pair_weights_with_a_kv_cache():
    levels = harness.levels("0,0.02,int8,fp8+kv_fp8,int8+kv_int4,0.01+kv_int8")
    assert levels == [
        ("bf16", 0.0, None),
        ("bf16", 0.02, None),
        ("int8", 0.0, None),
        ("fp8", 0.0, "fp8"),
        ("int8", 0.0, "int4"),
        ("bf16", 0.01, "int8"),
    ]
    chain = harness.parse_args("--task chain --sweep".split())
    assert chain.sweep == harness.levels(tasks.SWEEP_LEVELS["chain"]) and chain.seeds == tuple(
        range(8)
    )


@pytest.mark.parametrize(
    "argv, match",
    [
        ("--task chain --sweep int8+kv_int3", "--sweep levels"),
        ("--task chain --sweep fp8 --kv-quant int8", "--kv-quant"),
        ("--task chain --kv-quant int2", "--kv-quant"),
    ],
)
def test_bad_levels_and_kv_kinds_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        harness.parse_args(argv.split())
    assert match in capsys.readouterr().err


def test_each_sweep_level_runs_with_its_own_sampler_noise_and_kv_cache(tmp_path):
    """compare gives every run of a level that level's sampler, noise and KV cache, and names the
    level after all three."""
    argv = "--task chain --sweep 0.02,int8+kv_int4,fp8+kv_fp8 --seeds 0 --steps 2 --eval-every 1"
    args = harness.parse_args(argv.split() + ["--out", str(tmp_path)])
    seen = []

    def run(level_args, task, fn, center, seed, out, prefix=""):  # lab.run.run's signature
        seen.append((level_args.sampler, level_args.weight_noise, level_args.kv_quant, out))
        steps = {"0": 0.4, "1": 0.5, "2": 0.5}
        drift = {"0": 0.0, "1": 0.1, "2": 0.2}
        return dict(eval_acc=steps, drift=drift, final_drift=0.2, mean_kl_q_p=0.01, kl_q_p={})

    task = argparse.Namespace(cfg=tasks.SEQUENCE)
    compare.compare(args, task, None, run)
    assert sorted({s[:3] for s in seen}) == [
        ("bf16", 0.02, None),
        ("fp8", 0.0, "fp8"),
        ("int8", 0.0, "int4"),
    ]
    folders = {s[3].split("/")[-2] for s in seen}  # out/LEVEL/RUN
    assert folders == {"bf16_noise0.02", "int8_kv_int4", "fp8_kv_fp8"}


def test_summary_gives_the_mean_mismatch_between_evaluations():
    """kl_q_p at evaluation step b: the mean of the updates' kl_q_p from the last evaluation a to
    b (steps a .. b - 1)."""
    hist = dict(last=6, acc={"0": 0.1, "2": 0.2, "6": 0.3}, drift={"0": 0.0, "2": 1.0, "6": 2.0})
    hist |= dict(kl_q_p=[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], reward=[0.5] * 6)
    summary = harness.finish(None, hist)
    assert summary["kl_q_p"] == {"2": 1.5, "6": 4.5} and summary["mean_kl_q_p"] == 3.5
