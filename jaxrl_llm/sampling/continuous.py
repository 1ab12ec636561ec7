"""Continuous batching: a fixed set of decode slots that take the next pending sample as soon as theirs ends.

All samples of a call form a queue known up front (sample k continues prompt `sample_prompt[k]` and is
output row k; a prompt's samples are consecutive). Each prompt is prefilled once into an entry of a prompt
cache [E, prompt_bucket] kept beside its last-position logits; each of the S slots holds one sample and its
own response cache [S, new-token bucket], and reads its prompt's keys/values from the prompt cache
(`decoder.decode_step`'s `prompt_rows`). Memory per prompt with n samples: P + n N cache slots for the
static engine's n (P + N), and only S response caches are live whatever the number of samples.

Prompts are prefilled inside the decode loop, on demand: c at a time (c = prompts per prefill call), in
queue order, into free entries of the prompt cache, as the slots need their samples. The cache has one entry
per prompt of the call, at most S + c of them (`prompt_entries`); an entry frees when its prompt's last sample
ends. The cache is bounded by the slots, not by the prompts of the call (a 1024-prompt step on 64 slots
holds 68 entries, not 1024).

One `lax.while_loop` iteration prefills prompts if free slots need them, hands every free slot (its
sample ended at a stop id or max_new_tokens) the next pending sample, picks one token in every busy slot,
records it in the sample's output row and feeds it through the decoder at the slot's own position, all
inside the jitted loop: slots turn over without a host round trip or a recompile, and the prompt cache is
updated in place (written before the iteration's attention reads it). A sample's token t uses the uniform number
fold_in(fold_in(rng, k), t) of the static engine's row k (`engine._row_uniforms`), so both engines draw
the same rollouts. On a mesh the slots are split over its ('data', 'fsdp') axes and every device holds the
whole prompt cache, so a slot's gather by prompt entry stays on its device. A mixture of experts' recorded routes
(`SlotState.routes`) are split over the same axes by sample row, not held whole on every device.
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
from jaxrl_llm.models.moe import routes_before
# the slot rules live with the other shape rules; imported here too for the engine's readers
from jaxrl_llm.sampling.buckets import default_slots, prompt_entries, response_tile_size, slot_count  # noqa: F401
from jaxrl_llm.sampling.decoder import (
    RowCache,
    decode_step,
    empty_row_cache,
    prefill_layers,
    unstack_layers,
)
from jaxrl_llm.sampling.engine import _constrain, _empty_routes, paired_stop_hits, prefill_constraint, to_host
from jaxrl_llm.sampling.plan import CallPlan, check_max_slots, plan_calls, row_multiple
from jaxrl_llm.sampling.token_selection import select_tokens, selection_settings

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
                                "next_sample", "iterations", "response_k", "response_v", "prompts", "entry_of",
                                "entry_left", "prefilled", "given", "resume", "turn_ended", "first_row", "routes",
                                "prompt_routes"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SlotState:
    """What the slot loop carries (K = queue bucket, N = new-token bucket, S = slots).

    Per sample: tokens [K, N] int32 (pad_id after the end), logprobs [K, N] f32, lengths [K] int32,
    stopped [K] bool. Per slot: slot_sample [S] int32 (the sample it decodes, -1 when idle),
    slot_step [S] int32 (the token it picks next), logits [S, V] f32 (to pick that token from),
    response_k / response_v: per-layer response caches [S, ...] (`decoder.RowCache` layout; tuples of tiles at
        new-token buckets >= 256, `buckets.response_tile_size`).
    next_sample [] int32: first sample not yet given a slot; iterations [] int32: loop iterations run.
    The prompt cache (E entries): prompts (`PromptCache`), entry_of [Q] int32 (the entry holding prompt j,
    valid once j < prefilled), entry_left [E] int32 (samples of the entry's prompt not yet ended; 0: the
    entry is free), prefilled [] int32 (prompts prefilled so far, in queue order).
    first_row [] int32: the number of sample k's random numbers is first_row + k (0 but for an endless queue,
    `shift_slots`: a sample keeps its numbers when the samples before it leave the queue).
    A mixture of experts records its routes (routing replay; None for a dense model, as `engine.SamplingState`'s):
    routes [K, N, L_sparse, k] the experts each sample's token t chose as it was fed, prompt_routes [Q + c, P,
    L_sparse, k] those of each queue prompt's tokens in its prefill (-1: nothing recorded).
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
    prompts: PromptCache
    entry_of: jax.Array
    entry_left: jax.Array
    prefilled: jax.Array
    given: jax.Array
    resume: jax.Array
    turn_ended: jax.Array
    first_row: jax.Array
    routes: jax.Array | None = None
    prompt_routes: jax.Array | None = None


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


