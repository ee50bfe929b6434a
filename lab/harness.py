"""What never changes a number a run computes (skip it on a first read of train.py): the flags and
their checks, run.json, logs and metrics.jsonl, the resumable state (read back by run.py), Ctrl-C,
tables."""

import argparse
import concurrent.futures
import contextlib
import importlib.util
import json
import math
import os
import threading
import time

import jax
import numpy as np

import score_centering as sc
from lab import devices, hf_checkpoint, tasks

# -------------------------------------------------------------------------------------------------
# flags: every mistake is named in one line before any download, compile or training

SEEDED = {"model": "it builds its model from --seed", "data_dir": "it has no data files"}
MADE = {"data_dir": "it makes its problems"}
NOT_USED = dict(gsm8k={}, arithmetic=MADE) | dict.fromkeys(tasks.TINY, SEEDED)  # a task's: refused
OPTIMIZERS = ["sgd", "adam", "adamw"]  # optax's, at a constant learning rate
W8 = ["int8", "fp8"]  # the 8-bit kinds of numerics a sampler (or its KV cache) may use
KV = [*W8, "int4"]  # the kinds a quantised KV cache may hold
CORRECTIONS = dict(tis=sc.tis, mis=sc.mis, ppo=sc.ppo, cispo=sc.cispo, gspo=sc.gspo, topr=sc.topr)
FORMS = "tis:C, mis:LO,HI, ppo:EPS_LOW,EPS_HIGH[,DUAL_CLIP], cispo or gspo:EPS_LOW,EPS_HIGH, topr"
DPPO = "dppo masks by the shift |p - q|, not by p/q: a top-k tail has no single mass (step 10)"


def flag(key):  # "max_tokens" -> "--max-tokens"
    return "--" + key.replace("_", "-")


def csv(kind):  # "0,1" -> (0, 1) with kind int
    return lambda s: tuple(map(kind, s.split(",")))


def levels(text):  # "0.01,int8+kv_int4" -> [("bf16", 0.01, None), ("int8", 0.0, "int4")]
    found = []
    for level in text.split(","):  # a sampler, then (after +kv_) its KV cache's kind
        weights, _, kv = level.partition("+kv_")
        sampler, noise = (weights, 0.0) if weights in ("float32", *W8) else ("bf16", float(weights))
        found.append((sampler, noise, kv or None))
    return found


def correction(text):  # "ppo:0.2,0.28" -> sc.ppo(0.2, 0.28), checked by the loss; None: no weight
    if text is None:
        return None
    name, _, numbers = text.partition(":")
    if name not in CORRECTIONS:
        raise ValueError(DPPO if name == "dppo" else f"unknown: use {FORMS}")
    c = CORRECTIONS[name](*map(float, numbers.split(",") if numbers else []))  # or TypeError
    one = np.zeros((1, 1))  # one token: the loss checks the correction's bands, at trace time
    sc.loss(one[..., None], one.astype(int), one == 0, one[0], one, center=False, correction=c)
    return c


