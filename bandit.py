"""The toy bandit: the mechanism of drift in seconds, through the very same loss.

    python bandit.py    # centring off and on, with an online and a frozen sampler; --plot FILE

The policy is a vector of V logits; the sampler's are the trainer's plus a fixed random offset (a
persistent bias, like a quantiser's). Each rollout is one token, rewarded 1 with the arm's success
probability. With raw rewards the mean advantage is positive, so the drift term of
score_centering.py (step 4) pulls the policy toward the sampler at every step: refreshed from the
trainer (online), it walks away without bound; frozen, it stops (step 5). Drift: TV(p_t, p_0).
Letters: B rows, one rollout each; T = 1 token; V arms, the vocabulary; k = V the sampler's head.
"""

import argparse

import jax
import jax.numpy as jnp

import score_centering as sc

V = 16  # arms
B = 256  # rollouts a step: 32 groups of 8 (a bandit has one prompt)
GROUP = 8  # the rollouts of one prompt: --baseline group subtracts their mean


def bandit(
    center, staleness, steps=200, lr=0.5, noise=0.5, baseline="none", seed=0, tis_cap=None, mis=None
):
    """One run of plain SGD: the drift TV(p_t, p_0) after each step (curve), the final numbers."""

    def tv(a, b):  # total variation between the softmaxes of two logit vectors
        return float(0.5 * jnp.abs(jax.nn.softmax(a) - jax.nn.softmax(b)).sum())

    # the toy: arms' success rates and the sampler's offset
    k_success, k_bias, key = jax.random.split(jax.random.PRNGKey(seed), 3)
    success = jax.random.uniform(k_success, (V,), minval=0.45, maxval=0.55)  # small signal
    bias = noise * jax.random.normal(k_bias, (V,))  # drawn once: persistent
    mask = jnp.ones((B, 1), bool)  # [B, T]: every token trained
    options = dict(center=center, tis_cap=tis_cap, mis=mis)  # the loss's switches

    @jax.jit
    def step(theta, sampler_logits, key):
        # sample and score
        k_arm, k_reward = jax.random.split(key)
        logq = jax.nn.log_softmax(sampler_logits)  # [V]
        y = jax.random.categorical(k_arm, logq, shape=(B, 1))  # [B, T]
        head_logq, head_ids = jax.lax.top_k(logq, V)  # [k]: the head the sampler records, all arms
        head_ids, head_logq = (jnp.broadcast_to(x, (B, 1, V)) for x in (head_ids, head_logq))
        r = jax.random.bernoulli(k_reward, success[y[:, 0]]).astype(jnp.float32)  # [B]
        adv = r - r.reshape(-1, GROUP).mean(1).repeat(GROUP) if baseline == "group" else r

        # score-centred loss
        def loss(theta):
            logits = jnp.broadcast_to(theta, (B, 1, V))  # [B, T, V]: one policy for all rows
            return sc.loss(logits, y, mask, adv, logq[y], head_ids, head_logq, **options)[0]

        return theta - lr * jax.grad(loss)(theta)  # plain SGD

    # train
    theta = theta0 = jnp.zeros(V)
    curve = []
    for i in range(steps):
        if i % (staleness + 1) == 0:
            sampler_logits = theta + bias  # refreshed from the trainer (staleness >= steps: frozen)
        theta = step(theta, sampler_logits, jax.random.fold_in(key, i))
        curve.append(tv(theta, theta0))
    gap = tv(theta0 + bias, theta0)  # TV(q, p) at the start
    reward = float(jax.nn.softmax(theta) @ success)  # the final policy's expected reward
    return dict(drift=curve[-1], gap=gap, reward=reward, best_arm=float(success.max()), curve=curve)


def main(argv=None):
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    group = "r - its group's mean (here it removes drift exactly: centring changes nothing)"
    p.add_argument("--baseline", choices=["none", "group"], default="none", help="r, or " + group)
    p.add_argument("--steps", type=int, default=200, help="SGD steps")
    p.add_argument("--lr", type=float, default=0.5, help="learning rate")
    p.add_argument("--noise", type=float, default=0.5, help="std of the sampler's logit offset")
    p.add_argument("--tis-cap", type=float, help="truncated IS, w = min(p/q, C)")
    p.add_argument("--seed", type=int, default=0, help="of the toy and of the rollouts")
    p.add_argument("--plot", metavar="FILE", help="draw drift against steps into FILE (a PNG)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.lr <= 0 or (args.tis_cap is not None and args.tis_cap <= 0):
        p.error("--steps, --lr and --tis-cap must be > 0 (omit --tis-cap for no IS)")
    if args.plot:  # before the runs: fails now if it is not installed
        from matplotlib.figure import Figure  # optional; no pyplot: no window

    # run the four
    options = {k: v for k, v in vars(args).items() if k != "plot"}  # bandit's keywords
    runs = {}
    for sampler, staleness in (("online", 0), ("frozen", args.steps)):
        for center in (False, True):
            runs[f"{sampler} {'on' if center else 'off'}"] = bandit(center, staleness, **options)

    # print the table
    print(
        f"{V} arms, sampler logit offset std {args.noise}, baseline {args.baseline}, {args.steps} "
        f"steps, lr {args.lr}, seed {args.seed}; gap TV(q, p) {runs['online off']['gap']:.3f}"
    )
    print(f"{'sampler centring':22s} {'drift':>5} {'reward':>6}")
    for name, r in runs.items():
        print(f"{name:22s} {r['drift']:5.3f} {r['reward']:6.3f}")

    # the figure: drift against steps, online solid, frozen dashed; off red, on blue
    if args.plot:
        ax = Figure(figsize=(5.5, 3.3), dpi=100, layout="tight").subplots()
        for name, r in runs.items():
            style = ("r" if name.endswith("off") else "b") + ("-" if "online" in name else "--")
            ax.plot(range(1, args.steps + 1), r["curve"], style, label=name)
        ax.axhline(r["gap"], color="k", ls=":", lw=0.8, label="sampler gap at start")
        title = f"Toy bandit, {'raw rewards' if args.baseline == 'none' else 'group baseline'}"
        ax.set(xlabel="step", ylabel="drift  TV(p_t, p_0)", title=title)
        ax.legend(title="sampler, centring", fontsize=7, title_fontsize=7, frameon=False)
        ax.figure.savefig(args.plot)
    return runs


if __name__ == "__main__":
    main()
