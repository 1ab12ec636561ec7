"""A predicted GPU step time from the compiled program alone, checked against the one GPU we measured.

    python benchmarks/gpu_model.py [--out benchmarks/results/gpu_model.json]   # about 3 minutes on 2 CPU cores

Each train step of benchmarks/gpu.py's train part is compiled here for one H200 (no GPU needed: the gpu-compile
extra) exactly as that part builds it (the Qwen2.5-1.5B shape, f32 weights and AdamW, bf16 compute, full remat,
one packed row per micro-batch, `train.step.make_train_step` with the default algorithm), and its optimized HLO is
read kernel by kernel (`capacity.hlo_stats.kernel_costs`: times launched, matmul FLOPs, bytes). The model
(`capacity.gpu_targets.predict_seconds`) sums, per kernel, max(FLOPs / matmul ceiling, bytes / bandwidth) plus a launch
cost, with the H200's measured ceilings (508 TFLOP/s bf16, 2.79 TB/s: results/gpu_h200.json).

Its one free constant, the launch cost, is fitted on one measurement only: the packed XLA path's 28-layer step on
2 rows, 33.715 s on the H200 (results/gpu_h200.json, `train.ours_step_s`). Every other figure is a prediction:
- the four 4-layer variants measured on the same H200 the same day (`train_step_variants_4_layers` A-D: tiles of
  512 or 2048, packed or unpacked rows, tiles or none), which check the model on programs it was not fitted to;
- the default path now (`model.attention_impl=auto`: cuDNN on regrouped rows), against torch's measured 2.346 s.
The launch cost it fits is `gpu_targets.LAUNCH_SECONDS` (kept in step by tests/test_gpu_compile.py).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the compile-only GPU devices need no GPU here

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
MEASURED = HERE / "results" / "gpu_h200.json"


def compile_step(impl: str, *, layers: int = 28, rows: int = 2, samples: int = 8, block: int | None = 512):
    """(kernel costs, program stats, compile seconds) of benchmarks/gpu.py's train step for one H200."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from gpu import paper_batch, train_config
    from jaxrl_llm.capacity import aot
    from jaxrl_llm.capacity.hlo_stats import kernel_costs, program_stats
    from jaxrl_llm.models.layers import TILE_SCOPE
    from jaxrl_llm.models.model import init_params
    from jaxrl_llm.objectives import aggregate_denominator
    from jaxrl_llm.run.config import AlgorithmSection, OptimSection
    from jaxrl_llm.run.state import init_state, make_optimizer
    from jaxrl_llm.train.packing import pack_groups
    from jaxrl_llm.train.step import make_train_step

    prompt_len, resp_len = 1024, 3072
    config = train_config(False, block, prompt_len, layers).replace(attention_impl=impl)
    prompts, responses, lengths, groups, _, per_token = paper_batch(config, rows, prompt_len, resp_len, samples)
    batch = pack_groups(prompts, groups, responses, lengths, advantages=per_token,
                        old_logp=np.zeros((rows * samples, resp_len), np.float32))
    device = aot.topology_devices(aot.parse_topology("h200-1"))
    on_gpu = NamedSharding(Mesh(device, ("x",)), P())
    algo = AlgorithmSection()
    denom = float(aggregate_denominator(jnp.asarray(batch.mask.reshape(-1, batch.mask.shape[-1])), algo.agg))
    optimizer = make_optimizer(OptimSection())
    state = jax.eval_shape(lambda: init_state(init_params(config, jax.random.PRNGKey(0)), optimizer))

    def abstract(x):
        return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=on_gpu)

    step = make_train_step(config, algo, optimizer, micro_batch_size=1)
    start = time.perf_counter()
    compiled = step.lower(jax.tree_util.tree_map(abstract, state), jax.tree_util.tree_map(abstract, batch),
                          abstract(np.float32(denom))).compile()
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    needed = needed_tiles(batch.positions, batch.segments, config.attention_block_for(batch.tokens.shape[1]))
    return kernel_costs(text, {TILE_SCOPE: needed}), program_stats(text), seconds, needed


