"""lab/measure.py: the drift measure's two gradients are the train step's, and its problems are
GSM8K lines whose gold answers are their stories' arithmetic."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import train
from helpers import STOP, _prompts
from lab import measure, tasks


def test_the_drift_measures_gradients_are_the_train_steps(tiny):
    """measure.gradients (one forward, a backward for each arm, in calls of 2 rows) against
    make_train_step's (SGD at lr 1: the update is minus the gradient's token mean, over one
    micro-batch), uncentred and centred, on the full log q of the sampler's own rollouts."""
    prompt, pos = _prompts(tiny.tokenizer, 8)
    w_q = train.sampler_weights(tiny.weights, "int8")
    sampler = train.make_sampler(tiny.cfg, 10, 0, STOP, dict(mm=train.quant_mm("int8")))
    out = sampler(w_q, prompt, pos, jax.random.PRNGKey(3))
    batch = dict(out, prompt=prompt, pos=pos, adv=jnp.linspace(-1, 1, 8))
    n_tokens = float(out["mask"].sum())
    g_u, g_c, kl_sum = measure.gradients(train, tiny.cfg, tiny.weights, batch, rows=2)
    mesh, opt = Mesh(np.array(jax.devices()[:1]), ("data",)), optax.sgd(1.0)
    for center, g in ((False, g_u), (True, g_c)):
        step = train.make_train_step(tiny.cfg, opt, 8, mesh, center=center)
        w = jax.tree.map(jnp.copy, tiny.weights)
        new = step(w, opt.init(w), batch)[0]
        old, new = jax.tree.leaves(tiny.weights), jax.tree.leaves(new)
        ref = jnp.concatenate([(a - b).ravel() for a, b in zip(old, new, strict=True)])
        # calls of 1-8 rows, micro-batches of 2-8 and 1 or 4 devices moved it by <= 2e-7
        # (|g| <= 0.13); atol 5x
        np.testing.assert_allclose(g / n_tokens, ref, atol=1e-6)
    assert float(jnp.linalg.norm(g_u - g_c)) > 1e-3 * float(jnp.linalg.norm(g_c))  # a drift term
    logp = train.token_logp(tiny.cfg, tiny.weights, batch)  # the trainer's log p, its own pass
    kl = jnp.where(out["mask"], out["logq"] - logp, 0).sum()
    np.testing.assert_allclose(kl_sum, kl, atol=1e-4 * n_tokens)  # the token sum of log q − log p


def test_the_arithmetic_problems_read_as_gsm8k_with_their_storys_answer(tmp_path):
    folder = measure.write_arithmetic(str(tmp_path / "arith"), n=200)
    problems = tasks.read_gsm8k(folder, "train")
    assert len(problems) == 200 and len({q for q, _ in problems}) == 2 * 5 * 4
    for question, gold in problems:
        x, y = map(int, re.findall(r"\d+", question))
        assert gold == str(x + y if "+" in question else x * y), question


@pytest.mark.parametrize(
    "argv, says",
    [
        (["mismatch"], "--model is required"),
        (["mismatch", "--model", "m"], "give --data-dir"),
        (["accuracy", "--task", "chain"], "--task chain takes drift only"),
    ],
)
def test_bad_flags_are_one_line_before_any_load(argv, says, capsys):
    with pytest.raises(SystemExit):
        measure.parse(argv)
    assert says in capsys.readouterr().err
