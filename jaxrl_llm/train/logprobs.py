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
from jaxrl_llm.models.layers import einsum_f32, soft_cap


_FLOOR = -1e30


def gather_response_hidden(hidden: jax.Array, prompt_lens: jax.Array, response_len: int) -> jax.Array:
    """Rows of `hidden` [B, T, D] that predict response token r: position prompt_len - 1 + r -> [B, R, D]."""
    idx = prompt_lens[:, None] - 1 + jnp.arange(response_len)[None, :]
    idx = jnp.clip(idx, 0, hidden.shape[1] - 1)
    return jnp.take_along_axis(hidden, idx[..., None], axis=1)


def chunked_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array, *, chunk: int = 8192,
                     with_entropy: bool = False, entropy_grad: bool = True, keep_logits: bool = True,
                     softcap: float | None = None):
    """log softmax(hidden @ head.T)[targets] (and the softmax entropy), chunked over the vocabulary.
    With `softcap` c the logits are c tanh(hidden @ head.T / c) (Gemma 2's final soft-capping); the
    backward pass multiplies d/dl by the cap's derivative 1 - (l / c)^2.

    hidden [B, R, D], head [V, D], targets [B, R] int. Online log-sum-exp: with m the running max,
    s = sum exp(l - m) and u = sum exp(l - m) * l, logZ = m + log s and H = logZ - u / s.
    The backward pass takes each chunk's logits l from the forward pass and applies, with
    p = exp(l - logZ),
      d logp / d l = onehot(target) - p,    d H / d l = -p (l - E_p[l]),
    so the only [B, R, V]-sized values kept are the logits themselves (a custom VJP; plain autodiff
    would also keep exp(l) and every intermediate of the online log-sum-exp). With `keep_logits=False`
    not even those are kept: the backward pass recomputes each chunk's logits from the hidden states
    (one more [N, D] x [D, chunk] product per chunk), so the residuals are O(B R D), not O(B R V).
    Kept chunks come from a static Python loop: each chunk's logits are their own buffer (a scan would
    zero-fill and copy them into one stacked array). The last chunk may be shorter, so no padded
    vocabulary entries are scored.
    With `entropy_grad=False` the entropy is a metric only: no gradient flows through it (as under
    `jax.lax.stop_gradient`), and the backward pass skips its term.
    Returns logp [B, R] f32 (and entropy [B, R] f32 when with_entropy).
    """
    logp, entropy = _logprobs_entropy(hidden, head, targets, chunk, entropy_grad, keep_logits, softcap)
    return (logp, entropy) if with_entropy else logp


def _chunk_starts(vocab: int, chunk: int) -> list[int]:
    if chunk <= 0:
        raise ValueError(f"log-prob vocabulary chunk must be positive, got {chunk}")
    return list(range(0, vocab, chunk))


def _split_chunks(vocab: int, chunk: int) -> tuple[int, int]:
    """(number of whole chunks, width of the shorter last chunk or 0)."""
    _chunk_starts(vocab, chunk)  # validates chunk
    return vocab // chunk, vocab % chunk


def _update_stats(stats, logits, start, targets):
    """The online log-sum-exp state (m, s, u, target logit) after one chunk's logits [..., width]."""
    m, s, u, target_logit = stats
    width = logits.shape[-1]
    m_new = jnp.maximum(m, logits.max(-1))
    scale = jnp.exp(m - m_new)
    p = jnp.exp(logits - m_new[..., None])
    s = s * scale + p.sum(-1)
    u = u * scale + (p * logits).sum(-1)
    local = targets - start
    in_chunk = (local >= 0) & (local < width)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, width - 1)[..., None], axis=-1)[..., 0]
    return m_new, s, u, jnp.where(in_chunk, picked, target_logit)


