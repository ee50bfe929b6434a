"""train.main end to end, in seconds on a CPU: metrics, summary and checkpoint; --compare on GSM8K
and the sequence task (drift costs held-out score without centring) and its report and verdict;
resume, Ctrl-C, staleness, and a diverging run that stops with finite weights."""

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import score_centering as sc
import train
from helpers import _strict_json, _strip, spy_loss, tiny_argv, write_gsm8k
from lab import compare, harness, hf_checkpoint, rollouts, tasks
from lab import run as lab_run

# the project root, where train.py is (run as a script by the Ctrl-C test)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_end_to_end_writes_metrics_summary_and_a_checkpoint(
    tmp_path, gsm, capsys, monkeypatch
):
    seen = spy_loss(monkeypatch)
    summary = train.main(
        tiny_argv(
            gsm,
            "--center",
            "--sampler",
            "fp8",
            "--kv-quant",
            "int8",
            "--weight-noise",
            "0.05",
            "--correction",
            "mis:0.5,5",
            "--out",
            str(tmp_path / "run"),
            "--save",
            str(tmp_path / "saved"),
        )
    )
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[:2]:
        keys = ("loss", "grad_norm", "kl_q_p", "logprob_gap", "entropy", "clipped")
        assert all(np.isfinite(r[k]) for k in keys)
    assert rows[0]["drift"] == 0.0 and all("drift" in r and "acc" in r for r in rows)
    assert seen and set(seen) == {True}  # --center reached the loss
    assert json.load(open(tmp_path / "run" / "summary.json")) == summary
    assert set(summary) == {
        "eval_acc",
        "peak_acc",
        "final_acc",
        "drop",
        "drift",
        "final_drift",
        "mean_kl_q_p",
        "kl_q_p",
        "reward",
    }
    assert summary["final_drift"] == rows[-1]["drift"] == summary["drift"]["2"]
    saved = hf_checkpoint.load(str(tmp_path / "saved"))
    assert saved.tokenizer.encode("hi") == hf_checkpoint.load(gsm[0]).tokenizer.encode("hi")
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(saved.weights))


def test_gsm8k_compare_runs_both_arms_from_the_same_start(tmp_path, gsm, capsys, monkeypatch):
    seen = spy_loss(monkeypatch)
    plot = (
        ["--plot", str(tmp_path / "figs" / "cmp.png")]
        if importlib.util.find_spec("matplotlib")
        else []
    )
    summary = train.main(
        tiny_argv(
            gsm,
            "--compare",
            "--sampler",
            "int8",
            "--weight-noise",
            "0.05",
            "--out",
            str(tmp_path / "cmp"),
            *plot,
        )
    )
    text = capsys.readouterr().out
    table = [
        line.split() for line in text.splitlines() if line.startswith(("uncentered ", "centered "))
    ]
    assert [row[0] for row in table] == ["uncentered", "centered"] and seen == [False, True]
    assert float(table[1][3]) == pytest.approx(summary["centered"]["drop"], abs=1e-3)
    assert summary["verdict"].startswith("verdict: ") and "verdict: " in text
    assert text.splitlines()[-1] == summary["verdict"]  # it ends on its table and verdict
    assert not [line for line in text.splitlines() if line.startswith("summary ")]  # in a file
    rows = {
        arm: [json.loads(x) for x in open(tmp_path / "cmp" / arm / "metrics.jsonl")]
        for arm in ("uncentered", "centered")
    }
    # the same weights, data, sampler noise and keys: the first batch is the same batch in both arms
    assert rows["uncentered"][0]["reward"] == rows["centered"][0]["reward"]
    assert rows["uncentered"][0]["kl_q_p"] == rows["centered"][0]["kl_q_p"]
    assert json.load(open(tmp_path / "cmp" / "summary.json")) == summary
    assert not plot or os.path.getsize(tmp_path / "figs" / "cmp.png") > 1000


