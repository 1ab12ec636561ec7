"""Inference passes of the decoder shaped for sampling, built on the model's public layer function.

Every layer runs through `models.model.decoder_layer` (projections, RoPE, norms, MLP: the one place a
layer's arithmetic lives) with an attention of this module's own; only the data flow differs from
`models.forward_cached`, for speed on a decode loop:

- The row cache is split in a *prompt* part (slots 0..prompt_bucket-1, written once by prefill)
  and a *response* part indexed by generation step (slot t holds the key/value of generated token
  t for every row). All rows advance one step together, so a decode step writes one slot at the
  same index for every row: an in-place dynamic_update_slice instead of a scatter.
- Keys are stored transposed, [rows, kv_heads, head_dim, slots], so q k^T is a plain batched
  matmul (no per-step transpose of the cache); values are [rows, kv_heads, slots, head_dim].
- A sliding-window layer (Mistral, Gemma) keeps min(new-token bucket, window) response slots, a ring:
  generated token t goes to slot t mod that size, overwriting a token the window no longer sees.
- With `response_tile` > 0 (both engines at new-token buckets >= 256, `buckets.response_tile_size`) a full-attention
  layer's response part is a tuple of separate tile buffers, and a step attends only over the tiles generated so
  far (a `lax.switch` on step // tile, the deepest row's with a step per row): early in a 512-token call a static
  step reads a quarter of the response cache.
  Separate buffers, not slices of one: XLA copies a slice before a dot, and one dot per tile of a shared
  buffer cost more than the whole (benchmarks/README, decode_step.py's section, "Tried and not kept").
- Caches and layer weights are tuples with one entry per layer and the decode step loops over
  layers in Python: a scan over stacked layers would copy every layer's weights and cache slice
  out of the stacked arrays at every step (the dominant cost of a memory-bound decode on CPU).
- The static engine keeps one prompt entry per group of g consecutive rows that sample the same prompt (g: the
  largest that divides every prompt's sample count and a device's rows, `buckets.prompt_group_size`; 8 for
  GRPO's 8 samples per prompt): the prompt's keys and values are stored once and each step reads them once for the
  group, in one [g H / KV, d] x [d, P] product per KV head instead of g matrix-vector products.
- Prefill computes logits only at each prompt's last position.
- The continuous-batching engine (`sampling.continuous`) runs the same decode step with one step per
  row (rows at different token positions: per-row RoPE positions, cache slots and masks, the cache
  written by a scatter) and reads each row's prompt keys/values from a cache of one entry per prompt
  (`prompt_rows`), shared by all the rows that continue that prompt.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.models import ModelConfig, output_logits
from jaxrl_llm.models.layers import soft_cap
from jaxrl_llm.models.attention import prompt_attention
from jaxrl_llm.models.model import decoder_layer, embed_tokens, layer_constants, norm, sparse_layer_routes


class RowCache(NamedTuple):
    """Per-layer tuples of key/value buffers for R rows (P = prompt bucket, N = new-token bucket).

    prompt_k [R, KV, d, P], prompt_v [R, KV, P, d]: keys/values of the prompt at positions 0..P-1 (or one entry per
    group of g consecutive rows that continue the same prompt: [R / g, ...], read by `_attend` as one product);
    response_k [R, KV, d, N], response_v [R, KV, N, d]: of generated token t (position
    prompt_length + t) in slot t; on a sliding layer N is min(N, window) and the slot t mod N.
    A tiled layer's response_k / response_v entry is a tuple of N / T buffers [R, KV, d, T] / [R, KV, T, d]:
    token t in tile t // T, slot t mod T.
    """

    prompt_k: tuple
    prompt_v: tuple
    response_k: tuple
    response_v: tuple


def empty_row_cache(config: ModelConfig, rows: int, prompt_bucket: int, new_token_bucket: int,
                    dtype=None, response_tile: int = 0, prompt_group: int = 1) -> RowCache:
    """Zero caches; with `response_tile` T > 0 (dividing new_token_bucket) every full-attention layer's
    response part is a tuple of new_token_bucket / T tile buffers (sliding layers keep their ring). With
    `prompt_group` g > 1 (dividing rows) the prompt part holds one entry per g consecutive rows, which continue
    the same prompt (`buckets.prompt_group_size`): rows / g entries."""
    dtype = jnp.dtype(dtype or config.compute_dtype)
    kv, d = config.num_kv_heads, config.head_dim
    if response_tile and new_token_bucket % response_tile:
        raise ValueError(f"response_tile {response_tile} must divide the new-token bucket {new_token_bucket}")
    if prompt_group < 1 or rows % prompt_group:
        raise ValueError(f"prompt_group {prompt_group} must be >= 1 and divide the rows ({rows})")
    slots = response_slots(config, new_token_bucket)
    entries = rows // prompt_group
    prompt_k = tuple(jnp.zeros((entries, kv, d, prompt_bucket), dtype) for _ in slots)
    prompt_v = tuple(jnp.zeros((entries, kv, prompt_bucket, d), dtype) for _ in slots)

    def response(n, sliding, shape):
        if response_tile and not sliding:
            return tuple(jnp.zeros(shape(response_tile), dtype) for _ in range(n // response_tile))
        return jnp.zeros(shape(n), dtype)

    layers = list(zip(slots, config.sliding_layers()))
    return RowCache(prompt_k, prompt_v, tuple(response(n, w, lambda t: (rows, kv, d, t)) for n, w in layers),
                    tuple(response(n, w, lambda t: (rows, kv, t, d)) for n, w in layers))


def response_slots(config: ModelConfig, new_token_bucket: int) -> tuple[int, ...]:
    """Response slots of each layer's cache: the bucket, or min(bucket, window) on a sliding layer."""
    return tuple(min(new_token_bucket, config.sliding_window) if sliding else new_token_bucket
                 for sliding in config.sliding_layers())


