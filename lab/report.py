"""python -m lab.report DIR [--plot FILE]: a --compare's numbers recomputed from the files its runs
wrote (DIR/ARM_seedN/metrics.jsonl), finished or not: each seed's row, the means over the seeds
with 95% t-intervals, the drift ratio uncentred / centred, lab.compare's verdict, whether the
mismatch grew, and the curves (with the tail ratio ρ where logged); with --control, the
pre-registered reading of the full-weight runs (docs/real_model.md) and the arms compared problem
by problem. The docs quote the SmolLM2 runs from these files, committed without saved states."""

import argparse
import glob
import json
import math
import os

import numpy as np

from lab import compare, harness, sweep, tasks

ARMS = ("uncentered", "centered")


def read(folder):  # {seed: {arm: [the run's rows]}} for the seeds whose both arms have a row
    runs = {}
    for file in sorted(glob.glob(os.path.join(folder, "*_seed*", "metrics.jsonl"))):
        arm, seed = os.path.basename(os.path.dirname(file)).rsplit("_seed", 1)
        runs.setdefault(int(seed), {})[arm] = [json.loads(line) for line in open(file)]
    return {seed: arms for seed, arms in sorted(runs.items()) if set(arms) == set(ARMS)}


def windows(y, n=10):  # the means of n values in a row (one mean of all of them if fewer)
    n = min(n, len(y))
    return np.convolve(y, np.ones(n) / n, "valid")


def numbers(rows, last=None):  # a run's summary as lab.harness writes it, up to step `last`
    rows = [r for r in rows if last is None or r["step"] <= last]
    acc = {r["step"]: r["acc"] for r in rows if "acc" in r}
    final = max(acc)
    kl = [r["kl_q_p"] for r in rows if "loss" in r]
    gap = [r["logprob_gap"] for r in rows if "loss" in r]  # |log p − log q|: never below 0
    return dict(
        eval_acc=acc,
        drift={r["step"]: r["drift"] for r in rows if "drift" in r},
        peak_acc=max(acc.values()),
        final_acc=acc[final],
        drop=max(acc.values()) - acc[final],
        final_drift=[r["drift"] for r in rows if r["step"] == final][0],
        mean_kl_q_p=float(np.mean(kl)),
        kl_first=float(np.mean(kl[:10])),  # the mismatch over the first and the last 10 updates
        kl_last=float(np.mean(kl[-10:])),  # and the largest mean over any 10 in a row:
        kl_peak=float(windows(kl).max()) if kl else np.nan,
        gap_first=float(np.mean(gap[:10])),
        gap_last=float(np.mean(gap[-10:])),
        step=final,
    )


