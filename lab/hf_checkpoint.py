"""Hugging Face checkpoints for qwen3.py (Qwen3, Llama) and qwen3_5.py (Qwen3.5): config.json
checks, safetensors read with numpy (one file or sharded) and written, the hub fetch; the tokenizer
is lab/tokenizer.py. L layers (a layer weight is stacked along a leading L axis), V vocab."""

import collections
import importlib.util
import json
import math
import os
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from lab.models import layout, shapes
from lab.tokenizer import load_tokenizer, read_json

Model = collections.namedtuple("Model", "cfg weights tokenizer path")  # tokenizer: None if no files
DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}  # the ones we read
SAVED_BY = {"format": "pt", "saved_by": "score-centering"}  # save()'s mark, in __metadata__


# ---- config.json and safetensors headers
def read_header(file):
    """A safetensors file's tensors, {name: (file, dtype, shape, first byte, end byte, file size)},
    and its __metadata__. The file: 8 bytes of header length n, n bytes of JSON, the tensors."""
    with open(file, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        size = os.fstat(fh.fileno()).st_size
        raw = fh.read(n) if 8 + n <= size else b""
    try:
        header = json.loads(raw)
        tensors = {}
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]  # counted from the end of the header
                shape = tuple(entry["shape"])
                tensors[name] = (file, entry["dtype"], shape, 8 + n + start, 8 + n + end, size)
        return tensors, header.get("__metadata__")
    except (ValueError, TypeError, LookupError, AttributeError):
        raise ValueError(
            f"{file}: truncated, or its {n}-byte header is not safetensors JSON"
        ) from None


UNSUPPORTED = [
    "num_experts",
    "num_local_experts",
    "moe_intermediate_size",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
]
REQUIRED = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
]


def check_config(cfg, file):
    """cfg, checked: dense Qwen3, Llama or Qwen3.5, no biases, plain RoPE (recent transformers put
    rope_theta and its type in rope_parameters, older ones the type in rope_scaling); a Llama
    config without head_dim gets D / N, as transformers reads it; Qwen3.5's as qwen3_5_config's."""
    if cfg.get("model_type") == "llama" and "head_dim" not in cfg and "hidden_size" in cfg:
        cfg = dict(cfg, head_dim=cfg["hidden_size"] // cfg.get("num_attention_heads", 1))
    if cfg.get("model_type") in ("qwen3_5", "qwen3_5_text"):
        cfg = qwen3_5_config(cfg)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    c = {**rope, **cfg, "rope_type": rope.get("rope_type", rope.get("type", "default"))}
    errors = [f"{k} = {c[k]!r}" for k in UNSUPPORTED if c.get(k)]
    if c.get("model_type") not in ("qwen3", "llama", "qwen3_5_text"):
        errors.append(f"model_type = {c.get('model_type')!r}")
    if c["rope_type"] != "default":  # Llama 3.1 and 3.2's 'llama3' among them
        errors.append(f"rope_type = {c['rope_type']!r}: RoPE scaling is not implemented")
    if c.get("hidden_act", "silu") != "silu":
        errors.append(f"hidden_act = {c['hidden_act']!r}")
    errors += [f"{k} is missing" for k in REQUIRED if k not in c]
    if c.get("model_type") == "qwen3_5_text" and not errors:
        errors += qwen3_5_problems(c)
    if errors:
        raise ValueError(
            f"{file}: {'; '.join(errors)}: only dense Qwen3 and Llama checkpoints (model_type "
            "'qwen3' or 'llama') without biases or RoPE scaling are supported, and dense Qwen3.5 "
            "('qwen3_5') with gated attention"
        )
    return cfg


def qwen3_5_config(cfg):
    """Qwen3.5's as Qwen3_5ForCausalLM's (the vision-language wrapper's: its text_config), with
    transformers' defaults: layer_types; rope_theta, partial_rotary_factor in rope_parameters"""
    if "text_config" in cfg:  # tied or not as the wrapper says, as transformers reads it
        tie = cfg.get("tie_word_embeddings", False)
        cfg = dict(cfg["text_config"], model_type="qwen3_5_text", tie_word_embeddings=tie)
    L, every = cfg.get("num_hidden_layers", 0), cfg.get("full_attention_interval", 4)
    types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(L)]
    rope = {"partial_rotary_factor": 0.25}
    rope |= {k: cfg[k] for k in ("rope_theta", "partial_rotary_factor") if k in cfg}
    rope |= cfg.get("rope_parameters") or {}  # rope_parameters' own first, as transformers reads
    cfg = dict(cfg, architectures=["Qwen3_5ForCausalLM"], rope_parameters=rope)
    return dict(cfg, layer_types=cfg.get("layer_types") or types)


