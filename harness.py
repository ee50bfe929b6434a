"""What never changes a number the run computes (skip it on a first read of train.py): joining
several processes, the flags and their checks, run.json, logs and metrics.jsonl, the resumable
state, Ctrl-C, GSM8K's files, tables, figures and the verdict."""

import argparse
import concurrent.futures
import contextlib
import importlib.util
import json
import math
import os
import re
import shutil
import socket
import sys
import threading
import time
import urllib.request

import jax
import numpy as np
from jax.experimental import multihost_utils

import hf_checkpoint

# -------------------------------------------------------------------------------------------------
# processes


def reachable(address, seconds):  # a TCP connection to host:port opens within `seconds`
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + seconds
    while True:
        try:
            left = max(deadline - time.monotonic(), 0.1)
            socket.create_connection((host, int(port)), timeout=min(left, 5)).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)


def join_processes(env=os.environ):
    """One of JAX_NUM_PROCESSES processes (hosts): JAX_PROCESS_ID is its rank,
    JAX_COORDINATOR_ADDRESS the host:port of process 0, JAX_COORDINATOR_TIMEOUT how many seconds
    to wait for it (default 120). Process 0 prints and writes; every process reads (--resume: a
    shared folder). A process that cannot reach process 0 says so in one line and stops."""
    n = int(env.get("JAX_NUM_PROCESSES", 1))
    if n > 1 and not jax.distributed.is_initialized():
        rank, address = env.get("JAX_PROCESS_ID", "?"), env.get("JAX_COORDINATOR_ADDRESS", "")
        seconds = float(env.get("JAX_COORDINATOR_TIMEOUT", 120))
        if not rank.isdigit() or not int(rank) < n or ":" not in address:
            raise SystemExit(
                f"error: JAX_NUM_PROCESSES={n} needs JAX_PROCESS_ID in 0..{n - 1} (got {rank}) "
                f"and JAX_COORDINATOR_ADDRESS host:port of process 0 (got {address!r})"
            )
        who = "the other processes" if rank == "0" else "the coordinator, process 0,"
        print(
            f"process {rank} of {n}: waiting up to {seconds:g} s for {who} at {address} "
            "(JAX_COORDINATOR_ADDRESS; JAX_COORDINATOR_TIMEOUT sets the wait)",
            flush=True,
        )
        if rank != "0" and not reachable(address, seconds):
            raise SystemExit(
                f"error: process {rank} of {n} found no coordinator at {address} within "
                f"{seconds:g} s: set JAX_COORDINATOR_ADDRESS to process 0's host:port, reachable "
                "from here, and start process 0"
            )
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices: the tests
        jax.distributed.initialize(
            address, n, int(rank), initialization_timeout=max(int(seconds), 1)
        )
    if jax.process_index():
        sys.stdout = open(os.devnull, "w")


# -------------------------------------------------------------------------------------------------
# flags: every mistake is named in one line before any download, compile or training


def flag(key):  # "max_tokens" -> "--max-tokens"
    return "--" + key.replace("_", "-")


def csv(kind):  # "0.5,5" -> (0.5, 5.0)
    return lambda s: tuple(map(kind, s.split(",")))


QWEN3_06B = "Qwen/Qwen3-0.6B"
SWEEP = "0,0.01,0.03,0.1,int8"  # --sweep's levels: a bf16 sampler with fixed weight noise S; W8A8


def levels(text):  # "0,0.01,int8" -> [("bf16", 0.0), ("bf16", 0.01), ("int8", 0.0)]
    return [(s, 0.0) if s in ("int8", "fp8") else ("bf16", float(s)) for s in text.split(",")]


