"""train.py on Qwen3.5: a GRPO run of a tiny checkpoint with LoRA on every projection of both kinds
of layer, saved where transformers reads it; the sampler's log q against the trainer's log p with a
float32 DeltaNet state, and the mismatch a bf16 or fp16 state makes; the group prefill; W8A8 on
every matmul weight; the chat turn's end as eos; --plan from a config.json alone; the LoRA
experiment's command on Qwen3.5-0.8B's config.
B batch rows, T0 prompt length, M completion length, V vocab, k the sampler's top-k head size."""

import inspect
import json
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qwen3_5
import train
from helpers import _prompts, arange_pos, tiny_argv, write_gsm8k, write_tiny_qwen3_5
from lab import grouped, harness, hf_checkpoint, models, plan, run, tasks
from test_qwen3_5 import ATOL, QWEN3_5_0_8B, reference, torch_logits
from test_sampler import assert_a_group_prefilled_once_samples_as_each
from test_train_step import assert_a_group_shares_its_prompts_forward

END_OF_TEXT, IM_END = 275, 277  # the tiny tokenizer's <|endoftext|> and <|im_end|>


def below_150(tokens, mask, golds):  # a random model earns no GSM8K reward: the share below 150
    return ((np.asarray(tokens) < 150) & mask).sum(1) / np.maximum(mask.sum(1), 1)


def write_gsm35(root, **overrides):
    """A tiny Qwen3.5 (overrides: config keys) whose config.json names <|endoftext|> as its eos, as
    Qwen3.5-0.8B's does, and no generation_config.json; beside a tiny GSM8K folder."""
    path = write_tiny_qwen3_5(str(root / "ckpt"), eos_token_id=END_OF_TEXT, **overrides)
    os.remove(f"{path}/generation_config.json")
    return path, write_gsm8k(root / "gsm8k")


@pytest.fixture(scope="module")
def gsm35(tmp_path_factory):
    return write_gsm35(tmp_path_factory.mktemp("gsm35"))


@pytest.fixture(scope="module")
def tiny35(gsm35):
    return hf_checkpoint.load(gsm35[0])


def test_a_qwen3_5_reply_ends_at_the_chat_templates_end_of_turn(tiny35):
    """config.json's eos is <|endoftext|>, which a chat reply never writes: the sampler also stops
    at <|im_end|>, where the chat template ends a turn, as Qwen3's generation_config has it."""
    assert json.load(open(f"{tiny35.path}/config.json"))["eos_token_id"] == END_OF_TEXT
    assert set(tiny35.tokenizer.eos_ids) == {END_OF_TEXT, IM_END}
    assert tiny35.tokenizer.chat("hi")[-2:] != [IM_END]  # the prompt opens the reply's turn


def test_qwen3_5_grpo_with_lora_saves_what_transformers_reads_as_qwen3_5(tmp_path, monkeypatch):
    """Two GRPO steps of a tiny Qwen3.5 (the int8 W8A8 sampler, an int8 KV cache, a bf16 state),
    LoRA on every projection of both kinds of layer: finite metrics, and the saved policy is what
    transformers reads as a Qwen3_5ForCausalLM, whose logits are ours; only the adapted weights
    moved (not the norms, the conv, A_log, dt_bias or the embedding). One layer of each kind, not
    gsm35's two: its programs compile in about half the time (the layers are unrolled)."""
    kinds = ["linear_attention", "full_attention"]
    gsm = write_gsm35(tmp_path, layer_types=kinds, num_hidden_layers=len(kinds))
    flags = "--sampler int8 --kv-quant int8 --state-dtype bf16 --lora 4 --optimizer adamw --lr 0.05"
    out, saved = tmp_path / "run", tmp_path / "saved"
    argv = tiny_argv(gsm, *flags.split(), "--out", str(out), "--save", str(saved))
    load = tasks.gsm8k_task  # rewarded by the share of a completion's tokens below 150
    monkeypatch.setattr(
        tasks, "gsm8k_task", lambda *a, **k: load(*a, **k)._replace(reward=below_150)
    )
    train.main(argv)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[:2]:
        assert all(np.isfinite(r[k]) for k in ("loss", "grad_norm", "kl_q_p", "entropy")), r
    m = hf_checkpoint.load(str(saved))
    base = jax.tree.map(lambda x: x.astype(jnp.bfloat16), hf_checkpoint.load(gsm[0]).weights)
    moved = {
        (stack, name)
        for stack in ("linear", "full")
        for name, x in m.weights[stack].items()
        if not np.array_equal(x, base[stack][name])
    }
    adapted = dict(
        linear={"qkv", "z", "b", "a", "out", "gate", "up", "down"},
        full={"q", "k", "v", "o", "gate", "up", "down"},
    )
    assert moved == {(stack, name) for stack, names in adapted.items() for name in names}
    assert all(np.array_equal(m.weights[k], base[k]) for k in ("embed", "norm", "lm_head"))
    tokens = np.random.default_rng(0).integers(0, 300, (2, 12))
    hf = reference(str(saved))
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    forward = jax.jit(partial(qwen3_5.forward, m.cfg))  # one compile, not an op's each eagerly
    ours = forward(m.weights, jnp.array(tokens), arange_pos(2, 12))[0]
    np.testing.assert_allclose(torch_logits(hf, tokens), ours, atol=ATOL)