def _uniforms(rng: jax.Array, rows: jax.Array, steps: jax.Array) -> jax.Array:
    """U[0, 1) for output row rows[s] at token steps[s]: `engine._row_uniforms`' keys, one row per slot."""
    keys = jax.vmap(lambda r, t: jax.random.fold_in(jax.random.fold_in(rng, r), t))(rows, steps)
    return jax.vmap(jax.random.uniform)(keys)


class PromptQueue(NamedTuple):
    """The prompts of a call in queue order (Q = their bucket, padded with c rows of one pad token).

    tokens [Q + c, P] int32 right-padded, lengths [Q + c] int32, counts [Q + c] int32 (samples of each
    prompt, 0 for padding), sample_start [Q + c + 1] int32 (index of each prompt's first sample, the
    number of samples from the last real prompt on), num_prompts [] int32."""

    tokens: jax.Array
    lengths: jax.Array
    counts: jax.Array
    sample_start: jax.Array
    num_prompts: jax.Array


def _empty_state(config: ModelConfig, prompts: PromptCache, queue_prompts: PromptQueue, queue: int, pad_id: jax.Array,
                 *, slots: int, new_token_bucket: int) -> SlotState:
    empty = empty_row_cache(config, slots, 1, new_token_bucket, response_tile=response_tile_size(new_token_bucket))
    entries = prompts.lengths.shape[0]
    routes = _empty_routes(config, queue, 1, new_token_bucket)
    if routes:  # the prompts' routes per queue prompt
        routes["prompt_routes"] = _empty_routes(config, *queue_prompts.tokens.shape, 1)["prompt_routes"]
    return SlotState(
        tokens=jnp.full((queue, new_token_bucket), pad_id, jnp.int32),
        logprobs=jnp.zeros((queue, new_token_bucket), jnp.float32),
        lengths=jnp.zeros((queue,), jnp.int32), stopped=jnp.zeros((queue,), bool),
        slot_sample=jnp.full((slots,), -1, jnp.int32), slot_step=jnp.zeros((slots,), jnp.int32),
        logits=jnp.zeros((slots, config.vocab_size), jnp.float32),
        next_sample=jnp.zeros((), jnp.int32), iterations=jnp.zeros((), jnp.int32),
        response_k=empty.response_k, response_v=empty.response_v, prompts=prompts,
        entry_of=jnp.full(queue_prompts.tokens.shape[:1], entries, jnp.int32),
        entry_left=jnp.zeros((entries,), jnp.int32), prefilled=jnp.zeros((), jnp.int32),
        given=jnp.zeros((queue,), jnp.int32), resume=jnp.zeros((queue,), bool),
        turn_ended=jnp.zeros((queue,), bool), first_row=jnp.zeros((), jnp.int32), **routes)


def _constrain_routes(state: SlotState, mesh: Mesh | None) -> SlotState:
    """The recorded routes split over the mesh's row axes, routes by sample row and prompt_routes by queue prompt: the
    largest per-sample buffers (Qwen3-30B-A3B on v5p-64: 2.35 GiB a device whole). A slot's write goes to the device
    holding its sample's row: XLA gathers the slots' routes of one token (S x L_sparse x k) to every device, and each
    writes the rows it holds."""
    if state.routes is None or mesh is None:
        return state
    return dataclasses.replace(state, routes=_constrain(state.routes, mesh),
                               prompt_routes=_constrain(state.prompt_routes, mesh))


