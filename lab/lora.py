"""LoRA adapters on every matmul of a layer, of each kind (attention, linear attention, MLP): their
start, the merged weights the sampler and --save take, and the trainer's matmul that never merges
them (docs/lora.md). L layers, r the rank; a weight is [L, inputs..., outputs...] in a stack of
layers, its inputs the axes `input_axes` names (lab/models.py's INPUT_AXES), and an adapter pair
lora_a [L, inputs, r], lora_b [L, r, outputs]."""

import math

import jax
import jax.numpy as jnp

from lab.models import STACKS


def init(w, rank, key, input_axes):
    """Adapters {stack: {weight: pair}} on each matmul weight of each stack of layers (the weights
    input_axes names): lora_a normal of variance 1/fan-in, lora_b = 0 (starts at the base)."""
    pairs = [(stack, name) for stack in STACKS if stack in w for name in input_axes]
    pairs = [(stack, name) for stack, name in pairs if name in w[stack]]
    adapters = {stack: {} for stack, _ in pairs}
    for (stack, name), key_a in zip(pairs, jax.random.split(key, len(pairs)), strict=True):
        x = w[stack][name]  # [L, inputs..., outputs...]
        fan_in = math.prod(x.shape[1 : 1 + len(input_axes[name])])
        lora_a = jax.random.normal(key_a, (x.shape[0], fan_in, rank)) * fan_in**-0.5
        lora_b = jnp.zeros((x.shape[0], rank, x[0].size // fan_in))
        adapters[stack][name] = dict(lora_a=lora_a, lora_b=lora_b)
    return adapters


def merge(params, base, scale=None):
    """The policy's weights: base + scale · lora_a lora_b per weight (no base: the params)."""
    if base is None:
        return params
    merged = dict(base)
    for stack, adapters in params.items():
        layers = dict(base[stack])
        for name, ab in adapters.items():
            delta = scale * jnp.einsum("lir,lro->lio", ab["lora_a"], ab["lora_b"])
            layers[name] = layers[name] + delta.reshape(layers[name].shape)
        merged[stack] = layers
    return merged


def attach(params, base):  # the trainer's weights: each adapted W with its adapters
    adapted = {
        stack: base[stack] | {name: dict(w=base[stack][name], **ab) for name, ab in pairs.items()}
        for stack, pairs in params.items()
    }
    return base | adapted


def matmul(scale):
    """The trainer's matmul, where a weight may carry adapters (attach's dict(w=W, lora_a,
    lora_b)): x W + scale · (x lora_a) lora_b, which is x merge(...) up to rounding, and whose
    backward pass forms no gradient of a whole W (merged, it does: a third of the layers' work)."""

    def mm(spec, x, w):  # spec "btd,dnh->btnh": x's letters, W's (its inputs first), the output's
        if not isinstance(w, dict):
            return jnp.einsum(spec, x, w)
        (x_axes, w_axes), out = spec.split("->")[0].split(","), spec.split("->")[1]
        n_in = sum(c in x_axes for c in w_axes)  # W's input letters (d), then its outputs (nh)
        rows = "".join(c for c in x_axes if c not in w_axes)  # bt
        lora_a = w["lora_a"].reshape(*w["w"].shape[:n_in], -1)  # [inputs..., r]
        lora_b = w["lora_b"].reshape(-1, *w["w"].shape[n_in:])  # [r, outputs...]
        xa = jnp.einsum(f"{x_axes},{w_axes[:n_in]}z->{rows}z", x, lora_a)  # z: the rank
        delta = jnp.einsum(f"{rows}z,z{w_axes[n_in:]}->{out}", xa, lora_b)
        return jnp.einsum(spec, x, w["w"]) + scale * delta

    return mm
