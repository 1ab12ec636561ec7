"""Policy-gradient losses: the PPO / RAFT++ clipped surrogate, the plain -A log pi of RAFT, GSPO's
sequence-level ratio, CISPO's clipped importance weight, and the covariance-based Clip-Cov and KL-Cov.

Each kind is one small registered function (`POLICY_LOSSES`, like `ADVANTAGE_ESTIMATORS`):
`(TokenInputs, LossSettings) -> TokenLoss`, the per-token loss before weights and aggregation. `policy_loss`
prepares the inputs once (float32 ratios, stop-gradients, Clip-Cov / KL-Cov's selection), dispatches on
`kind`, then weighs, aggregates and measures. A new loss is a new function and a registry entry.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.objectives._checks import check_token_shapes
from jaxrl_llm.objectives.aggregate import AGG_MODES, LossTerms, aggregate_terms, check_mode, safe_divide
from jaxrl_llm.objectives.cov import COV_LOSS_KINDS, cov_selection
from jaxrl_llm.objectives.mstep import PROMPT_MEAN_MODES

# exp() of a log-ratio beyond this overflows float32 gradients; verl clamps at the same bound.
_MAX_LOG_RATIO = 20.0


class TokenInputs(NamedTuple):
    """The [B, T] arrays a loss kind reads, prepared by `policy_loss_terms` (float32 or wider)."""

    logp: jax.Array  # log-probs under the current policy (differentiated)
    log_ratio: jax.Array  # logp - old_logp, 0 off the mask, clamped to [-20, 20]
    adv: jax.Array  # advantages broadcast over tokens (stop_gradient)
    mask: jax.Array  # the response-token mask, in logp's dtype
    selected: jax.Array  # bool: Clip-Cov / KL-Cov's tokens (all False for the other kinds)
    token_adv: bool  # the advantages came per token, [B, T] (PRL), rather than per sequence


class LossSettings(NamedTuple):
    """The hyper-parameters of the loss kinds (each kind reads the ones it needs)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    kl_cov_coef: float = 1.0


class TokenLoss(NamedTuple):
    """A kind's per-token loss l_t [B, T] and what the metrics describe: the log-ratio the loss used (GSPO's
    sequence one) and where the ratio was clipped (bool [B, T])."""

    per_token: jax.Array
    log_ratio: jax.Array
    low_clipped: jax.Array
    high_clipped: jax.Array
    dual_clipped: jax.Array


def _clipped_surrogate(adv, log_ratio, s: LossSettings) -> TokenLoss:
    """max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), then min(., -A c) for A < 0 with dual_clip = c."""
    ratio = jnp.exp(log_ratio)
    per_token = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1.0 - s.clip_low, 1.0 + s.clip_high))
    # The clipped branch wins (and the gradient is 0) only on the side that A's sign points to.
    low_clipped = (adv < 0) & (ratio < 1.0 - s.clip_low)
    high_clipped = (adv > 0) & (ratio > 1.0 + s.clip_high)
    dual_clipped = jnp.zeros(ratio.shape, bool)
    if s.dual_clip is not None:
        dual_bound = -adv * s.dual_clip
        dual_clipped = (adv < 0) & (dual_bound < per_token)
        per_token = jnp.where(adv < 0, jnp.minimum(per_token, dual_bound), per_token)
    return TokenLoss(per_token, log_ratio, low_clipped, high_clipped, dual_clipped)


def _unclipped(per_token, log_ratio) -> TokenLoss:
    none = jnp.zeros(per_token.shape, bool)
    return TokenLoss(per_token, log_ratio, none, none, none)


