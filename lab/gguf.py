"""python -m lab.gguf FILE.gguf OUT_DIR: a GGUF file (llama.cpp's format) as a Hugging Face
checkpoint folder, which train.py's --model takes and transformers loads: config.json,
model.safetensors (float32, each tensor dequantised by the gguf package) and the tokenizer
(tokenizer.json, and tokenizer_config.json with the file's own chat template). Dense Llama files
only (SmolLM2, the Llama 3 shapes), whose tokenizer.ggml.pre is one of PRE_TOKENIZERS. Everything
is checked and converted in memory before OUT_DIR is made. D model width, N query heads, K
key/value heads, H head dimension, V vocab."""

import argparse
import importlib
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

from lab import hf_checkpoint

LAYER = dict(  # a layer's tensors: GGUF's names, Hugging Face's
    attn_norm="input_layernorm",
    attn_q="self_attn.q_proj",
    attn_k="self_attn.k_proj",
    attn_v="self_attn.v_proj",
    attn_output="self_attn.o_proj",
    ffn_norm="post_attention_layernorm",
    ffn_gate="mlp.gate_proj",
    ffn_up="mlp.up_proj",
    ffn_down="mlp.down_proj",
)
TOP = dict(token_embd="model.embed_tokens", output_norm="model.norm", output="lm_head")
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type of special and added tokens
# tokenizer.ggml.pre (absent: "default") -> the split regex written, as transformers' GGUF loader
# reads the field: None is ByteLevel's own, GPT-2's (llama.cpp isolates each \p{N} first for
# "smollm", which changes nothing: no SmolLM2 token joins one to another character); Llama 3's
# cuts digit runs into 1-3
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    "default": None,
    "gpt-2": None,
    "smollm": None,
    "llama-bpe": LLAMA3_PATTERN,
    "llama3": LLAMA3_PATTERN,
    "llama-v3": LLAMA3_PATTERN,
}


def hf_name(name):  # "blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight"
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if layer and layer[2] in LAYER:
        return f"model.layers.{layer[1]}.{LAYER[layer[2]]}.weight"
    top = re.fullmatch(r"(\w+)\.weight", name)
    if top and top[1] in TOP:
        return f"{TOP[top[1]]}.weight"
    raise ValueError(f"tensor {name} is not one of a dense Llama's")


