"""What one decode step costs in each engine's data flow, to split a continuous-batching iteration's cost.

    .venv/bin/python benchmarks/decode_step.py [--rows 64] [--entries 8,80] [--group 8] [--prompt-bucket 256]
        [--new-token-bucket 512] [--steps 12] [--repeats 4] [--json OUT]

The bundled SmolLM2-135M-Instruct (float32) runs `sampling.decoder.decode_step` for `--steps` steps in a jitted
`lax.fori_loop` that carries the cache, as the engines' decode loops do, on `--rows` rows with prompts of
`--prompt-bucket` slots and responses of `--new-token-bucket` slots (the rollouts workload's buckets at 64 rows:
prompts of 72-193 tokens, up to 512 new tokens). Variants, each a step of one engine's data flow:

- static: one step for all rows (the static engine, `engine.decode_rows`): each row has its own prompt cache,
  and the new keys/values of all rows go to one column (a dynamic_update_slice), one response buffer per layer;
- tiled: the static step over a response cache split in tiles (`buckets.response_tile_size`: 128 slots at a
  512-slot bucket), which reads only the tiles generated so far; timed in the middle of each tile count's range
  of steps, and averaged over them (the mean step of a call that runs the whole bucket);
- grouped, grouped_tiled: static and tiled with one prompt entry per `--group` consecutive rows (the samples of
  one prompt: `buckets.prompt_group_size`, 8 for 8 samples per prompt), read by one product per group: the
  static engine's step since its prompt entries are shared;
- per_row: one step per row (a scatter of each row's keys/values at its own slot), still a prompt cache per row;
- shared E: per-row steps, and each row reads its prompt's keys/values from a cache of E entries shared by the
  rows that continue the same prompt (`prompt_rows`: the continuous engine before its response cache had tiles),
  gathered layer by layer. One run per `--entries` value;
- shared_tiled: the same over a tiled response cache, as `continuous.decode_slots` runs it now, timed with every
  tile reached (in steady state some slot is deep into its response, and the deepest slot decides the tiles read).

All variants compute the same logits (tested: tests/test_benchmarks_rollouts.py). Reported per variant: seconds
per step (each loop compiled and run once, then `--repeats` rounds timing every variant in turn, so drift in
the machine's speed hits all alike; the fastest round of each), the ratio to the static step, and
the bytes a step must read (weights, prompt and response keys/values, the tiled step's reached tiles only; the
shared variant's gather also writes and re-reads its rows) over the read bandwidth measured here: the memory-bound floor of a step, and the step's
share of it. A continuous-batching iteration costs the shared step plus its bookkeeping (token choice, refill,
prefill): `benchmarks/rollouts.py` measures the whole.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

VARIANTS = ("static", "tiled", "grouped", "grouped_tiled", "per_row", "shared", "shared_tiled")
STATIC_STEP = ("static", "tiled", "grouped", "grouped_tiled")  # one step for all rows


def step_bytes(config, weight_bytes: int, rows: int, prompt_bucket: int, new_token_bucket: int, variant: str,
               itemsize: int = 4, response_slots_read: int | None = None, group: int = 1) -> dict:
    """Bytes one decode step moves at least: every weight once (`weight_bytes`; a tied embedding is read whole
    by the output projection), the prompt and response keys/values of every row on every layer (`itemsize`
    bytes each; the tiled variants read `response_slots_read` response slots, their reached tiles; the grouped
    ones one prompt entry per `group` rows); the shared variant also writes its gathered prompt rows and reads
    them back (2 x the prompt bytes)."""
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize  # keys and values
    prompt = (rows // group if variant.startswith("grouped") else rows) * prompt_bucket * per_token
    response = rows * (new_token_bucket if response_slots_read is None else response_slots_read) * per_token
    gather = 2 * prompt if variant.startswith("shared") else 0
    return dict(weights=weight_bytes, prompt=prompt, response=response, gather=gather)


def make_inputs(config, rows: int, entries: int, prompt_bucket: int, new_token_bucket: int, seed: int = 0,
                group: int = 1):
    """(shared prompt cache of `entries` entries, the per-row prompt cache it gives for row -> entry
    (row // group) % entries, response cache, prompt lengths [rows], tokens [rows], entry of each row, the per-row
    cache's rows 0, group, 2 group, ...: one entry per group of `group` rows, which hold the same prompt):
    random keys/values, each entry's prompt length in [prompt_bucket / 2, prompt_bucket]."""
    from jaxrl_llm.sampling.decoder import empty_row_cache

    rng = np.random.default_rng(seed)
    empty = empty_row_cache(config, rows, prompt_bucket, new_token_bucket)

    def random_like(shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32))

    shared_k = tuple(random_like((entries,) + k.shape[1:]) for k in empty.prompt_k)
    shared_v = tuple(random_like((entries,) + v.shape[1:]) for v in empty.prompt_v)
    if rows % group:
        raise ValueError(f"--group {group} must divide --rows {rows}")
    row_entry = jnp.arange(rows, dtype=jnp.int32) // group % entries
    own_k = tuple(jnp.take(k, row_entry, axis=0) for k in shared_k)
    own_v = tuple(jnp.take(v, row_entry, axis=0) for v in shared_v)
    response_k = tuple(random_like(k.shape) for k in empty.response_k)
    response_v = tuple(random_like(v.shape) for v in empty.response_v)
    entry_lengths = rng.integers(prompt_bucket // 2, prompt_bucket + 1, entries).astype(np.int32)
    lengths = jnp.asarray(entry_lengths)[row_entry]
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, rows).astype(np.int32))
    grouped = (tuple(k[::group] for k in own_k), tuple(v[::group] for v in own_v))
    return (shared_k, shared_v), (own_k, own_v), (response_k, response_v), lengths, tokens, row_entry, grouped