def _forward_stats(hidden, head, targets, chunk, keep_logits, softcap):
    """(logp, entropy, logZ, E_p[l]) [B, R] each, by an online log-sum-exp over vocabulary chunks, and
    every chunk's logits [B, R, width] f32 (`keep_logits`; else None).

    Kept logits: a static loop, each chunk's logits their own buffer (a scan would zero-fill and copy
    them into one stacked array). Otherwise a `lax.fori_loop` over the whole chunks (then the shorter
    last one): the loop makes every backend compute one chunk's logits at a time (XLA's CPU scheduler runs
    all of a static loop's independent products first)."""
    vocab = head.shape[0]
    hidden = hidden.astype(head.dtype)
    shape = targets.shape
    # A finite floor instead of -inf: exp() of it is 0 and never makes a NaN.
    stats = (jnp.full(shape, _FLOOR, jnp.float32), *(jnp.zeros(shape, jnp.float32) for _ in range(3)))

    def logits_of(block):
        return soft_cap(einsum_f32("brd,vd->brv", hidden, block), softcap)

    chunk_logits = None
    if keep_logits:
        chunk_logits = []
        for start in _chunk_starts(vocab, chunk):
            chunk_logits.append(logits_of(head[start:start + chunk]))
            stats = _update_stats(stats, chunk_logits[-1], start, targets)
    else:
        whole, tail = _split_chunks(vocab, chunk)

        def body(i, carry):
            start = i * chunk
            return _update_stats(carry, logits_of(jax.lax.dynamic_slice_in_dim(head, start, chunk)), start, targets)

        if whole:
            stats = jax.lax.fori_loop(0, whole, body, stats)
        if tail:
            stats = _update_stats(stats, logits_of(head[whole * chunk:]), whole * chunk, targets)
    m, s, u, target_logit = stats
    log_z = m + jnp.log(s)
    mean_logit = u / s
    return target_logit - log_z, log_z - mean_logit, log_z, mean_logit, chunk_logits


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _logprobs_entropy(hidden, head, targets, chunk, entropy_grad, keep_logits, softcap):
    return _forward_stats(hidden, head, targets, chunk, keep_logits, softcap)[:2]


def _logprobs_entropy_fwd(hidden, head, targets, chunk, entropy_grad, keep_logits, softcap):
    logp, entropy, log_z, mean_logit, chunk_logits = _forward_stats(hidden, head, targets, chunk, keep_logits,
                                                                    softcap)
    return (logp, entropy), (hidden, head, targets, log_z, mean_logit, chunk_logits)


def _logprobs_entropy_bwd(chunk, entropy_grad, keep_logits, softcap, residuals, cotangents):
    hidden, head, targets, log_z, mean_logit, chunk_logits = residuals
    g_logp, g_entropy = cotangents
    dtype = head.dtype
    # Tokens on one axis: [N, D] and [N, chunk] matrices, so both products below are plain matmuls.
    hidden_c = hidden.astype(dtype).reshape(-1, hidden.shape[-1])
    flat = lambda x: x.reshape(-1, 1)  # noqa: E731
    d_targets = np.zeros(targets.shape, jax.dtypes.float0)
    g_logp, g_entropy, log_z, mean_logit, targets = (flat(x) for x in (g_logp, g_entropy, log_z, mean_logit,
                                                                       targets))

    def chunk_grads(logits, block, start):
        """(d hidden [N, D] f32, d block^T [D, width]) of one chunk."""
        p = jnp.exp(logits - log_z)
        onehot = (targets - start) == jnp.arange(logits.shape[-1])
        weight = g_logp
        if entropy_grad:
            weight = g_logp + g_entropy * (logits - mean_logit)
        d_logits = jnp.where(onehot, g_logp, 0.0) - p * weight
        if softcap is not None:  # through l = c tanh(z / c): dl/dz = 1 - tanh^2 = 1 - (l / c)^2
            d_logits = d_logits * (1.0 - jnp.square(logits / softcap))
        d_logits = d_logits.astype(dtype)
        # hidden^T d_logits reads d_logits in the layout it was written (d_logits^T hidden would copy it
        # transposed, a [N, chunk] pass as slow as the product itself on CPU).
        return (einsum_f32("nw,wd->nd", d_logits, block),
                jnp.dot(hidden_c.T, d_logits, preferred_element_type=dtype))

    def logits_of(block):  # the forward pass's product, recomputed
        return soft_cap(einsum_f32("nd,wd->nw", hidden_c, block), softcap)

    if keep_logits:
        d_hidden = jnp.zeros(hidden_c.shape, jnp.float32)
        d_head_t = []  # [D, width] pieces of d head^T
        for start, logits in zip(_chunk_starts(head.shape[0], chunk), chunk_logits):
            d_h, d_block_t = chunk_grads(logits.reshape(-1, logits.shape[-1]),
                                         head[start:start + logits.shape[-1]], start)
            d_hidden = d_hidden + d_h
            d_head_t.append(d_block_t)
        d_head = jnp.concatenate(d_head_t, axis=1).T
    else:
        whole, tail = _split_chunks(head.shape[0], chunk)

        def body(i, carry):  # each chunk's rows of d head written in place
            d_hidden, d_head = carry
            start = i * chunk
            block = jax.lax.dynamic_slice_in_dim(head, start, chunk)
            d_h, d_block_t = chunk_grads(logits_of(block), block, start)
            return d_hidden + d_h, jax.lax.dynamic_update_slice_in_dim(d_head, d_block_t.T, start, 0)

        d_hidden, d_head = jnp.zeros(hidden_c.shape, jnp.float32), jnp.zeros(head.shape, dtype)
        if whole:
            d_hidden, d_head = jax.lax.fori_loop(0, whole, body, (d_hidden, d_head))
        if tail:
            block = head[whole * chunk:]
            d_h, d_block_t = chunk_grads(logits_of(block), block, whole * chunk)
            d_hidden = d_hidden + d_h
            d_head = d_head.at[whole * chunk:].set(d_block_t.T)
    return d_hidden.reshape(hidden.shape).astype(hidden.dtype), d_head, d_targets