def declare(p, defaults=True):  # defaults=False: none, to see which flags were typed
    group = p.add_argument_group("run")
    switch = dict(action="store_true")
    sweep = dict(nargs="?", const=(), type=levels, metavar="LEVELS")  # alone: the task's levels

    def a(name, help, **kw):  # the help ends with the default: per task, or argparse's
        key = name[2:].replace("-", "_")
        per_task = ", ".join(f"{t} {r[key]}" for t, r in tasks.RECIPE.items() if key in r)
        d = per_task or kw.get("default")
        shown = "" if d is None or d is False else f" (default: {d})"
        kw = kw if defaults else dict(kw, default=argparse.SUPPRESS)
        group.add_argument(name, help=help + shown, **kw)

    a("--task", "gsm8k, arithmetic; the others: tiny", choices=tasks.RECIPE, default="gsm8k")
    a("--center", "score centering: subtract the sampler-expected score", **switch)
    a("--compare", "centring off, then on, from the same start; one table", **switch)
    a("--seeds", "with --compare: the seeds to run, e.g. 0,1", type=csv(int))
    a("--workers", "with --compare: runs at once, threads sharing the compiled programs", type=int)
    levels_help = ", ".join(f"{t} {s}" for t, s in tasks.SWEEP_LEVELS.items())
    a("--sweep", f"--compare at each mismatch: σ, int8, fp8, +kv_KIND ({levels_help})", **sweep)
    a("--model", "Hugging Face repo id or local checkpoint directory", default="Qwen/Qwen3-0.6B")
    a("--data-dir", "folder with GSM8K train.jsonl and test.jsonl (default: download once, cached)")
    a("--seed", "seed of the data order, the sampler's noise and the rollouts", type=int, default=0)
    a("--out", "a new folder: metrics.jsonl (flushed every step), summary.json, resumable state")
    a("--save-every", "keep a resumable state in --out every N steps", type=int)
    a("--resume", "continue the run in this --out folder, with the flags it was started with")
    a("--save", "write the trained policy here as a Hugging Face checkpoint")
    a("--plot", "with --compare: draw the curves into this PNG (needs matplotlib)")
    a("--plan", "print the memory per device this run needs (reads config.json only)", **switch)

    group = p.add_argument_group("RL")
    a("--steps", "optimizer steps", type=int)
    a("--prompts", "prompts per step", type=int)
    a("--group", "rollouts per prompt", type=int, default=8)
    a("--max-tokens", "completion length cap", type=int)
    a("--lr", "constant learning rate", type=float)
    a("--optimizer", "no schedule: nothing confounds drift", choices=OPTIMIZERS, default="sgd")
    a("--baseline", "reward - group mean, or raw", choices=["group", "none"], default="group")
    a("--micro-batch", "rows a forward/backward pass (default: <= 8,192 tokens)", type=int)
    a("--topk", "sampler head recorded per token; 0: all V (exact)", type=int)
    a("--correction", f"importance weight: {FORMS} (default: off)", metavar="NAME:ARGS")
    a("--lora", "train LoRA adapters of this rank on every projection (default: off)", type=int)
    a("--lora-alpha", "LoRA scale alpha / rank (default: alpha = rank)", type=float)

    group = p.add_argument_group("mismatch: how the sampler differs from the float32 trainer")
    a("--sampler", "float32, bf16, or W8A8 fake quantisation", choices=["float32", "bf16", *W8])
    a("--kv-quant", "fake-quantise the keys and values it caches (default: off)", choices=KV)
    a("--state-dtype", "Qwen3.5's DeltaNet state (default: float32)", choices=["bf16", "fp16"])
    a("--weight-noise", "fixed relative weight noise σ", type=float)
    a("--staleness", "extra steps a sampler copy serves (>= --steps: frozen)", type=int, default=0)

    group = p.add_argument_group("evaluation: greedy, clean bf16; the drift meter")
    a("--eval-every", "evaluate every N steps", type=int)
    a("--eval-n", "held-out prompts: GSM8K's first N test problems, N tiny-task ones", type=int)
    a("--probe-n", "drift meter prompts (gsm8k: the first N test problems)", type=int, default=64)


def writable(path):  # the nearest existing folder on the way to `path` lets us write
    p = os.path.abspath(path)
    if os.path.exists(p):
        return os.path.isdir(p) and os.access(p, os.W_OK)
    return writable(os.path.dirname(p))


def not_positive(key):  # a check: the flag was given, and is not a finite number > 0 (int: >= 1)
    return lambda a: getattr(a, key) is not None and not 0 < getattr(a, key) < math.inf


