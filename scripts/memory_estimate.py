"""Per-device memory of the paper-scale presets on a v4-32, a v5e-64 and 8 x H100, from the configs alone.

    python scripts/memory_estimate.py                                  # every configs/paper preset, all targets
    python scripts/memory_estimate.py configs/paper/qwen2.5-math-7b_grpo.yaml --target v5e-64 optim.lr=2e-6
    python scripts/memory_estimate.py --write docs/launch.md           # refresh both tables in the guide

For each preset and target the script picks the fsdp x tensor layout of least peak (one packed row per
device per micro-batch), lowers `sampling.max_rows_per_call` where the sampler's KV cache alone would not fit
in 85% of HBM, and prints the overrides that select them. The terms are those of
`jaxrl_llm.capacity.memory.estimate_memory` (see its module docstring); sizes are GiB per device.
The LoRA presets (configs/paper/lora/) get a second table: each on the smallest hardware of `LORA_LADDER`
where it fits (one 16 GiB accelerator, one 80 GB GPU, 8 of them).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from jaxrl_llm.capacity.chips import GIB, TARGETS
from jaxrl_llm.capacity.known_models import model_config_for
from jaxrl_llm.capacity.layouts import suggest_layout
from jaxrl_llm.train import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
START, END = "<!-- memory-table:start -->", "<!-- memory-table:end -->"
LORA_START, LORA_END = "<!-- lora-memory-table:start -->", "<!-- lora-memory-table:end -->"
PAPER_TARGETS = ("v4-32", "v5e-64", "8xH100")
LORA_LADDER = ("1x16GB", "1xH100", "8xH100")
_TRANSIENT = {"train_step": "train step", "critic_step": "critic step", "sampling": "sampling",
              "gvm_norms": "GVM norms"}


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def _largest_term(est: dict) -> str:
    phase = max(_TRANSIENT, key=lambda k: est[k])
    if phase == "train_step":
        parts = {"attention/activations": est["activations"], "log-prob residuals": est["logprob_residuals"],
                 "gradients": est["gradients"]}
        return f"train step: {max(parts, key=parts.get)}"
    if phase == "critic_step":
        return "critic step: its gradients and activations"
    if phase == "sampling":
        return f"sampling: KV cache of {est['sample_rows']} rows per call"
    return "GVM per-sample gradients"


HEADROOM = 0.85  # "fits": the estimated peak within 85% of HBM (XLA's temporaries are not all counted)


def rows_that_fit(est: dict, hbm_bytes: int) -> int:
    """Rows one sampler call could hold within HEADROOM of HBM beside the resident state (a multiple of the
    rows' device split): the largest `sampling.max_rows_per_call` whose KV cache would fit."""
    split = est["mesh"]["data"] * est["mesh"]["fsdp"]
    per_row = est["sampling"] // (est["sample_rows"] // split)
    free = int(HEADROOM * hbm_bytes) - est["params"] - est["optimizer"] - est["reference"] - est["critic"]
    return max(0, free // per_row) * split


_HEADER = ["| preset | target | overrides | params + AdamW + ref (+ critic) | train step | sampling (rows per call) "
           "| GVM norms | peak | HBM | fits | largest term | sampled rows per call that fit |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]


def _row(path: pathlib.Path, name: str, config, model_config) -> tuple[str, bool]:
    """One table row of `config` on target `name`, and whether it fits."""
    target = TARGETS[name]
    est, layout = suggest_layout(config, model_config, target.devices, int(HEADROOM * target.hbm_bytes),
                                 platform=target.platform)
    if target.devices == 1 and not config.train.mesh:
        layout.pop("train.mesh")  # one device needs no mesh (and a quantized base runs without one)
    resident = est["params"] + est["optimizer"] + est["reference"] + est["critic"]
    fits = est["peak"] <= HEADROOM * target.hbm_bytes
    chosen = " ".join(f"{key}={value}" for key, value in layout.items())
    return (f"| {path.stem} | {name} | `{chosen}` | {_gib(resident)} "
            f"| {_gib(est['train_step'])} | {_gib(est['sampling'])} ({est['sample_rows']}) "
            f"| {_gib(est['gvm_norms'])} | {_gib(est['peak'])} | {_gib(target.hbm_bytes)} | {'yes' if fits else 'no'} "
            f"| {_largest_term(est)} | {rows_that_fit(est, target.hbm_bytes)} |"), fits


def table(presets: list[pathlib.Path], targets: list[str], overrides: list[str]) -> str:
    lines = list(_HEADER)
    for path in presets:
        config = load_config(path, overrides)
        model_config = model_config_for(config.model.source)
        lines.extend(_row(path, name, config, model_config)[0] for name in targets)
    return "\n".join(lines)


def smallest_fit_table(presets: list[pathlib.Path], ladder=LORA_LADDER, overrides=()) -> str:
    """One row per preset: the first target of `ladder` it fits on (the last one when none fits)."""
    lines = list(_HEADER)
    for path in presets:
        config = load_config(path, list(overrides))
        model_config = model_config_for(config.model.source)
        for name in ladder:
            row, fits = _row(path, name, config, model_config)
            if fits:
                break
        lines.append(row)
    return "\n".join(lines)


def write_into(doc: pathlib.Path, text: str, start: str = START, end: str = END) -> None:
    """Replace the text between the `start` and `end` markers of `doc`."""
    body = doc.read_text()
    if start not in body or end not in body:
        raise ValueError(f"{doc} has no {start} ... {end} markers")
    head, _, rest = body.partition(start)
    _, _, tail = rest.partition(end)
    doc.write_text(f"{head}{start}\n{text}\n{end}{tail}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("args", nargs="*", metavar="PRESET.yaml | section.key=value",
                        help="presets (default: configs/paper/*.yaml) and overrides applied to each")
    parser.add_argument("--target", action="append", choices=sorted(TARGETS),
                        help=f"default: {', '.join(PAPER_TARGETS)}")
    parser.add_argument("--write", metavar="DOC", help="also replace the table between the markers of DOC")
    args = parser.parse_intermixed_args(argv)
    overrides = [a for a in args.args if "=" in a]
    named = [pathlib.Path(a) for a in args.args if "=" not in a]
    presets = named or sorted((ROOT / "configs/paper").glob("*.yaml"))
    text = table(presets, args.target or list(PAPER_TARGETS), overrides)
    print(text)
    if args.write:
        write_into(pathlib.Path(args.write), text)
    if not named:
        lora_text = smallest_fit_table(sorted((ROOT / "configs/paper/lora").glob("*.yaml")), overrides=overrides)
        print(f"\nLoRA presets, each on the smallest of {', '.join(LORA_LADDER)} that fits:\n{lora_text}")
        if args.write:
            write_into(pathlib.Path(args.write), lora_text, LORA_START, LORA_END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
