"""Group bookkeeping shared by the advantage estimators: segment reductions over `group_ids`.

A group is the set of samples drawn for one prompt. Ids outside [0, num_groups) (use -1 for padding
rows of a fixed-shape batch) belong to no group: they are left out of every group statistic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def concrete_or_none(x) -> np.ndarray | None:
    """The value of `x` as a NumPy array, or None when `x` is traced (inside jit/vmap/grad)."""
    try:
        return np.asarray(x)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None


def resolve_num_groups(group_ids, num_groups: int | None, fn_name: str) -> int:
    """The static number of groups: `num_groups` if given, else max(group_ids) + 1 read on the host."""
    if num_groups is not None:
        if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or num_groups < 0:
            raise ValueError(f"{fn_name}: num_groups must be a non-negative Python int, got {num_groups!r}")
        return int(num_groups)
    ids = concrete_or_none(group_ids)
    if ids is None:
        raise ValueError(
            f"{fn_name}: group_ids is traced (inside jit or vmap), so the number of groups cannot be "
            f"read from it; pass num_groups=<int> as a static argument"
        )
    return int(ids.max()) + 1 if ids.size and ids.max() >= 0 else 0


def check_rewards_and_ids(rewards, group_ids, fn_name: str) -> tuple[jax.Array, jax.Array]:
    """Validate shapes/dtypes and return (float rewards [B], int group_ids [B])."""
    rewards = jnp.asarray(rewards)
    group_ids = jnp.asarray(group_ids)
    if rewards.ndim != 1:
        raise ValueError(f"{fn_name}: rewards must have shape [B], got {rewards.shape}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"{fn_name}: group_ids must have the same shape as rewards {rewards.shape}, got {group_ids.shape}"
        )
    if not jnp.issubdtype(group_ids.dtype, jnp.integer):
        raise ValueError(f"{fn_name}: group_ids must be integers, got dtype {group_ids.dtype}")
    if not jnp.issubdtype(rewards.dtype, jnp.floating):
        rewards = rewards.astype(jnp.float32)
    return rewards, group_ids


class GroupIndex:
    """Segment reductions and gathers for one `group_ids` vector with a static group count."""

    def __init__(self, group_ids: jax.Array, num_groups: int):
        self.num_groups = num_groups
        self.valid = (group_ids >= 0) & (group_ids < num_groups)
        # Invalid rows point at group 0 for the gather and are then zeroed or excluded.
        self.ids = jnp.where(self.valid, group_ids, 0)

    def sum(self, values: jax.Array) -> jax.Array:
        """[G] sum over each group's rows."""
        values = jnp.where(self.valid, values, 0)
        return jax.ops.segment_sum(values, self.ids, num_segments=self.num_groups)

    def count(self, dtype=jnp.float32) -> jax.Array:
        """[G] number of rows in each group (0 for unused ids)."""
        return self.sum(jnp.ones(self.ids.shape, dtype))

    def max(self, values: jax.Array) -> jax.Array:
        """[G] max over each group's rows (-inf for empty groups)."""
        values = jnp.where(self.valid, values, -jnp.inf)
        return jax.ops.segment_max(values, self.ids, num_segments=self.num_groups)

    def min(self, values: jax.Array) -> jax.Array:
        """[G] min over each group's rows (+inf for empty groups)."""
        values = jnp.where(self.valid, values, jnp.inf)
        return jax.ops.segment_min(values, self.ids, num_segments=self.num_groups)

    def gather(self, per_group: jax.Array, fill=0) -> jax.Array:
        """[B] each row's group value; `fill` for rows outside every group."""
        if self.num_groups == 0:
            return jnp.full(self.ids.shape, fill, per_group.dtype)
        return jnp.where(self.valid, per_group[self.ids], fill)
