"""What never changes a number the run computes (skip it on a first read of train.py): flags and their checks,
logs and metrics.jsonl, run.json, the resumable state, Ctrl-C, GSM8K's files, tables, figures, the verdict."""

import argparse, concurrent.futures, contextlib, importlib.util, json, math, os, re, shutil, sys, threading
import urllib.request

import jax
import numpy as np
from jax.experimental import multihost_utils

import qwen3

# ---------------------------------------------------------------------------------------------------------
# flags: every mistake is named in one line before any download, compile or training


def declare(p, recipe):  # recipe: {task: {flag: default}}, the defaults that depend on the task
    csv = lambda kind: lambda s: tuple(map(kind, s.split(",")))  # noqa: E731  "0.5,5" -> (0.5, 5.0)

    def a(name, help, **kw):  # the help ends with the default: per task, or argparse's
        key = name[2:].replace("-", "_")
        d = ", ".join(f"{t} {r[key]}" for t, r in recipe.items() if key in r) or kw.get("default")
        group.add_argument(
            name, help=help + ("" if d is None or d is False else f" (default: {d})"), **kw
        )

    group = p.add_argument_group("run")
    a(
        "--task",
        "gsm8k: Qwen3; sequence: a tiny CPU Qwen3; bandit: the toy",
        choices=recipe,
        default="gsm8k",
    )
    a("--center", "score centering: subtract the sampler-expected score", action="store_true")
    a(
        "--compare",
        "centring off, then on (bandit: x online/frozen sampler); one table",
        action="store_true",
    )
    a(
        "--seeds",
        "with --compare (not bandit): the seeds to run, e.g. 0,1 (default: --seed)",
        type=csv(int),
    )
    a(
        "--model",
        "Hugging Face repo id or local checkpoint directory (gsm8k)",
        default="Qwen/Qwen3-0.6B",
    )
    a("--data-dir", "folder with GSM8K train.jsonl and test.jsonl (default: download once, cached)")
    a("--seed", "seed of the data order, the sampler's noise and the rollouts", type=int, default=0)
    a(
        "--out",
        "a new folder: metrics.jsonl (flushed every step), summary.json, the resumable state",
    )
    a("--save-every", "keep a resumable state in --out every N steps", type=int)
    a("--resume", "continue the run in this --out folder, with the flags it was started with")
    a("--save", "write the trained policy here as a Hugging Face checkpoint")
    a("--plot", "with --compare: draw the curves into this PNG (needs matplotlib)")
    a(
        "--plan",
        "print the memory per device this run needs (reads config.json only)",
        action="store_true",
    )
    group = p.add_argument_group("RL")
    a("--steps", "optimizer steps", type=int)
    a("--prompts", "prompts per step", type=int)
    a("--group", "rollouts per prompt", type=int, default=8)
    a("--max-tokens", "completion length cap", type=int)
    a("--lr", "constant learning rate", type=float)
    a(
        "--optimizer",
        "no schedule: nothing confounds drift",
        choices=["sgd", "adam", "adamw"],
        default="sgd",
    )
    a(
        "--baseline",
        "advantage r - group mean, or raw r",
        choices=["group", "none"],
        default="group",
    )
    a(
        "--micro-batch",
        "rows per forward/backward pass (default: largest batch divisor <= 16)",
        type=int,
    )
    a(
        "--topk",
        "sampler head recorded per token; 0 = full distribution (exact)",
        type=int,
        default=128,
    )
    a("--tis-cap", "truncated importance sampling, w = min(p/q, C) (default: off)", type=float)
    a(
        "--mis",
        "masked IS LO,HI: w = p/q inside the band, 0 outside (default: off)",
        type=csv(float),
    )
    a("--lora", "train LoRA adapters of this rank on every projection (default: off)", type=int)
    a("--lora-alpha", "LoRA scale alpha / rank (default: alpha = rank)", type=float)
    group = p.add_argument_group("mismatch: how the sampler differs from the float32 trainer")
    a("--sampler", "bf16, or W8A8 fake quantisation", choices=["bf16", "int8", "fp8"])
    a(
        "--kv-quant",
        "fake-quantise every K and V the sampler caches (default: off)",
        choices=["int8", "fp8"],
    )
    a(
        "--weight-noise",
        "fixed relative weight noise σ (bandit: a fixed logit offset's std)",
        type=float,
    )
    a("--staleness", "refresh the sampler every S+1 steps; S >= steps: frozen", type=int, default=0)
    group = p.add_argument_group(
        "evaluation: greedy, clean bf16; the drift meter; bandit: the log cadence"
    )
    a("--eval-every", "evaluate every N steps", type=int)
    a(
        "--eval-n",
        "held-out prompts: the first N GSM8K test problems; N fixed sequence prompts",
        type=int,
    )
    a(
        "--probe-n",
        "the drift meter's probe prompts (gsm8k: the first N test problems)",
        type=int,
        default=64,
    )
    a("--arms", "bandit arms", type=int, default=16)