def unstack_layers(params) -> list:
    """The stacked layer parameters as one dict per layer."""
    stacked = params["layers"]
    num_layers = jax.tree_util.tree_leaves(stacked)[0].shape[0]
    return [jax.tree_util.tree_map(lambda a, i=i: a[i], stacked) for i in range(num_layers)]


def _prefill_layer(config: ModelConfig, tokens: jax.Array, cache_dtype, constrain=None, with_routes: bool = False):
    """One layer of the prefill of prompts tokens [C, P] (positions 0..P-1): (x, (layer params, its constants))
    -> (x, (keys [C, KV, d, P], values [C, KV, P, d])) in the cache's layout; the constants are
    `layer_constants`' (scanned or one layer's). `constrain(x, features=False)` pins the hidden states, keys
    and values to the prompts' sharding (`engine.prefill_constraint`: on a mesh, split over the row axes, so
    each device runs its own prompts); None: no constraint. With `with_routes` a layer's output also holds its
    `moe.LayerRoutes` (routing replay: the experts each prompt token chose)."""
    constrain = constrain or _unconstrained
    count, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (count, length))
    cache_dtype = jnp.dtype(cache_dtype or config.compute_dtype)
    distance = positions[:, :, None] - positions[:, None, :]
    causal = distance >= 0

    def layer(x, layer_in):
        lp, const = layer_in
        window = const.get("window")

        def attend_fn(q, k, v):  # k, v [C, P, KV, d]
            keep = causal if window is None else causal & (distance < window)
            return prompt_attention(q, k, v, keep, config, window=window, sinks=lp.get("attn_sinks")), (constrain(jnp.transpose(k, (0, 2, 3, 1)).astype(cache_dtype)),
                                                   constrain(jnp.transpose(v, (0, 2, 1, 3)).astype(cache_dtype)))

        if with_routes:
            x, kv, routes = decoder_layer(lp, config, constrain(x), positions, attend_fn, const.get("inv_freq"),
                                          const.get("sparse"), {})
            return constrain(x), (*kv, routes)
        x, kv = decoder_layer(lp, config, constrain(x), positions, attend_fn, const.get("inv_freq"), const.get("sparse"))
        return constrain(x), kv

    return layer


def _unconstrained(x: jax.Array, features: bool = False) -> jax.Array:
    return x


def _embed_prompts(params, config: ModelConfig, tokens: jax.Array, constrain) -> jax.Array:
    """The prompts' embeddings, split as `constrain` splits hidden states: looked up with the hidden dimension split
    as the table's (no device gathers the whole table), then moved to the prompts' split."""
    constrain = constrain or _unconstrained
    return constrain(constrain(embed_tokens(params, config, tokens), features=True))


