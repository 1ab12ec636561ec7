"""Pick the next token of every row from its logits: greedy, temperature, top-k, top-p (nucleus).

Sampling uses inverse-CDF lookup with one uniform number per row, which needs only one pass over
the vocabulary (Gumbel-max would need a random number per vocabulary entry, several times slower
on CPU). The cumulative sums are two-level (blocks of `_BLOCK` entries, then entries inside the
chosen block), computed with small triangular matmuls at full f32 precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_BLOCK = 256
_HIGHEST = jax.lax.Precision.HIGHEST


def _inclusive_cumsum(weights: jax.Array) -> jax.Array:
    """Cumulative sum over the last axis as a matmul with an upper-triangular matrix of ones."""
    n = weights.shape[-1]
    upper = jnp.triu(jnp.ones((n, n), weights.dtype))
    return jnp.matmul(weights, upper, precision=_HIGHEST)


def _first_crossing(cumulative: jax.Array, weights: jax.Array, threshold: jax.Array) -> jax.Array:
    """Index of the first entry with weight > 0 whose cumulative sum exceeds `threshold` [R].

    Falls back to the last positive entry when rounding puts the threshold at the total, so a
    zero-weight (filtered) entry can never be returned.
    """
    positive = weights > 0
    crossing = (cumulative > threshold[:, None]) & positive
    n = weights.shape[-1]
    last_positive = n - 1 - jnp.argmax(positive[:, ::-1], axis=-1)
    return jnp.where(jnp.any(crossing, axis=-1), jnp.argmax(crossing, axis=-1), last_positive)


def inverse_cdf_sample(weights: jax.Array, uniform: jax.Array) -> jax.Array:
    """Draw index i of row r with probability weights[r, i] / sum_j weights[r, j].

    weights: [R, n] non-negative, at least one positive entry per row; uniform: [R] in [0, 1).
    Returns int32 [R]: the first i with cumsum(weights)[i] > uniform * total.
    """
    rows, n = weights.shape
    if n <= _BLOCK:
        cumulative = _inclusive_cumsum(weights)
        return _first_crossing(cumulative, weights, uniform * cumulative[:, -1]).astype(jnp.int32)
    num_blocks = -(-n // _BLOCK)
    padded = jnp.pad(weights, ((0, 0), (0, num_blocks * _BLOCK - n))).reshape(rows, num_blocks, _BLOCK)
    block_sums = padded.sum(axis=-1)
    block_cumulative = _inclusive_cumsum(block_sums)
    threshold = uniform * block_cumulative[:, -1]
    block = _first_crossing(block_cumulative, block_sums, threshold)
    before = jnp.take_along_axis(block_cumulative, block[:, None], axis=1)[:, 0] - \
        jnp.take_along_axis(block_sums, block[:, None], axis=1)[:, 0]
    in_block = jnp.take_along_axis(padded, block[:, None, None], axis=1)[:, 0]
    offset = _first_crossing(_inclusive_cumsum(in_block), in_block, threshold - before)
    return (block * _BLOCK + offset).astype(jnp.int32)


def nucleus_mask(sorted_probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keep the smallest prefix of descending-sorted probabilities whose mass reaches top_p.

    Entry i is kept iff the mass strictly before it, sum_{j<i} p_j, is below top_p * total; the most
    likely entry is always kept (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration").
    """
    total = sorted_probs.sum(axis=-1, keepdims=True)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    return mass_before < top_p * total


def selection_settings(temperature: float, top_p: float, top_k: int) -> tuple[jax.Array, jax.Array, dict]:
    """The decode loops' token selection from host settings: (temperature, top_p) as traced f32 scalars and the
    static keywords of `select_tokens` {greedy, top_k, use_top_p}. Temperature 0 is greedy (its traced
    temperature 1.0, unused; no top-k or nucleus); top_p 1 needs no nucleus pass."""
    greedy = temperature == 0.0
    static = dict(greedy=greedy, top_k=0 if greedy else int(top_k), use_top_p=not greedy and top_p < 1.0)
    return jnp.float32(1.0 if greedy else temperature), jnp.float32(top_p), static


def select_tokens(
    logits: jax.Array,
    uniform: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    *,
    greedy: bool,
    top_k: int,
    use_top_p: bool,
) -> tuple[jax.Array, jax.Array]:
    """Choose one token per row and return (tokens int32 [R], logprobs f32 [R]).

    logits: [R, V] raw model logits. Greedy (`greedy=True`) takes argmax(logits) (first index on
    ties, as torch.argmax). Otherwise the token is drawn from softmax(logits / temperature)
    restricted to the `top_k` largest logits (top_k = 0: no limit) and then to the top_p nucleus
    (`use_top_p`), the order `transformers` applies its logits warpers in.

    The returned log-probability is always that of the *raw* logits at temperature 1,
    log_softmax(logits)[token], whatever temperature and filters were used to draw the token:
    the policy probability a trainer's importance ratios need.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    if greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    elif top_k > 0 or use_top_p:
        k = min(top_k, vocab) if top_k > 0 else vocab
        top_values, top_indices = jax.lax.top_k(logits, k)  # sorted descending
        probs = jnp.exp((top_values - top_values[:, :1]) / temperature)
        if use_top_p:
            probs = jnp.where(nucleus_mask(probs, top_p), probs, 0.0)
        choice = inverse_cdf_sample(probs, uniform)
        tokens = jnp.take_along_axis(top_indices, choice[:, None], axis=1)[:, 0].astype(jnp.int32)
    else:
        tokens = inverse_cdf_sample(jnp.exp((logits - row_max) / temperature), uniform)
    log_normalizer = row_max[:, 0] + jnp.log(jnp.sum(jnp.exp(logits - row_max), axis=-1))
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=1)[:, 0]
    return tokens, chosen - log_normalizer
