"""Score centering: a drift-free policy-gradient loss for RL whose sampler's numerics differ.

Marek & Ryabinin, "Score Centering Stabilizes Off-policy Reinforcement Learning", arXiv 2609.20807
(2026). Shapes: B rows, T token positions, V vocabulary, k the sampler's top-k head size.
"""

# The derivation, one step per number; its last step is the line `loss` ends on. Steps 1 to 8
# are the method; 9 to 11 add importance weights and the sampler's top-k head. A case to check
# by hand: V = 3, p = (.5, .3, .2), q = (.6, .3, .1), head {0}, y = 1 (test_score_centering.py).
# Notation: prefix h (the prompt and the tokens before t); trainer p(v) = p_θ(v | h);
# sampler q(v) = q(v | h); score s_v = ∇_θ log p(v); A the rollout's advantage; y the sampled
# token; z the trainer's logits, with ∇_z log p(v) = e_v − p.
#
# 1. The sampler q generates the rollouts, so the usual REINFORCE estimate of the policy gradient
#    has one term per generated token: g = A · s_y, y ~ q (biased when q ≠ p: step 3).
# 2. Zero-mean score lemma: Σ_v p(v) s_v = ∇_θ Σ_v p(v) = ∇_θ 1 = 0. On-policy (y ~ p), a part
#    of A that does not depend on y (a baseline, a constant reward) adds no expected gradient.
# 3. Off-policy the lemma fails: E_{y~q}[s_y] = Σ_v q(v) s_v =: s̄_q ≠ 0. In logit space
#    s̄_q = q − p, which is −∇_z CE(q, p): the direction that distils p toward q.
# 4. Split the expected update at one prefix: E_q[A s_y] = E_q[A | h] · s̄_q + Cov_q(A, s_y).
#    The first term is drift: it says nothing about which token was better, vanishes only when
#    q = p or E_q[A | h] = 0, and follows the sign of the prefix's mean advantage (positive pulls
#    p toward q, negative pushes it away). The second term is the signal.
# 5. Drift accumulates. A sampler rebuilt from each step's weights carries the same bias again
#    (same quantiser, same noise): the target moves with p, so the pull never ends (no bound).
#    A frozen q is a fixed target: pulled, p stops at it; pushed, no bound. A stale one trails p.
# 6. A group-mean baseline (GRPO) zeroes the group's mean advantage, not E_q[A | h] at each prefix:
#    drift survives it in sequences (in a one-step bandit, one prefix for all, it vanishes exactly).
# 7. Score centering subtracts the sampler-expected score from every token's score:
#    s̃_y = s_y − Σ_v q(v) s_v. Then E_q[s̃_y] = 0 and E_q[A s̃_y] = Cov_q(A, s_y): drift gone,
#    signal kept (weighted by q, not p; step 9's importance weights reweight it toward p). In
#    logit space the centred score is e_y − q instead of e_y − p.
# 8. As a loss per trained token, with sg = stop-gradient (q is data, never differentiated):
#    ℓ_t = −sg(A) · [log p(y_t) − Σ_v sg(q(v)) · log p(v)].
#    The batch loss is the mean over trained tokens, each weighted the same at any sequence length.
# 9. Importance weights. A detached weight f(r) of each token's ratio r = p/q multiplies its
#    score; under y ~ q a token v then enters with the mass m_v = q(v) f(r_v), not q(v), so
#    centring subtracts Σ_v m_v s_v: ℓ_t = −sg(A) · [sg(f(r_y)) log p(y) − Σ_v sg(m_v) log p(v)].
#    By hand, TIS (f(r) = min(r, C)) at C = 1.5 on the case above: r = p/q = (.83, 1, 2), so
#    f = (.83, 1, 1.5) and m = q f = (.5, .3, .15) = min(p, C q). As a function of two masses,
#    m(q, p) = q f(p/q) (steps 10, 11 use it). Every weight here (`Correction`) is a band (lo, hi)
#    for each sign of A: f(r) = r inside; outside, r clamped into it or f = 0. One band for every v:
#    centred, a constant A of either sign has no expected update. GSPO, TOPR weigh a row: A -> w A.
# 10. Top-k. q over a 151k vocabulary at every token is too big to keep: the sampler records its
#     head, its k most likely ids and their log q. Off the head, model q as the trainer's p
#     scaled by the tail ratio ρ to the mass q leaves there (FLOOR bounds both from below):
#         q̂(v) = q(v) on the head,  ρ p(v) off it,  ρ = (1 − Σ_head q) / (1 − Σ_head p).
#     Every tail token has the same ratio p / q̂ = 1/ρ, so its mass is ρ p f(1/ρ) = α p, with
#         α = ρ f(1/ρ) = m(ρ, 1)   (no IS: ρ; TIS: min(1, C ρ); MIS: 1 if lo ≤ 1/ρ ≤ hi, else 0).
# 11. No tail logits are needed (m̂ = m on the head, α p off it): write Σ_tail as Σ_v − Σ_head,
#         Σ_v sg(m̂_v) log p(v) = Σ_head m_v log p(v) + α Σ_tail sg(p(v)) log p(v)
#             = Σ_head m_v log p(v) + α [Σ_v sg(p(v)) log p(v) − Σ_head sg(p(v)) log p(v)]
#             = Σ_head c_v log p(v) − α · entropy(p),   with c_v = sg(m_v − α p(v)).
#     The entropy term's gradient, α Σ_v p(v) s_v, is zero (step 2): it enters detached, for
#     the loss's value alone. With the whole vocabulary as head the α terms cancel: step 9
#     exactly, whatever α is. `loss` ends on (the minus before the sum makes it + entropy)
#         ℓ_t = −sg(A) · [sg(f(r_y)) log p(y) − Σ_head c_v log p(v) + sg(α · entropy(p))],
#     whose gradient in logit space is −A · [f(r_y) (e_y − p) − Σ_head c_v (e_v − p)].
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