def _prefill_on_demand(params, layers, config: ModelConfig, mesh: Mesh | None, queue_prompts: PromptQueue,
                       prefill_chunk: int):
    """The slot loop's prefill: a step that prefills chunks of the queue's next prompts while free slots need them."""
    def prefill_next(state: SlotState) -> SlotState:
        """Prompts prefilled .. prefilled + c - 1 into the first c free entries (padding rows: nowhere)."""
        entries = state.entry_left.shape[0]
        first = state.prefilled
        chunk = [jax.lax.dynamic_slice_in_dim(x, first, prefill_chunk) for x in
                 (queue_prompts.tokens, queue_prompts.lengths, queue_prompts.counts)]
        tokens, lengths, counts = chunk
        # layer by layer on the loop's per-layer weights: each layer's keys/values go straight to its cache entry
        # each device prefills its share of the chunk (as `engine.prefill_rows`); the entries then go to every device
        routed = state.prompt_routes is not None
        last_logits, keys, values, *routes = prefill_layers(params, layers, config, _constrain(tokens, mesh), lengths,
                                                            state.prompts.keys[0].dtype, prefill_constraint(mesh),
                                                            with_routes=routed)
        index = first + jnp.arange(prefill_chunk)
        if routed:  # the queue prompts' own rows (past the queue's padding rows: dropped)
            state = dataclasses.replace(state, prompt_routes=state.prompt_routes.at[index].set(routes[0],
                                                                                               mode="drop"))
        target = jnp.nonzero(state.entry_left == 0, size=prefill_chunk, fill_value=entries)[0]
        target = jnp.where(index < queue_prompts.num_prompts, target, entries)  # out of range: dropped

        def put(old, new):
            return old.at[target].set(new.astype(old.dtype), mode="drop")

        cache = state.prompts
        cache = PromptCache(tuple(put(old, keys[i]) for i, old in enumerate(cache.keys)),
                            tuple(put(old, values[i]) for i, old in enumerate(cache.values)),
                            put(cache.lengths, lengths), put(cache.last_logits, last_logits))
        return dataclasses.replace(
            state, prompts=cache, entry_of=state.entry_of.at[index].set(target, mode="drop"),
            entry_left=put(state.entry_left, counts),
            prefilled=jnp.minimum(first + prefill_chunk, queue_prompts.num_prompts))

    def wants_prefill(state: SlotState) -> jax.Array:
        pending = queue_prompts.sample_start[state.prefilled] - state.next_sample  # prefilled, not in a slot
        return ((state.prefilled < queue_prompts.num_prompts) & (pending < (state.slot_sample < 0).sum())
                & ((state.entry_left == 0).sum() >= prefill_chunk))

    def prefill_on_demand(state: SlotState) -> SlotState:
        return jax.lax.while_loop(wants_prefill, prefill_next, state)

    return prefill_on_demand


def _refill(state: SlotState, *, queue_prompts: PromptQueue, sample_prompt: jax.Array, slots: int,
            turns: bool) -> SlotState:
    """Free slots take the next samples whose prompt is prefilled (with `turns`, resumed samples first)."""
    queue = sample_prompt.shape[0]
    free = state.slot_sample < 0
    limit = queue_prompts.sample_start[state.prefilled]  # samples whose prompt is in the cache
    rank = jnp.cumsum(free) - 1  # among the free slots, in index order
    resumed = jnp.zeros((), jnp.int32)
    if turns:  # resumed samples first, lowest index first
        resumed = state.resume.sum()
        waiting = jnp.nonzero(state.resume, size=slots, fill_value=queue)[0]
        take_resumed = free & (rank < resumed)
        resumed_sample = waiting[jnp.clip(rank, 0, slots - 1)]
    candidate = state.next_sample + rank - resumed
    take = free & (rank >= resumed) & (candidate < limit)
    sample = candidate
    if turns:
        take = take | take_resumed
        sample = jnp.where(take_resumed, resumed_sample, candidate)
    entry = state.entry_of[sample_prompt[jnp.clip(sample, 0, queue - 1)]]
    state = dataclasses.replace(
        state, slot_sample=jnp.where(take, sample, state.slot_sample),
        slot_step=jnp.where(free, 0, state.slot_step),
        logits=jnp.where(take[:, None], state.prompts.last_logits[entry], state.logits),
        next_sample=jnp.minimum(state.next_sample + jnp.maximum(free.sum() - resumed, 0), limit))
    if turns:
        state = dataclasses.replace(state, resume=state.resume.at[jnp.where(take_resumed, resumed_sample, queue)]
                                    .set(False, mode="drop"))
    return state


