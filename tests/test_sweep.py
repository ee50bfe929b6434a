"""sweep.py: the t quantile, the paired interval, the verdict, a level's row and from_step on
made-up runs, the report's columns, summary and figures, a run's progress line, and a short real
sweep (a line a run, then the tables)."""

import argparse
import json
import math
import os
import re

import numpy as np
import pytest

import train
from helpers import (
    _strict_json,
)
from lab import compare, sweep


def _sweep_run(scores, drifts, kl=0.01):  # a run's summary (harness.finish), evaluations every 50
    steps = [str(50 * i) for i in range(len(scores))]
    return dict(
        eval_acc=dict(zip(steps, scores, strict=True)),
        drift=dict(zip(steps, drifts, strict=True)),
        final_acc=scores[-1],
        peak_acc=max(scores),
        final_drift=drifts[-1],
        mean_kl_q_p=kl,
        kl_q_p=dict.fromkeys(steps[1:], kl),  # between evaluations
        reward=0.5,
        drop=max(scores) - scores[-1],
    )


def _level(u_scores, c_scores, u_drifts, c_drifts):  # {run: summary} as --compare orders them
    res = {}
    for seed, runs in enumerate(zip(u_scores, c_scores, u_drifts, c_drifts, strict=True)):
        res[f"uncentered_seed{seed}"] = _sweep_run(runs[0], runs[2], kl=0.1 * seed)
        res[f"centered_seed{seed}"] = _sweep_run(runs[1], runs[3], kl=0.1 * seed + 0.05)
    return res


def _t2(p=0.975):  # Student's t quantile, df 2, closed form: F(t) = 1/2 + t / (2√(2 + t²))
    a = 2 * p - 1
    return a * math.sqrt(2 / (1 - a * a))


def test_t_quantile_matches_closed_forms_and_tables():
    """df 1 (Cauchy: tan(π(p - 1/2))) and df 2 in closed form, at two levels; df 3, 7, 29 and a
    large df (the normal's 1.959964) against printed tables."""
    for p in (0.975, 0.995):
        assert sweep.t_quantile(1, p) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-7)
        assert sweep.t_quantile(2, p) == pytest.approx(_t2(p), rel=1e-7)
    table = {1: 12.7062, 3: 3.18245, 7: 2.36462, 29: 2.04523, 10**6: 1.95996}
    for df, t in table.items():
        assert sweep.t_quantile(df) == pytest.approx(t, abs=6e-5), df


def test_interval_is_the_paired_t_interval_by_hand():
    """[1, 2, 3, 4]: mean 2.5, sample sd √(5/3) = 1.29099, t(0.975, 3) = 3.18245, half-width
    3.18245 · 1.29099 / 2 = 2.0543; one value: a mean and no interval."""
    mean, lo, hi = sweep.interval([1, 2, 3, 4])
    assert mean == pytest.approx(2.5)
    assert (lo, hi) == pytest.approx((2.5 - 2.0543, 2.5 + 2.0543), abs=1e-4)
    mean, lo, hi = sweep.interval([3.0])
    assert mean == 3.0 and math.isnan(lo) and math.isnan(hi)


def test_verdict_reads_the_interval():
    """Above 0: pays; below: costs; across 0: the largest |value| it holds, on either side (not
    the half-width: [-1, 3.2] leaves 3.2 possible, not 2.1), an end at 0 included; one seed: said
    so."""
    assert sweep.verdict(0.4, 3.0) == "pays"
    assert sweep.verdict(-4.0, -0.2) == "costs"
    assert sweep.verdict(-1.0, 3.2) == "no effect larger than 3.2 points"
    assert sweep.verdict(-3.4, 1.0) == "no effect larger than 3.4 points"
    assert sweep.verdict(-0.1, 2.0) == "no effect larger than 2.0 points"  # just across 0
    assert sweep.verdict(-2.0, 0.1) == "no effect larger than 2.0 points"
    # an end at 0 is not above or below it: [0, 0] (seeds that all gain exactly 0) neither pays
    # nor costs
    assert sweep.verdict(0.0, 0.0) == "no effect larger than 0.0 points"
    assert sweep.verdict(0.0, 2.5) == "no effect larger than 2.5 points"
    assert sweep.verdict(-2.5, 0.0) == "no effect larger than 2.5 points"
    assert "one seed" in sweep.verdict(math.nan, math.nan)