INTEGERS = "steps prompts group max_tokens eval_every eval_n probe_n micro_batch save_every lora"
CHECKS = [  # (a test of the flags a: what is wrong, if anything; what to say, formatted with a)
    *[(not_positive(k), f"{flag(k)} must be >= 1") for k in (*INTEGERS.split(), "workers")],
    *[(not_positive(k), f"{flag(k)} must be a finite number > 0") for k in ("lr", "lora_alpha")],
    (lambda a: not 0 <= a.weight_noise < math.inf, "--weight-noise must be a finite number >= 0"),
    (
        lambda a: min(a.topk, a.staleness, a.seed, *a.seeds or []) < 0,
        "--topk, --staleness, --seed and --seeds must be >= 0",
    ),
    (lambda a: a.seeds and len(set(a.seeds)) < len(a.seeds), "--seeds {a.seeds} repeats a seed"),
    (lambda a: refusal(correction, a.correction), "--correction {a.correction}: {found}"),
    (
        lambda a: a.B > 0 and a.B % a.devices,  # no micro-batch fits, the default neither
        "--prompts x --group = {a.B} rollouts must be a multiple of the {a.devices} devices",
    ),
    (
        lambda a: (
            min(a.B, a.micro_batch) > 0
            and not a.B % a.devices  # else the check above says it
            and (a.B % a.micro_batch or a.micro_batch % a.devices)
        ),
        "--micro-batch {a.micro_batch} must divide --prompts x --group = {a.B} and be a multiple "
        "of the {a.devices} devices",
    ),
    (
        lambda a: (
            not all(0 <= noise < math.inf and kv in (None, *KV) for _, noise, kv in a.sweep or [])
        ),
        "--sweep levels: σ >= 0, float32, int8, fp8; each +kv_int8, int4, fp8 or not: {a.sweep}",
    ),
    (
        lambda a: a.sweep and {"sampler", "weight_noise", "kv_quant"} & a.given,
        "--sweep sets --sampler, --weight-noise and --kv-quant at each level: drop them",
    ),
    (lambda a: a.compare and a.center, "--compare runs centring off and on: drop --center"),
    (lambda a: a.baseline == "group" and a.group < 2, "--baseline group needs --group >= 2"),
    (lambda a: "lora_alpha" in a.given and not a.lora, "--lora-alpha needs --lora"),
    (
        lambda a: {"seeds", "workers"} & a.given and not a.compare,
        "--seeds and --workers are for --compare",
    ),
    (lambda a: a.compare and a.save, "--save keeps one policy: drop --compare"),
    (lambda a: a.plot and not a.compare, "--plot draws the --compare runs: add --compare"),
    (
        lambda a: a.plan and (a.compare or a.resume or a.out or a.save),
        "--plan only prints: drop --compare, --resume, --out and --save",
    ),
    # paths
    (
        lambda a: "" in (a.out, a.save, a.plot, a.resume, a.data_dir, a.model),
        "an empty --out, --save, --plot, --resume, --data-dir or --model: give a path or drop it",
    ),
    (
        lambda a: a.plot and not importlib.util.find_spec("matplotlib"),
        "--plot needs matplotlib: pip install matplotlib",
    ),
    (
        lambda a: a.plot and os.path.splitext(a.plot)[1].lower() not in (".png", ".pdf", ".svg"),
        "--plot {a.plot} must name a .png, .pdf or .svg file",
    ),
    (
        lambda a: (
            a.plot and (os.path.isdir(a.plot) or not writable(os.path.join(a.plot, os.pardir)))
        ),
        "--plot {a.plot} must be a file name in a writable folder",
    ),
    (
        lambda a: (
            a.data_dir
            and not all(os.path.isfile(f"{a.data_dir}/{s}.jsonl") for s in ("train", "test"))
        ),
        "--data-dir {a.data_dir} must contain train.jsonl and test.jsonl",
    ),
    (
        lambda a: a.resume and a.out and os.path.abspath(a.out) != os.path.abspath(a.resume),
        "--resume DIR continues the run in DIR: drop --out or make it the same folder",
    ),
    (
        lambda a: a.where and (os.path.isfile(a.where) or not writable(a.where)),
        "{a.where} must be a writable folder",
    ),
    (
        lambda a: a.out and not a.resume and os.path.isdir(a.out) and os.listdir(a.out),
        "--out {a.out} is not empty: pick a new folder, or --resume {a.out} to continue its run",
    ),
    (
        lambda a: a.resume and not os.path.isfile(f"{a.resume}/run.json"),
        "--resume {a.resume} holds no run (run.json): pass the --out of a run",
    ),
    (
        lambda a: a.resume and a.save and os.path.isfile(f"{a.resume}/summary.json"),
        "--resume {a.resume}: that run has finished and its state is gone; nothing to --save",
    ),
    (
        lambda a: a.save and os.path.realpath(a.save) == os.path.realpath(a.model),
        "--save would overwrite the --model checkpoint: pick another folder",
    ),
    (lambda a: a.save and refusal(hf_checkpoint.check_save_dir, a.save), "--save {found}"),
]


