"""Log-probabilities and entropies of response tokens without a [B, T, V] logits tensor.

The policy's log-prob of each response token needs a softmax over the whole vocabulary. Rather than
materialise logits for every position, the trainer (1) runs the decoder once over packed rows, (2)
gathers the hidden states that predict response tokens only, and (3) scans over vocabulary chunks with
an online log-sum-exp, so peak memory holds one [B, R, chunk] block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import models


_FLOOR = -1e30


def gather_response_hidden(hidden: jax.Array, prompt_lens: jax.Array, response_len: int) -> jax.Array:
    """Rows of `hidden` [B, T, D] that predict response token r: position prompt_len - 1 + r -> [B, R, D]."""
    idx = prompt_lens[:, None] - 1 + jnp.arange(response_len)[None, :]
    idx = jnp.clip(idx, 0, hidden.shape[1] - 1)
    return jnp.take_along_axis(hidden, idx[..., None], axis=1)


def chunked_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array, *, chunk: int = 8192,
                     with_entropy: bool = False):
    """log softmax(hidden @ head.T)[targets] (and the softmax entropy), chunked over the vocabulary.

    hidden [B, R, D], head [V, D], targets [B, R] int. Online log-sum-exp: with m the running max,
    s = sum exp(l - m) and u = sum exp(l - m) * l, logZ = m + log s and H = logZ - u / s.
    The backward pass recomputes each chunk's logits l and applies, with p = exp(l - logZ),
      d logp / d l = onehot(target) - p,    d H / d l = -p (l - E_p[l]),
    so neither pass holds more than one [B, R, chunk] block of logits (a custom VJP; plain autodiff
    of the scan would keep every chunk's logits and exponentials for the backward pass).
    Returns logp [B, R] f32 (and entropy [B, R] f32 when with_entropy).
    """
    logp, entropy = _logprobs_entropy(hidden, head, targets, chunk)
    return (logp, entropy) if with_entropy else logp


def _vocab_blocks(head: jax.Array, chunk: int) -> jax.Array:
    """head [V, D] zero-padded to whole chunks: [n_chunks, chunk, D]."""
    n_chunks = -(-head.shape[0] // chunk)
    pad = n_chunks * chunk - head.shape[0]
    return jnp.pad(head, ((0, pad), (0, 0))).reshape(n_chunks, chunk, head.shape[1])


def _forward_stats(hidden, head, targets, chunk):
    """(logp, entropy, logZ, E_p[l]) [B, R] each, by one online log-sum-exp scan over vocabulary chunks,
    and every chunk's logits [n_chunks, B, R, chunk] f32 (dropped by XLA where unused)."""
    vocab = head.shape[0]
    blocks = _vocab_blocks(head, chunk)
    hidden = hidden.astype(head.dtype)
    shape = targets.shape
    # A finite floor instead of -inf: exp() of it is 0 and never makes a NaN.
    init = (jnp.full(shape, _FLOOR, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))

    def body(carry, inputs):
        m, s, u, target_logit = carry
        block, start = inputs
        logits = jnp.einsum("brd,vd->brv", hidden, block, preferred_element_type=jnp.float32)
        valid = (start + jnp.arange(chunk)) < vocab
        logits = jnp.where(valid, logits, _FLOOR)
        m_new = jnp.maximum(m, logits.max(-1))
        scale = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[..., None])
        s = s * scale + p.sum(-1)
        u = u * scale + jnp.where(valid, p * logits, 0.0).sum(-1)
        local = targets - start
        in_chunk = (local >= 0) & (local < chunk)
        picked = jnp.take_along_axis(logits, jnp.clip(local, 0, chunk - 1)[..., None], axis=-1)[..., 0]
        target_logit = jnp.where(in_chunk, picked, target_logit)
        return (m_new, s, u, target_logit), logits

    starts = jnp.arange(blocks.shape[0]) * chunk
    (m, s, u, target_logit), chunk_logits = jax.lax.scan(body, init, (blocks, starts))
    log_z = m + jnp.log(s)
    mean_logit = u / s
    return target_logit - log_z, log_z - mean_logit, log_z, mean_logit, chunk_logits


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _logprobs_entropy(hidden, head, targets, chunk):
    return _forward_stats(hidden, head, targets, chunk)[:2]


