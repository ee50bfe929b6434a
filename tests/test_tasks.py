"""tasks.py: GSM8K's reward and files (the real ones when they are beside the project), the
sequence task's reward against numpy, and greedy evaluation."""

import collections
import json
import os
import re
from functools import partial

import jax
import numpy as np
import pytest

import qwen3
import train
from helpers import write_gsm8k
from lab import harness, problems, rollouts, run, tasks

# the project root: GSM8K's files, when present, are in ../shared/gsm8k beside it
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "text, gold, r",
    [
        ("3 + 4 = 7. So the answer is 7.", "7", 1.0),
        ("The answer is $1,234.", "1234", 1.0),
        ("Total: 18.00 dollars", "18", 1.0),
        ("**Answer:** \\boxed{42}", "42", 1.0),
        ("She has -5 apples left", "-5", 1.0),
        ("It costs 0.50 dollars", "0.5", 1.0),
        ("The answer is 7, not 8", "7", 0.0),  # the last number counts
        ("I am not sure", "3", 0.0),
        ("72 / 2 = 36 so 36", "360", 0.0),
        # an integer's zeros are its value: only a decimal's trailing zeros (and point) go
        ("So the total is 100.0", "100", 1.0),
        ("So the total is 100.0", "1", 0.0),
        ("The answer is 1,000", "1000", 1.0),
        ("The answer is 1,000", "1", 0.0),
        ("He walks 20", "20", 1.0),
        ("He walks 20", "2", 0.0),
        ("It costs 0.50", "0.5", 1.0),
        ("It costs 0.50", "5", 0.0),
        ("It costs 0.50", "50", 0.0),
        ("It weighs 30.50 kg", "30.5", 1.0),
        ("It weighs 30.50 kg", "3.5", 0.0),
    ],
)
def test_reward(text, gold, r):
    """1 exactly when the last number, without commas, $ and a decimal's trailing zeros, is gold."""
    assert tasks.reward(text, gold) == r


def test_gsm8k_gold_answers_and_malformed_lines(tmp_path):
    path = tmp_path / "train.jsonl"
    good = json.dumps({"question": "q?", "answer": "2 + 2 = 4\n#### 1,000"}) + "\n"
    for bad in (
        "{not json\n",
        '{"question": "q?", "answer": "no marker"}\n',
        '{"answer": "#### 3"}\n',
    ):
        path.write_text(good + bad)
        with pytest.raises(ValueError, match=f"{path}:2"):
            problems.read_gsm8k(str(tmp_path), "train")
    path.write_text(good)
    assert problems.read_gsm8k(str(tmp_path), "train") == [("q?", "1000")]


GSM8K = os.path.join(ROOT, "..", "shared", "gsm8k")


@pytest.mark.skipif(not os.path.isdir(GSM8K), reason="GSM8K's files are not beside the project")
def test_the_real_gsm8k_files_parse_and_every_reference_solution_earns_its_reward():
    """GSM8K's own train.jsonl and test.jsonl: 7,473 and 1,319 problems, every gold answer a
    number, and every reference solution, given as a completion, rewarded 1 (and a wrong final
    number 0)."""
    for split, n in (("train", 7473), ("test", 1319)):
        found = problems.read_gsm8k(GSM8K, split)
        assert len(found) == n, split
        assert all(re.fullmatch(r"-?\d+(\.\d+)?", gold) for _, gold in found)
        rows = [json.loads(line) for line in open(os.path.join(GSM8K, f"{split}.jsonl"))]
        for row, (question, gold) in zip(rows, found, strict=True):
            assert question == row["question"]
            assert tasks.reward(row["answer"], gold) == 1.0, row["answer"]
            assert tasks.reward(row["answer"] + "\n" + str(float(gold) + 1), gold) == 0.0


def test_trailing_blank_line_is_tolerated(tmp_path):
    data = write_gsm8k(tmp_path / "d", n_train=2)
    with open(os.path.join(data, "train.jsonl"), "a") as f:
        f.write("\n")
    found = problems.read_gsm8k(data, "train")
    assert found == [("What is 0 + 0?", "0"), ("What is 1 + 1?", "2")]


