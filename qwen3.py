"""Qwen3 (dense) in pure JAX: a dict of weights, pure functions, and a loader for Hugging Face checkpoints.

B batch, T query length, S key (cache) length, D hidden, F mlp hidden, H head dim, N query heads, K kv heads,
V vocab, L layers (stacked along the leading axis of every layer weight and run with lax.scan)."""
import importlib.util, json, math, os, unicodedata
from collections import namedtuple
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import tiktoken

def rms_norm(x, w, eps):  # in float32, back to the compute dtype before the weight (as transformers does)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32.astype(x.dtype) * jnp.broadcast_to(w.astype(x.dtype), x.shape)

def rope(x, pos, theta):  # rotate-half RoPE at the real positions; x [B, T, N, H], pos [B, T]
    h = x.shape[-1] // 2
    freq = 1 / theta ** (jnp.arange(h, dtype=jnp.float32) / h)
    angle = jnp.einsum('bt,h->bth', pos.astype(jnp.float32), freq)
    cos, sin = (f(angle)[:, :, None, :].astype(x.dtype) for f in (jnp.cos, jnp.sin))
    x1, x2 = x[..., :h], x[..., h:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

def init_kv(cfg, B, S, dtype=jnp.float32):  # position -1 marks an empty slot
    shape = (cfg['num_hidden_layers'], B, S, cfg['num_key_value_heads'], cfg['head_dim'])
    return dict(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), pos=jnp.full((B, S), -1, jnp.int32))

