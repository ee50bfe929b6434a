"""How fast train.py samples and trains here, as fractions of the devices' limits (docs/speed.md).

    python bench.py           # Qwen3-0.6B's shape, random weights: 6 min on 2 CPU cores
    python bench.py --tiny    # the sequence task's model: a minute or two, mostly compiling
    python bench.py --batch 1,16,64 --prompt 256 --new 128 --rows 16 --out bench.json   # a GPU

Medians of --repeats calls; compile_s: the first call's excess. T0 prompt, M new tokens, k top-k.
sampler (train.make_sampler): ms_step = (t(M) - t(1)) / (M - 1), prefill = t(1) - ms_step; k 1 is
plain sampling: x_plain = ms_step / bf16 k 1's; of_bw = the bytes a decode step reads (weights, the
bf16 KV cache) / ms_step / bandwidth. train (train.make_train_step, SGD): x_uncentred = s_step / the
uncentred one's; MFU = model FLOPs (6 x weights x tokens, the head, attention) / s_step / peak.
"""

import argparse
import json
import math
import os
import resource
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import hf_checkpoint
import qwen3
import tasks
import train

QWEN3_06B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024)  # Qwen3-0.6B's config
QWEN3_06B |= dict(intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16)
QWEN3_06B |= dict(num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6)
QWEN3_06B |= dict(tie_word_embeddings=True, max_position_embeddings=40960)
PEAKS = {  # device_kind contains: bf16 dense FLOP/s, memory bytes/s (the vendors' spec sheets)
    "H100": (989e12, 3.35e12),  # SXM
    "H200": (989e12, 4.8e12),
    "A100": (312e12, 2.039e12),  # SXM 80 GB
    "TPU v5 lite": (197e12, 819e9),  # v5e
    "TPU v6 lite": (918e12, 1640e9),  # v6e
}


def seconds(call, repeats):  # the median of `repeats` timed calls, and the first's excess
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    median = statistics.median(times[1:])
    return median, times[0] - median


def peak_gib():  # the device's peak memory so far; a CPU's: the process's peak RSS (Linux: KiB)
    stats = jax.devices()[0].memory_stats() or {}  # None on a CPU
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return stats.get("peak_bytes_in_use", rss) / 2**30


def peaks(repeats):  # (FLOP/s, bytes/s, where from): the table's, or measured
    for name, (flops, bandwidth) in PEAKS.items():
        if name in jax.devices()[0].device_kind:
            return flops, bandwidth, f"{name} spec sheet"
    a, x = jnp.ones((4096, 4096)), [jnp.zeros(2**28)]
    negate = jax.jit(jnp.negative, donate_argnums=0)

    def copy():  # 1 GiB read and written in place (a fresh buffer: the kernel zeroes its pages)
        x[0] = negate(x[0])
        return x[0]

    flops = 2 * 4096**3 / seconds(partial(jax.jit(jnp.matmul), a, a), repeats)[0]  # float32
    return flops, 2 * x[0].nbytes / seconds(copy, repeats)[0], "measured"


def random_weights(cfg, key):  # float32: N(0, 1/fan-in) matrices, unit norm weights
    (top, layers), L, w = qwen3.layout(cfg), cfg["num_hidden_layers"], {}
    shapes = {name: s for name, (_, _, s) in top.items()}
    shapes |= {name: (L, *s) for name, (_, _, s) in layers.items()}  # a layer's: L first
    for i, (name, shape) in enumerate(shapes.items()):
        fan_in = math.prod(shape[a] for a in train.INPUT_AXES.get(name, ()))
        normal = jax.random.normal(jax.random.fold_in(key, i), shape) * fan_in**-0.5
        w[name] = normal if name in train.INPUT_AXES else jnp.ones(shape)  # a norm's: ones
    return {name: w[name] for name in top} | dict(layers={name: w[name] for name in layers})


def time_sampler(cfg, w, kind, k, prompt, pos, args, bandwidth):
    (B, T0), M, key, t, c = prompt.shape, args.new, jax.random.PRNGKey(0), {}, {}
    for m in (1, M):  # eos -1 is never sampled
        fn = train.make_sampler(cfg, m, k, (-1,), train.quant_mm(kind))
        t[m], c[m] = seconds(partial(fn, w, prompt, pos, key), args.repeats)
    step = (t[M] - t[1]) / (M - 1)  # m tokens run the model 1 + m times (the last output unused)
    head, (L, _, K, H) = w.get("lm_head", w["embed"]), w["layers"]["k"].shape
    read = sum(x.nbytes for x in jax.tree.leaves(w["layers"])) + head.nbytes  # lookup: B rows
    read += 2 * L * B * (T0 + M) * K * H * 2  # K and V: the whole bf16 cache, every step
    row = dict(sampler=kind, k=k, B=B, prefill_tok_s=B * T0 / (t[1] - step), decode_tok_s=B / step)
    row |= dict(ms_step=step * 1e3, GB_s=read / step / 1e9, of_bw=read / step / bandwidth)
    return row | dict(compile_s=c[1] + c[M], peak_GiB=peak_gib())


