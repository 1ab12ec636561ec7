"""Partial rollouts in the loop (`rollouts.mode: partial`): a kill -9 and --resume of a run continues it exactly
(the engine's state, the groups handed over and the batches formed ahead are saved beside the checkpoint), every
step logs its tokens' versions and staleness within the bound."""

import json
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
from safetensors.numpy import load_file

from process_helpers import accuracy_rows, run_loop

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNNER = [sys.executable, str(ROOT / "tests" / "loop_runner.py")]
PARTIAL = ["rollouts.mode=partial", "rollouts.max_staleness=3", "rollouts.segment_iterations=4", "train.steps=6"]


_run, _rows = run_loop, accuracy_rows  # the loop runner and its metrics (process_helpers)


def test_partial_kill9_then_resume_equals_the_uninterrupted_run(tmp_path):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    _run(straight, *PARTIAL)
    rows = _rows(straight)
    assert len(rows) == 6
    for step, row in enumerate(rows):
        versions = {int(v): n for v, n in row["tokens_per_version"].items()}
        assert row["staleness_max"] == step - min(versions) <= 3
        assert row["policy_version"] == max(versions) <= max(0, step - 1)  # partial_lag 1
        assert sum(versions.values()) == round(row["response_length"] * 4)  # 2 prompts x 2 samples
        assert "rollout_mismatch_kl" in row  # the trainer's log-probs are recomputed: the gap is logged
    assert any(len(r["tokens_per_version"]) > 1 for r in rows)  # a batch mixes versions
    proc = subprocess.Popen(RUNNER + [f"train.out_dir={broken}", *PARTIAL], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    start = time.time()
    while len(_rows(broken)) < 3:  # a checkpoint at step 3 or 4: the last batch is still to be decoded
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() - start < 600, "timed out waiting for the run"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = sorted((broken / "in_flight").glob("*.npz"), key=lambda p: int(p.stem))
    with np.load(saved[-1]) as data:  # the sampler's state beside the checkpoint, with batches still to decode
        meta = json.loads(bytes(data["meta"]).decode())
        assert any(k.startswith("sampler/") for k in data.files) and meta["next_step"] < 6
    resumed = _run(broken, *PARTIAL, "--resume")
    assert "resumed from step" in resumed.stdout
    want, got = load_file(straight / "final" / "model.safetensors"), load_file(broken / "final" / "model.safetensors")
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    after = {r["step"]: r for r in _rows(broken)}
    for row in rows:
        for key in ("loss", "reward", "tokens_per_version", "samples_drawn"):
            assert after[row["step"]][key] == row[key], key
