"""'GRPO' on GSM8K, or a toy bandit, with a sampler whose numerics differ from the trainer's.

    python train.py --center                                  # Qwen3-0.6B on GSM8K, score-centred
    python train.py                                           # the same run uncentred: watch the drift
    python train.py --task bandit --baseline none --compare   # the mechanism in seconds, on a CPU

What it is: REINFORCE with a group-mean baseline, whose rollouts come from a copy of the policy that runs with
other numerics (bf16 / int8 / fp8, fixed weight noise, staleness), trained with `score_centering.loss`.
How it differs from textbook GRPO, and why:
- no KL penalty to a reference model: it would pull toward the start and hide the drift under study;
- no PPO ratio clipping: one optimizer step per batch, so the only off-policyness is the sampler mismatch;
- a token-mean loss over the whole batch, not a mean of per-sequence means (score_centering.py, step 8);
- advantages are rewards minus the group mean, not divided by the group's std (the paper's recipe);
- plain SGD at a constant learning rate on float32 master weights (the paper's recipe; --optimizer adam).
"""
import argparse, json, os, re, shutil, time, urllib.request
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

# ---------------------------------------------------------------------------------------------------------
# flags: defaults that depend on the task are None here and resolved below

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument_group("run").add_argument
    a("--task", choices=["gsm8k", "bandit"], default="gsm8k")
    a("--center", action="store_true", help="score centering: subtract the sampler-expected score")
    a("--model", default="Qwen/Qwen3-0.6B", help="Hugging Face repo id or local checkpoint directory")
    a("--data-dir", help="folder with GSM8K train.jsonl and test.jsonl (default: download once, cached)")
    a("--seed", type=int, default=0)
    a("--out", help="folder for metrics.jsonl (flushed every step) and summary.json")
    a("--save", help="write the trained policy here as a Hugging Face checkpoint")
    a = p.add_argument_group("RL").add_argument
    a("--steps", type=int, help="optimizer steps (default: gsm8k 100, bandit 200)")
    a("--prompts", type=int, default=32, help="prompts per step")
    a("--group", type=int, default=8, help="rollouts per prompt")
    a("--max-tokens", type=int, default=512, help="completion length cap")
    a("--lr", type=float, help="constant learning rate (default: gsm8k 0.01, bandit 0.5)")
    a("--optimizer", choices=["sgd", "adam"], default="sgd", help="no schedule: nothing to confound drift")
    a("--baseline", choices=["group", "none"], default="group", help="advantage r - group mean, or raw r")
    a("--micro-batch", type=int, default=16, help="sequences per forward/backward pass (memory)")
    a("--topk", type=int, default=128, help="sampler head recorded per token; 0 = full distribution (exact)")
    a("--tis-cap", type=float, help="truncated importance sampling, w = min(p/q, C) (default: off)")
    a = p.add_argument_group("mismatch: how the sampler differs from the float32 trainer").add_argument
    a("--sampler", choices=["bf16", "int8", "fp8"], default="bf16", help="bf16, or W8A8 fake quantisation")
    a("--weight-noise", type=float, help="fixed relative weight noise σ (default 0); bandit: the std of a "
                                         "fixed sampler logit offset (default 0.5)")
    a("--staleness", type=int, default=0, help="refresh the sampler every S+1 steps; S >= steps: frozen")
    a = p.add_argument_group("evaluation: greedy, clean bf16 sampler; bandit: log cadence").add_argument
    a("--eval-every", type=int, default=10)
    a("--eval-n", type=int, default=500, help="the first N GSM8K test problems")
    a = p.add_argument_group("bandit").add_argument
    a("--arms", type=int, default=16)
    a("--compare", action="store_true", help="run centring off/on x online/frozen sampler; print one table")
    a("--plot", help="with --compare: draw the drift curves into this PNG")
    args = p.parse_args(argv)
    bandit = args.task == "bandit"
    for name, for_gsm8k, for_bandit in (("steps", 100, 200), ("lr", 0.01, 0.5), ("weight_noise", 0.0, 0.5)):
        if getattr(args, name) is None:
            setattr(args, name, for_bandit if bandit else for_gsm8k)
    B, devices = args.prompts * args.group, jax.local_device_count()
    errors = [msg for bad, msg in [
        (min(args.steps, args.prompts, args.group, args.max_tokens, args.eval_every, args.eval_n, args.arms,
             args.micro_batch) < 1, "--steps, --prompts, --group, --max-tokens, --eval-every, --eval-n, "
                                    "--arms and --micro-batch must be >= 1"),
        (min(args.topk, args.staleness, args.weight_noise) < 0, "--topk, --staleness, --weight-noise: >= 0"),
        (args.lr <= 0 or (args.tis_cap is not None and args.tis_cap <= 0), "--lr and --tis-cap must be > 0"),
        (args.baseline == "group" and args.group < 2, "--baseline group needs --group >= 2"),
        (bandit and (args.save or args.data_dir or args.sampler != "bf16"),
         "--save, --data-dir and --sampler are for --task gsm8k (the bandit's mismatch is --weight-noise)"),
        (not bandit and (args.compare or args.plot), "--compare and --plot are for --task bandit"),
        (args.plot and not args.compare, "--plot draws the --compare runs: add --compare"),
        (not bandit and (B % args.micro_batch or args.micro_batch % devices),
         f"--micro-batch {args.micro_batch} must divide --prompts x --group = {B} and be a multiple of the "
         f"{devices} local devices"),
        (args.data_dir and not all(os.path.isfile(f"{args.data_dir}/{s}.jsonl") for s in ("train", "test")),
         f"--data-dir {args.data_dir} must contain train.jsonl and test.jsonl"),
    ] if bad]
    if errors:
        p.error("; ".join(errors))
    return args

