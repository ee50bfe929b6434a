"""python -m lab.corrections DIR: docs/corrections.md's tables, recomputed from the files of the
sweeps in DIR, one `train.py --sweep` a folder (its run.json and summary.json): each correction
with and without centring at each level of mismatch. A level's row is computed again from its
runs' summaries (lab.sweep.row), not read from the sweep's own row; gain_100 is the gain at the
last evaluation alone, where gain is the mean of the last LAST evaluations (lab.sweep); vs_none,
centring alone (no correction, centred) against the correction alone, seed by seed."""

import argparse
import glob
import json
import os

from lab import harness, sweep


def read(folder):  # {level: {correction: {run: summary}}}, "none" first, then the folders' order
    levels = {}
    for file in sorted(glob.glob(os.path.join(folder, "*", "summary.json"))):
        config = json.load(open(os.path.join(os.path.dirname(file), "run.json")))
        stale = f", staleness {config['staleness']}" if config["staleness"] else ""
        for level, res in json.load(open(file))["levels"].items():
            levels.setdefault(level + stale, {})[config["correction"] or "none"] = res["runs"]
    if not levels:
        raise SystemExit(f"{folder} holds no finished --sweep (NAME/summary.json and run.json)")
    return {
        level: dict(sorted(c.items(), key=lambda i: i[0] != "none")) for level, c in levels.items()
    }


def against_none(none, res):  # each seed's centred run with no correction less this one's alone
    if none is None:
        return "-"
    seeds = [run.removeprefix("uncentered_") for run in res if run.startswith("uncentered_")]
    gaps = [sweep.score(none[f"centered_{s}"]) - sweep.score(res[f"uncentered_{s}"]) for s in seeds]
    return sweep.span(*sweep.interval([100 * gap for gap in gaps]), "{:+.1f}")


def report(folder):  # prints a table a level; returns {level: {correction: row}}
    columns = {k: f for k, f in sweep.COLUMNS.items() if k not in ("from_step", "verdict")}
    tables = {}
    for level, corrections in read(folder).items():
        rows = {}
        for name, res in corrections.items():
            r = sweep.shown(sweep.row(res))
            at = r["steps"]  # the gain at the last evaluation, with its interval
            span = sweep.span(at["gain"][-1], at["gain_lo"][-1], at["gain_hi"][-1], "{:+.1f}")
            rows[name] = r | dict(gain_100=span, seeds=len(sweep.by_seed(res)), last=at["step"][-1])
            rows[name]["vs_none"] = against_none(corrections.get("none"), res)
        shapes = sorted({(r["seeds"], r["last"]) for r in rows.values()})  # (seeds, last step)
        print(f"\n{level}: " + "; ".join(f"{n} seeds, {last} steps" for n, last in shapes))
        harness.table("correction", rows, columns | dict(gain_100="{:>21}", vs_none="{:>21}"))
        tables[level] = rows
    print(
        f"\nu: --correction alone, c: with centring; final: the mean of a run's last {sweep.LAST} "
        "evaluations\ngain: c - u final of the same seed, in points [95% paired t-interval]; "
        "gain_100: the same at the last evaluation alone\nratio: drift u / c at the end of the "
        "same seed: geometric mean [95%]\nvs_none: centring alone (none, c) - the correction alone "
        "(u), final, in points [95% paired t-interval over seeds]"
    )
    return tables


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a folder of --sweep outputs, one a correction and setting")
    report(p.parse_args().folder)