def test_row_pairs_the_arms_of_each_seed_and_reads_each_arms_drift():
    """Seeds far apart (0.2, 0.5, 0.8) gain 2, 4, 3 points: the gain pairs the arms of one seed
    (mean 3, sd 1, t(0.975, 2) in closed form), and arms of different drift (uncentred 3, 8, 5;
    centred 1, 2, 5) give drift_u, drift_c and the geometric mean ratio ∛(3·4·1) with a
    t-interval on the log ratio."""
    base, gain = [0.2, 0.5, 0.8], [0.02, 0.04, 0.03]
    du, dc = [3.0, 8.0, 5.0], [1.0, 2.0, 5.0]
    r = sweep.row(
        _level(
            [[b] * 6 for b in base],
            [[b] * 1 + [b + g] * 5 for b, g in zip(base, gain, strict=True)],
            [[0.0, *[d] * 5] for d in du],
            [[0.0, *[d] * 5] for d in dc],
        )
    )
    half = _t2() * 1.0 / math.sqrt(3)
    assert r["gain"] == pytest.approx(3.0)
    assert (r["gain_lo"], r["gain_hi"]) == pytest.approx((3 - half, 3 + half))
    assert r["final_u"] == pytest.approx(0.5) and r["final_c"] == pytest.approx(0.53)
    assert r["drift_u"] == pytest.approx(16 / 3) and r["drift_c"] == pytest.approx(8 / 3)
    logs = np.log([3.0, 4.0, 1.0])
    log_half = _t2() * np.std(logs, ddof=1) / math.sqrt(3)
    assert r["ratio"] == pytest.approx(12 ** (1 / 3))
    assert r["ratio_lo"] == pytest.approx(math.exp(logs.mean() - log_half))
    assert r["ratio_hi"] == pytest.approx(math.exp(logs.mean() + log_half))
    assert r["kl_q_p"] == pytest.approx(np.mean([0, 0.05, 0.1, 0.15, 0.2, 0.25]))  # measured
    assert r["verdict"] == "pays"

    # against steps: step 0 has no drift (no ratio), the gain there is 0 with no width
    s = r["steps"]
    assert s["step"] == [0, 50, 100, 150, 200, 250]
    assert math.isnan(s["ratio"][0]) and s["ratio"][1:] == pytest.approx([12 ** (1 / 3)] * 5)
    assert s["gain"] == pytest.approx([0, 3, 3, 3, 3, 3])
    assert s["gain_lo"][0] == pytest.approx(0) and s["gain_lo"][1] == pytest.approx(3 - half)


def _gains_level(gains):  # three seeds whose per-step gains (points) are gains[step][seed]
    base = [0.3, 0.5, 0.7]
    c = [[b + g[seed] / 100 for g in gains] for seed, b in enumerate(base)]
    drifts = [[0.0] + [1.0] * (len(gains) - 1)] * 3
    return _level([[b] * len(gains) for b in base], c, drifts, drifts)


def test_from_step_is_where_the_gains_interval_stays_above_zero():
    """Per-step gains of three seeds: [5, 5, 5] at step 50 (interval above 0), [-1, 4, 6] at 100
    (across 0), [1, 2, 3] at 150 (mean above its spread, but its interval, 2 ± 2.48, holds 0), then
    above 0 at 200 and 250: from step 200. A last evaluation whose interval holds 0: None."""
    gains = [[0, 0, 0], [5, 5, 5], [-1, 4, 6], [1, 2, 3], [4, 5, 6], [3, 4, 5]]
    r = sweep.row(_gains_level(gains))
    half = _t2() / math.sqrt(3)  # sd 1 at 150, 200, 250
    assert r["steps"]["gain_lo"][3:] == pytest.approx([2 - half, 5 - half, 4 - half])
    assert r["from_step"] == 200
    assert sweep.row(_gains_level([*gains[:-1], [-1, 4, 6]]))["from_step"] is None
    series = dict(step=[0, 10, 20, 30], gain_lo=[1.0, -0.5, 0.3, 0.2])
    assert sweep.from_step(series) == 20
    assert sweep.from_step(dict(step=[0, 10], gain_lo=[math.nan, math.nan])) is None  # one seed


