"""Plain helpers shared by several files in tests/, imported by name (pytest puts tests/ on
sys.path): a tiny random Qwen3 checkpoint in the Hugging Face layout, written without our code; a
tiny GSM8K folder and the flags of a seconds-long run on it; prompts for the sampler; a spy on the
loss a train step traces; metrics rows without their times; strict JSON."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import train
from lab import rollouts


# ---- a tiny random Qwen3 checkpoint in the Hugging Face layout, written without our code
def gpt2_bytes_to_unicode():  # GPT-2's byte -> printable character table
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in bs]
    return dict(zip(bs + others, map(chr, bs + [256 + i for i in range(len(others))]), strict=True))


TINY_MERGES = [
    "Ġ t",
    "h e",
    "Ġt he",
    "i n",
    "Ġ a",
    "e r",
    "Ġ s",
    "o n",
    "r e",
    "a n",
    "Ċ Ċ",
    "Ġ Ġ",
    "ĠĠ ĠĠ",
    "Ġ 1",
    "1 2",
    "Ġa n",
    "Ġan d",
    "Ġ w",
    "o r",
]


TINY_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def write_safetensors(file, tensors):  # {name: numpy array} -> safetensors file, bf16 stays bf16
    names = {np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float32): "F32"}
    header, offset = {}, 0
    for name, a in tensors.items():
        header[name] = dict(
            dtype=names[a.dtype], shape=a.shape, data_offsets=[offset, offset + a.nbytes]
        )
        offset += a.nbytes
    h = json.dumps(header).encode()
    with open(file, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())


# ChatML, and with thinking off an empty think block, as Qwen3's template writes them
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


# write_tiny_checkpoint's overrides for a tiny Llama: the same shapes, no QK-norm
LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], use_sliding_window=None)


def write_tiny_checkpoint(path, tie=True, shards=1, seed=0, **overrides):
    """Write a tiny random Qwen3 checkpoint, Hugging Face layout, to directory `path`; return it.

    Files: config.json (hidden 32, 4 query heads, 2 kv heads, head_dim 16 != 32/4, 2 layers, mlp 64,
    vocab 300), generation_config.json (eos [277, 275]), bfloat16 safetensors (one file, or `shards`
    files and model.safetensors.index.json), and a byte-level BPE tokenizer: vocab.json (the 256
    byte characters, then 19 merges), merges.txt, tokenizer_config.json (added tokens <|endoftext|>,
    <|im_start|>, <|im_end|>, <think>, </think> = ids 275..279).
    tie: tied embeddings (no lm_head.weight). seed: the weights' random seed. overrides: config.json
    keys to set (None deletes the key), e.g. num_hidden_layers=1, or model_type="llama" (no q_norm
    and k_norm weights); the tensors follow the config. tokenizer_config.json holds a chat template.
    """
    os.makedirs(path, exist_ok=True)
    chars = gpt2_bytes_to_unicode()
    vocab = {chars[b]: i for i, b in enumerate(chars)}
    for m in TINY_MERGES:
        vocab[m.replace(" ", "")] = len(vocab)
    special = {t: len(vocab) + i for i, t in enumerate(TINY_SPECIAL)}
    cfg = dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|im_end|>"],
        torch_dtype="bfloat16",
    )
    cfg.update(overrides)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    D, F, V, L = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
        cfg["num_hidden_layers"],
    )
    N, K, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not tie:
        shapes["lm_head.weight"] = (V, D)
    for i in range(L):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (D,),
            p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (N * H, D),
            p + "self_attn.k_proj.weight": (K * H, D),
            p + "self_attn.v_proj.weight": (K * H, D),
            p + "self_attn.o_proj.weight": (D, N * H),
            p + "self_attn.q_norm.weight": (H,),
            p + "self_attn.k_norm.weight": (H,),
            p + "mlp.gate_proj.weight": (F, D),
            p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F),
        }
        if cfg["model_type"] == "llama":  # no QK-norm
            del shapes[p + "self_attn.q_norm.weight"], shapes[p + "self_attn.k_norm.weight"]
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            a = 1 + 0.2 * rng.standard_normal(shape)  # norm weights
        else:  # embeddings O(1), projections scaled by fan-in
            scale = 0.5 if name.startswith(("model.embed", "lm_head")) else shape[1] ** -0.5
            a = scale * rng.standard_normal(shape)
        tensors[name] = a.astype(ml_dtypes.bfloat16)
    if shards == 1:
        write_safetensors(f"{path}/model.safetensors", tensors)
    else:
        files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        weight_map = {name: files[i % shards] for i, name in enumerate(tensors)}
        for f in files:
            write_safetensors(
                f"{path}/{f}", {n: a for n, a in tensors.items() if weight_map[n] == f}
            )
        json.dump(
            {
                "metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
                "weight_map": weight_map,
            },
            open(f"{path}/model.safetensors.index.json", "w"),
        )
    json.dump(cfg, open(f"{path}/config.json", "w"), indent=2)
    json.dump(
        {
            "eos_token_id": [special["<|im_end|>"], special["<|endoftext|>"]],
            "pad_token_id": special["<|endoftext|>"],
            "bos_token_id": special["<|endoftext|>"],
        },
        open(f"{path}/generation_config.json", "w"),
    )
    json.dump(vocab, open(f"{path}/vocab.json", "w", encoding="utf-8"), ensure_ascii=False)
    open(f"{path}/merges.txt", "w", encoding="utf-8").write(
        "#version: 0.2\n" + "\n".join(TINY_MERGES) + "\n"
    )
    added = {
        str(i): dict(
            content=t,
            lstrip=False,
            normalized=False,
            rstrip=False,
            single_word=False,
            special=not t.endswith("think>"),
        )
        for t, i in special.items()
    }
    json.dump(
        {
            "added_tokens_decoder": added,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "bos_token": None,
            "unk_token": None,
            "add_prefix_space": False,
            "errors": "replace",
            "clean_up_tokenization_spaces": False,
            "model_max_length": 512,
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "chat_template": TINY_CHAT_TEMPLATE,
        },
        open(f"{path}/tokenizer_config.json", "w"),
        indent=2,
    )
    return path


# ---- positions and prompts
def arange_pos(B, T):
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def _prompts(tok, B, seed=0):  # B token lists of different lengths
    rng = np.random.default_rng(seed)
    return rollouts.left_pad(
        [list(rng.integers(0, 256, size=int(n))) for n in rng.integers(3, 12, size=B)],
        tok.pad_id,
        multiple=4,
    )


# 25 of the 300 ids end a completion, so completions stop at different steps
STOP = tuple(range(0, 300, 12))


# ---- runs: a tiny GSM8K folder, the flags of a run on it, what its files hold
def write_gsm8k(data, n_train=6, n_test=3):
    os.makedirs(data, exist_ok=True)
    for split, n in (("train", n_train), ("test", n_test)):
        with open(os.path.join(data, f"{split}.jsonl"), "w") as f:
            f.writelines(
                json.dumps(
                    {
                        "question": f"What is {i} + {i}?",
                        "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}",
                    }
                )
                + "\n"
                for i in range(n)
            )
    return str(data)


def tiny_argv(gsm, *extra):  # a GSM8K run of the tiny checkpoint: seconds on a CPU
    return [
        "--model",
        gsm[0],
        "--data-dir",
        gsm[1],
        "--steps",
        "2",
        "--prompts",
        "2",
        "--group",
        "4",
        "--max-tokens",
        "8",
        "--eval-every",
        "1",
        "--probe-n",
        "3",
        *extra,
    ]


def spy_loss(monkeypatch, key="center"):  # kw[key] of every sc.loss call a train step traces
    seen, real = [], train.sc.loss

    def spy(*a, **kw):
        if isinstance(a[0], jax.core.Tracer):  # not --correction's check of its text, on one token
            seen.append(kw[key])
        return real(*a, **kw)

    monkeypatch.setattr(train.sc, "loss", spy)
    return seen


def _strip(rows):  # metrics rows without their wall-clock times
    return [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]


def _strict_json(text):  # json.loads that refuses NaN and ±inf, as strict parsers do
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


# ---- a tiny random Qwen3.5 checkpoint in the Hugging Face layout, written without our code
QWEN3_5_LAYERS = ["full_attention", "linear_attention", "linear_attention", "full_attention"]


def write_tiny_qwen3_5(path, tie=False, vl=False, seed=0, **overrides):
    """Write a tiny random Qwen3.5 checkpoint to directory `path`; return it. The tokenizer and
    generation files are write_tiny_checkpoint's. config.json: Qwen3_5ForCausalLM's (vl: the
    vision-language wrapper's, the text model's config in text_config and its tensors under
    model.language_model., beside a vision tensor and an MTP tensor), hidden 32, mlp 64, vocab
    300; full attention: 4 query heads, 2 kv heads, head_dim 16, RoPE on a quarter of it; linear
    attention: 2 key heads of 8, 4 value heads of 12, conv kernel 4; layer_types QWEN3_5_LAYERS
    (full attention first: no full_attention_interval gives it). Every weight is random, the norm
    weights, A_log, dt_bias and the conv included; bfloat16. A token's query is near its own key
    (their projections and conv taps differ by 0.3 of random): with independent q and k, q·k ~ 0
    makes the delta rule's output at some tokens a near-cancellation that the gated RMSNorm scales
    up to unit size, and float32 rounding moves logits by ~5e-4. overrides: text config keys."""
    write_tiny_checkpoint(path, tie=tie, seed=seed)
    special = json.load(open(f"{path}/config.json"))
    cfg = dict(
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        layer_types=QWEN3_5_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_num_value_heads=4,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=4,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        attention_bias=False,
        bos_token_id=special["bos_token_id"],
        eos_token_id=special["eos_token_id"],
    )
    cfg.update(overrides)
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    N, K, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    J, E = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    U, Y = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    C = 2 * J * E + U * Y
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not tie:
        shapes["lm_head.weight"] = (V, D)
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (D,),
            p + "post_attention_layernorm.weight": (D,),
            p + "mlp.gate_proj.weight": (F, D),
            p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F),
        }
        if kind == "full_attention":  # q_proj: each head's query, then its output gate
            shapes |= {
                p + "self_attn.q_proj.weight": (N * 2 * H, D),
                p + "self_attn.k_proj.weight": (K * H, D),
                p + "self_attn.v_proj.weight": (K * H, D),
                p + "self_attn.o_proj.weight": (D, N * H),
                p + "self_attn.q_norm.weight": (H,),
                p + "self_attn.k_norm.weight": (H,),
            }
        else:  # in_proj_qkv: q (J·E), k (J·E), v (U·Y), the channels of the depthwise conv
            shapes |= {
                p + "linear_attn.in_proj_qkv.weight": (C, D),
                p + "linear_attn.in_proj_z.weight": (U * Y, D),
                p + "linear_attn.in_proj_b.weight": (U, D),
                p + "linear_attn.in_proj_a.weight": (U, D),
                p + "linear_attn.conv1d.weight": (C, 1, cfg["linear_conv_kernel_dim"]),
                p + "linear_attn.A_log": (U,),
                p + "linear_attn.dt_bias": (U,),
                p + "linear_attn.norm.weight": (Y,),
                p + "linear_attn.out_proj.weight": (D, U * Y),
            }
    rng = np.random.default_rng(seed)
    tensors = {name: random_qwen3_5_tensor(name, shape, rng) for name, shape in shapes.items()}
    for name, a in tensors.items():
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # q near k: see above
            a[: J * E] = a[J * E : 2 * J * E] + 0.3 * a[: J * E]
    if vl:  # the text model under model.language_model., and tensors the text model never reads
        tensors = {n.replace("model.", "model.language_model.", 1): a for n, a in tensors.items()}
        tensors["model.visual.blocks.0.norm1.weight"] = np.ones(16, ml_dtypes.bfloat16)
        tensors["mtp.fc.weight"] = np.ones((D, 2 * D), ml_dtypes.bfloat16)
        vision = dict(
            model_type="qwen3_5_vision",
            depth=1,
            hidden_size=16,
            num_heads=2,
            intermediate_size=32,
            patch_size=4,
            out_hidden_size=D,
            num_position_embeddings=16,
        )
        cfg = dict(
            architectures=["Qwen3_5ForConditionalGeneration"],
            model_type="qwen3_5",
            text_config={k: v for k, v in cfg.items() if k != "architectures"},
            vision_config=vision,
            tie_word_embeddings=tie,
        )
    write_safetensors(f"{path}/model.safetensors", tensors)
    json.dump(cfg, open(f"{path}/config.json", "w"), indent=2)
    return path


def random_qwen3_5_tensor(name, shape, rng):  # bfloat16, about the size a trained model's has
    if name.endswith("A_log"):  # decay rates exp(A_log) from 0.1 to 4
        a = np.log(rng.uniform(0.1, 4, shape))
    elif name.endswith(("dt_bias", "linear_attn.norm.weight")):  # about 1
        a = 1 + 0.3 * rng.standard_normal(shape)
    elif len(shape) == 1:  # the other norms multiply by 1 + weight: about 0
        a = 0.3 * rng.standard_normal(shape)
    elif name.endswith("conv1d.weight"):
        a = 0.5 * rng.standard_normal(shape)
    else:  # embeddings O(1), projections scaled by fan-in
        scale = 0.5 if name.startswith(("model.embed", "lm_head")) else shape[1] ** -0.5
        a = scale * rng.standard_normal(shape)
    return a.astype(ml_dtypes.bfloat16)