def report(folder, plot=None):  # prints the tables and the verdict; returns them as a dict
    runs = read(folder)
    if not runs:
        raise SystemExit(
            f"{folder} holds no --compare run with both arms (ARM_seedN/metrics.jsonl)"
        )
    # the seeds compared at the last evaluation both arms of every seed have reached
    last = min(
        max(r["step"] for r in rows if "acc" in r) for a in runs.values() for rows in a.values()
    )
    res = {s: {arm: numbers(a[arm], last) for arm in ARMS} for s, a in runs.items()}

    columns = dict(peak_acc="{:.3f}", final_acc="{:.3f}", drop="{:.3f}", final_drift="{:.2e}")
    columns |= dict(mean_kl_q_p="{:+.2e}", kl_first="{:+.2e}", kl_last="{:+.2e}", kl_peak="{:+.2e}")
    columns |= dict(gap_first="{:.2e}", gap_last="{:.2e}")
    rows = {f"{arm}_seed{s}": r[arm] for s, r in res.items() for arm in ARMS}
    print(f"{folder}: {len(res)} seeds, step {last}")
    harness.table("run", rows, columns)

    # means over the seeds, and the paired difference centred − uncentred, with 95% t-intervals
    intervals = {}
    for k in ("peak_acc", "final_acc", "drop", "final_drift", "mean_kl_q_p"):
        u, c = ([r[arm][k] for r in res.values()] for arm in ARMS)
        intervals[k] = [sweep.interval(x) for x in (u, c, np.subtract(c, u))]
    print(f"{'mean [95%]':22s} {'uncentred':>24s} {'centred':>24s} {'centred - uncentred':>24s}")
    for k, spans in intervals.items():
        f = "{:.2e}" if "kl" in k or "drift" in k else "{:.3f}"
        print(f"{k:22s} " + " ".join(f"{sweep.span(*s, f):>24s}" for s in spans))
    # how much farther the uncentred policy walks: geometric mean, t-interval on the log ratio
    ratio = sweep.ratio_interval(*([r[arm]["final_drift"] for r in res.values()] for arm in ARMS))
    print(f"final drift uncentred / centred: {sweep.span(*ratio, '{:.2f}')}")

    config = json.load(open(os.path.join(folder, "run.json")))
    score = "held-out score" if config["task"] in tasks.TINY else "accuracy"  # as compare says it
    verdict = compare.verdict(list(res.values()), score)

    def grew(k, arm):  # the seeds whose mean over the last 10 updates exceeds the first 10's
        return sum(r[arm][f"{k}_last"] > r[arm][f"{k}_first"] for r in res.values())

    growth = "; ".join(
        f"{arm}: over the run kl_q_p grew in {grew('kl', arm)} of {len(res)} seeds, "
        f"|log p - log q| in {grew('gap', arm)}"
        for arm in ARMS
    )
    print(verdict, growth, sep="\n")
    if plot:
        title = f"{os.path.basename(config['model'])}, --task {config['task']}, --sampler "
        title += config["sampler"] + (f" + kv {config['kv_quant']}" if config["kv_quant"] else "")
        curves(plot, runs, last, title)
    return dict(
        step=last, runs=res, intervals=intervals, ratio=ratio, verdict=verdict, growth=growth
    )


LATE = 0.4  # the pre-registered measure: the mean accuracy over the last 40% of the evaluations
COLLAPSE = 0.10  # a run whose late mean is this far below its peak (or below step 0's) collapsed


def late(rows):  # a run's step-0, peak and late-mean accuracy, its final drift, collapsed or not
    acc = {r["step"]: r["acc"] for r in rows if "acc" in r}
    steps = sorted(acc)
    late_mean = float(np.mean([acc[s] for s in steps[-math.ceil(LATE * len(steps)) :]]))
    peak, first = max(acc.values()), acc[steps[0]]
    fell = round(peak - late_mean, 6) >= COLLAPSE or late_mean < first  # k/400 sit on the bound
    drift = [r["drift"] for r in rows if r["step"] == steps[-1]][0]
    return dict(first=first, peak=peak, late=late_mean, drift=drift, collapsed=fell)


def preregistered(folder, control):
    """docs/real_model.md's pre-registered reading of the full-weight runs: each run's late mean and
    collapse, the paired difference centred − uncentred over the seeds (a 95% t-interval), and the
    verdict: collapse prevented, a conclusive null, or inconclusive. control: the bf16 --compare."""
    runs = {seed: {arm: late(arms[arm]) for arm in ARMS} for seed, arms in read(folder).items()}
    rows = open(os.path.join(control, "uncentered_seed0", "metrics.jsonl"))
    ref = late([json.loads(row) for row in rows])  # the bf16 control's uncentred arm, seed 0
    diff = sweep.interval([r["centered"]["late"] - r["uncentered"]["late"] for r in runs.values()])
    fell = {arm: sum(r[arm]["collapsed"] for r in runs.values()) for arm in ARMS}
    drift = float(np.mean([r["uncentered"]["drift"] for r in runs.values()])) / ref["drift"]
    n = len(runs)
    if fell["uncentered"] >= 2 and not fell["centered"] and n == 3:
        verdict = "collapse prevented (demonstrated)"
    elif not any(fell.values()) and drift >= 1.5 and n == 3:
        verdict = "conclusive null"
    else:
        verdict = "inconclusive"
    print(f"{folder}: late means (the last {LATE:.0%} of evaluations), control {control}")
    harness.table(
        "run", {f"{a}_seed{s}": r[a] for s, r in runs.items() for a in ARMS}, LATE_COLUMNS
    )
    print(f"late mean, centred - uncentred: {sweep.span(*diff, '{:+.3f}')}")
    print(f"collapsed: {fell['uncentered']} uncentred, {fell['centered']} centred of {n} seeds")
    print(f"final drift, uncentred mean / the control's uncentred: {drift:.2f}")
    print(f"pre-registered verdict: {verdict}" + (f" ({n} of 3 seeds in)" if n < 3 else ""))
    found = dict(runs=runs, diff=diff, collapsed=fell, drift_ratio=drift, verdict=verdict)
    return found | by_problem(folder)