def test_a_run_that_stopped_early_leaves_the_steps_every_run_has(tmp_path, capsys):
    """Seed 2's uncentred run stopped (diverged) after its evaluation at step 100; the others ran
    to 250. The series against steps hold steps 0, 50 and 100, where every run was evaluated, with
    the gains of all three seeds there (0, 2, 4 points: seeds 1 2 3, 2 4 6 at 50 and 100); a run's
    final score is the mean of its own last evaluations; the report goes through."""
    base, n = [0.3, 0.5, 0.7], 6
    gains = [[0, 0, 0], [1, 2, 3], [2, 4, 6], [3, 3, 3], [3, 3, 3], [3, 3, 3]]  # [step][seed]
    u = [[b] * (3 if seed == 2 else n) for seed, b in enumerate(base)]
    c = [[b + g[seed] / 100 for g in gains] for seed, b in enumerate(base)]
    du = [[0.0] + [2.0] * (len(run) - 1) for run in u]
    dc = [[0.0] + [1.0] * (n - 1)] * 3
    level = _level(u, c, du, dc)
    assert list(level["uncentered_seed2"]["eval_acc"]) == ["0", "50", "100"]

    r = sweep.row(level)
    s = r["steps"]
    assert s["step"] == [0, 50, 100]
    assert s["gain"] == pytest.approx([0, 2, 4])
    half = _t2() * 2 / math.sqrt(3)  # step 100: 2, 4, 6, sd 2
    assert (s["gain_lo"][2], s["gain_hi"][2]) == pytest.approx((4 - half, 4 + half))
    assert math.isnan(s["ratio"][0]) and s["ratio"][1:] == pytest.approx([2, 2])
    assert all(len(v) == 3 for v in s.values())
    # the score: the last LAST evaluations of each run (seed 2 uncentred: its three at 0.7)
    assert r["final_u"] == pytest.approx(0.5)
    assert r["final_c"] == pytest.approx(0.5 + np.mean(gains[-sweep.LAST :]) / 100)

    args = argparse.Namespace(
        seeds=[0, 1, 2], seed=0, steps=250, workers=3, plot=None, correction=None
    )
    args.out = str(tmp_path)
    summary = sweep.report(args, {"int8": level, "bf16": _gains_level(gains)}, 1.0)
    assert summary["levels"]["int8"]["steps"]["step"] == [0, 50, 100]
    assert summary["levels"]["bf16"]["steps"]["step"] == [0, 50, 100, 150, 200, 250]
    printed = capsys.readouterr().out
    assert re.search(r"^int8 .*\+4\.0 \[.*\] +- +- +- *$", printed, re.M), printed


def test_final_is_the_mean_of_the_last_evaluations():
    """The centred arm is 4 points up over its last LAST - 1 evaluations and 12 up at the final
    one: the gain is their mean, not the final evaluation's alone, nor the first ones'."""
    last, n = sweep.LAST, sweep.LAST + 3
    assert last > 1
    u = [[0.5] * n, [0.6] * n]
    c = [[s] * (n - last) + [s + 0.04] * (last - 1) + [s + 0.12] for s in (0.5, 0.6)]
    d = [[0.0] + [1.0] * (n - 1)] * 2
    r = sweep.row(_level(u, c, d, d))
    expected = 100 * (0.04 * (last - 1) + 0.12) / last
    assert r["gain"] == pytest.approx(expected)
    assert r["final_c"] == pytest.approx(0.55 + expected / 100)


def _two_levels():  # a level where centring pays and one where it costs, three seeds each
    base, du, dc = [0.2, 0.5, 0.8], [3.0, 8.0, 5.0], [1.0, 2.0, 5.0]
    drifts_u, drifts_c = [[0.0, *[d] * 5] for d in du], [[0.0, *[d] * 5] for d in dc]
    paying = _level(
        [[b] * 6 for b in base],
        [[b, *[b + g] * 5] for b, g in zip(base, [0.02, 0.04, 0.03], strict=True)],
        drifts_u,
        drifts_c,
    )
    costing = _level([[b] * 6 for b in base], [[b - 0.05] * 6 for b in base], drifts_c, drifts_c)
    return {"bf16_noise0.1": paying, "int8": costing}


