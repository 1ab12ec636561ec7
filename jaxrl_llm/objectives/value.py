"""Critic objectives of PPO: generalised advantage estimation and the clipped value loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.objectives.aggregate import LossTerms, aggregate_terms, check_mode, safe_divide


def gae_advantages(token_rewards, values, mask, *, gamma: float = 1.0, lam: float = 1.0
                   ) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous Control
    Using Generalized Advantage Estimation"), per response token, as PPO for LLMs uses it.

      delta_t = r_t + gamma V_{t+1} - V_t
      A_t     = delta_t + gamma lam A_{t+1}
      R_t     = A_t + V_t                    (the critic's regression target)

    The time steps of a row are its response tokens (mask != 0) in order; positions with mask 0 are
    not steps and are skipped, so t + 1 is the next response token of the row, and after the last one
    V = 0 and A = 0 (the episode ends). Left-padded, right-padded and packed rows therefore give the
    same advantages as their unpadded responses. Rewards and values at masked-out positions are
    ignored; advantages and returns there are 0. Computed by a reverse `lax.scan` over T in float32
    (or wider); gamma = lam = 1 gives A_t = sum_{s >= t} r_s - V_t.

    Args:
      token_rewards: [B, T] per-token rewards (the outcome reward on the last response token, and
        e.g. a per-token KL penalty).
      values: [B, T] critic values V_t of the states before each response token.
      mask: [B, T] response-token mask.
      gamma: discount in [0, 1].
      lam: GAE lambda in [0, 1].

    Returns:
      (advantages [B, T], returns [B, T]), constants (no gradient flows to the values).
    """
    token_rewards, values, mask = jnp.asarray(token_rewards), jnp.asarray(values), jnp.asarray(mask)
    if values.ndim != 2:
        raise ValueError(f"gae_advantages: values must be [B, T], got shape {values.shape}")
    for name, arr in (("token_rewards", token_rewards), ("mask", mask)):
        if arr.shape != values.shape:
            raise ValueError(f"gae_advantages: {name} must have values' shape {values.shape}, got {arr.shape}")
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"gae_advantages: {name} must be in [0, 1], got {value}")
    dtype = jnp.promote_types(jnp.result_type(token_rewards, values), jnp.float32)
    on = mask != 0
    rewards = jnp.where(on, token_rewards, 0.0).astype(dtype)
    values = jax.lax.stop_gradient(jnp.where(on, values, 0.0).astype(dtype))

    def backward(carry, xs):
        next_value, next_adv = carry
        reward, value, step = xs
        adv = reward + gamma * next_value - value + gamma * lam * next_adv
        # A position that is not a step passes the next step's value and advantage through unchanged.
        carry = (jnp.where(step, value, next_value), jnp.where(step, adv, next_adv))
        return carry, jnp.where(step, adv, 0.0)

    zeros = jnp.zeros(values.shape[:1], dtype)
    _, adv = jax.lax.scan(backward, (zeros, zeros), (rewards.T, values.T, on.T), reverse=True)
    advantages = adv.T
    return advantages, jnp.where(on, advantages + values, 0.0)


def value_loss_terms(values, old_values, returns, mask, *, clip: float | None = 0.2, agg: str = "token-mean",
                     max_len: int | None = None) -> tuple[LossTerms, dict[str, jax.Array]]:
    """The unreduced value loss `LossTerms(total, denom)` and the metrics of `value_loss`.

    Sums over rows, like `policy_loss_terms`: totals and denominators of row-wise micro-batches add up
    to the full batch's.
    """
    values, old_values, returns, mask = (jnp.asarray(x) for x in (values, old_values, returns, mask))
    if values.ndim != 2:
        raise ValueError(f"value_loss: values must be [B, T], got shape {values.shape}")
    for name, arr in (("old_values", old_values), ("returns", returns), ("mask", mask)):
        if arr.shape != values.shape:
            raise ValueError(f"value_loss: {name} must have values' shape {values.shape}, got {arr.shape}")
    if clip is not None and not clip > 0:
        raise ValueError(f"value_loss: clip must be > 0 (or None to disable), got {clip}")
    check_mode(agg, max_len, "value_loss")
    values = values.astype(jnp.promote_types(values.dtype, jnp.float32))
    mask = mask.astype(values.dtype)
    on = mask != 0
    old_values = jax.lax.stop_gradient(old_values).astype(values.dtype)
    returns = jax.lax.stop_gradient(returns).astype(values.dtype)
    unclipped = jnp.square(values - returns)
    if clip is None:
        per_token, clipped_wins = 0.5 * unclipped, jnp.zeros(values.shape, bool)
    else:
        clipped_values = old_values + jnp.clip(values - old_values, -clip, clip)
        clipped = jnp.square(clipped_values - returns)
        per_token = 0.5 * jnp.maximum(unclipped, clipped)
        clipped_wins = clipped > unclipped
    terms = aggregate_terms(per_token, mask, agg, max_len=max_len)

    count = mask.sum()

    def masked_mean(x):
        return safe_divide(jnp.sum(jnp.where(on, x, 0.0) * mask), count)

    values_sg = jax.lax.stop_gradient(values)

    def masked_var(x):  # centred, in float32 at least: E[x^2] - E[x]^2 loses a small variance to rounding
        x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        return masked_mean(jnp.square(x - masked_mean(x)))

    residual_var = masked_var(returns - values_sg)
    returns_var = masked_var(returns)
    metrics = {
        "value_clip_fraction": masked_mean(clipped_wins.astype(values.dtype)),
        "value_mean": masked_mean(values_sg),
        "return_mean": masked_mean(returns),
        # 1 - Var(R - V) / Var(R) over the tokens: 1 is a perfect critic, 0 no better than a constant.
        "explained_variance": jnp.where(returns_var > 0, 1.0 - safe_divide(residual_var, returns_var), 0.0),
        "num_tokens": count,
    }
    return terms, metrics


def value_loss(values, old_values, returns, mask, *, clip: float | None = 0.2, agg: str = "token-mean",
               max_len: int | None = None, denom=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped value loss of PPO (Schulman et al. 2017; the value clipping of OpenAI baselines, verl's
    `compute_value_loss`):

      l_t = 0.5 max((V_t - R_t)^2, (clip(V_t, V_old_t - c, V_old_t + c) - R_t)^2)

    reduced over the response mask with `aggregate(l, mask, agg)`. With clip=None, l_t = 0.5 (V_t - R_t)^2.
    Where the clipped branch is larger (the new value moved more than c away from V_old, in the
    direction away from R) the gradient is 0. `old_values` and `returns` are constants.

    Args:
      values: [B, T] values of the critic being trained.
      old_values: [B, T] the critic's values when the rollouts were scored.
      returns: [B, T] regression targets, e.g. from `gae_advantages`.
      mask: [B, T] response-token mask.
      clip: c > 0, or None for the unclipped loss.
      agg: an aggregation mode of `aggregate` (AGG_MODES).
      max_len: constant length for agg="seq-mean-token-sum-norm".
      denom: optional normaliser replacing this batch's denominator (the full batch's
        `aggregate_denominator` when this call sees one micro-batch).

    Returns:
      (loss scalar, metrics): value_clip_fraction (tokens where the clipped branch is larger), value_mean,
      return_mean, explained_variance (1 - Var(R - V) / Var(R) over the tokens; 0 when Var(R) = 0),
      num_tokens.
    """
    terms, metrics = value_loss_terms(values, old_values, returns, mask, clip=clip, agg=agg, max_len=max_len)
    return safe_divide(terms.total, terms.denom if denom is None else denom), metrics