# ---------------------------------------------------------------------------------------------------------
# logs: one fixed-width line per step; the same numbers in metrics.jsonl, flushed as they are made

COLUMNS = dict(reward="{:6.3f}", acc="{:6.3f}", drift="{:6.3f}", grad_norm="{:8.2e}", kl_q_p="{:+9.2e}",
               logprob_gap="{:8.2e}", entropy="{:6.3f}", length="{:6.1f}", seconds="{:6.1f}")

def log_step(row, steps, columns, out=None):
    cells = [f"{k} " + (COLUMNS[k].format(row[k]) if k in row else "-" * len(COLUMNS[k].format(0)))
             for k in columns]
    print(" | ".join([f"step {row['step']:>{len(str(steps))}}/{steps}", *cells]), flush=True)
    if out:
        with open(os.path.join(out, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")

def write_summary(out, summary):
    print("summary " + json.dumps(summary))
    if out:
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return summary

# ---------------------------------------------------------------------------------------------------------
# the toy bandit: the policy is a vector of K logits, the sampler's are the trainer's plus a fixed offset

def tv(logits_a, logits_b):  # total-variation distance between two softmax distributions
    return float(0.5 * jnp.abs(jax.nn.softmax(logits_a) - jax.nn.softmax(logits_b)).sum())

def bandit(args, center, staleness, out=None):
    """One run through the very same loss (T = 1). Returns the drift TV(p_t, p_0) after every step."""
    k_success, k_bias, key = jax.random.split(jax.random.PRNGKey(args.seed), 3)
    success = jax.random.uniform(k_success, (args.arms,), minval=0.45, maxval=0.55)  # a small signal
    bias = args.weight_noise * jax.random.normal(k_bias, (args.arms,))  # drawn once: a persistent bias
    B, K = args.prompts * args.group, min(args.topk or args.arms, args.arms)
    opt = getattr(optax, args.optimizer)(args.lr)

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
                           head_logq, center=center, tis_cap=args.tis_cap)
        (_, m), g = jax.value_and_grad(loss, has_aux=True)(theta)
        updates, opt_state = opt.update(g, opt_state)
        m = dict(m, reward=r.mean(), grad_norm=optax.tree.norm(g))
        return optax.apply_updates(theta, updates), opt_state, m

    theta0 = jnp.zeros(args.arms)
    theta, opt_state, curve = theta0, opt.init(theta0), []
    for i in range(args.steps):
        if i % (staleness + 1) == 0:
            sampler_logits = theta + bias                                           # refresh from the trainer
        theta, opt_state, m = step(theta, opt_state, sampler_logits, jax.random.fold_in(key, i))
        curve.append(tv(theta, theta0))
        if out is not None and ((i + 1) % args.eval_every == 0 or i == 0):
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
    print(f"{'sampler':8s} {'centring':8s} {'drift TV(p_T, p_0)':>18s} {'policy reward':>14s}")
    for (s, c), r in runs.items():
        print(f"{s:8s} {'on' if c else 'off':8s} {r['drift']:18.3f} {r['reward']:14.3f}")
    if args.out:
        with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
            f.writelines(json.dumps(dict(sampler=s, center=bool(c), step=i + 1, drift=d)) + "\n"
                         for (s, c), r in runs.items() for i, d in enumerate(r["curve"]))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5.5, 3.3), dpi=100)
        for (s, c), r in runs.items():
            ax.plot(np.arange(1, args.steps + 1), r["curve"], "-" if s == "online" else "--",
                    color="br"[1 - c], label=f"{s} sampler, centring {'on' if c else 'off'}")
        ax.axhline(runs["online", 0]["gap"], color="gray", lw=0.8, ls=":", label="sampler gap at start")
        ax.set(xlabel="step", ylabel="drift  TV(p_t, p_0)", title="Toy bandit, raw rewards")
        ax.legend(fontsize=7, frameon=False)
        fig.tight_layout()
        fig.savefig(args.plot)
    return write_summary(args.out, {f"{s}_{'centered' if c else 'uncentered'}": {k: v for k, v in r.items()
                                    if k != "curve"} for (s, c), r in runs.items()})