def _report(out, plot=None):  # sweep.report of _two_levels() into the folder out
    args = argparse.Namespace(
        seeds=[0, 1, 2], seed=0, steps=250, workers=3, plot=plot, out=out, correction=None
    )
    return sweep.report(args, _two_levels(), 123.4)


def test_report_prints_the_columns_and_writes_summary(tmp_path, capsys):
    """Two levels, three seeds: the first line has the levels, seeds, arms and seconds; each row
    the drift of each arm, the ratio and the gain with their intervals, from_step and the verdict;
    summary.json the same numbers, every run and the seconds; without --plot, no figure."""
    summary = _report(str(tmp_path))

    out = capsys.readouterr().out.splitlines()
    first = next(line for line in out if line.startswith("sweep:"))
    assert "2 levels x 3 seeds x 2 arms" in first and "123 s" in first
    paid = next(line for line in out if line.startswith("bf16_noise0.1 "))
    half = _t2() / math.sqrt(3)
    assert "5.33" in paid.split() and "2.67" in paid.split()  # drift_u, drift_c
    assert f"+3.0 [{3 - half:+.1f}, {3 + half:+.1f}]" in paid and paid.rstrip().endswith("pays")
    assert "50" in paid.split()  # from_step: the first evaluation after the start
    cost = next(line for line in out if line.startswith("int8 "))
    assert "-5.0" in cost and cost.rstrip().endswith("costs") and "1.00 [1.00, 1.00]" in cost
    kl_u, kl_c = (next(line for line in out if line.startswith(f"int8 {arm} ")) for arm in "uc")
    assert kl_u.split()[2:] == ["1.00e-01"] * 5 and kl_c.split()[2:] == ["1.50e-01"] * 5

    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["seconds"] == 123.4 and summary["seconds"] == 123.4
    level = saved["levels"]["bf16_noise0.1"]
    assert level["drift_u"] == pytest.approx(16 / 3) and level["from_step"] == 50
    assert level["gain_lo"] == pytest.approx(3 - half) and level["verdict"] == "pays"
    assert set(level["runs"]) == set(_two_levels()["bf16_noise0.1"])
    assert level["steps"]["step"][-1] == 250
    assert level["steps"]["ratio"][0] is None  # NaN (no drift at step 0) as JSON null
    assert os.listdir(tmp_path) == ["summary.json"]


