"""End-to-end checks of the RL loop on a tiny random policy (tests/loop_runner.py): exact resume after
kill -9, a clean save on SIGTERM, and the books a run keeps."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNNER = [sys.executable, str(ROOT / "tests" / "loop_runner.py")]


def _run(out_dir, *extra, check=True):
    proc = subprocess.run(RUNNER + [f"train.out_dir={out_dir}", *extra], capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"loop_runner failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _wait_for(predicate, proc, timeout=600):
    start = time.time()
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"runner exited early: {proc.stdout.read()[-2000:]} {proc.stderr.read()[-2000:]}")
        if time.time() - start > timeout:
            proc.kill()
            raise AssertionError("timed out waiting for the run")
        time.sleep(0.2)


def _step_rows(out_dir) -> list[dict]:
    """The per-step rows of a run's metrics (evaluation-only rows carry no "accuracy")."""
    path = pathlib.Path(out_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "accuracy" in r]


def _steps_logged(out_dir) -> int:
    return len(_step_rows(out_dir))


@pytest.mark.slow
def test_kill9_then_resume_is_bitwise_equal_to_uninterrupted(tmp_path, tiny_loop_run):
    straight, straight_stdout = tiny_loop_run  # loop_runner's defaults, uninterrupted (conftest: made once per run)
    broken = tmp_path / "broken"
    assert "STATUS done" in straight_stdout
    rows = _step_rows(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["samples_drawn"] == 4 * 2 * 2  # steps x prompts x samples: every sample is counted

    proc = subprocess.Popen(RUNNER + [f"train.out_dir={broken}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    _wait_for(lambda: _steps_logged(broken) >= 2, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = _run(broken, "--resume")
    assert "resumed from step" in resumed.stdout and "STATUS done" in resumed.stdout
    want = load_file(straight / "final" / "model.safetensors")
    got = load_file(broken / "final" / "model.safetensors")
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # The policy moved: the run is not trivially equal to its initial parameters.
    assert rows[-1]["grad_norm"] > 0


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(RUNNER + [f"train.out_dir={out}", "train.steps=50", "train.save_every=0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    _wait_for(lambda: _steps_logged(out) >= 1, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-2000:]
    assert "STATUS preempted" in stdout and "SIGTERM: saved step" in stdout
    steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and steps[-1] == _steps_logged(out) < 50


def test_restored_state_is_placed_as_a_fresh_runs(tmp_path):
    """On one device a resumed run's state is placed as a fresh run's (uncommitted, on the default device), not
    committed as orbax restores it: its train step is then the uninterrupted run's program, read back from a
    persistent compilation cache instead of compiled again."""
    import jax
    from loop_runner import TINY_RUN, tiny_policy

    from jaxrl_llm.run import resume
    from jaxrl_llm.run.setup import setup_run
    from jaxrl_llm.train import load_config

    config = load_config(None, TINY_RUN + [f"train.out_dir={tmp_path}"])
    run = setup_run(config, policy=tiny_policy())
    saved = jax.device_get(run.state)
    resume.save(run, 1, resume.new_books(), None)
    run.close()
    run = setup_run(config, policy=tiny_policy(seed=1))
    fresh = jax.tree_util.tree_leaves(run.state)
    step, _, _ = resume.restore(run)
    restored = jax.tree_util.tree_leaves(run.state)
    assert step == 1 and len(restored) == len(fresh)
    assert [x.committed for x in restored] == [x.committed for x in fresh] == [False] * len(fresh)
    assert [x.sharding for x in restored] == [x.sharding for x in fresh]
    for got, want in zip(restored, jax.tree_util.tree_leaves(saved)):
        np.testing.assert_array_equal(np.asarray(got), want)
    run.close()
