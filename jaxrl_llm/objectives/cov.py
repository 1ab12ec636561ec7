"""Token selection of Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement
Learning for Reasoning Language Models"): the entropy of the policy falls with the covariance between a
token's log-prob and its advantage, so a few tokens of high covariance are held back from the update.

The selection is a statistic of the whole batch (its centring means, its token count, a top-k or a
random draw over all its tokens), so it cannot be summed over micro-batches: compute it once over the
batch with `cov_selection` and pass it to every micro-batch's `policy_loss(..., cov_selected=...)`. The
trainer does this once per mini-batch, before its micro-batch scan.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.objectives._checks import check_token_shapes

COV_LOSS_KINDS = ("clip_cov", "kl_cov")


def token_covariance(logp, advantages, mask) -> jax.Array:
    """[B, T] per-token covariance term cov_t = (logp_t - mean logp) (A_t - mean A), where both means are
    over the response tokens of the batch (mask != 0); 0 at masked-out positions.

    Args:
      logp: [B, T] log-probs of the sampled tokens.
      advantages: [B] (broadcast over tokens) or [B, T].
      mask: [B, T] response-token mask.
    """
    logp, mask = jnp.asarray(logp), jnp.asarray(mask)
    adv = jnp.asarray(advantages)
    adv = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, logp.shape)
    dtype = jnp.promote_types(logp.dtype, jnp.float32)
    on = mask != 0
    count = jnp.maximum(on.sum(), 1).astype(dtype)
    logp = jnp.where(on, logp, 0.0).astype(dtype)
    adv = jnp.where(on, adv, 0.0).astype(dtype)
    cov = (logp - logp.sum() / count) * (adv - adv.sum() / count)
    return jnp.where(on, cov, 0.0)


def cov_selection(logp, old_logp, advantages, mask, *, kind: str, rng=None, cov_fraction: float = 2e-4,
                  cov_low: float = 1.0, cov_high: float = 5.0, clip_low: float = 0.2,
                  clip_high: float = 0.2) -> jax.Array:
    """[B, T] bool: the tokens Clip-Cov detaches or KL-Cov penalises, over this whole batch.

    With N response tokens, cov_t = `token_covariance(logp, advantages, mask)` and
    k = max(floor(cov_fraction N), 1) (0 when N = 0):

      clip_cov: k tokens drawn uniformly without replacement (the k with the smallest uniform key from
                `rng`) among those with cov_low < cov_t < cov_high that the PPO clip with
                clip_low / clip_high has not already cut off (fewer when fewer qualify)
      kl_cov:   the k tokens of largest cov_t (ties to the earlier position in row-major order)

    Paper values: cov_fraction 2e-4 (Clip-Cov's r; KL-Cov's k is 2e-3 for 7B and 2e-4 for 32B models),
    cov_low 1 and cov_high 5. No gradient flows through the selection.

    Args:
      logp, old_logp: [B, T] current and behaviour log-probs (the means centre logp).
      advantages: [B] or [B, T].
      mask: [B, T] response-token mask.
      kind: "clip_cov" or "kl_cov".
      rng: a jax.random key; required for clip_cov.
      cov_fraction: the fraction of the batch's tokens selected, in (0, 1].
      cov_low, cov_high: Clip-Cov's covariance window.
      clip_low, clip_high: Clip-Cov's PPO clip bounds (tokens it clips are not drawn).
    """
    if kind not in COV_LOSS_KINDS:
        raise ValueError(f"cov_selection: kind must be one of {COV_LOSS_KINDS}, got {kind!r}")
    if not 0.0 < cov_fraction <= 1.0:
        raise ValueError(f"cov_selection: cov_fraction must be in (0, 1], got {cov_fraction}")
    if kind == "clip_cov" and rng is None:
        raise ValueError("cov_selection: kind 'clip_cov' draws its tokens at random: pass rng=<jax.random key>")
    if kind == "clip_cov" and not cov_low < cov_high:
        raise ValueError(f"cov_selection: need cov_low < cov_high, got {cov_low}, {cov_high}")
    logp = jax.lax.stop_gradient(jnp.asarray(logp))
    old_logp = jax.lax.stop_gradient(jnp.asarray(old_logp))
    adv = jax.lax.stop_gradient(jnp.asarray(advantages))
    mask = jnp.asarray(mask)
    check_token_shapes("cov_selection", "logp", logp, old_logp=old_logp, mask=mask)
    if adv.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"cov_selection: advantages must be [B] {logp.shape[:1]} or [B, T] {logp.shape}, "
                         f"got {adv.shape}")
    on = mask != 0
    cov = token_covariance(logp, adv, mask)
    count = on.sum()
    k = jnp.where(count > 0, jnp.maximum(jnp.floor(cov_fraction * count.astype(jnp.float32)), 1.0), 0.0)
    if kind == "kl_cov":
        key = jnp.where(on, -cov, jnp.inf)
        eligible = on
    else:
        adv_t = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, logp.shape)
        ratio = jnp.exp(jnp.clip(jnp.where(on, logp - old_logp, 0.0), -20.0, 20.0))
        ppo_clipped = ((adv_t < 0) & (ratio < 1.0 - clip_low)) | ((adv_t > 0) & (ratio > 1.0 + clip_high))
        eligible = on & (cov > cov_low) & (cov < cov_high) & ~ppo_clipped
        key = jnp.where(eligible, jax.random.uniform(rng, logp.shape), 2.0)
    # The rank of each token's key among all tokens of the batch; the k lowest are taken.
    order = jnp.argsort(key.reshape(-1), stable=True)
    rank = jnp.zeros(order.shape, jnp.int32).at[order].set(jnp.arange(order.size, dtype=jnp.int32))
    return eligible & (rank.reshape(logp.shape) < k)
