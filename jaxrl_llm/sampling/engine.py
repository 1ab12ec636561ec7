"""The compiled stages of sampling: allocate the row state, prefill prompts into it, decode.

State is static (STYLE item 4): every array in `SamplingState` has a bucketed shape fixed before
decoding starts; the decode loop only overwrites it (the cache in place, as the buffer is donated).
Each prompt is prefilled once, and its cache is copied to the prompt entries of the rows that sample it (one
entry per row, or per group of consecutive rows of the same prompt: `decoder.empty_row_cache`'s `prompt_group`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.models.sharding import BATCH_AXES
from jaxrl_llm.models.moe import route_dtype, route_shape
from jaxrl_llm.sampling.decoder import RowCache, decode_step, empty_row_cache, prefill_cache, unstack_layers
from jaxrl_llm.sampling.token_selection import select_tokens

ROW_AXES = BATCH_AXES  # mesh axes the sample rows are split over: data, fsdp, expert


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "logprobs", "prompt_lengths", "done", "stopped", "lengths",
                                "step", "cache", "routes", "prompt_routes"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SamplingState:
    """Everything the decode loop carries, one row per sample (R = row bucket, N = token bucket).

    tokens [R, N] int32 generated tokens (pad_id after a row is done); logprobs [R, N] f32;
    prompt_lengths [R] int32 (token t of a row sits at position prompt_length + t);
    done [R] bool; stopped [R] bool (ended by a stop id); lengths [R] int32 tokens generated;
    step [] int32 tokens generated so far by the longest row; cache: the rows' RowCache.
    A mixture of experts records its routes (routing replay; None for a dense model): routes [R, N, L_sparse, k]
    the experts generated token t chose in each sparse layer when it was fed back (column t; -1 where not fed),
    prompt_routes [R, P, L_sparse, k] those of each row's prompt tokens in its prefill (`moe.route_dtype`).
    """

    tokens: jax.Array
    logprobs: jax.Array
    prompt_lengths: jax.Array
    done: jax.Array
    stopped: jax.Array
    lengths: jax.Array
    step: jax.Array
    cache: RowCache
    routes: jax.Array | None = None
    prompt_routes: jax.Array | None = None


def row_axes(mesh: Mesh | None) -> tuple[str, ...]:
    """The mesh axes present among ('data', 'fsdp', 'expert'): rows are sharded over their product."""
    if mesh is None:
        return ()
    return tuple(a for a in ROW_AXES if a in mesh.axis_names)


def row_sharding(mesh: Mesh | None, ndim: int, axis: int = 0) -> NamedSharding | None:
    """NamedSharding splitting dimension `axis` of an ndim array over the row axes of `mesh`."""
    if mesh is None:
        return None
    spec = [None] * ndim
    spec[axis] = row_axes(mesh) or None
    return NamedSharding(mesh, PartitionSpec(*spec))


def to_host(x: jax.Array) -> np.ndarray:
    """x as a numpy array, gathered from every process when it spans hosts."""
    if jax.process_count() > 1 and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _constrain(x: jax.Array, mesh: Mesh | None, axis: int = 0) -> jax.Array:
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, row_sharding(mesh, x.ndim, axis))


def prefill_constraint(mesh: Mesh | None):
    """The prefill's `constrain(x, features=False)` (`decoder.prefill_cache`): hidden states, keys and values split
    over the row axes on their first axis; with `features`, split over fsdp on their last (hidden) axis, as the
    embedding and output matrix hold it (`models.sharding.partition_rules`). None without a mesh."""
    if mesh is None:
        return None

    def constrain(x: jax.Array, features: bool = False) -> jax.Array:
        if not features:
            return _constrain(x, mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*([None] * (x.ndim - 1)), "fsdp")))

    return constrain


def cache_sharding(shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    """Where a sampler cache buffer [rows or entries, KV, ...] lives: rows over the row axes, KV heads over `tensor`
    when it divides them (as the attention's heads are), else every device holds all KV heads of its rows.
    Pinning the heads keeps the decode loop's carried cache in one sharding: left to the compiler, a tensor-split
    mesh got a cache output laid out unlike its input (no donation: two caches; `jaxrl-llm compile`)."""
    tensor = mesh.shape["tensor"] if "tensor" in mesh.axis_names else 1
    spec = [None] * len(shape)
    spec[0] = row_axes(mesh) or None
    if tensor > 1 and shape[1] % tensor == 0:
        spec[1] = "tensor"
    return NamedSharding(mesh, PartitionSpec(*spec))


def _constrain_state(state: SamplingState, mesh: Mesh | None) -> SamplingState:
    if mesh is None:
        return state
    cache = jax.tree_util.tree_map(lambda x: jax.lax.with_sharding_constraint(x, cache_sharding(x.shape, mesh)),
                                   state.cache)
    rows = {f.name: None if getattr(state, f.name) is None else _constrain(getattr(state, f.name), mesh)
            for f in dataclasses.fields(state) if f.name not in ("step", "cache")}
    return SamplingState(**rows, step=state.step, cache=cache)


@functools.partial(jax.jit, static_argnames=("config", "mesh", "prompt_bucket", "new_token_bucket", "response_tile",
                                             "prompt_group"))
def init_state(config: ModelConfig, mesh: Mesh | None, prompt_lengths: jax.Array, valid: jax.Array, *,
               prompt_bucket: int, new_token_bucket: int, response_tile: int = 0,
               prompt_group: int = 1) -> tuple[SamplingState, jax.Array]:
    """A fresh state for R = len(valid) rows (invalid rows are bucket padding: done from the start)
    and a zero [R, V] buffer for the logits of each row's first token; `response_tile` > 0 splits the
    response cache in tiles the decode step reads only as far as generated, `prompt_group` g > 1 keeps one
    prompt entry per g consecutive rows (`decoder.empty_row_cache`)."""
    rows = valid.shape[0]
    state = SamplingState(
        tokens=jnp.zeros((rows, new_token_bucket), jnp.int32),
        logprobs=jnp.zeros((rows, new_token_bucket), jnp.float32),
        prompt_lengths=prompt_lengths.astype(jnp.int32),
        done=~valid,
        stopped=jnp.zeros((rows,), bool),
        lengths=jnp.zeros((rows,), jnp.int32),
        step=jnp.zeros((), jnp.int32),
        cache=empty_row_cache(config, rows, prompt_bucket, new_token_bucket, response_tile=response_tile,
                              prompt_group=prompt_group),
        **_empty_routes(config, rows, prompt_bucket, new_token_bucket),
    )
    first_logits = _constrain(jnp.zeros((rows, config.vocab_size), jnp.float32), mesh)
    return _constrain_state(state, mesh), first_logits


def records_routes(config: ModelConfig) -> bool:
    """Whether the sampler records routes (routing replay): for a model with a sparse (mixture-of-experts) layer."""
    return any(config.sparse_layers())


def _empty_routes(config: ModelConfig, rows: int, prompt_bucket: int, new_token_bucket: int) -> dict:
    """`SamplingState`'s routes and prompt_routes, all -1 (nothing recorded yet); {} for a dense model."""
    if not records_routes(config):
        return {}
    per_token = route_shape(config)
    dtype = route_dtype(config.num_experts)
    return {"routes": jnp.full((rows, new_token_bucket, *per_token), -1, dtype),
            "prompt_routes": jnp.full((rows, prompt_bucket, *per_token), -1, dtype)}


@functools.partial(jax.jit, static_argnames=("config", "mesh"), donate_argnames=("state", "first_logits"))
def prefill_rows(params, config: ModelConfig, mesh: Mesh | None, prompt_tokens: jax.Array,
                 prompt_lengths: jax.Array, row_source: jax.Array, state: SamplingState,
                 first_logits: jax.Array) -> tuple[SamplingState, jax.Array]:
    """Run C prompts (prompt_tokens [C, L], right-padded, positions 0..L-1) through the model once
    and copy each prompt's cache slots [0, L) and its last-position logits to the rows with
    row_source[r] = its index in this call (rows with -1 belong to another call and are kept). With one prompt
    entry per group of g rows (the cache's prompt part has R / g entries) an entry takes its first row's source:
    a group's rows continue one prompt."""
    prompt_tokens = _constrain(prompt_tokens, mesh)
    # every layer's hidden states, keys and values split over the row axes as the prompts are, so each device runs
    # its own prompts (the merge below gathers the results to their rows); unconstrained, XLA ran the whole prefill
    # on every device of the mesh, or, constrained only at the end, every layer's MLP on every prompt of the chunk
    # with its contraction split (XLA's temporaries: [chunk, P, F / tensor] gate and up outputs per device)
    last_logits, keys, values, *routes = prefill_cache(params, config, prompt_tokens, prompt_lengths,
                                                       state.cache.prompt_k[0].dtype, prefill_constraint(mesh),
                                                       with_routes=state.routes is not None)
    keys, values = (tuple(_constrain(x, mesh) for x in part) for part in (keys, values))
    entries = state.cache.prompt_k[0].shape[0]
    entry_source = row_source.reshape(entries, -1)[:, 0]

    def merge(old, new, source):
        copied = jnp.take(new, jnp.maximum(source, 0), axis=0)
        return jnp.where((source >= 0).reshape((-1,) + (1,) * (copied.ndim - 1)), copied, old)

    cache = state.cache._replace(
        prompt_k=tuple(merge(old, keys[i], entry_source) for i, old in enumerate(state.cache.prompt_k)),
        prompt_v=tuple(merge(old, values[i], entry_source) for i, old in enumerate(state.cache.prompt_v)))
    first_logits = merge(first_logits, last_logits, row_source)
    state = dataclasses.replace(state, cache=cache)
    if routes:  # each row's prompt routes, as its first logits
        state = dataclasses.replace(state, prompt_routes=merge(state.prompt_routes, routes[0], row_source))
    return _constrain_state(state, mesh), _constrain(first_logits, mesh)


def _row_uniforms(rng: jax.Array, rows: int, step: jax.Array, row_offset: jax.Array) -> jax.Array:
    """One U[0, 1) number per row: key = fold_in(fold_in(rng, row_offset + row), step), so a row's draws
    depend only on the seed, its output row index and the step (not on bucket padding, batch mix, or
    which sampler call of a chunked step decodes it)."""
    keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(rng, r), step))(row_offset + jnp.arange(rows))
    return jax.vmap(jax.random.uniform)(keys)


