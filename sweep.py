"""When does centring pay? `train.py --sweep` runs --compare (centring off, then on, same seeds)
at each level of mismatch; this file reads those runs.

    python train.py --task sequence --sweep --seeds 0,1,2 --steps 600 --eval-every 50 --plot s.png

One row per level: the sampler's measured mismatch (kl_q_p, the token mean of log q - log p on the
rollouts, not the nominal noise), the drift of each arm at the end, the held-out score of each arm
at the end and at its peak, and the gain from centring: centred minus uncentred held-out score of
the same seed, in points, its mean and spread (the sample standard deviation) over the seeds, and
the first evaluation step from which the mean gain exceeds its spread at every later evaluation.
"""

import jax
import numpy as np

import harness

COLUMNS = dict(kl_q_p="{:9.2e}", drift_u="{:7.2f}", drift_c="{:7.2f}", final_u="{:7.3f}")
COLUMNS |= dict(final_c="{:7.3f}", peak_u="{:6.3f}", peak_c="{:6.3f}", gain="{:+6.1f}")
COLUMNS |= dict(spread="{:6.1f}", from_step="{:>9}")


def by_seed(res):  # {run: summary}, run after run as --compare makes them -> [(uncentred, centred)]
    runs = list(res.values())
    return list(zip(runs[::2], runs[1::2], strict=True))


def spread(x):  # the sample standard deviation over seeds (0 for one seed)
    return float(np.std(x, ddof=1)) if len(x) > 1 else 0.0


def gains(pairs, step):  # centred minus uncentred held-out score of each seed at a step, in points
    return [100 * (c["eval_acc"][step] - u["eval_acc"][step]) for u, c in pairs]


def first_step(pairs):  # the first evaluation from which the mean gain exceeds its spread for good
    steps = sorted(pairs[0][0]["eval_acc"], key=int)
    first = None
    for step in steps:
        g = gains(pairs, step)
        if np.mean(g) <= spread(g):
            first = None
        elif first is None:
            first = int(step)
    return first


def row(res):  # one level's runs -> its row of the table
    pairs = by_seed(res)

    def mean(arm, key):  # arm 0: uncentred, 1: centred
        return float(np.mean([pair[arm][key] for pair in pairs]))

    g = [100 * (c["final_acc"] - u["final_acc"]) for u, c in pairs]
    kl = float(np.mean([r["mean_kl_q_p"] for r in res.values()]))
    return dict(
        kl_q_p=kl,
        drift_u=mean(0, "final_drift"),
        drift_c=mean(1, "final_drift"),
        final_u=mean(0, "final_acc"),
        final_c=mean(1, "final_acc"),
        peak_u=mean(0, "peak_acc"),
        peak_c=mean(1, "peak_acc"),
        gain=float(np.mean(g)),
        spread=spread(g),
        from_step=first_step(pairs),
    )


def plot(file, rows, results):
    """Left: the gain from centring (points, seed spread as bars) and the drift ratio, against the
    measured kl_q_p on a log axis. Right: the mean held-out curves of each level (dashed:
    uncentred, solid: centred)."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure  # no pyplot: no window, no global state

    fig = Figure(figsize=(11, 3.6), dpi=100, layout="tight")
    left, right = fig.subplots(1, 2)
    ordered = sorted(rows.values(), key=lambda r: r["kl_q_p"])
    kl = [max(r["kl_q_p"], 1e-6) for r in ordered]  # a log axis: a floor for a zero mismatch
    gain, bars = [r["gain"] for r in ordered], [r["spread"] for r in ordered]
    left.errorbar(kl, gain, bars, fmt="o-", color="k", capsize=3)
    left.axhline(0, color="grey", lw=0.5)
    left.set(
        xscale="log", xlabel="measured kl_q_p (nats a token)", ylabel="gain from centring (points)"
    )
    ratio = left.twinx()
    drift_ratio = [r["drift_u"] / max(r["drift_c"], 1e-9) for r in ordered]
    ratio.plot(kl, drift_ratio, "s--", color="tab:red")
    ratio.set_ylabel("drift uncentred / centred", color="tab:red")
    colours = colormaps["viridis"](np.linspace(0, 0.9, len(results)))
    for colour, (level, res) in zip(colours, results.items(), strict=True):
        pairs = by_seed(res)
        steps = sorted(pairs[0][0]["eval_acc"], key=int)
        for arm, style in ((0, "--"), (1, "-")):
            curve = [np.mean([pair[arm]["eval_acc"][s] for pair in pairs]) for s in steps]
            label = level if arm else None
            right.plot(list(map(int, steps)), curve, style, color=colour, label=label)
    right.set(xlabel="step", ylabel="held-out score, mean of the seeds")
    right.set_title("dashed: uncentred, solid: centred", fontsize=9)
    right.legend(fontsize=7, frameon=False)
    with harness.LOCK:
        fig.savefig(file)


def report(args, results, seconds):  # results {level: {run: summary}}: table, summary.json, figure
    seeds, runs = args.seeds or [args.seed], f"{args.workers} at a time: {seconds:.0f} s"
    print(
        f"\nsweep: {len(results)} levels x {len(seeds)} seeds x 2 arms, {args.steps} steps, {runs}"
    )
    rows = {level: row(res) for level, res in results.items()}
    shown = {level: r | dict(from_step=r["from_step"] or "-") for level, r in rows.items()}
    harness.table("level", shown, COLUMNS)
    print("u: uncentred, c: centred; gain: c - u final held-out score of the same seed, in points")
    if args.plot and not jax.process_index():
        plot(args.plot, rows, results)
    summary = {level: rows[level] | dict(runs=res) for level, res in results.items()}
    return harness.write_summary(args.out, dict(levels=summary, seconds=seconds))
