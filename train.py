"""'GRPO' on GSM8K, a CPU sequence task or a toy bandit, with a sampler of other numerics than the trainer's.

    python train.py --center                                  # Qwen3-0.6B on GSM8K, score-centred
    python train.py --compare --out runs/gsm8k --plot gsm8k.png   # centring off, then on: same seed and noise
    python train.py --task sequence --compare                 # drift on the LLM code path, a minute on a CPU
    python train.py --task bandit --baseline none --compare   # the mechanism in seconds, on a CPU

What it is: REINFORCE with a group-mean baseline, whose rollouts come from a copy of the policy that runs with
other numerics (bf16 / int8 / fp8 weights and KV cache, fixed weight noise, staleness), trained with
`score_centering.loss`. How it differs from textbook GRPO, and why:
- no KL penalty to a reference model: it would pull toward the start and hide the drift under study;
- no PPO ratio clipping: one optimizer step per batch, so the only off-policyness is the sampler mismatch;
- a token-mean loss over the whole batch, not a mean of per-sequence means (score_centering.py, step 8);
- advantages are rewards minus the group mean, not divided by the group's std (the paper's recipe);
- plain SGD at a constant learning rate on float32 master weights (the paper's recipe; --optimizer adam).
"""
import argparse, concurrent.futures, importlib.util, json, math, os, re, shutil, threading, time
import urllib.request
from collections import namedtuple
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import qwen3
import score_centering as sc

TEMPERATURE = 1.0  # the sampler's; the recorded log q is the post-temperature distribution
GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/%s"
INSTRUCTION = "\nSolve the problem step by step, then give the final answer as a number on the last line."
TASKS = ("gsm8k", "sequence", "bandit")
TASK_DEFAULTS = dict(steps=(100, 30, 200), lr=(0.01, 0.05, 0.5), weight_noise=(0.0, 0.1, 0.5),
                     prompts=(32, 4, 32), max_tokens=(512, 16, 1), sampler=("bf16", "int8", "bf16"),
                     eval_every=(10, 3, 10))
OPTIMIZERS = dict(sgd=optax.sgd, adam=optax.adam, adamw=optax.adamw)  # adamw: optax's decay 1e-4

# ---------------------------------------------------------------------------------------------------------
# flags: every mistake is named in one line before any download, compile or training

