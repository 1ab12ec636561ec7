"""One planner for a sampler call: `prepare_call` checks a call's inputs once, `plan_calls` computes its shapes once.

Every entry point (`generate` on either engine, `continuous.generate_slots`, the multi-turn slot loop) and the
capacity planners (`capacity.aot`, `capacity.memory`) ask these two functions; none re-derives a row multiple, a bucket,
a prompt group or a slot count. The rules themselves (bucket sizes, prompt groups, prefill chunks, slots, prompt
entries) are `sampling.buckets`' pure arithmetic.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
from jax.sharding import Mesh

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.sampling.buckets import (
    SamplingPlan,
    bucket_size,
    default_slots,
    make_plan,
    prompt_entries,
    prompt_group_size,
    round_up,
    slot_count,
)
from jaxrl_llm.sampling.engine import row_axes
from jaxrl_llm.sampling.token_selection import selection_settings

ENGINES = ("static", "continuous")


def row_multiple(mesh: Mesh | None) -> int:
    """Devices a call's rows are split over: the product of the mesh's row axes ('data', 'fsdp'); 1 without one.
    Every row bucket and slot count is a multiple of it."""
    return 1 if mesh is None else int(np.prod([mesh.shape[a] for a in row_axes(mesh)]))


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """One sampler call: output rows first_row .. first_row + shapes.num_rows - 1 (ordered by prompt, then sample)
    on the shapes of `shapes` (buckets, prompt group, prefill chunk). Continuous engine (one call): `slots` decode
    slots, `prompt_entries` entries of the prompt cache, a prompt queue of `queue_bucket` prompts; 0 on the static
    engine."""

    first_row: int
    shapes: SamplingPlan
    slots: int = 0
    prompt_entries: int = 0
    queue_bucket: int = 0


def _call_counts(counts: np.ndarray, max_rows_per_call: int) -> list[tuple[int, np.ndarray]]:
    """[(first output row, per-prompt counts)] of consecutive runs of at most `max_rows_per_call` rows; a prompt's
    samples may straddle two runs and count in both."""
    row_prompt = np.repeat(np.arange(len(counts)), counts)
    return [(start, np.bincount(row_prompt[start: start + max_rows_per_call], minlength=len(counts)))
            for start in range(0, int(counts.sum()), max_rows_per_call)]


def plan_calls(prompt_lengths, counts, max_new_tokens: int, *, engine: str = "static", row_multiple: int = 1,
               max_rows_per_call: int = 0, prefill_tokens_per_call: int = 4096, max_slots: int | None = None,
               max_prompt_entries: int = 0, every_prompt: bool = False) -> list[CallPlan]:
    """The calls of one sampler call of `counts[i]` samples of prompt i (of `prompt_lengths[i]` tokens).

    Static engine: one call (`buckets.make_plan`) when max_rows_per_call is 0 or at least the rows, else consecutive
    runs of at most max_rows_per_call rows that share one compiled prefill and decode: the whole call's prompt
    bucket and prompts per prefill, one row bucket (that of max(max_rows_per_call, 2): XLA's matrix-vector products
    round differently from its matrix products) and one prompt group (`buckets.prompt_group_size` of every run's
    counts), so each row is computed as the single call would, bit for bit. E.g. counts (3, 0, 5, 1, 2) in runs of
    4: rows 0-3, 4-7, 8-10, row bucket 4, prompt group 1.

    Continuous engine: one call on `buckets.slot_count(buckets.default_slots(rows, max_slots))` slots, a queue of
    the prompts with samples (their bucket, a multiple of the prefill chunk c) and `buckets.prompt_entries` cache
    entries (`every_prompt`: one per queued prompt, as the multi-turn slot loop keeps them)."""
    lengths, counts = np.asarray(prompt_lengths), np.asarray(counts)
    whole = make_plan(lengths, counts, max_new_tokens, row_multiple=row_multiple,
                      prefill_tokens_per_call=prefill_tokens_per_call)
    if engine == "continuous":
        chunk = whole.prompts_per_prefill
        active = len(whole.prefill_prompts)
        slots = slot_count(default_slots(whole.num_rows, max_slots), whole.num_rows, row_multiple)
        queue = round_up(bucket_size(active), chunk)
        entries = queue if every_prompt else prompt_entries(active, slots, chunk, max_prompt_entries)
        return [CallPlan(0, whole, slots=slots, prompt_entries=entries, queue_bucket=queue)]
    if max_rows_per_call == 0 or whole.num_rows <= max_rows_per_call:
        return [CallPlan(0, whole)]
    row_bucket = round_up(bucket_size(max(max_rows_per_call, 2)), row_multiple)
    runs = _call_counts(counts, max_rows_per_call)
    group = prompt_group_size(np.concatenate([c for _, c in runs]), row_bucket // row_multiple)
    return [CallPlan(start, dataclasses.replace(
        make_plan(lengths, run, max_new_tokens, row_multiple=row_multiple,
                  prefill_tokens_per_call=prefill_tokens_per_call),
        prompt_bucket=whole.prompt_bucket, row_bucket=row_bucket, prompts_per_prefill=whole.prompts_per_prefill,
        prompt_group=group)) for start, run in runs]


@dataclasses.dataclass(frozen=True)
class CallSetup:
    """A sampler call's checked inputs: prompts as int32 arrays, per-prompt sample counts, params placed on `mesh`,
    the row multiple, the decode loops' stop array (`stop_array`), token-selection settings and engine options."""

    params: Any
    prompts: list
    counts: np.ndarray
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_ids: np.ndarray
    paired_stops: bool
    pad_id: int
    mesh: Mesh | None
    row_multiple: int
    engine: str = "static"
    max_slots: int | None = None
    max_prompt_entries: int = 0
    max_rows_per_call: int = 0
    prefill_tokens_per_call: int = 4096
    forced_prefixes: Sequence[Sequence[int]] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.counts.sum())

    def selection(self):
        """(temperature, top_p, static keywords) of the decode loops (`token_selection.selection_settings`)."""
        return selection_settings(self.temperature, self.top_p, self.top_k)

    def calls(self, *, every_prompt: bool = False) -> list[CallPlan]:
        """`plan_calls` of this call."""
        return plan_calls([len(p) for p in self.prompts], self.counts, self.max_new_tokens, engine=self.engine,
                          row_multiple=self.row_multiple, max_rows_per_call=int(self.max_rows_per_call),
                          prefill_tokens_per_call=self.prefill_tokens_per_call, max_slots=self.max_slots,
                          max_prompt_entries=self.max_prompt_entries, every_prompt=every_prompt)