def mistakes(
    args, chosen
):  # one line per mistake; checks are (is it wrong, what to do), grouped by concern
    v, where, name = vars(args), args.resume or args.out, lambda k: "--" + k.replace("_", "-")  # noqa: E731
    B, devices, bandit = args.prompts * args.group, jax.device_count(), args.task == "bandit"
    ints = "steps prompts group max_tokens eval_every eval_n probe_n arms micro_batch save_every lora".split()
    numbers = (
        [(v[k] is not None and v[k] < 1, f"{name(k)} must be >= 1") for k in ints]
        + [
            (v[k] is not None and not 0 < v[k] < math.inf, f"{name(k)} must be a finite number > 0")
            for k in ("lr", "tis_cap", "lora_alpha")
        ]
        + [
            (not 0 <= args.weight_noise < math.inf, "--weight-noise must be a finite number >= 0"),
            (
                min(args.topk, args.staleness, args.seed, *args.seeds or []) < 0,
                "--topk, --staleness, --seed and --seeds must be >= 0",
            ),
            (
                args.seeds and len(set(args.seeds)) < len(args.seeds),
                f"--seeds {args.seeds} repeats a seed",
            ),
            (
                args.mis and (len(args.mis) != 2 or not 0 <= args.mis[0] < args.mis[1]),
                f"--mis LO,HI needs 0 <= LO < HI, got {args.mis}",
            ),
            (
                not bandit
                and min(B, args.micro_batch) > 0
                and (B % args.micro_batch or args.micro_batch % devices),
                f"--micro-batch {args.micro_batch} must divide --prompts x --group = {B} and be a multiple of the "
                f"{devices} devices",
            ),
        ]
    )
    combinations = [
        (args.compare and args.center, "--compare runs centring off and on: drop --center"),
        (
            args.mis and args.tis_cap is not None,
            "--mis and --tis-cap are two importance weights: pick one",
        ),
        (args.baseline == "group" and args.group < 2, "--baseline group needs --group >= 2"),
        (args.lora_alpha is not None and args.lora is None, "--lora-alpha needs --lora"),
        (
            args.seeds and (not args.compare or bandit),
            "--seeds is for --compare on --task gsm8k or sequence",
        ),
        (args.compare and args.save, "--save keeps one policy: drop --compare"),
        (args.plot and not args.compare, "--plot draws the --compare runs: add --compare"),
        (
            args.plan and (bandit or args.compare or args.resume or args.out or args.save),
            "--plan only prints: drop --compare, --resume, --out and --save (and --task bandit)",
        ),
        (
            bandit
            and bool(
                args.save
                or args.data_dir
                or args.lora
                or args.kv_quant
                or args.save_every
                or args.resume
                or "sampler" in chosen
            ),
            "--save, --data-dir, --lora, --sampler, --kv-quant, --save-every and --resume are not for --task "
            "bandit (its mismatch is --weight-noise, and it runs in seconds)",
        ),
        (
            args.task == "sequence" and (args.data_dir or args.model != "Qwen/Qwen3-0.6B"),
            "--data-dir and --model are for --task gsm8k (the sequence task builds its model from --seed)",
        ),
    ]
    paths = [
        (
            "" in (args.out, args.save, args.plot, args.resume, args.data_dir, args.model),
            "an empty --out, --save, --plot, --resume, --data-dir or --model: give a path or drop the flag",
        ),
        (
            args.plot and not importlib.util.find_spec("matplotlib"),
            "--plot needs matplotlib: pip install matplotlib",
        ),
        (
            args.plot
            and (os.path.isdir(args.plot) or not writable(os.path.join(args.plot, os.pardir))),
            f"--plot {args.plot} must be a PNG file name in a writable folder",
        ),
        (
            args.data_dir
            and not all(os.path.isfile(f"{args.data_dir}/{s}.jsonl") for s in ("train", "test")),
            f"--data-dir {args.data_dir} must contain train.jsonl and test.jsonl",
        ),
        (
            args.resume and args.out and os.path.abspath(args.out) != os.path.abspath(args.resume),
            "--resume DIR continues the run in DIR: drop --out or make it the same folder",
        ),
        (
            where and (os.path.isfile(where) or not writable(where)),
            f"{where} must be a writable folder",
        ),
        (
            args.out and not args.resume and os.path.isdir(args.out) and os.listdir(args.out),
            f"--out {args.out} is not empty: pick a new folder, or --resume {args.out} to continue its run",
        ),
        (
            args.resume and not os.path.isfile(f"{args.resume}/run.json"),
            f"--resume {args.resume} holds no run (run.json): pass the --out of a run",
        ),
        (
            args.resume and args.save and os.path.isfile(f"{args.resume}/summary.json"),
            f"--resume {args.resume}: that run has finished and its state is gone; nothing to --save",
        ),
        (
            args.save and os.path.realpath(args.save) == os.path.realpath(args.model),
            "--save would overwrite the --model checkpoint: pick another folder",
        ),
    ]
    return [msg for bad, msg in numbers + combinations + paths if bad]