def csv(kind):  # "0.5,5" -> (0.5, 5.0): a comma-separated flag value
    return lambda s: tuple(map(kind, s.split(",")))

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])

    def flags(title):
        group = p.add_argument_group(title)
        def add(name, help, **kw):
            d = TASK_DEFAULTS.get(name[2:].replace("-", "_"))
            d = ", ".join(f"{t} {v}" for t, v in zip(TASKS, d)) if d else kw.get("default")
            help += "" if d is None or d is False else f" (default: {d})"
            group.add_argument(name, help=help, **kw)
        return add
    a = flags("run")
    a("--task", "gsm8k: Qwen3 GRPO; sequence: a tiny Qwen3 on a CPU; bandit: the one-step toy", choices=TASKS,
      default="gsm8k")
    a("--center", "score centering: subtract the sampler-expected score", action="store_true")
    a("--compare", "run centring off and on (sequence: x baseline group/none; bandit: x online/frozen "
                   "sampler), print one table", action="store_true")
    a("--seeds", "with --compare on gsm8k: the seeds to run, e.g. 0,1 (default: --seed)", type=csv(int))
    a("--model", "Hugging Face repo id or local checkpoint directory (gsm8k)", default="Qwen/Qwen3-0.6B")
    a("--data-dir", "folder with GSM8K train.jsonl and test.jsonl (default: download once, cached)")
    a("--seed", "seed of the data order, the sampler's noise and the rollouts", type=int, default=0)
    a("--out", "a new folder: metrics.jsonl (flushed every step), summary.json, the resumable state")
    a("--save-every", "keep a resumable state in --out every N steps", type=int)
    a("--resume", "continue the run in this --out folder, with the flags it was started with")
    a("--save", "write the trained policy here as a Hugging Face checkpoint")
    a("--plot", "with --compare: draw the curves into this PNG (needs matplotlib)")
    a = flags("RL")
    a("--steps", "optimizer steps", type=int)
    a("--prompts", "prompts per step", type=int)
    a("--group", "rollouts per prompt", type=int, default=8)
    a("--max-tokens", "completion length cap", type=int)
    a("--lr", "constant learning rate", type=float)
    a("--optimizer", "no schedule: nothing to confound drift", choices=list(OPTIMIZERS), default="sgd")
    a("--baseline", "advantage r - group mean, or raw r", choices=["group", "none"], default="group")
    a("--micro-batch", "sequences per forward/backward pass (default: the largest divisor of the batch "
                       "<= 16)", type=int)
    a("--topk", "sampler head recorded per token; 0 = full distribution (exact)", type=int, default=128)
    a("--tis-cap", "truncated importance sampling, w = min(p/q, C) (default: off)", type=float)
    a("--mis", "masked importance sampling LO,HI: w = p/q inside the band, 0 outside (default: off)",
      type=csv(float))
    a("--lora", "train LoRA adapters of this rank on every projection, not the weights (default: off)",
      type=int)
    a("--lora-alpha", "LoRA scale alpha / rank (default: alpha = rank)", type=float)
    a = flags("mismatch: how the sampler differs from the float32 trainer")
    a("--sampler", "bf16, or W8A8 fake quantisation", choices=["bf16", "int8", "fp8"])
    a("--kv-quant", "fake-quantise every K and V the sampler caches (default: off)", choices=["int8", "fp8"])
    a("--weight-noise", "fixed relative weight noise σ; bandit: the std of a fixed sampler logit offset",
      type=float)
    a("--staleness", "refresh the sampler every S+1 steps; S >= steps: frozen", type=int, default=0)
    a = flags("evaluation: greedy, clean bf16 sampler; the drift meter; bandit: the log cadence")
    a("--eval-every", "evaluate every N steps", type=int)
    a("--eval-n", "the first N GSM8K test problems", type=int, default=500)
    a("--probe-n", "probe prompts of the drift meter (gsm8k: the first N test problems)", type=int,
      default=64)
    a("--arms", "bandit arms", type=int, default=16)
    args = p.parse_args(argv)
    if args.resume and os.path.isfile(f"{args.resume}/run.json"):  # the run's own flags are the defaults
        p.set_defaults(**json.load(open(f"{args.resume}/run.json")))
        args = p.parse_args(argv)
    t = TASKS.index(args.task)
    chosen = {k for k in TASK_DEFAULTS if getattr(args, k) is not None}
    for k, d in TASK_DEFAULTS.items():
        setattr(args, k, d[t] if getattr(args, k) is None else getattr(args, k))
    B, devices, bandit = args.prompts * args.group, jax.local_device_count(), args.task == "bandit"
    divisors = [d for d in range(devices, min(B, 16) + 1, devices) if B % d == 0]
    args.micro_batch = (divisors or [max(B, 1)])[-1] if args.micro_batch is None else args.micro_batch
    args.lora_alpha = args.lora if args.lora_alpha is None else args.lora_alpha
    finite = lambda *xs: all(x is None or math.isfinite(x) for x in xs)  # noqa: E731
    where = args.resume or args.out
    errors = [msg for bad, msg in [
        (min(x for x in (args.steps, args.prompts, args.group, args.max_tokens, args.eval_every,
                         args.eval_n, args.probe_n, args.arms, args.micro_batch, args.save_every, args.lora)
             if x is not None) < 1,
         "--steps, --prompts, --group, --max-tokens, --eval-every, --eval-n, --probe-n, --arms, "
         "--micro-batch, --save-every and --lora must be >= 1"),
        (min(args.topk, args.staleness, args.seed, *args.seeds or []) < 0,
         "--topk, --staleness, --seed and --seeds must be >= 0"),
        (args.seeds and len(set(args.seeds)) < len(args.seeds), f"--seeds {args.seeds} repeats a seed"),
        ("" in (args.out, args.save, args.plot, args.resume, args.data_dir, args.model),
         "an empty --out, --save, --plot, --resume, --data-dir or --model: give a path or drop the flag"),
        (args.task == "sequence" and args.topk > SEQUENCE["vocab_size"],
         f"--topk {args.topk} exceeds the {SEQUENCE['vocab_size']} tokens of the sequence task"),
        (args.compare and args.center, "--compare runs centring off and on: drop --center"),
        (not finite(args.lr, args.weight_noise, args.tis_cap, args.lora_alpha) or args.weight_noise < 0
         or any(x is not None and x <= 0 for x in (args.lr, args.tis_cap, args.lora_alpha)),
         "--lr, --tis-cap, --lora-alpha must be finite numbers > 0 and --weight-noise >= 0"),
        (args.mis and (len(args.mis) != 2 or not 0 <= args.mis[0] < args.mis[1]),
         f"--mis LO,HI needs 0 <= LO < HI, got {args.mis}"),
        (args.mis and args.tis_cap is not None, "--mis and --tis-cap are two importance weights: pick one"),
        (args.baseline == "group" and args.group < 2, "--baseline group needs --group >= 2"),
        (args.lora_alpha is not None and args.lora is None, "--lora-alpha needs --lora"),
        (bandit and bool(args.save or args.data_dir or args.lora or args.kv_quant or args.save_every
                         or args.resume or "sampler" in chosen),
         "--save, --data-dir, --lora, --sampler, --kv-quant, --save-every and --resume are not for --task "
         "bandit (its mismatch is --weight-noise, and it runs in seconds)"),
        (args.task == "sequence" and (args.data_dir or args.model != "Qwen/Qwen3-0.6B"),
         "--data-dir and --model are for --task gsm8k (the sequence task builds its model from --seed)"),
        (args.seeds and (not args.compare or args.task != "gsm8k"),
         "--seeds is for --compare on --task gsm8k"),
        (args.compare and args.save, "--save keeps one policy: drop --compare"),
        (args.plot and not args.compare, "--plot draws the --compare runs: add --compare"),
        (args.plot and not importlib.util.find_spec("matplotlib"),
         "--plot needs matplotlib: pip install matplotlib"),
        (args.plot and (os.path.isdir(args.plot) or not writable(os.path.dirname(os.path.abspath(args.plot))))
         ,
         f"--plot {args.plot} must be a PNG file name in a writable folder"),
        (not bandit and min(B, args.micro_batch) > 0 and (B % args.micro_batch or args.micro_batch % devices),
         f"--micro-batch {args.micro_batch} must divide --prompts x --group = {B} and be a multiple of the "
         f"{devices} local devices"),
        (args.data_dir and not all(os.path.isfile(f"{args.data_dir}/{s}.jsonl") for s in ("train", "test")),
         f"--data-dir {args.data_dir} must contain train.jsonl and test.jsonl"),
        (args.resume and args.out and os.path.abspath(args.out) != os.path.abspath(args.resume),
         "--resume DIR continues the run in DIR: drop --out or make it the same folder"),
        (where and (os.path.isfile(where) or not writable(where)), f"{where} must be a writable folder"),
        (args.out and not args.resume and os.path.isdir(args.out) and os.listdir(args.out),
         f"--out {args.out} is not empty: pick a new folder, or --resume {args.out} to continue its run"),
        (args.resume and not os.path.isfile(f"{args.resume}/run.json"),
         f"--resume {args.resume} holds no run (run.json): pass the --out of a run"),
        (args.resume and args.save and os.path.isfile(f"{args.resume}/summary.json"),
         f"--resume {args.resume}: that run has finished and its state is gone; nothing to --save"),
        (args.save and os.path.realpath(args.save) == os.path.realpath(args.model),
         "--save would overwrite the --model checkpoint: pick another folder"),
    ] if bad]
    try:
        if args.save:
            qwen3.check_save_dir(args.save)
    except ValueError as e:
        errors.append(f"--save {e}")
    if args.resume and not errors:
        was, now = json.load(open(f"{args.resume}/run.json")), json.loads(json.dumps(run_config(args)))
        errors += [f"--resume {args.resume} was started with --{k.replace('_', '-')} {was.get(k)}, not {v}: "
                   "resume with the same flags" for k, v in now.items()
                   if was.get(k) != v and k != "save_every"][:1]
    if errors:
        p.error("; ".join(errors))
    args.out = where
    return args

def writable(path):  # the nearest existing folder on the way to `path` lets us write
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return os.path.isdir(path) and os.access(path, os.W_OK)

def run_config(args):  # the flags a resumed run starts from and must share (all but --save-every)
    return {k: v for k, v in vars(args).items() if k not in ("out", "resume", "save", "plot")}

