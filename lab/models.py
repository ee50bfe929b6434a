"""The model file a config.json names, chosen once here: qwen3.py runs Qwen3 and Llama, qwen3_5.py
Qwen3.5. Both have the same forward contract and an init_kv; their layer weights come in stacks,
one a kind of layer, each [L, ...] (L its layers): qwen3's "layers", qwen3_5's "linear", "full"."""

import jax
import jax.numpy as jnp

import qwen3
import qwen3_5

FILES = dict(qwen3=qwen3, llama=qwen3, qwen3_5_text=qwen3_5)  # config.json's model_type: its file
NAMES = dict(qwen3="Qwen3", llama="Llama", qwen3_5_text="Qwen3.5")
STACKS = ("layers", "linear", "full")  # the stacks' names in a weight tree
# each matmul weight's contracted (input) axes: [L, inputs..., outputs...] in a stack, [V, D] for
# the embedding and the untied head; o and out [L, heads, H, D]: the heads' outputs its input.
# W8A8 quantises a weight with one scale per output channel; LoRA's lora_a spans these axes
INPUT_AXES = dict(q=(1,), k=(1,), v=(1,), o=(1, 2), gate=(1,), up=(1,), down=(1,))
INPUT_AXES |= dict(embed=(1,), lm_head=(1,))
INPUT_AXES |= dict(qkv=(1,), z=(1,), b=(1,), a=(1,), out=(1, 2))  # Qwen3.5's linear attention


def model(cfg):  # the model file that runs cfg: its forward, init_kv and layout
    return FILES[cfg["model_type"]]


def layout(cfg):
    """The weights as qwen3_5.layout gives them: the top-level ones, and per stack (its layers'
    indices, one layer's weights); qwen3.py's every layer in one stack, "layers"."""
    if model(cfg) is qwen3_5:
        return qwen3_5.layout(cfg)
    top, layers = qwen3.layout(cfg)
    return top, {"layers": (range(cfg["num_hidden_layers"]), layers)}


def shapes(cfg, dtype=jnp.float32):  # the weight tree's shapes, as the checkpoint's load gives it
    top, stacks = layout(cfg)
    w = {k: jax.ShapeDtypeStruct(s, dtype) for k, (_, _, s) in top.items()}
    for name, (ids, layer) in stacks.items():
        w[name] = {k: jax.ShapeDtypeStruct((len(ids), *s), dtype) for k, (_, _, s) in layer.items()}
    return w
