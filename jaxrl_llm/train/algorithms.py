"""Algorithms as data: `algorithm.advantage` names an estimator of `objectives.ADVANTAGE_ESTIMATORS`; the rest
of an algorithm (loss kind, clipping, KL, filters, reward shape) is config. A new algorithm is one entry
here and a preset in configs/, never a branch in the loop.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxrl_llm import objectives
from jaxrl_llm.run.config import AlgorithmSection

def sequence_advantages(algo: AlgorithmSection, rewards: np.ndarray, group_ids: np.ndarray,
                        num_groups: int) -> np.ndarray:
    """Per-sample advantages [R] from the configured estimator."""
    if rewards.size == 0:
        return np.zeros(0, np.float32)
    fn = objectives.ADVANTAGE_ESTIMATORS[algo.advantage]
    return np.asarray(fn(jnp.asarray(rewards, jnp.float32), jnp.asarray(group_ids, jnp.int32),
                         num_groups=num_groups), np.float32)


def mixed_group_flags(rewards: np.ndarray, group_ids: np.ndarray, *, num_groups: int) -> np.ndarray:
    """NumPy bool [num_groups] on the host: the group holds at least two different rewards (`objectives.mixed_groups`,
    the DAPO / Reinforce-Rej filter); all False for an empty batch."""
    if rewards.size == 0:
        return np.zeros(num_groups, bool)
    return np.asarray(objectives.mixed_groups(jnp.asarray(rewards, jnp.float32), jnp.asarray(group_ids, jnp.int32),
                                              num_groups=num_groups), bool)


def token_advantages(algo: AlgorithmSection, seq_adv: np.ndarray, old_logp: np.ndarray, ref_logp: np.ndarray,
                     mask: np.ndarray) -> np.ndarray:
    """[R, T] advantages: the sequence advantage on every token, or PRL's per-token shaping when prl_eta is set."""
    if algo.prl_eta is None:
        return np.broadcast_to(seq_adv[:, None], mask.shape).astype(np.float32) * (mask > 0)
    return np.asarray(objectives.prl_advantages(jnp.asarray(seq_adv), jnp.asarray(old_logp), jnp.asarray(ref_logp),
                                                jnp.asarray(mask), eta=algo.prl_eta, step_len=algo.prl_step_len),
                      np.float32)


def needs_reference(algo: AlgorithmSection) -> bool:
    """A frozen reference policy is kept only for the KL term, the KL penalty in GAE's rewards or PRL shaping."""
    return algo.kl_coef > 0 or algo.kl_reward_coef > 0 or algo.prl_eta is not None


def token_rewards(rewards: np.ndarray, mask: np.ndarray, kl: np.ndarray | None = None,
                  kl_coef: float = 0.0) -> np.ndarray:
    """[R, T] rewards of the response tokens: r_t = -kl_coef * kl_t on every response token, plus the outcome
    reward rewards[i] on the last one (mask != 0); 0 off the mask. A response without tokens gets none."""
    on = mask != 0
    out = np.zeros(mask.shape, np.float32)
    if kl is not None and kl_coef:
        out -= np.float32(kl_coef) * np.where(on, kl, 0.0).astype(np.float32)
    rows = np.flatnonzero(on.any(axis=1))
    last = mask.shape[1] - 1 - np.argmax(on[rows, ::-1], axis=1)
    out[rows, last] += rewards[rows].astype(np.float32)
    return out