def declare(p, recipe):  # recipe: {task: {flag: default}}, the defaults that depend on the task
    group = p.add_argument_group("run")
    switch, optimizers, kinds = dict(action="store_true"), ["sgd", "adam", "adamw"], ["int8", "fp8"]
    sweep = dict(nargs="?", const=levels(SWEEP), type=levels, metavar="LEVELS")

    def a(name, help, **kw):  # the help ends with the default: per task, or argparse's
        key = name[2:].replace("-", "_")
        d = ", ".join(f"{t} {r[key]}" for t, r in recipe.items() if key in r) or kw.get("default")
        shown = "" if d is None or d is False else f" (default: {d})"
        group.add_argument(name, help=help + shown, **kw)

    a("--task", "gsm8k: Qwen3; sequence: tiny Qwen3; bandit: toy", choices=recipe, default="gsm8k")
    a("--center", "score centering: subtract the sampler-expected score", action="store_true")
    a("--compare", "centring off, then on (bandit: x online/frozen); one table", **switch)
    a("--seeds", "with --compare (not bandit): the seeds to run, e.g. 0,1", type=csv(int))
    a("--workers", "with --compare: runs at once, threads sharing the compiled programs", type=int)
    a("--sweep", f"--compare at each mismatch: S (bf16, noise S) or int8, fp8 ({SWEEP})", **sweep)
    a("--model", "Hugging Face repo id or local checkpoint directory (gsm8k)", default=QWEN3_06B)
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
    a("--optimizer", "no schedule: nothing confounds drift", choices=optimizers, default="sgd")
    a("--baseline", "r - group mean, or raw r", choices=["group", "none"], default="group")
    a("--micro-batch", "rows a forward/backward pass (default: <= 8,192 tokens)", type=int)
    a("--topk", "sampler head recorded per token; 0: all V (exact)", type=int, default=128)
    a("--tis-cap", "truncated importance sampling, w = min(p/q, C) (default: off)", type=float)
    a("--mis", "masked IS: w = p/q inside LO,HI, else 0 (default: off)", type=csv(float))
    a("--lora", "train LoRA adapters of this rank on every projection (default: off)", type=int)
    a("--lora-alpha", "LoRA scale alpha / rank (default: alpha = rank)", type=float)

    group = p.add_argument_group("mismatch: how the sampler differs from the float32 trainer")
    a("--sampler", "bf16, or W8A8 fake quantisation", choices=["bf16", "int8", "fp8"])
    a("--kv-quant", "fake-quantise each K and V the sampler caches (default: off)", choices=kinds)
    a("--weight-noise", "fixed relative weight noise σ (bandit: a logit offset's std)", type=float)
    a("--staleness", "refresh the sampler every S+1 steps; S >= steps: frozen", type=int, default=0)

    group = p.add_argument_group("evaluation: greedy, clean bf16; the drift meter; bandit: logs")
    a("--eval-every", "evaluate every N steps", type=int)
    a("--eval-n", "held-out prompts: the first N GSM8K test problems; N sequence prompts", type=int)
    a("--probe-n", "drift meter prompts (gsm8k: the first N test problems)", type=int, default=64)
    a("--arms", "bandit arms", type=int, default=16)


def writable(path):  # the nearest existing folder on the way to `path` lets us write
    p = os.path.abspath(path)
    if os.path.exists(p):
        return os.path.isdir(p) and os.access(p, os.W_OK)
    return writable(os.path.dirname(p))