FLOOR = 1e-6  # of the tail masses in the top-k model (step 10)


class Correction(NamedTuple):
    """Step 9's weight f(r) of the detached ratio r = p/q: r inside a band, clamped or 0 outside."""

    name: str
    positive: tuple  # the band (lo, hi) where A > 0
    negative: tuple  # the band where A ≤ 0
    clamp: bool = False  # outside the band: r clamped into it (True) or the token dropped (f = 0)
    level: str = "token"  # or one weight per row: "sequence" (GSPO), "trajectory" (TOPR)


NONE = Correction("none", (1.0, 1.0), (1.0, 1.0), clamp=True)  # f = 1 for any r: m = q, α = ρ


def tis(cap):  # truncated IS: f(r) = min(r, C)
    return Correction("tis", (0.0, cap), (0.0, cap), clamp=True)


def mis(lo, hi):  # masked IS (IcePop): f(r) = r in [lo, hi], 0 outside
    return Correction("mis", (lo, hi), (lo, hi))


def ppo(eps_low, eps_high, dual_clip=jnp.inf):  # PPO, DAPO: the clipped surrogate's gradient, q old
    return Correction("ppo", (0.0, 1 + eps_high), (1 - eps_low, dual_clip))


def cispo(eps_low, eps_high):  # CISPO: r clamped into [1 − ε_low, 1 + ε_high], no token dropped
    return Correction("cispo", (1 - eps_low, 1 + eps_high), (1 - eps_low, 1 + eps_high), True)


def gspo(eps_low, eps_high):  # GSPO: PPO's band on the geometric mean of a row's ratios
    return Correction("gspo", (0.0, 1 + eps_high), (1 - eps_low, jnp.inf), level="sequence")


def topr():  # TOPR: rows with A > 0 weigh 1, with A ≤ 0 their product of ratios capped at 1
    return Correction("topr", (1.0, 1.0), (0.0, 1.0), clamp=True, level="trajectory")


def log_mass(corr, logq, logp, positive):
    """Step 9's m(q, p) = q f(p/q) in logs (f at A's sign); gives m, f(r) = m(1, r), α = m(ρ, 1)."""
    lo = jnp.log(jnp.where(positive, corr.positive[0], corr.negative[0]))  # the band, in logs
    hi = jnp.log(jnp.where(positive, corr.positive[1], corr.negative[1]))
    if corr.clamp:  # log r clamped into [lo, hi]: log p into log q + [lo, hi] (hi = inf: no top)
        logm = jnp.maximum(logp, logq + lo)
        return jnp.where(hi == jnp.inf, logm, jnp.minimum(logm, logq + hi))
    log_r = logp - logq  # NaN where p = q = 0: outside any band, so m = 0 = p there
    return jnp.where((log_r >= lo) & (log_r <= hi), logp, -jnp.inf)