def _slot_loop(params, config: ModelConfig, mesh: Mesh | None, queue_prompts: PromptQueue, sample_prompt: jax.Array,
               num_samples: jax.Array, rng: jax.Array, temperature: jax.Array, top_p: jax.Array,
               max_new_tokens: jax.Array, stop_ids: jax.Array, *, slots: int, greedy: bool, top_k: int,
               use_top_p: bool, prefill_chunk: int, paired_stops: bool, turns: bool):
    """(constrain, busy, step) of the slot loop (traced inside `decode_slots` and `run_slots`). With `turns`, a sample
    that ends keeps its prompt entry (the host ends the conversation, not the loop), is flagged in turn_ended,
    and the host may give it back (resume): a free slot takes resumed samples before pending ones, feeds the
    sample's given tokens again (its row's own, one per iteration, no stop among them) and samples on."""
    queue = sample_prompt.shape[0]
    layers = unstack_layers(params)  # sliced once, outside the loop

    def constrain(state: SlotState) -> SlotState:
        per_slot = ("slot_sample", "slot_step", "logits")
        return _constrain_routes(dataclasses.replace(
            state, **{name: _constrain(getattr(state, name), mesh) for name in per_slot},
            response_k=jax.tree_util.tree_map(lambda x: _constrain(x, mesh), state.response_k),
            response_v=jax.tree_util.tree_map(lambda x: _constrain(x, mesh), state.response_v)), mesh)

    prefill_on_demand = _prefill_on_demand(params, layers, config, mesh, queue_prompts, prefill_chunk)
    refill = functools.partial(_refill, queue_prompts=queue_prompts, sample_prompt=sample_prompt, slots=slots,
                               turns=turns)

    def busy(state: SlotState) -> jax.Array:
        pending = jnp.any(state.slot_sample >= 0) | (state.next_sample < num_samples)
        return pending | jnp.any(state.resume) if turns else pending

    def step(state: SlotState) -> SlotState:
        # Prefill and refill first, then decode: the prefill writes the prompt cache before this iteration's
        # attention reads it, so XLA updates the cache in place. In the other order (decode, then prefill for
        # the next iteration) the read and the write of the loop's cache had no order XLA could prove, and it
        # copied the whole prompt cache twice per iteration (1.9 GB at 64 slots, 80 entries of 256 tokens
        # on SmolLM2-135M). Same iterations either way: prefill and refill end no sample, so `busy` holds
        # before them exactly when it holds after them.
        entries = state.entry_left.shape[0]
        state = constrain(refill(prefill_on_demand(state)))
        active = state.slot_sample >= 0
        sample = jnp.maximum(state.slot_sample, 0)
        t = state.slot_step
        uniform = jnp.zeros((slots,), jnp.float32) if greedy else _uniforms(rng, state.first_row + sample, t)
        tokens, logprobs = select_tokens(state.logits, uniform, temperature, top_p, greedy=greedy, top_k=top_k,
                                         use_top_p=use_top_p)
        forced = jnp.zeros((slots,), bool)
        if turns:  # a resumed sample's tokens so far are fed again as they are
            forced = active & (t < state.given[sample])
            tokens = jnp.where(forced, state.tokens[sample, t], tokens)
            logprobs = jnp.where(forced, state.logprobs[sample, t], logprobs)
        hit_stop = active & ~forced & jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1)
        if paired_stops:  # the slot's sample's tokens before t (`engine.paired_stop_hits`)
            written = state.tokens[sample]
            written = jnp.where(jnp.arange(written.shape[1])[None, :] < t[:, None], written, -1)
            hit_stop = hit_stop | (active & ~forced & paired_stop_hits(tokens, stop_ids, written, config.vocab_size))
        ended = active & (hit_stop | (t + 1 >= max_new_tokens))
        row = jnp.where(active, sample, queue)  # out of range: dropped
        entry = state.entry_of[sample_prompt[sample]]
        logits, cache, *routes = decode_step(params, layers, config, tokens, state.prompts.lengths[entry], t,
                                             RowCache(state.prompts.keys, state.prompts.values, state.response_k,
                                                      state.response_v),
                                             prompt_rows=entry, with_routes=state.routes is not None)
        if routes:  # the experts token t of each busy slot's sample chose as it was fed (idle slots: dropped)
            state = dataclasses.replace(state, routes=state.routes.at[row, t].set(routes[0], mode="drop"))
        state = dataclasses.replace(
            state,
            tokens=state.tokens.at[row, t].set(tokens, mode="drop"),
            logprobs=state.logprobs.at[row, t].set(logprobs, mode="drop"),
            lengths=state.lengths.at[row].set(t + 1, mode="drop"),
            stopped=state.stopped.at[row].set(hit_stop, mode="drop"),
            slot_sample=jnp.where(ended, -1, state.slot_sample),
            slot_step=jnp.where(active, t + 1, t), logits=logits, iterations=state.iterations + 1,
            response_k=cache.response_k, response_v=cache.response_v)
        if turns:  # the entry stays: the host ends the conversation
            state = dataclasses.replace(
                state, turn_ended=state.turn_ended.at[jnp.where(ended, sample, queue)].set(True, mode="drop"))
        else:
            state = dataclasses.replace(
                state, entry_left=state.entry_left.at[jnp.where(ended, entry, entries)].add(-1, mode="drop"))
        return constrain(state)

    return constrain, busy, step


