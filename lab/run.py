"""One run of train.py, as its `main` hands it over: the flags checked, the programs compiled once
(the drop-ins of lab/grouped.py and lab/train_step.py in place of train.py's reference sampler and
train step), the policy laid over the devices (FSDP, or LoRA adapters), the drift meter and the
held-out score, the data, and train.grpo run with logs, metrics.jsonl, resumable state and the
guard against an update that is not finite; --compare and --plan. `train` is train.py's module,
passed in by its `main`, never imported. B = P·G rows a step."""

import json
import math
import os
import time
from collections import namedtuple
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lab import compare, grouped, harness, hf_checkpoint, lora, plan, rollouts, tasks
from lab.devices import host, shardings
from lab.models import INPUT_AXES
from lab.train_step import make_train_step

STATE_DTYPES = dict(bf16=jnp.bfloat16, fp16=jnp.float16)  # --state-dtype: Qwen3.5's, not float32
Programs = namedtuple("Programs", "train mesh opt policy train_steps samplers greedy prober logp")


def build(train, args, cfg, eos):
    """The jitted programs, compiled once and shared by the runs of a --compare: one train step per
    arm, one sampler per kind of numerics, the greedy and the probe's (clean bf16) samplers, log p
    for the drift meter, the policy's weights (LoRA: merged); `train`: train.py's module."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    opt = getattr(optax, args.optimizer)(args.lr)  # sgd, adam or adamw (optax's decay: 1e-4)
    scale = args.lora and args.lora_alpha / args.lora  # LoRA's alpha / rank
    flags = dict(correction=harness.correction(args.correction), lora_scale=scale, group=args.group)

    @cache
    def samplers(kind, kv=None, state=None):  # sampler kind, the KV cache's kind, the state's dtype
        numerics = dict(mm=train.quant_mm(kind), kv_quant=train.kv_quant(kv))
        numerics["dtype"] = train.SAMPLER_DTYPES[kind]
        if state:  # Qwen3.5's recurrent state held at bf16 or fp16 (a dense model has none)
            numerics["state_dtype"] = STATE_DTYPES[state]
        return grouped.make_sampler(
            cfg, args.max_tokens, args.topk, eos, numerics, group=args.group
        )

    steps = [make_train_step(cfg, opt, args.micro_batch, mesh, c, **flags) for c in (False, True)]
    policy = jax.jit(partial(lora.merge, scale=scale)) if args.lora else lora.merge
    greedy = rollouts.remembered(grouped.make_sampler(cfg, args.max_tokens, 1, eos, greedy=True))
    prober = grouped.make_sampler(cfg, args.max_tokens, 1, eos)
    logp = jax.jit(partial(grouped.token_logp, cfg))
    return Programs(train, mesh, opt, policy, steps, samplers, greedy, prober, logp)


def run(args, task, fn, center, seed, out, prefix=""):
    """One GRPO run into `out` (resumed from its state when there is one); returns its summary.
    fn: build's programs; prefix: on each line it prints."""
    if summary := harness.finished(out):  # a --resume of a finished run
        return summary
    key, noise_key, probe_key, lora_key = jax.random.split(jax.random.PRNGKey(seed), 4)
    data = NamedSharding(fn.mesh, PartitionSpec("data"))  # rows split over the devices
    replicated = NamedSharding(fn.mesh, PartitionSpec())
    rows = args.prompts * args.group  # B = P·G: a sampler call

    # the policy: FSDP-split float32 weights (copied: the step donates them), or LoRA adapters
    w = jax.tree.map(jnp.copy, jax.device_put(task.weights, shardings(task.weights, fn.mesh)))
    params, base = w, None
    if args.lora:
        adapters = lora.init(w, args.lora, lora_key, INPUT_AXES)
        params, base = jax.device_put(adapters, replicated), w
    where = replicated if args.lora else shardings(jax.eval_shape(fn.opt.init, params), fn.mesh)
    opt_state = jax.jit(fn.opt.init, out_shardings=where)(params)  # made split: never whole

    policy = partial(fn.policy, base=base)  # the weights of params (LoRA: merged into the base)

    def copy(params, kind="bf16", sigma=0.0):  # a sampler's, whole on every device (default: clean)
        weights = fn.train.sampler_weights(policy(params), kind, sigma, noise_key)
        return jax.device_put(weights, replicated)

    # the drift meter, on completions drawn once from p_0's clean bf16 copy; the held-out score.
    # rollouts.generate: the prompts left-padded to one length, n rows a sampler call, the record
    # as arrays. drift(w): the probe tokens' mean log p_0(y) − log p_w(y), about KL(p_0 ‖ p_w)
    say = partial(harness.say, prefix=prefix)  # what runs before and between the steps: its time

    # rows a call on each device: all the prompts (up to 512), rounded up to a multiple of P·G;
    # as many on each device whatever their number, so that each computes, and draws, what one
    # device would (XLA:CPU's kernels sum a row in an order set by the rows a device holds)
    def on_each_device(prompts):
        return rows * math.ceil(min(len(prompts), 512) / rows)

    tic = time.perf_counter()
    n = on_each_device(task.probe) * fn.mesh.size  # more devices: copies of the first prompt
    probe = rollouts.generate(fn.prober, copy(params), task.probe, task.pad, probe_key, data, n)
    drift = rollouts.drift_meter(fn.logp, probe, policy(params), args.micro_batch, data)
    say(f"probe: {len(task.probe)} completions of p_0, {time.perf_counter() - tic:.0f} s")
    test, golds = [p for p, _ in task.test], [gold for _, gold in task.test]
    held_out = on_each_device(test)  # rows a greedy call on each device

    def evaluate(params):  # greedy, clean bf16: bit-equal weights scored once (fn.greedy remembers)
        say(f"evaluation: {len(test)} held-out prompts, greedy, {held_out} rows a device a call")
        tic = time.perf_counter()
        n = held_out * fn.mesh.size  # more devices: more of the set a call, or copies
        out = rollouts.generate(fn.greedy, copy(params), test, task.pad, None, data, n, say)
        correct = np.asarray(task.reward(out["tokens"], out["mask"], golds))  # a reward a problem
        say(f"evaluation: score {correct.mean():.3f}, {time.perf_counter() - tic:.0f} s")
        return dict(drift=drift(policy(params)), acc=correct.mean(), correct=correct)

    # the rollouts: P prompts a step, each G times, in an order drawn from the seed
    order = np.random.default_rng(seed).permutation(len(task.train))

    def sample(w_sampler, step):  # a step's rows split over the devices: see docs/scaling.md
        first = step * args.prompts
        problems = [task.train[order[(first + i // args.group) % len(order)]] for i in range(rows)]
        prompts, golds = [p for p, _ in problems], [gold for _, gold in problems]
        sampler = fn.samplers(args.sampler, args.kv_quant, args.state_dtype)
        step_key = jax.random.fold_in(key, step)
        return rollouts.generate(sampler, w_sampler, prompts, task.pad, step_key, data, rows), golds

    def train_step(params, opt_state, batch):
        return fn.train_steps[center](params, opt_state, jax.device_put(batch, data), base)

    # the loop, from the saved state if there is one
    template = copy(params, args.sampler) if args.staleness else None  # a saved copy's dtypes
    hist = dict(step=0, acc={}, drift={}, kl_q_p=[], reward=[])
    hist, state = resume(out, hist, params, opt_state, template)  # out's saved state, if any
    log = harness.recorder(args, out, hist, prefix)  # prints, appends metrics.jsonl, saves
    params, opt_state = fn.train.grpo(
        state,
        start=hist["step"],
        steps=args.steps,
        staleness=args.staleness,
        eval_every=args.eval_every,
        group=args.group,
        baseline=args.baseline,
        refresh=partial(copy, kind=args.sampler, sigma=args.weight_noise),
        sample=sample,
        reward=task.reward,
        train_step=train_step,
        evaluate=evaluate,
        record=stop_if_not_finite(log, evaluate),
    )
    if args.save:
        weights = host(policy(params))  # every process takes part; process 0 writes
        if not jax.process_index():
            hf_checkpoint.save(args.save, task.cfg, weights, task.path)
    return harness.finish(out, hist, args.lr, prefix)


def stop_if_not_finite(log, evaluate):
    """grpo's record: log(row, ...) each row; a row whose update was not finite (lab/train_step.py
    skipped it) is evaluated, logged, and ends the run."""

    def record(row, params, opt_state, w_sampler):
        finite = bool(row.get("finite", True))
        if not finite and "drift" not in row:
            row |= evaluate(params)
        log(row, params, opt_state, w_sampler)
        return finite

    return record


def resume(out, hist, *trees):  # hist and trees from out's state, if any; rows past it set aside
    if not out:
        return hist, trees
    file = os.path.join(out, "state.npz")
    if os.path.exists(file):
        with np.load(file) as z:
            leaves, tree = jax.tree.flatten(trees)
            if [z[f"a{i}"].shape for i in range(len(z.files) - 1)] != [x.shape for x in leaves]:
                raise ValueError(f"{file}: another run's (model, --lora, --optimizer, --staleness)")
            hist = json.loads(str(z["hist"]))
            leaves = [
                jax.device_put(z[f"a{i}"].astype(x.dtype), x.sharding) for i, x in enumerate(leaves)
            ]
            trees = tree.unflatten(leaves)  # typed and placed like the templates `trees`
        print(f"resumed {out} at step {hist['step']}", flush=True)
    elif os.path.exists(os.path.join(out, "metrics.jsonl")):  # no --save-every, or none saved yet
        print(f"resumed {out} at step 0: no saved state (state.npz) to continue from", flush=True)
    for name in ("metrics", "evals"):
        set_aside(out, name, hist["step"])
    return hist, trees


def set_aside(out, name, step):
    """Rows of out/NAME.jsonl at or past `step` are logged again by a resumed run: they move to
    out/NAME.replaced.jsonl (appended, never lost); a line cut short by a kill mid-write goes."""
    file = os.path.join(out, f"{name}.jsonl")
    if not os.path.exists(file):  # else the run has logged no row, and wrote nothing yet
        return
    rows = [r for r in open(file) if r.endswith("\n")]
    past = [r for r in rows if json.loads(r)["step"] >= step]
    if past and not jax.process_index():
        with harness.LOCK, open(os.path.join(out, f"{name}.replaced.jsonl"), "a") as f:
            f.writelines(past)
        print(
            f"  {len(past)} rows of {name}.jsonl from step {step} on: kept in {name}.replaced.jsonl"
        )
    harness.atomic(file, lambda f: f.writelines(r for r in rows if json.loads(r)["step"] < step))


def main(argv, train):
    """train.py's main: the flags, checked against the model's config.json before any download;
    --plan, --compare, or one run."""
    args = harness.parse_args(argv, train.__doc__.split("\n\n")[0].replace("\n", " "))
    harness.start(args)

    def work():
        tic = time.perf_counter()
        task = tasks.load(args, shardings)  # bad input: one line
        harness.say(f"load: {time.perf_counter() - tic:.1f} s")
        if args.plan:  # then `task` is the model's config.json alone, and (0,) stands in for eos
            adapters = partial(lora.init, input_axes=INPUT_AXES)
            return plan.plan(args, dict(task), build(train, args, task, (0,)), shardings, adapters)
        fn = build(train, args, task.cfg, task.eos)
        if args.compare:
            return compare.compare(args, task, fn, run)
        return run(args, task, fn, args.center, args.seed, args.out)

    return harness.interruptible(work)
