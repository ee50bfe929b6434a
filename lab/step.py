"""One GRPO step of train.py, part by part (docs/speed.md): the sampler's P·G rollouts, the train
step on them (and on them cut to each multiple of 32 tokens), the greedy evaluation of the held-out
set, the drift meter. Each part is called twice
and both times printed (the first compiles); the flags are train.py's.

    python -m lab.step --task arithmetic --model smollm2 --lora 32 --optimizer adamw --eval-n 400
"""

import argparse
import contextlib
import json
import math
import os
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lab import harness, lora, rollouts, run, tasks
from lab.devices import shardings
from lab.models import INPUT_AXES


def timed(name, call, times=2):  # call() `times` times: its last result; prints each time
    seconds = []
    for _ in range(times):
        start = time.perf_counter()
        out = jax.block_until_ready(call())
        seconds.append(round(time.perf_counter() - start, 2))
    print(json.dumps(dict(part=name, seconds=seconds, load=round(os.getloadavg()[0], 2))))
    return out


def prefill_a_row(sampler, batch, sample, rows):
    """The sampler with each row's prompt prefilled on its own, as before a group shared one
    prefill, timed; the first completion token's sorted head of log q against the batch's (its
    median and largest gap): quantisers turn the prefill's other order of sums into their steps."""
    one = timed("sample, a prefill a row", lambda: sample(sampler, n=rows))
    gap = np.abs(np.asarray(batch["head_logq"][:, 0]) - np.asarray(one["head_logq"][:, 0]))
    print(json.dumps(dict(first_head_logq_gap=[float(np.median(gap)), float(gap.max())])))


@contextlib.contextmanager
def merged_lora(lora, scale):  # the trainer's LoRA merged into W first, as before lora.matmul
    attach, matmul = lora.attach, lora.matmul
    lora.attach, lora.matmul = partial(lora.merge, scale=scale), lambda s: jnp.einsum
    try:
        yield
    finally:
        lora.attach, lora.matmul = attach, matmul


def main(argv, train):
    """train: the module whose programs are timed (train.py, passed in, not imported)."""
    args = harness.parse_args(argv)
    task = tasks.load(args, shardings)
    fn = run.build(train, args, task.cfg, task.eos)
    data, rows = NamedSharding(fn.mesh, PartitionSpec("data")), args.prompts * args.group
    key = jax.random.PRNGKey(args.seed)

    # the policy as a run starts it, and the sampler's copy
    params, base = task.weights, None
    if args.lora:
        params = lora.init(task.weights, args.lora, key, INPUT_AXES)
        base = task.weights
    opt_state, policy = fn.opt.init(params), fn.policy(params, base=base)
    w_q = timed("sampler copy", lambda: train.sampler_weights(policy, args.sampler))

    # the step's parts
    problems = [task.train[i // args.group] for i in range(rows)]
    prompts, golds = [p for p, _ in problems], [g for _, g in problems]
    sampler = fn.samplers(args.sampler, args.kv_quant, args.state_dtype)
    sample = partial(rollouts.generate, w=w_q, prompts=prompts, pad_id=task.pad, key=key, data=data)
    batch = timed("sample", lambda: sample(sampler, n=rows))
    a_row = run.build(train, argparse.Namespace(**vars(args) | dict(group=1)), task.cfg, task.eos)
    prefill_a_row(
        a_row.samplers(args.sampler, args.kv_quant, args.state_dtype), batch, sample, rows
    )
    rewards = np.asarray(task.reward(batch["tokens"], batch["mask"], golds), np.float32)
    batch["adv"] = train.advantage(rewards, args.group, args.baseline)

    def train_step(batch, step=fn.train_steps[args.center]):
        copy = jax.tree.map(jnp.copy, (params, opt_state))  # the step donates its inputs
        return step(*copy, jax.device_put(batch, data), base)

    timed("train step", lambda: train_step(batch))
    if args.lora:  # and with the adapters merged into W first, as before lab.lora.matmul
        with merged_lora(lora, args.lora_alpha / args.lora):
            merged = run.build(train, args, task.cfg, task.eos).train_steps[args.center]
            timed("train step, LoRA merged", lambda: train_step(batch, merged))
    # the train step's cost against the record's length M (rollouts.generate cuts a record after
    # its longest completion, rounded up to 32): the same rows at each M a multiple of 32
    for M in range(32, args.max_tokens + 1, 32):
        cut = {k: x if k in ("prompt", "pos", "adv") else x[:, :M] for k, x in batch.items()}
        timed(f"train step, M {M}", lambda cut=cut: train_step(cut))
    # and at M 32 with each row's prompt computed on its own, as before a group shared it
    alone = a_row.train_steps[args.center]  # built as train.py builds it, at group 1
    cut = {k: x if k in ("prompt", "pos", "adv") else x[:, :32] for k, x in batch.items()}
    timed("train step, M 32, a prompt a row", lambda: train_step(cut, alone))
    test = [p for p, _ in task.test]

    def a_call(prompts):  # rows a call, as lab/run.py's evaluation and probe: all, on each device
        return rows * math.ceil(min(len(prompts), 512) / rows) * fn.mesh.size

    held_out = a_call(test)
    calls = iter(range(100))  # a new key each call: fn.greedy remembers its inputs
    greedy = partial(rollouts.generate, fn.greedy, w_q, test, task.pad)
    timed("evaluation", lambda: greedy(jax.random.fold_in(key, next(calls)), data, held_out))
    n = a_call(task.probe)
    probe = timed(
        "probe", lambda: rollouts.generate(fn.prober, w_q, task.probe, task.pad, key, data, n), 1
    )
    drift = rollouts.drift_meter(fn.logp, probe, policy, args.micro_batch, data)
    timed("drift meter", lambda: drift(policy))
    lengths = batch["mask"].sum(-1)
    print(json.dumps(dict(mean_length=float(lengths.mean()), reward=float(rewards.mean()))))


if __name__ == "__main__":  # python -m lab.step, from the project's folder
    import sys

    import train  # the tutorial, whose programs are timed

    main(sys.argv[1:], train)