def test_a_correction_reaches_both_arms_of_a_compare_and_of_a_sweep(tmp_path, capsys, monkeypatch):
    """--correction in a --compare and in a --sweep (one level, one seed, a step): both arms' train
    steps call the loss with that correction, each run logs the share of tokens it clipped, and
    the --compare and --sweep reports name the correction."""
    seen = spy_loss(monkeypatch, "correction")
    flags = "--task sequence --steps 1 --prompts 2 --group 4 --max-tokens 6 --eval-every 1"
    flags += " --eval-n 8 --probe-n 8 --correction ppo:0.2,0.28"  # DAPO's
    made = sc.ppo(0.2, 0.28)
    for extra in ("--compare", "--sweep 0 --seeds 0"):
        seen.clear()
        out = tmp_path / extra.split()[0][2:]
        train.main([*flags.split(), *extra.split(), "--out", str(out)])
        assert seen == [made, made], seen  # one train step traced a arm
        runs = sorted(out.rglob("metrics.jsonl"))
        assert [run.parent.name.split("_")[0] for run in runs] == ["centered", "uncentered"]
        for run in runs:
            assert 0 <= json.loads(run.read_text().splitlines()[0])["clipped"] <= 1, run
    printed = capsys.readouterr().out
    assert "--correction ppo:0.2,0.28, 1 steps" in printed  # the --compare's report
    assert "1 steps, --correction ppo:0.2,0.28, " in printed  # the --sweep's


def test_sequence_task_drift_costs_held_out_score_without_centring(
    tmp_path, capsys, sequence_compare
):
    """The full LLM loop (sampler, KV cache, int8 + noise, top-k record, train step), shortened: on
    two seeds, uncentred GRPO walks farther and its held-out score falls further than centred
    GRPO's. Its four runs, three at once (the sequence task's --workers), log what they log with
    another beside them, row for row (seed 0's two runs, run again two at once), and print a line
    as each finishes; a single seed prints every step instead, each line whole. The four runs:
    conftest's sequence_compare, which test_report recomputes from its files."""
    flags, summary, lines = (sequence_compare[k] for k in ("flags", "summary", "lines"))
    seen = sequence_compare["seen"]
    assert sorted(seen) == [False, True]  # one train step traced per arm, shared by seeds, threads
    # evaluations at steps 0, 4, 8 of 4 runs, three at once: a seed's step 0 (its own random
    # model, the same in both arms) runs once
    assert sequence_compare["greedy_calls"] == 2 + 4 * 2
    one = train.main([*flags, "--seeds", "0", "--workers", "2", "--out", str(tmp_path / "one")])
    assert all(one[name] == summary[name] for name in ("uncentered_seed0", "centered_seed0"))
    one_lines = capsys.readouterr().out.splitlines()
    names = [f"{c}_seed{s}" for s in (0, 1) for c in ("uncentered", "centered")]
    done = [line.split(" | ")[0].split() for line in lines if re.match(r"run +\d+/", line)]
    assert [d[1] for d in done] == ["1/4", "2/4", "3/4", "4/4"]
    assert not [line for line in lines if re.search(r"step +\d+/\d+ \|", line)]
    assert sorted(d[3] for d in done) == sorted(names)
    for name in names:
        rows = [
            _strip(map(json.loads, open(d / name / "metrics.jsonl")))
            for d in (sequence_compare["out"], tmp_path / "one")
            if (d / name).exists()
        ]
        assert rows[0] == rows[-1] and len(rows[0]) == 9 and len(rows) == 2 - name.endswith("1")
        steps = [line for line in one_lines if line.startswith(f"{name}: step ")]
        assert len(steps) == 9 * (not name.endswith("1")), steps
        assert all(line.count(" | ") == 9 for line in steps), steps
    # measured: drops 0.141 and 0.130 uncentred, 0.006 and 0.032 centred; final scores 0.363 and
    # 0.356 against 0.542 and 0.462; final drifts 1.81 and 1.75 against 0.80 and 1.00
    for s in (0, 1):
        off, on = summary[f"uncentered_seed{s}"], summary[f"centered_seed{s}"]
        assert off["eval_acc"]["0"] == on["eval_acc"]["0"]
        assert list(off["eval_acc"]) == ["0", "4", "8"]
        assert off["drop"] > on["drop"] + 0.05 and off["final_acc"] < on["final_acc"] - 0.05, (
            off,
            on,
        )
        assert off["final_drift"] > 1.5 * on["final_drift"] > 0, (off, on)
    table = [line.split() for line in lines if line.split(" ")[0] in names]  # not "name: step"
    assert [row[0] for row in table] == names
    assert float(table[0][3]) == pytest.approx(summary["uncentered_seed0"]["drop"], abs=1e-3)
    assert summary["verdict"] in lines


