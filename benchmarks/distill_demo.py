"""On-policy distillation against GRPO on README's demo (issue 58, part 3): held-out accuracy against samples drawn,
from the runs' metrics.jsonl, into benchmarks/results/distill_demo.json.

The runs (configs/distill_demo.yaml; docs/distillation.md, "The demo"):

    grpo:    jaxrl-llm train --config configs/lora_demo.yaml              (README's demo; its final/ is the teacher)
    sampled: jaxrl-llm train --config configs/distill_demo.yaml train.out_dir=runs/distill_sampled
    topk:    jaxrl-llm train --config configs/distill_demo.yaml distill.mode=topk train.out_dir=runs/distill_topk
    topk_lr6e-4 (a variant, read when its folder is there):
             jaxrl-llm train --config configs/distill_demo.yaml distill.mode=topk optim.lr=6e-4 train.steps=6 \
                 train.out_dir=runs/distill_topk_lr6e-4

Every evaluation is avg@4 on the same 100 held-out problems with the same sampling seed. The teacher's accuracy is
the GRPO demo's last evaluation (the weights its final/ holds). A run reaches the teacher at its first evaluation
with accuracy >= teacher - sqrt(sd^2 + sd_teacher^2), each sd an evaluation's `eval_sampling_sd` (the noise of the
difference of two evaluations, as the demo's own report computes it); its samples_to_teacher is the samples drawn by
then, None if no evaluation of the run reached it.

    python benchmarks/distill_demo.py [--runs benchmarks/results/distill_demo_runs] [--json PATH]

`--runs` holds grpo/, sampled/ and topk/ (and the variants' folders), each a metrics.jsonl (the runs' own, copied).
Pure Python: no JAX.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "results" / "distill_demo_runs"
COMMAND = "python benchmarks/distill_demo.py --json benchmarks/results/distill_demo.json"
MODES = ("sampled", "topk")
VARIANTS = ("topk_lr6e-4",)  # distillation runs beside the modes' configs, summarised when measured
SETUP = {
    "what": "on-policy distillation (configs/distill_demo.yaml, mode sampled and topk, top 16) of the untrained "
            "bundled model with README's demo LoRA adapters towards the GRPO demo's final policy, against the GRPO "
            "demo itself; held-out avg@4 on the same 100 problems, the same sampling seed",
    "date": "2026-11-29",
    "machine": "2-core CPU shared with other sessions' tests and training runs (load average 8-18): the seconds are "
               "not the idle machine's",
    "grpo_run": "the CI run of cff2843 (bash .ci/run, README's command jaxrl-llm train --config "
                "configs/lora_demo.yaml; 0.560 -> 0.8175 as every run of it since 79e89e2); its final/ is the teacher",
    "grpo_step10": "the GRPO demo's step-10 checkpoint evaluated alone (the evaluation row at step 10 of "
                   "distill_demo_runs/grpo/metrics.jsonl): a copy of its checkpoint 10 resumed with train.steps=10",
    "topk_run": "the 4-step config, then --resume with train.steps=6 (steps 5-6 and an evaluation at 384 samples)",
    "topk_lr6e-4_run": "mode topk with optim.lr=6e-4 (3x the demo's; distill.coef would only rescale a loss AdamW "
                       "normalises) and train.steps=6, evaluations every 2 steps, from the same untrained student",
    "sampled_run": "started with train.steps=8 and stopped during step 6, after its step-5 checkpoint (the learning "
                   "rate is constant, so steps 1-4 and that evaluation are the 4-step config's); then --resume with "
                   "train.steps=5 (the evaluation at 320 samples only), --resume with train.steps=7 "
                   "train.eval_every=1 (steps 6-7, evaluations at 384 and 448 samples) and --resume with "
                   "train.steps=10 train.eval_every=1 (steps 8-10, evaluations at 512, 576 and 640 samples)",
}


def read_rows(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def read_runs(runs: pathlib.Path) -> dict[str, list[dict]]:
    """{name: metrics rows} of grpo, the modes and every variant whose folder is in `runs`."""
    names = ("grpo", *MODES, *(v for v in VARIANTS if (runs / v / "metrics.jsonl").is_file()))
    return {name: read_rows(runs / name) for name in names}


def eval_curve(rows: list[dict]) -> list[dict]:
    """[{step, samples, accuracy, sd}] of a run's evaluations in step order; samples: the samples_drawn of the
    step row at that step (0 before training; the last step's for the evaluation after it)."""
    drawn = {0: 0}
    for row in rows:
        if "samples_drawn" in row:
            drawn[row["step"]] = row["samples_drawn"]
    curve = {}
    for row in rows:
        if "eval_accuracy" in row:
            curve[row["step"]] = {"step": row["step"], "samples": drawn[row["step"]],
                                  "accuracy": row["eval_accuracy"], "sd": row["eval_sampling_sd"]}
    return [curve[step] for step in sorted(curve)]


def samples_to_teacher(curve: list[dict], teacher: dict) -> int | None:
    """Samples drawn at the run's first evaluation within one noise sd of the teacher's accuracy (None if none):
    accuracy >= teacher - sqrt(sd^2 + sd_teacher^2)."""
    for point in curve:
        if point["accuracy"] >= teacher["accuracy"] - math.hypot(point["sd"], teacher["sd"]):
            return point["samples"]
    return None


def summarize(runs: dict[str, list[dict]]) -> dict:
    """The demo's JSON from the runs' metrics rows: {"grpo": rows, "sampled": rows, "topk": rows, variant: rows}."""
    curves = {name: eval_curve(rows) for name, rows in runs.items()}
    teacher = curves["grpo"][-1]
    grpo = samples_to_teacher(curves["grpo"], teacher)
    opd = {name: samples_to_teacher(curves[name], teacher) for name in runs if name != "grpo"}
    return {
        "teacher_accuracy": teacher["accuracy"],
        "teacher_sd": teacher["sd"],
        "student_before": {name: curve[0]["accuracy"] for name, curve in curves.items()},
        "student_after": {name: curve[-1]["accuracy"] for name, curve in curves.items()},
        "samples": {name: curve[-1]["samples"] for name, curve in curves.items()},
        "grpo_samples_to_teacher": grpo,
        "opd_samples_to_teacher": opd,
        "ratio": {name: (n / grpo if n is not None and grpo else None) for name, n in opd.items()},
        # a run that did not reach the teacher: its ratio is above samples drawn / grpo's
        "ratio_above": {name: curves[name][-1]["samples"] / grpo for name, n in opd.items() if n is None and grpo},
        "train_seconds": {name: round(sum(r.get("time_wall_s", 0.0) for r in rows), 1) for name, rows in runs.items()},
        "curves": curves,
        "rule": "a run reaches the teacher at its first evaluation with avg@4 >= teacher - sqrt(sd^2 + sd_teacher^2)",
        "command": COMMAND,
        **SETUP,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=pathlib.Path, default=RUNS)
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    out = summarize(read_runs(args.runs))
    text = json.dumps(out, indent=1) + "\n"
    if args.json:
        args.json.write_text(text)
    print(text, end="")
    return out


if __name__ == "__main__":
    main()