# ---------------------------------------------------------------------------------------------------------
# logs: one fixed-width line per step; the same numbers in metrics.jsonl, flushed as they are made

COLUMNS = dict(reward="{:6.3f}", acc="{:6.3f}", drift="{:8.2e}", grad_norm="{:8.2e}", kl_q_p="{:+9.2e}",
               logprob_gap="{:8.2e}", entropy="{:6.3f}", length="{:6.1f}", seconds="{:6.1f}")
LOCK, PROGRESS = threading.Lock(), {}  # held while a file is written; where the run is (for Ctrl-C)

def log_step(row, steps, columns, out=None):
    cells = [f"{k} " + (COLUMNS[k].format(row[k]) if k in row else "-" * len(COLUMNS[k].format(0)))
             for k in columns]
    print(" | ".join([f"step {row['step']:>{len(str(steps))}}/{steps}", *cells]), flush=True)
    if out:
        with LOCK, open(os.path.join(out, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")

def write_json(file, data):  # a temporary name, then a rename: the file is either the old one or the new
    with LOCK:
        with open(file + ".tmp", "w") as f:
            json.dump(data, f, indent=1)
        os.replace(file + ".tmp", file)

def write_summary(out, summary):
    print("summary " + json.dumps(summary))
    if out:
        write_json(os.path.join(out, "summary.json"), summary)
    return summary

def plot(file, panels):  # panels: [(title, y label, {label: (x, y, matplotlib style)})], side by side
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.3), dpi=100, squeeze=False)
    for ax, (title, ylabel, curves) in zip(axes[0], panels):
        for label, (x, y, style) in curves.items():
            ax.plot(x, y, style, label=label, lw=0.8 if style.endswith(":") else 1.5)
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
    with LOCK:
        fig.savefig(file)

def interruptible(work):  # work() in a thread, so that Ctrl-C is honoured at once, even inside an XLA call
    future = concurrent.futures.ThreadPoolExecutor(1).submit(work)
    try:
        return future.result()
    except KeyboardInterrupt:
        try:
            LOCK.acquire(timeout=60)  # a file being written is finished first: metrics.jsonl stays valid
        except KeyboardInterrupt:  # a second Ctrl-C: stop waiting
            pass
        print(f"\ninterrupted {PROGRESS.get('where', 'before the first step')}", flush=True)
        os._exit(130)

def table(first, rows, columns):  # {name: {column: value}} -> a fixed-width table; columns: {column: format}
    width = {c: max(len(c), len(f.format(0))) for c, f in columns.items()}
    print(f"{first:22s} " + " ".join(f"{c:>{width[c]}}" for c in columns))
    for name, r in rows.items():
        print(f"{name:22s} " + " ".join(f"{f.format(r[c]):>{width[c]}}" for c, f in columns.items()))

# ---------------------------------------------------------------------------------------------------------
# the toy bandit: the policy is a vector of K logits, the sampler's are the trainer's plus a fixed offset

def tv(logits_a, logits_b):  # total-variation distance between two softmax distributions
    return float(0.5 * jnp.abs(jax.nn.softmax(logits_a) - jax.nn.softmax(logits_b)).sum())

def loss_kw(args, center):
    return dict(center=center, tis_cap=args.tis_cap, mis=args.mis)

def bandit(args, center, staleness, out=None):
    """One run through the very same loss (T = 1). Returns the drift TV(p_t, p_0) after every step."""
    k_success, k_bias, key = jax.random.split(jax.random.PRNGKey(args.seed), 3)
    success = jax.random.uniform(k_success, (args.arms,), minval=0.45, maxval=0.55)  # a small signal
    bias = args.weight_noise * jax.random.normal(k_bias, (args.arms,))  # drawn once: a persistent bias
    B, K = args.prompts * args.group, min(args.topk or args.arms, args.arms)
    opt = OPTIMIZERS[args.optimizer](args.lr)

    @jax.jit
    def step(theta, opt_state, sampler_logits, key):
        k_arm, k_reward = jax.random.split(key)
        logq = jax.nn.log_softmax(sampler_logits)                                      # [V]
        arms = jax.random.categorical(k_arm, logq, shape=(B, 1))                      # [B, T = 1]
        r = jax.random.bernoulli(k_reward, success[arms[:, 0]]).astype(jnp.float32)  # [B]
        head_logq, head_ids = jax.lax.top_k(logq, K)
        head_ids, head_logq = (jnp.broadcast_to(x, (B, 1, K)) for x in (head_ids, head_logq))  # [B, 1, K]
        def loss(theta):
            logits = jnp.broadcast_to(theta, (B, 1, args.arms))                          # [B, T = 1, V]
            return sc.loss(logits, arms, jnp.ones((B, 1), bool), advantage(r, args), logq[arms], head_ids,
                           head_logq, **loss_kw(args, center))
        (_, m), g = jax.value_and_grad(loss, has_aux=True)(theta)
        updates, opt_state = opt.update(g, opt_state, theta)
        m = dict(m, reward=r.mean(), grad_norm=optax.tree.norm(g))
        return optax.apply_updates(theta, updates), opt_state, m

    theta0 = jnp.zeros(args.arms)
    theta, opt_state, curve = theta0, opt.init(theta0), []
    for i in range(args.steps):
        if i % (staleness + 1) == 0:
            sampler_logits = theta + bias                                           # refresh from the trainer
        theta, opt_state, m = step(theta, opt_state, sampler_logits, jax.random.fold_in(key, i))
        curve.append(tv(theta, theta0))
        if out is not None and ((i + 1) % args.eval_every == 0 or i in (0, args.steps - 1)):
            log_step(dict({k: float(v) for k, v in m.items()}, step=i + 1, drift=curve[-1]), args.steps,
                     ["reward", "drift", "grad_norm", "kl_q_p", "logprob_gap", "entropy"], out)
    return dict(drift=curve[-1], gap=tv(theta0 + bias, theta0), reward=float(jax.nn.softmax(theta) @ success),
                best_arm=float(success.max()), curve=curve)