_logprobs_entropy.defvjp(_logprobs_entropy_fwd, _logprobs_entropy_bwd)


def response_logprobs(params, config, batch, *, chunk: int = 8192, with_entropy: bool = False,
                      entropy_grad: bool = True, compact: bool | None = None, topk_ids: jax.Array | None = None,
                      routing_replay: str = "none", with_routes: bool = False):
    """Per-token log pi(y_r | x, y_<r) [G, S, R] of the responses of a packed batch (`train.packing`).

    One decoder pass over the packed rows (segment-aware attention), then the hidden states that
    predict each response token are gathered and scored against the vocabulary in chunks
    (`chunked_logprobs`; `entropy_grad=False` makes the entropy a metric without gradient;
    `config.remat_logits` recomputes the chunks' logits in the backward pass instead of keeping them).

    Which positions are scored (`scored_positions`): every response slot, S x R per row, or with `compact`
    only the generated tokens, moved to the front of a row of L (the packed length) entries. Each generated
    token of a packed row sits at its own position of the row, so L entries always hold them; the compact
    layout is the smaller one when responses stop well before R (long-response RL: 8 slots of 3072 new
    tokens whose responses average a third of that score 24,576 positions per row, of which ~8,200 are
    tokens). `compact=None` picks it when L < S x R. The generated tokens' values are the same either way
    (one position's log-softmax does not depend on the others); slots past a response's end (mask 0) hold
    0 in the compact layout and the log-prob of their padding token in the slot layout.

    With `topk_ids` [G, S, R, K] (a teacher's top-K ids, `distill.mode` topk) the log-probs of those ids are
    returned last, [G, S, R, K] (`ids_logprobs`: from the same pass, no other vocabulary sweep).

    A mixture of experts with the sampler's routes (`batch.routes`): `routing_replay` "rollout" routes every
    recorded token to the sampler's experts (`decoder_pass`); `with_routes` appends the pass's `moe.LayerRoutes`
    (None without routes) to the outputs, which are then always a tuple."""
    full, routes = decoder_pass(params, config, batch, routing_replay=routing_replay, with_routes=with_routes)
    pred, targets, back = scored_positions(batch, compact)
    hidden = jnp.take_along_axis(full, pred[..., None], axis=1)
    head = output_matrix(params, config)
    out = chunked_logprobs(hidden, head, targets,
                           chunk=chunk, with_entropy=with_entropy, entropy_grad=entropy_grad,
                           keep_logits=not config.remat_logits, softcap=config.final_logit_softcapping)
    out = out if with_entropy else (out,)
    out = tuple(to_slots(x, back, batch.pred_index.shape) for x in out)
    if topk_ids is not None:
        out = (*out, ids_logprobs(full, head, batch, out[0], topk_ids, config.final_logit_softcapping))
    if with_routes:
        return (*out, routes)
    return out if with_entropy or topk_ids is not None else out[0]


ROUTING_REPLAYS = ("none", "rollout")