def test_sequence_reward_is_p0_top3_in_the_lower_half_over_the_mask():
    """Completions whose every token is p_0's rank-r token at its prefix, r in 0..5: the reward is
    the fraction of unmasked tokens that are in the lower half of V and ranked in p_0's top 3,
    with the ranks computed here in numpy from p_0's float32 logits."""
    task = tasks.sequence_task(0, 8, 8)
    cfg, V, B, M = task.cfg, task.cfg["vocab_size"], 16, 6
    rng = np.random.default_rng(0)
    prompts = np.array([p for p, _ in task.train[:B]], np.int32)
    seq, ranks = prompts, rng.integers(0, 6, (B, M))
    forward = jax.jit(partial(qwen3.forward, cfg, last=1))  # a compile a length, not an op's each
    for t in range(M):  # append p_0's rank-r token at each prefix
        pos = np.broadcast_to(np.arange(seq.shape[1]), seq.shape)
        with jax.default_matmul_precision("highest"):
            logits = np.asarray(forward(task.weights, seq, pos)[0][:, 0])
        order = np.argsort(-logits, axis=-1, kind="stable")
        seq = np.concatenate([seq, order[np.arange(B), ranks[:, t]][:, None]], 1).astype(np.int32)
    tokens = seq[:, 8:]
    lengths = rng.integers(1, M + 1, B)
    mask = np.arange(M)[None] < lengths[:, None]
    good = (tokens < V // 2) & (ranks < 3) & mask
    expected = good.sum(1) / mask.sum(1)
    assert ((tokens >= V // 2) & (ranks < 3)).any() and (ranks == 3).any()  # the cases that matter
    golds = [list(p) for p in prompts]
    np.testing.assert_allclose(task.reward(tokens, mask, golds), expected, atol=1e-6)


def test_evaluation_is_greedy_the_same_under_two_keys():
    """The held-out completions do not depend on the key: each token is the argmax. (A run passes
    no key at all, and fn.greedy remembers a call by its inputs: two keys, two real calls.)"""
    argv = "--task sequence --steps 1 --eval-n 16 --probe-n 8 --prompts 2 --group 4".split()
    args = harness.parse_args(argv + ["--max-tokens", "6"])
    task = tasks.sequence_task(0, 16, 8)
    fn = run.build(train, args, task.cfg, task.eos)
    prompt, pos = rollouts.left_pad([p for p, _ in task.test], 0)
    outs = [
        fn.greedy(train.sampler_weights(task.weights, "bf16"), prompt, pos, jax.random.PRNGKey(k))
        for k in (0, 1)
    ]
    assert outs[0] is not outs[1]  # two calls, not one remembered
    np.testing.assert_array_equal(outs[0]["tokens"], outs[1]["tokens"])
    np.testing.assert_array_equal(outs[0]["tokens"], outs[0]["head_ids"][..., 0])  # the argmax


def _sum_of(question):  # the arithmetic a question asks for, read from its words alone
    a, b = map(int, re.findall(r"\d+", question))
    if re.search(r"from|added to", question):  # "Subtract 3 from 9", "3 added to 9": b first
        a, b = b, a
    if re.search(r"\+|plus|sum|add", question, re.I):
        return "+", min(a, b), max(a, b), a + b
    if re.search(r"-|minus|difference|take|subtract", question, re.I):
        return "-", a, b, a - b
    assert re.search(r"times|multipl|product|groups| x |\*", question, re.I), question
    return "x", min(a, b), max(a, b), a * b


def test_arithmetic_problems_are_distinct_their_answers_right_and_held_out_sums_unseen(tmp_path):
    """2,000+ distinct training problems and 400 held out; each gold is the question's arithmetic
    read from its words; no held-out sum (3 + 4 and 4 + 3 are one; 9 - 3 its own) in any training
    wording, and sums of every operation held out; the files `python -m lab.problems` writes read
    back as GSM8K's, the same problems."""
    train_set, test_set = problems.arithmetic()
    assert len(set(train_set)) == len(train_set) >= 2000 and len(set(test_set)) == 400
    sums = {}
    for name, split in (("train", train_set), ("test", test_set)):
        sums[name] = {_sum_of(q) for q, _ in split}
        for question, gold in split:
            assert gold == str(_sum_of(question)[3]), question
    assert not sums["train"] & sums["test"] and len(sums["test"]) >= 40
    assert {op for op, *_ in sums["test"]} == {"+", "-", "x"}  # each operation held out
    assert problems.arithmetic() == (train_set, test_set) != problems.arithmetic(seed=1)
    folder = problems.write(str(tmp_path / "arithmetic"))
    assert problems.gsm8k(folder) == (train_set, test_set)


def test_arithmetic_terms_and_answers_are_in_the_documented_ranges(monkeypatch):
    """Every problem, training and held out (none cut at N_TEST), read from its words: the sums of
    two terms from 1 to 12, the differences whose subtracted term and answer are from 1 to 12
    (a sum taken apart), the times tables from 2 to 12, each in ten wordings, and nothing else."""
    monkeypatch.setattr(problems, "N_TEST", 10**6)
    train_set, test_set = problems.arithmetic()
    found = collections.Counter(_sum_of(question) for question, _ in train_set + test_set)
    terms, tables = range(1, 13), range(2, 13)
    add = [("+", min(a, b), max(a, b), a + b) for a in terms for b in terms]
    subtract = [("-", a + b, b, a) for a in terms for b in terms]
    multiply = [("x", min(a, b), max(a, b), a * b) for a in tables for b in tables]
    assert found == collections.Counter(10 * (add + subtract + multiply))