def _sequence_log_ratio(log_ratio, mask):
    """[B] mean over each row's response tokens of log(pi / pi_old): log s_i of GSPO."""
    return jnp.clip(safe_divide(jnp.sum(log_ratio * mask, axis=1), mask.sum(axis=1)),
                    -_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def clip_loss(x: TokenInputs, s: LossSettings) -> TokenLoss:
    """PPO (Schulman et al. 2017) / RAFT++: l_t = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high)), with
    r_t = exp(logp_t - old_logp_t); with dual_clip = c, for A < 0: l_t = min(l_t, -A c) (Ye et al. 2020)."""
    return _clipped_surrogate(x.adv, x.log_ratio, s)


def vanilla_loss(x: TokenInputs, s: LossSettings) -> TokenLoss:
    """RAFT (Dong et al. 2023): l_t = -A logp_t, weighted SFT on the accepted samples; no ratio, no clipping."""
    del s
    return _unclipped(-x.adv * jnp.where(x.mask != 0, x.logp, 0.0), x.log_ratio)


def gspo_loss(x: TokenInputs, s: LossSettings) -> TokenLoss:
    """GSPO (Zheng et al. 2025): the clip loss with r_t replaced on every token of row i by the sequence ratio
    s_i = exp(mean_{t in y_i} log r_t) and A by the sequence advantage A_i (a [B, T] advantage averaged over the
    row's response tokens)."""
    seq_adv = safe_divide(jnp.sum(x.adv * x.mask, axis=1), x.mask.sum(axis=1)) if x.token_adv else x.adv[:, 0]
    adv = jnp.broadcast_to(seq_adv[:, None], x.adv.shape)
    log_ratio = jnp.broadcast_to(_sequence_log_ratio(x.log_ratio, x.mask)[:, None], x.adv.shape)
    return _clipped_surrogate(adv, log_ratio, s)


def gspo_token_loss(x: TokenInputs, s: LossSettings) -> TokenLoss:
    """GSPO-token (Zheng et al. 2025): the clip loss with s_{i,t} = sg(s_i) pi_t / sg(pi_t): value s_i, gradient
    s_i d logp_t, so a per-token advantage may vary along the sequence."""
    seq = jax.lax.stop_gradient(_sequence_log_ratio(x.log_ratio, x.mask))
    return _clipped_surrogate(x.adv, seq[:, None] + x.log_ratio - jax.lax.stop_gradient(x.log_ratio), s)


def cispo_loss(x: TokenInputs, s: LossSettings) -> TokenLoss:
    """CISPO (MiniMax 2025): l_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A logp_t; the weight is clipped,
    never the token's gradient."""
    ratio = jnp.exp(x.log_ratio)
    # Written as -A sg(w / r) r: the same gradient -A w d logp, and the value -A w falls as the update takes effect.
    weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - s.clip_low, 1.0 + s.clip_high) / ratio)
    none = jnp.zeros(ratio.shape, bool)
    return TokenLoss(-x.adv * weight * ratio, x.log_ratio, ratio < 1.0 - s.clip_low, ratio > 1.0 + s.clip_high,
                     none)


def clip_cov_loss(x: TokenInputs, s: LossSettings) -> TokenLoss:
    """Clip-Cov (Cui et al. 2025): the clip loss, with the gradient detached on the selected tokens."""
    out = _clipped_surrogate(x.adv, x.log_ratio, s)
    return out._replace(per_token=jnp.where(x.selected, jax.lax.stop_gradient(out.per_token), out.per_token))


def kl_cov_loss(x: TokenInputs, s: LossSettings) -> TokenLoss:
    """KL-Cov (Cui et al. 2025): l_t = -A r_t + kl_cov_coef sel_t (log r_t)^2 / 2; no ratio clipping, the k2
    penalty holds the selected tokens instead."""
    ratio = jnp.exp(x.log_ratio)
    return _unclipped(-x.adv * ratio + jnp.where(x.selected, s.kl_cov_coef * 0.5 * x.log_ratio * x.log_ratio, 0.0),
                      x.log_ratio)


# kind -> (TokenInputs, LossSettings) -> TokenLoss; the config picks a loss by name (algorithm.loss).
POLICY_LOSSES: dict[str, Callable[[TokenInputs, LossSettings], TokenLoss]] = {
    "clip": clip_loss,
    "vanilla": vanilla_loss,
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
    "cispo": cispo_loss,
    "clip_cov": clip_cov_loss,
    "kl_cov": kl_cov_loss,
}
POLICY_LOSS_KINDS = tuple(POLICY_LOSSES)


def _check_inputs(logp, old_logp, advantages, mask, kind, clip_low, clip_high, dual_clip, agg, max_len, weights):
    if kind not in POLICY_LOSSES:
        raise ValueError(f"policy_loss: kind must be one of {POLICY_LOSS_KINDS}, got {kind!r}")
    check_token_shapes("policy_loss", "logp", logp, old_logp=old_logp, mask=mask)
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
    if weights is not None and jnp.shape(weights) != logp.shape:
        raise ValueError(f"policy_loss: weights must have logp's shape {logp.shape}, got {jnp.shape(weights)}")
    if agg in PROMPT_MEAN_MODES:
        raise ValueError(f"policy_loss: agg {agg!r} (GVM's M-step) weighs each sample by its prompt, which "
                         f"policy_loss does not see: reduce the per-token loss with prompt_mean_terms, or scale each "
                         f"sample's advantages by its M-step weight and use agg 'token-mean' (what the trainer "
                         f"does for algorithm.agg {agg!r}); policy_loss's modes are {AGG_MODES}")
    check_mode(agg, max_len, "policy_loss")


def _selected_tokens(kind, logp, old_logp, adv, mask, cov_selected, rng, cov_fraction, cov_low, cov_high,
                     clip_low, clip_high):
    """[B, T] bool: Clip-Cov / KL-Cov's tokens (given, or selected over this batch); all False for other kinds."""
    if kind not in COV_LOSS_KINDS:
        return jnp.zeros(logp.shape, bool)
    if cov_selected is None:
        cov_selected = cov_selection(logp, old_logp, adv, mask, kind=kind, rng=rng, cov_fraction=cov_fraction,
                                     cov_low=cov_low, cov_high=cov_high, clip_low=clip_low, clip_high=clip_high)
    elif jnp.shape(cov_selected) != logp.shape:
        raise ValueError(f"policy_loss: cov_selected must have logp's shape {logp.shape}, "
                         f"got {jnp.shape(cov_selected)}")
    return jnp.asarray(cov_selected, bool) & (mask != 0)