def qwen3_5_problems(c):  # in words; mrope_* pass: text's 3 position rows are equal, M-RoPE is RoPE
    try:
        layout(c)  # the sizes it reads: the linear attention's
    except KeyError as e:
        return [f"{e.args[0]} is missing"]
    problems, kinds = [], sorted(set(c["layer_types"]))
    if kinds != ["full_attention", "linear_attention"]:  # both, and nothing else
        problems.append(f"layer_types holds {', '.join(kinds)}")
    if c.get("attn_output_gate", True) is not True:
        problems.append(f"attn_output_gate = {c['attn_output_gate']!r}")
    if c["linear_num_value_heads"] % c["linear_num_key_heads"]:
        problems.append("linear_num_value_heads is not a multiple of linear_num_key_heads")
    return problems


def fetch(repo, files):
    """Downloads files of a repo from the hub into its cache; returns the snapshot's directory."""
    try:
        hub = importlib.import_module("huggingface_hub")  # optional: only a repo id needs it
        return hub.snapshot_download(repo, allow_patterns=files)
    except Exception as e:  # offline, no such repo, gated...: many types, we raise one
        raise ValueError(
            f"{repo} could not be downloaded from the Hugging Face hub ({e!r:.150}): pass a "
            "local checkpoint directory with --model"
        ) from None


def config(path, files=("config.json",)):
    """(config.json, the checkpoint's local directory). path: a local directory, or a repo id
    owner/name on the hub: its config.json is fetched and checked first, then `files`."""
    path = str(path)
    if not os.path.isdir(path):
        repo_id = re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", path) and not os.path.exists(path)
        if not repo_id or importlib.util.find_spec("huggingface_hub") is None:
            raise FileNotFoundError(
                f"{path} is not a directory: pass a checkpoint directory, or a repo id "
                "owner/name (this needs pip install huggingface_hub)"
            )
        fetched = fetch(path, ["config.json"])
        check_config(read_json(f"{fetched}/config.json"), f"{path}/config.json")
        path = fetch(path, list(files))
    return check_config(read_json(f"{path}/config.json"), f"{path}/config.json"), path


# ---- loading: every header is checked before any tensor is read
def tensor_problem(name, shape, entry):  # what is wrong with a tensor's header entry, or ""
    if entry is None:
        return f"tensor {name} is missing"
    _, dtype, file_shape, start, end, size = entry
    if file_shape != shape:
        return f"{name} is {file_shape}, config.json implies {shape}"
    if dtype not in DTYPES:
        return f"{name} has dtype {dtype}, not one of {', '.join(DTYPES)}"
    need = math.prod(file_shape) * np.dtype(DTYPES[dtype]).itemsize
    if end - start != need:
        return (
            f"{name} has data_offsets for {end - start} bytes, {file_shape} in {dtype} takes {need}"
        )
    if end > size:
        return f"{name} ends at byte {end}, the file has {size}: it is truncated"
    return ""


def view(file, dtype, shape, start, *_):  # a tensor in its file, read only where it is sliced
    return np.memmap(file, DTYPES[dtype], "r", start, shape)


def read_headers(path, expected):  # {name: header entry}, checked, of the expected {name: shape}
    index, single = f"{path}/model.safetensors.index.json", f"{path}/model.safetensors"
    sharded = os.path.exists(index)
    if sharded and os.path.exists(single):
        raise ValueError(f"{path} holds both model.safetensors and {index}: remove the stale one")
    if sharded:
        files = sorted({f"{path}/{f}" for f in read_json(index)["weight_map"].values()})
    else:
        files = [single]
    header = {}
    for file in files:
        # Qwen3.5's vision-language wrapper holds the text model as model.language_model.*, read
        # as model.*; its vision tower (model.visual.*) and MTP head (mtp.*) are not read
        tensors = read_header(file)[0].items()
        names = {re.sub(r"^model\.language_model\.", "model.", k): v for k, v in tensors}
        header |= {k: entry for k, entry in names.items() if k in expected}
    for name, shape in expected.items():
        problem = tensor_problem(name, shape, header.get(name))
        if problem:
            file = header[name][0] if name in header else (index if sharded else single)
            raise ValueError(f"{file}: {problem}")
    return header