def exact_kl(out, logp):  # KL(q || p) at each recorded position [B, M]: topk 0 records all of q
    q = jnp.exp(out["head_logq"])
    return jnp.where(out["mask"], (q * (out["head_logq"] - logp)).sum(-1), 0)


def test_a_float32_state_samples_the_trainers_p_and_a_bf16_or_fp16_state_does_not(tiny35):
    """A float32 sampler that decodes with the recurrent delta rule records log q equal to the log p
    of the trainer's chunked pass on the same tokens; held at bf16 or fp16 (--state-dtype), the
    state makes q differ from p, by far more than rounding: the largest |log q(y) - log p(y)| over
    64 tokens a row, and (bf16) KL(q || p), which kl_q_p estimates."""
    prompt, pos = _prompts(tiny35.tokenizer, 4)
    logp_of = jax.jit(lambda b: jax.nn.log_softmax(grouped.completion_logits(tiny35.cfg, **b)))
    gap, kl = {}, {}
    for state in ("float32", "bf16", "fp16"):
        numerics = dict(dtype=jnp.float32, kv_quant=None)
        numerics |= dict(state_dtype=run.STATE_DTYPES[state]) if state != "float32" else {}
        sample = grouped.make_sampler(tiny35.cfg, 64, 0, (), numerics)  # no eos: 64 tokens a row
        out = sample(tiny35.weights, prompt, pos, jax.random.PRNGKey(0))
        b = dict(w=tiny35.weights, prompt=prompt, pos=pos, tokens=out["tokens"])
        logp = logp_of(b)
        logp_y = jnp.take_along_axis(logp, out["tokens"][..., None], -1)[..., 0]
        gap[state] = float(jnp.where(out["mask"], jnp.abs(logp_y - out["logq"]), 0).max())
        kl[state] = float(exact_kl(out, logp).sum() / out["mask"].sum())
    # measured: gaps 7e-6 (float32), 5e-3 (bf16), 8e-4 (fp16); KL at bf16 8e-7, the others at
    # rounding's level (±1e-8, of either sign: a float32 sum over V of q (log q - log p))
    assert gap["float32"] <= 5e-5 and gap["bf16"] > 1e-3 and gap["fp16"] > 1e-4, gap
    assert kl["bf16"] > 1e-7, kl


def test_qwen3_5_group_prefilled_once_samples_as_rows_prefilled_each(tiny35):
    """group=4: each prompt's conv window, state, K and V are prefilled once and copied to its 4
    rows, which sample and record what rows prefilled one by one do (int8 W8A8 with an int4 KV cache
    and a bf16 state: every entry of the cache)."""
    assert_a_group_prefilled_once_samples_as_each(tiny35, 2, 12, "int8", "int4", jnp.bfloat16)


def test_the_trainer_shares_a_prompts_forward_with_its_group(tiny35):
    """The prompt's conv window, state, K and V computed once and shared by its 4 rows: the
    trainer's logits are those of one pass over each row. (The step around them, the gradient
    through the copies, the micro-batches and the split over devices, is the same code for both
    models: the dense model's test checks it, 18 s less than here.)"""
    assert_a_group_shares_its_prompts_forward(tiny35, 2, 12, steps=False)


def test_w8a8_quantises_every_matmul_weight_of_both_kinds_of_layer(tiny35):
    """INPUT_AXES names every weight qwen3_5.forward's matmuls take, with the axes they contract;
    --sampler int8 rounds each of them to at most 255 levels an output channel, and nothing else."""
    contracted = {}

    def spy(spec, x, w):
        w_sub, out = spec.split(",")[1].split("->")
        contracted[w.shape] = tuple(i for i, c in enumerate(w_sub) if c not in out)
        return jnp.einsum(spec, x, w)

    w = tiny35.weights
    jax.eval_shape(
        lambda w: qwen3_5.forward(tiny35.cfg, w, jnp.zeros((1, 3), int), arange_pos(1, 3), mm=spy),
        w,
    )
    matmuls = {("top", "lm_head")}
    for stack in ("linear", "full"):
        for name, x in w[stack].items():
            if x.shape[1:] in contracted:
                assert contracted[x.shape[1:]] == tuple(a - 1 for a in models.INPUT_AXES[name])
                matmuls.add((stack, name))
    assert len(matmuls) == 1 + 8 + 7  # the head, the linear and the full attention's layers
    q = train.sampler_weights(w, "int8")
    for stack in ("linear", "full"):
        for name, x in w[stack].items():
            x, y = np.asarray(x, np.float32), np.asarray(q[stack][name], np.float32)
            if (stack, name) not in matmuls:  # a norm, the conv, A_log, dt_bias: bf16 alone
                np.testing.assert_array_equal(y, x.astype(jnp.bfloat16).astype(np.float32))
                continue
            axes = models.INPUT_AXES[name]  # a scale an output channel; y: k s to bf16, k an int8
            s = np.abs(x).max(axis=axes, keepdims=True) / np.float32(127)
            k = np.round(y / s)
            assert np.abs(k).max() <= 127 and not np.array_equal(y, x), (stack, name)
            assert (np.abs(y - k * s) <= 2.0**-8 * np.abs(k * s) * (1 + 1e-6)).all(), (stack, name)


