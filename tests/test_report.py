"""lab.report: a --compare's numbers recomputed from its runs' metrics.jsonl equal what each run
wrote in its summary.json (kept in memory as it ran: another path); its intervals are Student's;
the SmolLM2 tables and verdict in docs/real_model.md are its reading of the committed files."""

import importlib.util
import json
import math
import os
import re

import numpy as np
import pytest

from lab import report


def test_a_compare_recomputes_from_its_files(tmp_path, capsys, sequence_compare):
    out, summary = sequence_compare["out"], sequence_compare["summary"]
    plot = tmp_path / "curves.png" if importlib.util.find_spec("matplotlib") else None
    found = report.report(str(out), plot and str(plot))
    text = capsys.readouterr().out
    assert found["step"] == 8 and sorted(found["runs"]) == [0, 1]
    for seed, arms in found["runs"].items():
        for arm, mine in arms.items():
            wrote = summary[f"{arm}_seed{seed}"]
            for k in ("peak_acc", "final_acc", "drop", "final_drift", "mean_kl_q_p"):
                assert mine[k] == pytest.approx(wrote[k], rel=1e-6, abs=1e-9), (seed, arm, k)
            assert {str(s): a for s, a in mine["eval_acc"].items()} == wrote["eval_acc"]
            assert len(set(wrote["eval_acc"].values())) > 1  # scores that moved: peak, final, drop
    # two seeds: mean ± t(0.975, 1 degree of freedom) = 12.706 times the standard error
    u = [found["runs"][s]["uncentered"]["final_drift"] for s in (0, 1)]
    c = [found["runs"][s]["centered"]["final_drift"] for s in (0, 1)]
    d = np.subtract(c, u)
    assert min(u + c) > 0 and abs(d).min() > 0  # the arms walked, and not as far
    half = 12.7062 * np.std(d, ddof=1) / math.sqrt(2)
    mean, lo, hi = found["intervals"]["final_drift"][2]
    assert (mean, lo, hi) == pytest.approx((d.mean(), d.mean() - half, d.mean() + half), rel=1e-4)
    # the drift ratio: exp of the mean log ratio, ± the same t-quantile on the logs
    logs = np.log(np.divide(u, c))
    half = 12.7062 * np.std(logs, ddof=1) / math.sqrt(2)
    expected = np.exp([logs.mean(), logs.mean() - half, logs.mean() + half])
    assert found["ratio"] == pytest.approx(tuple(expected), rel=1e-4)
    assert f"final drift uncentred / centred: {found['ratio'][0]:.2f} [" in text
    assert found["verdict"] == summary["verdict"] and summary["verdict"] in text
    assert not plot or os.path.getsize(plot) > 1000