def prompt_cache(variant: str, shared: tuple, own: tuple, grouped: tuple) -> tuple:
    """The (keys, values) prompt cache `variant` reads: `make_inputs`' shared cache (shared*), its cache of one entry
    per group of rows (grouped*), or its per-row cache (the others)."""
    return {"shared": shared, "grouped": grouped}.get(variant.split("_")[0], own)


@functools.partial(jax.jit, static_argnames=("config", "variant", "steps"))
def run_steps(params, config, variant: str, prompt_k, prompt_v, response_k, response_v, lengths, tokens,
              row_entry, first_step, *, steps: int):
    """`steps` decode steps of `variant` from response slot first_step on, each feeding the argmax of the last
    logits; returns the last step's logits [rows, V]."""
    from jaxrl_llm.sampling.decoder import RowCache, decode_step, unstack_layers

    layers = unstack_layers(params)
    rows = tokens.shape[0]

    def body(i, carry):
        cache, tokens, _ = carry
        step = first_step + i
        if variant in STATIC_STEP:  # tiled: the response cache is a tuple of tiles per layer; grouped: fewer entries
            logits, cache = decode_step(params, layers, config, tokens, lengths, step, cache)
        else:
            logits, cache = decode_step(params, layers, config, tokens, lengths, jnp.full((rows,), step), cache,
                                        prompt_rows=row_entry if variant.startswith("shared") else None)
        return cache, jnp.argmax(logits, -1).astype(jnp.int32), logits

    logits = jnp.zeros((rows, config.vocab_size), jnp.float32)
    cache = RowCache(prompt_k, prompt_v, response_k, response_v)
    return jax.lax.fori_loop(0, steps, body, (cache, tokens, logits))[2]


def split_tiles(response: tuple, tile: int, axis: int) -> tuple:
    """Per-layer response buffers as the tiled cache holds them: a tuple of consecutive `tile`-slot buffers."""
    return tuple(tuple(jax.lax.slice_in_dim(x, start, start + tile, axis=axis)
                       for start in range(0, x.shape[axis], tile)) for x in response)


