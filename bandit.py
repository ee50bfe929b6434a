"""The toy bandit, standalone (of this project it imports score_centering alone): the mechanism of
drift in seconds, through the very same loss.

    python bandit.py    # centring off and on, with an online and a frozen sampler

The policy is V logits; the sampler's are the trainer's plus a fixed random offset (a persistent
bias, like a quantiser's). A rollout is one token, rewarded 1 with its arm's success rate. With raw
rewards the mean advantage is positive, so score_centering.py's drift term (step 4) pulls the
policy toward the sampler every step: refreshed from the trainer (online), it walks without bound
in logits (drift, TV(p_t, p_0), nears its maximum 1 − 1/V); frozen, it stops. B rows, T = 1, k = V.
"""

import argparse

import jax
import jax.numpy as jnp

import score_centering as sc

V = 16  # arms
B = 256  # rollouts a step, all of the bandit's one prompt: 32 groups of GROUP
GROUP = 8  # --baseline group subtracts the mean of each group of 8 rows


def bandit(center, staleness, steps=200, lr=0.5, noise=0.5, baseline="none", seed=0, tis_cap=None):
    """One run of plain SGD: the drift TV(p_t, p_0) after each step (curve), the final numbers."""

    def tv(a, b):  # total variation between the softmaxes of two logit vectors
        return float(0.5 * jnp.abs(jax.nn.softmax(a) - jax.nn.softmax(b)).sum())

    # the toy: arms' success rates and the sampler's offset
    k_success, k_bias, key = jax.random.split(jax.random.PRNGKey(seed), 3)
    success = jax.random.uniform(k_success, (V,), minval=0.45, maxval=0.55)  # small signal
    bias = noise * jax.random.normal(k_bias, (V,))  # drawn once: persistent
    mask = jnp.ones((B, 1), bool)  # [B, T] with T = 1: a rollout is one token, the arm pulled
    tis = None if tis_cap is None else sc.tis(tis_cap)  # a token's weight min(p/q, C), or none

    @jax.jit
    def step(theta, sampler_logits, key):
        # sample and score
        k_arm, k_reward = jax.random.split(key)
        logq = jax.nn.log_softmax(sampler_logits)  # [V]
        y = jax.random.categorical(k_arm, logq, shape=(B, 1))  # [B, T]
        head = [jnp.broadcast_to(x, (B, 1, V)) for x in jax.lax.top_k(logq, V)]  # k = V: all arms
        rewards = jax.random.bernoulli(k_reward, success[y[:, 0]]).astype(jnp.float32)  # [B]
        means = rewards.reshape(-1, GROUP).mean(1).repeat(GROUP)  # [B]: each row's group mean
        adv = rewards - means if baseline == "group" else rewards

        # score-centred loss
        def loss(theta):
            logits = jnp.broadcast_to(theta, (B, 1, V))  # [B, T, V]: one policy for all rows
            return sc.loss(logits, y, mask, adv, logq[y], *head, center=center, correction=tis)[0]

        return theta - lr * jax.grad(loss)(theta)  # plain SGD

    # train
    theta = theta0 = jnp.zeros(V)
    curve = []
    for i in range(steps):
        if i % (staleness + 1) == 0:
            sampler_logits = theta + bias  # refreshed from the trainer (staleness >= steps: frozen)
        theta = step(theta, sampler_logits, jax.random.fold_in(key, i))
        curve.append(tv(theta, theta0))
    reward = float(jax.nn.softmax(theta) @ success)  # the final policy's expected reward
    return dict(drift=curve[-1], gap=tv(theta0 + bias, theta0), reward=reward, curve=curve)


def main(argv=None):
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    group = "r - its group's mean: one prefix for all: drift goes exactly, centring changes nothing"
    p.add_argument("--baseline", choices=["none", "group"], default="none", help="r, or " + group)
    p.add_argument("--steps", type=int, default=200, help="SGD steps")
    p.add_argument("--lr", type=float, default=0.5, help="learning rate")
    p.add_argument("--noise", type=float, default=0.5, help="std of the sampler's logit offset")
    p.add_argument("--tis-cap", type=float, help="truncated IS, weight min(p/q, C)")
    p.add_argument("--seed", type=int, default=0, help="of the toy and of the rollouts")
    args = p.parse_args(argv)
    cap_ok = args.tis_cap is None or args.tis_cap > 0  # omitted: no IS; inf: untruncated IS
    if not (args.steps >= 1 and 0 < args.lr < jnp.inf and 0 <= args.noise < jnp.inf and cap_ok):
        p.error("--steps >= 1, --lr finite > 0, --noise finite >= 0, --tis-cap > 0 (or omit it)")

    # run the four, then print their table
    options = vars(args)  # the flags: bandit's keywords
    runs = {}
    for sampler, staleness in (("online", 0), ("frozen", args.steps)):
        for center in (False, True):
            runs[f"{sampler} {'on' if center else 'off'}"] = bandit(center, staleness, **options)
    print(
        f"{V} arms, sampler logit offset std {args.noise}, baseline {args.baseline}, {args.steps} "
        f"steps, lr {args.lr}, seed {args.seed}; gap TV(q, p) {runs['online off']['gap']:.3f}"
    )
    print(f"{'sampler centring':22s} {'drift':>5} {'reward':>6}")
    for name, r in runs.items():
        print(f"{name:22s} {r['drift']:5.3f} {r['reward']:6.3f}")
    return runs


if __name__ == "__main__":
    main()