def test_a_folder_without_a_compare_is_refused_in_one_line(tmp_path):
    (tmp_path / "centered_seed0").mkdir()
    (tmp_path / "centered_seed0" / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    with pytest.raises(SystemExit, match="no --compare run with both arms"):
        report.report(str(tmp_path))


def test_growth_and_drift_ratio_from_made_up_runs(tmp_path, capsys):
    """Two seeds of 21 updates: the mismatch (kl_q_p, |log p - log q|) grew in a seed when its mean
    over the last 10 updates exceeds the first 10's; the series are made so that windows of 5 or 1
    answer otherwise; kl_q_p's peak, the largest mean over 10 updates in a row, is 0.55 for `down`
    (updates 1 to 10, 2 to 11, ...: above both ends), 0.9 for `up` (its last 10). The drift ratio
    is the geometric mean of the seeds' final drift uncentred / centred (2 and 4 here: sqrt 8)."""
    run = dict(task="arithmetic", model="m", sampler="fp8", kv_quant=None)
    (tmp_path / "run.json").write_text(json.dumps(run))
    up = [1.0] * 5 + [0.0] * 5 + [0.5] + [1.0] * 5 + [0.8] * 5  # 10s: 0.5 -> 0.9; 5s: 1.0 -> 0.8
    down = [0.0] * 5 + [1.0] * 5 + [0.5] + [0.0] * 5 + [0.2] * 5  # 10s: 0.5 -> 0.1; 5s: 0 -> 0.2
    rising = dict(uncentered=[(up, up), (down, up)], centered=[(down, down)] * 2)
    drift = dict(uncentered=[2.0, 8.0], centered=[1.0, 2.0])
    for arm, seeds in rising.items():
        for seed, (kl, gap) in enumerate(seeds):
            rows = []
            for step in range(21):
                row = dict(step=step, loss=0.0, kl_q_p=kl[step], logprob_gap=gap[step])
                if step % 10 == 0:
                    row |= dict(acc=0.5, drift=drift[arm][seed] * step / 20)
                rows.append(json.dumps(row) + "\n")
            (tmp_path / f"{arm}_seed{seed}").mkdir()
            (tmp_path / f"{arm}_seed{seed}" / "metrics.jsonl").write_text("".join(rows))
    found = report.report(str(tmp_path))
    assert found["growth"] == (
        "uncentered: over the run kl_q_p grew in 1 of 2 seeds, |log p - log q| in 2; "
        "centered: over the run kl_q_p grew in 0 of 2 seeds, |log p - log q| in 0"
    )
    peaks = {arm: [found["runs"][s][arm]["kl_peak"] for s in (0, 1)] for arm in rising}
    assert peaks == dict(uncentered=pytest.approx([0.9, 0.55]), centered=pytest.approx([0.55] * 2))
    assert found["ratio"][0] == pytest.approx(math.sqrt(8), rel=1e-9)
    assert "final drift uncentred / centred: 2.83 [" in capsys.readouterr().out


def rows_and_verdict(folder, section, kl_format):
    """Asserts that each seed's row, the verdict and the drift ratio lab.report reads from folder
    are in section, and that each arm's summary.json agrees with its metrics.jsonl; returns them."""
    found = report.report(folder)
    names = dict(uncentered="uncentred", centered="centred")
    for seed, arms in found["runs"].items():
        for arm, r in arms.items():
            kl = " / ".join(kl_format.format(r[k]) for k in ("kl_first", "kl_peak", "kl_last"))
            cells = [f"{seed}, {names[arm]}", *(f"{r[k]:.4f}" for k in ("peak_acc", "final_acc"))]
            cells += [f"{r['drop']:.4f}", f"{r['final_drift']:.2f}", kl]
            cells.append(f"{r['gap_first']:.2g} / {r['gap_last']:.2g}")
            assert ("| " + " | ".join(cells) + " |").replace("-", "−") in section, (seed, arm)
            wrote = json.load(open(os.path.join(folder, f"{arm}_seed{seed}", "summary.json")))
            for k in ("peak_acc", "final_acc", "drop", "final_drift", "mean_kl_q_p"):
                assert r[k] == pytest.approx(wrote[k], rel=1e-9, abs=1e-12), (seed, arm, k)
    verdict = found["verdict"]  # "verdict: [INCONCLUSIVE (why); the rule alone: ]centring WORD..."
    word = re.match(r"verdict: (INCONCLUSIVE|centring [A-Z]+(?: validated)?)", verdict).group(1)
    assert f"**The verdict: {word}**" in section
    rule = re.search(r"centring [A-Z]+(?: validated)?", verdict).group(0)  # the rule's own result
    assert rule in section
    assert verdict[verdict.index("drop ") :] in " ".join(section.split())  # wrapped over lines
    r = found["ratio"]  # the drift ratio uncentred / centred; one seed's has no interval
    one = len(found["runs"]) == 1
    assert (f"{r[0]:.2f} (one seed" if one else f"{r[0]:.2f} [{r[1]:.2f}, {r[2]:.2f}]") in section
    return found


def test_the_smollm2_tables_and_verdicts_in_the_docs_recompute_from_the_committed_files(capsys):
    """docs/real_model.md's 100-step tables, row by row, and its quoted verdicts are what
    lab.report reads from docs/results/smollm2-arith-fp8 and -bf16 (each run's committed
    metrics.jsonl), to the digits printed; and each arm's summary.json agrees with its metrics."""
    root = os.path.join(os.path.dirname(__file__), "..")
    results = os.path.join(root, "docs", "results")
    doc = open(os.path.join(root, "docs", "real_model.md")).read()
    fp8 = doc[doc.index("## Trained for 100 steps") : doc.index("### The bf16 control")]
    bf16 = doc[doc.index("### The bf16 control") : doc.index("## The cost of a GRPO step")]

    found = rows_and_verdict(os.path.join(results, "smollm2-arith-fp8"), fp8, "{:.3f}")
    assert len(found["runs"]) == 3
    labels = dict(peak_acc="peak", final_acc="final", drop="drop", final_drift="final drift")
    for k, label in labels.items():  # the means over the seeds, each with its 95% interval
        f = "{:.2f}" if k == "final_drift" else "{:.3f}"
        spans = " | ".join(
            f"{f.format(m)} [{f.format(lo)}, {f.format(hi)}]" for m, lo, hi in found["intervals"][k]
        )
        assert f"| {label} | {spans} |".replace("-", "−") in fp8, k
    found = rows_and_verdict(os.path.join(results, "smollm2-arith-bf16"), bf16, "{:.2g}")
    assert list(found["runs"]) == [0] and found["step"] == 100
    capsys.readouterr()


def write_runs(folder, runs):  # runs {(arm, seed): (accuracies every 10 steps, final drift)}
    for (arm, seed), (acc, drift) in runs.items():
        os.makedirs(folder / f"{arm}_seed{seed}")
        rows = [
            dict(step=10 * i, acc=a, drift=drift * i / (len(acc) - 1)) for i, a in enumerate(acc)
        ]
        (folder / f"{arm}_seed{seed}" / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows)
        )
    return str(folder)


