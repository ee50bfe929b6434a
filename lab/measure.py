"""What a real model shows (docs/real_model.md): each sampler kind's mismatch on its own text, one
step's drift term against its signal, its greedy GSM8K accuracy.

    python -m lab.measure mismatch --model smollm2 --data-dir ../shared/gsm8k
    python -m lab.measure drift --model smollm2 --max-tokens 128  # on lab/problems.py's arithmetic
    python -m lab.measure drift --task chain --max-tokens 64   # the chain task, its levels
    python -m lab.measure drift --task chain-hybrid --max-tokens 64 --state-dtype fp16
    python -m lab.measure drift --task chain-hybrid --levels float32 --state-dtype bf16  # the state
    python -m lab.measure accuracy --model smollm2 --data-dir ../shared/gsm8k --n 500

Each result is a JSON line in OUT/WHAT.jsonl, written as it is made; a rerun skips the results
already there; each is printed as a JSON line.
"""

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import score_centering as sc
from lab import grouped, harness, problems, rollouts, run, tasks

MISMATCH_LEVELS = "0,int8,fp8,0+kv_fp8,0+kv_int8,0+kv_int4,int8+kv_int4,fp8+kv_fp8,0.01,0.02"
DRIFT_LEVELS = "0,int8,fp8+kv_fp8,int8+kv_int4,0.02"  # the chain sweep's levels (tasks.py)


def results(file):  # {key: result} of the lines already written
    if not os.path.exists(file):
        return {}
    with open(file) as f:
        return {r["key"]: r for r in map(json.loads, f)}


def append(file, result):  # one line, flushed: a stopped run loses nothing it has measured
    with open(file, "a") as f:
        f.write(json.dumps(result) + "\n")


def sampler(train, args, task, level, topk, key):
    """The sampler of a level (harness.levels' (kind, σ, kv)) and its weights; with --state-dtype,
    Qwen3.5's recurrent state held at bf16 or fp16."""
    kind, sigma, kv = level
    numerics = dict(mm=train.quant_mm(kind), kv_quant=train.kv_quant(kv))
    numerics["dtype"] = train.SAMPLER_DTYPES[kind]
    if args.state_dtype:
        numerics["state_dtype"] = run.STATE_DTYPES[args.state_dtype]
    w_q = train.sampler_weights(task.weights, kind, sigma, jax.random.fold_in(key, 1))
    return grouped.make_sampler(task.cfg, args.max_tokens, topk, task.eos, numerics), w_q


def trainer_logp(
    train, cfg, w, rec, rows
):  # the float32 trainer's log p [B, M] of the sampled tokens
    logp = jax.jit(lambda w, b: grouped.token_logp(cfg, w, b))
    keep = ("prompt", "pos", "tokens")
    calls = [
        np.asarray(logp(w, {k: rec[k][i : i + rows] for k in keep}))
        for i in range(0, len(rec["tokens"]), rows)
    ]
    return np.concatenate(calls)


def mismatch(train, args, task, level, seed):
    """kl_q_p = token mean of log q − log p on q's own samples, mean |log p − log q|, and the
    mass of q's top 128 tokens, over args.rows GSM8K test prompts of up to max_tokens."""
    key = jax.random.key(seed)
    sample, w_q = sampler(train, args, task, level, 128, key)
    prompts = [p for p, _ in task.test[: args.rows]]
    rec = rollouts.generate(sample, w_q, prompts, task.pad, key, args.data, args.rows)
    logp, mask = trainer_logp(train, task.cfg, task.weights, rec, args.micro_batch), rec["mask"]
    diff = (rec["logq"] - logp)[mask]
    head = np.asarray(jax.scipy.special.logsumexp(rec["head_logq"], -1))[mask]
    return dict(
        kl_q_p=float(diff.mean()),
        abs_diff=float(np.abs(diff).mean()),
        head_mass=float(np.exp(head).mean()),
        tokens=int(mask.sum()),
        rows=len(prompts),
    )