def advantage(r, args):  # r [P * G] -> [P * G]: minus the mean of its group of G, or raw
    return (r - r.reshape(-1, args.group).mean(1).repeat(args.group)) if args.baseline == "group" else r

# ---------------------------------------------------------------------------------------------------------
# GSM8K: data and reward

def gsm8k(data_dir, split):
    """[(question, gold answer)] of one split, downloaded once (with progress) when there is no data_dir."""
    path = os.path.join(data_dir or os.path.expanduser("~/.cache/score-centering/gsm8k"), f"{split}.jsonl")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        progress = lambda n, size, total: print(  # noqa: E731
            f"\rdownloading GSM8K {split}: {min(n * size, total) / 1e6:.1f} / {total / 1e6:.1f} MB", end="")
        urllib.request.urlretrieve(GSM8K_URL % f"{split}.jsonl", path + ".part", progress)
        os.replace(path + ".part", path)
        print()
    problems = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                problems.append((row["question"], normalise(row["answer"].split("####")[1])))
            except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}:{n}: not a GSM8K line with a 'question' and an 'answer' ending in "
                                 f"'#### <number>' ({type(e).__name__}: {e})") from None
    return problems

def normalise(number):  # "$1,234.50" -> "1234.5", "18.0" -> "18"
    s = number.strip().replace(",", "").replace("$", "")
    return s.rstrip("0").rstrip(".") if "." in s else s

def reward(completion, gold):  # 1 when the completion's last number is the gold answer
    numbers = re.findall(r"-?\$?\d[\d,]*(?:\.\d+)?", completion)
    return float(bool(numbers) and normalise(numbers[-1]) == gold)