def _prompt_logits(params, config: ModelConfig, x: jax.Array, lengths: jax.Array, constrain) -> jax.Array:
    """The logits [C, V] of each prompt's last position (`lengths` - 1). The final-norm hidden states go to the
    output matrix split over their hidden dimension as it is (a product with its contraction split, not a
    gathered output matrix); the logits are then split as the prompts."""
    constrain = constrain or _unconstrained
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [C, D]
    last = norm(last, params["final_norm"], config)
    return constrain(output_logits(params, config, constrain(last, features=True)))


def prefill_cache(params, config: ModelConfig, tokens: jax.Array, lengths: jax.Array,
                  cache_dtype=None, constrain=None, with_routes: bool = False) -> tuple:
    """Run right-padded prompts tokens [C, P] (positions 0..P-1) through the decoder.

    Returns (logits [C, V] f32 at position lengths - 1, keys [layers, C, KV, d, P],
    values [layers, C, KV, P, d]). Slots >= a prompt's length hold padding and are never attended.
    `constrain`: as `_prefill_layer`'s. With `with_routes` (a mixture of experts) also the experts each prompt
    token chose in each sparse layer, [C, P, L_sparse, k] (`moe.route_dtype`), last.
    """
    layer = _prefill_layer(config, tokens, cache_dtype, constrain, with_routes)
    x, (keys, values, *routes) = jax.lax.scan(layer, _embed_prompts(params, config, tokens, constrain),
                                              (params["layers"], layer_constants(config)))
    out = (_prompt_logits(params, config, x, lengths, constrain), keys, values)
    return (*out, sparse_layer_routes(config, routes[0]).chosen) if with_routes else out


def prefill_layers(params, layers: list, config: ModelConfig, tokens: jax.Array, lengths: jax.Array,
                   cache_dtype=None, constrain=None, with_routes: bool = False) -> tuple:
    """`prefill_cache` over per-layer parameters (`unstack_layers`), one layer after another in Python:
    (logits [C, V], keys: one [C, KV, d, P] per layer, values: one [C, KV, P, d] per layer). For a prefill
    inside a decode loop that already holds the per-layer weights: each layer's keys and values can go to
    a per-layer cache as soon as they exist, instead of through one stacked [layers, ...] buffer beside
    the decode's own temporaries (0.38 GB for 16 prompts of 256 tokens on SmolLM2-135M), and no layer's
    weights are sliced out of the stacked arrays again. With `with_routes` (a mixture of experts) also the experts
    each prompt token chose in each sparse layer, [C, P, L_sparse, k], last (as `prefill_cache`)."""
    layer = _prefill_layer(config, tokens, cache_dtype, constrain)
    routed_layer = _prefill_layer(config, tokens, cache_dtype, constrain, with_routes=True)
    x, keys, values, chosen = _embed_prompts(params, config, tokens, constrain), [], [], []
    for i, lp in enumerate(layers):
        const = layer_constants(config, i)
        if with_routes and const["sparse"]:
            x, (k, v, routes) = routed_layer(x, (lp, const))
            chosen.append(routes.chosen)
        else:
            x, (k, v) = layer(x, (lp, const))
        keys.append(k)
        values.append(v)
    out = (_prompt_logits(params, config, x, lengths, constrain), tuple(keys), tuple(values))
    return (*out, jnp.stack(chosen, axis=2)) if with_routes else out


def _to_groups(x: jax.Array, entries: int) -> jax.Array:
    """[B, KV, H', ...] per row -> [C, KV, g H', ...] per prompt entry (B = C g, rows of an entry consecutive)."""
    batch, num_kv, heads = x.shape[:3]
    group = batch // entries
    x = x.reshape(entries, group, num_kv, heads, *x.shape[3:])
    return jnp.swapaxes(x, 1, 2).reshape(entries, num_kv, group * heads, *x.shape[4:])


