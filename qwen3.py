"""Qwen3 (dense) in pure JAX: a dict of weights, pure functions, and a loader for Hugging Face checkpoints.
B batch, T query length, S key (cache) length, D hidden, F mlp hidden, H head dim, N query heads, K kv heads,
V vocab, L layers (stacked along the leading axis of every layer weight and run with lax.scan)."""

import collections, importlib.util, json, math, os, re, unicodedata
from pathlib import Path
import jax, jax.numpy as jnp, ml_dtypes, numpy as np, tiktoken


def rms_norm(
    x, w, eps
):  # in float32, back to the compute dtype before the weight (as transformers does)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32.astype(x.dtype) * jnp.broadcast_to(w.astype(x.dtype), x.shape)


def rope(x, pos, theta):  # rotate-half RoPE at the real positions; x [B, T, N, H], pos [B, T]
    h = x.shape[-1] // 2
    angle = jnp.einsum("bt,h->bth", pos.astype(jnp.float32), 1 / theta ** (jnp.arange(h) / h))
    cos, sin = (f(angle)[:, :, None, :].astype(x.dtype) for f in (jnp.cos, jnp.sin))
    x1, x2 = x[..., :h], x[..., h:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def init_kv(cfg, B, S, dtype=jnp.float32):  # position -1 marks an empty slot
    shape = (cfg["num_hidden_layers"], B, S, cfg["num_key_value_heads"], cfg["head_dim"])
    return dict(
        k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), pos=jnp.full((B, S), -1, jnp.int32)
    )


def forward(
    cfg,
    w,
    tokens,
    pos,
    kv=None,
    t0=0,
    *,
    mm=jnp.einsum,
    dtype=jnp.float32,
    last=None,
    kv_quant=None,
):
    """Logits float32 [B, T, V] (or [B, last, V] for the last `last` positions) and the updated kv.
    tokens [B, T]; pos [B, T] their positions, < 0 for padding. A query at position p sees keys at 0..p.
    With kv, this call's keys, values and positions are written at [t0, t0 + T) (K and V as kv_quant(a) if
    given) and the queries attend over the whole cache. Each weight matmul is mm(spec, activation, weight)."""
    eps, H = cfg["rms_norm_eps"], cfg["head_dim"]
    theta = (
        cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    )  # hub / recent transformers
    kpos = (
        pos
        if kv is None
        else jax.lax.dynamic_update_slice(kv["pos"], pos.astype(jnp.int32), (0, t0))
    )
    mask = (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= pos[:, :, None])  # [B, T, S]
    x = w["embed"][tokens].astype(dtype)  # [B, T, D]

    @jax.checkpoint  # recompute the layer in the backward pass instead of storing its activations
    def layer(carry, xs):
        (x, kv), (lw, i) = carry, xs
        lw = jax.tree.map(lambda a: a.astype(dtype), lw)
        h = rms_norm(
            x, lw["attn_norm"], eps
        )  # attention: q, k get their own RMSNorm, before RoPE (QK-norm)
        q = rope(rms_norm(mm("btd,dnh->btnh", h, lw["q"]), lw["q_norm"], eps), pos, theta)
        k = rope(rms_norm(mm("btd,dkh->btkh", h, lw["k"]), lw["k_norm"], eps), pos, theta)
        v = mm("btd,dkh->btkh", h, lw["v"])
        if (
            kv is not None
        ):  # write this call's keys and values into layer i of the cache, attend over all
            k, v = (
                (kv_quant(k), kv_quant(v)) if kv_quant else (k, v)
            )  # as a quantised cache stores them
            write = lambda c, a: jax.lax.dynamic_update_slice(
                c, a[None].astype(c.dtype), (i, 0, t0, 0, 0)
            )
            kv = dict(
                kv, k=write(kv["k"], k), v=write(kv["v"], v)
            )  # in place: the cache is a scan carry
            k, v = kv["k"][i].astype(dtype), kv["v"][i].astype(dtype)
        q = q.reshape(
            *q.shape[:2], k.shape[2], -1, H
        )  # [B, T, K, G, H]: G query heads share a kv head
        s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * H**-0.5
        s = jnp.where(
            mask[:, None, None], s, -1e30
        )  # finite: a padding query sees no key, yet is not NaN
        o = jnp.einsum(
            "bkgts,bskh->btkgh", jax.nn.softmax(s, axis=-1).astype(dtype), v
        )  # [B, T, K, G, H]
        x = x + mm("btnh,nhd->btd", o.reshape(*o.shape[:2], -1, H), lw["o"])
        h = rms_norm(x, lw["mlp_norm"], eps)  # MLP
        h = jax.nn.silu(mm("btd,df->btf", h, lw["gate"])) * mm("btd,df->btf", h, lw["up"])
        return (x + mm("btf,fd->btd", h, lw["down"]), kv), None

    kv = None if kv is None else dict(kv, pos=kpos)
    (x, kv), _ = jax.lax.scan(layer, (x, kv), (w["layers"], jnp.arange(cfg["num_hidden_layers"])))
    x = rms_norm(x if last is None else x[:, -last:], w["norm"], eps)
    head = w["embed"] if cfg.get("tie_word_embeddings") else w["lm_head"]
    return mm("btd,vd->btv", x, head.astype(dtype)).astype(jnp.float32), kv