def _logprobs_entropy_fwd(hidden, head, targets, chunk):
    logp, entropy, log_z, mean_logit, chunk_logits = _forward_stats(hidden, head, targets, chunk)
    return (logp, entropy), (hidden, head, targets, log_z, mean_logit, chunk_logits)


def _logprobs_entropy_bwd(chunk, residuals, cotangents):
    hidden, head, targets, log_z, mean_logit, chunk_logits = residuals
    g_logp, g_entropy = cotangents
    vocab, dtype = head.shape[0], head.dtype
    blocks = _vocab_blocks(head, chunk)
    hidden_c = hidden.astype(dtype)

    def body(d_hidden, inputs):
        block, start, logits = inputs
        valid = (start + jnp.arange(chunk)) < vocab
        p = jnp.where(valid, jnp.exp(logits - log_z[..., None]), 0.0)
        onehot = (targets - start)[..., None] == jnp.arange(chunk)
        d_logits = (jnp.where(onehot, g_logp[..., None], 0.0)
                    - p * (g_logp[..., None] + g_entropy[..., None] * (logits - mean_logit[..., None])))
        d_logits = d_logits.astype(dtype)
        d_hidden = d_hidden + jnp.einsum("brv,vd->brd", d_logits, block, preferred_element_type=jnp.float32)
        d_block = jnp.einsum("brv,brd->vd", d_logits, hidden_c, preferred_element_type=jnp.float32)
        return d_hidden, d_block.astype(dtype)

    starts = jnp.arange(blocks.shape[0]) * chunk
    d_hidden, d_blocks = jax.lax.scan(body, jnp.zeros(hidden.shape, jnp.float32), (blocks, starts, chunk_logits))
    d_head = d_blocks.reshape(-1, head.shape[1])[:vocab]
    return d_hidden.astype(hidden.dtype), d_head, np.zeros(targets.shape, jax.dtypes.float0)


_logprobs_entropy.defvjp(_logprobs_entropy_fwd, _logprobs_entropy_bwd)


def response_logprobs(params, config, batch, *, chunk: int = 8192, with_entropy: bool = False):
    """Per-token log pi(y_r | x, y_<r) [G, S, R] of the responses of a packed batch (`train.packing`).

    One decoder pass over the packed rows (segment-aware attention), then the hidden states that
    predict each response token are gathered and scored against the vocabulary in chunks.
    """
    hidden = models.hidden_states(params, config, batch.tokens, batch.positions, segment_ids=batch.segments)
    rows, slots, resp_len = batch.pred_index.shape
    hidden = jnp.take_along_axis(hidden, batch.pred_index.reshape(rows, slots * resp_len)[..., None], axis=1)
    out = chunked_logprobs(hidden, output_matrix(params, config), batch.response_tokens.reshape(rows, -1),
                           chunk=chunk, with_entropy=with_entropy)
    if with_entropy:
        return tuple(x.reshape(rows, slots, resp_len) for x in out)
    return out.reshape(rows, slots, resp_len)


def row_logprobs(params, config, tokens, prompt_lens, response_tokens, *, chunk: int = 8192):
    """log pi of each response token [B, R] for unpacked rows: tokens [B, T] = prompt then response,
    right-padded; prompt_lens [B]; response_tokens [B, R] (one sample per row, e.g. per-sample gradients)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    hidden = models.hidden_states(params, config, tokens, positions)
    hidden = gather_response_hidden(hidden, prompt_lens, response_tokens.shape[1])
    return chunked_logprobs(hidden, output_matrix(params, config), response_tokens, chunk=chunk)


def output_matrix(params, config) -> jax.Array:
    """The [V, D] output embedding in the compute dtype: the token embedding when tied, else lm_head^T."""
    head = params["embed"] if config.tie_word_embeddings else params["lm_head"].T
    return head.astype(jnp.dtype(config.compute_dtype))