def paired_stop_hits(tokens: jax.Array, stop_ids: jax.Array, written: jax.Array, vocab_size: int) -> jax.Array:
    """[rows] bool: token t of each row is a pair-stop id (stored in `stop_ids` as id + vocab_size,
    `plan.stop_array`) that closes a pair, i.e. an odd number of them came before it among the row's
    `written` [rows, N] tokens (negative: not written): a row stops at the second, fourth, ... (a code fence that
    closes a block)."""
    pair = stop_ids - vocab_size
    valid = pair >= 0  # the plain stop ids and the -1 padding are no pair ids
    is_pair = jnp.any((tokens[:, None] == pair[None, :]) & valid, axis=-1)
    seen = jnp.sum(jnp.any((written[:, :, None] == pair[None, None, :]) & valid, axis=-1), axis=1)
    return is_pair & (seen % 2 == 1)


@functools.partial(jax.jit, static_argnames=("config", "mesh", "greedy", "top_k", "use_top_p", "paired_stops"),
                   donate_argnames=("state",))
def decode_rows(params, config: ModelConfig, mesh: Mesh | None, state: SamplingState,
                first_logits: jax.Array, rng: jax.Array, temperature: jax.Array, top_p: jax.Array,
                max_new_tokens: jax.Array, stop_ids: jax.Array, pad_id: jax.Array, row_offset: jax.Array = 0,
                forced: tuple[jax.Array, jax.Array] | None = None, *,
                greedy: bool, top_k: int, use_top_p: bool, paired_stops: bool = False) -> SamplingState:
    """Generate until every row is done: token 0 from `first_logits`, then a `lax.while_loop` that
    feeds each row's token t - 1 (position prompt_length + t - 1) and picks token t.

    A row is done after a token in `stop_ids` (-1 entries are padding) or after `max_new_tokens`
    tokens; with `paired_stops`, also after a pair-stop id that closes a pair (`paired_stop_hits`). The loop
    exits when all rows are done. `forced` = (tokens [R, F], lengths [R]): row r's first lengths[r] tokens are
    forced[r, :lengths[r]] instead of sampled (their log-probs the model's, at temperature 1; no stop among
    them), then it samples on: a conversation continued from its prompt's shared prefill (`sampling.multiturn`). Done rows keep flowing through the batch (static
    shapes) but write pad_id, log-prob 0 and do not grow. Row r draws its numbers as output row
    row_offset + r (`_row_uniforms`): a step split into several calls samples what one call would.
    """
    rows = state.done.shape[0]
    layers = unstack_layers(params)  # sliced once, outside the loop

    def pick(logits, step):
        uniform = jnp.zeros((rows,), jnp.float32) if greedy else _row_uniforms(rng, rows, step, row_offset)
        tokens, logprobs = select_tokens(logits, uniform, temperature, top_p, greedy=greedy, top_k=top_k,
                                         use_top_p=use_top_p)
        if forced is None:
            return tokens, logprobs
        given = forced[0][:, jnp.minimum(step, forced[0].shape[1] - 1)]
        taken = step < forced[1]
        given_logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1),
                                             given[:, None], axis=-1)[:, 0]
        return jnp.where(taken, given, tokens), jnp.where(taken, given_logprobs, logprobs)

    def record(state, tokens, logprobs):
        active = ~state.done
        t = state.step
        column = jnp.where(active, tokens, pad_id)[:, None]
        hit_stop = active & jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1)
        if paired_stops:  # columns before t hold each row's tokens (pad_id once done)
            before = jnp.where(jnp.arange(state.tokens.shape[1])[None, :] < t, state.tokens, -1)
            hit_stop = hit_stop | (active & paired_stop_hits(tokens, stop_ids, before, config.vocab_size))
        if forced is not None:  # a forced token never stops its row
            hit_stop = hit_stop & (t >= forced[1])
        return dataclasses.replace(
            state,
            tokens=jax.lax.dynamic_update_slice(state.tokens, column, (0, t)),
            logprobs=jax.lax.dynamic_update_slice(state.logprobs, jnp.where(active, logprobs, 0.0)[:, None],
                                                  (0, t)),
            done=state.done | hit_stop | (t + 1 >= max_new_tokens),
            stopped=state.stopped | hit_stop,
            lengths=state.lengths + active.astype(jnp.int32),
            step=t + 1,
        )

    def keep_going(state):
        return (state.step < max_new_tokens) & ~jnp.all(state.done)

    def step(state):
        last = jax.lax.dynamic_slice_in_dim(state.tokens, state.step - 1, 1, axis=1)[:, 0]
        logits, cache, *routes = decode_step(params, layers, config, last, state.prompt_lengths, state.step - 1,
                                             state.cache, with_routes=state.routes is not None)
        state = dataclasses.replace(state, cache=cache)
        if routes:  # the experts token step - 1 chose as it was fed (collect keeps a row's own tokens')
            state = dataclasses.replace(state, routes=jax.lax.dynamic_update_slice(
                state.routes, routes[0][:, None], (0, state.step - 1, 0, 0)))
        return _constrain_state(record(state, *pick(logits, state.step)), mesh)

    state = record(state, *pick(first_logits, state.step))
    return jax.lax.while_loop(keep_going, step, _constrain_state(state, mesh))