@functools.partial(jax.jit, static_argnames=("config", "mesh", "slots", "new_token_bucket", "greedy", "top_k",
                                             "use_top_p", "prefill_chunk", "paired_stops"),
                   donate_argnames=("prompts",))
def decode_slots(params, config: ModelConfig, mesh: Mesh | None, prompts: PromptCache, queue_prompts: PromptQueue,
                 sample_prompt: jax.Array, num_samples: jax.Array, rng: jax.Array,
                 temperature: jax.Array, top_p: jax.Array, max_new_tokens: jax.Array, stop_ids: jax.Array,
                 pad_id: jax.Array, *, slots: int, new_token_bucket: int, greedy: bool, top_k: int, use_top_p: bool,
                 prefill_chunk: int, paired_stops: bool = False) -> SlotState:
    """Decode samples 0 .. num_samples - 1 (sample k continues prompt sample_prompt[k] [K] of
    `queue_prompts`) on `slots` slots until every sample ended; returns the final `SlotState`.

    Prompts are prefilled on demand, `prefill_chunk` at a time in queue order, into free entries of the
    (empty, donated) prompt cache `prompts` (an entry frees when its prompt's last sample ends): before
    the slots take pending samples, the loop prefills chunks while fewer prefilled samples are pending
    than slots are free and a chunk's worth of entries is free. A slot takes a pending sample only once
    its prompt is prefilled. With E >= slots + prefill_chunk entries no slot ever waits: when the queue's
    next prompt is not prefilled, every live entry has a sample in a slot, so at least `prefill_chunk`
    entries are free. With fewer, free slots may wait for an entry; never forever, since an entry frees
    when its prompt's busy samples end and E >= prefill_chunk.

    A sample ends after a token in `stop_ids` (-1 entries are padding) or after `max_new_tokens` tokens;
    its slot then takes the lowest pending sample (free slots in index order), which picks its token 0
    from its prompt's last logits at the next iteration. Idle slots flow through the step and write
    nothing. With `mesh`, the slots and each prefill chunk are split over its row axes.
    """
    constrain, busy, step = _slot_loop(params, config, mesh, queue_prompts, sample_prompt, num_samples, rng,
                                       temperature, top_p, max_new_tokens, stop_ids, slots=slots, greedy=greedy,
                                       top_k=top_k, use_top_p=use_top_p, prefill_chunk=prefill_chunk,
                                       paired_stops=paired_stops, turns=False)
    state = _empty_state(config, prompts, queue_prompts, sample_prompt.shape[0], pad_id, slots=slots,
                         new_token_bucket=new_token_bucket)
    return jax.lax.while_loop(busy, step, constrain(state))


@functools.partial(jax.jit, static_argnames=("config", "slots", "new_token_bucket", "mesh"),
                   donate_argnames=("prompts",))
def start_slots(config: ModelConfig, prompts: PromptCache, queue_prompts: PromptQueue, sample_prompt: jax.Array,
                pad_id: jax.Array, *, slots: int, new_token_bucket: int, mesh: Mesh | None = None) -> SlotState:
    """The slot loop's state before its first iteration (nothing prefilled, every sample pending): `run_slots`
    goes on from it. With `mesh`, the routes start split as the loop holds them (`_constrain_routes`)."""
    return _constrain_routes(_empty_state(config, prompts, queue_prompts, sample_prompt.shape[0], pad_id, slots=slots,
                                          new_token_bucket=new_token_bucket), mesh)


@functools.partial(jax.jit, static_argnames=("config", "mesh", "slots", "greedy", "top_k", "use_top_p",
                                             "prefill_chunk", "paired_stops", "turns"),
                   donate_argnames=("state",))
