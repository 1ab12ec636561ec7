"""Sampler/trainer mismatch correction: importance weights of the trainer's probabilities of the sampled tokens
against the sampler's (truncated, TIS; masked, MIS; or rejection), and the size of the gap; the decoupled PPO
objective of asynchronous RL, which weighs a stale behaviour policy the same way."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.objectives._checks import check_token_shapes
from jaxrl_llm.objectives.aggregate import safe_divide
from jaxrl_llm.objectives.kl import kl_penalty
from jaxrl_llm.objectives.losses import _MAX_LOG_RATIO, policy_loss

ROLLOUT_CORRECTION_LEVELS = ("token", "sequence", "geometric")
ROLLOUT_CORRECTION_MODES = ("truncate", "mask", "reject")

# The log-ratio is clamped before exp() at the policy loss's bound (losses._MAX_LOG_RATIO = 20: exp(20) = 4.9e8 is
# finite in float32, and a sequence's summed log-ratio can be far larger; verl clamps at the same bound).


def _check(train_logp, sampler_logp, mask, level, mode, low, high):
    if level not in ROLLOUT_CORRECTION_LEVELS:
        raise ValueError(f"rollout_correction: level must be one of {ROLLOUT_CORRECTION_LEVELS}, got {level!r}")
    if mode not in ROLLOUT_CORRECTION_MODES:
        raise ValueError(f"rollout_correction: mode must be one of {ROLLOUT_CORRECTION_MODES}, got {mode!r}")
    check_token_shapes("rollout_correction", "train_logp", train_logp, sampler_logp=sampler_logp, mask=mask)
    # A token the two programs agree on (r = 1) must keep its full weight.
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(f"rollout_correction: need 0 <= low <= 1 <= high, got low={low}, high={high}")


def rollout_correction(train_logp, sampler_logp, mask, *, level: str = "token", mode: str = "truncate",
                       low: float = 0.0, high: float = 2.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token weights that correct a policy-gradient loss for the gap between the sampler's and the trainer's
    probabilities of the same sampled tokens.

    With d_t = train_logp_t - sampler_logp_t on the response mask m, the ratio r of pi_trainer / pi_sampler is

      token:      r_t = exp(d_t)
      sequence:   r_t = exp(sum_s d_s m_s)              the same on every token of the row
      geometric:  r_t = exp(sum_s d_s m_s / sum_s m_s)  the same on every token of the row

    (the log-ratio is clamped to [-20, 20] before exp, in float32 or wider), and the weight is

      truncate:  w_t = min(r_t, high)                            (TIS, truncated importance sampling;
                 Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training")
      mask:      w_t = r_t if low <= r_t <= high else 0           (MIS, masked importance sampling)
      reject:    w_t = 1   if low <= r_t <= high else 0           (rejection: the gap filters, never scales)

    The weights are constants under differentiation (stop_gradient) and 0 off the mask; a row without a
    response token gets weight 0 everywhere and no NaN. Multiply a policy loss's per-token terms by them
    (`policy_loss(..., weights=w)`). Each row's weights depend on that row alone, so micro-batches that split
    the batch by rows give the same weights.

    Args:
      train_logp: [B, T] log-probs of the sampled tokens under the trainer's computation of the policy that
        sampled them (the old log-probs recomputed at the start of the update).
      sampler_logp: [B, T] the sampler's log-probs of the same tokens.
      mask: [B, T] response-token mask.
      level: one of ROLLOUT_CORRECTION_LEVELS.
      mode: one of ROLLOUT_CORRECTION_MODES.
      low, high: the band [low, high] of accepted ratios (truncate uses high only); 0 <= low <= 1 <= high.

    Returns:
      (weights [B, T], metrics) with metrics over the masked tokens: mismatch_kl (the token mean of k3 =
      exp(d) - d - 1, an estimate of KL(pi_sampler || pi_trainer) from the sampler's tokens, as
      `kl_penalty(sampler_logp, train_logp, "k3")`), corrected_fraction (tokens whose weight is not their
      ratio: truncated at high, or set to 0), weight_mean, ratio_mean, ratio_min and ratio_max (1.0 with no
      tokens).

    >>> import jax.numpy as jnp
    >>> train = jnp.log(jnp.array([[0.5, 0.3, 0.9]]))
    >>> sampler = jnp.log(jnp.array([[0.5, 0.1, 0.6]]))
    >>> w, metrics = rollout_correction(train, sampler, jnp.ones((1, 3)), high=2.0)
    >>> [round(float(x), 4) for x in w[0]]  # ratios 1, 3 and 1.5; 3 is truncated at 2
    [1.0, 2.0, 1.5]
    >>> round(float(metrics["corrected_fraction"]), 4)
    0.3333
    """
    train_logp, sampler_logp, mask = jnp.asarray(train_logp), jnp.asarray(sampler_logp), jnp.asarray(mask)
    _check(train_logp, sampler_logp, mask, level, mode, low, high)
    dtype = jnp.promote_types(jnp.promote_types(train_logp.dtype, sampler_logp.dtype), jnp.float32)
    train_logp, sampler_logp = train_logp.astype(dtype), sampler_logp.astype(dtype)
    on = mask != 0
    m = mask.astype(dtype)
    # Padding may hold any value (even -inf): a zero difference there keeps every sum finite.
    diff = jax.lax.stop_gradient(jnp.where(on, train_logp - sampler_logp, 0.0))
    if level == "token":
        log_ratio = diff
    else:
        row = jnp.sum(diff * m, axis=1)
        if level == "geometric":
            row = safe_divide(row, m.sum(axis=1))
        log_ratio = jnp.broadcast_to(row[:, None], diff.shape)
    ratio = jnp.exp(jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    inside = (ratio >= low) & (ratio <= high)
    if mode == "truncate":
        weights = jnp.minimum(ratio, high)
        corrected = ratio > high
    elif mode == "mask":
        weights = jnp.where(inside, ratio, 0.0)
        corrected = ~inside
    else:
        weights = inside.astype(dtype)
        corrected = ~inside
    weights = jax.lax.stop_gradient(jnp.where(on, weights, 0.0))

    def masked_mean(x):
        return safe_divide(jnp.sum(jnp.where(on, x, 0.0) * m), m.sum())

    any_token = jnp.any(on)
    k3 = kl_penalty(jnp.where(on, sampler_logp, 0.0), jnp.where(on, train_logp, 0.0), "k3")
    metrics = {
        "mismatch_kl": jax.lax.stop_gradient(masked_mean(k3)),
        "corrected_fraction": masked_mean(corrected.astype(dtype)),
        "weight_mean": masked_mean(weights),
        "ratio_mean": jnp.where(any_token, masked_mean(ratio), 1.0),
        "ratio_min": jnp.where(any_token, jnp.min(jnp.where(on, ratio, jnp.inf)), 1.0),
        "ratio_max": jnp.where(any_token, jnp.max(jnp.where(on, ratio, -jnp.inf)), 1.0),
    }
    return weights, metrics


def decoupled_ppo_loss(logp, proximal_logp, behavior_logp, advantages, mask, *, clip_low: float = 0.2,
                       clip_high: float = 0.2, weight_cap: float | None = None, agg: str = "token-mean",
                       max_len: int | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The decoupled PPO objective of asynchronous RL (Fu et al. 2025, AReaL): the trust region is taken around
    the proximal policy (the trainer's policy at the start of the update), and the behaviour policy that sampled
    the tokens (a stale version, or the sampler's other precision) enters only through an importance weight.

    With u_t = exp(logp_t - proximal_logp_t) and w_t = exp(proximal_logp_t - behavior_logp_t),

      l_t = w_t max(-A_t u_t, -A_t clip(u_t, 1 - clip_low, 1 + clip_high))

    and with `weight_cap` = C the tokens whose w_t > C are left out (w_t = 0; AReaL's behav_imp_weight_cap),
    aggregated like `policy_loss` over every token of the mask. This is `rollout_correction(proximal_logp,
    behavior_logp, mask, level="token", mode="mask", high=C)` weighing `policy_loss(logp, proximal_logp, ...)`,
    which is how the trainer runs it (`algorithm.rollout_correction: token`, `_mode: mask`, `_high: C`, the old
    log-probs recomputed: docs/async_rollouts.md). Both proximal_logp and behavior_logp are constants.

    Returns:
      (loss, metrics): `policy_loss`'s metrics plus behavior_kl (k3 of the behaviour against the proximal policy,
      token mean), behavior_weight_mean and capped_fraction (tokens left out by the cap).

    >>> import jax.numpy as jnp
    >>> prox = jnp.log(jnp.array([[0.5, 0.4]]))
    >>> behav = jnp.log(jnp.array([[0.25, 0.4]]))  # w = 2 and 1
    >>> loss, m = decoupled_ppo_loss(prox, prox, behav, jnp.array([1.0]), jnp.ones((1, 2)))
    >>> round(float(loss), 4)  # u = 1: l = -A w per token, token mean of -2 and -1
    -1.5
    """
    cap = float("inf") if weight_cap is None else float(weight_cap)
    if cap < 1.0:
        raise ValueError(f"decoupled_ppo_loss: weight_cap must be >= 1 or None, got {weight_cap}")
    weights, found = rollout_correction(proximal_logp, behavior_logp, mask, level="token", mode="mask", high=cap)
    loss, metrics = policy_loss(logp, proximal_logp, advantages, mask, kind="clip", clip_low=clip_low,
                                clip_high=clip_high, agg=agg, max_len=max_len, weights=weights)
    metrics.update(behavior_kl=found["mismatch_kl"], behavior_weight_mean=found["weight_mean"],
                   capped_fraction=found["corrected_fraction"])
    return loss, metrics