RISE_THEN_FALL = [0.5, 0.6, 0.7, 0.8, 0.8, 0.8] + [0.6] * 6 + [0.3] * 9  # 21 evaluations, 200 steps
FLAT = [0.5] + [0.7] * 20
PREVENTED = "collapse prevented (demonstrated)"


@pytest.mark.parametrize(
    "uncentred, drift, verdict",
    [
        ([RISE_THEN_FALL, RISE_THEN_FALL, FLAT], 2.0, PREVENTED),
        ([RISE_THEN_FALL, FLAT, FLAT], 2.0, "inconclusive"),  # 1 of 3 collapsed
        ([FLAT] * 3, 1.5, "conclusive null"),  # none fell, 1.5x the control's drift
        ([FLAT] * 3, 1.4, "inconclusive"),  # none fell, the mismatch barely moved it
        ([[0.5] + [0.8] * 11 + [0.7] * 9] * 3, 1.0, PREVENTED),  # 10 points below: collapsed
        ([[0.6] + [0.55] * 20] * 3, 1.0, PREVENTED),  # below step 0: collapsed
        ([[0.5] + [0.8] * 11 + [0.7025] * 9] * 3, 1.0, "inconclusive"),  # 9.75 below: did not
    ],
)
def test_the_preregistered_verdict_by_hand(tmp_path, capsys, uncentred, drift, verdict):
    """docs/real_model.md's rules: the late mean is over the last 9 of 21 evaluations (40%); a run
    collapses 10 points below its peak (k/400 on the bound included) or below step 0; the verdict
    needs 2 of 3 uncentred arms and no centred one fallen, or none fallen at 1.5x the drift."""
    runs = {("uncentered", s): (acc, drift) for s, acc in enumerate(uncentred)}
    runs |= {("centered", s): (FLAT, 1.0) for s in range(3)}
    folder = write_runs(tmp_path / "main", runs)
    control = write_runs(tmp_path / "control", {("uncentered", 0): (FLAT, 1.0)})
    found = report.preregistered(folder, control)
    assert found["verdict"] == verdict
    assert f"pre-registered verdict: {verdict}" in capsys.readouterr().out
    late = [np.mean(acc[12:]) for acc in uncentred]  # steps 120 to 200
    assert found["diff"][0] == pytest.approx(np.mean(0.7 - np.array(late)), abs=1e-12)
    assert found["drift_ratio"] == pytest.approx(drift)