def decoder_pass(params, config, batch, *, routing_replay: str = "none", with_routes: bool = False):
    """(hidden [G, L, D], routes) of a packed batch: `models.hidden_states` over its rows. With the sampler's routes
    (`batch.routes`, a mixture of experts) and `routing_replay` "rollout" (R3, rollout routing replay) each recorded
    token goes to the sampler's experts in every sparse layer (its gate weights from this pass's router logits at
    them), the others (entries -1) to their own top k; `with_routes` also returns the pass's `moe.LayerRoutes`,
    load and router probabilities summed over the row's tokens (padding left out). routes is None otherwise."""
    if routing_replay not in ROUTING_REPLAYS:
        raise ValueError(f"routing_replay must be one of {ROUTING_REPLAYS}, got {routing_replay!r}")
    kwargs = dict(segment_ids=batch.segments, slots=batch.pred_index.shape[1], response_len=batch.pred_index.shape[2])
    replay = batch.routes if routing_replay == "rollout" else None
    if batch.routes is None or (replay is None and not with_routes):
        return models.hidden_states(params, config, batch.tokens, batch.positions, **kwargs), None
    real = (batch.segments <= batch.pred_index.shape[1]).astype(jnp.float32)  # segment S + 1 is padding
    return models.hidden_states(params, config, batch.tokens, batch.positions, replay=replay, token_weight=real,
                                with_routes=True, **kwargs)


def ids_logprobs(hidden, head, batch, logp, ids, softcap: float | None = None) -> jax.Array:
    """log softmax(l)[ids] [G, S, R, K] at each response position, from the log-prob of its response token:
    log p(v) = l_v - l_y + log p(y), with l = hidden @ head^T (soft-capped like the pass) at K + 1 rows of the
    head only, one id per position at a time. `hidden` [G, L, D] is the decoder's output, `logp` [G, S, R] the pass's log-probs of the response
    tokens y (their gradient carries the log-sum-exp's), `ids` [G, S, R, K] int. Slots past a response's end
    hold finite values of no meaning (their mask is 0)."""
    rows, slots, resp_len = batch.pred_index.shape
    k = ids.shape[-1]
    at = jnp.take_along_axis(hidden, batch.pred_index.reshape(rows, -1, 1), axis=1).astype(head.dtype)
    wanted = jnp.concatenate([batch.response_tokens.reshape(rows, -1, 1), ids.reshape(rows, -1, k)], axis=-1)

    def logit_of(index):  # one id per position: [G, S R] -> [G, S R]; rematerialised, so the backward pass keeps
        return einsum_f32("gpd,gpd->gp", at, head[index])  # no [G, S R, K, D] stack of gathered head rows

    logits = jax.lax.map(jax.checkpoint(logit_of), jnp.moveaxis(wanted, -1, 0))  # [K + 1, G, S R]
    logits = jnp.moveaxis(soft_cap(logits, softcap), 0, -1).reshape(rows, slots, resp_len, k + 1)
    return logits[..., 1:] - logits[..., :1] + logp[..., None]