def test_a_reward_constant_within_each_prompts_group_never_moves_the_policy(tmp_path, monkeypatch):
    """--baseline group: each reward minus the mean of its prompt's G rollouts. A reward that is the
    same for a prompt's G rollouts, and differs between prompts, gives every row advantage 0: the
    weights never move and the drift meter reads exactly 0 at every evaluation. P = 4 prompts of
    G = 2 rollouts, row i of prompt i // G: a mean over groups of P rows would mix prompts."""
    real, seen = tasks.TINY["sequence"], []

    def constant_per_prompt(*a):  # the sequence task, its reward replaced
        def reward(tokens, mask, golds):  # a gold is its prompt: k / 1024, exact group means
            seen.append(np.array([gold[0] / 1024 for gold in golds], np.float32))
            return seen[-1]

        return real(*a)._replace(reward=reward)

    monkeypatch.setitem(tasks.TINY, "sequence", constant_per_prompt)
    flags = "--task sequence --steps 2 --prompts 4 --group 2 --max-tokens 6 --eval-n 16 --probe-n 8"
    train.main([*flags.split(), "--eval-every", "1", "--lr", "0.4", "--out", str(tmp_path / "o")])
    batches = [r.reshape(4, 2) for r in seen if len(r) == 8]  # the training batches, not evals
    assert len(batches) == 2 and all(len(set(r[:, 0])) == 4 for r in batches)  # prompts differ
    assert all((r == r[:, :1]).all() for r in batches)  # a prompt's G rollouts: the same reward
    rows = [json.loads(x) for x in open(tmp_path / "o" / "metrics.jsonl")]
    assert [r["drift"] for r in rows] == [0.0] * 3, rows
    assert [r["grad_norm"] for r in rows[:2]] == [0.0] * 2, rows


def test_resume_gives_the_rows_summary_and_weights_of_a_run_never_interrupted(
    tmp_path, monkeypatch
):
    def flags(lr="1e-3"):
        # a stale float32 sampler with the sequence task's weight noise: the rows depend on the
        # random and the saved state, the saved copy included, back in --sampler's dtype
        return [
            "--task",
            "sequence",
            "--sampler",
            "float32",
            "--steps",
            "4",
            "--save-every",
            "2",
            "--staleness",
            "2",
            "--optimizer",
            "adam",
            "--lr",
            lr,
            "--center",
            "--prompts",
            "2",
            "--group",
            "4",
            "--max-tokens",
            "6",
            "--probe-n",
            "8",
            "--eval-every",
            "1",
            "--eval-n",
            "8",
            "--correction",
            "mis:0.2,5",
        ]

    straight = train.main(flags() + ["--out", str(tmp_path / "a"), "--save", str(tmp_path / "a_w")])

    class Killed(Exception):
        pass

    real = harness.save_state

    def save_then_die(*a):  # the state of step 2 is written, then the process dies
        real(*a)
        raise Killed

    monkeypatch.setattr(harness, "save_state", save_then_die)
    with pytest.raises(Killed):
        train.main(flags() + ["--out", str(tmp_path / "b")])
    monkeypatch.setattr(harness, "save_state", real)
    with open(
        tmp_path / "b" / "metrics.jsonl", "a"
    ) as f:  # a row logged after the state, and one cut short
        f.write(json.dumps({"step": 2, "reward": -1.0}) + '\n{"step": 3, "rew')
    with pytest.raises(SystemExit):
        train.main(flags("2e-3") + ["--resume", str(tmp_path / "b")])  # other flags: refused
    # its own flags
    resumed = train.main(["--resume", str(tmp_path / "b"), "--save", str(tmp_path / "b_w")])
    # the policy moved: drift, a mean over the probe's 8 completions, is of either sign
    assert resumed == straight and straight["drift"]["4"] != 0
    assert not os.path.exists(tmp_path / "b" / "state.npz")  # a finished run frees its state
    rows = [[json.loads(x) for x in open(tmp_path / d / "metrics.jsonl")] for d in ("a", "b")]
    assert _strip(rows[0]) == _strip(rows[1]) and [r["step"] for r in rows[1]] == [0, 1, 2, 3, 4]
    # the row past the saved state is kept aside, not lost; each held-out prompt's score, each step
    aside = [json.loads(x) for x in open(tmp_path / "b" / "metrics.replaced.jsonl")]
    assert aside == [{"step": 2, "reward": -1.0}]
    evals = [[json.loads(x) for x in open(tmp_path / d / "evals.jsonl")] for d in ("a", "b")]
    assert evals[0] == evals[1] and [r["step"] for r in evals[1]] == [0, 1, 2, 3, 4]
    scores = [np.mean(r["rewards"]) for r in evals[0]]
    acc = [r["acc"] for r in rows[0]]  # rewards kept to 6 decimals
    assert len(evals[0][0]["rewards"]) == 8 and scores == pytest.approx(acc, abs=1e-6)
    a, b = (jax.tree.leaves(hf_checkpoint.load(str(tmp_path / d)).weights) for d in ("a_w", "b_w"))
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b, strict=True))


