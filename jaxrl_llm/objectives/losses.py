"""Policy-gradient losses: the PPO / RAFT++ clipped surrogate and the plain -A log pi of RAFT."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.objectives.aggregate import LossTerms, aggregate_terms, check_mode, safe_divide

POLICY_LOSS_KINDS = ("clip", "vanilla")

# exp() of a log-ratio beyond this overflows float32 gradients; verl clamps at the same bound.
_MAX_LOG_RATIO = 20.0


def _check_inputs(logp, old_logp, advantages, mask, kind, clip_low, clip_high, dual_clip):
    if kind not in POLICY_LOSS_KINDS:
        raise ValueError(f"policy_loss: kind must be one of {POLICY_LOSS_KINDS}, got {kind!r}")
    if logp.ndim != 2:
        raise ValueError(f"policy_loss: logp must be [B, T], got shape {logp.shape}")
    for name, arr in (("old_logp", old_logp), ("mask", mask)):
        if arr.shape != logp.shape:
            raise ValueError(f"policy_loss: {name} must have logp's shape {logp.shape}, got {arr.shape}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"policy_loss: advantages must be [B] {logp.shape[:1]} or [B, T] {logp.shape}, "
                         f"got {advantages.shape}")
    if not 0.0 <= clip_low < 1.0 or not clip_high >= 0.0:
        raise ValueError(f"policy_loss: need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"policy_loss: dual_clip must be > 1 (or None), got {dual_clip}")


def policy_loss_terms(logp, old_logp, advantages, mask, *, kind: str = "clip", clip_low: float = 0.2,
                      clip_high: float = 0.2, dual_clip: float | None = None, agg: str = "token-mean",
                      max_len: int | None = None) -> tuple[LossTerms, dict[str, jax.Array]]:
    """The unreduced policy loss `LossTerms(total, denom)` and the metrics of `policy_loss`.

    loss = total / denom with the per-token PPO / RAFT loss l_t of `policy_loss` and, e.g. for
    token-mean, total = sum_{b,t} l_t m_t and denom = sum_{b,t} m_t (all modes: `aggregate_terms`).
    Summing `total` and `denom` over micro-batches that split the batch by rows gives exactly the
    full batch's `total` and `denom` for every `agg` mode, and the summed gradients of `total`
    divided by the summed `denom` equal the full-batch gradient (the pattern of tunix's LossOutput).

    Returns:
      (LossTerms(total, denom), metrics) with the arguments and metrics of `policy_loss`.
    """
    logp, old_logp, mask = jnp.asarray(logp), jnp.asarray(old_logp), jnp.asarray(mask)
    advantages = jnp.asarray(advantages)
    _check_inputs(logp, old_logp, advantages, mask, kind, clip_low, clip_high, dual_clip)
    check_mode(agg, max_len, "policy_loss")
    # Ratios of bfloat16 log-probs are too coarse for clipping at 1 +/- 0.2: compute in float32 or wider.
    logp = logp.astype(jnp.promote_types(logp.dtype, jnp.float32))
    mask = mask.astype(logp.dtype)
    on = mask != 0
    # Old log-probs and advantages are data, never differentiated.
    old_logp = jax.lax.stop_gradient(old_logp)
    adv = jax.lax.stop_gradient(advantages).astype(logp.dtype)
    adv = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, logp.shape)

    # Padding positions may hold any value; a zero log-ratio there keeps exp() and its gradient finite.
    log_ratio = jnp.clip(jnp.where(on, logp - old_logp, 0.0), -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = jnp.exp(log_ratio)

    low_clipped = jnp.zeros(logp.shape, bool)
    high_clipped = jnp.zeros(logp.shape, bool)
    dual_clipped = jnp.zeros(logp.shape, bool)
    if kind == "clip":
        unclipped = -adv * ratio
        clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
        per_token = jnp.maximum(unclipped, clipped)
        # The clipped branch wins (and the gradient is 0) only on the side that A's sign points to.
        low_clipped = (adv < 0) & (ratio < 1.0 - clip_low)
        high_clipped = (adv > 0) & (ratio > 1.0 + clip_high)
        if dual_clip is not None:
            dual_bound = -adv * dual_clip
            dual_clipped = (adv < 0) & (dual_bound < per_token)
            per_token = jnp.where(adv < 0, jnp.minimum(per_token, dual_bound), per_token)
    else:
        per_token = -adv * jnp.where(on, logp, 0.0)

    terms = aggregate_terms(per_token, mask, agg, max_len=max_len)

    def masked_mean(x):
        return safe_divide(jnp.sum(jnp.where(on, x, 0.0) * mask), mask.sum())

    any_token = jnp.any(on)
    ratio_sg = jax.lax.stop_gradient(ratio)
    log_ratio_sg = jax.lax.stop_gradient(log_ratio)
    metrics = {
        "clip_frac_low": masked_mean(low_clipped.astype(logp.dtype)),
        "clip_frac_high": masked_mean(high_clipped.astype(logp.dtype)),
        "clip_frac": masked_mean((low_clipped | high_clipped).astype(logp.dtype)),
        "dual_clip_frac": masked_mean(dual_clipped.astype(logp.dtype)),
        "ratio_mean": jnp.where(any_token, masked_mean(ratio_sg), 1.0),
        "ratio_min": jnp.where(any_token, jnp.min(jnp.where(on, ratio_sg, jnp.inf)), 1.0),
        "ratio_max": jnp.where(any_token, jnp.max(jnp.where(on, ratio_sg, -jnp.inf)), 1.0),
        # k3 estimate of KL(old || new) under samples from the old policy (Schulman 2020).
        "approx_kl": masked_mean(ratio_sg - 1.0 - log_ratio_sg),
        "num_tokens": mask.sum(),
    }
    return terms, metrics


def policy_loss(logp, old_logp, advantages, mask, *, kind: str = "clip", clip_low: float = 0.2,
                clip_high: float = 0.2, dual_clip: float | None = None, agg: str = "token-mean",
                max_len: int | None = None, denom=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Policy-gradient loss of PPO / GRPO / DAPO / RAFT++ (kind="clip") or RAFT (kind="vanilla").

    With ratio r_t = exp(logp_t - old_logp_t) and advantage A (per sequence, broadcast over tokens,
    or per token for PRL), the per-token loss is

      clip:     l_t = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high))
                (PPO, Schulman et al. 2017; asymmetric "clip-higher" bounds of DAPO, Yu et al. 2025)
                and with dual_clip = c > 1, for A < 0: l_t = min(l_t, -A c)
                (dual-clip PPO, Ye et al. 2020; verl's `compute_policy_loss`)
      vanilla:  l_t = -A logp_t   (RAFT, Dong et al. 2023: weighted SFT on the accepted samples)

    then reduced over the response mask with `aggregate(l, mask, agg, max_len=max_len)`.

    Gradient (token-mean over N tokens, clip): d loss / d logp_t = -A r_t / N where the unclipped
    branch is active, 0 where the ratio is clipped (and -A r_t / N is replaced by 0 under the dual
    clip). The log-ratio is clamped to [-20, 20] before exp, as in verl. `old_logp` and
    `advantages` are treated as constants (stop_gradient).

    Args:
      logp: [B, T] log-probs of the sampled tokens under the current policy.
      old_logp: [B, T] log-probs under the policy that generated the samples.
      advantages: [B] or [B, T].
      mask: [B, T] response-token mask.
      kind: "clip" or "vanilla".
      clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
      dual_clip: optional c > 1 bounding the loss of negative-advantage tokens at -A c.
      agg: an aggregation mode of `aggregate` (AGG_MODES).
      max_len: constant length for agg="seq-mean-token-sum-norm".
      denom: optional normaliser replacing this batch's own denominator (for micro-batches: the
        full batch's `aggregate_denominator(mask, agg)`; then the losses of the micro-batches sum to
        the full-batch loss). Use `policy_loss_terms` to accumulate totals and denominators instead.

    Returns:
      (loss scalar, metrics) with metrics over the masked tokens: clip_frac_low (A < 0 and
      r < 1 - clip_low), clip_frac_high (A > 0 and r > 1 + clip_high), clip_frac (either),
      dual_clip_frac, ratio_mean / ratio_min / ratio_max (1.0 with no tokens), approx_kl
      (mean of r - 1 - log r), num_tokens. Clip fractions are 0 for kind="vanilla".
    """
    terms, metrics = policy_loss_terms(logp, old_logp, advantages, mask, kind=kind, clip_low=clip_low,
                                       clip_high=clip_high, dual_clip=dual_clip, agg=agg, max_len=max_len)
    return safe_divide(terms.total, terms.denom if denom is None else denom), metrics
