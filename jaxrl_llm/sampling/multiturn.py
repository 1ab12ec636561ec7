"""Multi-turn rollouts: conversations that call tools between assistant turns, many at once.

`generate_multiturn` keeps a batch of conversations. A turn ends at the end of sequence, the conversation's
remaining token budget or a token whose text holds one of the environment's stop strings (a code fence; with
`env.paired_stops` only every second one, a fence that closes a block, so a call costs one turn). The environment
answers every ended turn (`tools.env`): continue, observe (a tool ran; its output is appended) or end. Tool calls
run in a thread pool.

On the static engine (and on the continuous one with `reuse_prompt_prefill=False`) the conversations go in rounds:
each round decodes one turn of every open conversation with `generate` and waits for the round's tool calls, so a
conversation waiting for its tool holds the others until the round's calls return. On the continuous engine the
conversations turn over on its slots instead (`continuous.run_slots`): the decode loop returns to the host every
`segment_iterations` iterations, the turns that ended go to the pool without waiting, and a conversation whose
answer is back takes the next free slot while the others decode: a slow tool holds only its own conversation.

Token in, token out: the sampled ids are kept as sampled (never decoded and re-encoded); an observation is
encoded once and appended with loss mask 0 and log-prob 0. The result is laid out like a single-turn rollout,
so every algorithm trains on it unchanged: `tokens` [R, N] holds the model's turns and the observations after
the prompt, `mask` is 1 on the model's tokens only, N = `max_new_tokens` bounds the whole conversation.

Each prompt is prefilled once for all its conversations. A continued conversation is fed its tokens so far again,
one decode step per token on its prompt's cached prefill (`generate`'s `forced_prefixes` on the static engine, the
resumed slot's given tokens on the continuous one); with `reuse_prompt_prefill=False` the rounds re-prefill each
open conversation's whole context. No KV cache is kept across a tool call. Sample k's token t is drawn with the
numbers of its row and position on the continuous engine (as in a single-turn call); the rounds draw each round's
rows with a key of their own.

Routes (a mixture of experts, routing replay): every token of the conversation gets the experts it chose in the pass
that first fed it: a prompt token in its prompt's prefill, a sampled token in the decode step that fed it back, an
observation token in the step (or, re-prefilled, the prefill) of the next turn that fed it. That first feed's
key/values are what the later tokens' log-probs attended to, and a re-feed in a later turn computes the same experts
up to another program's rounding. Observation tokens are out of the loss but in the trainer's forward, so replay
routes them too. Laid out as a single-turn rollout's (`generate.Rollout`): -1 past the prompt, on the last token
(never fed) and after it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.moe import routes_before
from jaxrl_llm.sampling.buckets import bucket_size
from jaxrl_llm.sampling.continuous import SlotStats
from jaxrl_llm.sampling.engine import to_host
from jaxrl_llm.sampling.generate import FINISH_STOP, generate
from jaxrl_llm.sampling.plan import prepare_call


@dataclasses.dataclass
class MultiTurnRollout:
    """Conversations as arrays, one row per sample, ordered by prompt then sample (as `generate`'s `Rollout`).

    tokens [R, N] int32: the model's turns and the observations, pad after; mask [R, N] float32: 1 on the
    model's tokens; logprobs [R, N]: the sampler's (temperature 1) on the model's tokens, else 0; lengths [R]:
    tokens of the conversation (observations included). Per row: turns (assistant turns decoded), tool_calls,
    tool_errors, tool_timeouts, malformed (ended inside an unclosed call), truncated (ran out of budget),
    tool_seconds, and model_text (the model's tokens decoded, observations left out: what gets scored).
    """

    prompt_index: np.ndarray
    tokens: np.ndarray
    mask: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    turns: np.ndarray
    tool_calls: np.ndarray
    tool_errors: np.ndarray
    tool_timeouts: np.ndarray
    malformed: np.ndarray
    truncated: np.ndarray
    tool_seconds: np.ndarray
    model_text: list[str]
    rounds: int = 0  # sampler calls (one per round; on the continuous engine's slots, decode segments)
    # rounds: slot-steps summed over them (iterations = slot-steps, one "slot"); turns on the continuous engine's
    # slots: its slots and loop iterations (a continued conversation's fed tokens count as slot-steps, not as useful)
    slot_stats: SlotStats | None = None
    # a mixture of experts' recorded routes (module docstring; None for a dense model): routes [R, N, L_sparse, k]
    # of the conversation's tokens, prompt_routes [R, P, L_sparse, k] of its prompt's, as `generate.Rollout`'s
    routes: np.ndarray | None = None
    prompt_routes: np.ndarray | None = None

    def summary(self) -> dict[str, float]:
        """Per-sample means of the tool metrics (turns, tool_calls, tool_call_rate: samples with a call,
        tool_errors, tool_timeouts, malformed, truncated), tool_seconds summed, rounds."""
        n = max(len(self.lengths), 1)
        return {"turns": float(self.turns.sum() / n), "tool_calls": float(self.tool_calls.sum() / n),
                "tool_call_rate": float((self.tool_calls > 0).sum() / n),
                "tool_errors": float(self.tool_errors.sum() / n), "tool_timeouts": float(self.tool_timeouts.sum() / n),
                "malformed_calls": float(self.malformed.sum() / n), "truncated": float(self.truncated.sum() / n),
                "tool_seconds": float(self.tool_seconds.sum()), "sampler_rounds": float(self.rounds)}

    def sums(self) -> dict[str, float]:
        """`summary` with the per-sample means as sums and the sample count (`samples`): draws and rounds add up."""
        n = len(self.lengths)
        return {**{key: value if key in ("tool_seconds", "sampler_rounds") else value * n
                   for key, value in self.summary().items()}, "samples": n}


@functools.lru_cache(maxsize=8)
def stop_token_ids(tokenizer, strings: tuple[str, ...]) -> tuple[int, ...]:
    """Every vocabulary id whose text contains one of `strings` (a fence may be its own token or part of one:
    "```", " ```", "```\\n"...), so a turn stops wherever the model writes it."""
    vocab = int(tokenizer.vocab_size)
    return tuple(i for i in range(vocab) if any(s in tokenizer.decode([i]) for s in strings))


@dataclasses.dataclass
class _Conversation:
    prompt: int
    record: dict
    tokens: list = dataclasses.field(default_factory=list)
    mask: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    turn_start: int = 0  # where the model's text since the last observation starts in `tokens`
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    malformed: bool = False
    truncated: bool = False
    tool_seconds: float = 0.0
    routes: np.ndarray | None = None  # [max_new_tokens, L_sparse, k]: each token's at its first feed, -1 before it
    prompt_routes: np.ndarray | None = None  # [P, L_sparse, k]: the prompt's, from its prefill

    def record_routes(self, fed: np.ndarray, width: int) -> None:
        """Keep the routes `fed` [n, L_sparse, k] of tokens 0 .. n - 1 of this conversation (-1: not fed) where
        none are kept yet: each token keeps those of the pass that first fed it."""
        if self.routes is None:
            self.routes = np.full((width, *fed.shape[1:]), -1, fed.dtype)
        n = min(len(fed), width)
        self.routes[:n] = np.where(self.routes[:n] >= 0, self.routes[:n], fed[:n])


def generate_multiturn(params, config, tokenizer, records: Sequence[dict], env, *, num_samples, max_new_tokens: int,
                       max_turns: int = 4, max_observation_tokens: int = 64, temperature: float = 1.0,
                       top_p: float = 1.0, top_k: int = 0, rng: jax.Array, mesh=None, tool_workers: int = 4,
                       reuse_prompt_prefill: bool = True, segment_iterations: int = 16,
                       **engine: Any) -> MultiTurnRollout:
    """Sample `num_samples` (an int, or one count per record) conversations of each record (its "prompt_ids"
    start them) with `env` answering the turns. `max_new_tokens` bounds a conversation's tokens after the
    prompt (model and observations together); `max_turns` its tool calls (a call past them ends it, not run); an
    observation longer than `max_observation_tokens` is cut, and says so.
    `engine`: `generate`'s engine keywords (engine, max_slots, max_prompt_entries, max_rows_per_call).
    `reuse_prompt_prefill` False decodes in rounds that re-prefill every open conversation's context after the
    first (either engine; `benchmarks/tool_rollouts.py` measures each way). `segment_iterations`: the continuous
    engine's decode iterations between two looks at the ended turns (the rollout's `rounds` counts segments)."""
    if max_turns < 0 or max_observation_tokens < 1 or max_new_tokens < 1 or tool_workers < 1 \
            or segment_iterations < 1:
        raise ValueError(f"need max_turns >= 0, max_observation_tokens >= 1, max_new_tokens >= 1, "
                         f"tool_workers >= 1 and segment_iterations >= 1, got {max_turns}, {max_observation_tokens}, "
                         f"{max_new_tokens}, {tool_workers}, {segment_iterations}")
    counts = np.broadcast_to(np.asarray(num_samples, np.int64), (len(records),))
    conversations = [_Conversation(prompt=i, record=records[i]) for i in range(len(records)) for _ in range(counts[i])]
    eos = tuple(int(s) for s in tokenizer.stop_ids)
    fences = tuple(sorted(set(stop_token_ids(tokenizer, tuple(env.stop_strings))) - set(eos)))
    # paired: a turn stops at a fence that closes a block, not at the one that opens it (one round per call)
    paired = bool(getattr(env, "paired_stops", False))
    stops = eos if paired else tuple(sorted(set(eos) | set(fences)))
    open_rows = list(range(len(conversations)))
    rounds, slot_steps, useful = 0, 0, 0
    min_rows = max(1, len(conversations) // 4)
    # The static engine continues every open conversation from its prompt's shared prefill, the conversation's
    # tokens so far forced (`generate(..., forced_prefixes=)`); the continuous engine re-prefills each one.
    reuse = reuse_prompt_prefill and engine.get("engine", "static") == "static"
    if reuse_prompt_prefill and engine.get("engine", "static") == "continuous":
        with concurrent.futures.ThreadPoolExecutor(max_workers=tool_workers) as pool:
            segments, stats = _slot_turns(
                params, config, tokenizer, records, counts, conversations, env, pool, stops=stops,
                fences=fences if paired else (), eos=eos, max_new_tokens=max_new_tokens, max_turns=max_turns,
                max_observation_tokens=max_observation_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                rng=rng, mesh=mesh, segment_iterations=segment_iterations, **engine)
        return _as_arrays(conversations, tokenizer, max_new_tokens, segments, stats)
    with concurrent.futures.ThreadPoolExecutor(max_workers=tool_workers) as pool:
        while open_rows:
            active = [conversations[i] for i in open_rows]  # in prompt order, as generate orders its rows
            forced, given = None, [0] * len(active)
            reprefilled = not (rounds == 0 or reuse)  # each row's context: its prompt and its tokens so far
            if not reprefilled:  # each prompt prefilled once for its open conversations
                contexts = [list(r["prompt_ids"]) for r in records]
                per_context = np.bincount([c.prompt for c in active], minlength=len(records))
                if rounds > 0:
                    forced = [c.tokens for c in active]
                    given = [len(c.tokens) for c in active]
            else:
                contexts = [list(records[c.prompt]["prompt_ids"]) + c.tokens for c in active]
                # Few shapes, few compilations: every call decodes up to the whole budget (a row past its own
                # is cut), and the rows are padded with repeats to at least a quarter of the first round's
                # (`generate` buckets them to powers of two): 64 conversations decode in 64, 32 or 16 rows.
                contexts += [contexts[i % len(contexts)] for i in range(max(0, min_rows - len(contexts)))]
                per_context = 1
            out, stats = generate(params, config, contexts, num_samples=per_context, max_new_tokens=max_new_tokens,
                                  temperature=temperature, top_p=top_p, top_k=top_k, stop_ids=stops,
                                  pair_stop_ids=fences if paired else (), forced_prefixes=forced,
                                  rng=jax.random.fold_in(rng, rounds), pad_id=tokenizer.pad_token_id, mesh=mesh,
                                  return_stats=True, **engine)
            rounds += 1
            slot_steps += stats.slot_steps
            useful += stats.useful_slot_steps
            stopped = []
            for row, c in enumerate(active):
                sampled = int(out.lengths[row]) - given[row]  # after the forced tokens (the conversation so far)
                n = min(sampled, max_new_tokens - len(c.tokens))
                if out.routes is not None:
                    _record_round_routes(c, out, row, len(records[c.prompt]["prompt_ids"]), n, reprefilled,
                                         max_new_tokens)
                at_stop = n == sampled and out.finish_reason[row] == FINISH_STOP
                stopped.append((c, *_take_turn(c, out.tokens[row, given[row]:given[row] + n].tolist(),
                                               out.logprobs[row, given[row]:given[row] + n].tolist(), at_stop,
                                               eos=eos, max_new_tokens=max_new_tokens, tokenizer=tokenizer)))
            answers = pool.map(lambda s: env.step(s[0].record, s[1], ended=s[2],
                                                  calls_left=max_turns - s[0].tool_calls), stopped)
            still_open = [i for i, (c, _, _), result in zip(open_rows, stopped, answers)
                          if _answer(c, result, tokenizer, max_new_tokens=max_new_tokens,
                                     max_observation_tokens=max_observation_tokens)]
            open_rows = still_open
    return _as_arrays(conversations, tokenizer, max_new_tokens, rounds,
                      SlotStats(slots=1, iterations=slot_steps, useful_slot_steps=useful))


def _slot_turns(params, config, tokenizer, records, counts, conversations: list[_Conversation], env, pool, *,
                stops, fences, eos, max_new_tokens: int, max_turns: int, max_observation_tokens: int,
                temperature: float, top_p: float, top_k: int, rng, mesh, segment_iterations: int,
                engine: str = "continuous", max_slots: int | None = None, prefill_tokens_per_call: int = 4096,
                max_prompt_entries: int = 0, max_rows_per_call: int = 0) -> tuple[int, SlotStats]:
    """The conversations on the continuous engine's slots, turned over in segments of `segment_iterations` loop
    iterations (`continuous.run_slots`): after each, the turns that ended go to the environment in `pool` (not
    waited for), and the conversations whose answers are back take slots again (their tokens so far fed again
    from their prompt's cached prefill, then sampled on) while the others decode: a slow tool holds only its own
    conversation. Fills `conversations` (in `records` order, as `generate` orders rows); returns (segments run,
    slot-steps). `max_prompt_entries` is ignored: the prompt cache holds every prompt of the call."""
    from jaxrl_llm.sampling import continuous

    setup = prepare_call(params, config, [r["prompt_ids"] for r in records], num_samples=counts,
                         max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                         stop_ids=stops, pair_stop_ids=fences, pad_id=tokenizer.pad_token_id, mesh=mesh, engine=engine,
                         max_slots=max_slots, max_prompt_entries=max_prompt_entries,
                         max_rows_per_call=max_rows_per_call, prefill_tokens_per_call=prefill_tokens_per_call)
    call = setup.calls(every_prompt=True)[0]
    (cache, queue, sample_prompt, num_samples), static = continuous.slot_inputs(
        config, setup.prompts, setup.counts, call, pad_id=tokenizer.pad_token_id)
    plan, params = call.shapes, setup.params
    # the plan's rows are ordered by prompt then sample, as `conversations`
    assert [conversations[r].prompt for r in range(plan.num_rows)] == plan.row_prompt.tolist()
    temperature, top_p, selection = setup.selection()
    keywords = dict(slots=static["slots"], **selection, prefill_chunk=static["prefill_chunk"],
                    paired_stops=setup.paired_stops)
    arguments = (queue, sample_prompt, num_samples, rng, temperature, top_p, jnp.int32(max_new_tokens),
                 jnp.asarray(setup.stop_ids), jnp.int32(segment_iterations))
    state = continuous.start_slots(config, cache, queue, sample_prompt, jnp.int32(tokenizer.pad_token_id),
                                   slots=static["slots"], new_token_bucket=static["new_token_bucket"], mesh=mesh)
    width, rows = static["new_token_bucket"], sample_prompt.shape[0]
    in_engine, waiting, segments = set(range(plan.num_rows)), {}, 0
    while in_engine or waiting:
        seen = np.zeros(rows, bool)
        if in_engine:
            state = continuous.run_slots(params, config, mesh, state, *arguments, **keywords)
            segments += 1
            ended = [r for r in np.flatnonzero(to_host(state.turn_ended)) if r in in_engine]
            if ended:
                tokens, logprobs, lengths, stopped = (to_host(x) for x in (state.tokens, state.logprobs,
                                                                          state.lengths, state.stopped))
                routes = None if state.routes is None else _rows_to_host(state.routes, ended)
            for i, r in enumerate(ended):
                c = conversations[r]
                given, n = len(c.tokens), int(lengths[r])
                if routes is not None:  # this turn's slot fed tokens 0 .. n - 2 (the given ones again)
                    c.record_routes(routes[i, :n - 1], max_new_tokens)
                text, done = _take_turn(c, tokens[r, given:n].tolist(), logprobs[r, given:n].tolist(),
                                        bool(stopped[r]), eos=eos, max_new_tokens=max_new_tokens,
                                        tokenizer=tokenizer)
                waiting[r] = pool.submit(env.step, c.record, text, ended=done, calls_left=max_turns - c.tool_calls)
                in_engine.discard(r)
                seen[r] = True
        if waiting and not in_engine:  # every slot idle: wait for a tool
            concurrent.futures.wait(list(waiting.values()), return_when=concurrent.futures.FIRST_COMPLETED)
        resume = np.zeros(rows, bool)
        row_tokens = np.full((rows, width), tokenizer.pad_token_id, np.int32)
        row_logprobs = np.zeros((rows, width), np.float32)
        given = np.zeros(rows, np.int32)
        for r in [r for r, f in waiting.items() if f.done()]:
            c = conversations[r]
            if _answer(c, waiting.pop(r).result(), tokenizer, max_new_tokens=max_new_tokens,
                       max_observation_tokens=max_observation_tokens):
                n = len(c.tokens)
                resume[r], given[r] = True, n
                row_tokens[r, :n], row_logprobs[r, :n] = c.tokens, c.logprobs
                in_engine.add(r)
        if resume.any() or seen.any():
            state = continuous.resume_slots(state, resume, row_tokens, row_logprobs, given, seen)
    if state.routes is not None:  # each prompt's, from its one prefill (its entry is kept across turns)
        for c, own in zip(conversations, continuous.sample_prompt_routes(state, queue, sample_prompt, plan.num_rows)):
            c.prompt_routes = own
    iterations = int(state.iterations)
    useful = int(sum(int(m) for c in conversations for m in c.mask))
    return segments, SlotStats(slots=static["slots"], iterations=iterations, useful_slot_steps=useful)


def _rows_to_host(x: jax.Array, rows: list[int]) -> np.ndarray:
    """x[rows] as a numpy array (then padded rows), taken on the device first: the ended turns' routes, not every
    sample's (routes are sparse layers x k ids per token, far more than its token and log-prob). The rows are padded
    to a bucket (`buckets.bucket_size`), so few shapes compile."""
    index = np.resize(np.asarray(rows, np.int32), bucket_size(len(rows)))
    return to_host(jnp.take(x, jnp.asarray(index), axis=0))


def _record_round_routes(c: _Conversation, out, row: int, prompt_length: int, sampled: int, reprefilled: bool,
                         width: int) -> None:
    """Keep the routes of a round's row (`generate`'s `Rollout` `out`) for `c`'s tokens so far and the `sampled`
    this turn adds: all in `out.routes` (the tokens so far forced), or, re-prefilled, the tokens so far in the
    context's prefill (after the prompt, in `out.prompt_routes`) and this turn's after them. The prompt's own come
    from the first round's prefill."""
    if c.prompt_routes is None:
        c.prompt_routes = out.prompt_routes[row]
    before = len(c.tokens)
    if reprefilled:
        routes = np.concatenate([out.prompt_routes[row, prompt_length:prompt_length + before],
                                 out.routes[row, :sampled]])
    else:
        routes = out.routes[row, :before + sampled]
    c.record_routes(routes, width)


def _take_turn(c: _Conversation, new: list, logprobs: list, at_stop: bool, *, eos, max_new_tokens: int,
               tokenizer) -> tuple[str, bool]:
    """Append a turn's sampled tokens to `c`: (the model's text since the last observation, whether the
    conversation ended: at the end of sequence, out of budget, or stopped other than at a stop id)."""
    c.tokens += new
    c.mask += [1.0] * len(new)
    c.logprobs += logprobs
    at_eos = at_stop and len(new) > 0 and new[-1] in eos
    c.truncated = len(c.tokens) >= max_new_tokens and not at_eos
    ended = at_eos or c.truncated or not at_stop
    return tokenizer.decode(c.tokens[c.turn_start:], skip_special_tokens=True), ended


def _answer(c: _Conversation, result, tokenizer, *, max_new_tokens: int, max_observation_tokens: int) -> bool:
    """Book the environment's answer to `c`'s turn (its observation appended, mask 0, cut to
    `max_observation_tokens` with a note); whether the conversation goes on."""
    if result.action == "continue":
        return True
    c.turns += 1
    c.malformed |= result.malformed
    if result.action == "end":
        return False
    c.tool_calls += 1
    c.tool_errors += int(result.error)
    c.tool_timeouts += int(result.timed_out)
    c.tool_seconds += result.seconds
    observation = [int(t) for t in tokenizer.encode(result.observation)]
    if len(observation) > max_observation_tokens:
        note = [int(t) for t in tokenizer.encode("\n[observation truncated]\n```\n")]
        keep = max_observation_tokens - len(note)
        observation = observation[:keep] + note if keep > 0 else observation[:max_observation_tokens]
    if len(observation) >= max_new_tokens - len(c.tokens):  # no room left to answer after it
        c.truncated = True
        return False
    c.tokens += observation
    c.mask += [0.0] * len(observation)
    c.logprobs += [0.0] * len(observation)
    c.turn_start = len(c.tokens)
    return True


def _as_arrays(conversations: list[_Conversation], tokenizer, width: int, rounds: int,
               slot_stats: SlotStats | None) -> MultiTurnRollout:
    rows = len(conversations)
    tokens = np.full((rows, width), tokenizer.pad_token_id, np.int32)
    mask = np.zeros((rows, width), np.float32)
    logprobs = np.zeros((rows, width), np.float32)
    for r, c in enumerate(conversations):
        n = len(c.tokens)
        tokens[r, :n], mask[r, :n], logprobs[r, :n] = c.tokens, c.mask, c.logprobs
    field = lambda name, dtype: np.array([getattr(c, name) for c in conversations], dtype)  # noqa: E731
    routes = {}
    if conversations and conversations[0].routes is not None:
        routes = {"routes": routes_before(np.stack([c.routes for c in conversations]),  # the last token: never fed
                                          np.array([len(c.tokens) for c in conversations]) - 1),
                  "prompt_routes": np.stack([c.prompt_routes for c in conversations])}
    text = [tokenizer.decode([t for t, m in zip(c.tokens, c.mask) if m], skip_special_tokens=True)
            for c in conversations]
    return MultiTurnRollout(
        prompt_index=field("prompt", np.int32), tokens=tokens, mask=mask, logprobs=logprobs,
        lengths=np.array([len(c.tokens) for c in conversations], np.int32), turns=field("turns", np.int32),
        tool_calls=field("tool_calls", np.int32), tool_errors=field("tool_errors", np.int32),
        tool_timeouts=field("tool_timeouts", np.int32), malformed=field("malformed", bool),
        truncated=field("truncated", bool), tool_seconds=field("tool_seconds", np.float64), model_text=text,
        rounds=rounds, slot_stats=slot_stats, **routes)
