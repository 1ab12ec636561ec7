"""Partial rollouts (`rollouts.mode: partial`): a sampler that never stops decoding. Its slots stay full across step
boundaries, a response still being written when new weights arrive continues under them (its KV cache kept), and
every token records the policy version that wrote it.

    sampler:  for segment s = 0, 1, ...: wait for version w(s) -> admit prompts -> decode I iterations with it
              -> hand over the groups whose samples all ended -> every B of them make step t's batch
    trainer:  take(t) -> score, update t -> [evaluate, save] -> publish(t + 1) -> take(t + 1) -> ...

The continuous engine (`sampling.continuous.run_slots`, entries freed as samples end) runs over a queue of Q prompts
in segments of I = `rollouts.segment_iterations` decode iterations. Prompts enter the queue in the data stream's
order; after each segment the groups whose samples have all ended are handed over in prompt order, the ended
prompts at the front leave the queue (`continuous.shift_slots`) and new ones take their places. Sample k of the
stream draws token t with the numbers fold_in(fold_in(key, k), t), wherever it sits in the queue.

Versions. Segment s decodes with exactly version w(s) = max(0, r(s) - L), where r(s) is the step whose batch the
sampler fills when s starts (batches completed before it) and L = `rollouts.partial_lag`; it waits until that version
is published. A token's version is that of the weights that computed the logits it was drawn from: the segment that
fed the token before it, or for token 0 the segment that prefilled its prompt. With `rollouts.recompute_cache` the
caches in flight are recomputed under each new version (`continuous.refresh_slots`) before the segment that first
reads it, and a row's next token is that version's. So the versions used, the tokens and the batches are functions
of the seed alone, whatever the threads' timing: a rerun reproduces every batch bitwise.
A batch of step t has staleness t - v >= L on its newest tokens; a group whose oldest token is more than
`rollouts.max_staleness` versions old when it is handed over is dropped (counted in `dropped_stale`) or, with
`rollouts.stale: redraw`, its prompt goes back to the queue's next free place and is drawn again.

Routes. A mixture of experts' sampler records the experts each prompt token and fed token chose (routing replay,
`continuous.SlotState`); a group hands them over with its samples, and a step's batch carries them to the trainer
(`ScoredRollouts.routes`, `prompt_routes`). Each is recorded once, when first computed, and never rewritten: a
prompt's by the version of the segment that first prefilled it (its `prefill_version` until a refresh), a response
token t's by the version of the segment that fed it, the one that drew token t + 1 from that feed (`versions[t + 1]`,
but for a refresh in between; the last token is never fed: -1). So a response continued under new weights holds each
version's routes for the tokens that version fed. Without recompute_cache these are exactly the experts the sampler
computed with: every cache entry stays that of the version that wrote it. With recompute_cache,
`continuous.refresh_slots` routes the prompt and the tokens so far again under the new version and records none of it:
their routes stay the earlier versions', while the tokens drawn after the refresh attended to caches the new version
computed with its own (unrecorded) experts.

Checkpoints. A checkpoint at step t waits until the sampler stops at the first segment whose version is t or later
(`quiesce`: a point fixed by the schedule), then saves beside it the batches formed and not yet trained, the groups
handed over for the next batch (their routes too) and the whole engine state: the slots' tokens, log-probs, token
versions and routes, the KV caches, the queue and the prompts read from the stream (`save_in_flight`). `--resume`
restores all of it, so a resumed run equals the uninterrupted one bitwise. A mixture of experts' checkpoint saved
before the sampler recorded routes resumes with model.routing_replay none, the rollouts in flight without routes;
with rollout it is refused (`saved_routes`).

Events. RUN_DIR/segments.jsonl logs the schedule for `benchmarks/partial_sim.py replay` (`SegmentLog`): the sampler's
shape, every segment's version, start and end and the groups it handed over with their lengths, and when each batch
was complete; one line per segment, so the lengths of every sample drawn once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import deque
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.moe import routes_before
from jaxrl_llm.sampling import continuous
from jaxrl_llm.sampling.buckets import bucket_size, default_slots, prefill_chunk, prompt_entries, round_up, slot_count
from jaxrl_llm.sampling.engine import to_host
from jaxrl_llm.sampling.plan import row_multiple, stop_array
from jaxrl_llm.sampling.token_selection import selection_settings

logger = logging.getLogger(__name__)


def _host(x: jax.Array) -> np.ndarray:
    """A copy on the host: the engine's next call donates (and may overwrite) the state's buffers, which a plain
    `np.asarray` of a CPU array would share."""
    return np.array(to_host(x))


@dataclasses.dataclass
class Group:
    """One prompt's n samples, once every one has ended. tokens / logprobs / versions [n, N]; versions: the policy
    version of each token (-1 after the sample's end); index: the prompt's place in the sampler's admissions.
    A mixture of experts' recorded routes (routing replay; None for a dense model): routes [n, N, L_sparse, k] the
    experts each fed token chose, prompt_routes [P, L_sparse, k] those of the prompt's tokens in its prefill (-1
    where nothing was recorded: a sample's last token, past the prompt). A response continued under new weights
    keeps the routes each version chose as it first fed its tokens (`continuous.refresh_slots` records none; module
    docstring, Routes)."""

    record: dict
    index: int
    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    stopped: np.ndarray
    versions: np.ndarray
    routes: np.ndarray | None = None
    prompt_routes: np.ndarray | None = None

    @property
    def oldest(self) -> int:
        return int(self.versions[self.versions >= 0].min())


class PartialSampler:
    """The continuous engine over an endless prompt stream, one segment at a time (see the module docstring).

    `next_records()` -> the stream's next prompts (records with "prompt_ids"), in order; `group_size` samples each.
    The queue holds `window` prompts (rounded up to the prefill chunk); `slots` decode slots (0: one per sample of
    `batch_groups` prompts, `buckets.default_slots`); prompts up to `prompt_bucket` tokens."""

    def __init__(self, model_config, *, next_records: Callable[[], list], group_size: int, batch_groups: int,
                 prompt_bucket: int, max_new_tokens: int, segment_iterations: int, temperature: float, top_p: float,
                 top_k: int, stop_ids, pad_id: int, key: jax.Array, slots: int = 0, window: int = 0, mesh=None,
                 prefill_tokens_per_call: int = 4096, recompute: bool = False):
        self.config, self.mesh, self.next_records = model_config, mesh, next_records
        self.n, self.max_new_tokens, self.pad_id = group_size, max_new_tokens, pad_id
        self.segment_iterations, self.recompute = segment_iterations, recompute
        multiple = row_multiple(mesh)
        self.prompt_bucket = bucket_size(prompt_bucket, minimum=16)
        self.slots = slot_count(default_slots(batch_groups * group_size, slots or None), batch_groups * group_size,
                                multiple)
        window = window or max(2 * batch_groups, 2 * -(-self.slots // group_size))
        self.chunk = prefill_chunk(self.prompt_bucket, window, multiple, prefill_tokens_per_call)
        self.window = round_up(window, self.chunk)
        self.width = bucket_size(max_new_tokens, minimum=16)
        rows = self.window * group_size
        temperature, top_p, self.selection = selection_settings(temperature, top_p, top_k)
        self.arguments = (jnp.asarray(np.repeat(np.arange(self.window, dtype=np.int32), group_size)),
                          jnp.int32(rows), key, temperature, top_p, jnp.int32(max_new_tokens),
                          jnp.asarray(stop_array(stop_ids, model_config.vocab_size)), jnp.int32(segment_iterations))
        self.entries = prompt_entries(self.window, self.slots, self.chunk)
        cache = continuous.empty_prompt_cache(model_config, self.entries, self.prompt_bucket)
        self.state = continuous.start_slots(model_config, cache, self._queue([]), self.arguments[0],
                                            jnp.int32(pad_id), slots=self.slots, new_token_bucket=self.width,
                                            mesh=mesh)
        # host books, one entry per queue place / row: the prompts, the version that prefilled each, whether its
        # group was handed over; per row the tokens so far and the version of the logits each was drawn from
        self.records: list[dict] = []
        self.admitted = 0  # prompts admitted since the start (the first queued prompt is admitted - len(records))
        self.buffer: deque = deque()  # prompts read from the stream and not yet admitted (redrawn ones first)
        self.prefill_version = np.full(self.window, -1, np.int32)
        self.handed = np.zeros(self.window, bool)
        self.lengths = np.zeros(rows, np.int32)
        self.drawn = np.full((rows, self.width), -1, np.int32)
        self.version = -1  # the version of the last segment
        self.segments = 0
        self.slot_steps = self.useful = 0  # slot-steps decoded and tokens picked, since the start
        self.log: Callable[[dict], None] | None = None  # given each segment's events (SegmentLog.segment)

    def _queue(self, records: list[dict]) -> continuous.PromptQueue:
        tokens = np.full((self.window + self.chunk, self.prompt_bucket), self.pad_id, np.int32)
        lengths = np.ones(self.window + self.chunk, np.int32)
        counts = np.zeros(self.window + self.chunk, np.int32)
        for j, record in enumerate(records):
            ids = np.asarray(record["prompt_ids"], np.int32)
            if not 0 < ids.size <= self.prompt_bucket:
                raise ValueError(f"partial rollouts: a prompt of {ids.size} tokens does not fit the sampler's "
                                 f"prompt bucket of {self.prompt_bucket} tokens (data.max_prompt_tokens)")
            if ids.size + self.max_new_tokens > self.config.max_position_embeddings:
                raise ValueError(f"partial rollouts: a prompt of {ids.size} tokens + max_new_tokens "
                                 f"({self.max_new_tokens}) exceeds max_position_embeddings "
                                 f"({self.config.max_position_embeddings})")
            tokens[j, :ids.size], lengths[j], counts[j] = ids, ids.size, self.n
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        return continuous.PromptQueue(jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(counts),
                                      jnp.asarray(starts), jnp.int32(len(records)))

    def redraw(self, record: dict) -> None:
        """Admit `record` again at the queue's next free place (before the stream's next prompts)."""
        self.buffer.appendleft(record)

    def _admit(self) -> None:
        while len(self.records) < self.window:
            if not self.buffer:
                self.buffer.extend(self.next_records())
            self.records.append(self.buffer.popleft())
            self.admitted += 1

    def segment(self, params, version: int) -> list[Group]:
        """Decode one segment with `params` (policy version `version`); the groups that ended in it, in prompt order."""
        started = time.perf_counter()
        self._admit()
        queue = self._queue(self.records)
        before, prefilled = self.lengths, int(self.state.prefilled)
        refreshed = self.recompute and 0 <= self.version != version
        if refreshed:  # the caches and the slots' next logits recomputed under the new weights
            self.state = continuous.refresh_slots(params, self.config, self.mesh, self.state, queue,
                                                  self.arguments[0], prefill_chunk=self.chunk)
            self.prefill_version[:prefilled] = version
        iterations = int(self.state.iterations)
        self.state = continuous.run_slots(params, self.config, self.mesh, self.state, queue, *self.arguments,
                                          slots=self.slots, **self.selection, prefill_chunk=self.chunk,
                                          paired_stops=False, turns=False)
        self.segments += 1
        self.lengths = _host(self.state.lengths)
        self.prefill_version[prefilled:int(self.state.prefilled)] = version
        self._book_versions(before, version, refreshed)
        self.slot_steps += (int(self.state.iterations) - iterations) * self.slots
        self.useful += int((self.lengths - before).sum())
        busy = _host(self.state.slot_sample)
        rows = np.arange(len(self.lengths))
        ended = (rows < int(self.state.next_sample)) & ~np.isin(rows, busy[busy >= 0])
        done = ended.reshape(self.window, self.n).all(axis=1) & ~self.handed
        done[len(self.records):] = False
        groups = self._hand_over(np.flatnonzero(done)) if done.any() else []
        self._shift()
        if self.log is not None:
            self.log({"segment": self.segments - 1, "version": version, "start": started, "end": time.perf_counter(),
                      "iterations": int(self.state.iterations) - iterations,
                      "groups": [[g.index, *map(int, g.lengths)] for g in groups]})
        return groups

    def _book_versions(self, before: np.ndarray, version: int, refreshed: bool) -> None:
        """The version of the logits each token of the segment was drawn from: the segment's own, but for a row's
        first token of the segment, drawn from logits computed before it (the last segment's, unless recomputed;
        token 0: its prompt's prefill)."""
        columns = np.arange(self.width)
        self.drawn[(columns > before[:, None]) & (columns < self.lengths[:, None])] = version
        rows = np.flatnonzero(self.lengths > before)
        prompt_version = self.prefill_version[rows // self.n]
        self.drawn[rows, before[rows]] = np.where(before[rows] > 0, version if refreshed else self.version,
                                                  prompt_version)
        self.version = version

    def _hand_over(self, places: np.ndarray) -> list[Group]:
        tokens, logprobs, stopped = (_host(x) for x in (self.state.tokens, self.state.logprobs, self.state.stopped))
        routed = self.state.routes is not None
        routes, prompt_routes = (_host(self.state.routes), _host(self.state.prompt_routes)) if routed else (None, None)
        out, first = [], self.admitted - len(self.records)
        for p in places:
            rows = slice(p * self.n, (p + 1) * self.n)
            lengths = self.lengths[rows]
            on = np.arange(self.width)[None, :] < lengths[:, None]
            versions = self.drawn[rows]
            n = self.max_new_tokens
            group = Group(record=self.records[p], index=first + int(p), tokens=tokens[rows, :n],
                          logprobs=np.where(on, logprobs[rows], 0.0)[:, :n], lengths=lengths.copy(),
                          stopped=stopped[rows].copy(), versions=np.where(on, versions, -1)[:, :n])
            if routed:  # as `continuous.generate_slots` gives them: a row's last token is never fed back
                group.routes = routes_before(routes[rows, :n], lengths - 1)
                group.prompt_routes = routes_before(prompt_routes[p][None], [len(self.records[p]["prompt_ids"])])[0]
            out.append(group)
            self.handed[p] = True
        return out

    def _shift(self) -> None:
        """The handed-over prompts at the queue's front leave it (`continuous.shift_slots`)."""
        d = int(np.argmin(self.handed)) if not self.handed.all() else self.window
        if d == 0:
            return
        rows = d * self.n
        self.state = continuous.shift_slots(self.state, jnp.int32(d), jnp.int32(rows), jnp.int32(self.pad_id),
                                            mesh=self.mesh)
        self.records = self.records[d:]
        for name, fill in (("prefill_version", -1), ("handed", False), ("lengths", 0), ("drawn", -1)):
            old = getattr(self, name)
            moved = np.roll(old, -(d if name in ("prefill_version", "handed") else rows), axis=0)
            moved[len(moved) - (d if name in ("prefill_version", "handed") else rows):] = fill
            setattr(self, name, moved)

    # ---- saved beside a checkpoint ---------------------------------------------------------------------------

    _HOST = ("prefill_version", "handed", "lengths", "drawn")

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict]:
        """(arrays, JSON-able books) that `load_state_dict` restores exactly."""
        leaves = jax.tree_util.tree_leaves(self.state)
        arrays = {f"leaf{i}": _host(x) for i, x in enumerate(leaves)}
        arrays.update({name: getattr(self, name).copy() for name in self._HOST})  # the sampler goes on after this
        books = {"records": list(self.records), "buffer": list(self.buffer), "admitted": self.admitted,
                 "segments": self.segments, "slot_steps": self.slot_steps, "useful": self.useful,
                 "version": self.version,
                 "shape": self._shape()}
        return arrays, books

    def _shape(self) -> list[int]:
        return [self.window, self.n, self.slots, self.width, self.prompt_bucket, self.segment_iterations,
                int(self.recompute)]

    def load_state_dict(self, arrays: dict[str, np.ndarray], books: dict) -> None:
        shape = self._shape()
        if books["shape"] != shape:
            raise ValueError(f"the saved partial sampler has queue, group, slots, width, prompt bucket, segment and "
                             f"recompute {books['shape']}, this run's has {shape}: resume with the checkpoint's "
                             f"settings")
        leaves, treedef = jax.tree_util.tree_flatten(self.state)
        # on a mesh each leaf goes back where the engine holds it (the routes split over the row axes)
        place = (lambda a, x: jnp.asarray(a, x.dtype)) if self.mesh is None else (
            lambda a, x: jax.device_put(np.asarray(a, x.dtype), x.sharding))
        self.state = jax.tree_util.tree_unflatten(treedef, [place(arrays[f"leaf{i}"], x)
                                                            for i, x in enumerate(leaves)])
        for name in self._HOST:
            setattr(self, name, np.array(arrays[name]))
        self.records, self.buffer = books["records"], deque(books["buffer"])
        self.admitted, self.segments, self.version = books["admitted"], books["segments"], books["version"]
        self.slot_steps, self.useful = books["slot_steps"], books["useful"]


# ---- a step's batch -----------------------------------------------------------------------------------------------

def batch_info(groups: list[Group], step: int) -> dict[str, Any]:
    """The versions of a step's tokens: policy_version (the newest), staleness (step - the oldest), staleness_mean
    (over the response tokens), staleness_max and tokens_per_version ({version: tokens})."""
    versions = np.concatenate([g.versions.ravel() for g in groups])
    versions = versions[versions >= 0]
    if versions.size == 0:
        return {"policy_version": step, "staleness": 0, "staleness_mean": 0.0, "staleness_max": 0,
                "tokens_per_version": {}}
    found, counts = np.unique(versions, return_counts=True)
    return {"policy_version": int(found[-1]), "staleness": int(step - found[0]),
            "staleness_mean": float(np.mean(step - versions)), "staleness_max": int(step - found[0]),
            "tokens_per_version": {str(int(v)): int(c) for v, c in zip(found, counts)}}


def score_groups(groups: list[Group], tokenizer, scorer) -> "ScoredRollouts":
    """A step's groups as `ScoredRollouts` (group g = prompt g), scored by `scorer` (texts, golds, lengths)."""
    from jaxrl_llm.train.rollouts import ScoredRollouts

    n = groups[0].tokens.shape[0]
    tokens = np.concatenate([g.tokens for g in groups]).astype(np.int32)
    lengths = np.concatenate([g.lengths for g in groups]).astype(np.int32)
    mask = (np.arange(tokens.shape[1])[None, :] < lengths[:, None]).astype(np.float32)
    texts = [tokenizer.decode(list(row[:k]), skip_special_tokens=True) for row, k in zip(tokens, lengths)]
    golds = [g.record["answer"] for g in groups for _ in range(n)]
    correct, rewards = scorer(texts, golds, lengths)
    routes = {}
    if groups[0].routes is not None:  # a mixture of experts: every row's routes and its prompt's (`ScoredRollouts`)
        routes = {"routes": np.concatenate([g.routes for g in groups]),
                  "prompt_routes": np.concatenate([np.repeat(g.prompt_routes[None], n, axis=0) for g in groups])}
    return ScoredRollouts(records=[g.record for g in groups],
                          prompt_index=np.repeat(np.arange(len(groups), dtype=np.int32), n), tokens=tokens,
                          mask=mask, logprobs=np.concatenate([g.logprobs for g in groups]).astype(np.float32),
                          lengths=lengths, rewards=np.asarray(rewards, np.float32), correct=np.asarray(correct),
                          **routes)


class SegmentLog:
    """RUN_DIR/segments.jsonl, appended from the sampler's and the trainer's threads: a header line {"start": step,
    "schedule": {...}, "sampler": {"window", "group_size", "slots", "segment_iterations", "max_new_tokens",
    "prefill_chunk", "prompt_entries"}}, then per segment
    {"segment", "version", "start", "end", "iterations", "groups": [[index, *lengths]]} and per batch taken
    {"batch": step, "sample_end"}; times are time.perf_counter() seconds, the batch lines tie them to metrics.jsonl's
    sample_end_s."""

    def __init__(self, path, header: dict):
        self.path, self.lock = path, threading.Lock()
        self.write(header)

    def write(self, event: dict) -> None:
        line = json.dumps(event) + "\n"
        with self.lock, open(self.path, "a", encoding="utf-8") as file:  # no file left open between segments
            file.write(line)


def segment_log(run, sampler: PartialSampler, start: int) -> SegmentLog | None:
    """The run's SegmentLog (process 0 only), given to `sampler`."""
    if jax.process_index() != 0:
        return None
    section = run.config.rollouts
    run.out_dir.mkdir(parents=True, exist_ok=True)
    log = SegmentLog(run.out_dir / "segments.jsonl", {
        "start": start, "schedule": {"partial_lag": section.partial_lag, "max_staleness": section.max_staleness,
                                     "batch_groups": run.config.sampling.prompts_per_step,
                                     "steps": run.config.train.steps, "redraw": section.stale == "redraw"},
        "sampler": {"window": sampler.window, "group_size": sampler.n, "slots": sampler.slots,
                    "segment_iterations": sampler.segment_iterations, "max_new_tokens": sampler.max_new_tokens,
                    "prefill_chunk": sampler.chunk, "prompt_entries": sampler.entries}})
    sampler.log = log.write
    return log


def make_partial_rollouts(run, start: int, in_flight: dict, *, filter_groups: Callable | None = None):
    """The loop's `rollouts.mode: partial` (`async_rollouts.PartialRollouts` over a `PartialSampler` on the run's
    sampler mesh): the stream `run.data`, the key fold_in(seed, 2^30) (no step's key of the other modes), and a
    step's batch scored in the trainer's thread, `filter_groups(scored) -> (scored, filtered)` applied to it."""
    from jaxrl_llm.train.async_rollouts import PartialRollouts, copy_params, in_flight_path

    cfg, section = run.config, run.config.rollouts  # a resumed run's schedule: resume.check_rollout_schedule
    sampling = cfg.sampling
    sampler = PartialSampler(run.sampler_model_config, next_records=lambda: list(next(run.data)),
                             group_size=sampling.samples_per_prompt, batch_groups=sampling.prompts_per_step,
                             prompt_bucket=cfg.data.max_prompt_tokens, max_new_tokens=sampling.max_new_tokens,
                             segment_iterations=section.segment_iterations, temperature=sampling.temperature,
                             top_p=sampling.top_p, top_k=sampling.top_k, stop_ids=run.tokenizer.stop_ids,
                             pad_id=run.tokenizer.pad_token_id, key=jax.random.fold_in(
                                 jax.random.PRNGKey(cfg.train.seed), 1 << 30),
                             slots=sampling.max_slots, mesh=run.sampler_mesh, recompute=section.recompute_cache)
    in_flight = saved_routes(in_flight, sampler, routing_replay=cfg.model.routing_replay,
                             checkpoint=f"the checkpoint at step {start} in {run.checkpointer.directory} (its "
                                        f"in-flight rollouts: {in_flight_path(run.out_dir, start)})")
    log = segment_log(run, sampler, start)

    def make_batch(groups, step, info):
        started = time.perf_counter()
        if log is not None and "sample_end" in info:
            log.write({"batch": step, "sample_end": info["sample_end"]})
        scored = score_groups(groups, run.tokenizer, run.scorer)
        filtered = 0
        if filter_groups is not None:
            scored, filtered = filter_groups(scored)
        info.update(rounds=1, prompts=len(groups) + info["dropped_stale"],
                    filtered=filtered, score_s=time.perf_counter() - started)
        return scored, info

    return PartialRollouts(sampler, make_batch, run.sampler_params, lambda params: copy_params(params, run.split_mesh),
                           start=start, steps=cfg.train.steps, batch_groups=sampling.prompts_per_step,
                           lag=section.partial_lag, max_staleness=section.max_staleness,
                           redraw=section.stale == "redraw", in_flight=in_flight)


# ---- groups beside a checkpoint -----------------------------------------------------------------------------

_GROUP_ARRAYS = ("tokens", "logprobs", "lengths", "stopped", "versions")
_GROUP_ROUTES = ("routes", "prompt_routes")  # a mixture of experts' recorded routes, saved when a group holds them


def pack_groups_state(prefix: str, groups: list[Group], arrays: dict) -> list[dict]:
    """Put `groups`' arrays in `arrays` under `prefix`; their records and indices (JSON) returned."""
    for i, group in enumerate(groups):
        for field in _GROUP_ARRAYS + _GROUP_ROUTES:
            if getattr(group, field) is not None:
                arrays[f"{prefix}/{i}/{field}"] = getattr(group, field)
    return [{"record": g.record, "index": g.index} for g in groups]


def unpack_groups_state(prefix: str, meta: list[dict], data) -> list[Group]:
    return [Group(record=m["record"], index=m["index"], **{f: np.array(data[f"{prefix}/{i}/{f}"])
                                                          for f in _GROUP_ARRAYS + _GROUP_ROUTES
                                                          if f"{prefix}/{i}/{f}" in data}) for i, m in enumerate(meta)]


def saved_routes(in_flight: dict, sampler: PartialSampler, *, routing_replay: str, checkpoint: str) -> dict:
    """`in_flight` (`async_rollouts.load_in_flight`) with the routes a mixture of experts' checkpoint saved before the
    sampler recorded them: its engine state lacks the route leaves and its groups their routes. With routing_replay
    none they are restored as -1 (nothing recorded): the trainer replays no route then, its values are those of a
    checkpoint with routes, and only routes_changed counts fewer routes (those recorded after the resume); with
    rollout a ValueError naming `checkpoint`, the first missing key and what to do, since those samples would be
    trained on the trainer's own experts, not replayed. Unchanged for a dense model or a newer checkpoint."""
    if sampler.state.routes is None or "sampler" not in in_flight:
        return in_flight
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(sampler.state)[0])
    route_leaves = [i for i, path in enumerate(paths) if path[0].name in _GROUP_ROUTES]
    saved = in_flight["sampler"]
    parts = [(f"{t}", in_flight[t][0]) for t in sorted(t for t in in_flight if t != "sampler")]
    parts.append(("pending", saved["pending"]))
    missing = [f"sampler/leaf{i}" for i in route_leaves if f"leaf{i}" not in saved["arrays"]]
    missing += [f"{prefix}/{i}/{field}" for prefix, groups in parts for i, g in enumerate(groups)
                for field in _GROUP_ROUTES if getattr(g, field) is None]
    if not missing:
        return in_flight
    if routing_replay != "none":
        raise ValueError(f"{checkpoint} was saved before the sampler recorded the experts' routes: it lacks "
                         f"{missing[0]!r} ({len(missing)} route arrays in all), which model.routing_replay="
                         f"{routing_replay} replays. Start the run afresh (a new output directory), or resume with "
                         f"model.routing_replay=none: the rollouts in flight then go on without routes")
    logger.warning("%s holds no routes for the rollouts in flight (saved before the sampler recorded them): they go on "
                   "with none (-1), and routes_changed counts only the routes recorded after the resume", checkpoint)
    dtype, per_token = sampler.state.routes.dtype, sampler.state.routes.shape[2:]
    arrays = dict(saved["arrays"])
    for i in route_leaves:
        arrays.setdefault(f"leaf{i}", np.full(leaves[i].shape, -1, dtype))
    for _, groups in parts:
        for g in groups:
            if g.routes is None:
                g.routes = np.full((*g.tokens.shape, *per_token), -1, dtype)
                g.prompt_routes = np.full((sampler.prompt_bucket, *per_token), -1, dtype)
    return {**in_flight, "sampler": {**saved, "arrays": arrays}}