def gradients(train, cfg, w, b, rows):
    """The uncentred and the centred (exact: b["head_logq"] is the full log q) gradients of the
    token-sum loss and the token sum of log q − log p, summed over calls of `rows` rows; one
    forward a call, two backward passes."""

    @jax.jit
    def both(w, b):
        fwd = lambda w: grouped.completion_logits(cfg, w, b["prompt"], b["pos"], b["tokens"])  # noqa: E731
        logits, vjp = jax.vjp(fwd, w)
        args = b["tokens"], b["mask"], b["adv"], b["logq"], b["head_logq"]

        def dlogits(center):
            loss = lambda lg: sc.loss(lg, *args, center=center)[0] * b["mask"].sum()  # noqa: E731
            return jax.grad(loss)(logits)

        kl_q_p = sc.loss(logits, *args, center=False)[1]["kl_q_p"]  # the token mean
        return vjp(dlogits(False))[0], vjp(dlogits(True))[0], kl_q_p * b["mask"].sum()

    keep = ("prompt", "pos", "tokens", "mask", "adv", "logq", "head_logq")
    total = None
    for i in range(0, len(b["tokens"]), rows):
        g = both(w, {k: b[k][i : i + rows] for k in keep})
        total = g if total is None else jax.tree.map(jnp.add, total, g)
    g_u, g_c = [jnp.concatenate([x.ravel() for x in jax.tree.leaves(t)]) for t in total[:2]]
    return g_u, g_c, float(total[2])


def drift(train, args, task, level, seed):
    """One step's drift term against its signal: g_u − g_c = Σ adv · E_q[∇ log p]
    (score_centering.py, step 7), over a batch of args.prompts prompts × args.group rollouts."""
    key = jax.random.key(seed)
    sample, w_q = sampler(train, args, task, level, 0, key)
    rng = np.random.default_rng(seed)
    chosen = [task.train[i] for i in rng.choice(len(task.train), args.prompts, replace=False)]
    chosen = [p for p in chosen for _ in range(args.group)]
    prompts, golds = [p for p, _ in chosen], [g for _, g in chosen]
    rec = rollouts.generate(sample, w_q, prompts, task.pad, key, args.data, len(prompts))
    rewards = np.asarray(task.reward(rec["tokens"], rec["mask"], golds), np.float32)
    adv = np.asarray(train.advantage(jnp.asarray(rewards), args.group, "group"))
    batch = rec | dict(adv=adv)
    g_u, g_c, kl_sum = gradients(train, task.cfg, task.weights, batch, args.micro_batch)
    norm_c, norm_d = float(jnp.linalg.norm(g_c)), float(jnp.linalg.norm(g_u - g_c))
    mixed = rewards.reshape(-1, args.group).std(-1) > 0
    return dict(
        drift_over_signal=norm_d / norm_c if norm_c else None,
        cos=float(g_u @ g_c / (jnp.linalg.norm(g_u) * norm_c)) if norm_c else None,
        norm_c=norm_c,
        norm_drift=norm_d,
        reward=float(rewards.mean()),
        mixed_groups=int(mixed.sum()),
        tokens=int(rec["mask"].sum()),
        kl_q_p=kl_sum / rec["mask"].sum(),
    )


def accuracy(
    train, args, task, level, seed
):  # greedy (clean bf16) on the first args.n test problems
    sampler = grouped.make_sampler(task.cfg, args.max_tokens, 1, task.eos, greedy=True)
    w_q = train.sampler_weights(task.weights, "bf16")
    test = task.test[: args.n]
    rec = rollouts.generate(
        sampler, w_q, [p for p, _ in test], task.pad, jax.random.key(seed), args.data, args.rows
    )
    right = task.reward(rec["tokens"], rec["mask"], [g for _, g in test])
    ended = np.isin(rec["tokens"], task.eos).any(-1)
    return dict(accuracy=float(np.mean(right)), n=len(test), ended=float(ended.mean()))


