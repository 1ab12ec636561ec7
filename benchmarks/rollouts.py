"""Rollout throughput in the RL shape: useful tokens per second and slot occupancy of jaxrl_llm.sampling
beside google-tunix's Sampler and transformers `generate`, on the same prompts, weights and row limit, in
the same process, and the machine's roofline measured with JAX in this script.

    .venv/bin/python benchmarks/rollouts.py [--problems 100] [--samples 8] [--max-new-tokens 512] [--rows 64]
        [--engines static,continuous] [--repeats 1] [--skip-peers] [--json OUT]
        [--replay-slots 64,128] [--replay-caps 0,16,8] [--replay OUT]

The workload is a training step's sampling: the bundled SmolLM2-135M-Instruct (float32) on the
gsm8k-100 problems with the `reasoning` prompt preset (DESIGN's system and user turns through the
bundled tokenizer's chat template, as the trainer builds them: `data.build_prompts`), `--samples` samples
per problem, temperature 1 (no top-k / top-p), up to `--max-new-tokens` new tokens, each row ending at
its first stop id (`tokenizer.stop_ids`), at most `--rows` rows decoding at once (the trainer's
`sampling.max_rows_per_call`; also measure `--rows 128`). Rows are ordered by problem, then sample, and
cut into consecutive batches of `--rows`:
- jaxrl_llm (static engine, `sampling.engine: static`): `generate(..., max_rows_per_call=rows)`, the
  trainer's call (`train.rollouts.sample_and_score`);
- jaxrl_llm continuous (`sampling.engine: continuous`): `generate(..., engine="continuous", max_slots=rows)`:
  `rows` decode slots, each taking the next pending sample as soon as its own ends (`sampling.continuous`);
  both engines draw the same tokens for a seed, which the script checks on the workload's rows;
- tunix: `Sampler(...)` on each batch of `rows` rows (the last batch padded with copies of its last row,
  so every call has the same shapes; the copies are decoded but their tokens are not counted), with
  `eos_tokens` = the stop ids and one `max_prompt_length` = the longest prompt;
- transformers: `model.generate` on each batch (left padding, `eos_token_id` = the stop ids, `top_k=0`).

Useful tokens: each row's tokens up to and including its first stop id (all `max_new_tokens` when none).
Useful tokens/s = useful tokens of the whole workload / its wall time, end to end (prefill, decode and
the copy back to the host; tokenisation of the prompts is done once, before). Each JAX sampler first runs
an untimed warm-up that compiles the programs of the timed calls (the continuous engine's is the whole
workload's call with every sample cut to one token: its program's shapes follow every row and
`--max-new-tokens`, its token limit is traced); the figures are medians over
`--repeats` timed runs.

Slot occupancy = useful tokens / decoded slot-steps. Every sampler here decodes a fixed batch of rows in
lock step until its longest row ends (or `max_new_tokens`): a call of B rows whose longest row has L
tokens decodes B x L token slots, of which a row of length l fills l. So slot-steps = sum over calls of
rows in the call x the longest row of the call. For jaxrl_llm the rows of a call are its row bucket
(`plan.plan_calls`' row bucket, padding rows included) and the calls are consecutive runs of `--rows` output
rows (`plan.plan_calls`); its decode loop (`engine.decode_rows`) stops when every row is done, after
max(lengths) tokens. tunix's loop stops likewise (`any(~done)`), over its padded batch; transformers
stops when every row has emitted an eos id. Occupancy 1 means no slot decoded past its row's end;
continuous batching (refilling a slot when its row ends) is what raises it. The continuous engine's
slot-steps are its loop's iterations x slots (`SlotStats`, from `generate(..., return_stats=True)`).

The continuous engine's schedule depends only on when each sample ends, so its slot-steps for any number
of slots or cap on its prompt entries (`sampling.max_prompt_entries`) follow from one run's lengths: the
script ends with that table (`replay_slots`, the engine's rules on the host; tested equal to the engine's own
iteration counts), and `--replay OUT` prints it for an earlier `--json` file without sampling, checking the
replay against the file's measured continuous run.

The roofline row is `benchmarks/sampling.py`'s: measured f32 matmul FLOP/s / (2 x parameters) per token
(large batch) and measured read bandwidth / weight bytes (batch 1). google-tunix is installed as
`benchmarks/sampling.py` says.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import pathlib
import statistics
import time
from typing import Sequence

import numpy as np


# ---- pure helpers (tests/test_benchmarks_rollouts.py) ---------------------------------------------------

def useful_lengths(tokens: np.ndarray, stop_ids: Sequence[int]) -> np.ndarray:
    """Tokens of each row up to and including its first stop id; the row's width when it has none.
    tokens: [R, T] generated tokens (anything may follow the first stop id)."""
    tokens = np.asarray(tokens)
    hit = np.isin(tokens, np.asarray(list(stop_ids)))
    return np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, tokens.shape[1]).astype(np.int64)


def lengths_before_stop(kept: Sequence[int], max_new_tokens: int) -> np.ndarray:
    """Useful lengths from outputs cut just before the first stop id (tunix's `out.tokens`): a row of k < max_new_tokens
    kept tokens ended with a stop id (k + 1 useful tokens); a row of max_new_tokens kept tokens had none."""
    kept = np.asarray(kept, np.int64)
    return np.where(kept < max_new_tokens, kept + 1, max_new_tokens)


def batches(n: int, size: int) -> list[tuple[int, int]]:
    """Consecutive [start, stop) runs of at most `size` of n rows."""
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def slot_steps(call_lengths: Sequence[np.ndarray], call_rows: Sequence[int]) -> int:
    """Token slots decoded: sum over calls of rows of the call x its longest row (every row of a call
    decodes until the longest one ends). call_lengths[c]: lengths of the rows decoded in call c."""
    if len(call_lengths) != len(call_rows):
        raise ValueError(f"{len(call_lengths)} calls of lengths but {len(call_rows)} row counts")
    total = 0
    for lengths, rows in zip(call_lengths, call_rows):
        lengths = np.asarray(lengths)
        if lengths.size > rows:
            raise ValueError(f"a call of {rows} rows cannot hold {lengths.size} lengths")
        total += int(rows) * int(lengths.max(initial=0))
    return total


def occupancy(useful_tokens: int, steps: int) -> float:
    """Useful tokens / decoded slot-steps (1.0 = no slot decoded past its row's end)."""
    return useful_tokens / steps if steps else 0.0


def summary(name: str, useful: np.ndarray, call_lengths, call_rows, seconds: list[float], *,
            decoded_slot_steps: int | None = None) -> dict:
    """One sampler's figures: useful tokens, slot-steps, occupancy, median seconds and useful tokens/s.
    Slot-steps are `slot_steps(call_lengths, call_rows)` (lock-step calls) unless `decoded_slot_steps`
    gives them (the continuous engine's iterations x slots)."""
    tokens = int(np.sum(useful))
    steps = slot_steps(call_lengths, call_rows) if decoded_slot_steps is None else int(decoded_slot_steps)
    median = statistics.median(seconds)
    return dict(sampler=name, useful_tokens=tokens, slot_steps=steps, occupancy=occupancy(tokens, steps),
                seconds=median, all_seconds=seconds, useful_tok_s=tokens / median, calls=len(call_rows),
                mean_length=float(np.mean(useful)), max_length=int(np.max(useful)))


# ---- the workload -----------------------------------------------------------------------------------------

def _sampling_bench():
    """benchmarks/sampling.py as a module (roofline, tunix builder and its id tokenizer)."""
    path = pathlib.Path(__file__).with_name("sampling.py")
    spec = importlib.util.spec_from_file_location("sampling_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def replay_slots(lengths: Sequence[int], counts: Sequence[int], slots: int, prefill_chunk: int,
                 entries: int) -> int:
    """Loop iterations of the continuous engine (`sampling.continuous.decode_slots`) on samples of these
    lengths, replayed on the host: the engine's schedule depends only on when samples end, so its slot-steps
    (iterations x slots) for any number of slots or prompt entries follow from one run's lengths.

    lengths [R]: tokens of each sample (through its stop id), samples ordered by prompt; counts [Q]: samples
    of each prompt with at least one (queue order); prefill_chunk: prompts per prefill (c); entries: prompt
    cache entries (E, a multiple of c, `continuous.prompt_entries`). The rules are the engine's: before the
    slots take samples, prompts are prefilled c at a time while fewer prefilled samples are pending than slots
    are free and c entries are free; free slots take the lowest pending samples whose prompt is prefilled;
    a sample's entry frees when the prompt's last sample ends; an iteration advances every busy slot by one
    token."""
    lengths = np.asarray(lengths, np.int64)
    counts = np.asarray(counts, np.int64)
    if lengths.size != counts.sum() or (counts < 1).any() or (lengths < 1).any():
        raise ValueError(f"{lengths.size} positive lengths for samples of {counts.tolist()} per prompt")
    if entries < prefill_chunk or entries % prefill_chunk:
        raise ValueError(f"entries ({entries}) must be a positive multiple of the prefill chunk ({prefill_chunk})")
    num_prompts, num_samples = len(counts), int(lengths.size)
    sample_start = np.concatenate([[0], np.cumsum(counts)])
    prompt_of = np.repeat(np.arange(num_prompts), counts)
    entry_of = np.full(num_prompts, -1)
    entry_left = np.zeros(entries, np.int64)
    slot_sample = np.full(slots, -1)
    slot_step = np.zeros(slots, np.int64)
    prefilled = next_sample = 0

    def prefill_and_refill():
        nonlocal prefilled, next_sample
        while (prefilled < num_prompts and sample_start[prefilled] - next_sample < (slot_sample < 0).sum()
               and (entry_left == 0).sum() >= prefill_chunk):
            chunk = np.arange(prefilled, min(prefilled + prefill_chunk, num_prompts))
            target = np.flatnonzero(entry_left == 0)[:len(chunk)]
            entry_of[chunk] = target
            entry_left[target] = counts[chunk]
            prefilled = int(chunk[-1]) + 1
        free = slot_sample < 0
        limit = sample_start[prefilled]
        candidate = next_sample + np.cumsum(free) - 1
        take = free & (candidate < limit)
        slot_sample[take] = candidate[take]
        slot_step[free] = 0
        next_sample = int(min(next_sample + free.sum(), limit))

    prefill_and_refill()
    iterations = 0
    while (slot_sample >= 0).any() or next_sample < num_samples:
        active = slot_sample >= 0
        slot_step[active] += 1
        ended = active & (slot_step >= lengths[np.maximum(slot_sample, 0)])
        np.subtract.at(entry_left, entry_of[prompt_of[slot_sample[ended]]], 1)
        slot_sample[ended] = -1
        iterations += 1
        prefill_and_refill()
    return iterations


def replay_occupancy(lengths: Sequence[int], samples: int, prompt_lengths: Sequence[int],
                     slot_options: Sequence[int], entry_caps: Sequence[int]) -> list[dict]:
    """The continuous engine's slot-steps and occupancy on a workload's sample lengths (`samples` per prompt,
    prompts of `prompt_lengths`), for each number of slots and each cap on its prompt entries (0: the
    engine's default, min(the prompts' bucket, slots + c)), by `replay_slots` with the engine's own c, slots and
    entries. Slot options the engine would cap to the same count (`slot_count`) give one set of rows, and caps
    that give the same entries one row."""
    from jaxrl_llm.sampling import make_plan
    from jaxrl_llm.sampling.continuous import prompt_entries, slot_count

    counts = np.full(len(prompt_lengths), samples)
    plan = make_plan(np.asarray(prompt_lengths), counts, 1)
    useful = int(np.sum(lengths))
    out = []
    # a slot option above the samples' bucket gives the same slots as a smaller one, and caps that give the same
    # entries the same cache: replay each (slots, entries) once, listing every cap that gives it in entry_caps
    for slots in dict.fromkeys(slot_count(max_slots, plan.num_rows) for max_slots in slot_options):
        caps_of: dict[int, list[int]] = {}
        for cap in entry_caps:
            caps_of.setdefault(prompt_entries(len(counts), slots, plan.prompts_per_prefill, cap), []).append(cap)
        for entries, caps in caps_of.items():
            iterations = replay_slots(lengths, counts, slots, plan.prompts_per_prefill, entries)
            out.append(dict(slots=slots, entry_cap=caps[0], entry_caps=caps, entries=entries,
                            prefill_chunk=plan.prompts_per_prefill, iterations=iterations,
                            slot_steps=iterations * slots, occupancy=occupancy(useful, iterations * slots)))
    return out


def load_workload(problems: int):
    """(config, params, tokenizer, prompt id lists) of the first `problems` gsm8k-100 problems."""
    from jaxrl_llm import data
    from jaxrl_llm.models import load_bundled

    config, params, tokenizer = load_bundled("float32")
    records = data.load_records("gsm8k-100")[:problems]
    kept, _ = data.build_prompts(records, tokenizer, "reasoning")
    return config, params, tokenizer, [r["prompt_ids"] for r in kept]


ENGINES = ("static", "continuous")


def parse_engines(text: str) -> list[str]:
    """"static,continuous" -> ["static", "continuous"]: our engines to run, each once, in this order."""
    engines = [e.strip() for e in text.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if not engines or unknown or len(set(engines)) != len(engines):
        raise ValueError(f"--engines takes distinct names from {ENGINES}, comma-separated; got {text!r}")
    return engines


def same_tokens(a, b) -> bool:
    """Two rollouts of the same rows hold the same generated tokens (and lengths and finish reasons)."""
    return (np.array_equal(a.lengths, b.lengths) and np.array_equal(a.finish_reason, b.finish_reason)
            and np.array_equal(a.tokens * a.mask.astype(bool), b.tokens * b.mask.astype(bool)))


def first_difference(a, b) -> tuple[int, int] | None:
    """(row, token) of the first generated token where two rollouts of the same rows differ (a row that ends
    in one and goes on in the other differs at the end of the shorter), None when `same_tokens`."""
    width = a.tokens.shape[1]
    live_a = np.arange(width)[None] < a.lengths[:, None]
    live_b = np.arange(width)[None] < b.lengths[:, None]
    differs = (live_a != live_b) | (live_a & (a.tokens != b.tokens))
    if not differs.any():
        return None
    row, token = np.argwhere(differs)[0]
    return int(row), int(token)


def sampler_name(engine: str) -> str:
    return "jaxrl_llm" if engine == "static" else f"jaxrl_llm {engine}"


def progress(sampler: str, run: int, repeats: int, call: int, calls: int, start: float) -> None:
    """One line per finished call of a timed run, so a run of many minutes shows where it is."""
    print(f"  {sampler}: run {run + 1} of {repeats}, call {call + 1} of {calls} done, "
          f"{time.perf_counter() - start:.0f} s into the run", flush=True)


def row_prompts(prompts: list[list[int]], samples: int) -> list[list[int]]:
    """One prompt per output row, ordered by prompt then sample (the trainer's order)."""
    return [p for p in prompts for _ in range(samples)]


def run_ours(params, config, tokenizer, prompts, samples, new_tokens, rows, repeats, engine="static") -> dict:
    """One engine of ours on the workload -> its `summary`, plus "rollout" (the last timed run's) and the
    compilations inside the timed runs. static: `rows` rows per call; continuous: `rows` slots."""
    import jax
    import jax.monitoring

    from jaxrl_llm.sampling import decode, generate, prefill
    from jaxrl_llm.sampling.plan import plan_calls, stop_array

    stop = tokenizer.stop_ids
    pad = tokenizer.pad_token_id
    options = dict(max_rows_per_call=rows) if engine == "static" else dict(engine=engine, max_slots=rows)

    def once(seed):
        return generate(params, config, prompts, num_samples=samples, max_new_tokens=new_tokens, temperature=1.0,
                        top_p=1.0, top_k=0, stop_ids=stop, rng=jax.random.key(seed), pad_id=pad, return_stats=True,
                        **options)

    if engine == "static":
        # Warm-up: the first call's plan (the shapes every call shares), decoded for one token only
        # (max_new_tokens is a traced argument of the decode program).
        arrays = [np.asarray(p, np.int32) for p in prompts]
        lengths = np.array([len(p) for p in prompts])
        first = plan_calls(lengths, np.full(len(prompts), samples), new_tokens, max_rows_per_call=rows)[0].shapes
        state, logits = prefill(params, config, arrays, first, pad_id=pad)
        jax.block_until_ready(decode(params, config, state, logits, max_new_tokens=1, temperature=1.0, top_p=1.0,
                                     top_k=0, stop_ids=stop_array(stop, config.vocab_size), rng=jax.random.key(0),
                                     pad_id=pad))
    else:
        # Warm-up: the whole workload's call, every sample cut to one token. The slot loop's shapes (prompt
        # cache, queue, slots, new-token bucket) follow every row and --max-new-tokens, but its
        # max_new_tokens is a traced argument, so this compiles the timed runs' program in a fraction of
        # their time (the timed runs' compilations are counted below: none).
        from jaxrl_llm.sampling import continuous

        slot_loop = continuous.decode_slots
        max_new_tokens_arg = list(inspect.signature(slot_loop).parameters).index("max_new_tokens")

        def one_token(*args, **kwargs):
            return slot_loop(*args[:max_new_tokens_arg], jax.numpy.int32(1), *args[max_new_tokens_arg + 1:],
                             **kwargs)

        continuous.decode_slots = one_token
        try:
            once(0)
        finally:
            continuous.decode_slots = slot_loop
    compiles = []  # XLA compilations inside the timed runs: none if the warm-up covered every shape

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    seconds = []
    for r in range(repeats):
        print(f"  {sampler_name(engine)}: run {r + 1} of {repeats} started (one `generate` call; it prints when done)",
              flush=True)
        start = time.perf_counter()
        rollout, stats = once(r + 1)
        seconds.append(time.perf_counter() - start)
        progress(sampler_name(engine), r, repeats, 0, 1, start)
    jax.monitoring.unregister_event_duration_listener(listener)
    useful = np.asarray(rollout.lengths, np.int64)  # a stop token is part of the response
    num_rows = len(useful)
    if engine == "static":
        call_rows = plan_calls([1], [num_rows], 1, max_rows_per_call=rows)[0].shapes.row_bucket
        runs = batches(num_rows, rows)
        result = summary(sampler_name(engine), useful, [useful[a:b] for a, b in runs], [call_rows] * len(runs),
                         seconds)
    else:
        result = summary(sampler_name(engine), useful, [useful], [stats.slots], seconds,
                         decoded_slot_steps=stats.slot_steps)
        result.update(slots=stats.slots, iterations=stats.iterations)
    return dict(result, engine=engine, compiles_in_timed_runs=len(compiles), rollout=rollout,
                generate_slot_steps=stats.slot_steps)


def run_tunix(sampler, tokenizer, prompts, samples, new_tokens, rows, repeats) -> dict:
    import jax

    strings = [" ".join(map(str, p)) for p in row_prompts(prompts, samples)]
    max_prompt = max(len(p) for p in prompts)
    runs = batches(len(strings), rows)

    def call(batch, seed, r, index, start):
        out = sampler(batch + [batch[-1]] * (rows - len(batch)), max_generation_steps=new_tokens,
                      max_prompt_length=max_prompt, temperature=1.0, top_p=1.0, eos_tokens=list(tokenizer.stop_ids),
                      seed=seed)
        jax.block_until_ready(out.tokens)
        if index >= 0:
            progress("tunix", r, repeats, index, len(runs), start)
        return lengths_before_stop([len(t) for t in out.tokens], new_tokens)

    call(strings[:rows], 0, 0, -1, time.perf_counter())  # warm-up: compiles the one shape of every call
    seconds = []
    for r in range(repeats):
        start = time.perf_counter()
        call_lengths = [call(strings[a:b], (r + 1) * 100_003 + a, r, i, start) for i, (a, b) in enumerate(runs)]
        seconds.append(time.perf_counter() - start)
    useful = np.concatenate([lengths[:b - a] for lengths, (a, b) in zip(call_lengths, runs)])
    return summary("tunix", useful, call_lengths, [rows] * len(runs), seconds)


def run_transformers(model, tokenizer, prompts, samples, new_tokens, rows, repeats) -> dict:
    import torch

    pad = tokenizer.pad_token_id
    stop = list(tokenizer.stop_ids)
    row_ids = row_prompts(prompts, samples)
    runs = batches(len(row_ids), rows)

    def call(batch, r, index, start):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in batch], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], dtype=torch.long)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                                 max_new_tokens=new_tokens, eos_token_id=stop, pad_token_id=pad, use_cache=True)
        progress("transformers", r, repeats, index, len(runs), start)
        return useful_lengths(out[:, width:].numpy(), stop)

    seconds = []
    for r in range(repeats):  # eager torch: nothing to compile
        torch.manual_seed(r + 1)
        start = time.perf_counter()
        call_lengths = [call(row_ids[a:b], r, i, start) for i, (a, b) in enumerate(runs)]
        seconds.append(time.perf_counter() - start)
    useful = np.concatenate(call_lengths)
    return summary("transformers", useful, call_lengths, [b - a for a, b in runs], seconds)