def parse_args(argv, recipe, description):
    join_processes()  # first: the checks count the devices of every process
    p = argparse.ArgumentParser(description=description)
    declare(p, recipe)
    args = p.parse_args(argv)
    if args.resume and os.path.isfile(
        f"{args.resume}/run.json"
    ):  # the run's own flags are the defaults
        p.set_defaults(**json.load(open(f"{args.resume}/run.json")))
        args = p.parse_args(argv)
    chosen = {
        k for k in recipe[args.task] if getattr(args, k) is not None
    }  # the rest: the task's defaults
    vars(args).update({k: d for k, d in recipe[args.task].items() if k not in chosen})
    B, devices = args.prompts * args.group, jax.device_count()
    divisors = [d for d in range(devices, min(B, 16) + 1, devices) if B % d == 0]
    args.micro_batch = (
        (divisors or [max(B, 1)])[-1] if args.micro_batch is None else args.micro_batch
    )
    args.lora_alpha = args.lora if args.lora_alpha is None else args.lora_alpha
    errors = mistakes(args, chosen)
    try:
        qwen3.check_save_dir(args.save) if args.save else None
    except ValueError as e:
        errors.append(f"--save {e}")
    if args.resume and not errors:
        was, now = (
            json.load(open(f"{args.resume}/run.json")),
            json.loads(json.dumps(run_config(args))),
        )
        errors += [
            f"--resume {args.resume} was started with --{k.replace('_', '-')} {was.get(k)}, not {v}: "
            "use the same flags"
            for k, v in now.items()
            if was.get(k) != v and k != "save_every"
        ][:1]
    if errors:
        p.error("; ".join(errors))
    args.out = args.resume or args.out
    return args


def writable(path):  # the nearest existing folder on the way to `path` lets us write
    p = os.path.abspath(path)
    return (
        os.path.isdir(p) and os.access(p, os.W_OK)
        if os.path.exists(p)
        else writable(os.path.dirname(p))
    )


def run_config(args):  # the flags a resumed run starts from and must share (all but --save-every)
    return {k: v for k, v in vars(args).items() if k not in ("out", "resume", "save", "plot")}


def join_processes(env=os.environ):
    """One of JAX_NUM_PROCESSES processes (hosts): JAX_PROCESS_ID is its rank, JAX_COORDINATOR_ADDRESS the
    host:port of process 0. Process 0 prints and writes; every process reads (--resume: a shared folder)."""
    if (n := int(env.get("JAX_NUM_PROCESSES", 1))) > 1 and not jax.distributed.is_initialized():
        jax.config.update(
            "jax_cpu_collectives_implementation", "gloo"
        )  # for CPU devices (the tests)
        jax.distributed.initialize(num_processes=n, process_id=int(env["JAX_PROCESS_ID"]))
    if jax.process_index():
        sys.stdout = open(os.devnull, "w")


def start(args):  # the run's folder and run.json (not rewritten by a resume), and the config line
    if jax.process_count() > 1:  # every process has checked the flags before process 0 makes --out
        multihost_utils.sync_global_devices("flags checked")
    if args.out and not args.resume:  # a resumed run's folder exists, with its run.json
        os.makedirs(args.out, exist_ok=True)
        atomic(
            os.path.join(args.out, "run.json"), lambda f: json.dump(run_config(args), f, indent=1)
        )
    print("config " + json.dumps(vars(args)), flush=True)


