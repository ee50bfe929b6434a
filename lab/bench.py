"""How fast train.py samples and trains here, as fractions of the devices' limits (docs/speed.md).

    python -m lab.bench           # Qwen3-0.6B's shape, random weights: 28 min on 2 busy CPU cores
    python -m lab.bench --tiny    # the sequence task's model: 3 min, mostly compiling
    python -m lab.bench --batch 1,16,64 --prompt 256 --new 128 --rows 16 --out bench.json   # a GPU

The programs a table compares run in one process, in --repeats rounds of a call each, back to back:
a figure is the median of its own calls, an x_ column the median of the rounds' ratios, compile_s
the first call's excess. Sampler (T0 prompt, M new tokens, k top-k; k 1: plain sampling): ms_step =
(t(M) - t(1)) / (M - 1), prefill = t(1) - ms_step, of_bw = the bytes a decode step moves (weights,
K and V; Qwen3.5: conv window and state) / ms_step / bandwidth. Train (SGD, on the int8 sampler's
rollouts, each row's prompt its own): MFU = model FLOPs (3 x the forward) / s_step / peak FLOP/s.
"""

import argparse
import json
import os
import resource
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lab import grouped, hf_checkpoint, tasks
from lab.devices import shardings
from lab.models import model
from lab.train_step import make_train_step

QWEN3_06B = dict(  # Qwen3-0.6B's config
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
)
PEAKS = {  # device_kind contains: bf16 dense FLOP/s, memory bytes/s (the vendors' spec sheets)
    "H100": (989e12, 3.35e12),  # SXM
    "H200": (989e12, 4.8e12),
    "A100": (312e12, 2.039e12),  # SXM 80 GB
    "TPU v5 lite": (197e12, 819e9),  # v5e
    "TPU v6 lite": (918e12, 1640e9),  # v6e
}
SAMPLERS = (("bf16", 1), ("bf16", 128), ("int8", 128))  # (kind, k); k 1: plain sampling


def timed_rounds(calls, repeats, clock=time.perf_counter):
    """calls {name: function}: each called once (compiling: first {name: s}), once more (warming
    up), then once a round, the order reversed every other round: times {name: [s a round]}."""

    def seconds(call):
        start = clock()
        jax.block_until_ready(call())
        return clock() - start

    # compile, warm up
    first = {name: seconds(call) for name, call in calls.items()}
    for call in calls.values():
        seconds(call)

    # alternating rounds
    times = {name: [] for name in calls}
    for r in range(repeats):
        for name in list(calls)[:: -1 if r % 2 else 1]:
            times[name].append(seconds(calls[name]))
    return first, times


def median_ratio(times, reference):  # the median over rounds of times / reference, round by round
    return statistics.median(t / r for t, r in zip(times, reference, strict=True))


def peak_gib():  # the device's peak memory so far; a CPU's: the process's peak RSS (Linux: KiB)
    stats = jax.devices()[0].memory_stats() or {}  # None on a CPU
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return stats.get("peak_bytes_in_use", rss) / 2**30


def peaks(repeats):  # (FLOP/s, bytes/s, where from): the table's, or measured
    for name, (flops, bandwidth) in PEAKS.items():
        if name in jax.devices()[0].device_kind:
            return flops, bandwidth, f"{name} spec sheet"
    a = jnp.ones((2048, 2048))  # 2 CPU cores: 35 GFLOP/s, 4096²'s 37, in an 8th of the time
    x = [jnp.zeros(2**28)]
    negate = jax.jit(jnp.negative, donate_argnums=0)

    def copy():  # 1 GiB read and written in place (a fresh buffer: the kernel zeroes its pages)
        x[0] = negate(x[0])
        return x[0]

    times = timed_rounds(dict(matmul=partial(jax.jit(jnp.matmul), a, a), copy=copy), repeats)[1]
    flops = 2 * 2048**3 / statistics.median(times["matmul"])  # float32
    return flops, 2 * x[0].nbytes / statistics.median(times["copy"]), "measured"


def decode_bytes(w, cache):
    """What a decode step moves: every weight, the head, the whole cache (K and V; Qwen3.5's conv
    window, and its state, read and written back); of the embedding, when not the head, B rows:
    not counted. cache: init_kv's arrays or their shapes."""
    lookup = w["embed"].nbytes if "lm_head" in w else 0  # the embedding, when only looked up
    weights = sum(x.nbytes for x in jax.tree.leaves(w)) - lookup
    cache = {name: x.size * x.dtype.itemsize for name, x in cache.items() if name != "pos"}
    return weights + sum(cache.values()) + cache.get("state", 0)


