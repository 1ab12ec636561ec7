"""GVM's M-step as a loss aggregation: every prompt weighs the same, and a prompt's samples are averaged.

The M-step of GVM-RAFT (Yao et al. 2025, arXiv 2505.02391, Algorithm 1) estimates the gradient of
sum_i E[log pi(y | x_i) | y accepted] over m prompts by

  Algorithm 1:  g = -(1/m) sum_i (1/|D_i|)     sum_{j in D_i} grad log pi(y_j | x_i)
  Lemma 1:      g = -(1/m) sum_i 1/(n_i p_i)   sum_{j in D_i} grad log pi(y_j | x_i)   (unbiased)

with D_i the accepted samples of prompt i among its n_i samples, p_i its acceptance rate (known, or
estimated from samples other than these, e.g. GVM's stage 1) and log pi(y | x) = sum_t log pi(y_t | ...)
the summed, not length-normalised, log-likelihood. The Lemma-1 variance sum_i G_i^2 / (n_i p_i) is what
GVM's allocation minimises. A token-mean over all samples instead weights prompt i by its token count,
which grows with n_i, so under GVM the allocation would change the objective, not only its variance.

Here a per-token loss x [B, T] is reduced as

  loss = (1/m) sum_b w_b sum_t x_bt m_bt,   w_b = counted_b / c_{g(b)}
  c_i  = sum over prompt i's rows of counted         ("prompt-mean", Algorithm 1: c_i = |D_i|)
  c_i  = n_i p_i, n_i = prompt i's rows              ("prompt-mean-unbiased", Lemma 1)

(w_b = 0 where c_i = 0), m the number of prompts. With the vanilla loss x = -A log pi and RAFT's
A = 1 on accepted samples, this is the estimator above. `counted` marks the samples of D_i (default:
every row, so that a prompt's samples are averaged).

Micro-batches: the weights come from the whole batch (`prompt_mean_weights`); each micro-batch's
`prompt_mean_terms` then holds plain row sums (m as sum_b 1/n_{g(b)}), which add up exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.objectives._groups import GroupIndex, concrete_or_none, resolve_num_groups
from jaxrl_llm.objectives.aggregate import LossTerms, masked_values, safe_divide

PROMPT_MEAN_MODES = ("prompt-mean", "prompt-mean-unbiased")


def prompt_mean_weights(group_ids, *, num_groups: int | None = None, counted=None, accept_rate=None) -> jax.Array:
    """Per-sample weights w_b = counted_b / c_{g(b)} of the M-step aggregation (GVM, Yao et al. 2025).

      accept_rate None (Algorithm 1):  c_i = sum_{b in prompt i} counted_b  (= |D_i|)
      accept_rate [num_groups] (Lemma 1, unbiased):  c_i = n_i p_i, n_i = number of rows of prompt i

    w_b = 0 where c_i = 0 and for rows whose id lies outside [0, num_groups) (padding, id -1).

    Args:
      group_ids: [B] int prompt index of each sample.
      num_groups: static number of prompts (else read from group_ids on the host).
      counted: optional [B] 0/1 (or bool) marking D_i, e.g. the accepted samples; default every row.
      accept_rate: optional [num_groups] p_i in [0, 1], estimated from other samples than these.

    Returns:
      float [B] weights.
    """
    group_ids = jnp.asarray(group_ids)
    if group_ids.ndim != 1 or not jnp.issubdtype(group_ids.dtype, jnp.integer):
        raise ValueError(f"prompt_mean_weights: group_ids must be an int [B] vector, got {group_ids.dtype} "
                         f"{group_ids.shape}")
    num_groups = resolve_num_groups(group_ids, num_groups, "prompt_mean_weights")
    index = GroupIndex(group_ids, num_groups)
    counted = jnp.ones(group_ids.shape, jnp.float32) if counted is None else jnp.asarray(counted, jnp.float32)
    if counted.shape != group_ids.shape:
        raise ValueError(f"prompt_mean_weights: counted must be [B] {group_ids.shape}, got {counted.shape}")
    if accept_rate is None:
        per_group = index.sum(counted)
    else:
        accept_rate = jnp.asarray(accept_rate, jnp.float32)
        if accept_rate.shape != (num_groups,):
            raise ValueError(f"prompt_mean_weights: accept_rate must be [num_groups] ({num_groups},), got "
                             f"{accept_rate.shape}")
        p = concrete_or_none(accept_rate)
        if p is not None and p.size and ((p < 0).any() or (p > 1).any()):
            raise ValueError(f"prompt_mean_weights: accept_rate must lie in [0, 1], got [{p.min()}, {p.max()}]")
        per_group = index.count() * accept_rate
    row_divisor = jnp.where(index.valid, per_group[index.ids], 0.0)
    return jnp.where(index.valid, safe_divide(counted, row_divisor), 0.0)


def prompt_mean_terms(per_token, mask, sample_weight, prompt_share) -> LossTerms:
    """LossTerms(total = sum_b w_b sum_t x_bt m_bt, denom = sum_b s_b): the M-step aggregation of a
    (micro-)batch. w = `prompt_mean_weights(...)` and s = `prompt_mean_weights(group_ids)` (every row
    counted: s_b = 1 / n_{g(b)}, so a prompt's rows share one unit and sum_b s_b = m), both computed on
    the whole batch and sliced like the rows. Row sums, so totals and denominators add up exactly over
    row-wise micro-batches, even when a prompt's samples straddle two of them.

    Args:
      per_token: [B, T] values; mask: [B, T] response-token mask; sample_weight: [B] w; prompt_share: [B] s.
    """
    per_token = jnp.asarray(per_token)
    if per_token.ndim != 2 or jnp.shape(mask) != per_token.shape:
        raise ValueError(f"prompt_mean_terms: per_token and mask must both be [B, T], got {per_token.shape} "
                         f"and {jnp.shape(mask)}")
    for name, arr in (("sample_weight", sample_weight), ("prompt_share", prompt_share)):
        if jnp.shape(arr) != per_token.shape[:1]:
            raise ValueError(f"prompt_mean_terms: {name} must be [B] {per_token.shape[:1]}, got {jnp.shape(arr)}")
    values, _ = masked_values(per_token, mask)
    weight = jnp.asarray(sample_weight, values.dtype)
    return LossTerms((values.sum(axis=1) * weight).sum(), jnp.asarray(prompt_share, values.dtype).sum())


def prompt_mean(per_token, mask, group_ids, *, num_groups: int | None = None, counted=None,
                accept_rate=None) -> jax.Array:
    """The M-step aggregation of a whole batch: (1/m) sum_i (1/c_i) sum_{b in prompt i, counted} sum_t x m
    with c_i = |D_i| (Algorithm 1) or n_i p_i when `accept_rate` is given (Lemma 1); see the module
    docstring. 0 for an empty batch.

    Args:
      per_token: [B, T]; mask: [B, T]; group_ids: [B] prompt index; num_groups: static count;
      counted: [B] marks D_i (default all rows); accept_rate: [num_groups] p_i for the Lemma-1 form.
    """
    num_groups = resolve_num_groups(group_ids, num_groups, "prompt_mean")
    weights = prompt_mean_weights(group_ids, num_groups=num_groups, counted=counted, accept_rate=accept_rate)
    share = prompt_mean_weights(group_ids, num_groups=num_groups)
    return prompt_mean_terms(per_token, mask, weights, share).value()