def run_bandit(args):
    if not args.compare:
        res = bandit(args, args.center, args.staleness, args.out or "")
        return write_summary(args.out, {k: v for k, v in res.items() if k != "curve"})
    runs = {(s, c): bandit(args, c, st) for s, st in (("online", 0), ("frozen", args.steps)) for c in (0, 1)}
    print(f"\n{args.arms} arms, sampler logit offset std {args.weight_noise}, baseline {args.baseline}, "
          f"{args.steps} steps, lr {args.lr}, seed {args.seed}; gap TV(q, p) {runs['online', 0]['gap']:.3f}")
    table("sampler centring", {f"{s} {'on' if c else 'off'}": r for (s, c), r in runs.items()},
          {"drift": "{:.3f}", "reward": "{:.3f}"})
    if args.out:
        with LOCK, open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
            f.writelines(json.dumps(dict(sampler=s, center=bool(c), step=i + 1, drift=d)) + "\n"
                         for (s, c), r in runs.items() for i, d in enumerate(r["curve"]))
    if args.plot:
        x = np.arange(1, args.steps + 1)
        curves = {f"{s} sampler, centring {'on' if c else 'off'}": (x, runs[s, c]["curve"], "rb"[c] + line)
                  for s, line in (("online", "-"), ("frozen", "--")) for c in (0, 1)}
        curves["sampler gap at start"] = (x[[0, -1]], [runs["online", 0]["gap"]] * 2, "k:")
        plot(args.plot, [("Toy bandit, raw rewards", "drift  TV(p_t, p_0)", curves)])
    return write_summary(args.out, {f"{s}_{'centered' if c else 'uncentered'}": {k: v for k, v in r.items()
                                    if k != "curve"} for (s, c), r in runs.items()})

def advantage(r, args):  # r [P * G] -> [P * G]: minus the mean of its group of G, or raw
    return (r - r.reshape(-1, args.group).mean(1).repeat(args.group)) if args.baseline == "group" else r

# ---------------------------------------------------------------------------------------------------------
# the tasks: a model, training and test prompts (token lists) with their gold, and a reward of token ids

Task = namedtuple("Task", "cfg weights eos pad train test probe reward path")

def gsm8k(data_dir, split):
    """[(question, gold answer)] of one split, downloaded once (with progress) when there is no data_dir."""
    cache = os.path.expanduser("~/.cache/score-centering")
    path = os.path.join(data_dir or os.path.join(cache, "gsm8k"), f"{split}.jsonl")
    if not os.path.exists(path):
        fresh = not os.path.exists(cache)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        progress = lambda n, size, total: print(  # noqa: E731
            f"\rdownloading GSM8K {split}: {min(n * size, total) / 1e6:.1f} / {total / 1e6:.1f} MB", end="")
        try:
            urllib.request.urlretrieve(GSM8K_URL % f"{split}.jsonl", path + ".part", progress)
        except OSError as e:
            shutil.rmtree(cache) if fresh else None  # no empty cache folder left behind
            raise ValueError(f"GSM8K could not be downloaded from GitHub ({getattr(e, 'reason', e)}): pass "
                             "--data-dir with train.jsonl and test.jsonl") from None
        os.replace(path + ".part", path)
        print()
    problems = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            try:
                if line.strip():  # blank lines (a trailing one, say) are not problems
                    row = json.loads(line.decode("utf-8"))
                    gold = normalise(row["answer"].split("####")[1])
                    assert re.fullmatch(r"-?\d+(\.\d+)?", gold), f"the gold answer {gold!r} is not a number"
                    problems.append((row["question"], gold))
            except (ValueError, KeyError, IndexError, TypeError, AttributeError, AssertionError) as e:
                raise ValueError(f"{path}:{n}: not a GSM8K line with a 'question' and an 'answer' ending in "
                                 f"'#### <number>' ({type(e).__name__}: {e})") from None
    if not problems:
        raise ValueError(f"{path} holds no problems: pass --data-dir with GSM8K's train.jsonl and test.jsonl")
    return problems

def normalise(number):  # "$1,234.50" -> "1234.5", "18.0" -> "18"
    s = number.strip().replace(",", "").replace("$", "")
    return s.rstrip("0").rstrip(".") if "." in s else s

def reward(completion, gold):  # 1 when the completion's last number is the gold answer
    numbers = re.findall(r"-?\$?\d[\d,]*(?:\.\d+)?", completion)
    return float(bool(numbers) and normalise(numbers[-1]) == gold)

def gsm8k_task(args):
    train_set, test_set = gsm8k(args.data_dir, "train"), gsm8k(args.data_dir, "test")
    model = qwen3.load(args.model)
    cfg, tok = model.cfg, model.tokenizer
    V, positions = cfg["vocab_size"], cfg.get("max_position_embeddings", math.inf)
    for bad, msg in [(tok is None, f"{args.model} has no tokenizer files (vocab.json or tokenizer.json)"),
                     (args.save and os.path.realpath(args.save) == os.path.realpath(model.path),
                      f"--save {args.save} is where --model {args.model} lives: pick another folder"),
                     (args.topk > V, f"--topk {args.topk} exceeds the {V} tokens of {args.model}"),
                     (args.topk == 0 and V > 4096, f"--topk 0 records q over all {V} tokens: use --topk 128"),
                     (args.max_tokens >= positions, f"--max-tokens {args.max_tokens} reaches past the "
                                                    f"{positions} positions of the model")]:
        if bad:
            raise ValueError(msg)
    prompts = lambda problems: [(tok.chat(q + INSTRUCTION), gold) for q, gold in problems]  # noqa: E731
    ids = lambda row: [t for t in row if t not in tok.eos_ids]  # noqa: E731  (the text ends at its EOS)
    return Task(cfg, model.weights, tok.eos_ids, tok.pad_id, prompts(train_set),
                prompts(test_set[:args.eval_n]),
                [p for p, _ in prompts(test_set[:args.probe_n])],
                lambda row, gold: reward(tok.decode(ids(row)), gold), model.path)

SEQUENCE = dict(model_type="qwen3", vocab_size=8192, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=256, tie_word_embeddings=True)
SHARPEN = 6.0  # the final norm's weight: entropy ~1.5 nats and top-128 mass > 0.99, like a trained LM's

