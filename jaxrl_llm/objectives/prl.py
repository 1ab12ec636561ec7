"""PRL: per-step advantages from the KL-regularised objective (process rewards from the log-ratio)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def prl_advantages(outcome_adv, old_logp, ref_logp, mask, *, eta: float, step_len: int | None = None,
                   step_ends=None) -> jax.Array:
    """Per-token advantages of PRL: the outcome advantage minus the future KL, at step granularity.

      delta_t = (old_logp_t - ref_logp_t) m_t
      S_t     = sum_{s >= t} delta_s                       (suffix sum over the response)
      A_t     = A_outcome - S_t / eta                      at every step end t,

    and every token takes the value of the end of its own step (back-filled over the step). Step
    ends are response tokens (m_t = 1) chosen by

      step_len=k   every k-th response token (counting response tokens from 1), or
      step_ends    a [B, T] boolean marking step ends, e.g. `tokens == newline_id`, or
      neither      every response token (a step per token),

    and the last response token of each row always ends a step. Tokens outside the mask get 0.
    The KL loss term is meant to be off when these advantages are used (the KL is already in A).

    Args:
      outcome_adv: [B] outcome advantages (e.g. from `grpo_advantages`).
      old_logp: [B, T] log-probs of the sampling policy.
      ref_logp: [B, T] log-probs of the reference policy.
      mask: [B, T] response-token mask.
      eta: KL temperature, > 0.
      step_len: fixed step length in response tokens (exclusive with step_ends).
      step_ends: [B, T] bool step-end markers (exclusive with step_len).

    Returns:
      [B, T] per-token advantages for `policy_loss`.
    """
    old_logp, ref_logp, mask = jnp.asarray(old_logp), jnp.asarray(ref_logp), jnp.asarray(mask)
    outcome_adv = jnp.asarray(outcome_adv)
    if old_logp.ndim != 2 or ref_logp.shape != old_logp.shape or mask.shape != old_logp.shape:
        raise ValueError(f"prl_advantages: old_logp, ref_logp and mask must share one [B, T] shape, got "
                         f"{old_logp.shape}, {ref_logp.shape}, {mask.shape}")
    if outcome_adv.shape != old_logp.shape[:1]:
        raise ValueError(f"prl_advantages: outcome_adv must be [B] = {old_logp.shape[:1]}, got {outcome_adv.shape}")
    if isinstance(eta, (int, float)) and not eta > 0:
        raise ValueError(f"prl_advantages: eta must be > 0, got {eta}")
    if step_len is not None and step_ends is not None:
        raise ValueError("prl_advantages: give step_len or step_ends, not both")
    if step_len is not None and (isinstance(step_len, bool) or not isinstance(step_len, int) or step_len < 1):
        raise ValueError(f"prl_advantages: step_len must be a positive int, got {step_len!r}")

    on = mask != 0
    dtype = jnp.result_type(old_logp.dtype, jnp.float32)
    delta = jnp.where(on, old_logp - ref_logp, 0.0).astype(dtype)
    suffix_kl = jnp.cumsum(delta[:, ::-1], axis=1)[:, ::-1]
    step_value = outcome_adv.astype(dtype)[:, None] - suffix_kl / eta

    position = jnp.cumsum(on, axis=1)  # 1-based index among response tokens
    is_last = on & (position == position[:, -1:])
    if step_len is not None:
        is_end = on & (position % step_len == 0)
    elif step_ends is not None:
        step_ends = jnp.asarray(step_ends)
        if step_ends.shape != old_logp.shape:
            raise ValueError(f"prl_advantages: step_ends must be [B, T] = {old_logp.shape}, got {step_ends.shape}")
        is_end = on & (step_ends != 0)
    else:
        is_end = on
    is_end = is_end | is_last

    # For each t, the first step end at or after t (T when there is none).
    seq_len = old_logp.shape[1]
    index = jnp.broadcast_to(jnp.arange(seq_len), old_logp.shape)
    next_end = jax.lax.cummin(jnp.where(is_end, index, seq_len), axis=1, reverse=True)
    filled = jnp.take_along_axis(step_value, jnp.minimum(next_end, seq_len - 1), axis=1)
    return jnp.where(on & (next_end < seq_len), filled, 0.0)