# ---------------------------------------------------------------------------------------------------------
# logs and metrics.jsonl, the resumable state, Ctrl-C, the checkpoint's tokenizer files, GSM8K's files

COLUMNS = dict(
    reward="{:6.3f}",
    acc="{:6.3f}",
    drift="{:8.2e}",
    grad_norm="{:8.2e}",
    kl_q_p="{:+9.2e}",
    logprob_gap="{:8.2e}",
    entropy="{:6.3f}",
    length="{:6.1f}",
    seconds="{:6.1f}",
)
LOCK, PROGRESS = threading.Lock(), {}  # held while a file is written; where the run is (for Ctrl-C)


def log_step(row, steps, columns, out=None):
    cells = [
        f"{k} " + (COLUMNS[k].format(row[k]) if k in row else "-" * len(COLUMNS[k].format(0)))
        for k in columns
    ]
    print(" | ".join([f"step {row['step']:>{len(str(steps))}}/{steps}", *cells]), flush=True)
    append_rows(out, [row])


def append_rows(out, rows):  # to out/metrics.jsonl; no out (or not process 0), no file
    with (
        LOCK,
        open(f"{out}/metrics.jsonl" if out and not jax.process_index() else os.devnull, "a") as f,
    ):
        f.writelines(json.dumps(row) + "\n" for row in rows)


def atomic(
    file, write, mode="w"
):  # write(f) to a temporary name, then rename: old file or new, never half
    with LOCK:
        if jax.process_index():  # process 0 writes
            return
        with open(file + ".tmp", mode) as f:
            write(f)
        os.replace(file + ".tmp", file)


def write_summary(out, summary):
    print("summary " + json.dumps(summary))
    atomic(
        os.path.join(out, "summary.json"), lambda f: json.dump(summary, f, indent=1)
    ) if out else None
    return summary


def finished(out):  # the summary of a run that has ended (a --resume of it), else None
    return (
        json.load(open(f))
        if out and os.path.exists(f := os.path.join(out, "summary.json"))
        else None
    )


def finish(
    out, hist, steps
):  # summary.json: drift and score per evaluation, peak, final, drop, mismatch
    final, acc, drift = str(steps), hist["acc"], hist["drift"]
    summary = dict(
        drift=drift,
        final_drift=drift[final],
        mean_kl_q_p=float(np.mean(hist["kl_q_p"])),
        reward=float(np.mean(hist["reward"][-5:])),
    )  # the last 5 steps' mean training reward
    summary |= (
        dict(
            eval_acc=acc,
            peak_acc=max(acc.values()),
            final_acc=acc[final],
            drop=max(acc.values()) - acc[final],
        )
        if acc
        else {}
    )
    write_summary(out, summary)
    if (
        out and os.path.exists(os.path.join(out, "state.npz")) and not jax.process_index()
    ):  # it can go
        os.remove(os.path.join(out, "state.npz"))
    return summary


def save_state(
    file, hist, *trees
):  # float32 leaves (bf16 ones widened exactly), then an atomic rename
    leaves = {
        f"a{i}": np.asarray(x, np.float32 if x.dtype == jax.numpy.bfloat16 else x.dtype)
        for i, x in enumerate(jax.tree.leaves(trees))
    }
    atomic(file, lambda f: np.savez(f, hist=np.array(json.dumps(hist)), **leaves), "wb")


def resume(out, hist, *trees):  # hist and trees from out's state, if any; metrics.jsonl cut there
    if out and os.path.exists(file := os.path.join(out, "state.npz")):
        with np.load(
            file
        ) as z:  # the trees as saved, shaped, typed and placed like the templates `trees`
            leaves, tree = jax.tree.flatten(trees)
            if [z[f"a{i}"].shape for i in range(len(z.files) - 1)] != [x.shape for x in leaves]:
                raise ValueError(
                    f"{file} does not match this run (model, --lora, --optimizer, --staleness)"
                )
            hist, trees = (
                json.loads(str(z["hist"])),
                tree.unflatten(
                    [
                        jax.device_put(z[f"a{i}"].astype(x.dtype), x.sharding)
                        for i, x in enumerate(leaves)
                    ]
                ),
            )
        print(f"resumed {out} at step {hist['step']}", flush=True)
    if out:  # rows past the saved state, or cut by a kill mid-write, are the interrupted run's: logged again
        rows = open(os.path.join(out, "metrics.jsonl")).readlines() if hist["step"] else []
        rows = [r for r in rows if r.endswith("\n") and json.loads(r)["step"] < hist["step"]]
        atomic(os.path.join(out, "metrics.jsonl"), lambda f: f.writelines(rows))
    return hist, trees