def response_topk(params, config, batch, k: int, *, chunk: int = 8192,
                  compact: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """(ids [G, S, R, K] int32, log-probs [G, S, R, K] f32): the K most likely next tokens at each response
    position of a packed batch and their full-vocabulary log-probs, most likely first (the teacher's pass of
    `distill.mode` topk). One decoder pass, then per vocabulary chunk of `chunk` ids an online log-sum-exp and a
    running top-K merged with the chunk's own (a `lax.fori_loop`: one [positions, chunk] f32 block at a time).
    Positions as `response_logprobs` scores them (`scored_positions`); slots past a response's end hold 0."""
    full = models.hidden_states(params, config, batch.tokens, batch.positions, segment_ids=batch.segments,
                                slots=batch.pred_index.shape[1], response_len=batch.pred_index.shape[2])
    pred, _, back = scored_positions(batch, compact)
    head = output_matrix(params, config)
    hidden = jnp.take_along_axis(full, pred[..., None], axis=1).astype(head.dtype)
    shape = pred.shape

    def update(carry, block, start):
        m, s, top_v, top_i = carry
        logits = soft_cap(einsum_f32("gpd,vd->gpv", hidden, block), config.final_logit_softcapping)
        m_new = jnp.maximum(m, logits.max(-1))
        s = s * jnp.exp(m - m_new) + jnp.exp(logits - m_new[..., None]).sum(-1)
        v, i = jax.lax.top_k(logits, min(k, block.shape[0]))
        merged_v = jnp.concatenate([top_v, v], axis=-1)
        merged_i = jnp.concatenate([top_i, i.astype(jnp.int32) + start], axis=-1)
        top_v, pick = jax.lax.top_k(merged_v, k)
        return m_new, s, top_v, jnp.take_along_axis(merged_i, pick, axis=-1)

    carry = (jnp.full(shape, _FLOOR, jnp.float32), jnp.zeros(shape, jnp.float32),
             jnp.full((*shape, k), -jnp.inf, jnp.float32), jnp.zeros((*shape, k), jnp.int32))
    whole, tail = _split_chunks(head.shape[0], chunk)
    if whole:
        carry = jax.lax.fori_loop(
            0, whole, lambda i, c: update(c, jax.lax.dynamic_slice_in_dim(head, i * chunk, chunk), i * chunk), carry)
    if tail:
        carry = update(carry, head[whole * chunk:], whole * chunk)
    m, s, top_v, top_i = carry
    logp = top_v - (m + jnp.log(s))[..., None]
    return tuple(_topk_to_slots(x, back, batch.mask) for x in (top_i, logp))


def _topk_to_slots(values: jax.Array, back, mask: jax.Array) -> jax.Array:
    """`to_slots` for [G, P, K] values -> [G, S, R, K], 0 where `mask` [G, S, R] is."""
    if back is not None:
        values = jnp.take_along_axis(values, back[0][..., None], axis=1)
    values = values.reshape(*mask.shape, values.shape[-1])
    return jnp.where(mask[..., None] > 0, values, 0)


def scored_positions(batch, compact: bool | None = None):
    """(hidden index [G, K], target tokens [G, K], back) of the positions `response_logprobs` scores.

    Slot layout (compact False): K = S x R, entry s R + r is response token r of slot s (`pred_index`,
    `response_tokens` flattened); back is None. Compact layout: K = L, the row's generated tokens (mask 1)
    in slot order at entries 0, 1, ..., the rest padding (index 0, token 0); back = (index [G, S x R] of
    each slot entry's compact entry, valid [G, S x R] bool: the mask). Compact assumes what packing gives:
    a row holds no more generated tokens than positions (entries past L would be dropped).
    `compact=None`: compact when L < S x R."""
    rows, slots, resp_len = batch.pred_index.shape
    width = batch.tokens.shape[1]
    flat = lambda x: x.reshape(rows, slots * resp_len)  # noqa: E731
    if compact is None:
        compact = width < slots * resp_len
    if not compact:
        return flat(batch.pred_index), flat(batch.response_tokens), None
    valid = flat(batch.mask) > 0
    rank = jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1  # compact entry of each generated token
    dest = jnp.where(valid, rank, width)  # out of range: dropped by the scatter
    row = jnp.arange(rows)[:, None]
    pred = jnp.zeros((rows, width), jnp.int32).at[row, dest].set(flat(batch.pred_index), mode="drop")
    targets = jnp.zeros((rows, width), jnp.int32).at[row, dest].set(flat(batch.response_tokens), mode="drop")
    return pred, targets, (jnp.clip(rank, 0, width - 1), valid)


def to_slots(values: jax.Array, back, shape: tuple[int, int, int]) -> jax.Array:
    """Values of `scored_positions`' entries [G, K] laid out as response slots `shape` [G, S, R]: the slot
    layout as it is, compact entries moved back to their slots (`back`), slots past a response's end 0."""
    if back is not None:
        index, valid = back
        values = jnp.where(valid, jnp.take_along_axis(values, index, axis=1), 0.0)
    return values.reshape(shape)


def row_logprobs(params, config, tokens, prompt_lens, response_tokens, *, chunk: int = 8192):
    """log pi of each response token [B, R] for unpacked rows: tokens [B, T] = prompt then response,
    right-padded; prompt_lens [B]; response_tokens [B, R] (one sample per row, e.g. per-sample gradients)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    hidden = models.hidden_states(params, config, tokens, positions)
    hidden = gather_response_hidden(hidden, prompt_lens, response_tokens.shape[1])
    return chunked_logprobs(hidden, output_matrix(params, config), response_tokens, chunk=chunk,
                            keep_logits=not config.remat_logits, softcap=config.final_logit_softcapping)


def output_matrix(params, config) -> jax.Array:
    """The [V, D] output embedding in the compute dtype: the token embedding when tied, else lm_head^T."""
    head = params["embed"] if config.tie_word_embeddings else params["lm_head"].T
    return head.astype(jnp.dtype(config.compute_dtype))