def run_slots(params, config: ModelConfig, mesh: Mesh | None, state: SlotState, queue_prompts: PromptQueue,
              sample_prompt: jax.Array, num_samples: jax.Array, rng: jax.Array, temperature: jax.Array,
              top_p: jax.Array, max_new_tokens: jax.Array, stop_ids: jax.Array, iterations: jax.Array, *, slots: int,
              greedy: bool, top_k: int, use_top_p: bool, prefill_chunk: int, paired_stops: bool = False,
              turns: bool = True) -> SlotState:
    """At most `iterations` more iterations of the slot loop, fewer when no slot is busy and nothing waits for one.

    In turns (`_slot_loop`'s `turns`, the default): samples whose turn ended are flagged (`turn_ended`) and keep
    their prompt entry; the host reads them, runs their tools while the slots decode the others, and gives the
    continued ones back with `resume_slots`. The prompt cache must hold every prompt of the call (`plan.plan_calls(
    ..., every_prompt=True)`): an entry is never freed. With `turns` False a sample that ends is done, and its
    prompt's entry frees with its last sample, as in `decode_slots`: the host reads the ended samples between
    segments (the partial rollouts' endless queue, `shift_slots`). Same random numbers as `decode_slots` (sample k's
    token t)."""
    constrain, busy, step = _slot_loop(params, config, mesh, queue_prompts, sample_prompt, num_samples, rng,
                                       temperature, top_p, max_new_tokens, stop_ids, slots=slots, greedy=greedy,
                                       top_k=top_k, use_top_p=use_top_p, prefill_chunk=prefill_chunk,
                                       paired_stops=paired_stops, turns=turns)
    stop_at = state.iterations + iterations
    return jax.lax.while_loop(lambda s: busy(s) & (s.iterations < stop_at), step, constrain(state))


@functools.partial(jax.jit, donate_argnames=("state",))
def resume_slots(state: SlotState, resume: jax.Array, tokens: jax.Array, logprobs: jax.Array, given: jax.Array,
                 seen: jax.Array) -> SlotState:
    """The host's answer between `run_slots` calls: samples `resume` [K] bool continue from their rows tokens
    [K, N] / logprobs (their turns so far and the observations after them), the first given [K] of them fed
    again before they sample on; the turn_ended flags of `seen` [K] bool are cleared."""
    return dataclasses.replace(
        state, tokens=jnp.where(resume[:, None], tokens, state.tokens),
        logprobs=jnp.where(resume[:, None], logprobs, state.logprobs),
        lengths=jnp.where(resume, given, state.lengths), given=jnp.where(resume, given, state.given),
        stopped=state.stopped & ~resume, resume=state.resume | resume, turn_ended=state.turn_ended & ~seen)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("state",))
def shift_slots(state: SlotState, prompts: jax.Array, rows: jax.Array, pad_id: jax.Array,
                mesh: Mesh | None = None) -> SlotState:
    """The queue without its first `prompts` prompts and their `rows` samples, every one of which has ended
    (`run_slots(..., turns=False)`): the rows after them move to the front, the freed rows at the back are
    empty, and the slots, the prompt entries and the random numbers (`first_row`) follow their samples. The host
    then puts new prompts in the queue's free places (its `PromptQueue` and sample_prompt, rebuilt), so that one
    queue of fixed size serves an endless stream of prompts. With `mesh`, the routes stay split over its row axes
    (`_constrain_routes`); the shift itself gathers them (a roll by a traced count crosses devices)."""
    def shift(x, fill):
        moved = jnp.roll(x, -rows, axis=0)
        keep = jnp.arange(x.shape[0]) < x.shape[0] - rows
        return jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), moved, fill)

    entries = state.entry_left.shape[0]
    entry_of = jnp.roll(state.entry_of, -prompts)
    entry_of = jnp.where(jnp.arange(entry_of.shape[0]) < entry_of.shape[0] - prompts, entry_of, entries)
    shifted = dataclasses.replace(
        state, tokens=shift(state.tokens, pad_id), logprobs=shift(state.logprobs, 0.0),
        lengths=shift(state.lengths, 0), stopped=shift(state.stopped, False), given=shift(state.given, 0),
        resume=shift(state.resume, False), turn_ended=shift(state.turn_ended, False),
        slot_sample=jnp.where(state.slot_sample >= 0, state.slot_sample - rows, -1),
        next_sample=state.next_sample - rows, entry_of=entry_of, prefilled=state.prefilled - prompts,
        first_row=state.first_row + rows)
    if state.routes is not None:  # the samples' routes move with them, the prompts' with their prompts
        moved = jnp.roll(state.prompt_routes, -prompts, axis=0)
        keep = jnp.arange(moved.shape[0]) < moved.shape[0] - prompts
        shifted = dataclasses.replace(shifted, routes=shift(state.routes, -1),
                                      prompt_routes=jnp.where(keep[:, None, None, None], moved, -1))
    return _constrain_routes(shifted, mesh)


