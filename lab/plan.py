"""--plan: the memory per device a run needs, from config.json alone: train.py's sampler and train
step compiled on the shapes and shardings of its weights, optimizer state, rollouts and KV cache,
nothing allocated. B = P·G rollouts, T0 prompt and M completion tokens, L layers."""

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from lab import harness, models


def plan(args, cfg, fn, shardings, lora_init, T0=256):
    """--plan: the sampler and the train step compiled on shapes and shardings alone; prints and
    returns the bytes per device. fn: lab/run.py build's programs; shardings, lora_init: the FSDP
    layout and LoRA adapters; T0: the prompt tokens planned for (GSM8K's: 100 to 250)."""
    L, mesh = cfg["num_hidden_layers"], fn.mesh
    B, M, key = args.prompts * args.group, args.max_tokens, jax.random.PRNGKey(0)  # B = P·G

    def placed(tree, where):  # abstract arrays: the shapes and dtypes of tree, on `where` shardings
        return jax.tree.map(lambda x, s: x.update(sharding=s), tree, where)

    def everywhere(spec, tree):
        return jax.tree.map(lambda _: NamedSharding(mesh, spec), tree)

    def size(tree):  # bytes per device
        leaves = jax.tree.leaves(tree)
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)

    def trained(tree):  # FSDP shards; LoRA: the adapters and their state whole on every device
        return everywhere(PartitionSpec(), tree) if args.lora else shardings(tree, mesh)

    w = models.shapes(cfg)  # float32, as loaded
    w16 = jax.tree.map(lambda x: x.update(dtype=jnp.bfloat16), w)
    w16 = placed(w16, everywhere(PartitionSpec(), w16))  # the sampler's copy
    w = placed(w, shardings(w, mesh))
    params = jax.eval_shape(partial(lora_init, rank=args.lora), w, key=key) if args.lora else w
    state = jax.eval_shape(fn.opt.init, params)
    params, state = placed(params, trained(params)), placed(state, trained(state))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    prompt = jax.ShapeDtypeStruct((B, T0), jnp.int32, sharding=rows)  # and pos
    batch = jax.eval_shape(fn.samplers(args.sampler), w16, prompt, prompt, key)
    batch |= dict(prompt=prompt, pos=prompt, adv=jax.ShapeDtypeStruct((B,), jnp.float32))
    batch = placed(batch, everywhere(PartitionSpec("data"), batch))
    s = fn.samplers(args.sampler).lower(w16, prompt, prompt, key).compile().memory_analysis()
    step = fn.train_steps[args.center]
    t = step.lower(params, state, batch, w if args.lora else None).compile().memory_analysis()
    init_kv = partial(models.model(cfg).init_kv, cfg, B // mesh.size, T0 + M, jnp.bfloat16)
    cache = jax.eval_shape(init_kv)
    kv = sum(x.size * x.dtype.itemsize for name, x in cache.items() if name != "pos")
    rows = {  # kv: a device's rows of the sampler's cache (K, V; Qwen3.5's conv inputs and state)
        "weights": size(w),
        "adapters": size(params) * bool(args.lora),
        "gradients": size(params),
        "optimizer state": size(state),
        "sampler weights": size(w16),
        "kv cache": kv,
        "sampler temporaries": s.temp_size_in_bytes,
        "train step arguments": t.argument_size_in_bytes,
        "train step temporaries": t.temp_size_in_bytes,
    }  # the peaks add what is resident meanwhile
    sampling = s.argument_size_in_bytes + s.output_size_in_bytes + s.temp_size_in_bytes
    stepping = t.argument_size_in_bytes + t.output_size_in_bytes - t.alias_size_in_bytes
    resident = rows["weights"] + rows["adapters"] + rows["optimizer state"]
    rows["peak while sampling"] = resident + sampling
    rows["peak in the train step"] = rows["sampler weights"] + stepping + t.temp_size_in_bytes
    lora = f", LoRA {args.lora}" if args.lora else ""
    shape = f"{B} rollouts x ({T0} + {M} tokens), micro-batch {args.micro_batch}"
    name = models.NAMES[cfg["model_type"]]
    print(f"--plan: {L}-layer {name}, {shape}, {args.optimizer}{lora}, {mesh.size} devices")
    harness.table(
        "per device", {k: dict(MiB=v / 2**20) for k, v in rows.items()}, dict(MiB="{:10,.1f}")
    )
    return rows
