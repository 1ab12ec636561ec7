"""Outcome advantage estimators: one scalar per sample, from its reward and its prompt's group.

Every estimator is a pure function `(rewards [B], group_ids [B]) -> advantages [B]`; groups are
formed with segment reductions, so they may have any size (GVM gives each prompt its own n_i,
including 1 and 0). `num_groups` is static: give it under jit/vmap; outside, it defaults to
max(group_ids) + 1. Ids outside [0, num_groups) (e.g. -1 padding rows) get advantage 0.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from jaxrl_llm.objectives._groups import GroupIndex, check_rewards_and_ids, resolve_num_groups


def grpo_advantages(rewards, group_ids, *, num_groups: int | None = None, scale_by_std: bool = True,
                    eps: float = 1e-6) -> jax.Array:
    """Group-relative advantages of GRPO (DeepSeekMath, Shao et al. 2024) and Dr.GRPO.

    A_i = (r_i - mean_g) / (std_g + eps)   with scale_by_std=True (GRPO),
    A_i = r_i - mean_g                      with scale_by_std=False (Dr.GRPO, Liu et al. 2025),

    where mean_g and the unbiased std_g (divisor n_g - 1) are over the rewards of sample i's group g.
    A group of one sample uses mean 0 and std 1, as verl's `compute_grpo_outcome_advantage` does,
    so its advantage is r / (1 + eps) (or r without std scaling). A group whose rewards are all
    equal gets advantage 0.

    Args:
      rewards: [B] rewards.
      group_ids: [B] integer group (prompt) index of each sample.
      num_groups: static number of groups; required under jit/vmap.
      scale_by_std: divide by the group std (GRPO) or not (Dr.GRPO).
      eps: added to the std.

    Returns:
      [B] advantages (float).
    """
    rewards, group_ids = check_rewards_and_ids(rewards, group_ids, "grpo_advantages")
    groups = GroupIndex(group_ids, resolve_num_groups(group_ids, num_groups, "grpo_advantages"))
    count = groups.count(rewards.dtype)
    single = count < 2
    mean = jnp.where(single, 0.0, groups.sum(rewards) / jnp.maximum(count, 1.0))
    centred = rewards - groups.gather(mean)
    sq_dev = groups.sum(centred * centred)
    std = jnp.where(single, 1.0, jnp.sqrt(sq_dev / jnp.maximum(count - 1.0, 1.0)))
    if scale_by_std:
        centred = centred / (groups.gather(std, fill=1.0) + eps)
    return jnp.where(groups.valid, centred, 0.0)


def rloo_advantages(rewards, group_ids, *, num_groups: int | None = None) -> jax.Array:
    """REINFORCE leave-one-out advantages (Ahmadian et al. 2024, "Back to Basics"; verl's RLOO).

    A_i = r_i - (sum_{j in g, j != i} r_j) / (n_g - 1)

    A group of one has no other sample to form a baseline: its baseline is 0 and A_i = r_i
    (as in verl's `compute_rloo_outcome_advantage`).

    Args:
      rewards: [B] rewards.
      group_ids: [B] integer group index of each sample.
      num_groups: static number of groups; required under jit/vmap.

    Returns:
      [B] advantages.
    """
    rewards, group_ids = check_rewards_and_ids(rewards, group_ids, "rloo_advantages")
    groups = GroupIndex(group_ids, resolve_num_groups(group_ids, num_groups, "rloo_advantages"))
    count = groups.gather(groups.count(rewards.dtype))
    others_sum = groups.gather(groups.sum(rewards)) - rewards
    baseline = jnp.where(count > 1, others_sum / jnp.maximum(count - 1.0, 1.0), 0.0)
    return jnp.where(groups.valid, rewards - baseline, 0.0)


def raft_advantages(rewards) -> jax.Array:
    """RAFT / RAFT++ advantages (Dong et al. 2023; Xiong et al. 2025): A_i = max(r_i, 0).

    With rewards in {-1, +1} (or {0, 1}), accepted samples get weight 1 and rejected ones 0, so
    the policy loss is supervised fine-tuning on the accepted samples.

    Args:
      rewards: [B] (or any shape) rewards.

    Returns:
      advantages of the same shape.
    """
    rewards = jnp.asarray(rewards)
    if not jnp.issubdtype(rewards.dtype, jnp.floating):
        rewards = rewards.astype(jnp.float32)
    return jnp.maximum(rewards, 0.0)


def mixed_group_mask(rewards, group_ids, *args, num_groups: int | None = None) -> jax.Array:
    """[B] bool: True where the sample's group holds at least two different rewards.

    mixed_i = max_{j in g} r_j != min_{j in g} r_j. A group of one, and a group whose rewards all
    agree (all correct or all wrong), is not mixed. DAPO's dynamic sampling (Yu et al. 2025) keeps
    only mixed groups; Reinforce-Rej (Xiong et al. 2025) drops the others. Ids outside
    [0, num_groups) are never mixed. `num_groups` is keyword-only, as in `mixed_groups` and the
    estimators; a third positional argument is still read as it, with a DeprecationWarning.
    """
    num_groups = _keyword_num_groups(args, num_groups, "mixed_group_mask")
    rewards, group_ids = check_rewards_and_ids(rewards, group_ids, "mixed_group_mask")
    groups = GroupIndex(group_ids, resolve_num_groups(group_ids, num_groups, "mixed_group_mask"))
    return groups.gather(groups.max(rewards) > groups.min(rewards), fill=False)


def _keyword_num_groups(args: tuple, num_groups: int | None, fn_name: str) -> int | None:
    """`num_groups` given positionally (the old signature of `mixed_group_mask`): warn, and use it."""
    if not args:
        return num_groups
    if len(args) > 1 or num_groups is not None:
        raise TypeError(f"{fn_name}: takes rewards, group_ids and the keyword num_groups, got {len(args)} more "
                        f"positional argument(s){' and num_groups' if num_groups is not None else ''}")
    warnings.warn(f"{fn_name}: pass num_groups as a keyword (num_groups={args[0]!r}); the positional form will go",
                  DeprecationWarning, stacklevel=3)
    return args[0]


def mixed_groups(rewards, group_ids, *, num_groups: int | None = None) -> jax.Array:
    """[num_groups] bool: mixed_g = max_{i in g} r_i != min_{i in g} r_i (DAPO, Yu et al. 2025).

    The per-group form of `mixed_group_mask`; `mixed_groups(...).sum()` is the number of groups a
    DAPO dynamic-sampling round contributed. Empty groups are not mixed.
    """
    rewards, group_ids = check_rewards_and_ids(rewards, group_ids, "mixed_groups")
    groups = GroupIndex(group_ids, resolve_num_groups(group_ids, num_groups, "mixed_groups"))
    return groups.max(rewards) > groups.min(rewards)


def reinforce_rej_advantages(rewards, group_ids, *, num_groups: int | None = None) -> jax.Array:
    """Reinforce-Rej advantages (Xiong et al. 2025, "A Minimalist Approach to LLM Reasoning").

    A_i = r_i if the rewards of i's group differ (not all correct, not all wrong), else 0.

    Rewards are expected in {-1, +1}. A group of one has nothing to differ from: 0.

    Args:
      rewards: [B] rewards.
      group_ids: [B] integer group index of each sample.
      num_groups: static number of groups; required under jit/vmap.

    Returns:
      [B] advantages.
    """
    rewards, group_ids = check_rewards_and_ids(rewards, group_ids, "reinforce_rej_advantages")
    mixed = mixed_group_mask(rewards, group_ids,
                             num_groups=resolve_num_groups(group_ids, num_groups, "reinforce_rej_advantages"))
    return jnp.where(mixed, rewards, 0.0)


def reinforce_pp_advantages(rewards, group_ids=None, *, num_groups: int | None = None,
                            eps: float = 1e-6) -> jax.Array:
    """REINFORCE++ advantages (Hu 2025, "REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both
    Prompt and Reward Models").

    Without group_ids (REINFORCE++): the global batch normalisation that replaces GRPO's per-prompt one,

      A_i = (r_i - mean_B) / (std_B + eps)

    With group_ids (REINFORCE++-baseline): each prompt's mean is subtracted first, then the result is
    normalised over the whole batch,

      c_i = r_i - mean_g(i),   A_i = (c_i - mean_B(c)) / (std_B(c) + eps)

    where mean_B and std_B are over every sample of the batch, and std_B is the population standard
    deviation (divisor B, as OpenRLHF's advantage whitening). mean_B(c) is 0 when every sample is in a
    group; a group of one gets c = 0. Ids outside [0, num_groups) are left out of every statistic and
    get advantage 0. The batch statistics make the estimator one call over the whole rollout batch:
    the trainer computes advantages on the host before splitting the batch, so micro-batching does
    not change them.

    Args:
      rewards: [B] rewards.
      group_ids: optional [B] integer group (prompt) index of each sample.
      num_groups: static number of groups; required under jit/vmap when group_ids is given.
      eps: added to the batch std.

    Returns:
      [B] advantages.
    """
    if group_ids is None:
        rewards = jnp.asarray(rewards)
        if rewards.ndim != 1:
            raise ValueError(f"reinforce_pp_advantages: rewards must have shape [B], got {rewards.shape}")
        if not jnp.issubdtype(rewards.dtype, jnp.floating):
            rewards = rewards.astype(jnp.float32)
        return _batch_whiten(rewards, jnp.ones(rewards.shape, bool), eps)
    rewards, group_ids = check_rewards_and_ids(rewards, group_ids, "reinforce_pp_advantages")
    groups = GroupIndex(group_ids, resolve_num_groups(group_ids, num_groups, "reinforce_pp_advantages"))
    mean = groups.sum(rewards) / jnp.maximum(groups.count(rewards.dtype), 1.0)
    return _batch_whiten(rewards - groups.gather(mean), groups.valid, eps)


def _batch_whiten(values, valid, eps):
    """(x - mean) / (population std + eps) over the rows where `valid`; 0 elsewhere."""
    weight = valid.astype(values.dtype)
    count = jnp.maximum(weight.sum(), 1.0)
    centred = values - jnp.sum(jnp.where(valid, values, 0.0)) / count
    std = jnp.sqrt(jnp.sum(jnp.where(valid, centred * centred, 0.0)) / count)
    return jnp.where(valid, centred / (std + eps), 0.0)


def reinforce_pp_batch_advantages(rewards, group_ids, *, num_groups: int | None = None,
                                  eps: float = 1e-6) -> jax.Array:
    """REINFORCE++ (Hu 2025) in the estimators' form `(rewards, group_ids) -> [B]`: the batch normalisation

      A_i = (r_i - mean_B) / (std_B + eps)

    over the samples whose id lies in [0, num_groups) (std_B the population one, divisor B); the others (e.g.
    -1 padding rows) are left out of both statistics and get 0. No group statistic is used: the ids only mark
    the real rows. With every id valid it equals `reinforce_pp_advantages(rewards)`; `ADVANTAGE_ESTIMATORS`
    names it "reinforce_pp" (and `reinforce_pp_advantages` with group ids "reinforce_pp_baseline").

    Args:
      rewards: [B] rewards.
      group_ids: [B] integer group index of each sample (rows outside [0, num_groups) are padding).
      num_groups: static number of groups; required under jit/vmap.
      eps: added to the batch std.

    Returns:
      [B] advantages.
    """
    rewards, group_ids = check_rewards_and_ids(rewards, group_ids, "reinforce_pp_batch_advantages")
    groups = GroupIndex(group_ids, resolve_num_groups(group_ids, num_groups, "reinforce_pp_batch_advantages"))
    return _batch_whiten(rewards, groups.valid, eps)


def raft_group_advantages(rewards, group_ids, *, num_groups: int | None = None) -> jax.Array:
    """`raft_advantages` in the estimators' form `(rewards, group_ids) -> [B]`: A_i = max(r_i, 0) (Dong et al.
    2023), the group ids unused (RAFT needs no group statistic), so the registry calls every estimator alike."""
    del group_ids, num_groups
    return raft_advantages(rewards)


def drgrpo_advantages(rewards, group_ids, *, num_groups: int | None = None, eps: float = 1e-6) -> jax.Array:
    """Dr.GRPO (Liu et al. 2025): A_i = r_i - mean_g, `grpo_advantages` with scale_by_std=False (a group of one:
    A_i = r_i)."""
    return grpo_advantages(rewards, group_ids, num_groups=num_groups, scale_by_std=False, eps=eps)


# name -> (rewards, group_ids, *, num_groups=None) -> [B]; the config picks an estimator by name
# (algorithm.advantage). Every entry is a public function of this module.
ADVANTAGE_ESTIMATORS = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
    "raft": raft_group_advantages,
    "reinforce_rej": reinforce_rej_advantages,
    "reinforce_pp": reinforce_pp_batch_advantages,
    "reinforce_pp_baseline": reinforce_pp_advantages,
}
