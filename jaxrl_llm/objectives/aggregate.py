"""Reduce a per-token loss `[B, T]` to a scalar, in the four modes of verl's `agg_loss`.

Each mode is a ratio `total / denom` (`LossTerms`). Both parts are sums over rows, so for
micro-batches that split the batch by rows, summing the totals and the denominators of the parts
gives exactly the full-batch loss:

  token-mean               total = sum_{b,t} x m            denom = sum_{b,t} m   (token count)
  seq-mean-token-mean      total = sum_b (sum_t x m / sum_t m)  over rows with a token
                           denom = number of rows with at least one token
  seq-mean-token-sum       total = sum_{b,t} x m            denom = B  (every row)
  seq-mean-token-sum-norm  total = sum_{b,t} x m / max_len  denom = B  (Dr.GRPO: constant max_len)

Gradient accumulation: either sum the gradients of `total_k` over micro-batches and divide by the
summed `denom` at the end, or, when each micro-batch must be normalised on its own, compute the
full batch's denominator first (`aggregate_denominator(full_mask, mode)`) and pass it as `denom=`
to `aggregate` / `policy_loss` for every micro-batch; the sum of those losses and of their
gradients equals the full-batch loss and gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


class LossTerms(NamedTuple):
    """An unreduced loss: `value() = total / denom` (0 when denom is 0).

    Accumulate over micro-batches with `jax.tree.map(jnp.add, a, b)` (a NamedTuple is a pytree).
    """

    total: jax.Array
    denom: jax.Array

    def value(self) -> jax.Array:
        return safe_divide(self.total, self.denom)


def safe_divide(total, denom) -> jax.Array:
    """total / denom, and 0 where denom is 0 (an empty batch contributes no loss and no NaN)."""
    denom = jnp.asarray(denom, dtype=jnp.result_type(total))
    nonzero = denom != 0
    return jnp.where(nonzero, total / jnp.where(nonzero, denom, 1), 0.0)


def check_mode(mode: str, max_len, fn_name: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"{fn_name}: agg mode must be one of {AGG_MODES}, got {mode!r}")
    if mode == "seq-mean-token-sum-norm":
        if max_len is None or isinstance(max_len, bool) or not max_len > 0:
            raise ValueError(f"{fn_name}: mode 'seq-mean-token-sum-norm' needs a constant max_len > 0, "
                             f"got {max_len!r}")


def masked_values(per_token, mask) -> tuple[jax.Array, jax.Array]:
    """(x * m with masked entries exactly 0 even where x is inf/NaN, m as x's float dtype)."""
    per_token = jnp.asarray(per_token)
    if not jnp.issubdtype(per_token.dtype, jnp.floating):
        per_token = per_token.astype(jnp.float32)
    mask = jnp.asarray(mask).astype(per_token.dtype)
    return jnp.where(mask != 0, per_token, 0.0) * mask, mask


def aggregate_terms(per_token, mask, mode: str, *, max_len: int | None = None) -> LossTerms:
    """The numerator and denominator of `aggregate` (verl's `agg_loss` modes, kept unreduced).

      token-mean               total = sum_{b,t} x m                 denom = sum_{b,t} m
      seq-mean-token-mean      total = sum_b sum_t x m / sum_t m     denom = #rows with a token
      seq-mean-token-sum       total = sum_{b,t} x m                 denom = B
      seq-mean-token-sum-norm  total = sum_{b,t} x m / max_len       denom = B

    Both parts are sums over rows, so they add up exactly across row-wise micro-batches.

    Args:
      per_token: [B, T] per-token values.
      mask: [B, T] response-token mask (1.0 on generated tokens, 0.0 on prompt and padding).
      mode: one of AGG_MODES.
      max_len: the constant length of 'seq-mean-token-sum-norm' (the generation budget).

    Returns:
      LossTerms(total, denom), both float scalars.
    """
    check_mode(mode, max_len, "aggregate")
    per_token = jnp.asarray(per_token)
    if per_token.ndim != 2 or jnp.shape(mask) != per_token.shape:
        raise ValueError(f"aggregate: per_token and mask must both be [B, T], got {per_token.shape} "
                         f"and {jnp.shape(mask)}")
    values, mask = masked_values(per_token, mask)
    dtype = values.dtype
    if mode == "token-mean":
        return LossTerms(values.sum(), mask.sum())
    if mode == "seq-mean-token-mean":
        row_tokens = mask.sum(axis=1)
        row_mean = safe_divide(values.sum(axis=1), row_tokens)
        return LossTerms(row_mean.sum(), (row_tokens > 0).sum().astype(dtype))
    num_rows = jnp.asarray(values.shape[0], dtype)
    if mode == "seq-mean-token-sum":
        return LossTerms(values.sum(), num_rows)
    return LossTerms(values.sum() / max_len, num_rows)


def aggregate_denominator(mask, mode: str) -> jax.Array:
    """The denominator `aggregate_terms(., mask, mode).denom` of a whole batch, from its mask alone:
    sum(m) for token-mean, the number of rows with a token for seq-mean-token-mean, B otherwise.

    Compute it once for the full batch and pass it as `denom=` when normalising micro-batches.
    """
    mask = jnp.asarray(mask)
    return aggregate_terms(jnp.zeros(mask.shape, jnp.float32), mask, mode, max_len=1).denom


def aggregate(per_token, mask, mode: str, *, max_len: int | None = None, denom=None) -> jax.Array:
    """Reduce a masked per-token loss to a scalar, as verl's `agg_loss` / Dr.GRPO.

    token-mean               = sum(x m) / sum(m)
    seq-mean-token-mean      = mean over rows with any token of (sum_t x m / sum_t m)
    seq-mean-token-sum       = mean over all B rows of sum_t x m
    seq-mean-token-sum-norm  = mean over all B rows of (sum_t x m) / max_len   (Dr.GRPO, Liu et al.
                               2025: a constant, not the row's length)

    An empty batch (denominator 0) gives 0.

    Args:
      per_token: [B, T] values.
      mask: [B, T] response-token mask.
      mode: one of AGG_MODES.
      max_len: constant length for 'seq-mean-token-sum-norm'.
      denom: optional normaliser replacing this batch's own denominator, e.g. the full batch's
        `aggregate_denominator` when this call sees one micro-batch of it.

    Returns:
      scalar.
    """
    terms = aggregate_terms(per_token, mask, mode, max_len=max_len)
    return safe_divide(terms.total, terms.denom if denom is None else denom)