MEASURES = dict(mismatch=mismatch, drift=drift, accuracy=accuracy)
COLUMNS = dict(
    mismatch=("kl_q_p", "abs_diff", "head_mass", "tokens"),
    drift=("drift_over_signal", "cos", "kl_q_p", "reward", "mixed_groups", "tokens"),
    accuracy=("accuracy", "n", "ended"),
)


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m lab.measure", description=__doc__.split("\n")[0])
    p.add_argument("what", choices=MEASURES)
    p.add_argument("--task", choices=["gsm8k", *tasks.TINY], default="gsm8k")
    p.add_argument("--model", help="a checkpoint folder (gsm8k)")
    p.add_argument("--data-dir", help="GSM8K's jsonl folder (mismatch, accuracy)")
    p.add_argument("--levels", help="harness.levels' spelling (default: per measure)")
    p.add_argument("--state-dtype", choices=["bf16", "fp16"], help="Qwen3.5's state (chain-hybrid)")
    p.add_argument("--seeds", type=harness.csv(int), default=(0, 1))
    p.add_argument("--rows", type=int, default=64, help="sampler rows a call (mismatch: in all)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompts", type=int, default=4, help="drift: prompts a batch")
    p.add_argument("--group", type=int, default=8, help="drift: rollouts a prompt")
    p.add_argument("--micro-batch", type=int, default=4, help="trainer rows a call")
    p.add_argument("--n", type=int, default=500, help="accuracy: the first N test problems")
    p.add_argument("--out", default="runs/measure")
    args = p.parse_args(argv)
    if args.task == "gsm8k" and not args.model:
        p.error("--model is required on gsm8k (a checkpoint folder: python -m lab.gguf FILE OUT)")
    if args.task != "gsm8k" and args.what != "drift":
        p.error(f"{args.what} measures GSM8K text: --task {args.task} takes drift only")
    if args.state_dtype and args.task != "chain-hybrid":
        p.error(f"--state-dtype {args.state_dtype}: only chain-hybrid's Qwen3.5 has a state")
    if args.what != "drift" and not args.data_dir:
        p.error(f"{args.what} reads GSM8K's test split: give --data-dir")
    default = dict(mismatch=MISMATCH_LEVELS, drift=DRIFT_LEVELS, accuracy="0")[args.what]
    args.levels = args.levels or default
    if args.what == "accuracy":  # greedy: one seed's is every seed's
        args.seeds = args.seeds[:1]
    return args


def load_task(args):  # one line for a bad checkpoint or data folder, as train.py's
    if args.task in tasks.TINY:
        return tasks.TINY[args.task](0, 0, 0)
    # drift: groups of mixed reward, on problems the model solves part of the time
    made = problems.arithmetic() if args.what == "drift" else problems.gsm8k(args.data_dir)
    try:
        return tasks.gsm8k_task(args.model, made, max(args.rows, args.n), 0)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None


def main(argv, train):
    """train: the module whose programs measure (train.py, passed in, not imported)."""
    args = parse(argv)
    task = load_task(args)
    args.data = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
    os.makedirs(args.out, exist_ok=True)
    state = f"-state_{args.state_dtype}" if args.state_dtype else ""
    file = f"{args.out}/{args.what}-{args.task}{state}.jsonl"
    done = results(file)
    for text, level in zip(args.levels.split(","), harness.levels(args.levels), strict=True):
        for seed in args.seeds:
            key = f"{text}/{seed}"
            if key not in done:
                start = time.time()
                r = MEASURES[args.what](train, args, task, level, seed)
                done[key] = dict(key=key, level=text, seed=seed, **r, s=time.time() - start)
                append(file, done[key])
            print(json.dumps(done[key]), flush=True)


if __name__ == "__main__":  # python -m lab.measure, from the project's folder
    import train  # the tutorial, whose sampler and train step are measured

    main(None, train)