# ---- loading: config.json, safetensors read with numpy, tokenizer through tiktoken
Model = collections.namedtuple("Model", "cfg weights tokenizer path")  # tokenizer: None if no files
Tokenizer = collections.namedtuple("Tokenizer", "encode decode chat eos_ids pad_id")
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3, thinking off
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F16": np.float16,
    "F32": np.float32,
}  # safetensors dtypes we read
SAVED_BY = {
    "format": "pt",
    "saved_by": "score-centering",
}  # save()'s mark, in the safetensors __metadata__


def read_json(
    file, default=None
):  # default: what a missing file reads as (None: the file must exist)
    try:
        return (
            json.loads(Path(file).read_bytes())
            if default is None or os.path.exists(file)
            else default
        )
    except ValueError as e:  # truncated, hand-edited or not utf-8
        raise ValueError(f"{file}: not valid JSON ({e})") from None


def read_header(
    file,
):  # safetensors: 8 bytes of header length n, n bytes of json, then the tensors' bytes
    with open(file, "rb") as fh:
        n, size = int.from_bytes(fh.read(8), "little"), os.fstat(fh.fileno()).st_size
        span = lambda a, b: (
            8 + n + a,
            8 + n + b,
            size,
        )  # data_offsets count from the end of the header
        try:  # {name: (file, dtype, shape, first byte, end byte, file size)}, __metadata__
            h = json.loads(fh.read(n) if 8 + n <= size else b"")
            return {
                k: (file, v["dtype"], tuple(v["shape"]), *span(*v["data_offsets"]))
                for k, v in h.items()
                if k != "__metadata__"
            }, h.get("__metadata__")
        except (ValueError, TypeError, LookupError, AttributeError):
            raise ValueError(
                f"{file}: truncated, or its {n}-byte header is not safetensors JSON"
            ) from None


def check_config(
    cfg, file
):  # dense Qwen3 only; recent transformers put rope_theta in rope_parameters
    c = {"rope_type": "default", **(cfg.get("rope_parameters") or {}), **cfg}
    bad = [k for k, ok in (("model_type", "qwen3"), ("rope_type", "default")) if c.get(k) != ok]
    bad += [
        k
        for k in (
            "num_experts",
            "num_local_experts",
            "moe_intermediate_size",
            "attention_bias",
            "use_sliding_window",
            "rope_scaling",
        )
        if c.get(k)
    ]
    if errors := [f"{k} = {c.get(k)!r}" for k in bad] + [
        f"{k} is missing"
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "rope_theta",
        )
        if k not in c
    ]:
        raise ValueError(
            f"{file}: {'; '.join(errors)}: only dense Qwen3 (model_type 'qwen3') is supported"
        )


def layout(
    cfg,
):  # our name -> (Hugging Face name, its shape, our shape); a torch Linear is [out, in]
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    N, K, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    top = dict(
        embed=("model.embed_tokens.weight", (V, D), (V, D)), norm=("model.norm.weight", (D,), (D,))
    )
    top |= (
        {} if cfg.get("tie_word_embeddings") else dict(lm_head=("lm_head.weight", (V, D), (V, D)))
    )
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
    return top, {k: ("model.layers.{}." + n + ".weight", *s) for k, (n, *s) in layers.items()}