def _to_rows(x: jax.Array, batch: int) -> jax.Array:
    """`_to_groups`' inverse: [C, KV, g H', ...] -> [B, KV, H', ...]."""
    entries, num_kv, heads = x.shape[:3]
    group = batch // entries
    x = x.reshape(entries, num_kv, group, heads // group, *x.shape[3:])
    return jnp.swapaxes(x, 1, 2).reshape(batch, num_kv, heads // group, *x.shape[4:])


def _attend(q, prompt_k, prompt_v, response_k, response_v, prompt_lengths, step, config: ModelConfig,
            window: int | None = None, sinks=None):
    """softmax(cap(scale q k^T)) v (scale and cap as `models.attend`) of one query per row over prompt
    slots s < prompt_length and response slots j <= step; with a sliding `window` w, only keys fewer than
    w positions back (prompt slot s: prompt_length + step - s < w; response slot j, holding generated token
    step - ((step - j) mod n) of a ring of n slots: (step - j) mod n < w). step is [] or one per row [B].
    response_k / response_v are one buffer each or a list of consecutive tiles (slots 0..T-1, T..2T-1, ...),
    read one dot per tile. q [B, H, d] (head h reads KV head h // (H / KV)); returns [B, H*d]. `sinks` [H] (gpt-oss):
    head h's softmax gains sinks[h] in its denominator (`layers.attention`).

    The prompt part may hold one entry per group of g consecutive rows (prompt_k [B / g, KV, d, P]: the g samples
    of one prompt, `empty_row_cache`'s `prompt_group`): the group's queries then meet their prompt's keys in one
    matrix product of g x H / KV rows per KV head, which reads the prompt's keys and values once instead of g
    times. prompt_lengths stay one per row (equal within a group); a grouped prompt needs one step for all rows."""
    batch, num_heads, head_dim = q.shape
    num_kv, entries = prompt_k.shape[1], prompt_k.shape[0]
    if batch % entries:
        raise ValueError(f"{batch} rows cannot share {entries} prompt entries in equal consecutive groups")
    if entries != batch and step.ndim:
        raise ValueError("a prompt cache shared by groups of rows needs one step for all rows")
    response_k = list(response_k) if isinstance(response_k, (list, tuple)) else [response_k]
    response_v = list(response_v) if isinstance(response_v, (list, tuple)) else [response_v]
    q = q.reshape(batch, num_kv, num_heads // num_kv, head_dim) * jnp.asarray(config.attention_scale, q.dtype)
    f32 = jnp.float32
    cap = config.attn_logit_softcapping
    # prompt part per entry [C, KV, g H / KV, P] (C = B and g = 1 without groups: the reshapes are then no-ops)
    prompt_scores = soft_cap(jnp.einsum("ckmd,ckds->ckms", _to_groups(q, entries), prompt_k.astype(q.dtype),
                                        preferred_element_type=f32), cap)
    response_scores = soft_cap(jnp.concatenate(
        [jnp.einsum("bkgd,bkdn->bkgn", q, k.astype(q.dtype), preferred_element_type=f32) for k in response_k], -1),
        cap)
    slots = response_scores.shape[-1]
    prompt_index, response_index = jnp.arange(prompt_k.shape[-1]), jnp.arange(slots)
    entry_lengths = prompt_lengths.reshape(entries, -1)[:, 0]
    prompt_ok = prompt_index[None, :] < entry_lengths[:, None]
    row_step = step[:, None] if step.ndim else step  # one step per row, or one for all rows
    response_ok = response_index <= row_step
    if window is not None:
        prompt_ok = prompt_ok & ((entry_lengths + step)[:, None] - prompt_index[None, :] < window)
        response_ok = response_ok & ((row_step - response_index) % slots < window)
    prompt_scores = jnp.where(prompt_ok[:, None, None, :], prompt_scores, -jnp.inf)
    response_ok = response_ok[:, None, None, :] if step.ndim else response_ok
    response_scores = jnp.where(response_ok, response_scores, -jnp.inf)
    top = jnp.maximum(_to_rows(prompt_scores.max(-1, keepdims=True), batch), response_scores.max(-1, keepdims=True))
    if sinks is not None:
        sink = sinks.astype(f32).reshape(1, num_kv, num_heads // num_kv, 1)
        top = jnp.maximum(top, sink)
    prompt_w, response_w = jnp.exp(prompt_scores - _to_groups(top, entries)), jnp.exp(response_scores - top)
    dtype = prompt_v.dtype
    total = _to_rows(prompt_w.sum(-1, keepdims=True), batch)
    if sinks is not None:
        total = total + jnp.exp(sink - top)
    out = _to_rows(jnp.einsum("ckms,cksd->ckmd", prompt_w.astype(dtype), prompt_v, preferred_element_type=f32), batch)
    # Tile by tile, in order: a tile past a row's step adds exact zeros, so reading more tiles than a row needs
    # (the continuous engine reads up to its deepest slot's) changes no bit of that row's result.
    start = 0
    for v in response_v:
        tile = v.shape[2]
        weights = response_w[..., start: start + tile]
        total = total + weights.sum(-1, keepdims=True)
        out = out + jnp.einsum("bkgn,bknd->bkgd", weights.astype(dtype), v, preferred_element_type=f32)
        start += tile
    return (out / total).reshape(batch, num_heads * head_dim)


# How a decode step lowered for a GPU reads a full-attention layer's response tiles: "reached" (the `lax.switch`
# over the tiles written so far, as on a CPU) or "every" (as on a TPU). Both compiled for one H200 (the 1.5B paper
# preset's sampler decode, `jaxrl-llm compile --topology h200-1`, 2026-11-29): "reached" 2,105 kernels and 28
# conditionals per generated token (one switch a layer), "every" 2,022 kernels and none, the same matmul FLOPs.
# Fewer kernels and no conditional per layer, at the price of reading the unwritten tiles (up to twice the
# response cache's bytes early in a call): a prediction until the sampler is timed both ways on the device.
GPU_DECODE_READS = "every"


def _attend_reached(q, prompt_k, prompt_v, tiles_k: tuple, tiles_v: tuple, prompt_lengths, step, config: ModelConfig,
                    sinks=None):
    """`_attend` over the response tiles that hold a token so far (tiles 0..step // T; with one step per row,
    up to the deepest row's tile, the other rows masked as in `_attend`): a `lax.switch` with one branch per
    count of tiles, each reading only its tiles.

    Lowered for a TPU (and, by `GPU_DECODE_READS`, a GPU) it reads every tile instead (the unreached ones add exact
    zeros): XLA's TPU compiler copies
    the loop-carried caches a conditional takes as operands, which held 2.8x the KV cache in temporaries
    (`jaxrl-llm compile`, tiny model on v5e 2x2 at 512 new tokens: 194.6 MB against 33.2 MB without the switch;
    a conditional per tile still 150.2 MB), where reading the unreached tiles costs bandwidth instead."""
    tile = tiles_k[0].shape[-1]

    def over(count):
        return lambda q, prompt_k, prompt_v, tiles_k, tiles_v: _attend(
            q, prompt_k, prompt_v, tiles_k[:count], tiles_v[:count], prompt_lengths, step, config, sinks=sinks)

    branches = [over(count) for count in range(1, len(tiles_k) + 1)]

    def reached(*operands):
        return jax.lax.switch(jnp.max(step) // tile, branches, *operands)

    every = branches[-1]
    return jax.lax.platform_dependent(q, prompt_k, prompt_v, tiles_k, tiles_v, tpu=every,
                                      cuda=every if GPU_DECODE_READS == "every" else reached, default=reached)


def _write_tiles(tiles: tuple, new: jax.Array, step: jax.Array, axis: int) -> tuple:
    """tiles (consecutive slot ranges of T) with new (size 1 on `axis`) written at slot `step` (one for all
    rows, or one per row [B]): every tile gets an in-place write at step mod T, of `new` in tile step // T and
    of its own old value elsewhere (a conditional write copied every tile buffer; measured 1,440 copies per
    step). With per-row steps each write is a scatter, as `_write_slot`'s."""
    tile = tiles[0].shape[axis]
    slot = step % tile
    in_tile = (step // tile).reshape(step.shape + (1,) * (new.ndim - step.ndim))  # [] or [B, 1, ...]
    written = []
    for index, buffer in enumerate(tiles):
        if step.ndim == 0:
            old = jax.lax.dynamic_slice_in_dim(buffer, slot, 1, axis=axis)
        else:
            old = jnp.take_along_axis(buffer, slot.reshape((-1,) + (1,) * (buffer.ndim - 1)), axis=axis)
        value = jnp.where(in_tile == index, new.astype(buffer.dtype), old)
        written.append(_write_slot(buffer, value, slot, axis))
    return tuple(written)


def _write_slot(buffer: jax.Array, new: jax.Array, slot: jax.Array, axis: int) -> jax.Array:
    """buffer with new (size 1 on `axis`) written at index `slot` of `axis`: one index for every row
    (an in-place dynamic_update_slice) or one per row [B] (a scatter)."""
    if slot.ndim == 0:
        return jax.lax.dynamic_update_slice_in_dim(buffer, new, slot, axis=axis)
    index = (jnp.arange(buffer.shape[0]),) + (slice(None),) * (axis - 1) + (slot,)
    return buffer.at[index].set(jnp.squeeze(new, axis))


def decode_step(params, layers: list, config: ModelConfig, tokens: jax.Array, prompt_lengths: jax.Array,
                step: jax.Array, cache: RowCache, prompt_rows: jax.Array | None = None, with_routes: bool = False
                ) -> tuple:
    """Feed generated token `step` of every row (tokens [B], at position prompt_length + step):
    write its keys/values to response slot `step` and return (logits [B, V] f32 for the next
    token, cache). Matches `models.forward` over the full sequence (tested to 1e-5 in f32).

    `step` is one int for all rows or one per row [B]. With `prompt_rows` [B], the cache's prompt part
    holds one entry per prompt [C, ...] and row b attends to entry prompt_rows[b] (gathered layer by
    layer); prompt_lengths are then the rows' own [B].
    With `with_routes` (a mixture of experts) it also returns the experts each row's token chose in each sparse
    layer, [B, L_sparse, k] (routing replay's record)."""
    step = jnp.asarray(step)
    chosen = []
    positions = (prompt_lengths + step)[:, None]
    x = embed_tokens(params, config, tokens[:, None])
    new = {name: [] for name in RowCache._fields}
    for i, lp in enumerate(layers):
        const = layer_constants(config, i)

        def attend_fn(q, k, v, i=i, window=const["window"]):  # q [B,1,H,d], k, v [B,1,KV,d]
            prompt_k, prompt_v = cache.prompt_k[i], cache.prompt_v[i]
            if prompt_rows is not None:
                # The gather's indices depend on this layer's query (a NaN query gives NaN either way), so XLA
                # cannot schedule every layer's gathered copy at the start of the step, all live at once
                # (0.72 GB at 64 slots of 256-token prompts on SmolLM2-135M; an optimization barrier did not hold).
                rows = jnp.where(jnp.isnan(q[0, 0, 0, 0]), 0, prompt_rows)
                prompt_k, prompt_v = jnp.take(prompt_k, rows, axis=0), jnp.take(prompt_v, rows, axis=0)
            if isinstance(cache.response_k[i], tuple):  # tiles (`buckets.response_tile_size`)
                response_k = _write_tiles(cache.response_k[i], jnp.transpose(k, (0, 2, 3, 1)), step, axis=3)
                response_v = _write_tiles(cache.response_v[i], jnp.transpose(v, (0, 2, 1, 3)), step, axis=2)
                attn = _attend_reached(q[:, 0], prompt_k, prompt_v, response_k, response_v, prompt_lengths, step,
                                       config, lp.get("attn_sinks"))
                return attn[:, None], (response_k, response_v)
            slot = step % cache.response_k[i].shape[-1]  # = step, except on a sliding layer's ring
            response_k = _write_slot(cache.response_k[i],
                                     jnp.transpose(k, (0, 2, 3, 1)).astype(cache.response_k[i].dtype), slot, axis=3)
            response_v = _write_slot(cache.response_v[i],
                                     jnp.transpose(v, (0, 2, 1, 3)).astype(cache.response_v[i].dtype), slot, axis=2)
            attn = _attend(q[:, 0], prompt_k, prompt_v, response_k, response_v, prompt_lengths, step, config, window,
                           lp.get("attn_sinks"))
            return attn[:, None], (response_k, response_v)

        routed = with_routes and const["sparse"]
        x, (response_k, response_v), *routes = decoder_layer(lp, config, x, positions, attend_fn, const["inv_freq"],
                                                              const["sparse"], {} if routed else None)
        if routed:
            chosen.append(routes[0].chosen[:, 0])
        new["response_k"].append(response_k)
        new["response_v"].append(response_v)
    hidden = norm(x[:, 0], params["final_norm"], config)
    cache = cache._replace(response_k=tuple(new["response_k"]), response_v=tuple(new["response_v"]))
    if with_routes:
        return output_logits(params, config, hidden), cache, jnp.stack(chosen, axis=1)
    return output_logits(params, config, hidden), cache