def sequence_task(args):
    """A tiny Qwen3 from the seed; the reward is the fraction of completion tokens in the lower half of V."""
    cfg, rng = dict(SEQUENCE), np.random.default_rng(args.seed)
    V, (top, layers) = cfg["vocab_size"], qwen3.layout(cfg)
    init = lambda shape, fan_in: rng.standard_normal(shape, np.float32) * fan_in ** -0.5  # noqa: E731
    w = {k: np.full(s, SHARPEN if k == "norm" else 1, np.float32) if len(s) == 1 else init(s, s[-1])
         for k, (_, _, s) in top.items()}
    L = cfg["num_hidden_layers"]
    w["layers"] = {k: np.ones((L, *s), np.float32) if len(s) == 1 else
                   init((L, *s), math.prod(s[:len(INPUT_AXES[k])])) for k, (_, _, s) in layers.items()}
    prompts = rng.integers(0, V, (512 + args.probe_n, 8)).tolist()  # 512 to train on, then the probe
    return Task(cfg, jax.tree.map(jnp.asarray, w), (-1,), 0, [(p, None) for p in prompts[:512]], [],
                prompts[512:], lambda row, gold: float(np.mean(np.array(row) < V // 2)), None)

# ---------------------------------------------------------------------------------------------------------
# the sampler: a bf16 copy of the trainer's weights with its own numerics (W8A8, noise, a quantised KV cache),
# and jitted KV-cache decoding that records what score_centering.loss needs

INPUT_AXES = dict(q=(1,), k=(1,), v=(1,), o=(1, 2), gate=(1,), up=(1,), down=(1,), embed=(1,), lm_head=(1,))

def fake_quant(x, axes, kind):  # symmetric, one scale per slice reduced over `axes`: int8 or fp8 (e4m3)
    x32, qmax = x.astype(jnp.float32), 127.0 if kind == "int8" else 448.0
    scale = jnp.maximum(jnp.abs(x32).max(axes, keepdims=True), 1e-12) / qmax
    y = x32 / scale
    y = y.astype(jnp.float8_e4m3fn) if kind == "fp8" else jnp.clip(jnp.round(y), -qmax, qmax)
    return (y.astype(jnp.float32) * scale).astype(x.dtype)

def kv_quant(kind):  # K, V [B, T, K, H] as a quantised cache keeps them: int8 per token and head; fp8 e4m3
    if kind == "int8":
        return lambda a: fake_quant(a, (3,), "int8")
    if kind == "fp8":  # unit scale, saturating at e4m3's largest value
        return lambda a: jnp.clip(a.astype(jnp.float32), -448, 448).astype(jnp.float8_e4m3fn).astype(a.dtype)
    return None

@partial(jax.jit, static_argnums=(1, 2))
def sampler_weights(w, kind, sigma=0.0, key=None):
    """bf16 copy of w ⊙ (1 + σε), ε ~ N(0, 1) from `key`: the same at each refresh, a persistent bias."""
    if sigma:
        leaves, tree = jax.tree.flatten(w)
        keys = jax.random.split(key, len(leaves))
        w = tree.unflatten([x * (1 + sigma * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)])
    if kind != "bf16":  # per output channel, every matmul weight (embeddings too)
        quant = lambda d: {k: fake_quant(x, INPUT_AXES[k], kind) if k in INPUT_AXES else x  # noqa: E731
                           for k, x in d.items()}
        w = dict(quant(w), layers=quant(w["layers"]))
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), w)

def quant_mm(kind):  # W8A8: the activation is fake-quantised per token (over the contracted axes) as well
    def mm(spec, x, w):
        x_axes, out = spec.split(",")[0], spec.split("->")[1]
        per_token = tuple(i for i, c in enumerate(x_axes) if c not in out)
        return jnp.einsum(spec, fake_quant(x, per_token, kind), w)
    return jnp.einsum if kind == "bf16" else mm

def categorical(key, logq, block=128):
    """y ~ q [B, V] by inverse CDF, a block of ids then an id in it: two uniforms a row, not V Gumbels."""
    B, V = logq.shape
    p = jnp.pad(jnp.exp(logq), ((0, 0), (0, -V % block))).reshape(B, -1, block)   # [B, V / block, block]
    def pick(key, w):  # i with probability w_i / Σ w; rounding never reaches past the last w_i > 0
        c = jnp.cumsum(w, -1)
        i = (c <= jax.random.uniform(key, (B, 1)) * c[:, -1:]).sum(-1)
        return jnp.minimum(i, w.shape[-1] - 1 - jnp.argmax(w[:, ::-1] > 0, -1))
    k_block, k_id = jax.random.split(key)
    i = pick(k_block, p.sum(-1))
    return i * block + pick(k_id, jnp.take_along_axis(p, i[:, None, None], 1)[:, 0])

def make_sampler(cfg, max_tokens, topk, eos_ids, mm=jnp.einsum, dtype=jnp.bfloat16, greedy=False, kv=None):
    """fn(weights, prompt [B, T0], pos [B, T0], key) -> dict of tokens, logq, mask [B, M] and the head
    head_ids, head_logq [B, M, K]: log q after temperature, normalised over the full vocabulary (topk = 0:
    the full [B, M, V] log q, no ids). Prefills once, then one token a step until every row ended its turn."""
    fwd, eos = partial(qwen3.forward, cfg, mm=mm, dtype=dtype, kv_quant=kv), jnp.array(eos_ids)

    def sample(w, prompt, pos, key):
        B, T0 = prompt.shape
        logits, kv = fwd(w, prompt, pos, qwen3.init_kv(cfg, B, T0 + max_tokens, dtype), 0, last=1)
        M, K = max_tokens, topk or cfg["vocab_size"]
        out = dict(tokens=jnp.zeros((B, M), jnp.int32), logq=jnp.zeros((B, M)), mask=jnp.zeros((B, M), bool),
                   head_logq=jnp.zeros((B, M, K)))
        out |= dict(head_ids=jnp.zeros((B, M, K), jnp.int32)) if topk else {}

        def body(carry):
            i, logits, kv, done, out, key = carry
            key, k_sample = jax.random.split(key)
            logq = jax.nn.log_softmax(logits[:, -1] / TEMPERATURE)                          # [B, V]
            y = jnp.argmax(logq, -1) if greedy else categorical(k_sample, logq)            # [B]
            rec = dict(tokens=y, logq=jnp.take_along_axis(logq, y[:, None], -1)[:, 0], mask=~done,
                       head_logq=logq)
            rec |= dict(zip(("head_logq", "head_ids"), jax.lax.top_k(logq, topk))) if topk else {}
            out = {name: x.at[:, i].set(rec[name]) for name, x in out.items()}
            logits, kv = fwd(w, y[:, None].astype(jnp.int32), pos[:, -1:] + 1 + i, kv, T0 + i)
            return i + 1, logits, kv, done | jnp.isin(y, eos), out, key

        running = lambda c: (c[0] < max_tokens) & ~c[3].all()  # noqa: E731
        return jax.lax.while_loop(running, body, (0, logits, kv, jnp.zeros(B, bool), out, key))[4]
    return jax.jit(sample)

def left_pad(prompts, pad_id, multiple=32):
    """Token lists -> tokens, positions [B, T0] left-padded (position -1); T0 rounded up: fewer compiles."""
    T0 = -(-max(map(len, prompts)) // multiple) * multiple
    tokens, pos = np.full((len(prompts), T0), pad_id, np.int32), np.full((len(prompts), T0), -1, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, T0 - len(p):], pos[b, T0 - len(p):] = p, np.arange(len(p))
    return tokens, pos

def generate(sampler, w, prompts, pad_id, key, data, n):  # every prompt, n rows (one program) a call
    prompt, pos = left_pad(prompts, pad_id)
    extra = -len(prompts) % n  # the last call is padded with copies of the first prompt
    prompt, pos = (np.concatenate([x, np.repeat(x[:1], extra, 0)]) for x in (prompt, pos))
    outs = [jax.device_get(sampler(w, *jax.device_put((prompt[i:i + n], pos[i:i + n]), data),
                                   jax.random.fold_in(key, i))) for i in range(0, len(prompt), n)]
    return {k: np.concatenate([o[k] for o in outs])[:len(prompts)] for k in outs[0]} | dict(
        prompt=prompt[:len(prompts)], pos=pos[:len(prompts)])

# ---------------------------------------------------------------------------------------------------------
# the trainer: float32 logits on prompt + completion, score_centering.loss, optionally LoRA adapters

def completion_logits(cfg, w, prompt, pos, tokens):
    """The trainer's float32 logits [B, M, V] at the positions that predicted the completion tokens [B, M]."""
    M = tokens.shape[1]
    seq_pos = jnp.concatenate([pos, pos[:, -1:] + 1 + jnp.arange(M)[None, :]], 1)
    with jax.default_matmul_precision("highest"):  # a float32 trainer, not TF32 (GPU) or bf16 passes (TPU)
        logits = qwen3.forward(cfg, w, jnp.concatenate([prompt, tokens], 1), seq_pos, last=M + 1)[0]
    return logits[:, :-1] / TEMPERATURE  # the logits at position t predict token t + 1

def token_logp(cfg, w, b):  # the trainer's log p [B, M] of the completion tokens of b
    logp = jax.nn.log_softmax(completion_logits(cfg, w, b["prompt"], b["pos"], b["tokens"]))
    return jnp.take_along_axis(logp, b["tokens"][..., None], -1)[..., 0]

def lora_init(w, rank, key):  # A ~ N(0, 1/fan-in), B = 0: the merged model starts exactly at the base
    def init(key, x, n_in):  # x [L, in..., out...]
        fan_in = math.prod(x.shape[1:1 + n_in])
        return dict(a=jax.random.normal(key, (x.shape[0], fan_in, rank)) * fan_in ** -0.5,
                    b=jnp.zeros((x.shape[0], rank, x[0].size // fan_in)))
    names = ("q", "k", "v", "o", "gate", "up", "down")  # every attention and MLP projection
    return {n: init(k, w["layers"][n], len(INPUT_AXES[n])) for n, k in zip(names, jax.random.split(key, 7))}

def merge(params, base, scale):  # the policy's weights: base + scale · A B per projection (no base: params)
    if base is None:
        return params
    delta = lambda x, ab: scale * jnp.einsum("lir,lro->lio", ab["a"], ab["b"]).reshape(x.shape)  # noqa: E731
    return dict(base, layers={k: x + delta(x, params[k]) if k in params else x
                              for k, x in base["layers"].items()})

def make_train_step(cfg, opt, loss_kw, micro_batch, mesh, lora_scale=None):
    """fn(params, opt_state, batch, base=None) -> (params, opt_state, metrics); params are the weights, or
    LoRA adapters on the frozen `base`; batch: the sampler's record plus prompt, pos [B, T0] and adv [B].
    Gradients accumulate over micro-batches, each spread over the mesh's data axis, and the loss is the token
    mean over the whole batch: the same numbers as one large batch."""
    def token_sum_loss(params, base, b):
        logits = completion_logits(cfg, merge(params, base, lora_scale), b["prompt"], b["pos"], b["tokens"])
        loss, metrics = sc.loss(logits, b["tokens"], b["mask"], b["adv"], b["logq"], b.get("head_ids"),
                                b["head_logq"], **loss_kw)
        return loss * b["mask"].sum(), (metrics, b["mask"].sum())  # token sums, divided by N below

    def step(params, opt_state, batch, base=None):
        def accumulate(grads, b):
            (loss, (metrics, n)), g = jax.value_and_grad(token_sum_loss, has_aux=True)(params, base, b)
            return jax.tree.map(jnp.add, grads, g), (loss, metrics, n)
        split = lambda x: jax.lax.with_sharding_constraint(  # noqa: E731  [B, ...] -> [B / mb, mb, ...]
            x.reshape(micro_batch, -1, *x.shape[1:]).swapaxes(0, 1), NamedSharding(mesh, P(None, "data")))
        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, (loss, metrics, n) = jax.lax.scan(accumulate, zeros, jax.tree.map(split, batch))
        N = jnp.maximum(n.sum(), 1)
        grads = jax.tree.map(lambda g: g / N, grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        metrics = dict({k: (v * n).sum() / N for k, v in metrics.items()}, loss=loss.sum() / N,
                       grad_norm=optax.tree.norm(grads))
        return optax.apply_updates(params, updates), opt_state, metrics
    # outputs replicated, as the inputs came: the second step does not compile again
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=NamedSharding(mesh, P()))

# ---------------------------------------------------------------------------------------------------------
# one GRPO run: evaluation and the drift meter, rollouts, the train step, a resumable state

def save_state(file, hist, *trees):  # float32 leaves (bf16 ones widened exactly), then an atomic rename
    leaves = [np.asarray(x, np.float32 if x.dtype == jnp.bfloat16 else x.dtype)
              for x in jax.tree.leaves(trees)]
    with LOCK:
        with open(file + ".tmp", "wb") as f:
            np.savez(f, hist=np.array(json.dumps(hist)), **{f"a{i}": x for i, x in enumerate(leaves)})
        os.replace(file + ".tmp", file)

def load_state(file, sharding, *trees):  # the trees as saved, shaped and typed like these templates
    with np.load(file) as z:
        leaves, tree = jax.tree.flatten(trees)
        if len(z.files) != len(leaves) + 1 or any(z[f"a{i}"].shape != x.shape for i, x in enumerate(leaves)):
            raise ValueError(f"{file} does not match this run (model, --lora, --optimizer, --staleness)")
        arrays = [jax.device_put(z[f"a{i}"].astype(x.dtype), sharding) for i, x in enumerate(leaves)]
        return json.loads(str(z["hist"])), tree.unflatten(arrays)

def drift_meter(logp, probe, w0, micro_batch):
    """fn(w) -> token mean of log p_0(y) - log p_w(y) over the probe completions: KL(p_0 || p_w) estimated."""
    def probe_logp(w):  # [B, M], micro_batch rows a call
        rows = range(0, len(probe["tokens"]), micro_batch)
        return np.concatenate([logp(w, {k: x[i:i + micro_batch] for k, x in probe.items()}) for i in rows])
    logp0, mask = probe_logp(w0), probe["mask"]
    return lambda w: float(((logp0 - probe_logp(w)) * mask).sum() / max(mask.sum(), 1))

def build(args, task):  # the jitted functions, compiled once and shared by every run of a --compare
    cfg, mesh = task.cfg, Mesh(np.array(jax.devices()), ("data",))
    opt, scale = OPTIMIZERS[args.optimizer](args.lr), args.lora and args.lora_alpha / args.lora
    return dict(mesh=mesh, opt=opt, scale=scale, logp=jax.jit(partial(token_logp, cfg)),
                steps={c: make_train_step(cfg, opt, loss_kw(args, c), args.micro_batch, mesh, scale)
                       for c in (False, True)},
                sampler=make_sampler(cfg, args.max_tokens, args.topk, task.eos, quant_mm(args.sampler),
                                     kv=kv_quant(args.kv_quant)),
                evaluator=make_sampler(cfg, args.max_tokens, 1, task.eos, greedy=True),
                prober=make_sampler(cfg, args.max_tokens, 1, task.eos))

def run(args, task, fn, center, seed, out):
    """One GRPO run into `out` (resumed from its state when there is one); returns its summary."""
    if out and os.path.exists(os.path.join(out, "summary.json")):  # a --resume of a finished run
        return json.load(open(os.path.join(out, "summary.json")))
    cfg, n, opt, scale = task.cfg, args.prompts * args.group, fn["opt"], fn["scale"]
    data, replicated = NamedSharding(fn["mesh"], P("data")), NamedSharding(fn["mesh"], P())  # rows split
    key, noise_key, probe_key, lora_key = jax.random.split(jax.random.PRNGKey(seed), 4)
    base = jax.device_put(jax.tree.map(jnp.copy, task.weights), replicated)  # a copy: the step donates it
    params = jax.device_put(lora_init(base, args.lora, lora_key), replicated) if args.lora else base
    base = base if args.lora else None
    # the drift meter: probe completions drawn once from the initial policy, clean bf16, temperature 1
    w0 = merge(params, base, scale)
    probe = generate(fn["prober"], sampler_weights(w0, "bf16"), task.probe, task.pad, probe_key, data, n)
    drift = drift_meter(fn["logp"], {k: probe[k] for k in ("prompt", "pos", "tokens", "mask")}, w0,
                        args.micro_batch)
    opt_state, w_sampler = jax.device_put(opt.init(params), replicated), None
    hist = dict(step=0, acc={}, drift={}, kl_q_p=[], reward=[])
    state_file = out and os.path.join(out, "state.npz")
    if out and os.path.exists(state_file):
        stale = sampler_weights(w0, "bf16") if args.staleness else None  # the sampler's copy, as it was
        hist, (params, opt_state, w_sampler) = load_state(state_file, replicated, params, opt_state, stale)
        print(f"resumed {out} at step {hist['step']}", flush=True)
    if out:  # rows past the saved state belong to the interrupted run: they are logged again below
        rows = open(os.path.join(out, "metrics.jsonl")).readlines() if hist["step"] else []
        rows = [r for r in rows if r.endswith("\n")]  # a row cut by a kill mid-write is dropped
        with LOCK, open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.writelines(r for r in rows if json.loads(r)["step"] < hist["step"])
    order = np.random.default_rng(seed).permutation(len(task.train))
    columns = [c for c in COLUMNS if c != "acc" or task.test]
    for step in range(hist["step"], args.steps + 1):
        saved = f"; python train.py --resume {args.out} continues from its state at step {hist['step']}"
        PROGRESS["where"] = f"at step {step} of {out or 'a run without --out'}{saved if hist['step'] else ''}"
        row, w = {"step": step}, merge(params, base, scale)
        if step % args.eval_every == 0 or step == args.steps:
            hist["drift"][str(step)] = row["drift"] = drift(w)
            if task.test:
                res = generate(fn["evaluator"], sampler_weights(w, "bf16"), [p for p, _ in task.test],
                               task.pad, key, data, n)
                hist["acc"][str(step)] = row["acc"] = float(np.mean(
                    [task.reward(t[m], g) for t, m, (_, g) in zip(res["tokens"], res["mask"], task.test)]))
        if step < args.steps:
            t0 = time.perf_counter()
            if step % (args.staleness + 1) == 0:
                w_sampler = sampler_weights(w, args.sampler, args.weight_noise, noise_key)
            problems = [task.train[order[(step * args.prompts + i // args.group) % len(order)]]
                        for i in range(n)]  # each prompt --group times
            batch = generate(fn["sampler"], w_sampler, [p for p, _ in problems], task.pad,
                             jax.random.fold_in(key, step), data, n)
            r = np.array([task.reward(t[m], g)
                          for t, m, (_, g) in zip(batch["tokens"], batch["mask"], problems)])
            t1 = time.perf_counter()
            batch["adv"] = advantage(r.astype(np.float32), args)
            params, opt_state, m = fn["steps"][center](params, opt_state, jax.device_put(batch, data), base)
            row |= {k: float(v) for k, v in m.items()} | dict(
                reward=float(r.mean()), length=float(batch["mask"].sum(1).mean()), sample_seconds=t1 - t0,
                train_seconds=time.perf_counter() - t1, seconds=time.perf_counter() - t0)
            hist["kl_q_p"].append(row["kl_q_p"])
            hist["reward"].append(row["reward"])
        log_step(row, args.steps, columns, out)
        if out and args.save_every and step < args.steps and (step + 1) % args.save_every == 0:
            hist["step"] = step + 1
            save_state(state_file, hist, params, opt_state, w_sampler if args.staleness else None)
    final = str(args.steps)
    summary = dict(drift=hist["drift"], final_drift=hist["drift"][final],
                   mean_kl_q_p=float(np.mean(hist["kl_q_p"])),
                   reward=float(np.mean(hist["reward"][-5:])))  # the last 5 steps' mean training reward
    if task.test:
        peak = max(hist["acc"].values())
        summary |= dict(eval_acc=hist["acc"], peak_acc=peak, final_acc=hist["acc"][final],
                        drop=peak - hist["acc"][final])
    if args.save:
        qwen3.save(args.save, cfg, jax.device_get(merge(params, base, scale)))
        for f in os.listdir(task.path) if task.path else []:  # the tokenizer files travel with the weights
            if f.endswith((".json", ".txt")) and f not in ("config.json", "model.safetensors.index.json"):
                shutil.copy(os.path.join(task.path, f), args.save)
    write_summary(out, summary)
    if out and os.path.exists(state_file):  # the run is complete: its state (weights, Adam) frees the disk
        os.remove(state_file)
    return summary

# ---------------------------------------------------------------------------------------------------------
# GSM8K side by side over seeds, with the verdict; the sequence task's 2 x 2

def verdict(runs):  # runs [{"uncentered": summary, "centered": summary}] over seeds -> one line
    mean = lambda arm, k: 100 * float(np.mean([r[arm][k] for r in runs]))  # noqa: E731  (in points)
    du, dc, fu, fc = mean("uncentered", "drop"), mean("centered", "drop"), mean("uncentered", "final_acc"), \
        mean("centered", "final_acc")
    facts = (f"drop {dc:.1f} points centred vs {du:.1f} uncentred, final accuracy {fc:.1f} vs {fu:.1f} "
             f"(means over {len(runs)} seed{'s' * (len(runs) > 1)})")
    if dc <= 2 and du - dc >= 3 and fc >= fu - 1.5:
        return "verdict: centring VALIDATED: " + facts
    if abs(du - dc) < 3:
        return "verdict: WITHIN SEED NOISE (drops differ by < 3 points): " + facts
    return ("verdict: centring NOT validated (needs a drop <= 2 points, >= 3 smaller than uncentred, and a "
            "final accuracy at most 1.5 below): " + facts)

def compare(args, task):
    if args.task == "sequence":
        arms = {f"{b}_{c}entered": (argparse.Namespace(**vars(args) | dict(baseline=b)), c == "c", args.seed)
                for b in ("group", "none") for c in ("unc", "c")}
    else:
        arms = {f"{c}entered" + (f"_seed{s}" if len(args.seeds or [0]) > 1 else ""): (args, c == "c", s)
                for s in args.seeds or [args.seed] for c in ("unc", "c")}
    res, fn = {}, build(args, task)
    for name, (a, center, seed) in arms.items():
        print(f"\n---- {name}", flush=True)
        out = args.out and os.path.join(args.out, name)
        if out:
            os.makedirs(out, exist_ok=True)
        res[name] = run(a, task, fn, center, seed, out)
    print(f"\n{task.cfg['num_hidden_layers']}-layer Qwen3, --sampler {args.sampler}, --kv-quant "
          f"{args.kv_quant}, --weight-noise {args.weight_noise}, --staleness {args.staleness}, {args.steps} "
          f"steps, lr {args.lr}")
    if args.task == "sequence":  # rows: baseline, centring
        table("baseline centring", {f"{k.split('_')[0]} {'on' if k.endswith('_centered') else 'off'}": r
                                    for k, r in res.items()}, dict(final_drift="{:.2e}", reward="{:.3f}"))
        summary = {k: dict(drift=r["final_drift"], drift_curve=list(r["drift"].values()), reward=r["reward"])
                   for k, r in res.items()}
    else:
        runs = list(res.values())  # uncentred, centred, seed by seed
        by_seed = [dict(uncentered=u, centered=c) for u, c in zip(runs[::2], runs[1::2])]
        columns = dict(peak_acc="{:.3f}", final_acc="{:.3f}", drop="{:.3f}", final_drift="{:.2e}",
                       mean_kl_q_p="{:+.2e}")
        table("run", res | {f"mean {arm}": {k: np.mean([r[arm][k] for r in by_seed]) for k in columns}
                            for arm in ("uncentered", "centered")}, columns)
        summary = dict(res, verdict=verdict(by_seed))
        print(summary["verdict"])
    if args.plot:
        style = {k: "rb"[i % 2] + ("-", "--", "-.", ":")[i // 2 % 4] for i, k in enumerate(res)}  # off, on
        curves = lambda key, arms: {k: (list(map(int, res[k][key])), list(res[k][key].values()), style[k])
                                    for k in arms}  # noqa: E731
        drift = "drift  KL(p_0 || p_t) on the probe"
        plot(args.plot, [(f"GRPO, {title}", drift, curves("drift", [k for k in res if k.startswith(prefix)]))
                         for prefix, title in (("group", "group baseline"), ("none", "raw rewards"))]
             if args.task == "sequence" else
             [("GSM8K", "greedy accuracy", curves("eval_acc", res)), ("GSM8K", drift, curves("drift", res))])
    return write_summary(args.out, summary)

def main(argv=None):
    args = parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        if not args.resume:
            write_json(os.path.join(args.out, "run.json"), run_config(args))
    print("config " + json.dumps(vars(args)), flush=True)

    def work():
        if args.task == "bandit":
            return run_bandit(args)
        try:
            task = gsm8k_task(args) if args.task == "gsm8k" else sequence_task(args)
        except (ValueError, OSError) as e:  # bad data or checkpoint: one line, no traceback
            raise SystemExit(f"error: {e}") from None
        if args.compare:
            return compare(args, task)
        return run(args, task, build(args, task), args.center, args.seed, args.out)
    return interruptible(work)

if __name__ == "__main__":
    main()