def forward(cfg, w, tokens, pos, kv=None, t0=0, *, mm=jnp.einsum, dtype=jnp.float32, last=None):
    """Logits float32 [B, T, V] (or [B, last, V] for the last `last` positions) and the updated kv.

    tokens [B, T]; pos [B, T] their positions, < 0 for padding. A query at position p sees keys at 0..p.
    With kv, this call's keys, values and positions are written at [t0, t0 + T) and the queries attend over
    the whole cache. Every weight matmul is mm(spec, activation, weight)."""
    eps, H = cfg['rms_norm_eps'], cfg['head_dim']
    theta = cfg.get('rope_theta') or cfg['rope_parameters']['rope_theta']  # hub / recent transformers
    kpos = pos if kv is None else jax.lax.dynamic_update_slice(kv['pos'], pos.astype(jnp.int32), (0, t0))
    mask = (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= pos[:, :, None])  # [B, T, S]
    x = w['embed'][tokens].astype(dtype)  # [B, T, D]

    @jax.checkpoint  # recompute the layer in the backward pass instead of storing its activations
    def layer(carry, xs):
        (x, kv), (lw, i) = carry, xs
        lw = jax.tree.map(lambda a: a.astype(dtype), lw)
        # attention: q and k get their own RMSNorm, before RoPE (Qwen3's QK-norm)
        h = rms_norm(x, lw['attn_norm'], eps)
        q = rope(rms_norm(mm('btd,dnh->btnh', h, lw['q']), lw['q_norm'], eps), pos, theta)
        k = rope(rms_norm(mm('btd,dkh->btkh', h, lw['k']), lw['k_norm'], eps), pos, theta)
        v = mm('btd,dkh->btkh', h, lw['v'])
        if kv is not None:  # write this call's keys and values into layer i of the cache, attend over all
            write = lambda c, a: jax.lax.dynamic_update_slice(c, a[None].astype(c.dtype), (i, 0, t0, 0, 0))
            kv = dict(kv, k=write(kv['k'], k), v=write(kv['v'], v))  # in place: the cache is a scan carry
            k, v = kv['k'][i].astype(dtype), kv['v'][i].astype(dtype)
        b, t, n, _ = q.shape
        q = q.reshape(b, t, k.shape[2], n // k.shape[2], H)  # [B, T, K, G, H]: G query heads share a kv head
        s = jnp.einsum('btkgh,bskh->bkgts', q, k, preferred_element_type=jnp.float32) * H**-0.5
        s = jnp.where(mask[:, None, None], s, -1e30)  # finite: a padding query sees no key, yet is not NaN
        o = jnp.einsum('bkgts,bskh->btkgh', jax.nn.softmax(s, axis=-1).astype(dtype), v).reshape(b, t, n, H)
        x = x + mm('btnh,nhd->btd', o, lw['o'])
        # MLP
        h = rms_norm(x, lw['mlp_norm'], eps)
        h = jax.nn.silu(mm('btd,df->btf', h, lw['gate'])) * mm('btd,df->btf', h, lw['up'])
        return (x + mm('btf,fd->btd', h, lw['down']), kv), None
    kv = None if kv is None else dict(kv, pos=kpos)
    (x, kv), _ = jax.lax.scan(layer, (x, kv), (w['layers'], jnp.arange(cfg['num_hidden_layers'])))
    x = rms_norm(x if last is None else x[:, -last:], w['norm'], eps)
    head = w['embed'] if cfg.get('tie_word_embeddings') else w['lm_head']
    logits = mm('btd,vd->btv', x, head.astype(dtype)).astype(jnp.float32)
    return logits, kv

# ---- loading: config.json, safetensors read with numpy, tokenizer through tiktoken
Model = namedtuple('Model', 'cfg weights tokenizer path')  # tokenizer: None when the directory has none
Tokenizer = namedtuple('Tokenizer', 'encode decode chat eos_ids pad_id')
CHAT = '<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n'  # Qwen3, thinking off
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")

def read_json(file, default=None):  # default: what a missing file reads as (None: the file must exist)
    return json.loads(Path(file).read_text('utf-8')) if default is None or os.path.exists(file) else default

def check_config(cfg, file):  # dense Qwen3 only; recent transformers put rope_theta in rope_parameters
    c = {'rope_type': 'default', **(cfg.get('rope_parameters') or {}), **cfg}
    bad = [k for k, ok in (('model_type', 'qwen3'), ('rope_type', 'default')) if c.get(k) != ok]
    bad += [k for k in ('num_experts', 'num_local_experts', 'moe_intermediate_size', 'attention_bias',
                        'use_sliding_window', 'rope_scaling') if c.get(k)]
    errors = [f'{k} = {c.get(k)!r}' for k in bad] + [f'{k} is missing' for k in (
        'vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads',
        'num_key_value_heads', 'head_dim', 'rms_norm_eps', 'rope_theta') if k not in c]
    if errors:
        raise ValueError(f"{file}: {'; '.join(errors)}: only dense Qwen3 (model_type 'qwen3') is supported")

def layout(cfg):  # our name -> (Hugging Face name, its shape, our shape); a torch Linear is [out, in]
    D, F, V = cfg['hidden_size'], cfg['intermediate_size'], cfg['vocab_size']
    N, K, H = cfg['num_attention_heads'], cfg['num_key_value_heads'], cfg['head_dim']
    top = dict(embed=('model.embed_tokens.weight', (V, D), (V, D)), norm=('model.norm.weight', (D,), (D,)))
    top |= {} if cfg.get('tie_word_embeddings') else dict(lm_head=('lm_head.weight', (V, D), (V, D)))
    a, m = 'self_attn.', 'mlp.'
    layers = dict(attn_norm=('input_layernorm', (D,), (D,)), q_norm=(a + 'q_norm', (H,), (H,)),
                  q=(a + 'q_proj', (N * H, D), (D, N, H)), k=(a + 'k_proj', (K * H, D), (D, K, H)),
                  v=(a + 'v_proj', (K * H, D), (D, K, H)), k_norm=(a + 'k_norm', (H,), (H,)),
                  o=(a + 'o_proj', (D, N * H), (N, H, D)), mlp_norm=('post_attention_layernorm', (D,), (D,)),
                  gate=(m + 'gate_proj', (F, D), (D, F)), up=(m + 'up_proj', (F, D), (D, F)),
                  down=(m + 'down_proj', (D, F), (F, D)))
    return top, {k: ('model.layers.{}.' + n + '.weight', *s) for k, (n, *s) in layers.items()}

def load(path, dtype=jnp.float32):
    """A local directory in the Hugging Face layout, or a repo id such as Qwen/Qwen3-0.6B."""
    if not os.path.isdir(path):  # a repo id: its config is checked before the weights are downloaded
        if '/' not in path or importlib.util.find_spec('huggingface_hub') is None:
            raise FileNotFoundError(f'{path} is not a directory: pass a checkpoint directory, or a repo id '
                                    'such as Qwen/Qwen3-0.6B after pip install huggingface_hub')
        import huggingface_hub as hub
        check_config(read_json(hub.hf_hub_download(path, 'config.json')), f'{path}/config.json')
        path = hub.snapshot_download(path, allow_patterns=['*.json', '*.safetensors', 'merges.txt'])
    cfg = read_json(f'{path}/config.json')
    check_config(cfg, f'{path}/config.json')
    top, layers, L = *layout(cfg), cfg['num_hidden_layers']
    expected = {n.format(i): s for n, s, _ in (*top.values(), *layers.values()) for i in range(L)}
    index = f'{path}/model.safetensors.index.json'
    sharded = os.path.exists(index)
    files = sorted(set(read_json(index)['weight_map'].values())) if sharded else ['model.safetensors']
    header = {}  # tensor name -> (file, dtype, shape, offset): every json header is read before any tensor
    for f in files:
        with open(f'{path}/{f}', 'rb') as fh:
            n = int.from_bytes(fh.read(8), 'little')
            header |= {k: (f'{path}/{f}', v['dtype'], tuple(v['shape']), 8 + n + v['data_offsets'][0])
                       for k, v in json.loads(fh.read(n)).items() if k in expected}
    for name, shape in expected.items():
        if name not in header:
            raise ValueError(f"{index if sharded else path + '/' + files[0]}: tensor {name} is missing")
        if header[name][2] != shape:
            raise ValueError(f'{header[name][0]}: {name} is {header[name][2]}, config.json implies {shape}')

    def read(name):
        f, dt, shape, offset = header[name]
        dt = {'BF16': ml_dtypes.bfloat16, 'F16': np.float16, 'F32': np.float32}[dt]
        return np.fromfile(f, dt, math.prod(shape), offset=offset).reshape(shape).astype(dtype)
    weights = {k: jnp.asarray(read(n)) for k, (n, _, _) in top.items()}
    weights['layers'] = {k: jnp.asarray(np.stack([read(n.format(i)).T.reshape(s) for i in range(L)]))
                         for k, (n, _, s) in layers.items()}  # [out, in] -> [in, out], head axes split out
    return Model(cfg, weights, load_tokenizer(path, cfg), path)

def save(out_dir, cfg, weights):
    """Write config.json and model.safetensors (bfloat16, Hugging Face names and layout)."""
    top, layers = layout(cfg)
    arrays = {n: weights[k] for k, (n, _, _) in top.items()} | {
        n.format(i): weights['layers'][k][i].reshape(hf[::-1]).T  # back to [out, in]
        for k, (n, hf, _) in layers.items() for i in range(cfg['num_hidden_layers'])}
    header, data = {'__metadata__': {'format': 'pt'}}, bytearray()
    for name, a in arrays.items():
        header[name] = dict(dtype='BF16', shape=a.shape, data_offsets=[len(data), len(data) + 2 * a.size])
        data += np.asarray(a, ml_dtypes.bfloat16).tobytes()
    header = json.dumps(header).encode()
    os.makedirs(out_dir, exist_ok=True)
    Path(out_dir, 'model.safetensors').write_bytes(len(header).to_bytes(8, 'little') + header + data)
    Path(out_dir, 'config.json').write_text(json.dumps(cfg, indent=2))

def load_tokenizer(path, cfg):  # byte-level BPE from vocab.json (or tokenizer.json): its ranks are the ids
    tj, tc, gen, vocab = (read_json(f'{path}/{f}', {}) for f in ('tokenizer.json', 'tokenizer_config.json',
                                                                  'generation_config.json', 'vocab.json'))
    vocab = vocab or tj.get('model', {}).get('vocab')
    if not vocab:
        return None
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2 bytes_to_unicode: printable bytes
    rest = [b for b in range(256) if b not in bs]  # are their own characters, the others chr(256) on
    byte = dict(zip(map(chr, bs + list(range(256, 256 + len(rest)))), bs + rest))
    special = {t['content']: int(i) for i, t in tc.get('added_tokens_decoder', {}).items()}
    special |= {t['content']: t['id'] for t in tj.get('added_tokens', [])}
    pre = tj.get('pre_tokenizer') or {}
    pattern = [p['pattern']['Regex'] for p in pre.get('pretokenizers', [pre]) if p.get('type') == 'Split']
    enc = tiktoken.Encoding(os.path.basename(path), pat_str=(pattern or [QWEN2_PATTERN])[0],
                            mergeable_ranks={bytes(byte[c] for c in s): i for s, i in vocab.items()},
                            special_tokens=special)
    eos = gen.get('eos_token_id', cfg.get('eos_token_id'))
    eos = tuple(eos) if isinstance(eos, list) else (eos,)
    known = {*vocab.values(), *special.values()}  # the ids with a token: Qwen3 has 151,669 of its 151,936

    def encode(text):  # NFC as Qwen's normaliser; special tokens (chat markup) in the text become single ids
        return enc.encode(unicodedata.normalize('NFC', text), allowed_special='all')

    def decode(ids):  # skips ids with no token: a sampler can still pick a padding logit
        return enc.decode([i for i in map(int, ids) if i in known])
    return Tokenizer(encode, decode, lambda text: encode(CHAT.format(text)), eos,
                     special.get('<|endoftext|>', eos[0]))