def load(path, dtype=jnp.float32, place=None):
    """A checkpoint: a local directory, or a repo id such as Qwen/Qwen3-0.6B. Each tensor is mapped
    from its file straight to its devices: place(shapes) gives their shardings (default: one)."""
    cfg, path = config(path, ["*.json", "*.safetensors", "merges.txt"])
    top, stacks = layout(cfg)
    expected = {hf: shape for hf, shape, _ in top.values()}
    for ids, layers in stacks.values():
        expected |= {hf.format(i): shape for hf, shape, _ in layers.values() for i in ids}
    header = read_headers(path, expected)
    src = {k: view(*header[hf]) for k, (hf, _, _) in top.items()}
    for name, (ids, layers) in stacks.items():
        src[name] = {  # [out, in] -> [in, out], one view per layer
            k: [view(*header[hf.format(i)]).T.reshape(s) for i in ids]
            for k, (hf, _, s) in layers.items()
        }

    def read(x, slices):  # a block of one tensor, in dtype; of a layer weight: from its L views
        if isinstance(x, list):
            return np.stack([m[slices[1:]] for m in x[slices[0]]]).astype(dtype)
        return x[slices].astype(dtype)

    def array(shape, sharding, x):
        if place:
            return jax.make_array_from_callback(shape.shape, sharding, lambda i: read(x, i))
        return jnp.asarray(read(x, (slice(None),) * len(shape.shape)))  # uncommitted

    abstract = shapes(cfg, dtype)
    weights = jax.tree.map(array, abstract, place(abstract) if place else abstract, src)
    return Model(cfg, weights, load_tokenizer(path, cfg), path)


# ---- saving: only into a folder that holds no checkpoint but save()'s own
def check_save_dir(out_dir):
    """Refuses a file, an unwritable folder or a checkpoint save() did not write; makes nothing."""
    folder = Path(out_dir).absolute()
    up = next(p for p in (folder, *folder.parents) if p.exists())  # out_dir or where it goes
    if not up.is_dir() or not os.access(up, os.W_OK | os.X_OK):
        raise ValueError(f"{out_dir}: {up} is not a writable directory")
    names = [f.name for f in folder.glob("*")]
    held = sorted(f for f in names if f == "config.json" or ".safetensors" in f)
    ours = held in (["model.safetensors"], ["config.json", "model.safetensors"])
    if held and not (ours and read_header(folder / "model.safetensors")[1] == SAVED_BY):
        raise ValueError(
            f"{out_dir} holds a checkpoint that save() did not write: {', '.join(held)}"
        )


def safetensors(arrays, dtype, metadata):  # {name: array} -> a file's bytes, each in dtype
    header, data = {"__metadata__": metadata}, bytearray()
    for name, a in arrays.items():
        a = np.asarray(a, DTYPES[dtype])
        header[name] = dict(
            dtype=dtype, shape=a.shape, data_offsets=[len(data), len(data) + a.nbytes]
        )
        data += a.tobytes()
    head = json.dumps(header).encode()
    return len(head).to_bytes(8, "little") + head + data


def write_whole(file, data):  # written beside it, then renamed: a crash leaves the old file whole
    partial = Path(file.parent, "save.partial")
    partial.write_bytes(data)
    os.replace(partial, file)


def save(out_dir, cfg, weights, tokenizer_dir=None):
    """Writes config.json and model.safetensors (bf16, Hugging Face names and layout) to out_dir,
    then tokenizer_dir's .json and .txt files but config.json and model.safetensors.index.json."""
    check_save_dir(out_dir)
    top, stacks = layout(cfg)
    arrays = {hf: weights[k] for k, (hf, _, _) in top.items()}
    for name, (ids, layers) in stacks.items():
        for k, (hf, hf_shape, _) in layers.items():
            for j, i in enumerate(ids):  # [in, out] -> [out, in]
                arrays[hf.format(i)] = weights[name][k][j].reshape(hf_shape[::-1]).T
    os.makedirs(out_dir, exist_ok=True)
    # model.safetensors first: alone, it still marks the folder as ours
    write_whole(Path(out_dir, "model.safetensors"), safetensors(arrays, "BF16", SAVED_BY))
    write_whole(Path(out_dir, "config.json"), json.dumps(cfg, indent=2).encode())
    for f in os.listdir(tokenizer_dir) if tokenizer_dir else []:
        checkpoint_file = f in ("config.json", "model.safetensors.index.json")
        if f.endswith((".json", ".txt")) and not checkpoint_file:
            shutil.copy(os.path.join(tokenizer_dir, f), out_dir)
