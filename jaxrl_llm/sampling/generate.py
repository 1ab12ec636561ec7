"""`generate`: sample continuations of token prompts with per-prompt sample counts."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.models.moe import routes_before
from jaxrl_llm.sampling.buckets import SamplingPlan, bucket_size
from jaxrl_llm.sampling.continuous import SlotStats, generate_slots
from jaxrl_llm.sampling.engine import SamplingState, decode_rows, init_state, prefill_rows, row_sharding, to_host
from jaxrl_llm.sampling.plan import ENGINES, CallPlan, CallSetup, prepare_call  # noqa: F401 (ENGINES re-exported)
from jaxrl_llm.sampling.token_selection import selection_settings
FINISH_STOP = 0
FINISH_LENGTH = 1
FINISH_REASON_NAMES = ("stop", "length")


class Rollout(NamedTuple):
    """Sampled continuations as numpy arrays, one row per sample, ordered by prompt then sample.

    prompt_index int32 [R]: which prompt the row continues.
    tokens int32 [R, max_new_tokens]: generated tokens (a stop token included), pad_id after.
    mask float32 [R, max_new_tokens]: 1.0 on generated tokens, 0.0 after the row ended.
    logprobs float32 [R, max_new_tokens]: log_softmax(logits)[token] of the model at temperature 1
        (see `generate`), 0.0 where mask is 0.
    lengths int32 [R]: number of generated tokens = mask.sum(1).
    finish_reason int32 [R]: FINISH_STOP (0) if the row ended with a stop id, else FINISH_LENGTH (1).
    Routing replay (a mixture of experts, either engine; None otherwise): routes [R, max_new_tokens, L_sparse,
    k] the experts each generated token chose in each sparse layer when fed back (-1 where mask is 0, and on a
    row's last token, which is never fed), prompt_routes [R, P, L_sparse, k] those of the row's prompt tokens in
    its prefill (-1 past the prompt); small ints (`moe.route_dtype`).
    """

    prompt_index: np.ndarray
    tokens: np.ndarray
    mask: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    finish_reason: np.ndarray
    routes: np.ndarray | None = None
    prompt_routes: np.ndarray | None = None

    def finish_reason_names(self) -> list[str]:
        """finish_reason as strings, "stop" or "length"."""
        return [FINISH_REASON_NAMES[int(code)] for code in self.finish_reason]


def _forced_rows(prefixes: Sequence[Sequence[int]], first_row: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [rows, F], lengths [rows]) of the forced prefixes of a call's rows first_row ..; F a power of two."""
    part = list(prefixes[first_row: first_row + rows])
    width = bucket_size(max(map(len, part), default=1), minimum=8)
    tokens = np.zeros((rows, width), np.int32)
    lengths = np.zeros(rows, np.int32)
    for r, prefix in enumerate(part):
        tokens[r, :len(prefix)] = prefix
        lengths[r] = len(prefix)
    return tokens, lengths


def _empty_rollout(max_new_tokens: int) -> Rollout:
    return Rollout(np.zeros(0, np.int32), np.zeros((0, max_new_tokens), np.int32),
                   np.zeros((0, max_new_tokens), np.float32), np.zeros((0, max_new_tokens), np.float32),
                   np.zeros(0, np.int32), np.zeros(0, np.int32))


def _put(x: np.ndarray, mesh: Mesh | None, axis: int = 0):
    return jnp.asarray(x) if mesh is None else jax.device_put(x, row_sharding(mesh, x.ndim, axis))


def prefill(params, config: ModelConfig, prompts: list[np.ndarray], plan: SamplingPlan, *,
            pad_id: int = 0, mesh: Mesh | None = None) -> tuple[SamplingState, jax.Array]:
    """Allocate the row state of `plan` and prefill every prompt with samples once, copying its cache
    to its rows. Returns (state, first_logits [row_bucket, V])."""
    rows = plan.row_bucket
    row_prompt = np.zeros(rows, np.int32)
    row_prompt[: plan.num_rows] = plan.row_prompt
    row_prompt[plan.num_rows:] = plan.prefill_prompts[0]  # padding rows copy a real prompt, never read
    lengths = np.array([len(p) for p in prompts], np.int32)
    valid = np.arange(rows) < plan.num_rows
    state, first_logits = init_state(config, mesh, _put(lengths[row_prompt], mesh), _put(valid, mesh),
                                     prompt_bucket=plan.prompt_bucket, new_token_bucket=plan.new_token_bucket,
                                     response_tile=plan.response_tile, prompt_group=plan.prompt_group)
    per_call = plan.prompts_per_prefill
    for start in range(0, len(plan.prefill_prompts), per_call):
        chunk = plan.prefill_prompts[start: start + per_call]
        tokens = np.full((per_call, plan.prompt_bucket), pad_id, np.int32)
        chunk_lengths = np.ones(per_call, np.int32)  # unused slots: one pad token
        for j, p in enumerate(chunk):
            tokens[j, : lengths[p]] = prompts[p]
            chunk_lengths[j] = lengths[p]
        position_in_chunk = np.full(len(prompts), -1, np.int32)
        position_in_chunk[chunk] = np.arange(len(chunk), dtype=np.int32)
        row_source = np.where(valid, position_in_chunk[row_prompt], -1).astype(np.int32)
        state, first_logits = prefill_rows(params, config, mesh, _put(tokens, mesh), _put(chunk_lengths, mesh),
                                           _put(row_source, mesh), state, first_logits)
    return state, first_logits


def decode(params, config: ModelConfig, state: SamplingState, first_logits: jax.Array, *, max_new_tokens: int,
           temperature: float, top_p: float, top_k: int, stop_ids: np.ndarray, rng: jax.Array, pad_id: int,
           mesh: Mesh | None = None, row_offset: int = 0, paired_stops: bool = False,
           forced: tuple[np.ndarray, np.ndarray] | None = None) -> SamplingState:
    """Run the decode loop on a prefilled state (see `engine.decode_rows`); its row r draws the random
    numbers of output row row_offset + r."""
    temperature, top_p, selection = selection_settings(temperature, top_p, top_k)
    return decode_rows(params, config, mesh, state, first_logits, rng, temperature, top_p,
                       jnp.int32(max_new_tokens), jnp.asarray(stop_ids), jnp.int32(pad_id), jnp.int32(row_offset),
                       None if forced is None else (_put(forced[0], mesh), _put(forced[1], mesh)),
                       **selection, paired_stops=paired_stops)


def collect(state: SamplingState, plan: SamplingPlan, max_new_tokens: int, pad_id: int = 0) -> Rollout:
    """Copy the first plan.num_rows rows of a decoded state to a `Rollout`; tokens after a row's end are
    pad_id (the loop stops when the longest row ends, so later columns were never written)."""
    n = plan.num_rows
    lengths = to_host(state.lengths)[:n]
    mask = (np.arange(max_new_tokens)[None, :] < lengths[:, None]).astype(np.float32)
    routes = {}
    if state.routes is not None:
        # a row's last token is never fed back
        routes["routes"] = routes_before(to_host(state.routes)[:n, :max_new_tokens], lengths - 1)
        routes["prompt_routes"] = routes_before(to_host(state.prompt_routes)[:n], to_host(state.prompt_lengths)[:n])
    return Rollout(
        prompt_index=plan.row_prompt.astype(np.int32),
        tokens=np.where(mask > 0, to_host(state.tokens)[:n, :max_new_tokens], pad_id).astype(np.int32),
        mask=mask,
        logprobs=to_host(state.logprobs)[:n, :max_new_tokens],
        lengths=lengths,
        finish_reason=np.where(to_host(state.stopped)[:n], FINISH_STOP, FINISH_LENGTH).astype(np.int32),
        **routes,
    )


def _continuous_rollout(setup: CallSetup, config: ModelConfig, call: CallPlan, rng: jax.Array
                        ) -> tuple[Rollout, SlotStats]:
    tokens, logprobs, lengths, stopped, row_prompt, stats, (routes, prompt_routes) = generate_slots(
        setup.params, config, setup.prompts, setup.counts, max_new_tokens=setup.max_new_tokens,
        temperature=setup.temperature, top_p=setup.top_p, top_k=setup.top_k, stop_ids=setup.stop_ids, rng=rng,
        pad_id=setup.pad_id, max_slots=call.slots, prefill_tokens_per_call=setup.prefill_tokens_per_call,
        max_prompt_entries=setup.max_prompt_entries, mesh=setup.mesh, paired_stops=setup.paired_stops, call=call,
        with_routes=True)
    mask = (np.arange(tokens.shape[1])[None, :] < lengths[:, None]).astype(np.float32)
    return Rollout(prompt_index=row_prompt, tokens=tokens, mask=mask, logprobs=logprobs, lengths=lengths,
                   finish_reason=np.where(stopped, FINISH_STOP, FINISH_LENGTH).astype(np.int32), routes=routes,
                   prompt_routes=prompt_routes), stats


def _concat(rollouts: list[Rollout]) -> Rollout:
    if rollouts[0].prompt_routes is not None:  # calls of other prompt buckets: pad to the widest with -1
        width = max(r.prompt_routes.shape[1] for r in rollouts)
        rollouts = [r._replace(prompt_routes=np.pad(r.prompt_routes, ((0, 0), (0, width - r.prompt_routes.shape[1]),
                                                                        (0, 0), (0, 0)), constant_values=-1))
                    for r in rollouts]
    return Rollout(*(None if parts[0] is None else np.concatenate(parts) for parts in zip(*rollouts)))


def generate(params, config: ModelConfig, prompts: Sequence[Sequence[int]], *, num_samples, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, stop_ids: Sequence[int] = (),
             rng: jax.Array, pad_id: int = 0, mesh: Mesh | None = None,
             prefill_tokens_per_call: int = 4096, max_rows_per_call: int = 0, engine: str = "static",
             max_slots: int | None = None, max_prompt_entries: int = 0, pair_stop_ids: Sequence[int] = (),
             forced_prefixes: Sequence[Sequence[int]] | None = None,
             return_stats: bool = False) -> Rollout | tuple[Rollout, SlotStats]:
    """Sample `num_samples[i]` continuations of each token prompt; returns a `Rollout`.

    prompts: list of non-empty token-id lists. num_samples: an int for every prompt, or one count per
    prompt (0 allowed: GVM-RAFT gives prompt i its own n_i). Each prompt is prefilled once (length
    padded to a bucket) and its KV cache copied to its samples' rows (one entry shared by each group of
    consecutive rows of the prompt, `buckets.prompt_group_size`); rows are padded to a power-of-two
    bucket (the call's shapes: `plan.plan_calls`; its checks: `plan.prepare_call`), so a new mix of counts with
    the same bucket reuses the compiled programs. Decoding is a
    `lax.while_loop` that ends when every row has emitted a stop id or `max_new_tokens` tokens. A row also
    stops at the second (fourth, ...) token of `pair_stop_ids` it emits: a code fence that closes a block,
    not the one that opens it (`sampling.multiturn`). `forced_prefixes` (static engine; one token list per row, in
    row order): each row's first tokens are given, not sampled, and count among its `max_new_tokens` (their
    log-probs are the model's): a row continues its prompt's shared prefill from a given point.

    temperature = 0 is greedy (argmax). Otherwise token t is drawn from softmax(logits / temperature)
    restricted to the top_k largest logits (0 = all) and then to the smallest set of tokens whose
    probability reaches top_p (nucleus sampling, Holtzman et al. 2020), the order of transformers'
    logits warpers. Row r's random numbers come from fold_in(fold_in(rng, r), t): reproducible for a
    given seed, prompts and counts.

    logprobs are ALWAYS log_softmax(logits)[token] of the unscaled logits (temperature 1, no top-k /
    top-p renormalisation): the policy's log-probability as a trainer's importance ratios need it,
    not the log-probability of the distribution the token was drawn from when temperature != 1 or
    filters are on. A stop token is part of the response (mask 1); positions after it have mask 0,
    token pad_id and logprob 0.

    With `mesh`, rows are sharded over its ('data', 'fsdp') axes and params are placed by the model's
    partition rules (`jaxrl_llm.models.sharding.shard_params`; a no-op when already placed so).

    `max_rows_per_call` > 0 decodes the output rows in consecutive runs of at most that many (`plan.plan_calls`),
    so only one run's KV cache is live at a time; the result is the same as one call (0, the default),
    token for token and log-prob for log-prob, since a row's random numbers follow its output index.

    `engine="continuous"` decodes on `max_slots` slots (None: one per sample, up to the row bucket) that
    take the next pending sample as soon as theirs ends, with one prompt cache per prompt
    (`sampling.continuous`); it returns the same rollout as the static engine (same tokens, log-probs
    to f32 rounding) when its slots equal the static call's row bucket; with another slot count f32 rounds
    the other batch shape differently, and a draw that falls that close to a token's CDF boundary picks
    the neighbouring token (SmolLM2-135M, 3 slots against 4 rows: one row of 8 from its 6th token). At
    new-token buckets >= 256 both engines attend over response tiles but compile them differently, and may
    round apart the same way (16 gsm8k problems x 8 samples, 64 slots, 512 tokens: one row of 128 from its
    478th token, log-probs within 2.1e-5 before it). It
    takes no `max_rows_per_call` (the slots bound the cache). Its prompt cache holds one entry per prompt,
    at most max_slots + c of them (c = prompts per prefill call; prompts are prefilled inside the decode
    loop as slots need them, into entries freed by finished prompts), or `max_prompt_entries` (> 0) where
    that is lower: a slot then waits for a free entry. With `mesh`, slots are split over its
    ('data', 'fsdp') axes and every device keeps the whole prompt cache.

    `return_stats=True` returns (rollout, `SlotStats`): slot occupancy = generated tokens / slot-steps
    decoded, summed over the calls. The continuous engine counts its loop iterations x slots; the static
    engine's slots are a call's rows (its row bucket, padding included), decoded in lock step for as many
    steps as the call's longest row.
    """
    setup = prepare_call(params, config, prompts, num_samples=num_samples, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_p=top_p, top_k=top_k, stop_ids=stop_ids,
                         pair_stop_ids=pair_stop_ids, pad_id=pad_id, mesh=mesh, engine=engine, max_slots=max_slots,
                         max_prompt_entries=max_prompt_entries, max_rows_per_call=max_rows_per_call,
                         prefill_tokens_per_call=prefill_tokens_per_call, forced_prefixes=forced_prefixes)
    if setup.num_rows == 0:
        empty = _empty_rollout(max_new_tokens)
        return (empty, SlotStats(slots=0, iterations=0, useful_slot_steps=0)) if return_stats else empty
    calls = setup.calls()
    if engine == "continuous":
        rollout, stats = _continuous_rollout(setup, config, calls[0], rng)
        return (rollout, stats) if return_stats else rollout
    rollouts = []
    for call in calls:
        run = call.shapes
        state, first_logits = prefill(setup.params, config, setup.prompts, run, pad_id=pad_id, mesh=mesh)
        forced = None if forced_prefixes is None else _forced_rows(forced_prefixes, call.first_row, run.row_bucket)
        state = decode(setup.params, config, state, first_logits, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_p=top_p, top_k=top_k, stop_ids=setup.stop_ids, rng=rng,
                       pad_id=pad_id, mesh=mesh, row_offset=call.first_row, paired_stops=setup.paired_stops,
                       forced=forced)
        rollouts.append(collect(state, run, max_new_tokens, pad_id))
    rollout = rollouts[0] if len(rollouts) == 1 else _concat(rollouts)
    if not return_stats:
        return rollout
    # decode_rows stops when a call's longest row ends: that row's length is the call's decode steps
    return rollout, SlotStats(slots=run.row_bucket, iterations=sum(int(part.lengths.max()) for part in rollouts),
                              useful_slot_steps=int(rollout.lengths.sum()))
