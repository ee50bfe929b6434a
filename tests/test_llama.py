"""Llama checkpoints: a tiny random Llama through the loader, a GRPO run and --save (it loads in
transformers as LlamaForCausalLM); the config checks; the chat prompt against transformers' own
rendering of the checkpoint's template."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train
from helpers import LLAMA, tiny_argv, write_gsm8k, write_tiny_checkpoint
from lab import bench, hf_checkpoint, tasks


def test_tiny_llama_runs_grpo_and_saves_a_llama(tmp_path, monkeypatch):
    # a tiny random model never answers GSM8K: each completion's reward is its text's length, so
    # that a group's rewards differ and every update moves the weights, whatever tokens are drawn
    monkeypatch.setattr(tasks, "reward", lambda text, gold: len(text) / 100)
    ckpt = write_tiny_checkpoint(str(tmp_path / "llama"), tie=False, **LLAMA)
    gsm = ckpt, write_gsm8k(tmp_path / "gsm8k")
    m = hf_checkpoint.load(ckpt)
    assert "q_norm" not in m.weights["layers"] and "k_norm" not in m.weights["layers"]
    train.main([*tiny_argv(gsm), "--out", str(tmp_path / "run"), "--save", str(tmp_path / "s")])
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2] and min(r["grad_norm"] for r in rows[:2]) > 0
    saved = hf_checkpoint.load(str(tmp_path / "s"))
    assert saved.cfg["model_type"] == "llama" and set(saved.weights["layers"]) == set(
        m.weights["layers"]
    )
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(saved.weights))
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), saved.weights, m.weights)
    assert max(jax.tree.leaves(moved)) > 0  # the saved policy is the trained one
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "s"))
    assert type(ref).__name__ == "LlamaForCausalLM"


@pytest.fixture(scope="module")
def llama_cfg(tmp_path_factory):  # a tiny Llama's config.json
    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("llama")), **LLAMA)
    return json.load(open(f"{path}/config.json"))


@pytest.mark.parametrize(
    "edit, match",
    [
        (dict(rope_scaling=dict(rope_type="llama3", factor=32.0)), "rope_type = 'llama3'"),
        (dict(rope_parameters=dict(rope_type="llama3", rope_theta=5e5)), "rope_type = 'llama3'"),
        (dict(mlp_bias=True), "mlp_bias = True"),
        (dict(attention_bias=True), "attention_bias = True"),
        (dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
        (dict(model_type="mistral"), "model_type = 'mistral'"),
    ],
)
def test_unsupported_llama_configs_are_refused_by_name(llama_cfg, edit, match):
    cfg = llama_cfg | edit
    with pytest.raises(ValueError, match=f"config.json: {match}.*only dense Qwen3 and Llama"):
        hf_checkpoint.check_config(cfg, "config.json")


def test_llama_config_without_head_dim_reads_it_as_d_over_n(llama_cfg):
    cfg = {k: v for k, v in llama_cfg.items() if k != "head_dim"}
    assert hf_checkpoint.check_config(cfg, "config.json")["head_dim"] == 32 // 4
    with pytest.raises(ValueError, match="head_dim is missing"):  # Qwen3's is never guessed
        hf_checkpoint.check_config(dict(cfg, model_type="qwen3"), "config.json")


def test_chat_prompt_is_the_checkpoint_template_as_transformers_renders_it(tiny):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(tiny.path)
    for question in ["What is 2 + 2?", "héllo\n\n  twice"]:
        text = ref.apply_chat_template(
            [{"role": "user", "content": question}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # not vacuous
        assert tiny.tokenizer.chat(question) == ref.encode(text, add_special_tokens=False)


def test_a_checkpoint_without_a_chat_template_is_refused_before_training(tmp_path):
    path = write_tiny_checkpoint(str(tmp_path / "ckpt"))
    config = json.load(open(f"{path}/tokenizer_config.json"))
    del config["chat_template"]
    json.dump(config, open(f"{path}/tokenizer_config.json", "w"))
    assert not os.path.exists(f"{path}/chat_template.jinja")
    with pytest.raises(SystemExit, match="has no chat template"):
        train.main([*tiny_argv((path, write_gsm8k(tmp_path / "g"))), "--out", str(tmp_path / "r")])
    assert not os.path.exists(tmp_path / "r" / "metrics.jsonl")


def test_bench_takes_a_llama_config_and_builds_it_without_qk_norm(tmp_path, llama_cfg, capsys):
    (tmp_path / "config.json").write_text(json.dumps(llama_cfg))
    args, cfg = bench.parse_args(["--config", str(tmp_path / "config.json")])
    w = tasks.init(cfg, np.random.default_rng(0))  # as lab.bench makes them
    L, D, N, H = (
        cfg[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "head_dim")
    )
    assert set(w["layers"]) == {"attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down"}
    assert w["layers"]["q"].shape == (L, D, N, H)
    (tmp_path / "bad.json").write_text(json.dumps(llama_cfg | dict(mlp_bias=True)))
    with pytest.raises(SystemExit):
        bench.parse_args(["--config", str(tmp_path / "bad.json")])
    error = capsys.readouterr().err.splitlines()[-1]
    assert "--config: " in error and "mlp_bias = True" in error