def loss(
    logits,
    tokens,
    mask,
    advantages,
    sampler_logprobs,
    head_logprobs=None,
    head_ids=None,
    *,
    center=True,
    correction=None,
):
    """Token-mean policy-gradient loss with optional score centering and one importance weight.

    logits [B, T, V]: the trainer's logits at the positions that predicted `tokens` [B, T];
    mask [B, T] (True = trained); advantages [B] or [B, T] (detached); sampler_logprobs [B, T];
    head_logprobs, head_ids [B, T, k]: the sampler's top-k log q (normalised over the full
    vocabulary) and ids, as jax.lax.top_k returns them; or the full log q [B, T, V] alone (exact);
    correction: a Correction (tis, mis, ppo, cispo, gspo, topr) or None, no weight (step 9).
    Returns (loss, metrics). Ids outside [0, V) raise ValueError on concrete inputs, NaN under jit.
    """
    # inputs
    logits, tokens, mask = jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(mask, bool)
    advantages, sampler_logprobs = jnp.asarray(advantages), jnp.asarray(sampler_logprobs)
    head_ids = None if head_ids is None else jnp.asarray(head_ids)  # optional
    head_logprobs = None if head_logprobs is None else jnp.asarray(head_logprobs)
    _check_arrays(logits, tokens, mask, advantages, sampler_logprobs, head_ids, head_logprobs)
    _check_options(center, correction, head_logprobs)
    sg = jax.lax.stop_gradient
    n_tokens = jnp.maximum(mask.sum(), 1).astype(jnp.float32)  # trained tokens

    def trained(x):  # float inputs at masked tokens may be garbage (NaN, inf): zeroed first
        return jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - 2)), x, 0)

    def token_mean(x):  # step 8
        return jnp.where(mask, x, 0.0).sum() / n_tokens

    # log-probs and advantages
    logp = jax.nn.log_softmax(trained(logits.astype(jnp.float32)), axis=-1)  # [B, T, V]
    logp_y = _gather(logp, tokens[..., None])[..., 0]  # [B, T]
    logq_y = sg(trained(sampler_logprobs.astype(jnp.float32)))
    A = sg(advantages.astype(jnp.float32))  # a constant
    A = trained(A[:, None] if A.ndim == 1 else A)

    # diagnostics
    log_ratio = sg(logp_y - logq_y)  # log p(y)/q(y)
    p_logp = jnp.where(logp == -jnp.inf, 0.0, jnp.exp(logp) * logp)  # 0 log 0 = 0 (-inf logits)
    entropy = sg(-p_logp.sum(-1))  # [B, T]
    metrics = dict(
        kl_q_p=token_mean(-log_ratio),
        logprob_gap=token_mean(jnp.abs(log_ratio)),
        entropy=token_mean(entropy),
    )

    # the correction (step 9): a token's weight multiplies its score, a row's its advantage
    corr, log_r = correction or NONE, log_ratio
    if corr.level != "token":  # the mean (GSPO) or sum (TOPR) of the row's log r, at each token
        n = mask.sum(-1, keepdims=True) if corr.level == "sequence" else 1
        log_r = jnp.where(mask, log_ratio, 0.0).sum(-1, keepdims=True) / jnp.maximum(n, 1)
    log_f = log_mass(corr, 0.0, log_r, A > 0)  # [B, T] log f(r), as f(r) = m(1, r); NONE: 0
    if correction is not None:  # the share of tokens weighted other than by their (row's) r
        metrics["clipped"] = token_mean(log_f != log_r)
    if corr.level != "token":  # a row's weight scales its advantage; its tokens enter with m = q
        A, corr, log_f = A * jnp.exp(log_f), NONE, jnp.zeros_like(log_ratio)
    f_y = jnp.exp(log_f)  # sg(f(r_y)): a weight 0 weighs 0, even at p(y) = 0 (a -inf logit)
    score = jnp.where(f_y == 0, 0.0, f_y * logp_y)  # sg(f(r_y)) log p(y)
    if head_logprobs is None:  # uncentred (center=False), and no head to measure: done
        return -token_mean(jnp.where(A == 0, 0.0, A * score)), metrics  # A = 0: 0, at p(y) = 0 too

    # tail model (step 10). Exact (no head_ids): head = V, α's terms cancel to Σ m log p (step 11)
    logq_head = sg(trained(head_logprobs.astype(jnp.float32)))  # [B, T, k]
    logp_head = logp if head_ids is None else _gather(logp, head_ids)  # [B, T, k]
    sg_logp_head = sg(logp_head)
    q_mass, p_mass = jnp.exp(logq_head).sum(-1), jnp.exp(sg_logp_head).sum(-1)  # [B, T]
    rho = jnp.maximum(1 - q_mass, FLOOR) / jnp.maximum(1 - p_mass, FLOOR)  # tail: q̂ = ρ p
    rho = rho if head_ids is not None else jnp.ones_like(rho)  # exact: no tail (1 − mass: rounding)

    # head coefficients c = m − α p (steps 10 and 11)
    m_head = jnp.exp(log_mass(corr, logq_head, sg_logp_head, (A > 0)[..., None]))  # [B, T, k]
    alpha = jnp.exp(log_mass(corr, jnp.log(rho), 0.0, A > 0))  # [B, T] the tail's α = m(ρ, 1)
    c_head = m_head - alpha[..., None] * jnp.exp(sg_logp_head)  # [B, T, k]
    metrics["head_mass_q"], metrics["head_mass_p"] = token_mean(q_mass), token_mean(p_mass)
    metrics["tail_ratio_log"] = token_mean(jnp.log(rho))  # 0 where q̂ = p off the head
    metrics["tail_ratio_max"] = jnp.where(mask, rho, 0.0).max()
    metrics["tail_ratio_over_2"] = token_mean(rho > 2)  # p / q̂ = 1/ρ below IcePop's floor 0.5
    # the drift a unit of A brings (step 4, in logits): m̂ − M p, M = Σ_v m̂_v; its size, Σ_v |·|
    M = m_head.sum(-1) + alpha * (1 - p_mass)
    on_head = jnp.abs(m_head - M[..., None] * jnp.exp(sg_logp_head)).sum(-1)
    metrics["drift_size"] = token_mean(on_head + jnp.abs(alpha - M) * (1 - p_mass))  # + tail

    # the line that removes the drift: step 11's bracket (c log p = 0 where c = 0, at p = 0 too)
    if center:
        score = score - jnp.where(c_head == 0, 0.0, c_head * logp_head).sum(-1) + alpha * entropy
    return -token_mean(jnp.where(A == 0, 0.0, A * score)), metrics  # A = 0 (a dropped row): 0