def mistakes(args, chosen):
    """Every mistake in the flags, one line each: what is wrong and what to do instead."""
    v, where, bandit, seeds = vars(args), args.resume or args.out, args.task == "bandit", args.seeds
    B, devices, mb = args.prompts * args.group, jax.device_count(), args.micro_batch  # B = P·G
    # numbers
    ints = (
        "steps prompts group max_tokens eval_every eval_n probe_n arms micro_batch save_every lora "
        "workers"
    )
    errors = [f"{flag(k)} must be >= 1" for k in ints.split() if v[k] is not None and v[k] < 1]
    errors += [
        f"{flag(k)} must be a finite number > 0"
        for k in ("lr", "tis_cap", "lora_alpha")
        if v[k] is not None and not 0 < v[k] < math.inf
    ]
    if not 0 <= args.weight_noise < math.inf:
        errors.append("--weight-noise must be a finite number >= 0")
    if min(args.topk, args.staleness, args.seed, *seeds or []) < 0:
        errors.append("--topk, --staleness, --seed and --seeds must be >= 0")
    if seeds and len(set(seeds)) < len(seeds):
        errors.append(f"--seeds {seeds} repeats a seed")
    if args.mis and (len(args.mis) != 2 or not 0 <= args.mis[0] < args.mis[1]):
        errors.append(f"--mis LO,HI needs 0 <= LO < HI, got {args.mis}")
    if not bandit and min(B, mb) > 0 and (B % mb or mb % devices):
        errors.append(
            f"--micro-batch {mb} must divide --prompts x --group = {B} and be a multiple of the "
            f"{devices} devices"
        )
    # combinations
    noises = [noise for _, noise in args.sweep or []]
    if not all(0 <= noise < math.inf for noise in noises):
        errors.append(f"--sweep levels are weight noises >= 0, int8 or fp8, got {noises}")
    if args.sweep and bandit:
        errors.append("--sweep is for --task sequence or gsm8k")
    elif args.sweep and {"sampler", "weight_noise"} & chosen:
        errors.append("--sweep sets the sampler and its noise: drop --sampler and --weight-noise")
    if args.compare and args.center:
        errors.append("--compare runs centring off and on: drop --center")
    if args.mis and args.tis_cap is not None:
        errors.append("--mis and --tis-cap are two importance weights: pick one")
    if args.baseline == "group" and args.group < 2:
        errors.append("--baseline group needs --group >= 2")
    if args.lora_alpha is not None and args.lora is None:
        errors.append("--lora-alpha needs --lora")
    if (seeds or "workers" in chosen or bandit and args.workers) and (not args.compare or bandit):
        errors.append("--seeds and --workers are for --compare on --task gsm8k or sequence")
    if args.compare and args.save:
        errors.append("--save keeps one policy: drop --compare")
    if args.plot and not args.compare:
        errors.append("--plot draws the --compare runs: add --compare")
    if args.plan and (bandit or args.compare or args.resume or args.out or args.save):
        errors.append(
            "--plan only prints: drop --compare, --resume, --out and --save (and --task bandit)"
        )
    models_only = [args.save, args.data_dir, args.lora, args.kv_quant, args.save_every, args.resume]
    if bandit and (any(models_only) or "sampler" in chosen):
        errors.append(
            "--save, --data-dir, --lora, --sampler, --kv-quant, --save-every and --resume are not "
            "for --task bandit (its mismatch is --weight-noise, and it runs in seconds)"
        )
    if args.task == "sequence" and (args.data_dir or args.model != QWEN3_06B):
        errors.append(
            "--data-dir and --model are for --task gsm8k (the sequence task builds its model from "
            "--seed)"
        )
    # paths
    if "" in (args.out, args.save, args.plot, args.resume, args.data_dir, args.model):
        errors.append(
            "an empty --out, --save, --plot, --resume, --data-dir or --model: give a path or drop "
            "the flag"
        )
    if args.plot and not importlib.util.find_spec("matplotlib"):
        errors.append("--plot needs matplotlib: pip install matplotlib")
    if args.plot and (os.path.isdir(args.plot) or not writable(os.path.join(args.plot, os.pardir))):
        errors.append(f"--plot {args.plot} must be a PNG file name in a writable folder")
    data = [f"{args.data_dir}/{split}.jsonl" for split in ("train", "test")]
    if args.data_dir and not all(os.path.isfile(f) for f in data):
        errors.append(f"--data-dir {args.data_dir} must contain train.jsonl and test.jsonl")
    if args.resume and args.out and os.path.abspath(args.out) != os.path.abspath(args.resume):
        errors.append(
            "--resume DIR continues the run in DIR: drop --out or make it the same folder"
        )
    if where and (os.path.isfile(where) or not writable(where)):
        errors.append(f"{where} must be a writable folder")
    if args.out and not args.resume and os.path.isdir(args.out) and os.listdir(args.out):
        errors.append(
            f"--out {args.out} is not empty: pick a new folder, or --resume {args.out} to continue "
            "its run"
        )
    if args.resume and not os.path.isfile(f"{args.resume}/run.json"):
        errors.append(f"--resume {args.resume} holds no run (run.json): pass the --out of a run")
    if args.resume and args.save and os.path.isfile(f"{args.resume}/summary.json"):
        errors.append(
            f"--resume {args.resume}: that run has finished and its state is gone; nothing to "
            "--save"
        )
    if args.save and os.path.realpath(args.save) == os.path.realpath(args.model):
        errors.append("--save would overwrite the --model checkpoint: pick another folder")
    if args.save:  # a file, an unwritable folder, or a folder with another checkpoint
        try:
            hf_checkpoint.check_save_dir(args.save)
        except ValueError as e:
            errors.append(f"--save {e}")
    return errors


def check_against_model(cfg, name, topk, max_tokens):  # flags that the model's config can refuse
    V, n_pos = cfg["vocab_size"], cfg.get("max_position_embeddings", math.inf)
    if topk > V:
        raise ValueError(f"--topk {topk} exceeds the {V} tokens of {name}")
    if topk == 0 and V > 4096:
        raise ValueError(f"--topk 0 records q over all {V} tokens: use --topk 128")
    if max_tokens >= n_pos:
        raise ValueError(
            f"--max-tokens {max_tokens} reaches past the {n_pos} positions of the model"
        )