def needed_tiles(positions, segments, block: int | None) -> float:
    """The fraction of `layers.blocked_attention`'s query x key tiles it computes on these rows (its `cond` per
    tile: a tile some query of the block reads, or every real tile of a block holding a query that reads no key),
    over the micro-batches of one row each; 1.0 without tiles (no conditional)."""
    import numpy as np

    from jaxrl_llm.models.layers import attention_keep_mask

    if block is None:
        return 1.0
    computed = total = 0
    for pos, seg in zip(np.asarray(positions), np.asarray(segments)):
        length = len(pos)
        blocks = -(-length // block)
        for i in range(blocks):
            q = slice(i * block, min((i + 1) * block, length))
            keep = np.asarray(attention_keep_mask(pos[None, q], pos[None], q_segments=seg[None, q],
                                                  k_segments=seg[None]))[0]  # [queries of the block, keys]
            keep = np.pad(keep, [(0, 0), (0, blocks * block - length)])
            read = keep.reshape(keep.shape[0], blocks, block).any(axis=(0, 2))
            real = np.arange(blocks) * block < length
            every_tile = not keep.any(axis=1).all()  # a query of the block that reads no key
            computed += int(real.sum() if every_tile else (read & real).sum())
            total += blocks
    return computed / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "results" / "gpu_model.json"))
    args = parser.parse_args()

    from jaxrl_llm.capacity.gpu_targets import GPUS, LAUNCH_SECONDS, predict_seconds

    h200 = GPUS["h200"]
    measured = json.loads(MEASURED.read_text())
    cases = {  # name: (impl, layers, rows, samples, block, measured seconds or None, what was measured)
        "packed_xla_28_layers_2_rows": ("xla", 28, 2, 8, 512, measured["train"]["ours_step_s"], "fitted on"),
    }
    for key, variant in measured["train_step_variants_4_layers"].items():
        cases[f"variant_{key}"] = ("xla", variant["layers"], variant["rows"], variant["responses_per_row"],
                                   variant["attention_block_size"], variant["ours_step_s"], "predicted")
    cases["auto_28_layers_2_rows"] = ("auto", 28, 2, 8, 512, None, "predicted; torch measured "
                                      f"{measured['train']['torch_step_s']:.3f} s on these samples")
    rows = {}
    for name, (impl, layers, count, samples, block, seconds, role) in cases.items():
        costs, stats, compile_s, needed = compile_step(impl, layers=layers, rows=count, samples=samples, block=block)
        roofline = predict_seconds(costs, h200, launch_seconds=0.0)
        rows[name] = {"attention_impl": impl, "layers": layers, "rows": count, "responses_per_row": samples,
                      "attention_block_size": block, "role": role, "measured_s": seconds, "roofline_s": roofline,
                      "tiles_computed": needed, "kernels_executed": sum(t for t, _, _ in costs),
                      "kernels": stats.kernels, "conditionals": stats.conditionals,
                      "matmul_tflop": stats.matmul_flops / 1e12, "attention_kernel": stats.attention_kernel,
                      "compile_s": compile_s, "costs": costs}
        print(f"{name}: {stats.kernels:,} kernels (upper bound), {rows[name]['kernels_executed']:,.0f} executed "
              f"({needed:.3f} of the tiles), roofline {roofline:.3f} s, measured {seconds}", flush=True)
    fit = rows["packed_xla_28_layers_2_rows"]
    launch = (fit["measured_s"] - fit["roofline_s"]) / fit["kernels_executed"]
    for row in rows.values():
        row["predicted_s"] = predict_seconds(row.pop("costs"), h200, launch_seconds=launch)
        if row["measured_s"]:
            row["predicted_over_measured"] = row["predicted_s"] / row["measured_s"]
    auto = rows["auto_28_layers_2_rows"]
    result = {"gpu": "h200", "matmul_flops_s": h200.matmul_flops_s, "bandwidth_bytes_s": h200.bandwidth_bytes_s,
              "launch_seconds_fitted": launch, "launch_seconds_in_gpu_targets": LAUNCH_SECONDS,
              "torch_step_s": measured["train"]["torch_step_s"],
              "auto_predicted_vs_torch": measured["train"]["torch_step_s"] / auto["predicted_s"],
              "measured_in": str(MEASURED.relative_to(HERE.parent)), "date": time.strftime("%Y-%m-%d"),
              "programs": rows}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"launch cost fitted: {launch * 1e6:.2f} us per kernel (gpu_targets.LAUNCH_SECONDS "
          f"{LAUNCH_SECONDS * 1e6:.2f} us)")
    for name, row in rows.items():
        measured_s = f"{row['measured_s']:.3f} s" if row["measured_s"] else "-"
        print(f"  {name:<30} {row['kernels_executed']:>12,.0f} kernels  predicted {row['predicted_s']:8.3f} s  measured "
              f"{measured_s:>9}  ({row['role']})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
