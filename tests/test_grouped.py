"""The runs' drop-ins against train.py's reference: lab/grouped.py's sampler (a group's prompt
prefilled once) decodes and records what train.make_sampler does, and train.grpo runs on the
reference alone. The trainer's logits and step against the reference: tests/test_train_step.py
(assert_a_group_shares_its_prompts_forward); the drop-in's draw, inverse CDF, samples exactly q:
tests/test_sampler.py (test_categorical_samples_exactly_q)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import train
from helpers import STOP, _prompts
from lab import grouped, rollouts, tasks

KINDS = [("float32", None), ("bf16", None), ("int8", "int4"), ("fp8", "fp8")]


@pytest.mark.parametrize("kind, kv", KINDS)
def test_the_grouped_greedy_sampler_records_what_the_reference_does(tiny, kind, kv):
    """Greedy, 4 prompts each 4 times, at each kind of numerics, both compiled with every bf16
    rounding made (grouped.ROUNDING): the same tokens and mask, log q and head within the spread a
    prefill of 4 rows against 16 gives (measured: 3.3e-6 at float32, 0 at the others on this
    model; atol 5e-5)."""
    assert grouped.TEMPERATURE == train.TEMPERATURE
    prompt, pos = (np.repeat(x, 4, 0) for x in _prompts(tiny.tokenizer, 4))  # [16, T0]
    numerics = dict(mm=train.quant_mm(kind), kv_quant=train.kv_quant(kv))
    numerics["dtype"] = train.SAMPLER_DTYPES[kind]
    w = train.sampler_weights(tiny.weights, kind)
    key = jax.random.PRNGKey(0)
    ref = train.make_sampler(tiny.cfg, 12, 8, STOP, numerics, greedy=True)
    # compiled as the drop-in is, every bf16 rounding it writes made (else XLA's fusions choose)
    ref = jax.jit(ref.__wrapped__, compiler_options=grouped.ROUNDING)(w, prompt, pos, key)
    drop_in = grouped.make_sampler(tiny.cfg, 12, 8, STOP, numerics, greedy=True, group=4)
    out = drop_in(w, prompt, pos, key)
    assert set(out) == set(ref)
    np.testing.assert_array_equal(out["tokens"], ref["tokens"])
    np.testing.assert_array_equal(out["mask"], ref["mask"])
    atol = 5e-5
    mask = np.asarray(ref["mask"])
    np.testing.assert_allclose(
        np.where(mask, out["logq"], 0), np.where(mask, ref["logq"], 0), atol=atol
    )
    head = np.where(mask[..., None], np.asarray(out["head_logq"]) - ref["head_logq"], 0)
    assert np.abs(head).max() <= atol
    assert len(set(mask.sum(1).tolist())) > 1  # rows that end at different steps


def test_the_reference_loop_runs_on_the_reference_alone():
    """train.grpo with train.py's own sampler and train step (of lab/, the task and its prompts
    left-padded alone): three steps of the sequence task, each row with its reward, loss and
    metrics, and the policy moved."""
    task = tasks.sequence_task(0, 8, 8)
    cfg, w0 = task.cfg, task.weights
    sampler = train.make_sampler(cfg, 8, 16, task.eos, dict(mm=train.quant_mm("int8")))
    opt, rows = optax.sgd(0.1), []
    prompts = [p for p, _ in task.train[:4] for _ in range(4)]  # 4 prompts, 4 rollouts each
    prompt, pos = (jnp.asarray(x) for x in rollouts.left_pad(prompts, task.pad))

    def sample(w_sampler, step):
        out = sampler(w_sampler, prompt, pos, jax.random.PRNGKey(step))
        return dict(out, prompt=prompt, pos=pos), prompts

    params, _ = train.grpo(
        (w0, opt.init(w0), None),
        start=0,
        steps=3,
        staleness=0,
        eval_every=3,
        group=4,
        baseline="group",
        refresh=lambda w: train.sampler_weights(w, "int8"),
        sample=sample,
        reward=task.reward,
        train_step=train.make_train_step(cfg, opt, center=True),
        evaluate=lambda w: dict(acc=0.0),
        record=lambda row, *state: rows.append(row) or True,
    )
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[:3]:
        assert all(np.isfinite(float(r[k])) for k in ("loss", "reward", "drift_size", "grad_norm"))
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), params, w0)
    assert max(jax.tree.leaves(moved)) > 0