def unpermute(w, heads):
    """q or k [heads·H, D] from llama.cpp's row order back to Hugging Face's. llama.cpp rotates the
    pairs (2i, 2i + 1) of each head, rotate-half RoPE the pairs (i, i + H/2), so its converter
    stores row j·H/2 + i of a head as row 2i + j; this puts each row back."""
    rows, D = w.shape
    return w.reshape(heads, rows // heads // 2, 2, D).swapaxes(1, 2).reshape(rows, D)


def config(field, file):
    """config.json of a Llama, from the file's llama.* fields."""
    if field("general.architecture") != "llama":
        raise ValueError(f"{file}: architecture {field('general.architecture')!r}, not 'llama'")
    scaling = field("llama.rope.scaling.type", "none")
    if field("llama.expert_count", 0) or scaling != "none":
        raise ValueError(f"{file}: experts or RoPE scaling ({scaling}): not a dense plain Llama")
    D, N = field("llama.embedding_length"), field("llama.attention.head_count")
    return dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=len(field("tokenizer.ggml.tokens")),
        hidden_size=D,
        intermediate_size=field("llama.feed_forward_length"),
        num_hidden_layers=field("llama.block_count"),
        num_attention_heads=N,
        num_key_value_heads=field("llama.attention.head_count_kv", N),
        head_dim=field("llama.attention.key_length", D // N),
        hidden_act="silu",
        rms_norm_eps=field("llama.attention.layer_norm_rms_epsilon"),
        rope_theta=field("llama.rope.freq_base", 10000.0),
        max_position_embeddings=field("llama.context_length"),
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=field("tokenizer.ggml.bos_token_id", None),
        eos_token_id=field("tokenizer.ggml.eos_token_id"),
        pad_token_id=field("tokenizer.ggml.padding_token_id", None),
        torch_dtype="float32",
    )


def weights(reader, cfg, file):
    """{Hugging Face name: float32 array [out, in]}, dequantised; tied when there is no output."""
    quants = importlib.import_module("gguf.quants")
    arrays = {}
    for t in reader.tensors:
        try:
            a = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        except NotImplementedError:
            raise ValueError(
                f"{file}: tensor {t.name} is {t.tensor_type.name}: not readable"
            ) from None
        arrays[hf_name(t.name)] = a.reshape(tuple(int(n) for n in reversed(t.shape)))
    for i in range(cfg["num_hidden_layers"]):  # llama.cpp's RoPE row order, undone
        q, k = (f"model.layers.{i}.self_attn.{x}_proj.weight" for x in "qk")
        arrays[q] = unpermute(arrays[q], cfg["num_attention_heads"])
        arrays[k] = unpermute(arrays[k], cfg["num_key_value_heads"])
    cfg["tie_word_embeddings"] = "lm_head.weight" not in arrays
    return arrays


def tokenizer_files(field, file):
    """tokenizer.json (byte-level BPE: the file's tokens, merges, control and user-defined tokens;
    the split its tokenizer.ggml.pre names) and tokenizer_config.json (the special tokens by name,
    the chat template)."""
    if field("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"{file}: tokenizer {field('tokenizer.ggml.model')!r}, not byte-level BPE")
    pre = field("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{file}: pre-tokenizer {pre!r}, not one of {', '.join(PRE_TOKENIZERS)}")
    tokens, kinds = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    added = [
        dict(id=i, content=tokens[i], single_word=False, lstrip=False, rstrip=False)
        | dict(normalized=False, special=kinds[i] == CONTROL)
        for i in range(len(tokens))
        if kinds[i] in (CONTROL, USER_DEFINED)
    ]
    byte_level = dict(type="ByteLevel", add_prefix_space=False, trim_offsets=True, use_regex=True)
    pre_tokenizer, pattern = byte_level, PRE_TOKENIZERS[pre]
    if pattern:  # the file's split, then ByteLevel without GPT-2's
        split = dict(type="Split", pattern=dict(Regex=pattern), behavior="Isolated", invert=False)
        pieces = [split, byte_level | dict(use_regex=False)]
        pre_tokenizer = dict(type="Sequence", pretokenizers=pieces)
    model = dict(type="BPE", dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False)
    model |= dict(vocab={t: i for i, t in enumerate(tokens)})
    model |= dict(merges=[m.split(" ") for m in field("tokenizer.ggml.merges")])
    tokenizer_json = dict(version="1.0", added_tokens=added, normalizer=None)
    tokenizer_json |= dict(pre_tokenizer=pre_tokenizer, decoder=byte_level, model=model)

    def name(key):  # a special token's text, by its id field
        i = field(f"tokenizer.ggml.{key}_token_id", None)
        return None if i is None else tokens[i]

    tokenizer_config = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token=name("bos"),
        eos_token=name("eos"),
        pad_token=name("padding"),
        unk_token=name("unknown"),
        add_bos_token=bool(field("tokenizer.ggml.add_bos_token", False)),
        clean_up_tokenization_spaces=False,
        chat_template=field("tokenizer.chat_template", None),
    )
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": tokenizer_config}


def convert(file, out_dir):
    """Reads, checks and converts `file` whole, then writes out_dir, a new folder."""
    for folder in (out_dir, f"{out_dir}.partial"):
        if os.path.exists(folder):
            raise ValueError(f"{folder} exists: name a new folder, or remove it")
    if not os.path.isfile(file):
        raise ValueError(f"{file} is not a file: pass a .gguf file")
    try:
        reader = importlib.import_module("gguf").GGUFReader(file)
    except ModuleNotFoundError:
        raise ValueError("reading a GGUF file needs the gguf package: pip install gguf") from None
    except (ValueError, OSError) as e:  # not a GGUF file (its magic), or truncated
        raise ValueError(f"{file}: not a readable GGUF file ({e})") from None
    missing = object()

    def field(key, default=missing):
        if key not in reader.fields and default is missing:
            raise ValueError(f"{file}: no {key} field")
        return reader.fields[key].contents() if key in reader.fields else default

    cfg = config(field, file)
    files = tokenizer_files(field, file)  # a tokenizer refused before any dequantising
    arrays = weights(reader, cfg, file)
    files["config.json"] = cfg
    metadata = {"format": "pt", "converted_from": os.path.basename(file)}
    data = hf_checkpoint.safetensors(arrays, "F32", metadata)

    partial = Path(f"{out_dir}.partial")  # renamed when whole: a crash leaves no half folder
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(data)
    for name, content in files.items():
        (partial / name).write_text(json.dumps(content, indent=1, ensure_ascii=False))
    os.rename(partial, out_dir)


CPU_RUN = "--lora 32 --optimizer adamw --steps 4 --prompts 2 --eval-every 4 --eval-n 64"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="a .gguf file of a dense Llama (SmolLM2, the Llama 3 shapes)")
    p.add_argument("out_dir", help="the checkpoint folder to write: must not exist")
    args = p.parse_args(argv)
    try:
        convert(args.file, args.out_dir)
    except (ValueError, OSError) as e:  # OSError: out_dir's parent cannot be written
        sys.exit(f"error: {e}")
    print(f"wrote {args.out_dir}; a few minutes of GRPO on a CPU (docs/real_model.md):")
    print(f"python train.py --task arithmetic --model {args.out_dir} {CPU_RUN} --out runs/try")


if __name__ == "__main__":
    main()
