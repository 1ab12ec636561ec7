"""Policy-gradient losses: the PPO / RAFT++ clipped surrogate, the plain -A log pi of RAFT, GSPO's
sequence-level ratio, CISPO's clipped importance weight, and the covariance-based Clip-Cov and KL-Cov."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.objectives.aggregate import LossTerms, aggregate_terms, check_mode, safe_divide
from jaxrl_llm.objectives.cov import COV_LOSS_KINDS, cov_selection

POLICY_LOSS_KINDS = ("clip", "vanilla", "gspo", "gspo_token", "cispo", "clip_cov", "kl_cov")

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
    # CISPO takes clip_low = 1: no floor on its importance weight, as the paper runs it.
    max_low_ok = clip_low <= 1.0 if kind == "cispo" else clip_low < 1.0
    if not (0.0 <= clip_low and max_low_ok) or not clip_high >= 0.0:
        raise ValueError(f"policy_loss: need 0 <= clip_low < 1 (<= 1 for cispo) and clip_high >= 0, got "
                         f"{clip_low}, {clip_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"policy_loss: dual_clip must be > 1 (or None), got {dual_clip}")


def _sequence_log_ratio(log_ratio, mask):
    """[B] mean over each row's response tokens of log(pi / pi_old): log s_i of GSPO."""
    return jnp.clip(safe_divide(jnp.sum(log_ratio * mask, axis=1), mask.sum(axis=1)),
                    -_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def policy_loss_terms(logp, old_logp, advantages, mask, *, kind: str = "clip", clip_low: float = 0.2,
                      clip_high: float = 0.2, dual_clip: float | None = None, agg: str = "token-mean",
                      max_len: int | None = None, cov_selected=None, rng=None, cov_fraction: float = 2e-4,
                      cov_low: float = 1.0, cov_high: float = 5.0, kl_cov_coef: float = 1.0, weights=None
                      ) -> tuple[LossTerms, dict[str, jax.Array]]:
    """The unreduced policy loss `LossTerms(total, denom)` and the metrics of `policy_loss`.

    loss = total / denom with the per-token PPO / RAFT loss l_t of `policy_loss` and, e.g. for
    token-mean, total = sum_{b,t} l_t m_t and denom = sum_{b,t} m_t (all modes: `aggregate_terms`).
    Summing `total` and `denom` over micro-batches that split the batch by rows gives exactly the
    full batch's `total` and `denom` for every `agg` mode, and the summed gradients of `total`
    divided by the summed `denom` equal the full-batch gradient (the pattern of tunix's LossOutput).
    GSPO's sequence ratio is a statistic of one row, so it splits with the rows too. Clip-Cov and
    KL-Cov select tokens over the whole batch: pass the full batch's `cov_selection` as `cov_selected`
    to each micro-batch, or the selection is made over the micro-batch alone. Per-token `weights` (the
    sampler/trainer correction, `rollout_correction`) belong to their rows and split with them.

    Returns:
      (LossTerms(total, denom), metrics) with the arguments and metrics of `policy_loss`.
    """
    logp, old_logp, mask = jnp.asarray(logp), jnp.asarray(old_logp), jnp.asarray(mask)
    advantages = jnp.asarray(advantages)
    _check_inputs(logp, old_logp, advantages, mask, kind, clip_low, clip_high, dual_clip)
    if weights is not None and jnp.shape(weights) != logp.shape:
        raise ValueError(f"policy_loss: weights must have logp's shape {logp.shape}, got {jnp.shape(weights)}")
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
    if kind == "gspo":
        # One ratio and one advantage per sequence, the same on each of its tokens.
        seq_adv = adv[:, 0] if advantages.ndim == 1 else safe_divide(jnp.sum(adv * mask, axis=1), mask.sum(axis=1))
        adv = jnp.broadcast_to(seq_adv[:, None], logp.shape)
        log_ratio = jnp.broadcast_to(_sequence_log_ratio(log_ratio, mask)[:, None], logp.shape)
    elif kind == "gspo_token":
        # Value s_i, gradient s_i d logp_t: the sequence ratio with a per-token advantage.
        seq = jax.lax.stop_gradient(_sequence_log_ratio(log_ratio, mask))
        log_ratio = seq[:, None] + log_ratio - jax.lax.stop_gradient(log_ratio)
    ratio = jnp.exp(log_ratio)

    low_clipped = jnp.zeros(logp.shape, bool)
    high_clipped = jnp.zeros(logp.shape, bool)
    dual_clipped = jnp.zeros(logp.shape, bool)
    selected = jnp.zeros(logp.shape, bool)
    if kind in COV_LOSS_KINDS:
        if cov_selected is None:
            cov_selected = cov_selection(logp, old_logp, adv, mask, kind=kind, rng=rng, cov_fraction=cov_fraction,
                                         cov_low=cov_low, cov_high=cov_high, clip_low=clip_low, clip_high=clip_high)
        elif jnp.shape(cov_selected) != logp.shape:
            raise ValueError(f"policy_loss: cov_selected must have logp's shape {logp.shape}, "
                             f"got {jnp.shape(cov_selected)}")
        selected = jnp.asarray(cov_selected, bool) & on
    if kind in ("clip", "gspo", "gspo_token", "clip_cov"):
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
        if kind == "clip_cov":  # the selected tokens keep their loss value but pass no gradient
            per_token = jnp.where(selected, jax.lax.stop_gradient(per_token), per_token)
    elif kind == "cispo":
        # The weight w is clipped and detached; every token keeps the gradient -A w d logp. Written as
        # -A sg(w / r) r: the same gradient, and the value -A w falls as the update takes effect.
        low_clipped = ratio < 1.0 - clip_low
        high_clipped = ratio > 1.0 + clip_high
        weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) / ratio)
        per_token = -adv * weight * ratio
    elif kind == "kl_cov":
        # No ratio clipping: a k2 penalty on the log-ratio of the selected tokens holds them instead.
        per_token = -adv * ratio + jnp.where(selected, kl_cov_coef * 0.5 * log_ratio * log_ratio, 0.0)
    else:
        per_token = -adv * jnp.where(on, logp, 0.0)

    if weights is not None:  # constants of the update, like the advantages
        per_token = per_token * jax.lax.stop_gradient(jnp.asarray(weights)).astype(logp.dtype)
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
        "cov_frac": masked_mean(selected.astype(logp.dtype)),
        "num_tokens": mask.sum(),
    }
    return terms, metrics


