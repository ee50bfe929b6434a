"""Score centering: a drift-free policy-gradient loss for RL with a sampler whose numerics differ
from the trainer's.

Marek & Ryabinin, "Score Centering Stabilizes Off-policy Reinforcement Learning", arXiv 2609.20807
(2026). Shapes: B rows, T token positions, V vocabulary, k the sampler's top-k head size.
"""

# The derivation, one step per number; its last step is the line `loss` ends on. Steps 1 to 8
# are the method; 9 to 11 add importance weights and the sampler's top-k head.
# Notation: prefix h (the prompt and the tokens before t); trainer p(v) = p_θ(v | h);
# sampler q(v) = q(v | h); score s_v = ∇_θ log p(v); A the rollout's advantage; y the sampled
# token; z the trainer's logits, with ∇_z log p(v) = e_v − p.
#
# 1. The sampler q generates the rollouts, so REINFORCE estimates the policy gradient with one
#    term per generated token: g = A · s_y, y ~ q.
# 2. Zero-mean score lemma: Σ_v p(v) s_v = ∇_θ Σ_v p(v) = ∇_θ 1 = 0. On-policy (y ~ p), a part
#    of A that does not depend on y (a baseline, a constant reward) adds no expected gradient.
# 3. Off-policy the lemma fails: E_{y~q}[s_y] = Σ_v q(v) s_v =: s̄_q ≠ 0. In logit space
#    s̄_q = q − p, which is −∇_z CE(q, p): the direction that distils p toward q.
# 4. Split the expected update at one prefix: E_q[A s_y] = E_q[A | h] · s̄_q + Cov_q(A, s_y).
#    The first term is drift: it says nothing about which token was better, vanishes only when
#    q = p or E_q[A | h] = 0, and follows the sign of the prefix's mean advantage (positive pulls
#    p toward q, negative pushes it away). The second term is the signal.
# 5. Drift accumulates. The sampler, rebuilt from each step's weights, is biased the same way
#    again (same quantiser, same noise): a target that moves with p, no bound in logits. A frozen
#    one is a fixed target: pulled, p stops at it; pushed, no bound. A stale one trails p instead.
# 6. A group-mean baseline (GRPO) zeroes the group's mean advantage, not E_q[A | h] at each prefix:
#    drift survives it in sequences (in a one-step bandit, one prefix for all, it vanishes exactly).
# 7. Score centering subtracts the sampler-expected score from every token's score:
#    s̃_y = s_y − Σ_v q(v) s_v. Then E_q[s̃_y] = 0 and E_q[A s̃_y] = Cov_q(A, s_y): drift gone,
#    signal kept (weighted by q, not p; step 9's importance weights reweight it toward p). In
#    logit space the centred score is e_y − q instead of e_y − p.
# 8. As a loss per trained token, with sg = stop-gradient (q is data, never differentiated):
#    ℓ_t = −sg(A) · [log p(y_t) − Σ_v sg(q(v)) · log p(v)].
#    The batch loss is the mean over trained tokens, each weighted the same at any sequence length.
# 9. Importance weights. A weight f(r) of each token's detached ratio r = p/q multiplies its
#    score (TIS caps it, MIS drops tokens whose ratio is far off). Under y ~ q a token v then
#    enters with the mass m_v = q(v) f(r_v) instead of q(v), so centring subtracts Σ_v m_v s_v:
#    ℓ_t = −sg(A) · [sg(f(r_y)) log p(y) − Σ_v sg(m_v) log p(v)].
#    `loss` takes the weight as its mass m(q, p) = q f(p/q), in logs; f(r) = m(1, r). No IS:
#    m = q. TIS: f(r) = min(r, C), m = min(p, C q). MIS (miles' `mis`, verl's IcePop): f(r) = r
#    in a band [lo, hi], 0 outside, so m = p in it, 0 outside. Full IS (f(r) = r, m = p)
#    subtracts Σ_v p s_v = 0: it is drift-free already (step 2), at the price of its variance.
# 10. Top-k. q over a 151k vocabulary at every token is too big to keep: the sampler records its
#     head, its k most likely ids and their log q. Off the head, model q as the trainer's p
#     scaled to the mass that q leaves there (FLOOR bounds both masses from below):
#         q̂(v) = q(v) on the head,  ρ p(v) off it,  ρ = (1 − Σ_head q) / (1 − Σ_head p).
#     Every tail token has the same ratio p / q̂ = 1/ρ, so its mass is m(ρ p, p) = α p, with
#         α = m(ρ, 1) = ρ f(1/ρ)   (no IS: ρ; TIS: min(1, C ρ); MIS: 1 if lo ≤ 1/ρ ≤ hi, else 0).
# 11. The value needs no tail logits (m̂: m on the head, α p off it): the tail is all less the head,
#         Σ_v sg(m̂_v) log p(v) = Σ_head m_v log p(v) + α Σ_tail sg(p(v)) log p(v)
#             = Σ_head m_v log p(v) + α [Σ_v sg(p(v)) log p(v) − Σ_head p(v) log p(v)]
#             = Σ_head c_v log p(v) − α · entropy(p),   with c_v = sg(m_v − α p(v)).
#     The entropy term's gradient, α Σ_v p(v) s_v, is zero (step 2): it enters detached, for
#     the loss's value alone. With the whole vocabulary as head the α terms cancel: step 9
#     exactly, whatever α is. `loss` ends on (the minus before the sum makes it + entropy)
#         ℓ_t = −sg(A) · [sg(f(r_y)) log p(y) − Σ_head c_v log p(v) + sg(α · entropy(p))],
#     whose gradient in logit space is −A · [f(r_y) (e_y − p) − Σ_head c_v (e_v − p)].
# A case to check by hand (test_score_centering.py pins it): V = 3, p = (0.5, 0.3, 0.2),
#     q = (0.6, 0.3, 0.1), a head of k = 1: token 0. ρ = 0.4 / 0.5 = 0.8: q̂ = (0.6, 0.24, 0.16).
#     No IS: m_0 = q_0 = 0.6, α = ρ = 0.8, c_0 = 0.6 − 0.8 · 0.5 = 0.2, and the centring term
#     c_0 (e_0 − p) = (0.1, −0.06, −0.04) is q̂ − p. MIS in [0.5, 1.2]: r_0 = 5/6 is in, m_0 =
#     p_0 = 0.5; the tail's 1/ρ = 1.25 is out, α = 0: c_0 = 0.5, the term (0.25, −0.15, −0.1).
#     Exact centring, no IS (k = 3): q − p = (0.1, 0, −0.1).
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

