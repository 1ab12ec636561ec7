"""Log-probabilities and entropies of response tokens without a [B, T, V] logits tensor.

The policy's log-prob of each response token needs a softmax over the whole vocabulary. Rather than
materialise logits for every position, the trainer (1) runs the decoder once over packed rows, (2)
gathers the hidden states that predict response tokens only, and (3) scans over vocabulary chunks with
an online log-sum-exp, so peak memory holds one [B, R, chunk] block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
    Returns logp [B, R] f32 (and entropy [B, R] f32 when with_entropy).
    """
    vocab = head.shape[0]
    n_chunks = -(-vocab // chunk)
    pad = n_chunks * chunk - vocab
    head = jnp.pad(head, ((0, pad), (0, 0))).reshape(n_chunks, chunk, head.shape[1])
    hidden = hidden.astype(head.dtype)
    shape = targets.shape
    # A finite floor instead of -inf: exp() of it is 0, and 0 * floor stays finite in the backward pass.
    init = (jnp.full(shape, _FLOOR, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))

    def body(carry, inputs):
        m, s, u, target_logit = carry
        block, start = inputs
        logits = jnp.einsum("brd,vd->brv", hidden, block, preferred_element_type=jnp.float32)
        valid = (start + jnp.arange(chunk)) < vocab
        logits = jnp.where(valid, logits, _FLOOR)
        # The running max only keeps exp() in range; log Z does not depend on it, so no gradient.
        m_new = jax.lax.stop_gradient(jnp.maximum(m, logits.max(-1)))
        scale = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[..., None])
        s = s * scale + p.sum(-1)
        u = u * scale + jnp.where(valid, p * logits, 0.0).sum(-1)
        local = targets - start
        in_chunk = (local >= 0) & (local < chunk)
        picked = jnp.take_along_axis(logits, jnp.clip(local, 0, chunk - 1)[..., None], axis=-1)[..., 0]
        target_logit = jnp.where(in_chunk, picked, target_logit)
        return (m_new, s, u, target_logit), None

    starts = jnp.arange(n_chunks) * chunk
    (m, s, u, target_logit), _ = jax.lax.scan(body, init, (head, starts))
    log_z = m + jnp.log(s)
    logp = target_logit - log_z
    if with_entropy:
        return logp, log_z - u / s
    return logp


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