def fetch(
    repo, files
):  # from the Hugging Face hub into its cache; returns the snapshot's directory
    try:
        return importlib.import_module("huggingface_hub").snapshot_download(
            repo, allow_patterns=files
        )
    except (
        Exception
    ) as e:  # offline, no such repo, gated...: the hub raises many types, we raise one line
        raise ValueError(
            f"{repo} could not be downloaded from the Hugging Face hub ({e!r:.150}): pass a "
            "local checkpoint directory with --model"
        ) from None


def config(
    path, files=("config.json",)
):  # (config.json, a local directory); a repo id: fetch files first
    if not os.path.isdir(
        path := str(path)
    ):  # only owner/name can be a repo id; its config is checked first
        if (
            not re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", path)
            or os.path.exists(path)
            or importlib.util.find_spec("huggingface_hub") is None
        ):
            raise FileNotFoundError(
                f"{path} is not a directory: pass a checkpoint directory, or a repo id "
                "owner/name (this needs pip install huggingface_hub)"
            )
        check_config(
            read_json(f"{fetch(path, ['config.json'])}/config.json"), f"{path}/config.json"
        )
        path = fetch(path, list(files))
    check_config(cfg := read_json(f"{path}/config.json"), f"{path}/config.json")
    return cfg, path


def load(path, dtype=jnp.float32, place=None):
    """A Hugging Face checkpoint (a local directory, or a repo id such as Qwen/Qwen3-0.6B), each tensor mapped
    from the file straight to its devices: place(shapes) gives their shardings (default: one device)."""
    cfg, path = config(path, ["*.json", "*.safetensors", "merges.txt"])
    top, layers, L = *layout(cfg), cfg["num_hidden_layers"]
    expected = {n.format(i): s for n, s, _ in (*top.values(), *layers.values()) for i in range(L)}
    index, single = f"{path}/model.safetensors.index.json", f"{path}/model.safetensors"
    if (sharded := os.path.exists(index)) and os.path.exists(single):
        raise ValueError(f"{path} holds both model.safetensors and {index}: remove the stale one")
    files = (
        sorted({f"{path}/{f}" for f in read_json(index)["weight_map"].values()})
        if sharded
        else [single]
    )
    header = {
        k: h for f in files for k, h in read_header(f)[0].items() if k in expected
    }  # before any tensor
    for name, shape in expected.items():
        f, dt, sh, a, b, size = header.get(name, (index if sharded else single, "F32", (), 0, 0, 0))
        need = math.prod(sh) * np.dtype(DTYPES.get(dt, np.uint8)).itemsize
        if (
            bad := f"tensor {name} is missing"
            if name not in header
            else f"{name} is {sh}, config.json implies {shape}"
            if sh != shape
            else f"{name} has dtype {dt}, not one of {', '.join(DTYPES)}"
            if dt not in DTYPES
            else f"{name} has data_offsets for {b - a} bytes, {sh} in {dt} takes {need}"
            if b - a != need
            else f"{name} ends at byte {b}, the file has {size}: it is truncated"
            if b > size
            else ""
        ):
            raise ValueError(f"{f}: {bad}")
    mm = lambda f, dt, shape, a, *_: np.memmap(
        f, DTYPES[dt], "r", a, shape
    )  # a view, read only where sliced
    src = {k: mm(*header[n]) for k, (n, _, _) in top.items()} | {
        "layers": {
            k: [  # [out, in] -> [in, out]
                mm(*header[n.format(i)]).T.reshape(s) for i in range(L)
            ]
            for k, (n, _, s) in layers.items()
        }
    }
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((L, *x[0].shape) if isinstance(x, list) else x.shape, dtype),
        src,
        is_leaf=lambda x: isinstance(x, list),
    )
    part = lambda x, i: (
        np.stack([m[i[1:]] for m in x[i[0]]]) if isinstance(x, list) else x[i]
    ).astype(dtype)
    array = lambda s, w, x: (
        jax.make_array_from_callback(s.shape, w, lambda i: part(x, i))
        if place
        else jnp.asarray(part(x, (slice(None),) * len(s.shape)))
    )  # default: uncommitted
    return Model(
        cfg,
        jax.tree.map(array, shapes, place(shapes) if place else shapes, src),
        load_tokenizer(path, cfg),
        path,
    )