def test_a_resume_with_no_saved_state_starts_over_and_keeps_the_rows_it_had(tmp_path, gsm, capsys):
    """A run without --save-every that stopped before its summary: --resume starts it over at step
    0, says so, and moves the rows it had to metrics.replaced.jsonl and evals.replaced.jsonl."""
    out = tmp_path / "run"
    train.main(tiny_argv(gsm, "--out", str(out)))
    os.remove(out / "summary.json")  # as if stopped after its last row
    had = {n: open(out / f"{n}.jsonl").read() for n in ("metrics", "evals")}
    train.main(["--resume", str(out)])
    assert "at step 0: no saved state" in capsys.readouterr().out
    for name, text in had.items():
        assert open(out / f"{name}.replaced.jsonl").read() == text
        again = [json.loads(x) for x in open(out / f"{name}.jsonl")]
        assert _strip(again) == _strip(json.loads(x) for x in text.splitlines())


def test_a_start_that_fails_leaves_out_as_it_was_and_the_corrected_command_runs(
    tmp_path, gsm, monkeypatch
):
    """A run that fails on its data (a train.jsonl of no problem), its --model folder (a
    config.json without weights) or within its first step has written nothing: --out is not
    there, and the same command, corrected, runs in it. A --compare whose first run fails before
    its first row leaves nothing either: the run queued after it never starts."""
    out, cmp = str(tmp_path / "o"), str(tmp_path / "cmp")
    bad = write_gsm8k(tmp_path / "bad")
    (tmp_path / "bad" / "train.jsonl").write_text("")
    (tmp_path / "weightless").mkdir()
    shutil.copy(os.path.join(gsm[0], "config.json"), tmp_path / "weightless")
    for argv in (
        tiny_argv(gsm, "--data-dir", bad, "--out", out),
        tiny_argv(gsm, "--model", str(tmp_path / "weightless"), "--out", out),
    ):
        with pytest.raises(SystemExit):
            train.main(argv)
        assert not os.path.exists(out), argv

    class Failed(Exception):
        pass

    def fails(*a, **kw):
        raise Failed

    with monkeypatch.context() as m:  # the first step fails, after its run read out's state
        m.setattr(train, "advantage", fails)
        with pytest.raises(Failed):
            train.main(tiny_argv(gsm, "--out", out))
    assert not os.path.exists(out)
    train.main(tiny_argv(gsm, "--out", out))
    assert sorted(os.listdir(out)) == ["evals.jsonl", "metrics.jsonl", "run.json", "summary.json"]

    real, centers = lab_run.run, []

    def first_fails(args, task, fn, center, *rest):
        centers.append(center)
        if len(centers) == 1:
            raise Failed
        return real(args, task, fn, center, *rest)

    with monkeypatch.context() as m:
        m.setattr(lab_run, "run", first_fails)
        with pytest.raises(Failed):
            train.main(tiny_argv(gsm, "--compare", "--out", cmp))
    assert not os.path.exists(cmp) and centers == [False]


def test_a_write_that_dies_midway_leaves_the_old_file_whole(tmp_path):
    """harness.atomic: a write that raises after writing part of the new content leaves the file
    as it was (not the part, not empty); one that finishes replaces it whole."""
    file = str(tmp_path / "summary.json")
    harness.atomic(file, lambda f: f.write('{"step": 1}'))
    assert open(file).read() == '{"step": 1}'

    class Killed(Exception):
        pass

    def dies_midway(f):
        f.write('{"step": 2, "dri')
        f.flush()
        raise Killed

    with pytest.raises(Killed):
        harness.atomic(file, dies_midway)
    assert open(file).read() == '{"step": 1}'
    harness.atomic(file, lambda f: f.write(b'{"step": 3}'), "wb")
    assert open(file).read() == '{"step": 3}'