def time_variants(params, config, runs, steps: int, repeats: int, tile: int = 0) -> list[float]:
    """Seconds per step of each (variant, inputs, first step) in `runs` (first step None: the middle of the
    response bucket): every loop compiled and run once first, then `repeats` rounds that time each in turn (so
    a drift in the machine's speed hits all alike), the fastest round of each. The tiled variant splits the
    response caches in tiles of `tile` slots."""
    calls = []
    for variant, inputs, first in runs:
        (shared_k, shared_v), (own_k, own_v), (response_k, response_v), lengths, tokens, row_entry, grouped = inputs
        prompt_k, prompt_v = prompt_cache(variant, (shared_k, shared_v), (own_k, own_v), grouped)
        first = jnp.int32(response_k[0].shape[-1] // 2 if first is None else first)
        if variant.endswith("tiled"):
            response_k, response_v = split_tiles(response_k, tile, 3), split_tiles(response_v, tile, 2)
        calls.append(functools.partial(run_steps, params, config, variant, prompt_k, prompt_v, response_k,
                                       response_v, lengths, tokens, row_entry, first, steps=steps))
    for call in calls:
        call().block_until_ready()
    best = [float("inf")] * len(calls)
    for r in range(repeats):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call().block_until_ready()
            best[i] = min(best[i], time.perf_counter() - start)
        print(f"  round {r + 1} of {repeats}: " + ", ".join(f"{b / steps:.4f}" for b in best) + " s/step so far",
              flush=True)
    return [b / steps for b in best]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--entries", default="8,80", help="prompt-cache entries of the shared variant, comma-separated")
    parser.add_argument("--group", type=int, default=8,
                        help="rows per prompt entry of the grouped variants (samples per prompt)")
    parser.add_argument("--prompt-bucket", type=int, default=256)
    parser.add_argument("--new-token-bucket", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    entries = [int(e) for e in args.entries.split(",") if e]
    if args.rows < 1 or args.steps < 1 or args.repeats < 1 or not entries or min(entries) < 1:
        parser.error("--rows, --steps, --repeats and every --entries value must be >= 1")
    if args.group < 1 or args.rows % args.group:
        parser.error("--group must be >= 1 and divide --rows")
    if args.new_token_bucket < 2 * args.steps:
        parser.error("--new-token-bucket must hold the steps from its middle on (>= 2 x --steps)")

    from sampling import machine_roofline, weight_size  # noqa: E402  (benchmarks/sampling.py)

    from jaxrl_llm.models import load_bundled
    from jaxrl_llm.sampling.buckets import response_tile_size

    config, params, _ = load_bundled("float32")
    num_params, weight_bytes = weight_size(params)
    roofline = machine_roofline(num_params, weight_bytes)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {args.rows} rows, prompt bucket "
          f"{args.prompt_bucket}, new-token bucket {args.new_token_bucket}, {args.steps} steps x {args.repeats}; "
          f"measured read {roofline['bandwidth'] / 1e9:.1f} GB/s, matmul {roofline['flops'] / 1e9:.0f} GFLOP/s",
          flush=True)
    tile = response_tile_size(args.new_token_bucket)
    # the tiled step at the middle of each tile count's range of steps (its cost grows with the tiles reached)
    tiled = [("tiled", max(entries), start + (tile - args.steps) // 2)
             for start in range(0, args.new_token_bucket, tile)] if tile >= args.steps else []
    # the continuous engine's step since its cache has tiles too: its deepest slot is deep in steady state, so
    # timed with every tile reached
    last = [("shared_tiled", max(entries), tiled[-1][2])] if tiled else []
    grouped_tiled = [("grouped_tiled", e, first) for _, e, first in tiled]
    runs = ([("static", max(entries), None)] + tiled + [("grouped", max(entries), None)] + grouped_tiled
            + [("per_row", max(entries), None)] + [("shared", e, None) for e in entries] + last)
    # one set of inputs per entry count: static, tiled, grouped and per_row read the same arrays as the largest
    # shared run
    inputs = {e: make_inputs(config, args.rows, e, args.prompt_bucket, args.new_token_bucket, group=args.group)
              for e in dict.fromkeys(e for _, e, _ in runs)}
    seconds = time_variants(params, config, [(variant, inputs[e], first) for variant, e, first in runs], args.steps,
                            args.repeats, tile)
    results = []
    for (variant, e, first), step_seconds in zip(runs, seconds):
        read = None if first is None else (first + args.steps) // tile * tile + tile  # slots of reached tiles
        moved = step_bytes(config, weight_bytes, args.rows, args.prompt_bucket, args.new_token_bucket, variant,
                           response_slots_read=read, group=args.group)
        floor = sum(moved.values()) / roofline["bandwidth"]
        results.append(dict(variant=variant, entries=e if variant.startswith("shared") else None, first_step=first,
                            seconds=step_seconds, bytes=moved, floor_seconds=floor))
    static = results[0]["seconds"]
    print("\n| variant | s per step | vs static | GB read per step | memory floor s | share of bandwidth |")
    print("|---|---|---|---|---|---|")
    for r in results:
        steps = f"steps {r['first_step']}-{(r['first_step'] or 0) + args.steps - 1}"
        name = {"shared": f"shared, {r['entries']} entries", "tiled": f"tiled, {steps}",
                "grouped": f"grouped by {args.group}", "grouped_tiled": f"grouped by {args.group}, tiled, {steps}",
                "shared_tiled": f"shared, {r['entries']} entries, tiled, {steps}"}.get(r["variant"], r["variant"])
        print(f"| {name} | {r['seconds']:.4f} | {r['seconds'] / static:.2f}x | {sum(r['bytes'].values()) / 1e9:.2f} | "
              f"{r['floor_seconds']:.4f} | {r['floor_seconds'] / r['seconds']:.0%} |")
    for variant in ("tiled", "grouped_tiled"):
        tiled_seconds = [r["seconds"] for r in results if r["variant"] == variant]
        if tiled_seconds:  # every tile count is reached for the same number of steps in a call of the whole bucket
            mean = float(np.mean(tiled_seconds))
            print(f"{variant} ({tile}-slot tiles), mean over a call of all {args.new_token_bucket} steps: {mean:.4f} s "
                  f"per step, {mean / static:.2f}x static")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), roofline=roofline, results=results), f, indent=1)


if __name__ == "__main__":
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    main()