def test_state_dtype_is_refused_for_a_dense_model():
    with pytest.raises(SystemExit, match="--state-dtype bf16: the sequence task has no recurrent"):
        train.main("--task sequence --state-dtype bf16".split())


def test_plan_sizes_a_qwen3_5_from_its_config_json_alone(tmp_path, monkeypatch, capsys):
    """--plan on 4 devices, LoRA rank 8 and AdamW, from a folder with a tiny Qwen3.5's config.json
    only: its parameters counted from the config (each weight of each kind of layer), matrices split
    4 ways and vectors whole; an adapter pair of (inputs + outputs) x r on each matmul of both kinds
    of layer; the cache of a quarter of the rows: K and V of the full-attention layers (bf16), the
    conv's last inputs (bf16) and the float32 state of the linear ones. 2 full-attention layers and
    1 linear: a count of one kind read as the other's is seen (the train step compiles in 0.7 of
    the 4 layers' time)."""
    kinds = ["full_attention", "linear_attention", "full_attention"]
    tiny = dict(tie=True, layer_types=kinds, num_hidden_layers=len(kinds))
    cfg = json.load(open(write_tiny_qwen3_5(str(tmp_path / "tiny"), **tiny) + "/config.json"))
    json.dump(cfg, open(tmp_path / "config.json", "w"))  # no weights, no tokenizer
    monkeypatch.setattr(hf_checkpoint, "load", None)
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    N, K, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    J, E = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    U, Y, width = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"], 4
    C, r = 2 * J * E + U * Y, 8
    full = cfg["layer_types"].count("full_attention")
    linear = len(cfg["layer_types"]) - full
    mlp = 3 * D * F
    matrices = V * D + full * (3 * N * H * D + 2 * K * H * D + mlp)  # q: a query and a gate
    matrices += linear * (C * D + 2 * U * Y * D + 2 * U * D + C * width + mlp)
    vectors = D + full * (2 * H + 2 * D) + linear * (3 * U + Y + 2 * D - U)  # A_log, dt_bias, norms
    mlp_pairs = 2 * (D + F) + (F + D)  # gate, up, down
    full_pairs = (D + 2 * N * H) + 2 * (D + K * H) + (N * H + D) + mlp_pairs  # q, k, v, o
    linear_pairs = (
        (D + C) + (D + U * Y) + 2 * (D + U) + (U * Y + D) + mlp_pairs
    )  # qkv, z, b, a, out
    pairs = full * full_pairs + linear * linear_pairs
    B, T0, M = 8, inspect.signature(plan.plan).parameters["T0"].default, 4
    argv = f"--plan --model {tmp_path} --prompts 2 --group 4 --max-tokens {M} --topk 8"
    rows = train.main(argv.split() + "--optimizer adamw --lora 8".split())
    assert "--plan: 3-layer Qwen3.5" in capsys.readouterr().out
    assert rows["weights"] == 4 * (matrices // 4 + vectors)
    assert rows["adapters"] == rows["gradients"] == 4 * r * pairs
    kv = 2 * full * (B // 4) * (T0 + M) * K * H * 2
    kv += linear * (B // 4) * ((width - 1) * C * 2 + U * E * Y * 4)
    assert rows["kv cache"] == kv


def test_the_lora_recipes_command_is_accepted_on_qwen3_5_0_8b(tmp_path):
    """The LoRA recipe's command on Qwen3.5-0.8B's config.json passes each flag and config check."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_5_0_8B))
    argv = f"--model {tmp_path} --lora 32 --optimizer adamw --lr 1e-4 --prompts 32 --group 8"
    args = harness.parse_args(argv.split() + "--max-tokens 512 --compare".split())
    tasks.check_against_model(hf_checkpoint.config(args.model)[0], args)  # raises on a refusal
    assert args.lora == 32 and args.max_tokens == 512 and args.topk == 128