def run_config(args):  # the flags a resumed run starts from and must share (but --save-every)
    return {
        k: v for k, v in vars(args).items() if k not in ("out", "resume", "save", "plot", "workers")
    }


def parse_args(argv, recipe, description):
    join_processes()  # first: the checks count the devices of every process
    p = argparse.ArgumentParser(description=description)
    declare(p, recipe)
    args = p.parse_args(argv)
    run_json = f"{args.resume}/run.json"
    was = json.load(open(run_json)) if args.resume and os.path.isfile(run_json) else None
    if was is not None:  # the run's own flags are the defaults
        p.set_defaults(**was)
        args = p.parse_args(argv)
    chosen = {k for k in recipe[args.task] if getattr(args, k) is not None}
    args.compare = args.compare or bool(args.sweep)  # a sweep is a --compare at every level
    vars(args).update({k: d for k, d in recipe[args.task].items() if k not in chosen})
    if jax.process_count() > 1:  # processes enter a run's collectives together: one run at a time
        args.workers = 1
    if args.micro_batch is None:  # the largest divisor of B = P·G, a multiple of the devices, of at
        B, devices = args.prompts * args.group, jax.device_count()  # most 8,192 completion tokens
        cap = min(B, 8192 // max(args.max_tokens, 1))  # GSM8K's 512-token completions: 16 rows
        divisors = [d for d in range(devices, cap + 1, devices) if B % d == 0]
        args.micro_batch = (divisors or [max(B, 1)])[-1]
    args.lora_alpha = args.lora if args.lora_alpha is None else args.lora_alpha
    errors = mistakes(args, chosen)
    if args.resume and not errors:  # run.json is there: the first flag that differs from it
        now = json.loads(json.dumps(run_config(args)))  # as run.json holds it: tuples are lists
        changed = [k for k, v in now.items() if was.get(k) != v and k != "save_every"]
        if changed:
            k = changed[0]
            errors.append(
                f"--resume {args.resume} was started with {flag(k)} {was.get(k)}, not {now[k]}: "
                "use the same flags"
            )
    if errors:
        p.error("; ".join(errors))
    args.out = args.resume or args.out
    return args


# -------------------------------------------------------------------------------------------------
# the run's files: run.json, logs and metrics.jsonl, the resumable state; Ctrl-C


def strict(x):  # NaN and ±inf as null, so that every file is JSON that strict parsers read
    if isinstance(x, dict):
        return {k: strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


LOCK = threading.Lock()  # held while a file is written: Ctrl-C waits for it
PROGRESS = {}  # where the run is, for Ctrl-C's message


def atomic(file, write, mode="w"):  # write(f) to a temporary name, then rename: old file or new
    if jax.process_index():  # process 0 writes
        return
    with LOCK:
        with open(file + ".tmp", mode) as f:
            write(f)
        os.replace(file + ".tmp", file)


def start(args):  # the run's folder and run.json (not rewritten by a resume), and the config line
    if jax.process_count() > 1:  # every process has checked the flags before process 0 makes --out
        multihost_utils.sync_global_devices("flags checked")
    if args.out and not args.resume:
        os.makedirs(args.out, exist_ok=True)
        atomic(f"{args.out}/run.json", lambda f: json.dump(run_config(args), f, indent=1))
    print("config " + json.dumps(vars(args)), flush=True)


COLUMNS = dict(reward="{:6.3f}", acc="{:6.3f}", drift="{:8.2e}", grad_norm="{:8.2e}")  # step lines
COLUMNS |= dict(kl_q_p="{:+9.2e}", logprob_gap="{:8.2e}", entropy="{:6.3f}", length="{:6.1f}")
COLUMNS |= dict(seconds="{:6.1f}")


def append_rows(out, rows):  # to out/metrics.jsonl; no out (or not process 0), no file
    if not out or jax.process_index():
        return
    with LOCK, open(f"{out}/metrics.jsonl", "a") as f:
        f.writelines(json.dumps(strict(row)) + "\n" for row in rows)


def log_step(row, steps, columns, out=None, prefix=""):  # "step 12/100 | reward  0.410 | ..."
    cells = [
        f"{k} " + (COLUMNS[k].format(row[k]) if k in row else "-" * len(COLUMNS[k].format(0)))
        for k in columns
    ]
    line = " | ".join([f"{prefix}step {row['step']:>{len(str(steps))}}/{steps}", *cells])
    print(line + "\n", end="", flush=True)  # one write: the lines of parallel runs stay whole
    append_rows(out, [row])


def write_summary(out, summary, prefix=""):
    print(f"{prefix}summary {json.dumps(strict(summary))}\n", end="", flush=True)
    if out:
        atomic(os.path.join(out, "summary.json"), lambda f: json.dump(strict(summary), f, indent=1))
    return summary


def finished(out):  # the summary of a run that has ended (a --resume of it), else None
    if out and os.path.exists(os.path.join(out, "summary.json")):
        return json.load(open(os.path.join(out, "summary.json")))


def finish(out, hist, steps, lr=None, prefix=""):
    """summary.json: drift and score per evaluation, peak, final, drop; a run whose update was not
    finite stopped at that step (its weights are that step's), and says so."""
    final, acc, drift = str(steps), hist["acc"], hist["drift"]
    kl, reward = float(np.mean(hist["kl_q_p"])), float(np.mean(hist["reward"][-5:]))  # last 5 steps
    summary = dict(drift=drift, final_drift=drift[final], mean_kl_q_p=kl, reward=reward)
    if acc:
        peak = max(acc.values())
        summary |= dict(eval_acc=acc, peak_acc=peak, final_acc=acc[final], drop=peak - acc[final])
    if "diverged_at_step" in hist:
        summary["stopped"] = (
            f"step {steps}: the loss, a gradient or a weight is not finite: the update was skipped "
            f"and the run stopped with the weights of step {steps}; try a lower --lr (now {lr:g})"
        )
        print(f"{prefix}{summary['stopped']}", flush=True)
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


def resume(out, hist, *trees):  # hist and trees from out's state, if any; metrics.jsonl cut there
    if not out:
        return hist, trees
    os.makedirs(out, exist_ok=True)  # a --compare's run: a subfolder
    file = os.path.join(out, "state.npz")
    if os.path.exists(file):
        with np.load(file) as z:
            leaves, tree = jax.tree.flatten(trees)
            if [z[f"a{i}"].shape for i in range(len(z.files) - 1)] != [x.shape for x in leaves]:
                raise ValueError(
                    f"{file} does not match this run (model, --lora, --optimizer, --staleness)"
                )
            hist = json.loads(str(z["hist"]))
            leaves = [
                jax.device_put(z[f"a{i}"].astype(x.dtype), x.sharding) for i, x in enumerate(leaves)
            ]
            trees = tree.unflatten(leaves)  # typed and placed like the templates `trees`
        print(f"resumed {out} at step {hist['step']}", flush=True)
    # rows past the saved state, or cut by a kill mid-write, are the interrupted run's: logged again
    rows = open(os.path.join(out, "metrics.jsonl")).readlines() if hist["step"] else []
    rows = [r for r in rows if r.endswith("\n") and json.loads(r)["step"] < hist["step"]]
    atomic(os.path.join(out, "metrics.jsonl"), lambda f: f.writelines(rows))
    return hist, trees


def at_step(step, out, run_dir, saved):  # for Ctrl-C: where the run is, and how to continue it
    how = f"; python train.py --resume {run_dir} continues from its state at step {saved}"
    PROGRESS["where"] = f"at step {step} of {out or 'a run without --out'}{how if saved else ''}"


def interruptible(work):  # work() in a thread, so that Ctrl-C is honoured at once, even inside XLA
    try:
        return concurrent.futures.ThreadPoolExecutor(1).submit(work).result()
    except KeyboardInterrupt:
        with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C: stop waiting
            LOCK.acquire(timeout=60)  # a file being written is finished first: it stays valid
        print(f"\ninterrupted {PROGRESS.get('where', 'before the first step')}", flush=True)
        os._exit(130)


# -------------------------------------------------------------------------------------------------
# GSM8K's files


def read_gsm8k(data_dir, split, normalise):
    """[(question, normalise(gold))] of a split; without data_dir, downloaded once and cached."""
    cache = os.path.expanduser("~/.cache/score-centering")
    path = os.path.join(data_dir or os.path.join(cache, "gsm8k"), f"{split}.jsonl")
    if not os.path.exists(path):
        fresh = not os.path.exists(cache)
        url = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/"
        os.makedirs(os.path.dirname(path), exist_ok=True)

        def progress(n, size, total):
            done, total = min(n * size, total) / 1e6, total / 1e6
            print(f"\rdownloading GSM8K {split}: {done:.1f} / {total:.1f} MB", end="")

        try:
            urllib.request.urlretrieve(url + f"{split}.jsonl", path + ".part", progress)
        except OSError as e:
            if fresh:  # no empty cache folder left behind
                shutil.rmtree(cache)
            raise ValueError(
                f"GSM8K could not be downloaded from GitHub ({getattr(e, 'reason', e)}): pass "
                "--data-dir with train.jsonl and test.jsonl"
            ) from None
        os.replace(path + ".part", path)
        print()
    problems = []
    for n, line in enumerate(open(path, "rb").read().split(b"\n"), 1):
        if not line.strip():  # blank lines (a trailing one, say) are not problems
            continue
        try:
            row = json.loads(line.decode("utf-8"))
            gold = normalise(row["answer"].split("####")[1])
            assert re.fullmatch(r"-?\d+(\.\d+)?", gold), f"the gold answer {gold!r} is not a number"
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


# -------------------------------------------------------------------------------------------------
# tables, figures and the verdict


def table(first, rows, columns):  # {name: {column: value}} -> a fixed-width table; {column: format}
    width = {c: max(len(c), len(f.format(0))) for c, f in columns.items()}
    print(f"{first:22s} " + " ".join(f"{c:>{width[c]}}" for c in columns))
    for name, r in rows.items():
        cells = [f"{f.format(r[c]):>{width[c]}}" for c, f in columns.items()]
        print(f"{name:22s} " + " ".join(cells))


def plot(file, panels):  # panels: [(title, y label, {label: (x, y, matplotlib style)})], in a row
    from matplotlib.figure import Figure  # no pyplot: no window, no global state

    fig = Figure(figsize=(5.5 * len(panels), 3.3), dpi=100, layout="tight")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, ylabel, curves) in zip(axes, panels, strict=True):
        for label, (x, y, style) in curves.items():
            ax.plot(x, y, style, label=label, lw=0.8 if style.endswith(":") else 1.5)
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        ax.legend(fontsize=7, frameon=False)
    os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
    with LOCK:
        fig.savefig(file)


def verdict(runs, score="accuracy"):  # runs: [{"uncentered": summary, "centered": summary}], seeds
    def mean(arm, k):  # over the seeds, in points
        return 100 * float(np.mean([r[arm][k] for r in runs]))

    du, dc = mean("uncentered", "drop"), mean("centered", "drop")
    fu, fc = mean("uncentered", "final_acc"), mean("centered", "final_acc")
    facts = (
        f"drop {dc:.1f} points centred vs {du:.1f} uncentred, final {score} {fc:.1f} vs {fu:.1f} "
        f"(means over {len(runs)} seed{'s' * (len(runs) > 1)})"
    )
    if dc <= 2 and du - dc >= 3 and fc >= fu - 1.5:
        return "verdict: centring VALIDATED: " + facts
    if abs(du - dc) < 3:
        return "verdict: WITHIN SEED NOISE (drops differ by < 3 points): " + facts
    return (
        "verdict: centring NOT validated (needs a drop <= 2 points, >= 3 smaller than uncentred, "
        f"and a final {score} at most 1.5 below): " + facts
    )


def report(args, cfg, res):  # --compare: table, verdict, figure; res {run: summary}, off/on pairs
    print(
        f"\n{cfg['num_hidden_layers']}-layer Qwen3, --sampler {args.sampler}, "
        f"--kv-quant {args.kv_quant}, --weight-noise {args.weight_noise}, "
        f"--staleness {args.staleness}, {args.steps} steps, lr {args.lr}"
    )
    runs = list(res.values())  # uncentred, centred, seed by seed
    by_seed = [dict(uncentered=u, centered=c) for u, c in zip(runs[::2], runs[1::2], strict=True)]
    columns = dict(peak_acc="{:.3f}", final_acc="{:.3f}", drop="{:.3f}", final_drift="{:.2e}")
    columns["mean_kl_q_p"] = "{:+.2e}"
    means = {
        f"mean {arm}": {k: np.mean([r[arm][k] for r in by_seed]) for k in columns}
        for arm in ("uncentered", "centered")
    }
    table("run", res | means, columns)
    gsm8k = args.task == "gsm8k"
    score, name = ("accuracy", "GSM8K") if gsm8k else ("held-out score", "sequence task")
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
    return write_summary(args.out, summary)