def refusal(check, x):  # why check(x) refuses x (its ValueError or TypeError), or ""
    try:
        check(x)
        return ""
    except (ValueError, TypeError) as e:
        return str(e)


def mistakes(args, given):
    """Every mistake in the flags, one line each: what is wrong, what to do; given: typed flags."""
    B, where = args.prompts * args.group, args.resume or args.out  # B = P·G
    a = argparse.Namespace(**vars(args), given=given, B=B, devices=jax.device_count(), where=where)
    errors = [
        f"{flag(k)} is not used by --task {args.task} ({why}): drop it"
        for k, why in NOT_USED[args.task].items()
        if k in given
    ]
    for test, message in CHECKS:
        found = test(a)
        if found:
            errors.append(message.format(a=a, found=found))
    return errors


def run_config(args):  # the flags a resumed run starts from and must share (but `free` below)
    ignored = ("out", "resume", "save", "plot", "workers")  # may change at a --resume
    return {k: v for k, v in vars(args).items() if k not in ignored}


def typed(argv):  # the flags typed on the command line, whatever their values
    p = argparse.ArgumentParser(add_help=False)
    declare(p, defaults=False)
    return set(vars(p.parse_known_args(argv)[0]))


def changed_since(args, was):  # a --resume: the first flag that differs from its run.json
    now = json.loads(json.dumps(run_config(args)))  # as run.json holds it: tuples are lists
    free = ("save_every", "micro_batch")  # a micro-batch: rounding alone; one for other devices
    changed = [k for k, v in now.items() if was.get(k) != v and k not in free]
    message = "--resume {} was started with {} {}, not {}: use the same flags"
    return [message.format(args.resume, flag(k), was.get(k), now[k]) for k in changed[:1]]


def parse_args(argv=None, description=None):
    devices.join()  # first: the checks count the devices of every process
    p = argparse.ArgumentParser(description=description)
    declare(p)
    args = p.parse_args(argv)
    run_json = f"{args.resume}/run.json"
    was = json.load(open(run_json)) if args.resume and os.path.isfile(run_json) else None
    if was is not None:  # the run's own flags are the defaults
        p.set_defaults(**was)
        args = p.parse_args(argv)

    # the defaults that depend on the task, and on the devices
    if args.sweep == ():  # --sweep without levels: the task's
        args.sweep = levels(tasks.SWEEP_LEVELS[args.task])
    args.compare = args.compare or bool(args.sweep)  # a sweep is a --compare at every level
    recipe = tasks.RECIPE[args.task]
    if args.sweep and args.task in tasks.TINY:
        recipe = recipe | tasks.SWEEP_RECIPE  # its own: 8 seeds, 150 steps, exact centring
    vars(args).update({k: d for k, d in recipe.items() if getattr(args, k) is None})
    args.workers = 1 if jax.process_count() > 1 else args.workers  # processes step in lockstep
    if args.micro_batch is None:
        args.micro_batch = devices.default_micro_batch(args)
    args.lora_alpha = args.lora if args.lora_alpha is None else args.lora_alpha

    # every mistake at once, one line each
    errors = mistakes(args, typed(argv))
    if was is not None and not errors:
        errors = changed_since(args, was)
    if errors:
        p.error("; ".join(errors))
    args.out = args.resume or args.out
    return args


# -------------------------------------------------------------------------------------------------
# the run's files: run.json, logs and metrics.jsonl, the resumable state; Ctrl-C; tables


