"""--compare: centring off, then on, from the same seed, weights, data, noise and keys, for each
seed; with --sweep, at each level of mismatch (sweep.py reads those). The runs share their compiled
programs and go --workers at a time, in threads; each run's numbers are those it has alone."""

import argparse
import concurrent.futures
import os
import time

import jax
import numpy as np

from lab import harness, models, sweep, tasks


def compare(args, task, fn, run):
    """Every run of a --compare or --sweep; returns the report's summary. fn: lab.run.build's
    programs; run(args, task, fn, center, seed, out, prefix) -> a run's summary (lab.run.run)."""
    start = time.perf_counter()  # the sweep's wall-clock time, compiling included
    seeds = args.seeds or [args.seed]
    by_seed = dict.fromkeys(seeds, task)
    if args.task in tasks.TINY:  # its model comes from the seed (GSM8K's does not)
        build = tasks.TINY[args.task]
        by_seed = {seed: build(seed, args.eval_n, args.probe_n) for seed in seeds}
    # runs that would interleave their steps by the thousand (a sweep, several seeds at once) print
    # a line each as they finish; the others print every step, prefixed with their name
    quiet = bool(args.sweep) or (len(seeds) > 1 and args.workers > 1)
    results, pool = {}, concurrent.futures.ThreadPoolExecutor(args.workers)
    for sampler, noise, kv in args.sweep or [(args.sampler, args.weight_noise, args.kv_quant)]:
        level = sampler + (f"_noise{noise:g}" if noise else "") + (f"_kv_{kv}" if kv else "")
        mismatch = dict(sampler=sampler, weight_noise=noise, kv_quant=kv)
        level_args = argparse.Namespace(**vars(args) | mismatch)
        results[level] = {}
        for seed in seeds:
            for center in (False, True):
                name = ("centered" if center else "uncentered") + (
                    f"_seed{seed}" if args.seeds else ""
                )
                out = args.out and os.path.join(args.out, level if args.sweep else "", name)
                prefix = None if quiet else f"{name}: "  # None: the run prints nothing
                job = (level_args, by_seed[seed], fn, center, seed, out, prefix)
                results[level][name] = pool.submit(run, *job)
    wait(results, pool, start, quiet)
    results = {level: {k: job.result() for k, job in res.items()} for level, res in results.items()}
    if args.sweep:
        return sweep.report(args, results, time.perf_counter() - start)
    return report(args, task.cfg, results[level])


def wait(results, pool, start, quiet):
    """Every run to its end, a line as each finishes when quiet; a run that fails stops the compare
    there: the runs queued behind it never start, nor write."""
    names = {job: f"{level} {name}" for level, res in results.items() for name, job in res.items()}
    width = max(map(len, names.values()))
    try:
        for done, job in enumerate(concurrent.futures.as_completed(names), 1):
            summary = job.result()
            if quiet:
                seconds = time.perf_counter() - start
                name = names[job].ljust(width)
                print(progress(done, len(names), name, summary, seconds), flush=True)
    finally:
        pool.shutdown(cancel_futures=True)


def progress(done, total, name, summary, seconds):  # "run 3/80 int8 centered_seed1 | score ..."
    last = max(summary["eval_acc"], key=int)  # the run's last evaluation: its score and drift
    left = seconds / done * (total - done)  # at the pace of the runs so far
    stopped = f" | stopped at {summary['stopped'].split(':')[0]}" if "stopped" in summary else ""
    return (
        f"run {done:>{len(str(total))}}/{total} {name} | score {summary['eval_acc'][last]:.3f} | "
        f"drift {summary['drift'][last]:9.2e} | {duration(seconds)} in, about {duration(left)} "
        f"left{stopped}"
    )


def duration(seconds):  # "45 s", "12 min", "3.2 h"
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"