def check_max_slots(max_slots) -> None:
    if isinstance(max_slots, bool) or not isinstance(max_slots, (int, np.integer)) or max_slots < 1:
        raise ValueError(f"max_slots must be an int >= 1 (decode slots of the continuous engine), got {max_slots!r}")


def _is_count(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, np.integer)) and x >= 0


def _check_engine(engine: str, max_slots, max_rows_per_call, max_prompt_entries) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "continuous":
        if max_slots is not None:
            check_max_slots(max_slots)
        if max_rows_per_call:
            raise ValueError("max_rows_per_call applies to the static engine; the continuous engine bounds "
                             "its cache with max_slots")
        if not _is_count(max_prompt_entries):
            raise ValueError(f"max_prompt_entries must be an int >= 0 (0: max_slots + one prefill chunk), "
                             f"got {max_prompt_entries!r}")
    elif max_prompt_entries:
        raise ValueError("max_prompt_entries applies to engine='continuous' (its prompt cache)")
    elif max_slots is not None:
        raise ValueError("max_slots applies to engine='continuous'; the static engine bounds its cache with "
                         "max_rows_per_call")


def _check_settings(max_new_tokens: int, temperature: float, top_p: float, top_k: int, max_rows_per_call) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = no limit), got {top_k}")
    if not _is_count(max_rows_per_call):
        raise ValueError(f"max_rows_per_call must be an int >= 0 (0 = all rows in one call), got {max_rows_per_call!r}")


def sample_counts(num_samples, num_prompts: int) -> np.ndarray:
    """int64 [num_prompts] from an int (every prompt) or one count per prompt, each >= 0."""
    if isinstance(num_samples, (int, np.integer)):
        counts = np.full(num_prompts, int(num_samples), np.int64)
    else:
        counts = np.asarray(list(num_samples))
        if counts.shape != (num_prompts,):
            raise ValueError(f"num_samples must be an int or one count per prompt ({num_prompts}), "
                             f"got {len(counts)} counts")
        if counts.size and not np.issubdtype(counts.dtype, np.integer):
            raise ValueError(f"num_samples must hold integers, got dtype {counts.dtype}")
    if (counts < 0).any():
        raise ValueError(f"num_samples must be >= 0, got {counts.tolist()}")
    return counts.astype(np.int64)