def at_step(step, out, run_dir, saved):  # for Ctrl-C: where the run is, and how to continue it
    how = (
        f"; python train.py --resume {run_dir} continues from its state at step {saved}"
        if saved
        else ""
    )
    PROGRESS["where"] = f"at step {step} of {out or 'a run without --out'}{how}"


def interruptible(
    work,
):  # work() in a thread, so that Ctrl-C is honoured at once, even inside an XLA call
    try:
        return concurrent.futures.ThreadPoolExecutor(1).submit(work).result()
    except KeyboardInterrupt:
        with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C: stop waiting
            LOCK.acquire(
                timeout=60
            )  # a file being written is finished first: metrics.jsonl stays valid
        print(f"\ninterrupted {PROGRESS.get('where', 'before the first step')}", flush=True)
        os._exit(130)


def save_checkpoint(
    path, cfg, weights, tokenizer_dir
):  # qwen3.save, then the tokenizer files beside it
    qwen3.save(path, cfg, weights)
    for f in os.listdir(tokenizer_dir) if tokenizer_dir else []:
        if f.endswith((".json", ".txt")) and f not in (
            "config.json",
            "model.safetensors.index.json",
        ):
            shutil.copy(os.path.join(tokenizer_dir, f), path)


def read_gsm8k(data_dir, split, normalise):
    """[(question, normalise(gold))] of a split, downloaded once (with progress) when there is no data_dir."""
    cache = os.path.expanduser("~/.cache/score-centering")
    path = os.path.join(data_dir or os.path.join(cache, "gsm8k"), f"{split}.jsonl")
    if not os.path.exists(path):
        fresh = not os.path.exists(cache)
        url = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        progress = lambda n, size, total: print(  # noqa: E731
            f"\rdownloading GSM8K {split}: {min(n * size, total) / 1e6:.1f} / {total / 1e6:.1f} MB",
            end="",
        )
        try:
            urllib.request.urlretrieve(url + f"{split}.jsonl", path + ".part", progress)
        except OSError as e:
            shutil.rmtree(cache) if fresh else None  # no empty cache folder left behind
            raise ValueError(
                f"GSM8K could not be downloaded from GitHub ({getattr(e, 'reason', e)}): pass "
                "--data-dir with train.jsonl and test.jsonl"
            ) from None
        os.replace(path + ".part", path)
        print()
    problems = []
    for n, line in enumerate(open(path, "rb").read().split(b"\n"), 1):
        try:
            if line.strip():  # blank lines (a trailing one, say) are not problems
                row = json.loads(line.decode("utf-8"))
                gold = normalise(row["answer"].split("####")[1])
                assert re.fullmatch(r"-?\d+(\.\d+)?", gold), (
                    f"the gold answer {gold!r} is not a number"
                )
                problems.append((row["question"], gold))
        except (ValueError, KeyError, IndexError, TypeError, AttributeError, AssertionError) as e:
            raise ValueError(
                f"{path}:{n}: not a GSM8K line with a 'question' and an 'answer' ending in "
                f"'#### <number>' ({type(e).__name__}: {e})"
            ) from None
    if not problems:
        raise ValueError(
            f"{path} holds no problems: pass --data-dir with GSM8K's train.jsonl and test.jsonl"
        )
    return problems


# ---------------------------------------------------------------------------------------------------------
# tables, figures and the verdict


def table(
    first, rows, columns
):  # {name: {column: value}} -> a fixed-width table; columns: {column: format}
    width = {c: max(len(c), len(f.format(0))) for c, f in columns.items()}
    print(f"{first:22s} " + " ".join(f"{c:>{width[c]}}" for c in columns))
    for name, r in rows.items():
        print(
            f"{name:22s} " + " ".join(f"{f.format(r[c]):>{width[c]}}" for c, f in columns.items())
        )


def plot(
    file, panels
):  # panels: [(title, y label, {label: (x, y, matplotlib style)})], side by side
    from matplotlib.figure import Figure  # no pyplot: no window, no global state

    fig = Figure(figsize=(5.5 * len(panels), 3.3), dpi=100, layout="tight")
    for ax, (title, ylabel, curves) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        for label, (x, y, style) in curves.items():
            ax.plot(x, y, style, label=label, lw=0.8 if style.endswith(":") else 1.5)
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        ax.legend(fontsize=7, frameon=False)
    os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
    with LOCK:
        fig.savefig(file)