def by_problem(folder):
    """The arms problem by problem (evals.jsonl): at each evaluation both arms of a seed reached,
    how many held-out problems (a reward of 1) both got right, the centred arm alone, the uncentred
    arm alone, neither. {seed: {step: counts}}, printed a table a seed."""
    found = {}
    for seed in read(folder):
        files = [os.path.join(folder, f"{arm}_seed{seed}", "evals.jsonl") for arm in ARMS]
        if not all(map(os.path.exists, files)):  # runs from before evals.jsonl
            continue
        u, c = (
            {r["step"]: np.array(r["rewards"]) == 1 for r in map(json.loads, open(f))}
            for f in files
        )
        found[seed] = {
            step: dict(
                both=int((u[step] & c[step]).sum()),
                centred=int((c[step] & ~u[step]).sum()),
                uncentred=int((u[step] & ~c[step]).sum()),
                neither=int((~u[step] & ~c[step]).sum()),
            )
            for step in sorted(set(u) & set(c))
        }
        columns = dict.fromkeys(("both", "centred", "uncentred", "neither"), "{:5d}")
        harness.table(f"seed {seed}, step", {str(k): v for k, v in found[seed].items()}, columns)
    return dict(problems=found)


LATE_COLUMNS = dict(first="{:.4f}", peak="{:.4f}", late="{:.4f}", drift="{:.2f}", collapsed="{}")


def curves(file, runs, last, title):
    """Held-out accuracy and drift at each evaluation (dots), kl_q_p and (where logged) the tail
    ratio's mean log ρ as the means of the last 10 updates at each step: uncentred red, centred
    blue, a line style per seed."""
    dashes = ("-", "--", "-.", ":")
    panels = [("held-out greedy accuracy", "acc"), ("drift  KL(p_0 || p_t)", "drift")]
    panels.append(("kl_q_p, mean of the last 10 updates", "kl_q_p"))
    if any("tail_ratio_log" in r for arms in runs.values() for rows in arms.values() for r in rows):
        panels.append(("tail ratio: mean log ρ, last 10 updates", "tail_ratio_log"))
    out = []
    for name, key in panels:
        lines = {}
        for i, (seed, arms) in enumerate(runs.items()):
            for arm, colour in zip(ARMS, "rb", strict=True):
                xy = [(r["step"], r[key]) for r in arms[arm] if key in r and r["step"] <= last]
                x, y = zip(*xy, strict=True)
                if key in ("kl_q_p", "tail_ratio_log"):  # a step's estimate is noisy: 10 at once
                    y = windows(y)
                    x = x[len(x) - len(y) :]
                label = f"{'un' * (arm == 'uncentered')}centred, seed {seed}"
                dots = "" if key in ("kl_q_p", "tail_ratio_log") else "."  # evaluations: dots
                lines[label] = (x, y, colour + dots + dashes[i % 4])
        out.append(("" if out else title, name, lines))  # the run named once, over the first
    compare.plot(file, out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="the --out of a --compare")
    p.add_argument("--plot", help="draw the curves into this PNG (needs matplotlib)")
    p.add_argument("--control", help="the bf16 control's --out: the pre-registered verdict too")
    args = p.parse_args()
    report(args.folder, args.plot)
    if args.control:
        preregistered(args.folder, args.control)
