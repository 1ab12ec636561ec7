"""Train-step time and peak host memory of LoRA against full fine-tuning on the bundled SmolLM2-135M, with
the demo's update workload: 8 prompts x 8 samples per step, one micro-batch of 8 packed rows (a prompt and
its 8 responses each), layer remat "full", GRPO's clipped loss, AdamW.

    .venv/bin/python benchmarks/lora.py [--rank 16] [--targets all] [--prompt-len 128] [--new-tokens 24]
        [--repeats 3] [--base-dtype float32|bfloat16|int8|int4] [--remat-logits]

Each mode runs in a fresh process (peak RSS only grows within one): it loads the policy as a run does
(`run.setup.load_policy`), builds the train state (full: parameters + AdamW moments of every weight; LoRA:
the frozen base + adapters + their moments), compiles the step and times `repeats` steps after one untimed.
LoRA's step also merges the adapters into the weights once, as a run does before sampling (timed apart).
Reported per mode: the median step seconds, the merge seconds (LoRA), resident memory after loading and the
process's peak RSS (`ru_maxrss`), also as read after loading and after the merge, to tell where the peak is.
`--remat-logits` turns on `model.remat_logits` in both modes (the backward pass recomputes each vocabulary
chunk's logits instead of keeping them). `--sampling` (LoRA only, after the peak is read) also times one demo-sized
`generate` (8 prompts x 8 samples, `--new-tokens`) from the merged weights against adapters applied on the fly.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import numpy as np


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2 ** 20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def demo_batch(config, prompt_len: int, new_tokens: int, prompts: int = 8, samples: int = 8, seed: int = 0):
    """A packed TrainBatch of `prompts` random prompts, each row one prompt and its `samples` responses."""
    from jaxrl_llm.train.packing import pack_groups

    rng = np.random.default_rng(seed)
    prompt_ids = [rng.integers(1, config.vocab_size, size=prompt_len).tolist() for _ in range(prompts)]
    responses = rng.integers(1, config.vocab_size, size=(prompts * samples, new_tokens)).astype(np.int32)
    lengths = np.full(prompts * samples, new_tokens)
    members = [np.arange(samples * g, samples * (g + 1)) for g in range(prompts)]
    mask = np.ones((prompts * samples, new_tokens), np.float32)
    adv = rng.choice([-1.0, 1.0], size=(prompts * samples, 1)).astype(np.float32) * mask
    old = -3.0 * mask
    batch = pack_groups(prompt_ids, members, responses, lengths, advantages=adv, old_logp=old, ref_logp=old)
    return batch, float(mask.sum())


def measure(mode: str, args) -> dict:
    import jax

    from jaxrl_llm.models import lora
    from jaxrl_llm.run.config import AlgorithmSection, OptimSection
    from jaxrl_llm.run.setup import load_policy, map_large_host_allocations
    from jaxrl_llm.run.state import init_state, make_optimizer
    from jaxrl_llm.train.step import make_train_step

    map_large_host_allocations()  # as a run does
    quantized = mode == "lora" and args.base_dtype in ("int8", "int4")
    base_dtype = "float32" if mode == "full" or quantized else args.base_dtype
    config, params, _ = load_policy("bundled", param_dtype=base_dtype, remat=True, remat_logits=args.remat_logits)
    if quantized:  # as a run with lora.base_dtype does: the projections become codes + scales
        from jaxrl_llm.models.quant import quantize_base

        params = jax.jit(quantize_base, static_argnums=1)(params, args.base_dtype)
    loaded = rss_mb()
    algo, optimizer = AlgorithmSection(), make_optimizer(OptimSection())
    batch, denom = demo_batch(config, args.prompt_len, args.new_tokens)
    batch = jax.device_put(batch)
    out = {"mode": mode, "rss_after_load_mb": loaded, "peak_after_load_mb": peak_rss_mb()}
    if mode == "full":
        state = init_state(params, optimizer)
        step = make_train_step(config, algo, optimizer, micro_batch_size=8)
    else:
        spec = lora.LoraSpec(rank=args.rank, alpha=2.0 * args.rank, targets=lora.resolve_targets(args.targets))
        state = init_state(lora.init_adapters(config, spec, jax.random.PRNGKey(0)), optimizer)
        step = make_train_step(config, algo, optimizer, micro_batch_size=8, frozen=params, lora_scale=spec.scale)
        merge = jax.jit(lambda base, adapters: lora.merge(base, adapters, spec.scale))
        jax.block_until_ready(merge(params, state.params))
        start = time.perf_counter()
        merged = jax.block_until_ready(merge(params, state.params))
        out["merge_s"] = time.perf_counter() - start
        out["peak_after_merge_mb"] = peak_rss_mb()
        del merged
        out["trained_params"] = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    times = []
    for i in range(args.repeats + 1):
        start = time.perf_counter()
        state, metrics = step(state, batch, np.float32(denom))
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    out.update(step_s=statistics.median(times[1:]), first_step_s=times[0], peak_rss_mb=peak_rss_mb(),
               loss=float(metrics["loss"]), rows=int(batch.tokens.shape[0]), row_tokens=int(batch.tokens.shape[1]))
    if mode == "lora" and args.sampling:
        out.update(sampling_seconds(config, params, state.params, spec, args))
    return out


def sampling_seconds(config, base, adapters, spec, args) -> dict:
    """Median seconds of one demo-sized `generate` (after a compiling call) from merged weights and from
    the base with the adapters applied on the fly (x W + (x A)(s B) in every projection)."""
    import jax

    from jaxrl_llm.models import lora
    from jaxrl_llm.sampling import generate

    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, config.vocab_size, size=args.prompt_len).tolist() for _ in range(8)]
    trained = jax.tree_util.tree_map(lambda x: x + 0.01, adapters)  # B != 0, as after training
    out = {}
    for name, params in (("sample_merged_s", lora.merge(base, trained, spec.scale)),
                         ("sample_on_the_fly_s", lora.attach(base, trained, spec.scale))):
        def once():
            jax.block_until_ready(generate(params, config, prompts, num_samples=8, max_new_tokens=args.new_tokens,
                                           temperature=1.0, rng=jax.random.key(0)).tokens)
        once()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            once()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="all")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--base-dtype", default="float32", choices=["float32", "bfloat16", "int8", "int4"],
                        help="LoRA's frozen base: a parameter dtype or quantized codes (lora.base_dtype)")
    parser.add_argument("--remat-logits", action="store_true", help="model.remat_logits on, in both modes")
    parser.add_argument("--sampling", action="store_true", help="also time sampling: merged vs on the fly")
    parser.add_argument("--mode", choices=["full", "lora"], help="measure one mode in this process")
    args = parser.parse_args()
    if args.mode:
        print("RESULT", json.dumps(measure(args.mode, args)), flush=True)
        return
    results = {}
    for mode in ("full", "lora"):
        proc = subprocess.run([sys.executable, __file__, "--mode", mode, *sys.argv[1:]], capture_output=True,
                              text=True, check=True)
        results[mode] = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
        print(json.dumps(results[mode]), flush=True)
    full, low = results["full"], results["lora"]
    print(f"LoRA rank {args.rank} ({args.targets}) / full: step time {low['step_s'] / full['step_s']:.2f}x, "
          f"peak RSS {low['peak_rss_mb'] / full['peak_rss_mb']:.2f}x "
          f"({low['peak_rss_mb']:.0f} / {full['peak_rss_mb']:.0f} MB); merge {low['merge_s'] * 1e3:.0f} ms")
    if args.sampling:
        print(f"sampling: merged {low['sample_merged_s']:.2f} s, adapters on the fly {low['sample_on_the_fly_s']:.2f} s")


if __name__ == "__main__":
    main()
