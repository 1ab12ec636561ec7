"""DAPO's overlong reward shaping (the dynamic-sampling mask is `mixed_group_mask` in advantages)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def overlong_penalty(lengths, *, max_len: int, buffer: int, factor: float = 1.0) -> jax.Array:
    """Soft overlong punishment of DAPO (Yu et al. 2025; verl's DAPO reward manager), added to r.

      penalty = min(-(L - (max_len - buffer)) / buffer * factor, 0)

    0 up to max_len - buffer tokens, then falling linearly to -factor at L = max_len (and further
    below for L > max_len: there is no lower clamp, as in the reference).

    Args:
      lengths: [B] response lengths in tokens.
      max_len: the maximum response length L_max.
      buffer: the length of the punishment interval L_buf, 0 < buffer <= max_len.
      factor: the penalty at L = max_len (as a positive magnitude).

    Returns:
      [B] float penalties (<= 0).
    """
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"overlong_penalty: max_len must be a positive int, got {max_len!r}")
    if isinstance(buffer, bool) or not isinstance(buffer, int) or not 0 < buffer <= max_len:
        raise ValueError(f"overlong_penalty: buffer must be an int in (0, max_len={max_len}], got {buffer!r}")
    lengths = jnp.asarray(lengths)
    lengths = lengths.astype(jnp.result_type(lengths.dtype, jnp.float32))
    exceed = lengths - (max_len - buffer)
    return jnp.minimum(-exceed / buffer * factor, 0.0)
