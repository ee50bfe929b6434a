"""When does centring pay, and is the sweep sure of it? `train.py --sweep` runs --compare
(centring off, then on, same seeds) at each level of mismatch; this file reads those runs.

    python train.py --task sequence --sweep --plot s.png      # 8 seeds, 150 steps: about 10 min

One row per level: the sampler's measured mismatch (kl_q_p, the token mean of log q - log p on the
rollouts, not the nominal noise), the final drift of each arm and their ratio, the held-out score
of each arm at the end, and the gain from centring: centred minus uncentred held-out score of the
same seed, in points, each the mean of the run's last LAST evaluations. Over the seeds the gain has
a mean and a 95% paired t-interval, the drift ratio a geometric mean and its interval; the verdict
reads the gain's interval ("pays", "costs", or the largest effect it leaves possible), and
from_step is the first evaluation from which the gain's interval stays above 0. The same gain and
ratio at every evaluation step (the long horizon) go to summary.json, a table and a figure.
"""

import functools
import math
import os

import jax
import numpy as np

from lab import harness

# a run's score at its end: the mean of its last 4 evaluations. One evaluation's noise is 1 to 2
# points; four halve it (if independent). At the default 25 of 150 steps they are steps 75 to 150,
# at 200 of 3,000 steps 2,400 to 3,000: the end of the run, not the path there
LAST = 4
# the kl_q_p users measured on real engines against their trainers (docs/sweep.md names the
# sources): the bands the map shades, to read the sweep's levels against
ENGINES = {"bf16 engines": (1e-4, 9e-3), "fp8 engines": (1e-2, 6e-2)}


def by_seed(res):  # {run: summary}, run after run as --compare makes them -> [(uncentred, centred)]
    runs = list(res.values())
    return list(zip(runs[::2], runs[1::2], strict=True))


def score(run):  # the mean held-out score of the run's last LAST evaluations
    steps = sorted(run["eval_acc"], key=int)[-LAST:]
    return float(np.mean([run["eval_acc"][s] for s in steps]))


