"""lab/measure.py: the drift measure's two gradients are the train step's; each measure's numbers
(mismatch, drift, accuracy) on the tiny model against a direct computation from its sampler's own
record; its problems are GSM8K lines whose gold answers are their stories' arithmetic."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import train
from helpers import STOP, _prompts
from lab import grouped, measure, tasks
from lab.train_step import make_train_step


def test_the_drift_measures_gradients_are_the_train_steps(tiny):
    """measure.gradients (one forward, a backward for each arm, in calls of 2 rows) against
    make_train_step's (SGD at lr 1: the update is minus the gradient's token mean, over one
    micro-batch), uncentred and centred, on the full log q of the sampler's own rollouts."""
    prompt, pos = _prompts(tiny.tokenizer, 8)
    w_q = train.sampler_weights(tiny.weights, "int8")
    sampler = grouped.make_sampler(tiny.cfg, 10, 0, STOP, dict(mm=train.quant_mm("int8")))
    out = sampler(w_q, prompt, pos, jax.random.PRNGKey(3))
    batch = dict(out, prompt=prompt, pos=pos, adv=jnp.linspace(-1, 1, 8))
    n_tokens = float(out["mask"].sum())
    g_u, g_c, kl_sum = measure.gradients(train, tiny.cfg, tiny.weights, batch, rows=2)
    mesh, opt = Mesh(np.array(jax.devices()[:1]), ("data",)), optax.sgd(1.0)
    for center, g in ((False, g_u), (True, g_c)):
        step = make_train_step(tiny.cfg, opt, 8, mesh, center=center)
        w = jax.tree.map(jnp.copy, tiny.weights)
        new = step(w, opt.init(w), batch)[0]
        old, new = jax.tree.leaves(tiny.weights), jax.tree.leaves(new)
        ref = jnp.concatenate([(a - b).ravel() for a, b in zip(old, new, strict=True)])
        # calls of 1-8 rows, micro-batches of 2-8 and 1 or 4 devices moved it by <= 2e-7
        # (|g| <= 0.13); atol 5x
        np.testing.assert_allclose(g / n_tokens, ref, atol=1e-6)
    assert float(jnp.linalg.norm(g_u - g_c)) > 1e-3 * float(jnp.linalg.norm(g_c))  # a drift term
    logp = grouped.token_logp(tiny.cfg, tiny.weights, batch)  # the trainer's log p, its own pass
    kl = jnp.where(out["mask"], out["logq"] - logp, 0).sum()
    np.testing.assert_allclose(kl_sum, kl, atol=1e-4 * n_tokens)  # the token sum of log q − log p


def recording(records, monkeypatch):
    """train.py, with lab/grouped.py's sampler (the one the measures take) patched so that each call
    of a sampler appends {its prompt, pos and record} to records: what a measure sampled."""
    real = grouped.make_sampler

    def make_sampler(*args, **kwargs):
        sampler = real(*args, **kwargs)

        def sample(w, prompt, pos, key):
            out = sampler(w, prompt, pos, key)
            records.append(jax.device_get(dict(out, prompt=prompt, pos=pos)))
            return out

        return sample

    monkeypatch.setattr(grouped, "make_sampler", make_sampler)
    return train


def even_first(tokens, mask, golds):  # a reward: 1 when a completion's first token is even
    return [float(row[0] % 2 == 0) for row in tokens]


def tiny_measure(tiny, rows=8):
    """A Task of `rows` random prompts (train and test alike) that end at STOP, rewarded by
    even_first; the flags the measures read, as measure.parse and main set them."""
    rng = np.random.default_rng(0)
    problems = [(list(rng.integers(0, 256, n)), "0") for n in rng.integers(3, 12, rows)]
    pad = tiny.tokenizer.pad_id
    task = tasks.Task(tiny.cfg, tiny.weights, STOP, pad, problems, problems, [], even_first, None)
    data = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
    flags = dict(max_tokens=8, rows=rows, micro_batch=4, prompts=2, group=4, n=rows, data=data)
    flags["state_dtype"] = None  # a dense model's: no recurrent state
    return task, types.SimpleNamespace(**flags)


