"""benchmarks/distill_demo.py: the evaluation curve and the samples-to-teacher rule by hand, and
benchmarks/results/distill_demo.json is what the script gives from the runs' saved metrics (no training here)."""

import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("distill_demo", ROOT / "benchmarks" / "distill_demo.py")
demo = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = demo
_spec.loader.exec_module(demo)


def test_eval_curve_puts_each_evaluation_at_the_samples_drawn_by_its_step():
    rows = [{"step": 0, "eval_accuracy": 0.5, "eval_sampling_sd": 0.02},
            {"step": 1, "samples_drawn": 64, "loss": 0.1},
            {"step": 2, "samples_drawn": 128, "eval_accuracy": 0.7, "eval_sampling_sd": 0.015},
            {"step": 3, "samples_drawn": 192},
            {"step": 3, "eval_accuracy": 0.75, "eval_sampling_sd": 0.01}]
    assert demo.eval_curve(rows) == [{"step": 0, "samples": 0, "accuracy": 0.5, "sd": 0.02},
                                     {"step": 2, "samples": 128, "accuracy": 0.7, "sd": 0.015},
                                     {"step": 3, "samples": 192, "accuracy": 0.75, "sd": 0.01}]


def test_a_run_reaches_the_teacher_within_one_sd_of_the_difference():
    teacher = {"accuracy": 0.8, "sd": 0.03}
    # sd of the difference: sqrt(0.04^2 + 0.03^2) = 0.05, so the bar is 0.75
    curve = [{"samples": 0, "accuracy": 0.5, "sd": 0.04}, {"samples": 64, "accuracy": 0.749, "sd": 0.04},
             {"samples": 128, "accuracy": 0.751, "sd": 0.04}, {"samples": 192, "accuracy": 0.9, "sd": 0.04}]
    assert demo.samples_to_teacher(curve, teacher) == 128
    assert demo.samples_to_teacher(curve[:2], teacher) is None


def test_summary_of_three_small_runs():
    def run(*points):  # (step, samples, accuracy, sd) evaluations; a step row per step with samples_drawn
        rows = [{"step": s, "samples_drawn": n, "time_wall_s": 2.0} for s, n, _, _ in points if s]
        return rows + [{"step": s, "eval_accuracy": a, "eval_sampling_sd": sd} for s, _, a, sd in points]

    out = demo.summarize({"grpo": run((0, 0, 0.5, 0.03), (2, 100, 0.7, 0.03), (4, 200, 0.8, 0.03)),
                          "sampled": run((0, 0, 0.5, 0.03), (1, 50, 0.78, 0.03)),
                          "topk": run((0, 0, 0.5, 0.03), (1, 50, 0.6, 0.03))})
    # the bar: 0.8 - sqrt(2) 0.03 = 0.7576; grpo reaches it at 200 samples, sampled at 50, topk never
    assert out["teacher_accuracy"] == 0.8 and out["grpo_samples_to_teacher"] == 200
    assert out["opd_samples_to_teacher"] == {"sampled": 50, "topk": None}
    assert out["ratio"] == {"sampled": 0.25, "topk": None} and out["ratio_above"] == {"topk": 0.25}
    assert out["student_after"] == {"grpo": 0.8, "sampled": 0.78, "topk": 0.6}
    assert out["samples"] == {"grpo": 200, "sampled": 50, "topk": 50}
    assert out["train_seconds"] == {"grpo": 4.0, "sampled": 2.0, "topk": 2.0}


def test_results_json_is_what_the_script_gives_from_the_saved_metrics():
    saved = ROOT / "benchmarks" / "results" / "distill_demo.json"
    if not saved.exists():
        pytest.skip("benchmarks/results/distill_demo.json not measured yet")
    want = json.loads(json.dumps(demo.summarize(demo.read_runs(demo.RUNS))))
    got = json.loads(saved.read_text())
    assert {k: got[k] for k in want} == want
