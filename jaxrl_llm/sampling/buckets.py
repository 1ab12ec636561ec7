"""Static shapes for the sampler: lengths, row counts and prompt counts are rounded up to buckets so
that a new prompt length or a new mix of per-prompt sample counts reuses a compiled program."""

from __future__ import annotations

import dataclasses
import math

import numpy as np


def bucket_size(n: int, *, minimum: int = 1, granularity: int = 256) -> int:
    """Smallest bucket >= max(n, minimum): powers of two below `granularity`, then multiples of it.

    E.g. with minimum 16, granularity 256: 5 -> 16, 17 -> 32, 200 -> 256, 300 -> 512, 700 -> 768.
    """
    if n < 0:
        raise ValueError(f"bucket_size needs a non-negative size, got {n}")
    n = max(n, minimum, 1)
    if n <= granularity:
        return 1 << (n - 1).bit_length()
    return -(-n // granularity) * granularity


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


RESPONSE_TILE = 128  # smallest response tile; a dot over fewer slots costs more per slot on CPU
MAX_RESPONSE_TILES = 8  # tiles per layer at most: the step's switch compiles one branch per tile count


def response_tile_size(new_token_bucket: int) -> int:
    """Response tile of both engines' decode caches for a new-token bucket (`decoder.empty_row_cache`): 0 (one
    buffer) below two tiles of RESPONSE_TILE, else max(RESPONSE_TILE, bucket / MAX_RESPONSE_TILES) when that
    divides the bucket (it does for every bucket of `bucket_size` >= 256: 256 -> 128, 512 -> 128, 3072 -> 384)."""
    if new_token_bucket < 2 * RESPONSE_TILE:
        return 0
    tile = max(RESPONSE_TILE, new_token_bucket // MAX_RESPONSE_TILES)
    return tile if new_token_bucket % tile == 0 else 0


def prompt_group_size(counts, rows_per_device: int) -> int:
    """Rows that share one prompt entry of the static engine's cache (`decoder.empty_row_cache`'s `prompt_group`):
    the largest g that divides every positive sample count and a device's rows, so that with rows ordered by
    prompt every run of g consecutive rows continues one prompt and no group straddles two devices. E.g. 8 samples
    of every prompt on 64 rows -> 8; counts (8, 4) -> 4; (6, 6) on 64 rows -> 2; (3, 5) -> 1."""
    counts = np.asarray(counts, dtype=np.int64).ravel()
    return max(math.gcd(int(rows_per_device), int(np.gcd.reduce(counts[counts > 0]))), 1)  # gcd(g, 0) = g


@dataclasses.dataclass(frozen=True)
class SamplingPlan:
    """Where every output row comes from and the padded shapes of one `generate` call.

    Output rows are ordered by prompt, then sample; row r samples prompt `row_prompt[r]`.
    Rows [num_rows, row_bucket) are padding, marked done from the start. `prefill_prompts` are the
    prompts with at least one sample, prefilled `prompts_per_prefill` at a time.
    """

    row_prompt: np.ndarray        # int32 [num_rows]
    prefill_prompts: np.ndarray   # int32 [num_active] prompt indices with count > 0
    num_rows: int
    row_bucket: int
    prompt_bucket: int            # padded prompt length
    new_token_bucket: int         # padded max_new_tokens (token buffer width)
    prompts_per_prefill: int
    response_tile: int = 0        # response cache tile of the decode step (`response_tile_size`); 0: none
    prompt_group: int = 1         # consecutive rows per prompt entry of the cache (`prompt_group_size`)

    @property
    def cache_length(self) -> int:
        return self.prompt_bucket + self.new_token_bucket


def make_plan(
    prompt_lengths: np.ndarray,
    counts: np.ndarray,
    max_new_tokens: int,
    *,
    row_multiple: int = 1,
    prefill_tokens_per_call: int = 4096,
) -> SamplingPlan:
    """Buckets: prompt length and max_new_tokens to powers of two (min 16) then multiples of 256;
    rows to powers of two (then multiples of 256) and a multiple of `row_multiple` (the number of
    devices the rows are split over); prompts per prefill call to a power of two such that
    prompts x prompt_bucket stays within `prefill_tokens_per_call` (at least one prompt); the response
    cache's tile by `response_tile_size` of the new-token bucket; rows per prompt entry by `prompt_group_size`."""
    row_prompt = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    active = np.flatnonzero(counts > 0).astype(np.int32)
    num_rows = int(row_prompt.shape[0])
    prompt_bucket = bucket_size(int(prompt_lengths[active].max()) if len(active) else 1, minimum=16)
    row_bucket = round_up(bucket_size(num_rows), row_multiple)
    new_token_bucket = bucket_size(max_new_tokens, minimum=16)
    return SamplingPlan(
        row_prompt=row_prompt,
        prefill_prompts=active,
        num_rows=num_rows,
        row_bucket=row_bucket,
        prompt_bucket=prompt_bucket,
        new_token_bucket=new_token_bucket,
        prompts_per_prefill=prefill_chunk(prompt_bucket, len(active), row_multiple, prefill_tokens_per_call),
        response_tile=response_tile_size(new_token_bucket),
        prompt_group=prompt_group_size(counts, row_bucket // row_multiple),
    )


def prefill_chunk(prompt_bucket: int, num_prompts: int, row_multiple: int = 1,
                  prefill_tokens_per_call: int = 4096) -> int:
    """Prompts per prefill call: the power of two at or below prefill_tokens_per_call / prompt_bucket (at
    least one), at most the prompts' bucket, rounded up to a multiple of `row_multiple`."""
    budget = max(1, prefill_tokens_per_call // prompt_bucket)
    budget = 1 << (budget.bit_length() - 1)  # round down to a power of two
    return round_up(min(bucket_size(num_prompts), budget), row_multiple)


def prompt_entries(num_prompts: int, slots: int, prefill_chunk: int, limit: int = 0) -> int:
    """Entries of the continuous engine's prompt cache: one per prompt of the call (their bucket, a multiple of
    the prefill chunk c), at most slots + c (rounded up to a multiple of c): enough for every prompt with a
    sample in a slot and one chunk prefilled ahead, so the cache is bounded by the slots, not the prompts.
    `limit` > 0 caps the entries lower (rounded up to a multiple of c, at least c): a slot whose next sample's
    prompt has no free entry then waits until a prompt's last sample ends (never forever: E >= c)."""
    every = round_up(bucket_size(num_prompts), prefill_chunk)
    bound = round_up(slots + prefill_chunk, prefill_chunk)
    if limit > 0:
        bound = min(bound, round_up(limit, prefill_chunk))
    return min(every, bound)


def slot_count(max_slots: int, num_rows: int, row_multiple: int = 1) -> int:
    """Slots of a call: max_slots, at most the row bucket of its samples (more would never be busy), at
    least 2 (XLA's matrix-vector products round differently from its matrix products; 2 slots keep the
    static engine's arithmetic), rounded up to a multiple of `row_multiple` (the devices they are split over)."""
    return round_up(max(2, min(int(max_slots), bucket_size(num_rows))), row_multiple)


def default_slots(samples: int, max_slots: int | None) -> int:
    """The slots a caller asks for: `max_slots`, or (None / 0) one per sample rounded up to the row bucket
    (`buckets.bucket_size`), so calls of nearby sizes share one compiled loop (`slot_count` then bounds it)."""
    return max_slots if max_slots else bucket_size(int(samples))