def whiten(values: np.ndarray, mask: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) over the tokens where mask != 0 (the unbiased variance, as verl's
    `masked_whiten`); 0 off the mask. One token: x - mean = 0."""
    on = mask != 0
    x = values[on].astype(np.float64)
    if x.size == 0:
        return np.zeros(values.shape, np.float32)
    var = x.var(ddof=1) if x.size > 1 else 0.0
    return np.where(on, (values - x.mean()) / np.sqrt(var + eps), 0.0).astype(np.float32)


def gae_token_advantages(algo: AlgorithmSection, rewards: np.ndarray, values: np.ndarray, mask: np.ndarray,
                         old_logp: np.ndarray, ref_logp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PPO with a critic: (advantages, returns) [R, T] from `objectives.gae_advantages` over `token_rewards`
    (the outcome reward on the last token, minus kl_reward_coef x kl_penalty(old_logp, ref_logp, kl_kind) on
    each), with algorithm.gamma and lam; the advantages whitened over the batch's tokens when
    whiten_advantages. The returns, the critic's targets, are never whitened."""
    kl = None
    if algo.kl_reward_coef > 0:
        kl = np.asarray(objectives.kl_penalty(jnp.asarray(old_logp), jnp.asarray(ref_logp), algo.kl_kind))
    token_r = token_rewards(rewards, mask, kl, algo.kl_reward_coef)
    adv, ret = objectives.gae_advantages(jnp.asarray(token_r), jnp.asarray(values, jnp.float32), jnp.asarray(mask),
                                         gamma=algo.gamma, lam=algo.lam)
    adv, ret = np.asarray(adv, np.float32), np.asarray(ret, np.float32)
    return (whiten(adv, mask) if algo.whiten_advantages else adv), ret


def explained_variance(returns: np.ndarray, values: np.ndarray, mask: np.ndarray) -> float:
    """1 - Var(R - V) / Var(R) over the response tokens (1: a perfect critic, 0: no better than a constant, < 0:
    worse; 0 when Var(R) = 0), the metric of `objectives.value_loss` computed in float64 from centred values
    (returns that barely vary would lose their variance to rounding in float32)."""
    on = mask != 0
    r, v = returns[on].astype(np.float64), values[on].astype(np.float64)
    var_r = r.var() if r.size else 0.0
    return float(1.0 - (r - v).var() / var_r) if var_r > 0 else 0.0


def rollout_weights(algo: AlgorithmSection, train_logp: np.ndarray, sampler_logp: np.ndarray,
                    mask: np.ndarray) -> tuple[np.ndarray | None, dict[str, float]]:
    """The sampler/trainer mismatch correction of a rollout batch: (weights [R, N] or None, metrics).

    weights = `objectives.rollout_correction(train_logp, sampler_logp, mask)` with algorithm.rollout_correction
    (the level), _mode, _low and _high; None when the correction is off. train_logp are the trainer's log-probs of
    the sampled tokens at the start of the update (the recomputed old log-probs), sampler_logp the sampler's. The
    metrics (rollout_mismatch_kl, and with the correction on rollout_corrected_fraction, rollout_weight_mean,
    rollout_ratio_min, rollout_ratio_max) are measured whenever both log-probs exist.

    The weights are computed here, on the host, once per rollout batch rather than in the train step: both
    log-probs are constants of the whole update (every epoch and mini-batch), a row's weights depend on that row
    alone, and the caller folds them into the advantages, A_t <- w_t A_t. For the losses the correction allows
    (clip with or without dual clip, vanilla, gspo, gspo_token, cispo) the per-token loss is positively homogeneous
    in A, l(w A) = w l(A) for w >= 0 (gspo: per row, its loss being one value on every token), so this is
    `policy_loss(..., weights=w)` exactly, under any micro-batching, with no per-token field more in the packed
    batch. The KL and entropy terms are not weighted. A token of weight 0 has advantage 0 and counts as unclipped in
    clip_fraction; a sample whose every weight is 0 is dropped from the update like any sample without advantage
    (and, with agg prompt-mean, leaves its prompt's D_i).
    """
    weights, found = objectives.rollout_correction(
        jnp.asarray(train_logp), jnp.asarray(sampler_logp), jnp.asarray(mask), level=algo.rollout_correction or "token",
        mode=algo.rollout_correction_mode, low=algo.rollout_correction_low, high=algo.rollout_correction_high)
    metrics = {"rollout_mismatch_kl": float(found["mismatch_kl"])}
    if not algo.rollout_correction:
        return None, metrics
    metrics.update({f"rollout_{k}": float(found[k]) for k in ("corrected_fraction", "weight_mean", "ratio_min",
                                                              "ratio_max")})
    return np.asarray(weights, np.float32), metrics