def check_save_dir(
    out_dir,
):  # refuses a file, an unwritable folder, or a checkpoint save() did not write
    d = Path(out_dir).absolute()  # only looks: creates nothing
    up = next(
        p for p in (d, *d.parents) if p.exists()
    )  # out_dir, or the folder it would be made in
    if not up.is_dir() or not os.access(up, os.W_OK | os.X_OK):
        raise ValueError(f"{out_dir}: {up} is not a writable directory")
    held = sorted(
        f.name for f in d.glob("*") if f.name == "config.json" or ".safetensors" in f.name
    )
    if held and not (
        held in (["model.safetensors"], ["config.json", "model.safetensors"])
        and read_header(d / "model.safetensors")[1] == SAVED_BY
    ):
        raise ValueError(
            f"{out_dir} holds a checkpoint that save() did not write: {', '.join(held)}"
        )


def save(
    out_dir, cfg, weights
):  # config.json and model.safetensors: bfloat16, Hugging Face names and layout
    check_save_dir(out_dir)
    top, layers = layout(cfg)
    arrays = {n: weights[k] for k, (n, _, _) in top.items()} | {
        n.format(i): weights["layers"][k][i].reshape(hf[::-1]).T  # back to [out, in]
        for k, (n, hf, _) in layers.items()
        for i in range(cfg["num_hidden_layers"])
    }
    head, data = {"__metadata__": SAVED_BY}, bytearray()
    for name, a in arrays.items():
        head[name] = dict(
            dtype="BF16", shape=a.shape, data_offsets=[len(data), len(data) + 2 * a.size]
        )
        data += np.asarray(a, ml_dtypes.bfloat16).tobytes()
    os.makedirs(
        out_dir, exist_ok=True
    )  # model.safetensors first: alone, it still marks the folder as ours
    for f, b in (
        ("model.safetensors", len(h := json.dumps(head).encode()).to_bytes(8, "little") + h + data),
        ("config.json", json.dumps(cfg, indent=2).encode()),
    ):
        Path(out_dir, "save.partial").write_bytes(
            b
        )  # then renamed: a crash leaves the old file whole
        os.replace(Path(out_dir, "save.partial"), Path(out_dir, f))


def load_tokenizer(
    path, cfg
):  # byte-level BPE from vocab.json (or tokenizer.json): its ranks are the ids
    tj, tc, gen, vocab = (
        read_json(f"{path}/{f}", {})
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "vocab.json")
    )
    if not (vocab := vocab or tj.get("model", {}).get("vocab")):
        return None
    bs = [
        *range(33, 127),
        *range(161, 173),
        *range(174, 256),
    ]  # GPT-2 bytes_to_unicode: printable as is,
    byte = dict(
        zip(map(chr, bs + [*range(256, 512)]), bs + sorted({*range(256)} - {*bs}))
    )  # others 256+
    special = {t["content"]: int(i) for i, t in tc.get("added_tokens_decoder", {}).items()}
    special |= {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    pre = tj.get("pre_tokenizer") or {}
    pattern = [
        p["pattern"]["Regex"] for p in pre.get("pretokenizers", [pre]) if p.get("type") == "Split"
    ]
    enc = tiktoken.Encoding(
        "qwen3",
        pat_str=(pattern or [QWEN2_PATTERN])[0],
        special_tokens=special,
        mergeable_ranks={bytes(byte[c] for c in s): i for s, i in vocab.items()},
    )
    if (eos := {**cfg, **gen}.get("eos_token_id", special.get(str(tc.get("eos_token"))))) is None:
        raise ValueError(
            f"{path}: no eos_token_id in generation_config.json or config.json: add one"
        )
    eos = tuple(eos) if isinstance(eos, list) else (eos,)
    known = {
        *vocab.values(),
        *special.values(),
    }  # the ids with a token: Qwen3 has 151,669 of its 151,936
    encode = lambda text: enc.encode(
        unicodedata.normalize("NFC", text), allowed_special="all"
    )  # NFC as Qwen
    return Tokenizer(
        encode,
        lambda ids: enc.decode([i for i in map(int, ids) if i in known]),
        lambda text: encode(CHAT.format(text)),
        eos,
        special.get("<|endoftext|>", eos[0]),
    )
