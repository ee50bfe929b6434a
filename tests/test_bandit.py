"""bandit.py: drift online and with a frozen sampler, its table, its bad flags, and that it imports
nothing of the project but score_centering."""

import ast
import math
import os
import sys

import jax
import jax.numpy as jnp
import pytest

import bandit


def test_bandit_online_drift_and_frozen_sampler():
    off, on = (bandit.bandit(center, 0) for center in (False, True))
    assert off["drift"] >= 5 * on["drift"], (off["drift"], on["drift"])
    assert off["curve"][-1] > off["curve"][99] > off["curve"][49]  # steady, growing
    frozen = bandit.bandit(False, 200)
    assert 0.6 * frozen["gap"] <= frozen["drift"] <= 1.3 * frozen["gap"], (
        frozen["drift"],
        frozen["gap"],
    )
    assert off["drift"] >= 3 * frozen["drift"]  # online: far past the gap
    assert frozen["curve"][-1] - frozen["curve"][99] < 0.2 * frozen["gap"]  # frozen: it has stopped


def test_untruncated_importance_sampling_removes_drift_so_centring_changes_nothing():
    """--tis-cap inf weighs each token by p/q: its mass q p/q = p has expected score 0
    (score_centering.py step 9), so the online sampler's drift is gone without centring, and
    centring, which subtracts that mass's expected score, changes nothing."""
    plain = bandit.bandit(False, 0)
    off, on = (bandit.bandit(center, 0, tis_cap=math.inf) for center in (False, True))
    assert off["drift"] <= plain["drift"] / 5, (off["drift"], plain["drift"])
    assert off["curve"] == pytest.approx(on["curve"], abs=1e-6)


def test_group_baseline_subtracts_each_groups_own_mean(monkeypatch):
    """Rewards constant within each group of GROUP rollouts and alternating 1, 0 between groups:
    each group's mean is its reward, so a group baseline makes every advantage 0 and the policy
    never moves (drift exactly 0), while raw rewards (or the batch mean, 1/2) leave advantages
    that move it."""

    def groups_alternate(key, p, shape=None):  # row i: 1 when its group i // GROUP is even
        return jnp.arange(p.shape[0]) // bandit.GROUP % 2 == 0

    monkeypatch.setattr(jax.random, "bernoulli", groups_alternate)
    run = bandit.bandit(False, 0, steps=5, baseline="group")
    assert run["curve"] == [0.0] * 5 and run["drift"] == 0.0, run["curve"]
    raw = bandit.bandit(False, 0, steps=5, baseline="none")
    assert raw["drift"] > 1e-3, raw["drift"]


def test_bandit_main_prints_one_table(capsys):
    runs = bandit.main(["--steps", "30"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("16 arms, ") and "30 steps" in lines[0]
    assert lines[1].split() == ["sampler", "centring", "drift", "reward"]
    table = [line.split() for line in lines[2:]]
    assert [row[:2] for row in table] == [
        [s, c] for s in ("online", "frozen") for c in ("off", "on")
    ]
    for sampler, centring, drift, reward in table:  # the printed numbers are the returned ones
        run = runs[f"{sampler} {centring}"]
        assert float(drift) == pytest.approx(run["drift"], abs=5.1e-4)
        assert float(reward) == pytest.approx(run["reward"], abs=5.1e-4)
    frozen_on = bandit.bandit(True, 30, steps=30)  # that row is this run: frozen sampler, centred
    assert runs["frozen on"]["drift"] == frozen_on["drift"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "0"],
        ["--baseline", "grpo"],
        ["--noise", "nan"],
        ["--noise", "inf"],
        ["--noise", "-1"],
        ["--lr", "inf"],
        ["--lr", "nan"],
        ["--lr", "0"],
        ["--tis-cap", "nan"],
        ["--tis-cap", "0"],
    ],
    ids=" ".join,
)
def test_bandit_bad_flags_stop_before_any_run(argv, monkeypatch, capsys):
    """A number that is not finite, or out of range: refused in one line naming the flag, before
    any run (or a run's worth of time lost)."""

    def fail(*args, **kwargs):
        raise AssertionError("bandit() ran")

    monkeypatch.setattr(bandit, "bandit", fail)
    with pytest.raises(SystemExit) as e:
        bandit.main(argv)
    assert e.value.code == 2, argv
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and argv[0] in errors[0], errors


def test_bandit_imports_no_project_file_but_score_centering():
    folder = os.path.dirname(os.path.abspath(bandit.__file__))
    tree = ast.parse(open(os.path.join(folder, "bandit.py")).read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            imported |= {name.split(".")[0] for name in names}
    project = {f[:-3] for f in os.listdir(folder) if f.endswith(".py")}
    assert imported & project == {"score_centering"}, imported & project
    third_party = imported - set(sys.stdlib_module_names)
    assert third_party <= {"jax", "numpy", "score_centering"}, third_party