def sampler_rows(B, T0, M, first, times, read, bandwidth, peak):  # seconds of [kind, k, m]
    # decode steps, round by round: m tokens run the model 1 + m times
    def steps(kind, k):
        pairs = zip(times[kind, k, 1], times[kind, k, M], strict=True)
        return [(t_m - t_1) / (M - 1) for t_1, t_m in pairs]

    # a row per sampler
    rows = []
    for kind, k in SAMPLERS:
        t_1 = statistics.median(times[kind, k, 1])
        step = (statistics.median(times[kind, k, M]) - t_1) / (M - 1)
        compile_s = sum(first[kind, k, m] - statistics.median(times[kind, k, m]) for m in (1, M))
        row = dict(
            sampler=kind,
            k=k,
            B=B,
            prefill_tok_s=B * T0 / (t_1 - step),
            decode_tok_s=B / step,
            ms_step=step * 1e3,
            GB_s=read / step / 1e9,
            of_bw=read / step / bandwidth,
            compile_s=compile_s,
            peak_GiB=peak,
            x_plain=median_ratio(steps(kind, k), steps("bf16", 1)),
        )
        rows.append(row)
    return rows


def time_sampler(train, cfg, sampler_w, prompt, pos, args, bandwidth):  # sampler_w {kind: weights}
    B, T0 = prompt.shape
    M = args.new
    calls = {}
    for kind, k in SAMPLERS:
        for m in (1, M):  # eos -1 is never sampled: every row decodes m tokens
            fn = grouped.make_sampler(cfg, m, k, (-1,), dict(mm=train.quant_mm(kind)))
            calls[kind, k, m] = partial(fn, sampler_w[kind], prompt, pos, jax.random.PRNGKey(0))
    first, times = timed_rounds(calls, args.repeats)
    cache = jax.eval_shape(partial(model(cfg).init_kv, cfg, B, T0 + M, jnp.bfloat16))
    read = decode_bytes(sampler_w["bf16"], cache)  # int8: fake-quantised, the same bf16 bytes
    return sampler_rows(B, T0, M, first, times, read, bandwidth, peak_gib())


def train_flops(cfg, w, B, T0, M):
    """3 x the forward: the matmuls (Qwen3.5's depthwise conv: as many), the head at M + 1
    positions, attention's scores and mix; Qwen3.5's delta rule as its recurrence computes it (a
    token: M^T k, the write, q^T M, each 2·E·Y a value head), not as its chunks do."""
    T, stacks = T0 + M, [s for s in w.values() if isinstance(s, dict)]
    matmul = sum(x.size for s in stacks for x in s.values() if x.ndim > 2)  # [L, inputs, outputs]
    L, N, H, _ = next(s["o"] for s in stacks if "o" in s).shape  # the attention layers'
    forward = 2 * T * matmul + 2 * (M + 1) * w["embed"].size + 4 * L * T * T * N * H
    if "linear" in w:
        n, U, Y, _ = w["linear"]["out"].shape
        forward += 6 * T * n * U * cfg["linear_key_head_dim"] * Y
    return 3 * B * forward


def train_rows(k, B, T, flops, first, times, peak_flops, peak):  # seconds of [center]
    rows = []
    for center in (False, True):
        s = statistics.median(times[center])
        row = dict(
            train="centred" if center else "uncentred",
            k=k or "V",
            B=B,
            tok_s=B * T / s,
            s_step=s,
            TFLOP_s=flops / s / 1e12,
            MFU=flops / s / peak_flops,
            compile_s=first[center] - s,
            peak_GiB=peak,
            x_uncentred=median_ratio(times[center], times[False]),
        )
        rows.append(row)
    return rows


def one_step(step, carry, batch):  # the updated weights and state go into the next step
    carry[:] = step(*carry, batch)[:2]
    return carry


def time_train(train, cfg, w, batch, k, mesh, args, peak_flops):
    B, M = batch["tokens"].shape
    T0 = batch["prompt"].shape[1]
    opt = optax.sgd(1e-4)
    calls = {}
    for center in (False, True):
        step = make_train_step(cfg, opt, B, mesh, center)
        params = jax.tree.map(jnp.copy, jax.device_put(w, shardings(w, mesh)))  # donated
        calls[center] = partial(one_step, step, [params, opt.init(params)], batch)
    first, times = timed_rounds(calls, args.repeats)
    flops = train_flops(cfg, w, B, T0, M)
    return train_rows(k, B, T0 + M, flops, first, times, peak_flops, peak_gib())