def strict(x):  # NaN and ±inf as null, so that every file is JSON that strict parsers read
    if isinstance(x, dict):
        return {k: strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


LOCK = threading.RLock()  # held while files are written (atomic's within): Ctrl-C waits for it
PROGRESS = {}  # where the run is, for Ctrl-C's message
RUN_JSON = {}  # {--out: its run.json} until the first row: a start that fails writes nothing


def atomic(file, write, mode="w"):  # write(f) to a temporary name, then rename: old file or new
    if jax.process_index():  # process 0 writes
        return
    with LOCK:
        try:
            with open(file + ".tmp", mode) as f:
                write(f)
        except BaseException:  # a write that failed leaves no half file behind
            os.remove(file + ".tmp")
            raise
        os.replace(file + ".tmp", file)


def start(args):  # the config line; --out's run.json (a resume's is there) waits for a first row
    RUN_JSON.clear()  # what a start that failed before, in this process, left unwritten
    if args.out and not args.resume:
        RUN_JSON[args.out] = run_config(args)
    print("config " + json.dumps(vars(args)), flush=True)


COLUMNS = {  # the step line's numbers, as printed
    "reward": "{:6.3f}",
    "acc": "{:6.3f}",
    "drift": "{:8.2e}",
    "grad_norm": "{:8.2e}",
    "kl_q_p": "{:+9.2e}",
    "logprob_gap": "{:8.2e}",
    "entropy": "{:6.3f}",
    "length": "{:6.1f}",
    "seconds": "{:6.1f}",
}


def say(text, prefix=""):  # one write: the lines of parallel runs stay whole; prefix None: quiet
    if prefix is not None:
        print(f"{prefix}{text}\n", end="", flush=True)


def log_step(row, steps, out=None, prefix=""):  # "step 12/100 | reward  0.410 | ..."
    cells = [
        f"{k} " + (f.format(row[k]) if k in row else "-" * len(f.format(0)))
        for k, f in COLUMNS.items()
    ]
    say(" | ".join([f"step {row['step']:>{len(str(steps))}}/{steps}", *cells]), prefix)
    if out and not jax.process_index():  # process 0 appends it to out/metrics.jsonl
        with LOCK:  # the first row writes --out's run.json, after every process checked the flags
            os.makedirs(out, exist_ok=True)  # --out, or a --compare's run: a subfolder of it
            for top, config in RUN_JSON.items():
                atomic(f"{top}/run.json", lambda f, c=config: json.dump(c, f, indent=1))
            RUN_JSON.clear()
            with open(f"{out}/metrics.jsonl", "a") as f:
                f.write(json.dumps(strict(row)) + "\n")


def write_summary(out, summary, prefix=""):
    say(f"summary {json.dumps(strict(summary))}", prefix)
    if out:
        atomic(os.path.join(out, "summary.json"), lambda f: json.dump(strict(summary), f, indent=1))
    return summary


def finished(out):  # the summary of a run that has ended (a --resume of it), else None
    if out and os.path.exists(os.path.join(out, "summary.json")):
        return json.load(open(os.path.join(out, "summary.json")))


def recorder(args, out, hist, prefix=""):
    """record(row, params, opt_state, w_sampler), train.grpo's: prints the step's line (prefix None:
    not), appends it to out/metrics.jsonl (the first row: --out's run.json too), keeps what the
    summary needs in hist, saves the resumable state each --save-every steps, tells Ctrl-C where."""
    clock = [time.perf_counter()]

    def record(row, params, opt_state, w_sampler):
        finite = bool(row.pop("finite", True))
        correct = row.pop("correct", None)  # each held-out problem's reward (accuracy: 1 or 0)
        row = {k: v if k == "step" else float(v) for k, v in row.items()}
        step = hist["last"] = row["step"]
        trained = "loss" in row and finite  # an update was made
        if "loss" in row:  # a step that trained: its wall-clock seconds, evaluation included
            row["seconds"] = time.perf_counter() - clock[0]
        clock[0] = time.perf_counter()

        # what the summary reads: the evaluations, the mismatch and the reward of each update
        hist["acc"] |= {str(step): row["acc"]} if "acc" in row else {}
        hist["drift"] |= {str(step): row["drift"]} if "drift" in row else {}
        if trained:
            hist["kl_q_p"].append(row["kl_q_p"])
            hist["reward"].append(row["reward"])
        if not finite:
            hist["diverged_at_step"] = step
        log_step(row, args.steps, out, prefix)
        if correct is not None and out and not jax.process_index():  # in the held-out set's order
            rewards = [round(float(x), 6) for x in np.asarray(correct)]
            with LOCK, open(f"{out}/evals.jsonl", "a") as f:
                f.write(json.dumps(dict(step=step, rewards=rewards)) + "\n")

        # the resumable state, and where Ctrl-C's message says the run can continue from
        if out and args.save_every and (step + 1) % args.save_every == 0 and trained:
            hist["step"] = step + 1
            stale = w_sampler if args.staleness else None  # else rebuilt at the next step anyway
            trees = devices.host((params, opt_state, stale))
            save_state(os.path.join(out, "state.npz"), hist, *trees)
        how = f"; python train.py --resume {args.out} continues from step {hist['step']}"
        PROGRESS["where"] = f"at step {step + 1} of {out or 'a run without --out'}"
        PROGRESS["where"] += how if hist["step"] else ""

    return record


def finish(out, hist, lr=None, prefix=""):
    """summary.json: drift and score per evaluation, peak, final, drop; a run whose update was not
    finite stopped at that step (its weights are that step's), and says so."""
    steps = hist["last"]
    final, acc, drift = str(steps), hist["acc"], hist["drift"]
    kl, reward = float(np.mean(hist["kl_q_p"])), float(np.mean(hist["reward"][-5:]))  # last 5 steps
    summary = dict(drift=drift, final_drift=drift[final], mean_kl_q_p=kl, reward=reward)
    evals = sorted(map(int, acc))  # the mismatch between evaluations: does it grow as p sharpens?
    pairs = zip(evals[:-1], evals[1:], strict=True)
    summary["kl_q_p"] = {str(b): float(np.mean(hist["kl_q_p"][a:b])) for a, b in pairs}
    peak = max(acc.values())
    summary |= dict(eval_acc=acc, peak_acc=peak, final_acc=acc[final], drop=peak - acc[final])
    if "diverged_at_step" in hist:
        summary["stopped"] = (
            f"step {steps}: the loss, a gradient or a weight is not finite: the update was skipped "
            f"and the run stopped with the weights of step {steps}; try a lower --lr (now {lr:g})"
        )
        say(summary["stopped"], prefix)
    write_summary(out, summary, prefix)
    if out and os.path.exists(os.path.join(out, "state.npz")) and not jax.process_index():
        os.remove(os.path.join(out, "state.npz"))  # the run has ended: its state can go
    return summary


def save_state(file, hist, *trees):  # float32 leaves (bf16 widened exactly), then an atomic rename
    leaves = {
        f"a{i}": np.asarray(x, np.float32 if x.dtype == jax.numpy.bfloat16 else x.dtype)
        for i, x in enumerate(jax.tree.leaves(trees))
    }
    atomic(file, lambda f: np.savez(f, hist=np.array(json.dumps(strict(hist))), **leaves), "wb")


def interruptible(work):  # work() in a thread, so that Ctrl-C is honoured at once, even inside XLA
    try:
        return concurrent.futures.ThreadPoolExecutor(1).submit(work).result()
    except KeyboardInterrupt:
        with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C: stop waiting
            LOCK.acquire(timeout=60)  # a file being written is finished first: it stays valid
        print(f"\ninterrupted {PROGRESS.get('where', 'before the first step')}", flush=True)
        os._exit(130)


def table(first, rows, columns):  # {name: {column: value}} -> a fixed-width table; {column: format}
    width = {c: max(len(c), len(f.format(0))) for c, f in columns.items()}
    print(f"{first:22s} " + " ".join(f"{c:>{width[c]}}" for c in columns))
    for name, r in rows.items():
        cells = [f"{f.format(r[c]):>{width[c]}}" for c, f in columns.items()]
        print(f"{name:22s} " + " ".join(cells))