def parse_ints(text: str, flag: str, minimum: int) -> list[int]:
    """"64,128" -> [64, 128]; every value an int >= minimum."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < minimum:
        raise ValueError(f"{flag} takes comma-separated ints >= {minimum}; got {text!r}")
    return values


def print_replay(replayed: list[dict]) -> None:
    print()
    print("Continuous engine replayed on these lengths (`replay_slots`: slot-steps follow from when samples end):")
    print("| slots | max_prompt_entries | entries (prefill chunk c) | iterations | slot-steps | occupancy |")
    print("|---|---|---|---|---|---|")
    for r in replayed:
        cap = " or ".join(str(c or "default") for c in r.get("entry_caps", [r["entry_cap"]]))
        print(f"| {r['slots']} | {cap} | {r['entries']} ({r['prefill_chunk']}) | {r['iterations']} | "
              f"{r['slot_steps']} | {r['occupancy']:.1%} |")


def replay_file(path: str, slot_options: list[int], caps: list[int]) -> None:
    """`--replay`: the replay table for an earlier run's lengths, checked against its measured continuous run."""
    with open(path) as f:
        run = json.load(f)
    if not run.get("lengths"):
        raise SystemExit(f"{path} has no 'lengths' (written by --json since the replay was added)")
    engine, lengths = next(iter(run["lengths"].items()))
    print(f"{path}: {len(lengths)} samples ({run['samples']} per prompt, {len(run['prompt_lengths'])} prompts), "
          f"lengths of the {engine} engine, {sum(lengths)} useful tokens")
    measured = [r for r in run["results"] if r.get("engine") == "continuous"]
    if measured:
        slots, iterations = measured[0]["slots"], measured[0]["iterations"]
        replay = replay_occupancy(lengths, run["samples"], run["prompt_lengths"], [slots], [0])[0]
        print(f"measured continuous run: {slots} slots, {iterations} iterations; replayed: {replay['iterations']} "
              f"({'equal' if replay['iterations'] == iterations else 'DIFFERENT'})")
    print_replay(replay_occupancy(lengths, run["samples"], run["prompt_lengths"], slot_options, caps))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", type=int, default=100, help="first N gsm8k-100 problems")
    parser.add_argument("--samples", type=int, default=8, help="samples per problem")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--rows", type=int, default=64, help="rows decoding at once (also measure 128)")
    parser.add_argument("--engines", default="static,continuous",
                        help="our engines, comma-separated: static (rows per call) and/or continuous (rows = slots)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per sampler (median reported)")
    parser.add_argument("--skip-peers", action="store_true")
    parser.add_argument("--json", default=None, help="write every figure to this file")
    parser.add_argument("--replay-slots", default="64,128",
                        help="slot counts for the continuous engine's replayed occupancy (comma-separated)")
    parser.add_argument("--replay-caps", default="0,16,8",
                        help="sampling.max_prompt_entries values to replay (0: the engine's default)")
    parser.add_argument("--replay", default=None, metavar="JSON",
                        help="sample nothing: replay the continuous engine on the lengths of an earlier --json")
    args = parser.parse_args()
    try:
        engines = parse_engines(args.engines)
        replay_slots_, replay_caps = (parse_ints(args.replay_slots, "--replay-slots", 1),
                                      parse_ints(args.replay_caps, "--replay-caps", 0))
    except ValueError as error:
        parser.error(str(error))
    if args.replay:
        replay_file(args.replay, replay_slots_, replay_caps)
        return

    import jax

    bench = _sampling_bench()
    config, params, tokenizer, prompts = load_workload(args.problems)
    roof = bench.machine_roofline(*bench.weight_size(params))
    prompt_lengths = [len(p) for p in prompts]
    load_before = os.getloadavg()
    print(f"SmolLM2-135M f32, {len(prompts)} gsm8k-100 problems (reasoning prompt, {min(prompt_lengths)}-"
          f"{max(prompt_lengths)} tokens) x {args.samples} samples, up to {args.max_new_tokens} new tokens, "
          f"T=1, stop ids {list(tokenizer.stop_ids)}, {args.rows} rows at once; measured "
          f"{roof['flops'] / 1e9:.0f} GFLOP/s f32 matmul, {roof['bandwidth'] / 1e9:.1f} GB/s read; "
          f"load {load_before[0]:.1f} on {os.cpu_count()} cores", flush=True)

    shape = (prompts, args.samples, args.max_new_tokens, args.rows, args.repeats)
    results, rollouts = [], {}
    for engine in engines:
        result = run_ours(params, config, tokenizer, *shape, engine=engine)
        rollouts[engine] = result.pop("rollout")
        results.append(result)
        print(f"{result['sampler']} done: {result['useful_tok_s']:.1f} useful tok/s, occupancy "
              f"{result['occupancy']:.1%} ({result['slot_steps']} slot-steps; generate's SlotStats: "
              f"{result['generate_slot_steps']}), {result['compiles_in_timed_runs']} compilations in the timed runs",
              flush=True)
    tokens_agree, difference = None, None
    if len(rollouts) == 2:
        static, continuous = rollouts["static"], rollouts["continuous"]
        tokens_agree = same_tokens(static, continuous)
        difference = first_difference(static, continuous)
        print(f"continuous engine's tokens equal the static engine's on all {len(static.lengths)} rows "
              f"(same seed): {tokens_agree}", flush=True)
        if difference is not None:  # expected only when the slots are not the static call's row bucket
            row, token = difference
            gap = float(np.abs(static.logprobs[row, :token] - continuous.logprobs[row, :token]).max(initial=0.0))
            print(f"  first difference: row {row}, token {token} ({static.tokens[row, token]} against "
                  f"{continuous.tokens[row, token]}); largest log-prob gap before it {gap:.1e} (f32 rounds a "
                  f"batch of {args.rows} slots differently from the static calls' power-of-two row bucket: a draw "
                  f"near a CDF boundary can flip)", flush=True)
    if not args.skip_peers:
        max_prompt = max(prompt_lengths)
        sampler = bench.build_tunix(config, params, cache_size=max_prompt + args.max_new_tokens + 8)
        probe = prompts[0][:bench.PROMPT_LENGTH]
        print("tunix greedy agrees with jaxrl_llm:", bench.check_tunix_greedy(sampler, config, params, probe),
              flush=True)
        results.append(run_tunix(sampler, tokenizer, *shape))
        print(f"tunix done: {results[-1]['useful_tok_s']:.1f} useful tok/s", flush=True)
        model = bench.load_transformers(config, params)
        results.append(run_transformers(model, tokenizer, *shape))
        print(f"transformers done: {results[-1]['useful_tok_s']:.1f} useful tok/s", flush=True)
    load_after = os.getloadavg()

    ours = {r["engine"]: r["useful_tok_s"] for r in results if "engine" in r}
    print()
    print("| sampler | rows at once | calls | useful tokens | mean / max length | wall s | useful tok/s | "
          "slot-steps | occupancy | " + " | ".join(f"{sampler_name(e)} / this" for e in ours) + " |")
    print("|---|---|---|---|---|---|---|---|---|" + "---|" * len(ours))
    for r in results:
        print(f"| {r['sampler']} | {args.rows} | {r['calls']} | {r['useful_tokens']} | {r['mean_length']:.1f} / "
              f"{r['max_length']} | {r['seconds']:.2f} | {r['useful_tok_s']:.1f} | {r['slot_steps']} | "
              f"{r['occupancy']:.1%} | " + " | ".join(f"{tok_s / r['useful_tok_s']:.2f}x" for tok_s in ours.values())
              + " |")
    print(f"| roofline (large batch) | | | | | | {roof['large_batch_tok_s']:.0f} | | | "
          + " | ".join(f"at {tok_s / roof['large_batch_tok_s']:.0%} of it" for tok_s in ours.values()) + " |")
    if len(ours) == 2:
        occupancy = {r["engine"]: r["occupancy"] for r in results if "engine" in r}
        print(f"continuous / static: {ours['continuous'] / ours['static']:.2f}x useful tok/s, occupancy "
              f"{occupancy['continuous']:.1%} against {occupancy['static']:.1%}; same tokens: {tokens_agree}")
    print(f"load average (1 min) {load_before[0]:.1f} before, {load_after[0]:.1f} after ({os.cpu_count()} cores)")
    replayed = []
    if rollouts:
        lengths = np.asarray(next(iter(rollouts.values())).lengths)
        replayed = replay_occupancy(lengths, args.samples, prompt_lengths, replay_slots_, replay_caps)
        print_replay(replayed)
    if args.json:
        out = dict(vars(args), roofline=roof, load_before=load_before, load_after=load_after, cpus=os.cpu_count(),
                   jax=jax.__version__, prompt_lengths=prompt_lengths, results=results,
                   continuous_tokens_equal_static=tokens_agree, first_difference=difference,
                   lengths={engine: np.asarray(r.lengths).tolist() for engine, r in rollouts.items()},
                   replayed=replayed)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