def _loss_metrics(out: TokenLoss, mask, selected) -> dict[str, jax.Array]:
    """The metrics of `policy_loss` over the masked tokens (see its docstring)."""
    on = mask != 0

    def masked_mean(x):
        return safe_divide(jnp.sum(jnp.where(on, x, 0.0) * mask), mask.sum())

    def fraction(flags):
        return masked_mean(flags.astype(mask.dtype))

    any_token = jnp.any(on)
    log_ratio = jax.lax.stop_gradient(out.log_ratio)
    ratio = jnp.exp(log_ratio)
    return {
        "clip_fraction_low": fraction(out.low_clipped),
        "clip_fraction_high": fraction(out.high_clipped),
        "clip_fraction": fraction(out.low_clipped | out.high_clipped),
        "dual_clip_fraction": fraction(out.dual_clipped),
        "ratio_mean": jnp.where(any_token, masked_mean(ratio), 1.0),
        "ratio_min": jnp.where(any_token, jnp.min(jnp.where(on, ratio, jnp.inf)), 1.0),
        "ratio_max": jnp.where(any_token, jnp.max(jnp.where(on, ratio, -jnp.inf)), 1.0),
        # k3 estimate of KL(old || new) under samples from the old policy (Schulman 2020).
        "approx_kl": masked_mean(ratio - 1.0 - log_ratio),
        "cov_selected_fraction": fraction(selected),
        "num_tokens": mask.sum(),
    }


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

    The per-token loss is `POLICY_LOSSES[kind]`'s.

    Returns:
      (LossTerms(total, denom), metrics) with the arguments and metrics of `policy_loss`.
    """
    logp, old_logp, mask = jnp.asarray(logp), jnp.asarray(old_logp), jnp.asarray(mask)
    advantages = jnp.asarray(advantages)
    _check_inputs(logp, old_logp, advantages, mask, kind, clip_low, clip_high, dual_clip, agg, max_len, weights)
    # Ratios of bfloat16 log-probs are too coarse for clipping at 1 +/- 0.2: compute in float32 or wider.
    logp = logp.astype(jnp.promote_types(logp.dtype, jnp.float32))
    mask = mask.astype(logp.dtype)
    # Old log-probs and advantages are data, never differentiated.
    old_logp = jax.lax.stop_gradient(old_logp)
    adv = jax.lax.stop_gradient(advantages).astype(logp.dtype)
    adv = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, logp.shape)
    # Padding positions may hold any value; a zero log-ratio there keeps exp() and its gradient finite.
    log_ratio = jnp.clip(jnp.where(mask != 0, logp - old_logp, 0.0), -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    selected = _selected_tokens(kind, logp, old_logp, adv, mask, cov_selected, rng, cov_fraction, cov_low,
                                cov_high, clip_low, clip_high)
    inputs = TokenInputs(logp, log_ratio, adv, mask, selected, advantages.ndim == 2)
    out = POLICY_LOSSES[kind](inputs, LossSettings(clip_low, clip_high, dual_clip, kl_cov_coef))
    per_token = out.per_token
    if weights is not None:  # constants of the update, like the advantages
        per_token = per_token * jax.lax.stop_gradient(jnp.asarray(weights)).astype(logp.dtype)
    return aggregate_terms(per_token, mask, agg, max_len=max_len), _loss_metrics(out, mask, selected)


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
      kind: one of POLICY_LOSS_KINDS, the names of the `POLICY_LOSSES` registry.
      clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
      dual_clip: optional c > 1 bounding the loss of negative-advantage tokens at -A c (clip kinds).
      agg: an aggregation mode of `aggregate` (AGG_MODES). GVM's M-step modes (PROMPT_MEAN_MODES) weigh each
        sample by its prompt, which this function does not see: they raise, pointing to `prompt_mean_terms`.
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
      (loss scalar, metrics) with metrics over the masked tokens: clip_fraction_low (A < 0 and
      r < 1 - clip_low; for cispo every r < 1 - clip_low), clip_fraction_high (A > 0 and r > 1 + clip_high;
      for cispo every r > 1 + clip_high), clip_fraction (either; the trainer logs it under the same name),
      dual_clip_fraction, ratio_mean / ratio_min /
      ratio_max (1.0 with no tokens; the sequence ratio for gspo and gspo_token), approx_kl
      (mean of r - 1 - log r), cov_selected_fraction (the selected tokens of clip_cov / kl_cov),
      num_tokens.
      Clip fractions are 0 for kind="vanilla" and "kl_cov".
    """
    terms, metrics = policy_loss_terms(logp, old_logp, advantages, mask, kind=kind, clip_low=clip_low,
                                       clip_high=clip_high, dual_clip=dual_clip, agg=agg, max_len=max_len,
                                       cov_selected=cov_selected, rng=rng, cov_fraction=cov_fraction,
                                       cov_low=cov_low, cov_high=cov_high, kl_cov_coef=kl_cov_coef,
                                       weights=weights)
    return safe_divide(terms.total, terms.denom if denom is None else denom), metrics