def test_compare_runs_each_seed_as_that_seed_alone():
    """A seed inside --compare is that seed's run: --compare --seeds 1,3 gives each seed's two arms
    that seed and that seed's own p_0 (not the model of --seed 0), and --compare --seed 3 runs seed
    3, not seed 0 (that a run given a seed is the seed's solo run: the tests above)."""
    hist = dict(last=1, acc={"0": 0.5, "1": 0.5}, drift={"0": 0.0, "1": 0.1}, kl_q_p=[0.01])
    seen = []

    def run(args, task, fn, center, seed, out, prefix=""):  # lab.run.run's signature
        seen.append((seed, center, task.weights))
        return harness.finish(None, hist | dict(reward=[0.5]))

    flags = "--task sequence --compare --steps 1 --eval-n 8 --probe-n 8".split()
    for extra, seeds in ((["--seeds", "1,3"], [1, 3]), (["--seed", "3"], [3])):
        seen.clear()
        args = harness.parse_args([*flags, *extra])
        compare.compare(args, tasks.load(args), None, run)
        assert [(s, c) for s, c, _ in seen] == [(s, c) for s in seeds for c in (False, True)]
        for seed, _, weights in seen:  # that seed's own p_0
            own = tasks.sequence_task(seed, 8, 8).weights
            np.testing.assert_array_equal(weights["embed"], own["embed"])


def test_ctrl_c_stops_within_seconds_and_leaves_valid_metrics(tmp_path, gsm):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        *tiny_argv(gsm, "--steps", "100000", "--out", str(out)),
    ]
    # a terminal's Ctrl-C: a child of a job started in the background (nohup ... &) inherits
    # SIGINT ignored, and would never see the signal this test sends
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(
                os.environ,
                JAX_PLATFORMS="cpu",  # programs this process compiled, reused
                JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            ),
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.time() + 600  # a loaded machine can take minutes to import and compile

    def started():
        metrics = out / "metrics.jsonl"
        return metrics.exists() and metrics.read_text().count("\n") >= 3

    while time.time() < deadline and proc.poll() is None and not started():
        time.sleep(0.2)
    if not started():  # Ctrl-C during start-up is not what this test is about
        proc.kill()
        pytest.fail(f"no 3 steps within 600 s: {proc.communicate()[0][-2000:]}")
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    try:
        text, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running 60 s after Ctrl-C: {proc.communicate()[0][-2000:]}")
    assert time.time() - t0 < 10 and proc.returncode == 130, text
    assert "interrupted at step" in text and "Traceback" not in text, text
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]  # every line is whole
    assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) >= 3


def test_staleness_refreshes_the_sampler_every_s_plus_1_steps(gsm, monkeypatch):
    calls, real = [], train.grpo

    def spy(state, refresh, **kw):  # the loop's refreshes of the sampler's copy, each's kind
        def counted(params):
            calls.append(refresh.keywords["kind"])
            return refresh(params)

        return real(state, refresh=counted, **kw)

    monkeypatch.setattr(train, "grpo", spy)
    sampler = ["--sampler", "fp8", "--kv-quant", "int8"]  # the end-to-end test's sampler and cache
    train.main(tiny_argv(gsm, "--steps", "5", "--eval-every", "5", *sampler, "--staleness", "1"))
    assert calls == ["fp8"] * 3, calls  # steps 0, 2, 4


OVER_2, LARGER = "the centred drop is over 2 points", "the centred drop is the larger"


def rule_says(verdict, expected):  # the rule's result, alone or beside INCONCLUSIVE
    return verdict.startswith(f"verdict: centring {expected}") or (
        verdict.startswith("verdict: INCONCLUSIVE")
        and f"rule alone: centring {expected}" in verdict
    )