def test_seeds_are_compared_at_the_last_evaluation_every_run_reached(tmp_path, capsys):
    """Seed 1's uncentred run is ahead (evaluated at step 30, every other run last at 20): each
    run is read up to step 20, its final accuracy and drift that evaluation's, its kl_q_p from
    no update after it: the rows past 20 wait for the other runs."""
    run = dict(task="arithmetic", model="m", sampler="fp8", kv_quant=None)
    (tmp_path / "run.json").write_text(json.dumps(run))
    reached = {("uncentered", 0): 20, ("centered", 0): 20, ("uncentered", 1): 30}
    reached[("centered", 1)] = 20
    for (arm, seed), end in reached.items():
        rows = []
        for step in range(end + 1):  # an update a step (none after the last evaluation)
            row = dict(step=step)
            if step < end:
                row |= dict(loss=0.0, kl_q_p=step / 1000, logprob_gap=step / 100)
            if step % 10 == 0:  # accuracy 0, 0.1, 0.2 (0.3); drift 0, 1, 2 (3)
                row |= dict(acc=step / 100, drift=step / 10)
            rows.append(json.dumps(row) + "\n")
        (tmp_path / f"{arm}_seed{seed}").mkdir()
        (tmp_path / f"{arm}_seed{seed}" / "metrics.jsonl").write_text("".join(rows))
    found = report.report(str(tmp_path))
    assert found["step"] == 20 and "2 seeds, step 20" in capsys.readouterr().out
    for arms in found["runs"].values():
        for r in arms.values():
            assert r["eval_acc"] == {0: 0.0, 10: 0.1, 20: 0.2} and r["step"] == 20
            assert (r["final_acc"], r["peak_acc"], r["final_drift"]) == (0.2, 0.2, 2.0)
            # no update past step 20: a mean of 0.0095 (steps 0 to 19) or 0.01 (0 to 20), not 0.0145
            assert r["mean_kl_q_p"] <= np.mean(np.arange(21) / 1000) + 1e-12


def test_the_arms_are_compared_problem_by_problem_at_each_evaluation_both_reached(tmp_path):
    """evals.jsonl's rewards (1: right) counted by hand: at step 0, of 6 problems both arms got 2
    right, the centred arm alone 1, the uncentred alone 2, neither 1; step 10 only the uncentred
    arm reached (not compared); seed 1 has no evals.jsonl (a run from before it: skipped)."""
    runs = {(arm, s): (FLAT[:2], 1.0) for arm in ("uncentered", "centered") for s in (0, 1)}
    folder = write_runs(tmp_path, runs)
    evals = dict(
        uncentered=[dict(step=0, rewards=[1, 1, 0, 1, 1, 0]), dict(step=10, rewards=[1] * 6)],
        centered=[dict(step=0, rewards=[1, 0, 1, 0, 1, 0])],
    )
    for arm, rows in evals.items():
        with open(os.path.join(folder, f"{arm}_seed0", "evals.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    counts = dict(both=2, centred=1, uncentred=2, neither=1)
    assert report.by_problem(folder) == {"problems": {0: {0: counts}}}


def test_the_sgd_pilots_table_in_the_docs_recomputes_from_its_committed_metrics():
    """docs/real_model.md's pilot table (held-out accuracy, drift, the mean kl_q_p of the 10
    updates before each evaluation) is what docs/results/smollm2-sgd-pilot-lr1e-2's metrics.jsonl
    holds, to the digits printed; and the pilot passes its pre-registered rule (a peak above step
    0's, no evaluation after it more than 5 points below)."""
    root = os.path.join(os.path.dirname(__file__), "..")
    doc = open(os.path.join(root, "docs", "real_model.md")).read()
    rows = open(os.path.join(root, "docs", "results", "smollm2-sgd-pilot-lr1e-2", "metrics.jsonl"))
    rows = [json.loads(r) for r in rows]
    acc = {r["step"]: r["acc"] for r in rows if "acc" in r}
    drift = {r["step"]: r["drift"] for r in rows if "drift" in r}
    kl = {
        s: np.mean([r["kl_q_p"] for r in rows if s - 10 <= r["step"] < s and "loss" in r])
        for s in acc
        if s
    }
    steps = sorted(acc)
    assert "| step | " + " | ".join(map(str, steps)) + " |" in doc
    assert "| held-out accuracy | " + " | ".join(f"{acc[s]:.3f}" for s in steps) + " |" in doc
    cells = ["0"] + [f"{drift[s]:.2g}" if drift[s] < 0.01 else f"{drift[s]:.3f}" for s in steps[1:]]
    assert "| drift ≈ KL(p_0 ‖ p_t) | " + " | ".join(cells) + " |" in doc
    assert (
        "| kl_q_p, mean of the 10 updates before | | "
        + " | ".join(f"{kl[s]:.4f}" for s in steps[1:])
        + " |"
        in doc
    )
    peak = max(steps, key=lambda s: (acc[s], -s))
    assert acc[peak] > acc[0] and acc[peak] - min(acc[s] for s in steps if s >= peak) <= 0.05
