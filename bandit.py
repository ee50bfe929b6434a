"""The toy bandit: the mechanism of drift in seconds, through the very same loss.

    python train.py --task bandit --baseline none --compare

The policy is a vector of V logits; the sampler's are the trainer's plus a fixed random offset (a
persistent bias, like a quantiser's). Each rollout is one token (T = 1), rewarded 1 with the arm's
success probability. With raw rewards (--baseline none) the mean advantage is positive, so the drift
term of score_centering.py (step 4) pulls the policy toward the sampler at every step; with the
sampler refreshed from the trainer (online) it walks away without bound, with a frozen one it
stops (step 5). Drift is measured exactly: TV(p_t, p_0). Letters: B = P·G rows, V arms, k the
sampler's top-k head size.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import harness
import score_centering as sc


def bandit(args, center, staleness, out=None):
    """One run; returns the drift TV(p_t, p_0) after every step, and the final numbers."""

    def tv(a, b):  # total variation between the softmaxes of two logit vectors
        return float(0.5 * jnp.abs(jax.nn.softmax(a) - jax.nn.softmax(b)).sum())

    k_success, k_bias, key = jax.random.split(jax.random.PRNGKey(args.seed), 3)
    success = jax.random.uniform(k_success, (args.arms,), minval=0.45, maxval=0.55)  # small signal
    bias = args.weight_noise * jax.random.normal(k_bias, (args.arms,))  # drawn once: persistent
    B, k = args.prompts * args.group, min(args.topk or args.arms, args.arms)
    opt = getattr(optax, args.optimizer)(args.lr)

    @jax.jit
    def step(theta, opt_state, sampler_logits, key):
        k_arm, k_reward = jax.random.split(key)
        logq = jax.nn.log_softmax(sampler_logits)  # [V]
        arms = jax.random.categorical(k_arm, logq, shape=(B, 1))  # [B, T = 1]
        r = jax.random.bernoulli(k_reward, success[arms[:, 0]]).astype(jnp.float32)  # [B]
        head_logq, head_ids = jax.lax.top_k(logq, k)
        head_ids, head_logq = (jnp.broadcast_to(x, (B, 1, k)) for x in (head_ids, head_logq))
        adv = r  # raw rewards, or minus the mean of their group of G (as train.advantage)
        if args.baseline == "group":
            adv = r - r.reshape(-1, args.group).mean(1).repeat(args.group)

        def loss(theta):
            logits = jnp.broadcast_to(theta, (B, 1, args.arms))  # [B, T = 1, V]
            mask = jnp.ones((B, 1), bool)
            return sc.loss(
                logits,
                arms,
                mask,
                adv,
                logq[arms],
                head_ids,
                head_logq,
                center=center,
                tis_cap=args.tis_cap,
                mis=args.mis,
            )

        (_, m), g = jax.value_and_grad(loss, has_aux=True)(theta)
        updates, opt_state = opt.update(g, opt_state, theta)
        m = dict(m, reward=r.mean(), grad_norm=optax.tree.norm(g))
        return optax.apply_updates(theta, updates), opt_state, m

    theta0 = jnp.zeros(args.arms)
    theta, opt_state, curve = theta0, opt.init(theta0), []
    for i in range(args.steps):
        if i % (staleness + 1) == 0:
            sampler_logits = theta + bias  # refreshed from the trainer
        theta, opt_state, m = step(theta, opt_state, sampler_logits, jax.random.fold_in(key, i))
        curve.append(tv(theta, theta0))
        if out is not None and ((i + 1) % args.eval_every == 0 or i in (0, args.steps - 1)):
            row = dict({k: float(v) for k, v in m.items()}, step=i + 1, drift=curve[-1])
            columns = [c for c in harness.COLUMNS if c in row]
            harness.log_step(row, args.steps, columns, out)
    return dict(
        drift=curve[-1],
        gap=tv(theta0 + bias, theta0),
        reward=float(jax.nn.softmax(theta) @ success),
        best_arm=float(success.max()),
        curve=curve,
    )


def report(args, runs):  # runs {(sampler, centred): bandit result}
    print(
        f"\n{args.arms} arms, sampler logit offset std {args.weight_noise}, "
        f"baseline {args.baseline}, {args.steps} steps, lr {args.lr}, seed {args.seed}; "
        f"gap TV(q, p) {runs['online', 0]['gap']:.3f}"
    )
    rows = {f"{s} {'on' if c else 'off'}": r for (s, c), r in runs.items()}
    harness.table("sampler centring", rows, {"drift": "{:.3f}", "reward": "{:.3f}"})
    for (s, c), r in runs.items():
        rows = [
            dict(sampler=s, center=bool(c), step=i + 1, drift=d) for i, d in enumerate(r["curve"])
        ]
        harness.append_rows(args.out, rows)
    if args.plot:
        x = np.arange(1, args.steps + 1)
        curves = {}
        for s, line in (("online", "-"), ("frozen", "--")):
            for c in (0, 1):  # off red, on blue
                label = f"{s} sampler, centring {'on' if c else 'off'}"
                curves[label] = (x, runs[s, c]["curve"], "rb"[c] + line)
        curves["sampler gap at start"] = (x[[0, -1]], [runs["online", 0]["gap"]] * 2, "k:")
        harness.plot(args.plot, [("Toy bandit, raw rewards", "drift  TV(p_t, p_0)", curves)])
    summary = {
        f"{s}_{'centered' if c else 'uncentered'}": {k: v for k, v in r.items() if k != "curve"}
        for (s, c), r in runs.items()
    }
    return harness.write_summary(args.out, summary)


def run(args):
    """One run, or --compare: centring off and on, each with an online and a frozen sampler."""
    if not args.compare:
        res = bandit(args, args.center, args.staleness, args.out or "")
        return harness.write_summary(args.out, {k: v for k, v in res.items() if k != "curve"})
    samplers = (("online", 0), ("frozen", args.steps))
    runs = {(s, c): bandit(args, c, staleness) for s, staleness in samplers for c in (0, 1)}
    return report(args, runs)