def test_report_draws_the_map_and_the_steps_figure(tmp_path):
    """--plot FILE: the map in FILE and the series against steps in FILE_steps, two PNGs; the
    summary the same as without --plot."""
    pytest.importorskip("matplotlib")
    for folder in ("plain", "drawn", "figs"):
        (tmp_path / folder).mkdir()
    _report(str(tmp_path / "plain"))
    _report(str(tmp_path / "drawn"), plot=str(tmp_path / "figs" / "s.png"))
    for name in ("s.png", "s_steps.png"):
        assert (tmp_path / "figs" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert sorted(os.listdir(tmp_path / "figs")) == ["s.png", "s_steps.png"]
    saved = [(tmp_path / d / "summary.json").read_text() for d in ("plain", "drawn")]
    assert saved[0] == saved[1]


def test_a_progress_line_counts_the_runs_and_estimates_the_rest_at_their_pace():
    """3 runs of 12 done in 30 s: 10 s a run, so 9 more take about 90 s (2 min); the score and
    drift of the last evaluation (step 10, not 9 as text sorts); a run that stopped says at which
    step; durations in s, min or h."""
    summary = dict(eval_acc={"9": 0.25, "10": 0.5}, drift={"9": 0.5, "10": 0.0123})
    line = compare.progress(3, 12, "int8 centered_seed1", summary, 30.0)
    assert line == (
        "run  3/12 int8 centered_seed1 | score 0.500 | drift  1.23e-02 | 30 s in, about 2 min left"
    )
    stopped = summary | dict(stopped="step 7: the loss, a gradient or a weight is not finite")
    line = compare.progress(12, 12, "int8 uncentered_seed1", stopped, 3960.0)
    assert line.endswith("| 1.1 h in, about 0 s left | stopped at step 7"), line


TIME = r"\d+(\.\d)? (s|min|h)"  # a duration as a progress line prints it


def test_short_sweep_has_every_level_and_seed_and_the_mismatch_sets_the_arms_apart(
    tmp_path, capsys
):
    """--sweep 0,0.1 on two seeds, shortened: every level and seed is there, the measured
    kl_q_p grows with the noise, the gain is centred minus uncentred of the same seed; after one
    step from the same rollouts, the two arms' drift differs less with a clean bf16 sampler than
    with 10% noise (the centring term scales with the mismatch). At lr 0.1 a step stays small (at
    0.4 both arms can overshoot to the same drift). It prints a line a finished run, counting up
    to the 8 runs with the run's score and drift, then the tables: no step, no JSON; the steps
    are in each run's metrics.jsonl."""
    argv = "--task sequence --sweep 0,0.1 --seeds 0,1 --steps 1 --eval-every 1".split()
    argv += "--eval-n 8 --probe-n 8 --prompts 2 --group 4 --max-tokens 6 --lr 0.1".split()
    summary = train.main(argv + ["--out", str(tmp_path / "o")])
    saved = _strict_json((tmp_path / "o" / "summary.json").read_text())
    levels = saved["levels"]
    assert list(levels) == ["bf16", "bf16_noise0.1"]
    names = {f"{arm}_seed{s}" for arm in ("uncentered", "centered") for s in (0, 1)}
    for level, r in levels.items():
        assert set(r["runs"]) == names
        assert all((tmp_path / "o" / level / name / "summary.json").exists() for name in names)
        for name in names:
            rows = (tmp_path / "o" / level / name / "metrics.jsonl").read_text().splitlines()
            assert [json.loads(row)["step"] for row in rows] == [0, 1]

        # each run's score: the mean of its last evaluations (here steps 0 and 1, all it has)
        runs = r["runs"]
        gains = [
            np.mean(list(runs[f"centered_seed{s}"]["eval_acc"].values()))
            - np.mean(list(runs[f"uncentered_seed{s}"]["eval_acc"].values()))
            for s in (0, 1)
        ]
        assert r["gain"] == pytest.approx(100 * np.mean(gains), abs=1e-9)
        assert r["gain_lo"] <= r["gain"] <= r["gain_hi"] and r["verdict"]
    kl = [levels[k]["kl_q_p"] for k in levels]
    assert kl[0] < kl[1], kl
    assert summary["levels"]["bf16"]["kl_q_p"] == kl[0]

    def apart(level):  # |drift of the uncentred arm - centred arm| after the first step
        runs = levels[level]["runs"]
        return [
            abs(runs[f"uncentered_seed{s}"]["drift"]["1"] - runs[f"centered_seed{s}"]["drift"]["1"])
            for s in (0, 1)
        ]

    assert max(apart("bf16")) < min(apart("bf16_noise0.1")), (apart("bf16"), apart("bf16_noise0.1"))

    lines = capsys.readouterr().out.splitlines()
    runs = [line.split(" | ") for line in lines if re.match(r"run +\d+/", line)]
    assert [cells[0].split()[1] for cells in runs] == [f"{i}/8" for i in range(1, 9)]
    done = {" ".join(cells[0].split()[2:]): cells for cells in runs}  # "level name" -> cells
    assert set(done) == {f"{level} {name}" for level in levels for name in names}
    for run_name, cells in done.items():
        level, name = run_name.split()
        run = levels[level]["runs"][name]
        assert cells[1] == f"score {run['final_acc']:.3f}", cells
        drift = float(cells[2].split()[1])  # printed to 3 digits
        assert drift == pytest.approx(run["final_drift"], rel=1e-2, abs=1e-12), cells
        assert re.fullmatch(rf"{TIME} in, about {TIME} left", cells[3]), cells
    assert not [line for line in lines if re.search(r"step +\d+/\d+ \|", line)]
    assert not [line for line in lines if "{" in line and not line.startswith("config ")]
    assert len(lines) < 40, len(lines)


def test_kl_table_shows_eight_windows_evenly_spaced_with_the_first_and_the_last(capsys):
    """A 2,000-step run evaluated every 50 has 40 windows: the table prints 8 of them, steps 50 to
    2000 evenly, each the seeds' mean of that window (seed s: step / 1e4 + s / 100, centred +0.05).
    """
    level = _level([[0.5] * 41] * 2, [[0.5] * 41] * 2, [[1.0] * 41] * 2, [[1.0] * 41] * 2)
    for name, run in level.items():
        seed = int(name[-1])
        run["kl_q_p"] = {
            s: int(s) / 1e4 + seed / 100 + name.startswith("c") / 20 for s in run["kl_q_p"]
        }
    sweep.kl_table({"int8": level})
    out = capsys.readouterr().out.splitlines()
    head = next(line for line in out if line.startswith("kl_q_p to step")).split()[3:]
    assert head == ["50", "350", "600", "900", "1150", "1450", "1700", "2000"]
    u = next(line for line in out if line.startswith("int8 u ")).split()[2:]
    assert [float(x) for x in u] == pytest.approx([int(s) / 1e4 + 0.005 for s in head], rel=5e-3)
    c = next(line for line in out if line.startswith("int8 c ")).split()[2:]
    assert [float(x) for x in c] == pytest.approx([int(s) / 1e4 + 0.055 for s in head], rel=5e-3)


TIS_U = [[0.2, 0.1, 0.1, 0.2, 0.3], [0.2, 0.1, 0.2, 0.2, 0.2], [0.1, 0.3, 0.3, 0.3, 0.3]]


def test_corrections_table_recomputes_each_level_from_the_runs(tmp_path, capsys):
    """lab.corrections reads one folder a sweep and recomputes each row from the runs' summaries,
    not from the sweep's stored row (set to nonsense here): the gain is the paired mean of the last
    LAST evaluations in points, gain_100 the last evaluation's, the ratio the geometric mean;
    vs_none pairs each seed's centred run with no correction with that seed's run of the correction
    alone (another sweep)."""
    from lab import corrections

    u = [[0.2, 0.3, 0.4, 0.5, 0.6], [0.2, 0.3, 0.3, 0.3, 0.4], [0.1, 0.2, 0.2, 0.4, 0.2]]
    c = [[0.2, 0.4, 0.4, 0.6, 0.7], [0.2, 0.3, 0.4, 0.4, 0.4], [0.1, 0.3, 0.3, 0.4, 0.5]]
    du, dc = [[0, 1, 2, 3, 4.0]] * 3, [[0, 1, 1, 1, 2.0], [0, 1, 1, 1, 1.0], [0, 1, 1, 1, 4.0]]
    for name, correction, stale, level in [
        ("quant-tis", "tis:2", 0, "fp8_kv_fp8"),
        ("quant-none", None, 0, "fp8_kv_fp8"),
        ("stale-none", None, 7, "bf16"),
    ]:
        os.makedirs(tmp_path / name)
        json.dump(
            dict(correction=correction, staleness=stale), open(tmp_path / name / "run.json", "w")
        )
        runs = _level(TIS_U if correction else u, c, du, dc)
        summary = dict(levels={level: dict(gain=99.0, runs=runs)})
        json.dump(summary, open(tmp_path / name / "summary.json", "w"))
    tables = corrections.report(str(tmp_path))
    assert list(tables) == ["fp8_kv_fp8", "bf16, staleness 7"]
    assert list(tables["fp8_kv_fp8"]) == ["none", "tis:2"]  # the uncorrected row first
    row = tables["bf16, staleness 7"]["none"]
    gain = 100 * np.mean(np.mean(np.subtract(c, u)[:, -sweep.LAST :], axis=1))  # last LAST
    assert row["gain"].startswith(f"{gain:+.1f} [")
    assert row["gain_100"].startswith(f"{np.mean(np.subtract(c, u)[:, -1]) * 100:+.1f} [")
    ratio = np.exp(np.mean(np.log(np.array(du)[:, -1] / np.array(dc)[:, -1])))
    assert row["ratio"].startswith(f"{ratio:.2f} [")
    assert "fp8_kv_fp8: 3 seeds" in capsys.readouterr().out
    vs_none = 100 * np.mean(np.subtract(c, TIS_U)[:, -sweep.LAST :])  # none's c, tis's u
    assert tables["fp8_kv_fp8"]["tis:2"]["vs_none"].startswith(f"{vs_none:+.1f} [")
    assert tables["fp8_kv_fp8"]["none"]["vs_none"] == tables["fp8_kv_fp8"]["none"]["gain"]