def show(rows):  # a fixed-width table headed by the keys, numbers to 3 significant digits
    cells = [
        [f"{float(f'{x:.3g}'):,g}" if isinstance(x, float) else str(x) for x in r.values()]
        for r in rows
    ]
    width = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(rows[0])]
    for line in [list(rows[0]), *cells]:
        print("  ".join(x.rjust(n) for x, n in zip(line, width, strict=True)))


def parse_args(argv=None):  # the flags and the model's config; a mistake: one line, no compile
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # the model: Qwen3-0.6B's shape unless told otherwise
    which = p.add_mutually_exclusive_group()
    which.add_argument("--tiny", action="store_true", help="the sequence task's model")
    which.add_argument("--config", help="a Hugging Face config.json: its Qwen3, Llama or Qwen3.5")
    # the work
    p.add_argument("--batch", default="1,4", help="sampler rows B, comma-separated (default 1,4)")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens T0 (default 16)")
    p.add_argument("--new", type=int, help="completion tokens M >= 2 (default 8; --tiny: 128)")
    p.add_argument("--rows", type=int, default=4, help="train step rows B (default 4)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds, a call each (default 5)")
    p.add_argument("--out", help="also write the figures to this JSON file, a new one")
    args = p.parse_args(argv)
    args.new = (128 if args.tiny else 8) if args.new is None else args.new  # tiny: 0.1 ms a step
    args.batch = [int(b) if b.isdigit() else 0 for b in args.batch.split(",")]  # 0: refused
    if min(*args.batch, args.prompt, args.rows, args.repeats) < 1 or args.new < 2:
        p.error("--batch (such as 1,4), --prompt, --rows, --repeats must be >= 1, and --new >= 2")
    if args.rows % jax.device_count():
        p.error(f"--rows {args.rows} must be a multiple of the {jax.device_count()} devices")
    if args.out and os.path.exists(args.out):
        p.error(f"--out {args.out} exists: name a new file")
    cfg = tasks.SEQUENCE if args.tiny else QWEN3_06B
    try:
        if args.config:
            cfg = hf_checkpoint.check_config(hf_checkpoint.read_json(args.config), args.config)
    except (ValueError, OSError) as e:
        p.error(f"--config: {e}")
    return args, dict(cfg)


def main(argv, train):
    """train: the module whose programs are measured (train.py, passed in, not imported)."""
    args, cfg = parse_args(argv)
    key = jax.random.PRNGKey(0)
    device = f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}"
    peak_flops, bandwidth, source = peaks(args.repeats)
    print(f"{device}, load {os.getloadavg()[0]:.2f}, T0 {args.prompt}, M {args.new}")
    print(f"{source}: {peak_flops / 1e12:.3g} TFLOP/s, {bandwidth / 1e9:.3g} GB/s", flush=True)

    # weights, prompts
    w = tasks.init(cfg, np.random.default_rng(0))  # random: N(0, 1/fan-in) matrices
    sampler_w = {kind: train.sampler_weights(w, kind) for kind in ("bf16", "int8")}
    n = max(*args.batch, args.rows)  # random prompts [n, T0], positions from 0
    prompt = jax.random.randint(key, (n, args.prompt), 0, cfg["vocab_size"])
    pos = jnp.tile(jnp.arange(args.prompt), (n, 1))

    # the sampler at each B
    samples = []
    for B in args.batch:
        samples += time_sampler(train, cfg, sampler_w, prompt[:B], pos[:B], args, bandwidth)
    show(samples)

    # the train steps at each k, on the int8 sampler's rollouts (its weights, W8A8 matmuls)
    mesh = Mesh(jax.devices(), ("data",))
    prompt = prompt[: args.rows]
    pos = pos[: args.rows]
    adv = jax.random.normal(key, (args.rows,))  # random advantages
    steps = []
    for k in (128, 0) if cfg["vocab_size"] <= 4096 else (128,):  # 0: exact (train.py: small V)
        sample = grouped.make_sampler(cfg, args.new, k, (-1,), dict(mm=train.quant_mm("int8")))
        batch = dict(sample(sampler_w["int8"], prompt, pos, key), prompt=prompt, pos=pos, adv=adv)
        batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))  # rows split
        steps += time_train(train, cfg, w, batch, k, mesh, args, peak_flops)
    show(steps)

    # the JSON record
    if args.out:
        report = dict(device=device, load=os.getloadavg(), peak=(peak_flops, bandwidth, source))
        with open(args.out, "x") as f:  # "x": never over an existing file
            json.dump(report | dict(model=cfg, args=vars(args), sampler=samples, train=steps), f)


if __name__ == "__main__":  # python -m lab.bench, from the project's folder
    import train  # the tutorial, whose programs are measured

    main(None, train)
