"""Continuous batching: a fixed set of decode slots that take the next pending sample as soon as theirs ends.

All samples of a call form a queue known up front (sample k continues prompt `sample_prompt[k]` and is
output row k). Every prompt is prefilled once into a prompt cache [C, prompt_bucket] kept beside its
last-position logits; each of the S slots holds one sample and its own response cache [S, new-token
bucket], and reads its prompt's keys/values from the prompt cache (`decoder.decode_step`'s `prompt_rows`).
Memory per prompt with n samples: P + n N cache slots for the static engine's n (P + N), and only S
response caches are live whatever the number of samples.

One `lax.while_loop` iteration picks one token in every busy slot, records it in the sample's output
row, feeds it through the decoder at the slot's own position, and hands every slot whose sample ended
(stop id or max_new_tokens) the next pending sample, all inside the jitted loop: slots turn over
without a host round trip or a recompile. A sample's token t uses the uniform number
fold_in(fold_in(rng, k), t) of the static engine's row k (`engine._row_uniforms`), so both engines draw
the same rollouts. On a mesh the slots are split over its ('data', 'fsdp') axes and every device holds the
whole prompt cache, so a slot's gather by prompt id stays on its device.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.sampling.buckets import bucket_size, make_plan, round_up
from jaxrl_llm.sampling.decoder import RowCache, decode_step, empty_row_cache, prefill_cache, unstack_layers
from jaxrl_llm.sampling.engine import _constrain, row_axes, row_sharding, to_host
from jaxrl_llm.sampling.token_selection import select_tokens

logger = logging.getLogger(__name__)


class PromptCache(NamedTuple):
    """One entry per prompt (C = prompt bucket count, P = prompt length bucket), per-layer tuples.

    keys [C, KV, d, P], values [C, KV, P, d] (layout of `decoder.RowCache`'s prompt part);
    lengths [C] int32; last_logits [C, V] f32: the logits of each prompt's first generated token.
    """

    keys: tuple
    values: tuple
    lengths: jax.Array
    last_logits: jax.Array


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "logprobs", "lengths", "stopped", "slot_sample", "slot_step", "logits",
                                "next_sample", "iterations", "response_k", "response_v"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SlotState:
    """What the slot loop carries (K = queue bucket, N = new-token bucket, S = slots).

    Per sample: tokens [K, N] int32 (pad_id after the end), logprobs [K, N] f32, lengths [K] int32,
    stopped [K] bool. Per slot: slot_sample [S] int32 (the sample it decodes, -1 when idle),
    slot_step [S] int32 (the token it picks next), logits [S, V] f32 (to pick that token from),
    response_k / response_v: per-layer response caches [S, ...] (`decoder.RowCache` layout).
    next_sample [] int32: first sample not yet given a slot; iterations [] int32: loop iterations run.
    """

    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    stopped: jax.Array
    slot_sample: jax.Array
    slot_step: jax.Array
    logits: jax.Array
    next_sample: jax.Array
    iterations: jax.Array
    response_k: tuple
    response_v: tuple


class SlotStats(NamedTuple):
    """How busy the slots were: occupancy = useful slot-steps / (iterations x slots), where a useful
    slot-step is one generated token (the sum of the rollout's lengths)."""

    slots: int
    iterations: int
    useful_slot_steps: int

    @property
    def slot_steps(self) -> int:
        """Slot-steps decoded: iterations x slots."""
        return self.iterations * self.slots

    @property
    def occupancy(self) -> float:
        return self.useful_slot_steps / self.slot_steps if self.slot_steps else 0.0


def empty_prompt_cache(config: ModelConfig, prompts: int, prompt_bucket: int) -> PromptCache:
    dtype = jnp.dtype(config.compute_dtype)
    kv, d, layers = config.num_kv_heads, config.head_dim, config.num_layers
    return PromptCache(tuple(jnp.zeros((prompts, kv, d, prompt_bucket), dtype) for _ in range(layers)),
                       tuple(jnp.zeros((prompts, kv, prompt_bucket, d), dtype) for _ in range(layers)),
                       jnp.ones((prompts,), jnp.int32), jnp.zeros((prompts, config.vocab_size), jnp.float32))


@functools.partial(jax.jit, static_argnames=("config", "mesh"), donate_argnames=("cache",))
def prefill_prompts(params, config: ModelConfig, mesh: Mesh | None, tokens: jax.Array, lengths: jax.Array,
                    offset: jax.Array, cache: PromptCache) -> PromptCache:
    """Run prompts tokens [c, P] (right-padded) through the model and write their keys, values, lengths
    and last-position logits to entries offset .. offset + c - 1 of the prompt cache. With `mesh` the c
    prompts are split over its row axes and every device receives the whole cache."""
    last_logits, keys, values = prefill_cache(params, config, _constrain(tokens, mesh), lengths, cache.keys[0].dtype)

    def put(old, new):
        return jax.lax.dynamic_update_slice_in_dim(old, new.astype(old.dtype), offset, axis=0)

    return PromptCache(tuple(put(old, keys[i]) for i, old in enumerate(cache.keys)),
                       tuple(put(old, values[i]) for i, old in enumerate(cache.values)),
                       put(cache.lengths, lengths), put(cache.last_logits, last_logits))


def _uniforms(rng: jax.Array, rows: jax.Array, steps: jax.Array) -> jax.Array:
    """U[0, 1) for output row rows[s] at token steps[s]: `engine._row_uniforms`' keys, one row per slot."""
    keys = jax.vmap(lambda r, t: jax.random.fold_in(jax.random.fold_in(rng, r), t))(rows, steps)
    return jax.vmap(jax.random.uniform)(keys)


@functools.partial(jax.jit, static_argnames=("config", "mesh", "slots", "new_token_bucket", "greedy", "top_k",
                                             "use_top_p"))
def decode_slots(params, config: ModelConfig, mesh: Mesh | None, prompts: PromptCache, sample_prompt: jax.Array,
                 num_samples: jax.Array, rng: jax.Array, temperature: jax.Array, top_p: jax.Array,
                 max_new_tokens: jax.Array, stop_ids: jax.Array, pad_id: jax.Array, *, slots: int,
                 new_token_bucket: int, greedy: bool, top_k: int, use_top_p: bool) -> SlotState:
    """Decode samples 0 .. num_samples - 1 (sample k continues prompt-cache entry sample_prompt[k] [K])
    on `slots` slots until every sample ended; returns the final `SlotState`.

    A sample ends after a token in `stop_ids` (-1 entries are padding) or after `max_new_tokens` tokens;
    its slot then takes the lowest pending sample (slots in index order), which picks its token 0 from
    its prompt's last logits at the next iteration. Idle slots (no sample left) flow through the step
    and write nothing. With `mesh`, the slots are split over its row axes.
    """
    queue = sample_prompt.shape[0]
    layers = unstack_layers(params)  # sliced once, outside the loop
    empty = empty_row_cache(config, slots, 1, new_token_bucket)

    def constrain(state: SlotState) -> SlotState:
        per_slot = ("slot_sample", "slot_step", "logits")
        return dataclasses.replace(
            state, **{name: _constrain(getattr(state, name), mesh) for name in per_slot},
            response_k=tuple(_constrain(x, mesh) for x in state.response_k),
            response_v=tuple(_constrain(x, mesh) for x in state.response_v))

    def refill(state: SlotState, free: jax.Array) -> SlotState:
        candidate = state.next_sample + jnp.cumsum(free) - 1
        take = free & (candidate < num_samples)
        sample = jnp.where(take, candidate, jnp.where(free, -1, state.slot_sample))
        prompt = sample_prompt[jnp.clip(candidate, 0, queue - 1)]
        return dataclasses.replace(
            state, slot_sample=sample, slot_step=jnp.where(free, 0, state.slot_step),
            logits=jnp.where(take[:, None], prompts.last_logits[prompt], state.logits),
            next_sample=jnp.minimum(state.next_sample + free.sum(), num_samples))

    def busy(state: SlotState) -> jax.Array:
        return jnp.any(state.slot_sample >= 0)

    def step(state: SlotState) -> SlotState:
        active = state.slot_sample >= 0
        sample = jnp.maximum(state.slot_sample, 0)
        t = state.slot_step
        uniform = jnp.zeros((slots,), jnp.float32) if greedy else _uniforms(rng, sample, t)
        tokens, logprobs = select_tokens(state.logits, uniform, temperature, top_p, greedy=greedy, top_k=top_k,
                                         use_top_p=use_top_p)
        hit_stop = active & jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1)
        ended = active & (hit_stop | (t + 1 >= max_new_tokens))
        row = jnp.where(active, sample, queue)  # out of range: dropped
        prompt = sample_prompt[sample]
        logits, cache = decode_step(params, layers, config, tokens, prompts.lengths[prompt], t,
                                    RowCache(prompts.keys, prompts.values, state.response_k, state.response_v),
                                    prompt_rows=prompt)
        state = dataclasses.replace(
            state,
            tokens=state.tokens.at[row, t].set(tokens, mode="drop"),
            logprobs=state.logprobs.at[row, t].set(logprobs, mode="drop"),
            lengths=state.lengths.at[row].set(t + 1, mode="drop"),
            stopped=state.stopped.at[row].set(hit_stop, mode="drop"),
            slot_step=jnp.where(active, t + 1, t), logits=logits, iterations=state.iterations + 1,
            response_k=cache.response_k, response_v=cache.response_v)
        return constrain(refill(state, ended))

    state = SlotState(
        tokens=jnp.full((queue, new_token_bucket), pad_id, jnp.int32),
        logprobs=jnp.zeros((queue, new_token_bucket), jnp.float32),
        lengths=jnp.zeros((queue,), jnp.int32), stopped=jnp.zeros((queue,), bool),
        slot_sample=jnp.full((slots,), -1, jnp.int32), slot_step=jnp.zeros((slots,), jnp.int32),
        logits=jnp.zeros((slots, config.vocab_size), jnp.float32),
        next_sample=jnp.zeros((), jnp.int32), iterations=jnp.zeros((), jnp.int32),
        response_k=empty.response_k, response_v=empty.response_v)
    state = constrain(refill(state, jnp.ones((slots,), bool)))
    return jax.lax.while_loop(busy, step, state)


def slot_count(max_slots: int, num_rows: int, row_multiple: int = 1) -> int:
    """Slots of a call: max_slots, at most the row bucket of its samples (more would never be busy), at
    least 2 (XLA's matrix-vector products round differently from its matrix products; 2 slots keep the
    static engine's arithmetic), rounded up to a multiple of `row_multiple` (the devices they are split over)."""
    return round_up(max(2, min(int(max_slots), bucket_size(num_rows))), row_multiple)


def check_max_slots(max_slots) -> None:
    if isinstance(max_slots, bool) or not isinstance(max_slots, (int, np.integer)) or max_slots < 1:
        raise ValueError(f"max_slots must be an int >= 1 (decode slots of the continuous engine), got {max_slots!r}")


def generate_slots(params, config: ModelConfig, prompts: list[np.ndarray], counts: np.ndarray, *,
                   max_new_tokens: int, temperature: float, top_p: float, top_k: int, stop_ids: np.ndarray,
                   rng: jax.Array, pad_id: int, max_slots: int, prefill_tokens_per_call: int = 4096,
                   mesh: Mesh | None = None):
    """The continuous engine behind `generate(..., engine="continuous")` on checked inputs (prompts as
    int32 arrays, counts [len(prompts)] with a positive sum, stop_ids padded by `generate._stop_array`).
    Returns (tokens [R, max_new_tokens], logprobs, lengths [R], stopped [R], row_prompt [R], SlotStats)
    as numpy arrays, R = counts.sum(), rows ordered by prompt then sample. `params` must already be placed
    on `mesh` when one is given (`models.sharding.shard_params`)."""
    check_max_slots(max_slots)
    lengths = np.array([len(p) for p in prompts])
    row_multiple = 1 if mesh is None else int(np.prod([mesh.shape[a] for a in row_axes(mesh)]))
    plan = make_plan(lengths, counts, max_new_tokens, row_multiple=row_multiple,
                     prefill_tokens_per_call=prefill_tokens_per_call)
    active = plan.prefill_prompts
    per_call = plan.prompts_per_prefill
    cache = empty_prompt_cache(config, round_up(bucket_size(len(active)), per_call), plan.prompt_bucket)
    for start in range(0, len(active), per_call):
        chunk = active[start: start + per_call]
        tokens = np.full((per_call, plan.prompt_bucket), pad_id, np.int32)
        chunk_lengths = np.ones(per_call, np.int32)  # unused entries: one pad token
        for j, p in enumerate(chunk):
            tokens[j, : lengths[p]] = prompts[p]
            chunk_lengths[j] = lengths[p]
        tokens = jnp.asarray(tokens) if mesh is None else jax.device_put(tokens, row_sharding(mesh, 2))
        cache = prefill_prompts(params, config, mesh, tokens, jnp.asarray(chunk_lengths), jnp.int32(start), cache)
    entry = np.zeros(len(prompts), np.int32)
    entry[active] = np.arange(len(active), dtype=np.int32)
    sample_prompt = np.zeros(plan.row_bucket, np.int32)
    sample_prompt[: plan.num_rows] = entry[plan.row_prompt]
    slots = slot_count(max_slots, plan.num_rows, row_multiple)
    greedy = temperature == 0.0
    state = decode_slots(params, config, mesh, cache, jnp.asarray(sample_prompt), jnp.int32(plan.num_rows), rng,
                         jnp.float32(1.0 if greedy else temperature), jnp.float32(top_p), jnp.int32(max_new_tokens),
                         jnp.asarray(stop_ids), jnp.int32(pad_id), slots=slots,
                         new_token_bucket=plan.new_token_bucket, greedy=greedy, top_k=0 if greedy else int(top_k),
                         use_top_p=not greedy and top_p < 1.0)
    n = plan.num_rows
    out_lengths = to_host(state.lengths)[:n]
    stats = SlotStats(slots=slots, iterations=int(state.iterations), useful_slot_steps=int(out_lengths.sum()))
    logger.debug("continuous sampler: %d samples on %d slots, %d iterations, slot occupancy %.3f", n, slots,
                 stats.iterations, stats.occupancy)
    return (to_host(state.tokens)[:n, :max_new_tokens], to_host(state.logprobs)[:n, :max_new_tokens],
            out_lengths, to_host(state.stopped)[:n], plan.row_prompt.astype(np.int32), stats)