FLOOR = 1e-6  # of the tail masses in the top-k model (step 10)


def no_is(logq, logp):  # step 9's mass m(q, p) = q f(p/q) in logs, for f = 1: m = q
    return logq


def truncated_is(logq, logp, cap):  # TIS, f(r) = min(r, C): m = min(p, C q)
    return jnp.minimum(logp, jnp.log(cap) + logq)


def masked_is(logq, logp, lo, hi):  # MIS, f(r) = r in the band [lo, hi], else 0: m = p or 0
    log_r = logp - logq  # NaN where p = q = 0: outside any band, so m = 0 = p there
    return jnp.where((log_r >= jnp.log(lo)) & (log_r <= jnp.log(hi)), logp, -jnp.inf)


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
    tis_cap=None,
    mis=None,
):
    """Token-mean policy-gradient loss with optional score centering and truncated or masked IS.

    logits [B, T, V]: the trainer's logits at the positions that predicted `tokens` [B, T];
    mask [B, T] (True = trained); advantages [B] or [B, T] (detached);
    sampler_logprobs [B, T] = log q(tokens);
    head_logprobs, head_ids [B, T, k]: the sampler's top-k log q (normalised over the full
    vocabulary) and ids, as jax.lax.top_k returns them; or the full log q [B, T, V] alone (exact);
    tis_cap C: weight min(p/q, C); mis (lo, hi): weight p/q inside the band, 0 outside (not both).
    Returns (loss, metrics). Ids outside [0, V) raise ValueError on concrete inputs, NaN under jit.
    """
    # inputs
    logits, tokens, mask = jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(mask)
    advantages, sampler_logprobs = jnp.asarray(advantages), jnp.asarray(sampler_logprobs)
    head_ids = None if head_ids is None else jnp.asarray(head_ids)  # optional
    head_logprobs = None if head_logprobs is None else jnp.asarray(head_logprobs)
    _check_arrays(logits, tokens, mask, advantages, sampler_logprobs, head_ids, head_logprobs)
    _check_options(center, tis_cap, mis, head_logprobs)
    sg = jax.lax.stop_gradient
    mask = mask.astype(bool)
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

    # the importance weight, as its mass m(q, p) = q f(p/q) in logs (step 9)
    log_m, weighted = no_is, None
    if tis_cap is not None:
        log_m, weighted = partial(truncated_is, cap=tis_cap), "tis_capped"
    if mis is not None:
        log_m, weighted = partial(masked_is, lo=mis[0], hi=mis[1]), "mis_masked"
    log_f_y = log_m(0.0, log_ratio)  # log f(r_y), as f(r) = m(1, r)
    if weighted:  # the share of tokens weighted below their r (TIS: capped; MIS: masked)
        metrics[weighted] = token_mean(log_f_y < log_ratio)
    f_y = jnp.exp(log_f_y)  # sg(f(r_y)): a weight 0 weighs 0, even at p(y) = 0 (a -inf logit)
    score = jnp.where(f_y == 0, 0.0, f_y * logp_y)  # sg(f(r_y)) log p(y)
    if head_logprobs is None:  # no sampler distribution: nothing to centre
        return -token_mean(A * score), metrics

    # tail model (step 10)
    logq_head = sg(trained(head_logprobs.astype(jnp.float32)))  # [B, T, k]
    logp_head = logp if head_ids is None else _gather(logp, head_ids)  # [B, T, k]
    sg_logp_head = sg(logp_head)
    q_mass, p_mass = jnp.exp(logq_head).sum(-1), jnp.exp(sg_logp_head).sum(-1)  # [B, T]
    rho = jnp.maximum(1 - q_mass, FLOOR) / jnp.maximum(1 - p_mass, FLOOR)  # tail: q̂ = ρ p

    # head coefficients c = m − α p (steps 10 and 11)
    m_head = jnp.exp(log_m(logq_head, sg_logp_head))  # [B, T, k] m = m(q, p)
    alpha = jnp.exp(log_m(jnp.log(rho), 0.0))  # [B, T] the tail's α = m(ρ, 1)
    c_head = m_head - alpha[..., None] * jnp.exp(sg_logp_head)  # [B, T, k]
    metrics["head_mass_q"] = token_mean(q_mass)
    metrics["head_mass_p"] = token_mean(p_mass)
    metrics["correction"] = token_mean(jnp.abs(c_head).sum(-1))

    # centred score: step 11's bracket; c log p = 0 where c = 0, even at p = 0 (a -inf logit)
    if center:
        score = score - jnp.where(c_head == 0, 0.0, c_head * logp_head).sum(-1) + alpha * entropy
    return -token_mean(A * score), metrics


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
            raise ValueError(
                f"{name} must be [B, T] = {(B, T)} like logits {logits.shape}, got {x.shape}"
            )
    if advantages.shape not in ((B,), (B, T)):
        raise ValueError(
            f"advantages must be [B] = {(B,)} or [B, T] = {(B, T)}, got {advantages.shape}"
        )
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


def _check_options(center, tis_cap, mis, head_logprobs):
    """Raise ValueError on options that contradict each other or the inputs."""
    if center and head_logprobs is None:
        raise ValueError(
            "center=True needs the sampler's distribution: pass head_logprobs and head_ids "
            "(top-k) or head_logprobs alone (full [B, T, V] log-softmax, exact centring)"
        )
    if tis_cap is not None and not tis_cap > 0:
        raise ValueError(f"tis_cap must be a positive C (f(r) = min(r, C)), got {tis_cap}; or None")
    if tis_cap is not None and mis is not None:
        raise ValueError(f"tis_cap={tis_cap} and mis={mis}: truncated or masked IS, pass one")
    is_band = isinstance(mis, (tuple, list)) and len(mis) == 2 and 0 <= mis[0] < mis[1]
    if mis is not None and not is_band:
        raise ValueError(
            f"mis must be a band (lo, hi) of p/q, 0 ≤ lo < hi ≤ inf, got {mis}; or None"
        )
