"""GVM dynamic sample allocation: split a sampling budget over prompts to lower gradient variance."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.objectives._groups import concrete_or_none


def _check_concrete_inputs(accept_rate, grad_norm, budget, filter_threshold, filter_insufficient):
    p, g, n = concrete_or_none(accept_rate), concrete_or_none(grad_norm), concrete_or_none(budget)
    if p is not None and p.size and (np.any(p < 0) or np.any(p > 1) or np.any(np.isnan(p))):
        raise ValueError(f"gvm_allocate: accept_rate must lie in [0, 1], got values in [{p.min()}, {p.max()}]")
    if g is not None and g.size and (np.any(g < 0) or not np.all(np.isfinite(g))):
        raise ValueError(f"gvm_allocate: grad_norm must be finite and >= 0, got values in [{g.min()}, {g.max()}]")
    if n is not None and (n.shape != () or n < 0 or n != np.round(n)):
        raise ValueError(f"gvm_allocate: budget must be a non-negative integer scalar, got {budget!r}")
    threshold = concrete_or_none(filter_threshold)
    if threshold is not None and not 0 < threshold <= 1:
        raise ValueError(f"gvm_allocate: filter_threshold must lie in (0, 1] (1.0 disables it), got {filter_threshold}")
    insufficient = concrete_or_none(filter_insufficient)
    if insufficient is not None and insufficient < 0:
        raise ValueError(f"gvm_allocate: filter_insufficient must be >= 0 (0 disables it), got {filter_insufficient}")


def _normalise(weights: jax.Array) -> jax.Array:
    total = weights.sum()
    return jnp.where(total > 0, weights / jnp.where(total > 0, total, 1.0), 0.0)


def gvm_allocate(accept_rate, grad_norm, budget, *, alpha: float = 1e-3, beta: float = 2.0,
                 filter_threshold: float = 1.0, filter_insufficient: float = 0.0) -> jax.Array:
    """Samples per prompt for stage 2 of GVM-RAFT (Yao et al. 2025, "Optimizing Chain-of-Thought
    Reasoners via Gradient Variance Minimization in Rejection Sampling and RL"; RLHFlow/GVM
    `em/stage_2_calc_sample_size.py`).

      w_i = G_i / sqrt(p_i + alpha / p_i^(beta - 1)),  w_i = 0 where G_i = 0 or p_i = 0
      w   = w / sum(w)

    with p_i the stage-1 acceptance rate and G_i the mean gradient norm of prompt i's accepted
    samples. Then two optional filters, as in the reference code:

      filter_threshold  (0, 1]: w_i = 0 where p_i > filter_threshold (prompts that are too easy);
                        1.0, the default, keeps every prompt.
      filter_insufficient >= 0: w_i = 0 where p_i w_i budget < filter_insufficient, i.e. where the
                        expected number of accepted stage-2 samples is below it (w_i as after the
                        threshold filter, before renormalising); 0, the default, keeps every prompt.

    then w = w / sum(w) again, and the integer rounding: n_i = round(w_i budget) (half to even),
    then +1 on the largest residuals w_i budget - n_i (or -1 on the smallest) until
    sum(n_i) = budget; ties go to the lower index. Each n_i is the floor or the ceiling of
    w_i budget, and prompts with w_i = 0 get 0. If every weight is 0 the result is all zeros
    (and does not sum to budget).

    Pure jax.numpy, so it runs on the host (eager) or under jit; `budget` may be traced. Inputs are
    range-checked only when concrete. Rounding is done in the default float dtype (float32 unless
    jax_enable_x64).

    Args:
      accept_rate: [N] p_i in [0, 1].
      grad_norm: [N] G_i >= 0.
      budget: total number of stage-2 samples N (e.g. n_prompts * samples_per_prompt).
      alpha, beta: the penalty of the allocation rule (paper defaults 1e-3 and 2).
      filter_threshold, filter_insufficient: the optional filters above.

    Returns:
      int32 [N] sample counts.
    """
    _check_concrete_inputs(accept_rate, grad_norm, budget, filter_threshold, filter_insufficient)
    accept_rate = jnp.asarray(accept_rate, dtype=jnp.result_type(float))
    grad_norm = jnp.asarray(grad_norm, dtype=accept_rate.dtype)
    if accept_rate.ndim != 1 or grad_norm.shape != accept_rate.shape:
        raise ValueError(f"gvm_allocate: accept_rate and grad_norm must both be [N], got {accept_rate.shape} "
                         f"and {grad_norm.shape}")
    budget = jnp.asarray(budget).astype(jnp.int32)

    usable = (grad_norm > 0) & (accept_rate > 0)
    p = jnp.where(usable, accept_rate, 1.0)
    weights = jnp.where(usable, grad_norm / jnp.sqrt(p + alpha / p ** (beta - 1.0)), 0.0)
    weights = _normalise(weights)
    weights = jnp.where(accept_rate <= filter_threshold, weights, 0.0)
    expected_accepted = accept_rate * weights * budget
    keep = (filter_insufficient <= 0) | (expected_accepted >= filter_insufficient)
    weights = _normalise(jnp.where(keep, weights, 0.0))

    scaled = weights * budget
    counts = jnp.round(scaled)
    shortfall = budget - counts.sum().astype(jnp.int32)
    residual = scaled - counts
    # Rank the adjustable prompts: largest residual first when adding, smallest first when removing.
    key = jnp.where(weights > 0, jnp.where(shortfall > 0, -residual, residual), jnp.inf)
    order = jnp.argsort(key, stable=True)
    rank = jnp.zeros(order.shape, jnp.int32).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    adjust = (rank < jnp.abs(shortfall)) & (weights > 0)
    return counts.astype(jnp.int32) + jnp.sign(shortfall) * adjust.astype(jnp.int32)