def time_train(cfg, w, batch, k, center, mesh, args, peak_flops):
    (B, M), T0, opt = batch["tokens"].shape, batch["prompt"].shape[1], optax.sgd(1e-4)
    T, (L, _, N, H) = T0 + M, w["layers"]["q"].shape
    step = train.make_train_step(cfg, opt, B, mesh, center)
    params = jax.tree.map(jnp.copy, jax.device_put(w, train.shardings(w, mesh)))  # donated
    carry = [params, opt.init(params)]

    def one_step():  # the updated weights and state go into the next step
        carry[:] = step(*carry, batch)[:2]
        return carry

    s, compile_s = seconds(one_step, args.repeats)
    matmul = sum(x.size for name, x in w["layers"].items() if name in train.INPUT_AXES)
    # 3 x the forward: the layers' matmuls, the head at M + 1 positions, attention over [T, T]
    flops = 3 * B * (2 * T * matmul + 2 * (M + 1) * w["embed"].size + 4 * L * T * T * N * H)
    row = dict(train="centred" if center else "uncentred", k=k or "V", B=B, tok_s=B * T / s)
    row |= dict(s_step=s, TFLOP_s=flops / s / 1e12, MFU=flops / s / peak_flops)
    return row | dict(compile_s=compile_s, peak_GiB=peak_gib())


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
    model = p.add_mutually_exclusive_group()
    model.add_argument("--tiny", action="store_true", help="the sequence task's model")
    model.add_argument("--config", help="a Hugging Face config.json: that Qwen3's shape")
    # the work
    p.add_argument("--batch", default="1,4", help="sampler rows B, comma-separated (default 1,4)")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens T0 (default 16)")
    p.add_argument("--new", type=int, help="completion tokens M >= 2 (default 8; --tiny: 128)")
    p.add_argument("--rows", type=int, default=4, help="train step rows B (default 4)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls a figure (default 3)")
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
        cfg = hf_checkpoint.read_json(args.config) if args.config else cfg
        hf_checkpoint.check_config(cfg, args.config)
    except (ValueError, OSError) as e:
        p.error(f"--config: {e}")
    return args, dict(cfg)


def main(argv=None):
    args, cfg = parse_args(argv)
    (T0, M, rows), key = (args.prompt, args.new, args.rows), jax.random.PRNGKey(0)
    device = f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}"
    peak_flops, bandwidth, source = peaks(args.repeats)
    w = random_weights(cfg, key)
    print(f"{device}, load {os.getloadavg()[0]:.2f}, T0 {T0}, M {M}")
    print(f"{source}: {peak_flops / 1e12:.3g} TFLOP/s, {bandwidth / 1e9:.3g} GB/s", flush=True)
    n = max(*args.batch, rows)  # random prompts [n, T0], positions from 0
    prompt = jax.random.randint(key, (n, T0), 0, cfg["vocab_size"])
    pos = jnp.tile(jnp.arange(T0), (n, 1))
    samples, plain = [], {}  # plain: bf16 k 1's ms_step at each B, the first timed
    for kind in ("bf16", "int8"):
        w16 = train.sampler_weights(w, kind)
        for B in args.batch:
            for k in (1, 128) if kind == "bf16" else (128,):  # the head costs the same in int8
                row = time_sampler(cfg, w16, kind, k, prompt[:B], pos[:B], args, bandwidth)
                plain[B] = plain.get(B, row["ms_step"])
                samples.append(row | dict(x_plain=row["ms_step"] / plain[B]))
    show(samples)
    mesh, steps, prompt, pos = Mesh(jax.devices(), ("data",)), [], prompt[:rows], pos[:rows]
    for k in (128, 0) if cfg["vocab_size"] <= 4096 else (128,):  # 0: exact (train.py: small V)
        out = train.make_sampler(cfg, M, k, (-1,))(w16, prompt, pos, key)  # int8's rollouts
        batch = dict(out, prompt=prompt, pos=pos, adv=jax.random.normal(key, (rows,)))
        batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))  # rows split
        for center in (False, True):
            row = time_train(cfg, w, batch, k, center, mesh, args, peak_flops)
            if not center:
                uncentred = row["s_step"]
            steps.append(row | dict(x_uncentred=row["s_step"] / uncentred))
    show(steps)
    if args.out:
        report = dict(device=device, load=os.getloadavg(), peak=(peak_flops, bandwidth, source))
        with open(args.out, "x") as f:  # "x": never over an existing file
            json.dump(report | dict(model=cfg, args=vars(args), sampler=samples, train=steps), f)


if __name__ == "__main__":
    main()
