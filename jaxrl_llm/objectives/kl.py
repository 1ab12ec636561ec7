"""Per-token KL estimators against a reference policy, and the entropy of the sampling distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp

KL_KINDS = ("k1", "k2", "k3", "abs")

# k3 clamps its output to [-10, 10]; clamping the log-ratio at +/-20 first changes no output value
# (|k3| > 10 there already) but keeps exp() and its gradient finite.
_K3_CLAMP = 10.0
_MAX_LOG_RATIO = 20.0


def kl_penalty(logp, ref_logp, kind: str) -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) from the log-probs of the sampled tokens.

    With d = logp - ref_logp (Schulman 2020, "Approximating KL divergence"; verl's `kl_penalty`):

      k1  = d
      k2  = d^2 / 2
      k3  = exp(-d) - (-d) - 1 = exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]
            (the GRPO KL loss, DeepSeekMath, coefficient 1e-3)
      abs = |d|

    Args:
      logp: [B, T] log-probs under the current policy.
      ref_logp: [B, T] log-probs under the reference policy.
      kind: one of KL_KINDS.

    Returns:
      [B, T] per-token penalties (reduce with `aggregate` over the response mask).
    """
    logp, ref_logp = jnp.asarray(logp), jnp.asarray(ref_logp)
    if kind not in KL_KINDS:
        raise ValueError(f"kl_penalty: kind must be one of {KL_KINDS}, got {kind!r}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"kl_penalty: logp {logp.shape} and ref_logp {ref_logp.shape} must have one shape")
    diff = logp - ref_logp
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff * diff
    if kind == "abs":
        return jnp.abs(diff)
    ref_minus = jnp.clip(-diff, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return jnp.clip(jnp.exp(ref_minus) - ref_minus - 1.0, -_K3_CLAMP, _K3_CLAMP)


def entropy_from_logits(logits) -> jax.Array:
    """Entropy of the categorical distribution softmax(logits) over the last axis.

    H = logsumexp(z) - sum_v softmax(z)_v z_v = -sum_v p_v log p_v  (verl's `entropy_from_logits`),
    computed in float32; vocabulary entries with logit -inf (p = 0) contribute 0.

    Args:
      logits: [B, T, V] (any leading shape).

    Returns:
      [B, T] entropies in nats.
    """
    logits = jnp.asarray(logits)
    if logits.ndim < 1:
        raise ValueError(f"entropy_from_logits: logits need a vocabulary axis, got shape {logits.shape}")
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    prob = jnp.exp(logp)
    safe_logp = jnp.where(prob > 0, logp, 0.0)
    return -jnp.sum(prob * safe_logp, axis=-1)
