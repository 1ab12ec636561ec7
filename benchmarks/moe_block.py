"""The mixture-of-experts block on a CPU: the grouped matmuls of `models.moe.expert_mlp` against the dense reference
and transformers' own MoE block, at one real layer's shape, in one run.

    .venv/bin/python benchmarks/moe_block.py [--tokens 128] [--repeats 5] [--json benchmarks/results/moe_block.json]

The shape is one sparse layer of Qwen3-30B-A3B (hidden 2048, 128 experts of width 768, 8 per token, weights
renormalised over them), float32, on `--tokens` tokens (a decode step of that many rows, or a short prefill).
Variants, all given the same router and expert weights and the same tokens:

- tiles: `moe_block` with moe_impl "tiles" (what "auto" compiles to on a CPU): each expert's rows padded to tiles,
  a scan over the tiles;
- ragged_dot: moe_impl "ragged_dot" (`jax.lax.ragged_dot`, what "auto" compiles to on a TPU or GPU), which XLA's
  CPU backend expands to a masked dense product over every expert;
- dense: every token through every expert (`expert_mlp_dense`, the tests' reference);
- transformers: `Qwen3MoeSparseMoeBlock` of transformers (torch CPU) with the experts implementation a model of
  it gets by default, "grouped_mm" (`torch._grouped_mm` over the tokens sorted by expert), and with "eager" (a
  Python loop over the experts that received tokens).

Each variant is run once (JAX's compiled), then `--repeats` rounds time every variant in turn (drift in the
machine's speed hits all alike); the fastest round of each is reported (the machine is shared: single calls of
every variant were seen to take 20-30x their fastest), with the medians, every round, the ratio of every variant
to tiles, the FLOPs each must do (grouped: the routed tokens only; dense and ragged_dot on a CPU: every expert),
and the largest difference of each output from the dense reference.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

HIDDEN, WIDTH, EXPERTS, TOP_K = 2048, 768, 128, 8  # Qwen/Qwen3-30B-A3B's config.json


def _config():
    from jaxrl_llm.models import ModelConfig

    return ModelConfig(vocab_size=8, hidden_size=HIDDEN, intermediate_size=6144, num_layers=1, num_heads=32,
                       num_kv_heads=4, head_dim=128, model_type="qwen3_moe", qk_norm=True, num_experts=EXPERTS,
                       num_experts_per_tok=TOP_K, moe_intermediate_size=WIDTH, norm_topk_prob=True)


def _layer(seed: int = 0) -> dict:
    """Router and experts drawn as transformers initialises them (N(0, 0.02^2)), [in, out] as the model stores them."""
    rng = np.random.default_rng(seed)
    draw = lambda *shape: (0.02 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    return {"router": draw(HIDDEN, EXPERTS), "expert_gate": draw(EXPERTS, HIDDEN, WIDTH),
            "expert_up": draw(EXPERTS, HIDDEN, WIDTH), "expert_down": draw(EXPERTS, WIDTH, HIDDEN)}


def _jax_variants(config) -> dict:
    from jaxrl_llm.models.moe import expert_mlp_dense, layer_experts, moe_block, route

    def dense(lp, h):
        routing = route(h, lp["router"], top_k=TOP_K, normalize=True)
        return expert_mlp_dense(h, routing, layer_experts(lp, config, h.dtype))

    return {"tiles": jax.jit(lambda lp, h: moe_block(lp, config.replace(moe_impl="tiles"), h)),
            "ragged_dot": jax.jit(lambda lp, h: moe_block(lp, config.replace(moe_impl="ragged_dot"), h)),
            "dense": jax.jit(dense)}


def _torch_block(layer: dict, implementation: str, like=None):
    """transformers' Qwen3MoeSparseMoeBlock holding `layer`'s weights ([E, 2F, D] gate_up rows gate first, [E, D, F]
    down, router [E, D]), or sharing the weights of block `like` (one copy of the 2.4 GB of experts)."""
    import torch
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=WIDTH, num_experts=EXPERTS,
                                     num_experts_per_tok=TOP_K, norm_topk_prob=True)
    hf._experts_implementation = implementation
    block = Qwen3MoeSparseMoeBlock(hf).eval()
    if like is not None:
        block.load_state_dict(like.state_dict(), assign=True)
        return block, hf._experts_implementation
    with torch.no_grad():
        block.gate.weight.copy_(torch.from_numpy(layer["router"].T.copy()))
        gate_up = np.concatenate([layer["expert_gate"], layer["expert_up"]], axis=-1).transpose(0, 2, 1)
        block.experts.gate_up_proj.copy_(torch.from_numpy(np.ascontiguousarray(gate_up)))
        block.experts.down_proj.copy_(torch.from_numpy(np.ascontiguousarray(layer["expert_down"].transpose(0, 2, 1))))
    return block, hf._experts_implementation


def run(tokens: int, repeats: int) -> dict:
    import torch
    import transformers

    config = _config()
    layer = _layer()
    h = np.random.default_rng(1).standard_normal((tokens, HIDDEN)).astype(np.float32)
    blocks, like = {}, None
    for implementation in ("grouped_mm", "eager"):  # one copy of the weights, shared
        blocks[implementation] = like = _torch_block(layer, implementation, like and like[0])
    lp = {k: jnp.asarray(v) for k, v in layer.items()}
    del layer  # the weights live on in JAX's and torch's copies only (the machine has 23 GB)
    hj = jnp.asarray(h)
    fns = _jax_variants(config)
    calls, outputs, compile_s = {}, {}, {}
    for name, fn in fns.items():
        start = time.perf_counter()
        outputs[name] = np.asarray(fn(lp, hj).block_until_ready())
        compile_s[name] = time.perf_counter() - start
        calls[name] = lambda fn=fn: fn(lp, hj).block_until_ready()
    torch_impls = {}
    for implementation, (block, used) in blocks.items():
        name = f"transformers_{implementation}"
        ht = torch.from_numpy(h)[None]
        with torch.no_grad():
            outputs[name] = block(ht).numpy()[0]
        torch_impls[name] = used

        def call(block=block, ht=ht):
            with torch.no_grad():
                block(ht)
        calls[name] = call
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    seconds = {name: min(t) for name, t in times.items()}
    grouped = 2 * 3 * tokens * TOP_K * HIDDEN * WIDTH
    flops = {"tiles": grouped, "ragged_dot": 2 * 3 * tokens * TOP_K * EXPERTS * HIDDEN * WIDTH,
             "dense": 2 * 3 * tokens * EXPERTS * HIDDEN * WIDTH, "transformers_grouped_mm": grouped,
             "transformers_eager": grouped}
    reference = outputs["dense"]
    return {
        "shape": {"tokens": tokens, "hidden": HIDDEN, "expert_width": WIDTH, "experts": EXPERTS, "top_k": TOP_K,
                  "dtype": "float32", "model": "Qwen/Qwen3-30B-A3B (one sparse layer)"},
        "seconds": seconds,
        "median_seconds": {name: statistics.median(t) for name, t in times.items()},
        "all_seconds": times,
        "compile_seconds": compile_s,
        "ratio_to_tiles": {name: seconds[name] / seconds["tiles"] for name in seconds},
        "tiles_speedup_over": {name: seconds[name] / seconds["tiles"] for name in seconds if name != "tiles"},
        "flops": flops,
        "gflops_per_s": {name: flops[name] / seconds[name] / 1e9 for name in seconds},
        "max_abs_diff_from_dense": {name: float(np.abs(out - reference).max()) for name, out in outputs.items()},
        "output_scale": float(np.abs(reference).max()),
        "transformers_experts_implementation": torch_impls,
        "versions": {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "torch_threads": torch.get_num_threads(),
    }


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    result = run(args.tokens, args.repeats)
    result["load_average_before_after"] = [load_before, os.getloadavg()]  # 1/5/15-minute: the machine is shared
    result.update(date=datetime.date.today().isoformat(), commit=_commit(), machine=f"{os.cpu_count()}-core "
                  f"{platform.processor() or platform.machine()}, {jax.devices()[0].device_kind}",
                  command="python benchmarks/moe_block.py " + " ".join(argv if argv is not None else
                                                                       __import__("sys").argv[1:]))
    print(json.dumps({k: result[k] for k in ("seconds", "ratio_to_tiles", "gflops_per_s",
                                             "max_abs_diff_from_dense")}, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
