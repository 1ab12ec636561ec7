"""The TPU and GPU launch tables of docs/launch.md from the compiler: each preset compiled for the slice or GPU host
the memory table names for it (`jaxrl-llm compile`, one process per preset and slice), XLA's peak per chip beside
the chip's HBM and `estimate_memory`; for GPU hosts also what each program runs (attention kernel, kernels launched,
matmul FLOPs over the model's, the predicted seconds).

    python scripts/compile_table.py                         # the presets and slices of ROWS, printed
    python scripts/compile_table.py --write docs/launch.md  # and written between the compile-table markers
    python scripts/compile_table.py configs/models/gemma-3-4b-it.yaml --topology v5litepod-64
    python scripts/compile_table.py --reuse --write docs/launch.md       # compile only the rows without a JSON
    python scripts/compile_table.py --saved-only --write docs/launch.md  # no compiles: the saved rows, the rest listed
    python scripts/compile_table.py --gpu --reuse --write docs/launch.md # the GPU table (the gpu-compile extra)

Saved rows keep their compiled numbers and get their estimates from today's `estimate_memory`.

The overrides of each row are those `scripts/memory_estimate.py` picks for the slice (the layout of least
estimated peak); needs libtpu (`pip install 'jaxrl_llm[tpu]'`). Each compile runs in its own process and takes
minutes on a 2-core CPU; the JSON of every run is kept under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

from jaxrl_llm.capacity.aot import ProgramReport, refresh_estimates, usable_bytes
from jaxrl_llm.capacity.chips import GIB, TARGETS
from jaxrl_llm.capacity.gpu_targets import parse_gpu_topology
from jaxrl_llm.capacity.known_models import model_config_for
from jaxrl_llm.capacity.layouts import suggest_layout
from jaxrl_llm.train import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
START, END = "<!-- compile-table:start -->", "<!-- compile-table:end -->"
GPU_START, GPU_END = "<!-- gpu-compile-table:start -->", "<!-- gpu-compile-table:end -->"
HEADROOM = 0.85  # as scripts/memory_estimate.py: the layout is chosen to fit 85% of HBM
# (preset, slice as users name it, the memory table's target of the same chips): every preset on the TPU
# slices docs/launch.md and docs/models.md name for it (the 7B LoRA presets' target is a GPU: not compiled here)
PAPER = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs/paper").glob("*.yaml"))
MODELS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs/models").glob("*.yaml"))
# the mixtures of experts on the slices issue 57 names for them (v5p: 96 GiB chips), the other model presets on v5e-64
MOE_SLICES = {"configs/models/qwen3-30b-a3b_grpo.yaml": "v5p-64", "configs/models/gpt-oss-20b_grpo.yaml": "v5p-16"}
ROWS = ([(preset, "v5litepod-64", "v5e-64") for preset in PAPER] + [(preset, "v4-32", "v4-32") for preset in PAPER]
        + [(preset, "v5litepod-64", "v5e-64") for preset in MODELS if preset not in MOE_SLICES]
        + [(preset, MOE_SLICES[preset], MOE_SLICES[preset]) for preset in MODELS if preset in MOE_SLICES]
        + [(f"configs/paper/lora/qwen2.5-math-1.5b_{name}_lora.yaml", "v5litepod-1", "1x16GB")
           for name in ("grpo", "gvm_raftpp")])
# every paper preset on one host of 8 H100s with the memory table's 8xH100 layout (the gpu-compile extra)
GPU_ROWS = [(preset, "h100-8", "8xH100") for preset in PAPER]


def layout_overrides(preset: str, target: str) -> list[str]:
    config = load_config(ROOT / preset)
    _, layout = suggest_layout(config, model_config_for(config.model.source), TARGETS[target].devices,
                               int(HEADROOM * TARGETS[target].hbm_bytes), platform=TARGETS[target].platform)
    if TARGETS[target].devices == 1 and not config.train.mesh:
        layout.pop("train.mesh")  # one device needs no mesh (a quantized base runs without one), as the memory table
    return [f"{key}={value}" for key, value in layout.items()]


def compile_one(preset: str, topology: str, overrides: list[str], out: pathlib.Path) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "jaxrl_llm.cli", "compile", "--config", str(ROOT / preset), "--topology",
               topology, "--json", str(out), *overrides]
    print("$", " ".join(command[1:]), flush=True)
    done = subprocess.run(command, env={**os.environ, "JAX_PLATFORMS": "cpu"}, text=True, capture_output=True)
    # a failure's reason is on stderr: a program that does not fit (exit 1), a bad config (2), or a traceback (1)
    print(done.stdout, done.stderr[-2000:] if done.returncode else "", flush=True)
    if not out.exists():
        raise RuntimeError(f"compile of {preset} for {topology} failed (exit {done.returncode})")
    result = {**json.loads(out.read_text()), "overrides": overrides, "command": " ".join(command[1:])}
    out.write_text(json.dumps(result, indent=1))
    return result


def table(results: list[tuple[str, str, list[str], dict]]) -> str:
    lines = ["| preset | slice | overrides | program | compile s | XLA allots | XLA peak | + resident | usable | estimate "
             "| fits |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for preset, topology, overrides, result in results:
        hbm = usable_bytes(result)  # the chip's HBM the compiler lets a program use
        for p in result["programs"]:
            if p["error"]:
                lines.append(f"| {pathlib.Path(preset).stem} | {topology} | `{' '.join(overrides)}` | {p['name']} | "
                             f"{p['compile_s']:.0f} | does not compile: {p['error'][:80]} | | | {hbm / GIB:.2f} "
                             "| | no |")
                continue
            compiler = p.get("compiler_peak_bytes", 0)  # rows compiled before it was recorded: the allotment
            total = ProgramReport(**p).need_bytes + p["resident_bytes"]
            estimate = f"{p['estimate_bytes'] / GIB:.2f}" if p["estimate_bytes"] else "-"
            lines.append(f"| {pathlib.Path(preset).stem} | {topology} | `{' '.join(overrides)}` | {p['name']} | "
                         f"{p['compile_s']:.0f} | {p['peak_bytes'] / GIB:.2f} | "
                         f"{f'{compiler / GIB:.2f}' if compiler else '-'} | {total / GIB:.2f} | {hbm / GIB:.2f} "
                         f"| {estimate} | {'yes' if p['fits'] else 'no'} |")
    return "\n".join(lines)


def gpu_table(results: list[tuple[str, str, list[str], dict]]) -> str:
    lines = ["| preset | host | overrides | program | attention | kernels | matmul / model | predicted s | XLA peak "
             "| + resident | usable | estimate | fits |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for preset, topology, overrides, result in results:
        hbm = usable_bytes(result)
        for p in result["programs"]:
            head = f"| {pathlib.Path(preset).stem} | {topology} | `{' '.join(overrides)}` | {p['name']} |"
            if p["error"]:
                lines.append(f"{head} | | | | does not compile: {p['error'][:80]} | | {hbm / GIB:.2f} | | no |")
                continue
            ratio = f"{p['matmul_flops'] / p['model_flops']:.2f}" if p.get("model_flops") else "-"
            estimate = f"{p['estimate_bytes'] / GIB:.2f}" if p["estimate_bytes"] else "-"
            total = ProgramReport(**p).need_bytes + p["resident_bytes"]
            lines.append(f"{head} {p['attention_kernel']} | {p['kernels']:,} | {ratio} | {p['predicted_s']:.3g} | "
                         f"{ProgramReport(**p).need_bytes / GIB:.2f} | {total / GIB:.2f} | {hbm / GIB:.2f} | "
                         f"{estimate} | {'yes' if p['fits'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", nargs="?", help="one preset (default: every row of ROWS)")
    parser.add_argument("--topology", help="with a preset: the slice (v5litepod-64, v4-32, ...)")
    parser.add_argument("--target", help="with a preset: the memory table's target whose layout to take")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/compile"), help="folder of the JSON reports")
    parser.add_argument("--write", metavar="DOC", help="replace the table between the compile-table markers of DOC")
    parser.add_argument("--reuse", action="store_true",
                        help="take a row's JSON under --out where it exists (its estimates recomputed)")
    parser.add_argument("--gpu", action="store_true", help="the GPU table (GPU_ROWS) instead of the TPU one")
    parser.add_argument("--saved-only", action="store_true",
                        help="as --reuse, and list the rows without a JSON as not compiled instead of compiling them")
    args = parser.parse_args(argv)
    default = GPU_ROWS if args.gpu else ROWS
    rows = default if args.preset is None else [(args.preset, args.topology, args.target or args.topology)]
    results, failed, missing = [], [], []
    for preset, topology, target in rows:
        overrides = layout_overrides(preset, target) if target in TARGETS else []
        out = pathlib.Path(args.out) / f"{pathlib.Path(preset).stem}_{topology}.json"
        if (args.reuse or args.saved_only) and out.exists():
            result = json.loads(out.read_text())
            overrides = result.get("overrides", overrides)  # the layout it was compiled with
            # the compiled numbers as saved, the estimate from today's estimate_memory
            result = refresh_estimates(load_config(ROOT / preset, overrides), result)
            out.write_text(json.dumps(result, indent=1))
        elif args.saved_only:
            missing.append((preset, topology, overrides))
            continue
        else:
            try:
                result = compile_one(preset, topology, overrides, out)
            except RuntimeError as err:  # the process died (not a program over HBM: that is a row saying so)
                print(err, file=sys.stderr)
                failed.append(f"{preset} on {topology}")
                continue
        results.append((preset, topology, overrides, result))
    gpu = args.gpu or any(parse_gpu_topology(topology) for _, topology, _ in rows)
    text = (gpu_table if gpu else table)(results)
    if missing:
        text += "\n\nNot compiled yet (`python scripts/compile_table.py PRESET --topology SLICE --target TARGET`): " + \
            "; ".join(f"{pathlib.Path(preset).stem} on {topology} (`{' '.join(overrides)}`)"
                      for preset, topology, overrides in missing) + "."
    print(text)
    if args.write:
        sys.path.insert(0, str(ROOT / "scripts"))
        from memory_estimate import write_into

        write_into(pathlib.Path(args.write), text, *((GPU_START, GPU_END) if gpu else (START, END)))
    if failed:
        print("not compiled (see above): " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