def verdict(runs, score="accuracy"):  # runs: [{"uncentered": summary, "centered": summary}], seeds
    def mean(arm, k):  # over the seeds, in points
        return 100 * float(np.mean([r[arm][k] for r in runs]))

    du, dc = mean("uncentered", "drop"), mean("centered", "drop")
    fu, fc = mean("uncentered", "final_acc"), mean("centered", "final_acc")
    facts = (
        f"drop {dc:.1f} points centred vs {du:.1f} uncentred, final {score} {fc:.1f} vs {fu:.1f} "
        f"(means over {len(runs)} seed{'s' * (len(runs) > 1)})"
    )
    # each bound compared rounded to 1e-6 points: accuracies of k/N sit on a bound exactly (a
    # drop of 0.80 - 0.78 is 2.0000000000000018 points)
    gap, below = round(du - dc, 6), round(fu - fc, 6)
    failed = [f"the centred drop is over 2 points ({dc:.2f})"] * (round(dc, 6) > 2)
    failed += ["the centred drop is the larger"] * (gap < 0)
    failed += [f"the final {score} is {below:.1f} points below, over 1.5"] * (below > 1.5)
    rule = "centring VALIDATED" if not failed else f"centring NOT validated ({'; '.join(failed)})"
    if abs(gap) < 3:
        rule = "centring FAILED (the drops differ by < 3 points: seed noise)"
    if round(du, 6) < 5:  # the hypothesis, that centring prevents the uncentred drop, needs one
        return (
            f"verdict: INCONCLUSIVE (the uncentred arm did not destabilise: its drop, {du:.1f} "
            f"points, is under the 5 the hypothesis presupposes); the rule alone: {rule}: " + facts
        )
    return f"verdict: {rule}: " + facts


def report(args, cfg, res):  # --compare: table, verdict, figure; res {run: summary}, off/on pairs
    print(
        f"\n{cfg['num_hidden_layers']}-layer {models.NAMES[cfg['model_type']]}, "
        f"--sampler {args.sampler}, --kv-quant {args.kv_quant}, --state-dtype {args.state_dtype}, "
        f"--weight-noise {args.weight_noise}, "
        f"--staleness {args.staleness}, --correction {args.correction}, "
        f"{args.steps} steps, lr {args.lr}"
    )
    runs = list(res.values())  # uncentred, centred, seed by seed
    by_seed = [dict(uncentered=u, centered=c) for u, c in zip(runs[::2], runs[1::2], strict=True)]
    columns = dict(peak_acc="{:.3f}", final_acc="{:.3f}", drop="{:.3f}", final_drift="{:.2e}")
    columns["mean_kl_q_p"] = "{:+.2e}"
    means = {
        f"mean {arm}": {k: np.mean([r[arm][k] for r in by_seed]) for k in columns}
        for arm in ("uncentered", "centered")
    }
    harness.table("run", res | means, columns)
    chat = args.task not in tasks.TINY  # a checkpoint on problems: an accuracy
    score, name = ("accuracy", args.task) if chat else ("held-out score", f"{args.task} task")
    summary = dict(res, verdict=verdict(by_seed, score))
    print(summary["verdict"])
    if args.plot and not jax.process_index():
        # off red, on blue; a dash per seed
        style = {k: "rb"[i % 2] + ("-", "--", "-.", ":")[i // 2 % 4] for i, k in enumerate(res)}

        def curves(key):
            return {
                k: (list(map(int, r[key])), list(r[key].values()), style[k]) for k, r in res.items()
            }

        panels = [(name, f"greedy {score}", curves("eval_acc"))]
        panels.append((name, "drift  KL(p_0 || p_t) on the probe", curves("drift")))
        plot(args.plot, panels)
    return harness.write_summary(args.out, summary, prefix=None)  # out/summary.json: not printed


def plot(file, panels):  # panels: [(title, y label, {label: (x, y, matplotlib style)})], in a row
    from matplotlib.figure import Figure  # no pyplot: no window, no global state

    fig = Figure(figsize=(5.5 * len(panels), 3.3), dpi=100, layout="tight")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, ylabel, curves) in zip(axes, panels, strict=True):
        for label, (x, y, style) in curves.items():
            ax.plot(x, y, style, label=label, lw=0.8 if style.endswith(":") else 1.5)
        ax.set(xlabel="step", ylabel=ylabel, title=title)
    # the panels share their curves' labels: one legend, right of the last panel, over no curve
    axes[-1].legend(fontsize=7, frameon=False, loc="center left", bbox_to_anchor=(1, 0.5))
    os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
    with harness.LOCK:
        fig.savefig(file)