@pytest.mark.parametrize(
    "drops, finals, expected",
    [
        (([0.10, 0.08], [0.01, 0.00]), ([0.40, 0.42], [0.41, 0.42]), "VALIDATED"),
        (
            ([0.10, 0.08], [0.05, 0.03]),
            ([0.40, 0.42], [0.41, 0.42]),
            f"NOT validated ({OVER_2} (4.00)):",
        ),
        (
            ([0.10, 0.08], [0.01, 0.00]),
            ([0.40, 0.42], [0.38, 0.40]),
            "NOT validated (the final accuracy is 2.0 points below, over 1.5):",
        ),
        (([0.03, 0.02], [0.01, 0.01]), ([0.40, 0.42], [0.41, 0.42]), "FAILED"),  # 1.5 apart
        # the bounds from accuracies of k/400, as the runs compute them: on every bound at once (a
        # centred drop of 2 points, 3 below the uncentred one, a final 1.5 points below), then one
        # problem of 400 past each
        (([0.85 - 0.80] * 2, [0.80 - 0.78] * 2), ([0.795] * 2, [0.78] * 2), "VALIDATED"),
        (
            ([0.85 - 0.7975] * 2, [0.80 - 0.7775] * 2),
            ([0.7775] * 2,) * 2,
            f"NOT validated ({OVER_2} (2.25)):",
        ),
        (
            ([0.85 - 0.8025] * 2, [0.80 - 0.78] * 2),
            ([0.795] * 2, [0.78] * 2),
            "FAILED",
        ),  # 2.75 apart
        (
            ([0.85 - 0.80] * 2, [0.80 - 0.78] * 2),
            ([0.795] * 2, [0.7775] * 2),
            "NOT validated (the final accuracy is 1.8 points below, over 1.5):",
        ),
    ],
)
def test_verdict(drops, finals, expected):
    """The rule on the means over the seeds, each part that fails named; a bound that accuracies
    of k/400 meet exactly (their differences are not exact in binary) is met."""
    arms = ("uncentered", "centered")
    runs = [
        {arm: dict(drop=drops[i][s], final_acc=finals[i][s]) for i, arm in enumerate(arms)}
        for s in range(2)
    ]
    assert rule_says(compare.verdict(runs), expected)


@pytest.mark.parametrize(
    "drops, inconclusive",
    [
        ([0.85 - 0.8025] * 2, True),  # 4.75 points: one problem of 400 short of 5
        ([0.85 - 0.80] * 2, False),  # 5 points exactly (k/400 accuracies)
        ([0.0, 0.0999], True),  # the mean over the seeds: 4.995
        ([0.30, 0.30], False),
    ],
)
def test_verdict_is_inconclusive_when_the_uncentred_arm_drops_under_5_points(drops, inconclusive):
    """Whether centring prevents a drop can only be asked of runs whose uncentred arm dropped: under
    5 points (the mean over the seeds), INCONCLUSIVE, with the rule's own result beside it."""
    runs = [
        dict(uncentered=dict(drop=u, final_acc=0.4), centered=dict(drop=0.0, final_acc=0.4))
        for u in drops
    ]
    found = compare.verdict(runs)
    assert found.startswith("verdict: INCONCLUSIVE") == inconclusive, found
    assert rule_says(found, "VALIDATED" if np.mean(drops) >= 0.03 else "FAILED")  # 3 points apart


@pytest.mark.parametrize(
    "drop_u, drop_c, expected",
    [
        ((0.01, 0.01), (0.04, 0.04), f"NOT validated ({OVER_2} (4.00); {LARGER}):"),  # 3 worse
        ((0.00, 0.02), (0.02, 0.06), f"NOT validated ({OVER_2} (4.00); {LARGER}):"),  # the means
        ((0.01, 0.01), (0.30, 0.30), f"NOT validated ({OVER_2} (30.00); {LARGER}):"),  # 29 worse
        ((0.01, 0.01), (0.039, 0.039), "FAILED"),  # 2.9 points worse
        ((0.08, 0.08), (0.05, 0.05), f"NOT validated ({OVER_2} (5.00)):"),  # 3 better, drop 5 > 2
        ((0.08, 0.08), (0.051, 0.051), "FAILED"),  # 2.9 better
    ],
)
def test_verdict_calls_drops_3_points_apart_noise_on_neither_side(drop_u, drop_c, expected):
    """Seed noise is drops less than 3 points apart, whichever arm drops more: 3 points apart
    (in the means over the seeds) is a difference, for the centred arm or against it."""
    runs = [
        dict(uncentered=dict(drop=u, final_acc=0.4), centered=dict(drop=c, final_acc=0.4))
        for u, c in zip(drop_u, drop_c, strict=True)
    ]
    assert rule_says(compare.verdict(runs), expected)