def test_mismatch_is_the_token_mean_of_log_q_minus_log_p(tiny, monkeypatch):
    task, args = tiny_measure(tiny)
    records = []
    r = measure.mismatch(recording(records, monkeypatch), args, task, ("int8", 0.0, None), seed=0)
    (rec,) = records
    mask = rec["mask"]
    logp = np.asarray(grouped.token_logp(tiny.cfg, tiny.weights, rec))
    diff = (rec["logq"] - logp)[mask]  # on q's own samples
    assert r["tokens"] == mask.sum() > 20 and r["rows"] == 8
    assert abs(r["kl_q_p"] - diff.mean()) < 1e-5 < abs(diff.mean()) / 10  # its sign included
    assert abs(r["abs_diff"] - np.abs(diff).mean()) < 1e-5
    head = np.exp(rec["head_logq"]).sum(-1)[mask]  # q's top-128 of 300 tokens
    assert abs(r["head_mass"] - head.mean()) < 1e-5 and 0.4 < r["head_mass"] < 1


def test_drift_is_the_drift_terms_norm_over_the_centred_gradients(tiny, monkeypatch):
    # 2 prompts x 4 rollouts from a sampler with 5% weight noise; the group baseline by hand
    task, args = tiny_measure(tiny)
    records = []
    r = measure.drift(recording(records, monkeypatch), args, task, ("bf16", 0.05, None), seed=0)
    (rec,) = records
    rewards = np.array(even_first(rec["tokens"], rec["mask"], None)).reshape(2, 4)
    adv = (rewards - rewards.mean(1, keepdims=True)).ravel()
    g_u, g_c, _ = measure.gradients(train, tiny.cfg, tiny.weights, dict(rec, adv=adv), rows=4)
    norm_u, norm_c = float(jnp.linalg.norm(g_u)), float(jnp.linalg.norm(g_c))
    norm_d = float(jnp.linalg.norm(g_u - g_c))
    assert abs(norm_u - norm_c) > 0.01 * norm_c  # dividing by |g_u| would show
    assert abs(r["drift_over_signal"] - norm_d / norm_c) < 1e-4 < norm_d / norm_c / 100
    assert abs(r["cos"] - float(g_u @ g_c) / (norm_u * norm_c)) < 1e-4
    assert r["reward"] == rewards.mean() and r["mixed_groups"] == (rewards.std(1) > 0).sum() > 0
    mask = rec["mask"]
    logp = np.asarray(grouped.token_logp(tiny.cfg, tiny.weights, rec))
    kl_q_p = (rec["logq"] - logp)[mask].mean()
    assert r["tokens"] == mask.sum() and abs(r["kl_q_p"] - kl_q_p) < 1e-5 < abs(kl_q_p) / 10


def test_accuracy_is_the_share_rewarded_and_ended_the_share_with_an_eos(tiny, monkeypatch):
    task, args = tiny_measure(tiny)
    records = []
    r = measure.accuracy(recording(records, monkeypatch), args, task, ("bf16", 0.0, None), seed=0)
    (rec,) = records
    rows = zip(rec["tokens"], rec["mask"], strict=True)
    ended = [any(t in STOP for t in row[m]) for row, m in rows]  # an eos among its tokens
    assert r["ended"] == np.mean(ended) and 0 < r["ended"] < 1
    assert r["accuracy"] == np.mean(even_first(rec["tokens"], rec["mask"], None)) and r["n"] == 8


@pytest.mark.parametrize(
    "argv, says",
    [
        (["mismatch"], "--model is required"),
        (["mismatch", "--model", "m"], "give --data-dir"),
        (["accuracy", "--task", "chain"], "--task chain takes drift only"),
        (["drift", "--task", "chain", "--state-dtype", "fp16"], "only chain-hybrid's Qwen3.5"),
    ],
)
def test_bad_flags_are_one_line_before_any_load(argv, says, capsys):
    with pytest.raises(SystemExit):
        measure.parse(argv)
    assert says in capsys.readouterr().err