@functools.partial(jax.jit, static_argnames=("config", "mesh", "prefill_chunk"), donate_argnames=("state",))
def refresh_slots(params, config: ModelConfig, mesh: Mesh | None, state: SlotState, queue_prompts: PromptQueue,
                  sample_prompt: jax.Array, *, prefill_chunk: int) -> SlotState:
    """The caches recomputed with `params` (new weights for the samples in flight): every prompt entry prefilled
    again from the queue prompt it holds, `prefill_chunk` at a time, and every busy slot's tokens so far fed again,
    one decode step per position for all slots together, so its response cache and its next token's logits are
    those `params` compute. Tokens, log-probs and random numbers stay, and so do a mixture of experts' recorded
    routes: the prompts' and tokens' experts under `params` are computed here and not recorded, so a sample keeps
    those of the weights that first prefilled or fed each token while its later tokens are drawn from caches
    `params` routed. Costs a prefill of the entries and max(slot_step) decode steps."""
    layers = unstack_layers(params)
    entries, queue = state.entry_left.shape[0], queue_prompts.tokens.shape[0]
    index = jnp.arange(queue, dtype=jnp.int32)
    # the newest prefilled prompt of each entry (a freed entry keeps an ended prompt: recomputed, never read)
    holder = jnp.zeros((entries,), jnp.int32).at[jnp.where(index < state.prefilled, state.entry_of, entries)].max(
        index, mode="drop")

    def prefill(c, cache: PromptCache) -> PromptCache:
        rows = jax.lax.dynamic_slice_in_dim(holder, c * prefill_chunk, prefill_chunk)
        logits, keys, values = prefill_layers(params, layers, config, _constrain(queue_prompts.tokens[rows], mesh),
                                              queue_prompts.lengths[rows], cache.keys[0].dtype,
                                              prefill_constraint(mesh))

        def put(old, new):
            return jax.lax.dynamic_update_slice_in_dim(old, new.astype(old.dtype), c * prefill_chunk, axis=0)

        return PromptCache(tuple(put(o, n) for o, n in zip(cache.keys, keys)),
                           tuple(put(o, n) for o, n in zip(cache.values, values)),
                           put(cache.lengths, queue_prompts.lengths[rows]), put(cache.last_logits, logits))

    prompts = jax.lax.fori_loop(0, entries // prefill_chunk, prefill, state.prompts)
    active = state.slot_sample >= 0
    sample = jnp.maximum(state.slot_sample, 0)
    entry = state.entry_of[sample_prompt[sample]]
    steps = jnp.where(active, state.slot_step, 0)

    def feed(j, carry):
        logits, response_k, response_v = carry
        out, cache = decode_step(params, layers, config, state.tokens[sample, j], prompts.lengths[entry],
                                 jnp.full_like(steps, j), RowCache(prompts.keys, prompts.values, response_k,
                                                                   response_v), prompt_rows=entry)
        return jnp.where((j == steps - 1)[:, None], out, logits), cache.response_k, cache.response_v

    logits, response_k, response_v = jax.lax.fori_loop(0, jnp.max(steps), feed, (state.logits, state.response_k,
                                                                                 state.response_v))
    return dataclasses.replace(state, prompts=prompts, logits=logits, response_k=response_k, response_v=response_v)


def slot_inputs(config: ModelConfig, prompts: list[np.ndarray], counts: np.ndarray, call: CallPlan, *,
                pad_id: int):
    """((prompt cache, queue, sample_prompt, num_samples), static keywords of `decode_slots`) of the continuous
    call `call` (`plan.plan_calls`): the arrays its decode loop starts from (`jaxrl_llm.capacity.aot` lowers the same)."""
    plan = call.shapes
    lengths = np.array([len(p) for p in prompts])
    active = plan.prefill_prompts
    per_call = plan.prompts_per_prefill
    queue_tokens = np.full((call.queue_bucket + per_call, plan.prompt_bucket), pad_id, np.int32)
    queue_lengths = np.ones(call.queue_bucket + per_call, np.int32)  # padding rows: one pad token
    queue_counts = np.zeros(call.queue_bucket + per_call, np.int32)
    for j, p in enumerate(active):
        queue_tokens[j, : lengths[p]] = prompts[p]
        queue_lengths[j] = lengths[p]
        queue_counts[j] = counts[p]
    sample_start = np.concatenate([[0], np.cumsum(queue_counts)]).astype(np.int32)
    queue = PromptQueue(jnp.asarray(queue_tokens), jnp.asarray(queue_lengths), jnp.asarray(queue_counts),
                        jnp.asarray(sample_start), jnp.int32(len(active)))
    cache = empty_prompt_cache(config, call.prompt_entries, plan.prompt_bucket)
    entry = np.zeros(len(prompts), np.int32)
    entry[active] = np.arange(len(active), dtype=np.int32)
    sample_prompt = np.zeros(plan.row_bucket, np.int32)
    sample_prompt[: plan.num_rows] = entry[plan.row_prompt]
    static = {"slots": call.slots, "new_token_bucket": plan.new_token_bucket, "prefill_chunk": per_call}
    return (cache, queue, jnp.asarray(sample_prompt), jnp.int32(plan.num_rows)), static


def generate_slots(params, config: ModelConfig, prompts: list[np.ndarray], counts: np.ndarray, *,
                   max_new_tokens: int, temperature: float, top_p: float, top_k: int, stop_ids: np.ndarray,
                   rng: jax.Array, pad_id: int, max_slots: int, prefill_tokens_per_call: int = 4096,
                   max_prompt_entries: int = 0, mesh: Mesh | None = None, paired_stops: bool = False,
                   call: CallPlan | None = None, with_routes: bool = False):
    """The continuous engine behind `generate(..., engine="continuous")` on checked inputs (`plan.prepare_call`:
    prompts as int32 arrays, counts [len(prompts)] with a positive sum, stop_ids padded by `plan.stop_array`),
    running `call` (None: `plan.plan_calls` of these inputs). Returns (tokens [R, max_new_tokens], logprobs,
    lengths [R], stopped [R], row_prompt [R], SlotStats) as numpy arrays, R = counts.sum(), rows ordered by prompt
    then sample. `params` must already be placed on `mesh` when one is given (`models.sharding.shard_params`).
    With `with_routes` also (routes [R, max_new_tokens, L_sparse, k], prompt_routes [R, P, L_sparse, k]), last:
    a mixture of experts' recorded experts as `generate.collect` gives the static engine's (-1 where nothing was
    recorded: a row's last token, never fed, and past its prompt), (None, None) for a dense model."""
    check_max_slots(max_slots)
    if call is None:
        call = plan_calls([len(p) for p in prompts], counts, max_new_tokens, engine="continuous",
                          row_multiple=row_multiple(mesh), prefill_tokens_per_call=prefill_tokens_per_call,
                          max_slots=max_slots, max_prompt_entries=max_prompt_entries)[0]
    inputs, static = slot_inputs(config, prompts, counts, call, pad_id=pad_id)
    temperature, top_p, selection = selection_settings(temperature, top_p, top_k)
    state = decode_slots(params, config, mesh, *inputs, rng, temperature, top_p, jnp.int32(max_new_tokens),
                         jnp.asarray(stop_ids), jnp.int32(pad_id), **static, **selection, paired_stops=paired_stops)
    slots = static["slots"]
    n = call.shapes.num_rows
    out_lengths = to_host(state.lengths)[:n]
    stats = SlotStats(slots=slots, iterations=int(state.iterations), useful_slot_steps=int(out_lengths.sum()))
    logger.debug("continuous sampler: %d samples on %d slots, %d iterations, slot occupancy %.3f", n, slots,
                 stats.iterations, stats.occupancy)
    out = (to_host(state.tokens)[:n, :max_new_tokens], to_host(state.logprobs)[:n, :max_new_tokens],
           out_lengths, to_host(state.stopped)[:n], call.shapes.row_prompt.astype(np.int32), stats)
    if not with_routes:
        return out
    if state.routes is None:
        return (*out, (None, None))
    routes = routes_before(to_host(state.routes)[:n, :max_new_tokens], out_lengths - 1)  # the last: never fed back
    return (*out, (routes, sample_prompt_routes(state, inputs[1], inputs[2], n)))


def sample_prompt_routes(state: SlotState, queue_prompts: PromptQueue, sample_prompt, rows: int) -> np.ndarray:
    """The recorded routes [rows, P, L_sparse, k] of the first `rows` samples' prompts: each its queue prompt's
    (`sample_prompt`) from that prompt's prefill, -1 past the prompt."""
    queue_row = np.asarray(sample_prompt)[:rows]
    return routes_before(to_host(state.prompt_routes)[queue_row], np.asarray(queue_prompts.lengths)[queue_row])