@functools.cache
def t_quantile(df, p=0.975):
    """Student's t quantile for p > 1/2 and df >= 1, by bisection on its CDF. With u = √df·tan θ
    the density integrates as P(0 < T < √df·tan θ) = c ∫_0^θ cos^(df-1) φ dφ, c = Γ((df+1)/2) /
    (√π·Γ(df/2)): a bounded integrand on [0, π/2) for every df, which the trapezoid rule handles."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)
    lo, hi = 0.0, math.pi / 2
    for _ in range(60):
        theta = (lo + hi) / 2
        phi = np.linspace(0, theta, 20001)
        if c * np.trapezoid(np.cos(phi) ** (df - 1), phi) < p - 0.5:
            lo = theta
        else:
            hi = theta
    return math.sqrt(df) * math.tan((lo + hi) / 2)


def interval(x):  # mean of the seeds' values and its 95% t-interval (lo, hi): NaN for one seed
    x = np.asarray(x, np.float64)
    mean = float(x.mean())
    if len(x) < 2:
        return mean, math.nan, math.nan
    half = t_quantile(len(x) - 1) * float(x.std(ddof=1)) / math.sqrt(len(x))
    return mean, mean - half, mean + half


def ratio_interval(u, c):
    """Drift uncentred / centred over the seeds: the geometric mean and its 95% interval, a
    t-interval on the log ratio exponentiated; NaN unless every drift is > 0 (step 0 has none)."""
    u, c = np.asarray(u, np.float64), np.asarray(c, np.float64)
    if not (np.all(u > 0) and np.all(c > 0)):
        return math.nan, math.nan, math.nan
    return tuple(math.exp(v) for v in interval(np.log(u / c)))


def verdict(lo, hi):  # the gain's 95% interval in words
    if math.isnan(lo):
        return "one seed: no interval"
    if lo > 0:
        return "pays"
    if hi < 0:
        return "costs"
    # the interval's farther end, not its half-width: the mean can sit off zero, and the largest
    # effect the data leave possible is then larger on that side
    return f"no effect larger than {max(abs(lo), abs(hi)):.1f} points"


def against_steps(pairs):  # the gain and the drift ratio at every evaluation that all runs have
    runs = [run for pair in pairs for run in pair]
    steps = sorted(set.intersection(*(set(run["eval_acc"]) for run in runs)), key=int)

    def arm(i, key, step):  # the seeds' values; arm 0: uncentred, 1: centred
        return np.array([pair[i][key][step] for pair in pairs])

    gain = [interval(100 * (arm(1, "eval_acc", s) - arm(0, "eval_acc", s))) for s in steps]
    ratio = [ratio_interval(arm(0, "drift", s), arm(1, "drift", s)) for s in steps]
    return dict(
        step=[int(s) for s in steps],
        gain=[g[0] for g in gain],
        gain_lo=[g[1] for g in gain],
        gain_hi=[g[2] for g in gain],
        ratio=[r[0] for r in ratio],
        ratio_lo=[r[1] for r in ratio],
        ratio_hi=[r[2] for r in ratio],
    )


def from_step(series):  # the first evaluation from which the gain's interval stays above 0
    first = None
    for step, lo in reversed(list(zip(series["step"], series["gain_lo"], strict=True))):
        if not lo > 0:  # NaN (one seed) included
            break
        first = step
    return first


def row(res):  # one level's runs -> its numbers: the table's row and the series against steps
    pairs = by_seed(res)

    # at the end: the paired gain of the last evaluations, the ratio of the final drifts
    gain, gain_lo, gain_hi = interval([100 * (score(c) - score(u)) for u, c in pairs])
    drifts = [[pair[arm]["final_drift"] for pair in pairs] for arm in (0, 1)]
    ratio, ratio_lo, ratio_hi = ratio_interval(*drifts)
    series = against_steps(pairs)

    return dict(
        kl_q_p=float(np.mean([run["mean_kl_q_p"] for run in res.values()])),
        drift_u=float(np.mean(drifts[0])),
        drift_c=float(np.mean(drifts[1])),
        ratio=ratio,
        ratio_lo=ratio_lo,
        ratio_hi=ratio_hi,
        final_u=float(np.mean([score(u) for u, _ in pairs])),
        final_c=float(np.mean([score(c) for _, c in pairs])),
        gain=gain,
        gain_lo=gain_lo,
        gain_hi=gain_hi,
        from_step=from_step(series),
        verdict=verdict(gain_lo, gain_hi),
        steps=series,
    )


# -------------------------------------------------------------------------------------------------
# the tables and the figures

COLUMNS = {  # the table's columns, as printed; intervals as "mean [lo, hi]"
    "kl_q_p": "{:9.2e}",
    "drift_u": "{:7.2f}",
    "drift_c": "{:7.2f}",
    "ratio": "{:>20}",
    "final_u": "{:7.3f}",
    "final_c": "{:7.3f}",
    "gain": "{:>21}",
    "from_step": "{:>9}",
    "verdict": "{:<7}",
}


def span(mean, lo, hi, f):  # "mean [lo, hi]" in format f; "-" where undefined
    if math.isnan(mean):
        return "-"
    if math.isnan(lo):
        return f.format(mean) + " (one seed)"
    return f"{f.format(mean)} [{f.format(lo)}, {f.format(hi)}]"


def shown(r):  # a level's row as the table prints it
    return r | dict(
        ratio=span(r["ratio"], r["ratio_lo"], r["ratio_hi"], "{:.2f}"),
        gain=span(r["gain"], r["gain_lo"], r["gain_hi"], "{:+.1f}"),
        from_step=r["from_step"] or "-",
    )


def evenly(items, n):  # n of the items, evenly spaced, the first and the last among them
    return [
        items[i] for i in np.linspace(0, len(items) - 1, min(n, len(items))).round().astype(int)
    ]


def steps_tables(rows, n=6):  # the gain and the ratio at n evenly spaced evaluation steps
    steps = sorted({s for r in rows.values() for s in r["steps"]["step"]})
    steps = evenly(steps, n)
    for name, f in (("gain", "{:+.1f}"), ("ratio", "{:.2f}")):
        cells = {}
        for level, r in rows.items():
            s = r["steps"]
            triples = zip(s[name], s[name + "_lo"], s[name + "_hi"], strict=True)
            at = {str(step): span(*t, f) for step, t in zip(s["step"], triples, strict=True)}
            cells[level] = {str(step): at.get(str(step), "-") for step in steps}
        harness.table(f"{name} [95%] at step", cells, {str(step): "{:>21}" for step in steps})


def kl_table(results, n=8):  # each arm's kl_q_p between evaluations (n of them), the seeds' mean
    cells = {}
    for level, res in results.items():
        for arm, runs in zip(("u", "c"), zip(*by_seed(res), strict=True), strict=True):
            steps = sorted(set.intersection(*(set(run["kl_q_p"]) for run in runs)), key=int)
            cells[f"{level} {arm}"] = {
                s: np.mean([run["kl_q_p"][s] for run in runs]) for s in steps
            }
    columns = sorted({s for row in cells.values() for s in row}, key=int)
    columns = evenly(columns, n)
    cells = {k: {s: row.get(s, math.nan) for s in columns} for k, row in cells.items()}
    harness.table("kl_q_p to step", cells, dict.fromkeys(columns, "{:9.2e}"))


def plot_map(file, rows, results, colours):
    """Left: the gain from centring (points, 95% intervals as bars) and the drift ratio, against
    the measured kl_q_p on a log axis. Right: the mean held-out curves of each level (dashed:
    uncentred, solid: centred)."""
    from matplotlib.figure import Figure  # no pyplot: no window, no global state

    fig = Figure(figsize=(11, 3.6), dpi=100, layout="tight")
    left, right = fig.subplots(1, 2)

    # the map: gain and drift ratio against the measured mismatch
    ordered = sorted(rows.values(), key=lambda r: r["kl_q_p"])
    kl = [max(r["kl_q_p"], 1e-6) for r in ordered]  # a log axis: a floor for a zero mismatch
    twin = left.twinx()
    for ax, name, colour in ((left, "gain", "k"), (twin, "ratio", "tab:red")):
        mean, lo, hi = (np.array([r[name + k] for r in ordered]) for k in ("", "_lo", "_hi"))
        bars = np.nan_to_num([mean - lo, hi - mean])  # one seed: no bars
        ax.errorbar(kl, mean, bars, fmt="o-" if name == "gain" else "s--", color=colour, capsize=3)
    left.axhline(0, color="grey", lw=0.5)
    for (name, (lo, hi)), colour in zip(ENGINES.items(), ("tab:blue", "tab:orange"), strict=True):
        left.axvspan(lo, hi, color=colour, alpha=0.12, label=name + " (measured)")
    left.legend(fontsize=7, frameon=False, loc="upper left")
    left.set(xscale="log", xlabel="measured kl_q_p (nats a token)", ylabel="gain (points, 95%)")
    twin.set_ylabel("drift uncentred / centred", color="tab:red")

    # the held-out curves, mean of the seeds
    for colour, (level, res) in zip(colours, results.items(), strict=True):
        pairs = by_seed(res)
        steps = rows[level]["steps"]["step"]
        for arm, style in ((0, "--"), (1, "-")):
            curve = [np.mean([pair[arm]["eval_acc"][str(s)] for pair in pairs]) for s in steps]
            right.plot(steps, curve, style, color=colour, label=level if arm else None)
    right.set(xlabel="step", ylabel="held-out score, mean of the seeds")
    right.set_title("dashed: uncentred, solid: centred", fontsize=9)
    right.legend(fontsize=7, frameon=False)
    with harness.LOCK:
        fig.savefig(file)


def plot_steps(file, rows, colours):  # the gain and the drift ratio against steps, 95% bands
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.6), dpi=100, layout="tight")
    axes = fig.subplots(1, 2)
    for ax, name, base in ((axes[0], "gain", 0), (axes[1], "ratio", 1)):
        for colour, (level, r) in zip(colours, rows.items(), strict=True):
            s = {k: np.array(v, np.float64) for k, v in r["steps"].items()}
            ax.plot(s["step"], s[name], color=colour, label=level)
            ax.fill_between(s["step"], s[name + "_lo"], s[name + "_hi"], color=colour, alpha=0.2)
        ax.axhline(base, color="grey", lw=0.5)
    axes[0].set(xlabel="step", ylabel="gain from centring (points, 95%)")
    axes[1].set(xlabel="step", ylabel="drift uncentred / centred (95%)")  # linear: ticks within 1-2
    axes[0].legend(fontsize=7, frameon=False)
    with harness.LOCK:
        fig.savefig(file)


def report(args, results, seconds):  # results {level: {run: summary}}: tables, summary.json, plots
    seeds = args.seeds or [args.seed]
    print(
        f"\nsweep: {len(results)} levels x {len(seeds)} seeds x 2 arms, {args.steps} steps, "
        f"--correction {args.correction}, {args.workers} at a time: {seconds:.0f} s"
    )

    # the table at the end of the runs, then against steps
    rows = {level: row(res) for level, res in results.items()}
    harness.table("level", {level: shown(r) for level, r in rows.items()}, COLUMNS)
    print(
        f"u: uncentred, c: centred; final: the mean of a run's last {LAST} evaluations\n"
        "gain: c - u final of the same seed, in points: mean over seeds [95% paired t-interval]\n"
        "ratio: drift u / c at the end of the same seed: geometric mean [95%]\n"
        "from_step: the first evaluation from which the gain's interval stays above 0"
    )
    steps_tables(rows)
    kl_table(results)

    # summary.json, then the figures: the map, and against steps next to it
    summary = {level: rows[level] | dict(runs=res) for level, res in results.items()}
    summary = harness.write_summary(args.out, dict(levels=summary, seconds=seconds), prefix=None)
    if args.plot and not jax.process_index():
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        from matplotlib import colormaps

        colours = colormaps["viridis"](np.linspace(0, 0.9, len(results)))
        plot_map(args.plot, rows, results, colours)
        root, ext = os.path.splitext(args.plot)
        plot_steps(root + "_steps" + ext, rows, colours)
    return summary