def verdict(
    runs, score="accuracy"
):  # runs [{"uncentered": summary, "centered": summary}] over seeds
    mean = lambda arm, k: 100 * float(np.mean([r[arm][k] for r in runs]))  # noqa: E731  (in points)
    (du, dc), (fu, fc) = (
        [mean(arm, k) for arm in ("uncentered", "centered")] for k in ("drop", "final_acc")
    )
    facts = (
        f"drop {dc:.1f} points centred vs {du:.1f} uncentred, final {score} {fc:.1f} vs {fu:.1f} "
        f"(means over {len(runs)} seed{'s' * (len(runs) > 1)})"
    )
    if dc <= 2 and du - dc >= 3 and fc >= fu - 1.5:
        return "verdict: centring VALIDATED: " + facts
    if abs(du - dc) < 3:
        return "verdict: WITHIN SEED NOISE (drops differ by < 3 points): " + facts
    return (
        "verdict: centring NOT validated (needs a drop <= 2 points, >= 3 smaller than uncentred, and a "
        f"final {score} at most 1.5 below): " + facts
    )


def report(
    args, cfg, res
):  # --compare: the table, the verdict, the figure; res {arm: summary}, off/on pairs
    print(
        "\n{}-layer Qwen3, --sampler {sampler}, --kv-quant {kv_quant}, --weight-noise {weight_noise}, "
        "--staleness {staleness}, {steps} steps, lr {lr}".format(
            cfg["num_hidden_layers"], **vars(args)
        )
    )
    runs = list(res.values())  # uncentred, centred, seed by seed
    by_seed = [dict(uncentered=u, centered=c) for u, c in zip(runs[::2], runs[1::2])]
    columns = dict(
        peak_acc="{:.3f}",
        final_acc="{:.3f}",
        drop="{:.3f}",
        final_drift="{:.2e}",
        mean_kl_q_p="{:+.2e}",
    )
    table(
        "run",
        res
        | {
            f"mean {arm}": {k: np.mean([r[arm][k] for r in by_seed]) for k in columns}
            for arm in ("uncentered", "centered")
        },
        columns,
    )
    score, name = (
        ("accuracy", "GSM8K") if args.task == "gsm8k" else ("held-out score", "sequence task")
    )
    summary = dict(res, verdict=verdict(by_seed, score))
    print(summary["verdict"])
    if args.plot and not jax.process_index():
        style = {
            k: "rb"[i % 2] + ("-", "--", "-.", ":")[i // 2 % 4] for i, k in enumerate(res)
        }  # off, on
        curves = lambda key: {
            k: (list(map(int, r[key])), list(r[key].values()), style[k])  # noqa: E731
            for k, r in res.items()
        }
        plot(
            args.plot,
            [
                (name, f"greedy {score}", curves("eval_acc")),
                (name, "drift  KL(p_0 || p_t) on the probe", curves("drift")),
            ],
        )
    return write_summary(args.out, summary)


def report_bandit(args, runs):  # runs {(sampler, centred): bandit result}
    print(
        f"\n{args.arms} arms, sampler logit offset std {args.weight_noise}, baseline {args.baseline}, "
        f"{args.steps} steps, lr {args.lr}, seed {args.seed}; gap TV(q, p) {runs['online', 0]['gap']:.3f}"
    )
    table(
        "sampler centring",
        {f"{s} {'on' if c else 'off'}": r for (s, c), r in runs.items()},
        {"drift": "{:.3f}", "reward": "{:.3f}"},
    )
    append_rows(
        args.out,
        [
            dict(sampler=s, center=bool(c), step=i + 1, drift=d)
            for (s, c), r in runs.items()
            for i, d in enumerate(r["curve"])
        ],
    )
    if args.plot:
        x = np.arange(1, args.steps + 1)
        curves = {
            f"{s} sampler, centring {'on' if c else 'off'}": (
                x,
                runs[s, c]["curve"],
                "rb"[c] + line,
            )
            for s, line in (("online", "-"), ("frozen", "--"))
            for c in (0, 1)
        }
        curves["sampler gap at start"] = (x[[0, -1]], [runs["online", 0]["gap"]] * 2, "k:")
        plot(args.plot, [("Toy bandit, raw rewards", "drift  TV(p_t, p_0)", curves)])
    return write_summary(
        args.out,
        {
            f"{s}_{'centered' if c else 'uncentered'}": {k: v for k, v in r.items() if k != "curve"}
            for (s, c), r in runs.items()
        },
    )
