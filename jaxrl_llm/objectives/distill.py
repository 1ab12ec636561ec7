"""On-policy distillation: a teacher scores the student's own samples, token by token.

Two signals, both on the student's sampled states (Agarwal et al. 2024, GKD; Lu and Thinking Machines Lab
2025, "On-Policy Distillation"):

  sampled  the per-token reverse KL of the sampled token, A_t = log pi_T(y_t) - log pi_S(y_t), used as the
           policy loss's advantages (`reverse_kl_advantages`); its expectation under the student's samples is
           -KL(pi_S || pi_T) per token.
  top-K    the teacher's K most likely tokens at each position, renormalised over those K, against the
           student's full-vocabulary log-softmax at the same ids (`topk_distill_loss`), differentiated
           directly like a supervised loss.

The student's log-softmax is computed over vocabulary chunks with an online log-sum-exp, forward and
backward, so no [tokens, V] float32 array exists at once beyond the logits themselves (and their gradient,
in the logits' dtype).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.objectives._checks import check_token_shapes
from jaxrl_llm.objectives.aggregate import LossTerms, aggregate_terms, check_mode, safe_divide

# A finite floor for the running maximum: exp() of it is 0 and never makes a NaN.
_FLOOR = -1e30


def reverse_kl_advantages(student_logp, teacher_logp, mask) -> jax.Array:
    """Per-token advantages of on-policy distillation: A_t = (log pi_T(y_t) - log pi_S(y_t)) m_t.

    y_t is the token the student sampled and pi_S the policy that sampled it (the sampler's behaviour
    log-probs), so A_t is a one-sample estimate of minus the reverse KL, -KL(pi_S || pi_T), at position t.
    Used as the policy loss's [B, T] advantages with no discounting (each token's own term, not a sum over
    the tokens after it): Agarwal et al. 2024 (GKD), "On-policy distillation of language models"; Lu and
    Thinking Machines Lab 2025, "On-Policy Distillation". Masked positions are exactly 0 whatever they hold.

    Args:
      student_logp: [B, T] log-probs of the sampled tokens under the student (the sampler's).
      teacher_logp: [B, T] log-probs of the same tokens under the teacher.
      mask: [B, T] response-token mask.

    Returns:
      [B, T] float32 (or wider) advantages.
    """
    student_logp, teacher_logp, mask = jnp.asarray(student_logp), jnp.asarray(teacher_logp), jnp.asarray(mask)
    check_token_shapes("reverse_kl_advantages", "student_logp", student_logp, teacher_logp=teacher_logp, mask=mask)
    dtype = jnp.promote_types(jnp.result_type(student_logp, teacher_logp), jnp.float32)
    mask = mask.astype(dtype)
    diff = teacher_logp.astype(dtype) - student_logp.astype(dtype)
    return jnp.where(mask != 0, diff, 0.0) * mask


def _log_z(logits, chunk: int) -> jax.Array:
    """logsumexp over the last axis of logits [N, V], one [N, chunk] float32 block at a time -> [N] f32."""
    vocab = logits.shape[-1]
    whole, tail = divmod(vocab, chunk)

    def update(carry, block):
        m, s = carry
        block = block.astype(jnp.float32)
        m_new = jnp.maximum(m, block.max(-1))
        return m_new, s * jnp.exp(m - m_new) + jnp.exp(block - m_new[:, None]).sum(-1)

    carry = (jnp.full(logits.shape[:1], _FLOOR, jnp.float32), jnp.zeros(logits.shape[:1], jnp.float32))
    if whole:
        carry = jax.lax.fori_loop(
            0, whole, lambda i, c: update(c, jax.lax.dynamic_slice_in_dim(logits, i * chunk, chunk, 1)), carry)
    if tail:
        carry = update(carry, logits[:, whole * chunk:])
    m, s = carry
    return m + jnp.log(s)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _log_softmax_at(logits, ids, chunk):
    """log softmax(logits)[ids]: logits [N, V], ids [N, K] int -> [N, K] f32, chunked over V both ways."""
    return _log_softmax_at_fwd(logits, ids, chunk)[0]


def _log_softmax_at_fwd(logits, ids, chunk):
    log_z = _log_z(logits, chunk)
    picked = jnp.take_along_axis(logits, ids, axis=-1).astype(jnp.float32) - log_z[:, None]
    return picked, (logits, ids, log_z)


def _log_softmax_at_bwd(chunk, residuals, g):
    """d/dl_v of sum_k g_k log p(id_k) = sum_k g_k [v = id_k] - (sum_k g_k) p_v, one chunk of v at a time."""
    logits, ids, log_z = residuals
    g = g.astype(jnp.float32)
    g_sum = g.sum(-1, keepdims=True)
    rows = jnp.arange(logits.shape[0])[:, None]
    vocab = logits.shape[-1]
    whole, tail = divmod(vocab, chunk)

    def chunk_grad(block, start):
        width = block.shape[-1]
        # Rows with no cotangent (padding) give exactly 0, even where their logits are inf or NaN.
        d = jnp.where(g_sum != 0, -g_sum * jnp.exp(block.astype(jnp.float32) - log_z[:, None]), 0.0)
        local = ids - start
        local = jnp.where((local >= 0) & (local < width), local, width)  # out of this chunk: dropped
        return d.at[rows, local].add(g, mode="drop").astype(logits.dtype)

    d_logits = jnp.zeros(logits.shape, logits.dtype)
    if whole:
        def body(i, d_logits):
            block = jax.lax.dynamic_slice_in_dim(logits, i * chunk, chunk, 1)
            return jax.lax.dynamic_update_slice_in_dim(d_logits, chunk_grad(block, i * chunk), i * chunk, 1)

        d_logits = jax.lax.fori_loop(0, whole, body, d_logits)
    if tail:
        d_logits = d_logits.at[:, whole * chunk:].set(chunk_grad(logits[:, whole * chunk:], whole * chunk))
    return d_logits, np.zeros(ids.shape, jax.dtypes.float0)


_log_softmax_at.defvjp(_log_softmax_at_fwd, _log_softmax_at_bwd)


def _check_topk(student_logits, teacher_ids, teacher_logp, mask, agg, max_len, chunk):
    if student_logits.ndim != 3:
        raise ValueError(f"topk_distill_loss: student_logits must be [B, T, V], got shape {student_logits.shape}")
    b_t, vocab = student_logits.shape[:2], student_logits.shape[2]
    if teacher_ids.ndim != 3 or teacher_ids.shape[:2] != b_t or teacher_ids.shape[2] < 1:
        raise ValueError(f"topk_distill_loss: teacher_ids must be [B, T, K] with [B, T] = {b_t} and K >= 1, "
                         f"got shape {teacher_ids.shape}")
    if not jnp.issubdtype(teacher_ids.dtype, jnp.integer):
        raise ValueError(f"topk_distill_loss: teacher_ids must be integer token ids, got dtype {teacher_ids.dtype}")
    if teacher_logp.shape != teacher_ids.shape:
        raise ValueError(f"topk_distill_loss: teacher_logp must have teacher_ids' shape {teacher_ids.shape}, "
                         f"got {teacher_logp.shape}")
    if mask.shape != b_t:
        raise ValueError(f"topk_distill_loss: mask must be [B, T] = {b_t}, got {mask.shape}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"topk_distill_loss: chunk must be a positive int, got {chunk!r}")
    check_mode(agg, max_len, "topk_distill_loss")
    if not isinstance(teacher_ids, jax.core.Tracer):
        low, high = int(jnp.min(teacher_ids)), int(jnp.max(teacher_ids))
        if low < 0 or high >= vocab:
            raise ValueError(f"topk_distill_loss: teacher_ids must lie in [0, {vocab}) (the student's vocabulary), "
                             f"got ids from {low} to {high}")


def topk_distill_terms(student_logits, teacher_ids, teacher_logp, mask, *, agg: str = "token-mean",
                       max_len: int | None = None, chunk: int = 8192) -> tuple[LossTerms, dict[str, jax.Array]]:
    """The unreduced top-K distillation loss `LossTerms(total, denom)` and the metrics of `topk_distill_loss`.

    Both parts are sums over rows (`aggregate_terms`), so summing them over row-wise micro-batches gives the
    full batch's exactly, and the summed gradients of `total` over the summed `denom` are its gradient.
    """
    student_logits, teacher_ids = jnp.asarray(student_logits), jnp.asarray(teacher_ids)
    teacher_logp, mask = jnp.asarray(teacher_logp), jnp.asarray(mask)
    _check_topk(student_logits, teacher_ids, teacher_logp, mask, agg, max_len, chunk)
    batch, length, vocab = student_logits.shape
    student = _log_softmax_at(student_logits.reshape(-1, vocab), teacher_ids.reshape(batch * length, -1), chunk)
    return topk_terms_at_ids(student.reshape(teacher_ids.shape), teacher_logp, mask, agg=agg, max_len=max_len)


def topk_terms_at_ids(student_logp, teacher_logp, mask, *, agg: str = "token-mean",
                      max_len: int | None = None) -> tuple[LossTerms, dict[str, jax.Array]]:
    """`topk_distill_terms` from the student's full-vocabulary log-probs of the teacher's ids, `student_logp`
    [B, T, K] (the trainer's pass gives them from its hidden states, `train.logprobs.ids_logprobs`), with
    `teacher_logp` [B, T, K] and `mask` [B, T]: loss_t = sum_k p~_k (log p~_k - student_logp_k)."""
    student_logp, teacher_logp, mask = jnp.asarray(student_logp), jnp.asarray(teacher_logp), jnp.asarray(mask)
    if student_logp.shape != teacher_logp.shape or student_logp.shape[:-1] != mask.shape:
        raise ValueError(f"topk_terms_at_ids: student_logp and teacher_logp must be [B, T, K] over mask [B, T], got "
                         f"{student_logp.shape}, {teacher_logp.shape} and {mask.shape}")
    check_mode(agg, max_len, "topk_terms_at_ids")
    on = (mask != 0)[..., None]
    # The teacher is a fixed target; padding positions may hold anything (-inf included).
    teacher = jnp.where(on, jax.lax.stop_gradient(teacher_logp).astype(jnp.float32), 0.0)
    log_q = teacher - jax.nn.logsumexp(teacher, axis=-1, keepdims=True)
    q = jnp.exp(log_q)
    student = jnp.where(on, student_logp.astype(jnp.float32), 0.0)
    per_token = jnp.sum(jnp.where(q > 0, q * (log_q - student), 0.0), axis=-1)
    terms = aggregate_terms(per_token, mask, agg, max_len=max_len)
    float_mask = mask.astype(jnp.float32)

    def masked_mean(x):
        return safe_divide(jnp.sum(jnp.where(on[..., 0], x, 0.0) * float_mask), float_mask.sum())

    metrics = {
        "topk_coverage": masked_mean(jnp.exp(jax.lax.stop_gradient(student)).sum(-1)),
        "teacher_topk_mass": masked_mean(jnp.exp(teacher).sum(-1)),
        "num_tokens": float_mask.sum(),
    }
    return terms, metrics


def topk_distill_loss(student_logits, teacher_ids, teacher_logp, mask, *, agg: str = "token-mean",
                      max_len: int | None = None, denom=None, chunk: int = 8192) -> tuple[jax.Array, dict]:
    """Top-K distillation on the student's own samples (GKD's token-level divergence on a top-K support).

    At each position t the teacher's K most likely ids id_k with log-probs T_k are renormalised over the K,
    log p~_k = T_k - logsumexp_j T_j, and compared with the student's full-vocabulary log-softmax at the same
    ids:

      loss_t = sum_k p~_k (log p~_k - log p_S(id_k)),    log p_S(v) = l_v - logsumexp_u l_u

    reduced over the response mask like the other losses (`aggregate`, mode `agg`). Gradient:
    d loss_t / d l_v = (sum_k p~_k) p_S(v) - sum_k p~_k [v = id_k] = p_S(v) - p~(v): the student's softmax
    pulled towards the renormalised teacher on its K ids. The teacher is a constant (stop-gradient). The
    student's log-sum-exp and its gradient run over vocabulary chunks of `chunk` ids (an online log-sum-exp
    like the trainer's log-prob pass): no [B, T, V] float32 array besides the logits' own gradient, which
    has the logits' dtype. Agarwal et al. 2024, "On-policy distillation of language models: learning from
    self-generated mistakes" (GKD); Lu and Thinking Machines Lab 2025, "On-Policy Distillation".

    Args:
      student_logits: [B, T, V] the student's logits at the positions that predict each response token.
      teacher_ids: [B, T, K] int, the teacher's top-K token ids at each position (in [0, V)).
      teacher_logp: [B, T, K] the teacher's full-vocabulary log-probs of those ids.
      mask: [B, T] response-token mask.
      agg: an aggregation mode of `aggregate` (AGG_MODES); max_len: its constant for seq-mean-token-sum-norm.
      denom: optional normaliser replacing this batch's own denominator (the full batch's
        `aggregate_denominator(mask, agg)` when this call sees one micro-batch of it).
      chunk: vocabulary ids per block of the log-sum-exp.

    Returns:
      (loss scalar, metrics over the masked tokens: topk_coverage, the mean of sum_k p_S(id_k), the student's
      probability mass on the teacher's top K; teacher_topk_mass, the mean of sum_k exp(T_k); num_tokens).
    """
    terms, metrics = topk_distill_terms(student_logits, teacher_ids, teacher_logp, mask, agg=agg, max_len=max_len,
                                        chunk=chunk)
    return safe_divide(terms.total, terms.denom if denom is None else denom), metrics