def check_prompts(prompts, config: ModelConfig, max_new_tokens: int) -> list[np.ndarray]:
    """Prompts as int32 arrays: each a non-empty list of ids in [0, vocab_size) whose length + max_new_tokens fits
    the model's positions."""
    arrays = []
    for i, prompt in enumerate(prompts):
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"prompt {i} must be a non-empty list of token ids, got {prompt!r:.80}")
        if ids.min() < 0 or ids.max() >= config.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {config.vocab_size})")
        if ids.size + max_new_tokens > config.max_position_embeddings:
            raise ValueError(f"prompt {i} ({ids.size} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_position_embeddings ({config.max_position_embeddings})")
        arrays.append(ids.astype(np.int32))
    return arrays


def stop_array(stop_ids: Sequence[int], vocab_size: int, pair_stop_ids: Sequence[int] = ()) -> np.ndarray:
    """The decode loops' stop array: stop ids, then pair-stop ids stored as id + vocab_size (no token matches
    them as immediate stops; `engine.paired_stop_hits` reads them back), padded with -1 to a bucket."""
    for name, ids in (("stop_ids", stop_ids), ("pair_stop_ids", pair_stop_ids)):
        bad = [int(s) for s in ids if not 0 <= int(s) < vocab_size]
        if bad:
            raise ValueError(f"{name} must lie in [0, {vocab_size}), got {sorted(bad)}")
    stop = np.asarray(sorted(set(int(s) for s in stop_ids)) + sorted(set(int(s) + vocab_size for s in pair_stop_ids)),
                      np.int32)
    padded = np.full(bucket_size(stop.size, minimum=4), -1, np.int32)  # -1 never matches a token
    padded[: stop.size] = stop
    return padded


def prepare_call(params, config: ModelConfig, prompts, *, num_samples, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, stop_ids: Sequence[int] = (), pair_stop_ids: Sequence[int] = (),
                 pad_id: int = 0, mesh: Mesh | None = None, engine: str = "static", max_slots: int | None = None,
                 max_prompt_entries: int = 0, max_rows_per_call: int = 0, prefill_tokens_per_call: int = 4096,
                 forced_prefixes: Sequence[Sequence[int]] | None = None) -> CallSetup:
    """Check a sampler call's inputs (`generate`'s keywords) and set it up: engine options, settings
    (max_new_tokens >= 1, temperature >= 0, top_p in (0, 1], top_k >= 0), prompts (`check_prompts`), sample counts
    (`sample_counts`), stop ids (`stop_array`), forced prefixes (static engine, one per row, shorter than
    max_new_tokens); params placed on `mesh` by the model's partition rules (a no-op when already placed so)."""
    _check_engine(engine, max_slots, max_rows_per_call, max_prompt_entries)
    _check_settings(max_new_tokens, temperature, top_p, top_k, max_rows_per_call)
    prompt_arrays = check_prompts(prompts, config, max_new_tokens)
    counts = sample_counts(num_samples, len(prompt_arrays))
    if forced_prefixes is not None:
        if engine != "static":
            raise ValueError("forced_prefixes needs engine='static'")
        if len(forced_prefixes) != int(counts.sum()):
            raise ValueError(f"forced_prefixes: one per row ({int(counts.sum())}), got {len(forced_prefixes)}")
        if max(map(len, forced_prefixes), default=0) >= max_new_tokens:
            raise ValueError(f"forced_prefixes must be shorter than max_new_tokens ({max_new_tokens})")
    if mesh is not None:
        from jaxrl_llm.models.sharding import shard_params

        params = shard_params(params, mesh)
    return CallSetup(params=params, prompts=prompt_arrays, counts=counts, max_new_tokens=int(max_new_tokens),
                     temperature=temperature, top_p=top_p, top_k=top_k,
                     stop_ids=stop_array(stop_ids, config.vocab_size, pair_stop_ids),
                     paired_stops=len(pair_stop_ids) > 0, pad_id=pad_id, mesh=mesh, row_multiple=row_multiple(mesh),
                     engine=engine, max_slots=max_slots, max_prompt_entries=max_prompt_entries,
                     max_rows_per_call=max_rows_per_call, prefill_tokens_per_call=prefill_tokens_per_call,
                     forced_prefixes=forced_prefixes)
