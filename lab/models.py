"""The model file a config.json names, chosen once here, as the runs call it: qwen3.py runs Qwen3
and Llama, qwen3_5.py Qwen3.5 (with lab/chunked.py's delta rule). Both have the same forward
contract and an init_kv; their layer weights come in stacks, one a kind of layer, each [L, ...] (L
its layers): qwen3's "layers", qwen3_5's "linear", "full". Beside the dispatch, each file's weights
as a checkpoint names them (its layout), in the shape letters of the file's own docstring."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp

import qwen3
import qwen3_5
from lab import chunked


def qwen3_5_forward(cfg, w, tokens, pos, kv=None, start=0, *, state_dtype=None, **numerics):
    """qwen3_5.forward as the runs call it: the delta rule in chunks (lab/chunked.py: mostly
    matmuls, with a memory-saving gradient), and a sampler's state_dtype (--state-dtype) the dtype
    its cache holds the recurrent state at, which each call (its prefill, a decoded token) rounds
    the state to at its end."""
    if state_dtype is not None:  # a sampler's numerics: it always passes a cache
        kv = dict(kv, state=kv["state"].astype(state_dtype))
    return qwen3_5.forward(cfg, w, tokens, pos, kv, start, rule=chunked.delta_rule, **numerics)


QWEN3_5 = SimpleNamespace(forward=qwen3_5_forward, init_kv=qwen3_5.init_kv)
FILES = dict(qwen3=qwen3, llama=qwen3, qwen3_5_text=QWEN3_5)  # config.json's model_type: its model
NAMES = dict(qwen3="Qwen3", llama="Llama", qwen3_5_text="Qwen3.5")
STACKS = ("layers", "linear", "full")  # the stacks' names in a weight tree
# each matmul weight's contracted (input) axes: [L, inputs..., outputs...] in a stack, [V, D] for
# the embedding and the untied head; o and out [L, heads, H, D]: the heads' outputs its input.
# W8A8 quantises a weight with one scale per output channel; LoRA's lora_a spans these axes
INPUT_AXES = dict(q=(1,), k=(1,), v=(1,), o=(1, 2), gate=(1,), up=(1,), down=(1,))
INPUT_AXES |= dict(embed=(1,), lm_head=(1,))
INPUT_AXES |= dict(qkv=(1,), z=(1,), b=(1,), a=(1,), out=(1, 2))  # Qwen3.5's linear attention


def model(cfg):  # what runs cfg: its model file's forward and init_kv
    return FILES[cfg["model_type"]]


def qwen3_layout(cfg):
    """The weights, {our name: (Hugging Face name, its shape, our shape)}: the top-level ones, and
    one layer's ("{}" in the name is the layer's index). A torch Linear is [out, in]; ours are
    [in, out], with the heads split out (q [D, N, H], o [N, H, D])."""
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    N, K, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    top = dict(
        embed=("model.embed_tokens.weight", (V, D), (V, D)),
        norm=("model.norm.weight", (D,), (D,)),
    )
    if not cfg.get("tie_word_embeddings"):
        top["lm_head"] = ("lm_head.weight", (V, D), (V, D))
    layers = dict(
        attn_norm=("input_layernorm", (D,), (D,)),
        q_norm=("self_attn.q_norm", (H,), (H,)),
        q=("self_attn.q_proj", (N * H, D), (D, N, H)),
        k=("self_attn.k_proj", (K * H, D), (D, K, H)),
        v=("self_attn.v_proj", (K * H, D), (D, K, H)),
        k_norm=("self_attn.k_norm", (H,), (H,)),
        o=("self_attn.o_proj", (D, N * H), (N, H, D)),
        mlp_norm=("post_attention_layernorm", (D,), (D,)),
        gate=("mlp.gate_proj", (F, D), (D, F)),
        up=("mlp.up_proj", (F, D), (D, F)),
        down=("mlp.down_proj", (D, F), (F, D)),
    )
    if cfg["model_type"] == "llama":  # no QK-norm
        del layers["q_norm"], layers["k_norm"]
    return top, {
        ours: ("model.layers.{}." + hf + ".weight", *s) for ours, (hf, *s) in layers.items()
    }


def qwen3_5_layout(cfg):
    """Qwen3.5's weights, {our name: (Hugging Face name, its shape, our shape)}: the top-level ones,
    and per stack (its layers' indices, one layer's weights, "{}" the index in a name). A torch
    Linear [out, in] is ours [in, out], heads split out; the conv's [C, 1, kernel] is ours [kernel,
    C]."""
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    N, K, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    J, E = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    U, Y = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    C, kernel = 2 * J * E + U * Y, cfg["linear_conv_kernel_dim"]
    top = dict(
        embed=("model.embed_tokens.weight", (V, D), (V, D)),
        norm=("model.norm.weight", (D,), (D,)),
    )
    if not cfg.get("tie_word_embeddings"):
        top["lm_head"] = ("lm_head.weight", (V, D), (V, D))
    linear = dict(
        qkv=("linear_attn.in_proj_qkv.weight", (C, D), (D, C)),  # q, k, v: J·E, J·E, U·Y
        conv=("linear_attn.conv1d.weight", (C, 1, kernel), (kernel, C)),
        z=("linear_attn.in_proj_z.weight", (U * Y, D), (D, U, Y)),
        b=("linear_attn.in_proj_b.weight", (U, D), (D, U)),
        a=("linear_attn.in_proj_a.weight", (U, D), (D, U)),
        A_log=("linear_attn.A_log", (U,), (U,)),
        dt_bias=("linear_attn.dt_bias", (U,), (U,)),
        norm=("linear_attn.norm.weight", (Y,), (Y,)),
        out=("linear_attn.out_proj.weight", (D, U * Y), (U, Y, D)),
    )
    full = dict(
        q=("self_attn.q_proj.weight", (N * 2 * H, D), (D, N, 2 * H)),  # a head's query, its gate
        q_norm=("self_attn.q_norm.weight", (H,), (H,)),
        k=("self_attn.k_proj.weight", (K * H, D), (D, K, H)),
        k_norm=("self_attn.k_norm.weight", (H,), (H,)),
        v=("self_attn.v_proj.weight", (K * H, D), (D, K, H)),
        o=("self_attn.o_proj.weight", (D, N * H), (N, H, D)),
    )
    both = dict(
        attn_norm=("input_layernorm.weight", (D,), (D,)),
        mlp_norm=("post_attention_layernorm.weight", (D,), (D,)),
        gate=("mlp.gate_proj.weight", (F, D), (D, F)),
        up=("mlp.up_proj.weight", (F, D), (D, F)),
        down=("mlp.down_proj.weight", (D, F), (F, D)),
    )
    stacks = {}
    for name, mixer in (("linear", linear), ("full", full)):
        ids = [i for i, t in enumerate(cfg["layer_types"]) if t == f"{name}_attention"]
        layer = {k: ("model.layers.{}." + hf, *s) for k, (hf, *s) in (mixer | both).items()}
        stacks[name] = ids, layer
    return top, stacks


def layout(cfg):
    """The weights as qwen3_5_layout gives them: the top-level ones, and per stack (its layers'
    indices, one layer's weights); qwen3.py's every layer in one stack, "layers"."""
    if model(cfg) is QWEN3_5:
        return qwen3_5_layout(cfg)
    top, layers = qwen3_layout(cfg)
    return top, {"layers": (range(cfg["num_hidden_layers"]), layers)}


def shapes(cfg, dtype=jnp.float32):  # the weight tree's shapes, as the checkpoint's load gives it
    top, stacks = layout(cfg)
    w = {k: jax.ShapeDtypeStruct(s, dtype) for k, (_, _, s) in top.items()}
    for name, (ids, layer) in stacks.items():
        w[name] = {k: jax.ShapeDtypeStruct((len(ids), *s), dtype) for k, (_, _, s) in layer.items()}
    return w
