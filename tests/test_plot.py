"""`jaxrl-llm plot`: which panels a metrics.jsonl gets (plan_panels), and the PNG of one run and of two."""

import json

import pytest

from jaxrl_llm.cli import main
from jaxrl_llm.plot import (NO_UPDATE, NON_FINITE, Panel, centred_mean, constant_text, default_out, plan_panels,
                                  plot_run, split_rows)


def _step(step, reward, length, drawn, *, grad_norm=0.5, updates=1, skipped=0, kl=0.0):
    row = {"step": step, "reward": reward, "accuracy": reward, "response_length": length, "samples_drawn": drawn,
           "lr": 1e-4, "updates": updates, "skipped_update": skipped, "tokens_per_s": 10.0 * step,
           "time_sample_s": 2.0, "time_score_s": 0.5, "time_train_s": 1.0, "time_wall_s": 4.0}
    if updates:  # a step without an update logs no loss terms (loop.step_metrics)
        row.update(kl=kl, grad_norm=grad_norm)
    return row


# Evaluations at steps 0 and 4 (the last beside step 4's row); step 2's update was non-finite, step 3 made none.
RUN = [{"step": 0, "eval_accuracy": 0.5, "eval_sampling_sd": 0.05},
       _step(1, 0.25, 10, 8, grad_norm=1.0), _step(2, 0.5, 12, 16, grad_norm="nan", skipped=1),
       _step(3, 0.75, 11, 28, updates=0), _step(4, 1.0, 14, 36),
       {"step": 4, "eval_accuracy": 0.7, "eval_sampling_sd": 0.04}]


def _write(run_dir, rows):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_plan_merges_equal_series_and_summarises_constant_ones():
    plan = plan_panels([RUN])
    assert plan.panels == (
        Panel("held-out accuracy (eval_accuracy)", ("eval_accuracy",), "eval"),
        Panel("reward = accuracy", ("reward", "accuracy"), "series"),
        Panel("response_length", ("response_length",), "series"),
        Panel("grad_norm", ("grad_norm",), "series"),  # 1.0, 0.5 (step 2's "nan" is no value)
        Panel("samples_per_step", ("samples_per_step",), "series"),  # 8, 8, 12, 8
        Panel("seconds per step", ("time_sample_s", "time_score_s", "time_train_s", "time_wall_s"), "time"),
        Panel("tokens_per_s", ("tokens_per_s",), "series"))
    assert plan.constant == ((("kl",), 0.0), (("lr",), 1e-4))
    assert plan.gaps == (((2, NON_FINITE), (3, NO_UPDATE)),)
    assert plan.window == 3  # max(3, 4 steps // 4), odd
    assert constant_text(plan.constant) == "kl = 0, lr = 0.0001"
    assert "step 2: update skipped: non-finite" in plan.summary()


def test_plan_of_two_runs_merges_and_sets_aside_only_what_holds_in_both():
    other = [dict(r) for r in RUN]
    for row in other[1:5]:
        row["accuracy"] = row["reward"] / 2  # reward is no longer accuracy in this run
        if "kl" in row:
            row["kl"] = 0.1  # constant here, but not the other run's value
    titles = [p.title for p in plan_panels([RUN, other]).panels]
    assert titles[1:4] == ["reward", "accuracy", "response_length"] and "kl" in titles
    assert plan_panels([RUN, other]).constant == ((("lr",), 1e-4),)


def test_split_rows_keeps_a_resumed_steps_last_row_and_derives_samples_per_step():
    rows = [RUN[0], RUN[1], RUN[2], {**RUN[2], "reward": 0.0}, RUN[3], RUN[5]]
    steps, evals = split_rows(rows)
    assert [r["step"] for r in steps] == [1, 2, 3] and steps[1]["reward"] == 0.0
    assert [r["samples_per_step"] for r in steps] == [8, 8, 12]
    assert [(r["step"], r["eval_accuracy"]) for r in evals] == [(0, 0.5), (4, 0.7)]


def test_centred_mean_by_hand():
    assert centred_mean([1.0, 2.0, 3.0, 6.0], 3) == pytest.approx([1.5, 2.0, 11 / 3, 4.5])


def test_plot_draws_one_run_and_two(tmp_path, capsys):
    one = _write(tmp_path / "grpo", RUN)
    assert main(["plot", str(one)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {one / 'curves.png'}" in out and "reward = accuracy" in out and "constant: kl = 0" in out
    assert (one / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    two = _write(tmp_path / "gvm", [{**r, "reward": r["reward"] / 2} if "reward" in r else r for r in RUN])
    assert default_out([one, two]) == tmp_path / "curves_grpo_vs_gvm.png"
    drawn = plot_run([one, two], x="samples")
    assert drawn.path.read_bytes()[:4] == b"\x89PNG" and drawn.plan.gaps == plan_panels([RUN]).gaps * 2
    with pytest.raises(ValueError, match="--x samples"):
        plot_run(_write(tmp_path / "eval_only", RUN[:1]), tmp_path / "x.png", x="samples")
    assert main(["plot", str(one), str(tmp_path / "missing")]) == 2