def left_pad(prompts, pad_id, multiple=32):
    """Token lists -> tokens, positions [B, T0] left-padded (position -1); T0 rounded up: fewer compiles."""
    T0 = -(-max(map(len, prompts)) // multiple) * multiple
    tokens, pos = np.full((len(prompts), T0), pad_id, np.int32), np.full((len(prompts), T0), -1, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, T0 - len(p):], pos[b, T0 - len(p):] = p, np.arange(len(p))
    return tokens, pos

# ---------------------------------------------------------------------------------------------------------
# the sampler: a bf16 copy of the trainer's weights with its own numerics (W8A8, noise), and jitted
# KV-cache decoding that records what score_centering.loss needs

INPUT_AXES = dict(q=(1,), k=(1,), v=(1,), o=(1, 2), gate=(1,), up=(1,), down=(1,), embed=(1,), lm_head=(1,))

def fake_quant(x, axes, kind):  # symmetric, one scale per slice reduced over `axes`: int8 or fp8 (e4m3)
    x32, qmax = x.astype(jnp.float32), 127.0 if kind == "int8" else 448.0
    scale = jnp.maximum(jnp.abs(x32).max(axes, keepdims=True), 1e-12) / qmax
    y = x32 / scale
    y = y.astype(jnp.float8_e4m3fn) if kind == "fp8" else jnp.clip(jnp.round(y), -qmax, qmax)
    return (y.astype(jnp.float32) * scale).astype(x.dtype)

def sampler_weights(w, kind, sigma=0.0, key=None):
    """bf16 copy of w ⊙ (1 + σε), ε ~ N(0, 1) from `key`: the same at every refresh, a persistent bias."""
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

def make_sampler(cfg, max_tokens, topk, eos_ids, mm=jnp.einsum, dtype=jnp.bfloat16, greedy=False):
    """fn(weights, prompt [B, T0], pos [B, T0], key) -> dict of tokens, logq, mask [B, M] and the head
    head_ids, head_logq [B, M, K]: log q after temperature, normalised over the full vocabulary (topk = 0:
    the full [B, M, V] log q, no ids). Prefills once, then one token a step until every row ended its turn."""
    fwd, eos = partial(qwen3.forward, cfg, mm=mm, dtype=dtype), jnp.array(eos_ids)

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
            y = jnp.argmax(logq, -1) if greedy else jax.random.categorical(k_sample, logq)  # [B]
            rec = dict(tokens=y, logq=jnp.take_along_axis(logq, y[:, None], -1)[:, 0], mask=~done,
                       head_logq=logq)
            rec |= dict(zip(("head_logq", "head_ids"), jax.lax.top_k(logq, topk))) if topk else {}
            out = {name: x.at[:, i].set(rec[name]) for name, x in out.items()}
            logits, kv = fwd(w, y[:, None].astype(jnp.int32), pos[:, -1:] + 1 + i, kv, T0 + i)
            return i + 1, logits, kv, done | jnp.isin(y, eos), out, key

        running = lambda c: (c[0] < max_tokens) & ~c[3].all()  # noqa: E731
        return jax.lax.while_loop(running, body, (0, logits, kv, jnp.zeros(B, bool), out, key))[4]
    return jax.jit(sample)

# ---------------------------------------------------------------------------------------------------------
# the train step: the trainer's logits on prompt + completion, then score_centering.loss

def completion_logits(cfg, w, prompt, pos, tokens):
    """The trainer's float32 logits [B, M, V] at the positions that predicted the completion tokens [B, M]."""
    M = tokens.shape[1]
    seq_pos = jnp.concatenate([pos, pos[:, -1:] + 1 + jnp.arange(M)[None, :]], 1)
    with jax.default_matmul_precision("highest"):  # a float32 trainer, not TF32 (GPU) or bf16 passes (TPU)
        logits = qwen3.forward(cfg, w, jnp.concatenate([prompt, tokens], 1), seq_pos, last=M + 1)[0]
    return logits[:, :-1] / TEMPERATURE  # the logits at position t predict token t + 1

def make_train_step(cfg, opt, center, tis_cap, micro_batch, mesh):
    """fn(weights, opt_state, batch) -> (weights, opt_state, metrics); batch: the sampler's record plus
    prompt, pos [B, T0] and adv [B]. Gradients accumulate over micro-batches, each spread over the mesh's data
    axis, and the loss is the token mean over the whole batch: the same numbers as one large batch."""
    def token_sum_loss(w, b):
        logits = completion_logits(cfg, w, b["prompt"], b["pos"], b["tokens"])
        loss, metrics = sc.loss(logits, b["tokens"], b["mask"], b["adv"], b["logq"], b.get("head_ids"),
                                b["head_logq"], center=center, tis_cap=tis_cap)
        return loss * b["mask"].sum(), (metrics, b["mask"].sum())  # token sums, divided by N below

    def step(w, opt_state, batch):
        def accumulate(grads, b):
            (loss, (metrics, n)), g = jax.value_and_grad(token_sum_loss, has_aux=True)(w, b)
            return jax.tree.map(jnp.add, grads, g), (loss, metrics, n)
        split = lambda x: jax.lax.with_sharding_constraint(  # noqa: E731  [B, ...] -> [B / mb, mb, ...]
            x.reshape(micro_batch, -1, *x.shape[1:]).swapaxes(0, 1), NamedSharding(mesh, P(None, "data")))
        zeros = jax.tree.map(jnp.zeros_like, w)
        grads, (loss, metrics, n) = jax.lax.scan(accumulate, zeros, jax.tree.map(split, batch))
        N = jnp.maximum(n.sum(), 1)
        grads = jax.tree.map(lambda g: g / N, grads)
        updates, opt_state = opt.update(grads, opt_state, w)
        metrics = dict({k: (v * n).sum() / N for k, v in metrics.items()}, loss=loss.sum() / N,
                       grad_norm=optax.tree.norm(grads))
        return optax.apply_updates(w, updates), opt_state, metrics
    return jax.jit(step, donate_argnums=(0, 1))

# ---------------------------------------------------------------------------------------------------------
# GSM8K GRPO

def rollouts(sampler, w, tok, problems, key, data):  # sample (rows split over devices), decode, reward
    prompt, pos = jax.device_put(left_pad([tok.chat(q + INSTRUCTION) for q, _ in problems], tok.pad_id), data)
    out = jax.device_get(sampler(w, prompt, pos, key))
    texts = [tok.decode([t for t, m in zip(*row) if m and t not in tok.eos_ids])
             for row in zip(out["tokens"], out["mask"])]
    return dict(out, prompt=prompt, pos=pos), np.array([reward(t, g) for t, (_, g) in zip(texts, problems)])

def evaluate(args, evaluator, w, tok, problems, data):  # greedy accuracy, in batches of --prompts x --group
    n, w, key = args.prompts * args.group, sampler_weights(w, "bf16"), jax.random.PRNGKey(0)  # key: unused
    chunks = [problems[i:i + n] for i in range(0, len(problems), n)]  # each padded to n rows: one program
    scores = [rollouts(evaluator, w, tok, c + c[:1] * (n - len(c)), key, data)[1][:len(c)] for c in chunks]
    return float(np.concatenate(scores).mean())

def main(argv=None):
    args = parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        open(os.path.join(args.out, "metrics.jsonl"), "w").close()
    print("config " + json.dumps(vars(args)), flush=True)
    if args.task == "bandit":
        return run_bandit(args)
    train_set, test_set = gsm8k(args.data_dir, "train"), gsm8k(args.data_dir, "test")[:args.eval_n]
    model = qwen3.load(args.model)
    cfg, tok = model.cfg, model.tokenizer
    if tok is None or (args.topk == 0 and cfg["vocab_size"] > 4096):
        raise SystemExit(f"{args.model} has no tokenizer files" if tok is None else
                         f"--topk 0 records q over all {cfg['vocab_size']} tokens a step: use --topk 128")
    mesh = Mesh(np.array(jax.devices()), ("data",))
    data = NamedSharding(mesh, P("data"))  # rollouts and batches are split over all devices, row-wise
    w = jax.device_put(model.weights, NamedSharding(mesh, P()))  # the weights replicated
    opt = getattr(optax, args.optimizer)(args.lr)
    opt_state, (key, noise_key) = opt.init(w), jax.random.split(jax.random.PRNGKey(args.seed))
    train_step = make_train_step(cfg, opt, args.center, args.tis_cap, args.micro_batch, mesh)
    sampler = make_sampler(cfg, args.max_tokens, args.topk, tok.eos_ids, quant_mm(args.sampler))
    evaluator = make_sampler(cfg, args.max_tokens, 1, tok.eos_ids, greedy=True)
    order, accs = np.random.default_rng(args.seed).permutation(len(train_set)), {}
    for step in range(args.steps + 1):
        row = {"step": step}
        if step % args.eval_every == 0 or step == args.steps:
            accs[step] = row["acc"] = evaluate(args, evaluator, w, tok, test_set, data)
        if step < args.steps:
            t0 = time.perf_counter()
            if step % (args.staleness + 1) == 0:
                w_sampler = sampler_weights(w, args.sampler, args.weight_noise, noise_key)
            problems = [train_set[order[(step * args.prompts + i) % len(order)]] for i in range(args.prompts)]
            batch, r = rollouts(sampler, w_sampler, tok, [p for p in problems for _ in range(args.group)],
                                jax.random.fold_in(key, step), data)
            t1 = time.perf_counter()
            batch["adv"] = advantage(r.astype(np.float32), args)
            w, opt_state, m = train_step(w, opt_state, jax.device_put(batch, data))
            row |= {k: float(v) for k, v in m.items()} | dict(
                reward=float(r.mean()), length=float(batch["mask"].sum(1).mean()), sample_seconds=t1 - t0,
                train_seconds=time.perf_counter() - t1, seconds=time.perf_counter() - t0)
        log_step(row, args.steps, [c for c in COLUMNS if c != "drift"], args.out)
    peak = max(accs.values())
    summary = dict(eval_acc={str(k): v for k, v in accs.items()}, peak_acc=peak, final_acc=accs[args.steps],
                   drop=peak - accs[args.steps])
    if args.save:
        qwen3.save(args.save, cfg, jax.device_get(w))
        for f in os.listdir(model.path):  # the tokenizer and generation config travel with the weights
            if f.endswith((".json", ".txt")) and f not in ("config.json", "model.safetensors.index.json"):
                shutil.copy(os.path.join(model.path, f), args.save)
    return write_summary(args.out, summary)

if __name__ == "__main__":
    main()