def _gather(logp, ids):
    """logp at ids on the last axis; an id out of range (only under jit) gives NaN, never a wrap."""
    return jnp.take_along_axis(
        logp, ids, -1, mode="fill", fill_value=jnp.nan, wrap_negative_indices=False
    )


def _check_arrays(logits, tokens, mask, advantages, sampler_logprobs, head_ids, head_logprobs):
    """Raise ValueError on inconsistent shapes or ids; runs at trace time, before any compute."""
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {logits.shape}")
    B, T, V = logits.shape
    for name, x in (("tokens", tokens), ("mask", mask), ("sampler_logprobs", sampler_logprobs)):
        if x.shape != (B, T):
            raise ValueError(f"{name} must be [B, T] = {(B, T)} as logits are, got {x.shape}")
    if advantages.shape not in ((B,), (B, T)):
        raise ValueError(f"advantages must be [B] or [B, T] = {(B, T)}, got {advantages.shape}")
    _check_head(head_ids, head_logprobs, B, T, V)
    _check_ids("tokens", tokens, logits.shape)
    if head_ids is not None:
        _check_ids("head_ids", head_ids, logits.shape)


def _check_head(head_ids, head_logprobs, B, T, V):
    """Raise ValueError unless the head is [B, T, k] log q and ids, or the full log q alone."""
    if head_ids is None and head_logprobs is not None and head_logprobs.shape != (B, T, V):
        raise ValueError(
            f"head_logprobs without head_ids must be the full sampler log-softmax [B, T, V] = "
            f"{(B, T, V)}, got {head_logprobs.shape}; pass head_ids for a top-k head"
        )
    if head_ids is None:
        return
    if head_logprobs is None:
        raise ValueError("head_ids given without head_logprobs: pass the sampler's log q there")
    if head_ids.shape[:-1] != (B, T) or head_logprobs.shape != head_ids.shape:
        raise ValueError(
            f"head_ids and head_logprobs must both be [B, T, k] with B, T = {(B, T)}, got "
            f"head_ids {head_ids.shape} and head_logprobs {head_logprobs.shape}"
        )


def _check_ids(name, ids, shape):
    """Raise ValueError unless ids are integers, and (when their values are known) in [0, V)."""
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        swap = " (swapped? as jax.lax.top_k gives them: log q, then ids)" * (name != "tokens")
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}{swap}")
    if isinstance(ids, jax.core.Tracer) or not ids.size:  # values unknown under jit: _gather
        return
    lo, hi = int(np.asarray(ids).min()), int(np.asarray(ids).max())
    if lo < 0 or hi >= shape[-1]:
        raise ValueError(f"{name} holds ids in [{lo}, {hi}], outside [0, V) for logits {shape}")


def _check_options(center, c, head_logprobs):
    """Raise ValueError on options that contradict each other or the inputs."""
    if center and head_logprobs is None:
        raise ValueError(
            "center=True needs the sampler's distribution: pass head_logprobs and head_ids "
            "(top-k) or head_logprobs alone (full [B, T, V] log-softmax, exact centring)"
        )
    bands = (c.positive, c.negative) if isinstance(c, Correction) else [()]
    ok = all(
        len(b) == 2 and 0 <= b[0] <= b[1] and 0 < b[1] and (c.clamp or b[0] < b[1]) for b in bands
    )
    if c is not None and not (ok and c.level in ("token", "sequence", "trajectory")):
        raise ValueError(
            f"correction must be made by tis, mis, ppo, cispo, gspo or topr, with bands 0 ≤ lo ≤ "
            f"hi ≤ inf, 0 < hi (lo < hi where it drops), got {c}"
        )