def policy_loss(logp, old_logp, advantages, mask, *, kind: str = "clip", clip_low: float = 0.2,
                clip_high: float = 0.2, dual_clip: float | None = None, agg: str = "token-mean",
                max_len: int | None = None, denom=None, cov_selected=None, rng=None, cov_fraction: float = 2e-4,
                cov_low: float = 1.0, cov_high: float = 5.0, kl_cov_coef: float = 1.0, weights=None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Policy-gradient loss of PPO / GRPO / DAPO / RAFT++ (kind="clip"), RAFT (kind="vanilla"), GSPO,
    CISPO, Clip-Cov and KL-Cov.

    With ratio r_t = exp(logp_t - old_logp_t) and advantage A (per sequence, broadcast over tokens,
    or per token for PRL), sg() the stop-gradient, the per-token loss is

      clip:       l_t = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high))
                  (PPO, Schulman et al. 2017; asymmetric "clip-higher" bounds of DAPO, Yu et al. 2025)
                  and with dual_clip = c > 1, for A < 0: l_t = min(l_t, -A c)
                  (dual-clip PPO, Ye et al. 2020; verl's `compute_policy_loss`)
      vanilla:    l_t = -A logp_t   (RAFT, Dong et al. 2023: weighted SFT on the accepted samples)
      gspo:       the clip loss with r_t replaced on every token of sequence i by its sequence ratio
                  s_i = exp(mean_{t in y_i} (logp_t - old_logp_t)) and A by the sequence advantage A_i
                  (a [B, T] advantage is averaged over the row's response tokens). With agg
                  seq-mean-token-mean this is GSPO's -mean_i min(s_i A_i, clip(s_i) A_i) (Zheng et al.
                  2025, "Group Sequence Policy Optimization"; paper bounds clip_low 3e-4, clip_high 4e-4)
      gspo_token: the clip loss with s_{i,t} = sg(s_i) pi_t / sg(pi_t): value s_i, gradient s_i d logp_t,
                  so a per-token advantage may vary along the sequence; with one advantage per sequence
                  it equals gspo in value and gradient (GSPO-token, the same paper)
      cispo:      l_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A logp_t: the weight is clipped, never
                  the token's gradient (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently
                  with Lightning Attention"); clip_low = 1 removes the floor, as the paper runs it.
                  Computed as -A sg(w_t / r_t) r_t with w_t the clipped weight: the same gradient
                  -A w_t d logp_t, and the value -A w_t on the clip loss's scale
      clip_cov:   the clip loss, with the gradient detached on the tokens of `cov_selection` (a random
                  cov_fraction of the tokens whose covariance (logp - mean logp)(A - mean A) lies in
                  (cov_low, cov_high))
      kl_cov:     l_t = -A r_t + kl_cov_coef sel_t (logp_t - old_logp_t)^2 / 2 on the tokens sel_t of
                  `cov_selection` (the top cov_fraction by covariance); no ratio clipping. Clip-Cov and
                  KL-Cov are from Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
                  Reasoning Language Models" (their code penalises |logp - old_logp|; the k2 form
                  here has the same zero and a gradient that vanishes with the log-ratio)

    then, with per-token `weights` w_t (the sampler/trainer mismatch correction of `rollout_correction`),
    l_t <- w_t l_t, and reduced over the response mask with `aggregate(l, mask, agg, max_len=max_len)`.

    Gradient (token-mean over N tokens, clip): d loss / d logp_t = -A r_t / N where the unclipped
    branch is active, 0 where the ratio is clipped (and -A r_t / N is replaced by 0 under the dual
    clip); for gspo, d loss / d logp_t = -A_i s_i / N on every token of an unclipped sequence. The
    log-ratio (and GSPO's mean log-ratio) is clamped to [-20, 20] before exp, as in verl. `old_logp`
    and `advantages` are treated as constants (stop_gradient).

    Micro-batches: every kind is a sum over rows (one row is one sequence, so GSPO's mean over a
    sequence is inside its row). Clip-Cov and KL-Cov select tokens over the whole batch: compute
    `cov_selection` once on the full batch and pass it as `cov_selected` to every micro-batch.

    Args:
      logp: [B, T] log-probs of the sampled tokens under the current policy.
      old_logp: [B, T] log-probs under the policy that generated the samples.
      advantages: [B] or [B, T].
      mask: [B, T] response-token mask.
      kind: one of POLICY_LOSS_KINDS.
      clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
      dual_clip: optional c > 1 bounding the loss of negative-advantage tokens at -A c (clip kinds).
      agg: an aggregation mode of `aggregate` (AGG_MODES).
      max_len: constant length for agg="seq-mean-token-sum-norm".
      denom: optional normaliser replacing this batch's own denominator (for micro-batches: the
        full batch's `aggregate_denominator(mask, agg)`; then the losses of the micro-batches sum to
        the full-batch loss). Use `policy_loss_terms` to accumulate totals and denominators instead.
      cov_selected: clip_cov / kl_cov: optional [B, T] bool selection from `cov_selection` over the
        full batch; without it the selection is made over this batch.
      rng: clip_cov without cov_selected: the jax.random key of the draw.
      cov_fraction, cov_low, cov_high: the selection of `cov_selection` (paper: 2e-4, 1, 5).
      kl_cov_coef: kl_cov's penalty weight (paper: 1).
      weights: optional [B, T] per-token weights multiplying the per-token loss (constants: stop_gradient);
        None leaves the loss as it is. The metrics describe the unweighted tokens.

    Returns:
      (loss scalar, metrics) with metrics over the masked tokens: clip_frac_low (A < 0 and
      r < 1 - clip_low; for cispo every r < 1 - clip_low), clip_frac_high (A > 0 and r > 1 + clip_high;
      for cispo every r > 1 + clip_high), clip_frac (either), dual_clip_frac, ratio_mean / ratio_min /
      ratio_max (1.0 with no tokens; the sequence ratio for gspo and gspo_token), approx_kl
      (mean of r - 1 - log r), cov_frac (the selected tokens of clip_cov / kl_cov), num_tokens.
      Clip fractions are 0 for kind="vanilla" and "kl_cov".
    """
    terms, metrics = policy_loss_terms(logp, old_logp, advantages, mask, kind=kind, clip_low=clip_low,
                                       clip_high=clip_high, dual_clip=dual_clip, agg=agg, max_len=max_len,
                                       cov_selected=cov_selected, rng=rng, cov_fraction=cov_fraction,
                                       cov_low=cov_low, cov_high=cov_high, kl_cov_coef=kl_cov_coef,
                                       weights=weights)
    return safe_divide(terms.total, terms.denom if denom is None else denom), metrics