def test_a_diverging_run_stops_with_finite_weights_and_strict_json(tmp_path, capsys):
    """At --lr 1e38 the weights blow up within a few steps: the step whose loss, gradient or
    weights are not finite is skipped, the run stops there and says to lower --lr, every file is
    strict JSON, and --save writes finite weights."""
    argv = "--task sequence --steps 6 --lr 1e38 --eval-n 8 --probe-n 8 --eval-every 2".split()
    argv += ["--save-every", "1"]
    out, saved = tmp_path / "o", tmp_path / "w"
    summary = train.main(argv + ["--out", str(out), "--save", str(saved)])
    printed = capsys.readouterr().out
    stopped = re.search(r"step (\d+): the loss, a gradient or a weight is not finite", printed)
    assert stopped and "try a lower --lr (now 1e+38)" in printed, printed[-500:]
    step = int(stopped.group(1))
    assert step < 6 and summary["stopped"].startswith(f"step {step}:")
    assert _strict_json((out / "summary.json").read_text())["stopped"] == summary["stopped"]
    rows = [_strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(step + 1))  # nothing after the stop
    assert any(v is None for v in rows[-1].values())  # the non-finite metric, as null
    assert str(step) in _strict_json((out / "summary.json").read_text())["drift"]
    assert not (out / "state.npz").exists()
    weights = jax.tree.leaves(hf_checkpoint.load(str(saved)).weights)
    assert weights and all(bool(np.isfinite(np.asarray(x)).all()) for x in weights)


def test_compare_report_credits_the_arm_that_was_centred(capsys):
    """Arms that differ clearly: the uncentred runs drop 20 points, the centred ones none. The mean
    rows and the verdict must say so (and would not with the pairs the other way round)."""
    args = harness.parse_args("--task sequence --compare --seeds 0,1".split())

    def summary(peak, final):
        curves = dict(eval_acc={"0": peak, "10": final}, drift={"0": 0.0, "10": 1.0})
        scores = dict(peak_acc=peak, final_acc=final, drop=peak - final, final_drift=1.0)
        return curves | scores | dict(mean_kl_q_p=0.5)

    res = {}
    for seed in (0, 1):
        res[f"uncentered_seed{seed}"] = summary(0.6, 0.4)
        res[f"centered_seed{seed}"] = summary(0.6, 0.6)
    out = compare.report(args, tasks.SEQUENCE, res)
    printed = capsys.readouterr().out
    assert out["verdict"].startswith("verdict: centring VALIDATED")
    assert re.search(r"mean uncentered\s+0\.600\s+0\.400\s+0\.200", printed), printed
    assert re.search(r"mean centered\s+0\.600\s+0\.600\s+0\.000", printed), printed


def test_a_run_says_what_it_does_before_its_first_step(tmp_path, gsm, capsys):
    """Between the config line and step 0: the load, the probe and the first evaluation, each with
    its seconds (the sampler and the drift meter compile there). Generation over several calls says
    the prompts done after each."""
    train.main(tiny_argv(gsm, "--steps", "1", "--out", str(tmp_path / "run")))
    lines = capsys.readouterr().out.splitlines()
    before = lines[1 : next(i for i, line in enumerate(lines) if line.startswith("step "))]
    assert re.fullmatch(r"load: \d+\.\d s", before[0]), before
    assert re.fullmatch(r"probe: 3 completions of p_0, \d+ s", before[1]), before
    assert re.fullmatch(
        r"evaluation: 3 held-out prompts, greedy, 8 rows a device a call", before[2]
    ), before
    assert re.fullmatch(r"evaluation: score \d\.\d{3}, \d+ s", before[3]) and len(before) == 4

    said = []
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

    def sampler(w, prompt, pos, key):
        return dict(tokens=prompt, mask=prompt > 0)

    n = len(jax.devices()) * 2
    key = jax.random.PRNGKey(0)
    out = rollouts.generate(sampler, None, [[1, 2]] * (2 * n + 1), 0, key, data, n, said.append)
    assert len(out["tokens"]) == 2 * n + 1
    assert said == [f"  {k} of {2 * n + 1} prompts" for k in (n, 2 * n, 2 * n + 1)]
    rollouts.generate(sampler, None, [[1, 2]] * n, 0, key, data, n, said.append)  # one call
    assert len(said) == 3
