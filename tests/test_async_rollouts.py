"""Asynchronous rollouts (`rollouts.mode: async`, train/async_rollouts.py): the sampler thread's schedule on a
fake draw (versions, staleness, order, checkpoints' in-flight steps, errors), the in-flight file, and the loop:
k = 0 equal to the synchronous run bitwise, kill -9 and --resume of a k = 1 run exact, the sampler on its own
devices of an 8-device CPU mesh."""

import json
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxrl_llm.run.config import ConfigError
from jaxrl_llm.train import load_config
from jaxrl_llm.train.async_rollouts import (AsyncRollouts, load_in_flight, prune_in_flight, save_in_flight)
from jaxrl_llm.train.rollouts import ScoredRollouts
from process_helpers import accuracy_rows, run_loop
from simulated_mesh import run_on_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNNER = [sys.executable, str(ROOT / "tests" / "loop_runner.py")]


# ---- the schedule on a fake draw ------------------------------------------------------------------------------

class FakeTrainer:
    """Versions are integers: the policy after v updates is v. `draw` records (step, version) in order."""

    def __init__(self, draw_seconds=0.0, fail_at=None):
        self.version = 0
        self.drawn: list[tuple[int, int]] = []
        self.draw_seconds, self.fail_at = draw_seconds, fail_at
        self.lock = threading.Lock()

    def draw(self, step, params):
        if step == self.fail_at:
            raise ValueError("bad batch")
        time.sleep(self.draw_seconds)
        with self.lock:
            self.drawn.append((step, params))
        return _rollouts(step), {"sample_s": 0.0, "score_s": 0.0}

    def snapshot(self):
        return self.version


def _rollouts(step: int, rows: int = 2) -> ScoredRollouts:
    return ScoredRollouts(records=[{"prompt_ids": [1, 2, step], "answer": str(step)}],
                          prompt_index=np.zeros(rows, np.int32), tokens=np.full((rows, 3), step, np.int32),
                          mask=np.ones((rows, 3), np.float32), logprobs=np.full((rows, 3), -0.5 * step, np.float32),
                          lengths=np.full(rows, 3, np.int32), rewards=np.arange(rows, dtype=np.float32),
                          correct=np.array([True, False][:rows]))


def _train(rollouts, trainer, start, steps, save_at=()):
    """The loop's protocol: take(t) -> update -> [quiesce for a save] -> publish(t + 1)."""
    taken, saved = [], {}
    for step in range(start, steps):
        scored, info = rollouts.take(step)
        taken.append((step, info["policy_version"], info["staleness"], int(scored.tokens[0, 0])))
        trainer.version = step + 1
        if step + 1 in save_at:
            saved[step + 1] = {t: info["policy_version"] for t, (_, info) in rollouts.quiesce(step + 1).items()}
        rollouts.publish(step + 1)
    rollouts.close()
    return taken, saved


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_each_step_is_drawn_with_version_t_minus_k(k):
    trainer = FakeTrainer(draw_seconds=0.002)
    rollouts = AsyncRollouts(trainer.draw, trainer.snapshot, lambda v: v, start=0, steps=7, max_staleness=k)
    taken, _ = _train(rollouts, trainer, 0, 7)
    want = [(t, max(0, t - k), min(t, k), t) for t in range(7)]  # (step, version, staleness, the step's batch)
    assert taken == want
    assert sorted(trainer.drawn) == [(t, max(0, t - k)) for t in range(7)]
    assert [t for t, _ in trainer.drawn] == list(range(7))  # drawn in step order: the data stream's order


def test_k0_takes_turns_with_the_trainer():
    """With k = 0 step t's draw starts only after update t - 1, and the trainer waits for it: the synchronous order."""
    events = []
    trainer = FakeTrainer()
    draw = trainer.draw
    trainer.draw = lambda step, params: (events.append(("draw", step)), draw(step, params))[1]
    rollouts = AsyncRollouts(trainer.draw, trainer.snapshot, lambda v: v, start=0, steps=4, max_staleness=0)
    for step in range(4):
        rollouts.take(step)
        events.append(("update", step))
        trainer.version = step + 1
        rollouts.publish(step + 1)
    rollouts.close()
    assert events == [e for t in range(4) for e in (("draw", t), ("update", t))]


def test_quiesce_returns_the_steps_a_checkpoint_saves_and_resume_continues_them():
    k, steps = 2, 8
    trainer = FakeTrainer(draw_seconds=0.002)
    rollouts = AsyncRollouts(trainer.draw, trainer.snapshot, lambda v: v, start=0, steps=steps, max_staleness=k)
    straight, saved = _train(rollouts, trainer, 0, steps, save_at=(3, 7))
    # at the save after step 3 the sampler has drawn steps 3 and 4 (versions 1 and 2), no more; near the end only
    # the steps that exist
    assert saved == {3: {3: 1, 4: 2}, 7: {7: 5}}
    # resume at 3 from what was saved: the in-flight steps are handed back, the sampler goes on at step 5
    resumed_trainer = FakeTrainer()
    resumed_trainer.version = 3
    in_flight = {t: (_rollouts(t), {"policy_version": v, "staleness": t - v, "sample_s": 0.0, "score_s": 0.0})
                 for t, v in saved[3].items()}
    rollouts = AsyncRollouts(resumed_trainer.draw, resumed_trainer.snapshot, lambda v: v, start=3, steps=steps,
                             max_staleness=k, in_flight=in_flight)
    resumed, _ = _train(rollouts, resumed_trainer, 3, steps)
    assert resumed == straight[3:]
    assert [t for t, _ in resumed_trainer.drawn] == [5, 6, 7]


@pytest.mark.parametrize("k", [1, 2])
def test_a_finished_run_resumed_with_more_steps_draws_with_its_newest_version(k):
    """A run of 4 steps that finished saved no in-flight rollouts and no older versions: resumed to 7 steps, the
    sampler draws steps 4 .. 4 + k - 1 with version 4 (not 4 - k, which no one publishes: it waited for ever), then
    t - k again."""
    trainer = FakeTrainer()
    trainer.version = 4
    rollouts = AsyncRollouts(trainer.draw, trainer.snapshot, lambda v: v, start=4, steps=7, max_staleness=k)
    done = []
    worker = threading.Thread(target=lambda: done.append(_train(rollouts, trainer, 4, 7)), daemon=True)
    worker.start()
    worker.join(timeout=120)  # the mechanism, with wide slack: each fake draw returns at once
    assert done, "the resumed sampler is still waiting for a version"
    taken, _ = done[0]
    want = [(t, max(4, t - k)) for t in range(4, 7)]
    assert [(t, v) for t, v, _, _ in taken] == want
    assert [s for _, _, s, _ in taken] == [t - v for t, v in want]


def test_a_failing_draw_reaches_the_trainer():
    trainer = FakeTrainer(fail_at=2)
    rollouts = AsyncRollouts(trainer.draw, trainer.snapshot, lambda v: v, start=0, steps=5, max_staleness=1)
    with pytest.raises(RuntimeError, match="sampler thread failed drawing step 3") as err:
        _train(rollouts, trainer, 0, 5)
    assert isinstance(err.value.__cause__, ValueError)


def test_versions_no_step_needs_are_dropped():
    trainer = FakeTrainer()
    placed = []
    rollouts = AsyncRollouts(trainer.draw, trainer.snapshot, lambda v: placed.append(v) or v, start=0, steps=4,
                             max_staleness=1)
    _train(rollouts, trainer, 0, 4)
    assert placed == [0, 1, 2]  # version 3 would be read by step 4 alone, and there is none
    assert set(rollouts.versions) <= {2}


# ---- the in-flight file ---------------------------------------------------------------------------------------

def test_in_flight_rollouts_round_trip(tmp_path):
    in_flight = {5: (_rollouts(5), {"policy_version": 4, "staleness": 1, "sample_s": 0.25, "rounds": 1,
                                    "sample_start": 1.0, "sample_end": 2.0}),
                 6: (_rollouts(6, rows=1), {"policy_version": 5, "staleness": 1, "sample_s": 0.5, "rounds": 1})}
    save_in_flight(tmp_path, 5, in_flight)
    back = load_in_flight(tmp_path, 5, expected=2)
    assert sorted(back) == [5, 6]
    for t in (5, 6):
        want, got = in_flight[t][0], back[t][0]
        assert got.records == want.records
        for field in ("prompt_index", "tokens", "mask", "logprobs", "lengths", "rewards", "correct"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
            assert getattr(got, field).dtype == getattr(want, field).dtype
    assert back[5][1] == {"policy_version": 4, "staleness": 1, "sample_s": 0.25, "rounds": 1}  # clock marks dropped
    assert load_in_flight(tmp_path, 9, expected=0) == {}
    with pytest.raises(FileNotFoundError, match="9.npz is missing.*2 steps of rollouts"):
        load_in_flight(tmp_path, 9, expected=2)
    with pytest.raises(ValueError, match="holds 2 steps.*expects 3"):
        load_in_flight(tmp_path, 5, expected=3)
    save_in_flight(tmp_path, 7, {7: in_flight[6]})
    prune_in_flight(tmp_path, [7])
    assert sorted(p.name for p in (tmp_path / "in_flight").iterdir()) == ["7.npz"]


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="rollouts.mode"):
        load_config(None, ["rollouts.mode=later"])
    with pytest.raises(ConfigError, match="rollouts.max_staleness"):
        load_config(None, ["rollouts.mode=async", "rollouts.max_staleness=-1"])
    with pytest.raises(ConfigError, match="rollouts.sampler_devices.*applies to rollouts.mode=async"):
        load_config(None, ["rollouts.sampler_devices=2"])
    with pytest.raises(ConfigError, match="rollouts.mode.*gvm"):
        load_config(None, ["rollouts.mode=async", "sampling.allocation=gvm"])
    with pytest.raises(ConfigError, match="rollouts.sampler_mesh"):
        load_config(None, ["rollouts.mode=async", "rollouts.sampler_mesh=data=2"])


def test_asynchronous_runs_verify_in_a_process_pool():
    """The sampler thread scores, where the in-process time limit (SIGALRM) does not hold: at least one worker."""
    from jaxrl_llm.run.setup import verifier_workers

    assert verifier_workers(load_config(None, [])) == 0
    assert verifier_workers(load_config(None, ["rollouts.mode=async"])) == 1
    assert verifier_workers(load_config(None, ["rollouts.mode=async", "train.verifier_workers=3"])) == 3


# ---- the loop ---------------------------------------------------------------------------------------------------

_run, _rows = run_loop, accuracy_rows  # the loop runner and its metrics (process_helpers)


def _weights(out_dir) -> dict:
    return load_file(pathlib.Path(out_dir) / "final" / "model.safetensors")


def test_k0_equals_the_synchronous_run_bitwise(tmp_path, tiny_loop_run):
    sync = tiny_loop_run[0]  # loop_runner's defaults: the synchronous run (conftest: made once per test run)
    _run(tmp_path / "async", "rollouts.mode=async", "rollouts.max_staleness=0")
    want, got = _weights(sync), _weights(tmp_path / "async")
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    sync_rows, async_rows = _rows(sync), _rows(tmp_path / "async")
    for key in ("loss", "grad_norm", "reward", "response_length", "samples_drawn"):
        assert [r[key] for r in async_rows] == [r[key] for r in sync_rows], key
    assert [r["policy_version"] for r in async_rows] == [0, 1, 2, 3]
    assert sync_rows[-1]["grad_norm"] > 0  # the policy moved


def test_k1_kill9_then_resume_equals_the_uninterrupted_run(tmp_path):
    args = ["rollouts.mode=async", "rollouts.max_staleness=1", "train.steps=5"]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    _run(straight, *args)
    rows = _rows(straight)
    assert [(r["policy_version"], r["staleness"]) for r in rows] == [(0, 0), (0, 1), (1, 1), (2, 1), (3, 1)]
    assert rows[-1]["samples_drawn"] == 5 * 2 * 2
    proc = subprocess.Popen(RUNNER + [f"train.out_dir={broken}", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    start = time.time()
    while len(_rows(broken)) < 3:  # a checkpoint at step 2 or 3 holds the next step's rollouts in flight
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() - start < 600, "timed out waiting for the run"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list((broken / "in_flight").glob("*.npz"))
    resumed = _run(broken, *args, "--resume")
    assert "resumed from step" in resumed.stdout
    want, got = _weights(straight), _weights(broken)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert _rows(broken)[-1]["samples_drawn"] == rows[-1]["samples_drawn"]
    # another schedule cannot continue these in-flight rollouts
    proc = subprocess.run(RUNNER + [f"train.out_dir={broken}", "rollouts.mode=sync", "train.steps=6", "--resume"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode != 0 and "another schedule of rollouts" in proc.stderr


SPLIT = """
import json, sys
sys.path.insert(0, "tests")
from loop_runner import TINY_RUN, tiny_policy
from jaxrl_llm.run import setup as setup_module
from jaxrl_llm.train import load_config
from jaxrl_llm.train.loop import train

seen = {}
original = setup_module.setup_run
def setup_run(config, **kwargs):
    run = original(config, **kwargs)
    seen["trainer"] = sorted(d.id for d in run.mesh.devices.flat)
    seen["sampler"] = sorted(d.id for d in run.sampler_mesh.devices.flat)
    policy = run.sampler_params()
    from jaxrl_llm.train.async_rollouts import copy_params
    copied = copy_params(policy, run.split_mesh)
    import jax
    seen["copy_devices"] = sorted({d.id for leaf in jax.tree_util.tree_leaves(copied) for d in leaf.devices()})
    return run


if __name__ == "__main__":  # the verifier's pool starts processes that import this file
    import jaxrl_llm.train.loop as loop_module
    loop_module.setup_run = setup_run
    out = sys.argv[1]
    summary = train(load_config(None, TINY_RUN + [f"train.out_dir={out}", "rollouts.mode=async", "rollouts.sampler_devices=4",
                                                 "train.mesh=fsdp=4", "train.steps=3"]), policy=tiny_policy())
    rows = [json.loads(l) for l in open(f"{out}/metrics.jsonl") if '"accuracy"' in l]
    print("RESULT " + json.dumps({**seen, "status": summary["status"],
                                  "versions": [r["policy_version"] for r in rows], "grad_norm": rows[-1]["grad_norm"]}))
"""


def test_the_sampler_on_its_own_devices_of_an_8_device_mesh(tmp_path):
    script = tmp_path / "split.py"
    script.write_text(SPLIT)
    result = run_on_devices([str(script), str(tmp_path / "run")], devices=8)
    assert result["trainer"] == [0, 1, 2, 3] and result["sampler"] == [4, 5, 6, 7]
    assert result["copy_devices"] == [4, 5, 6, 7]
    assert result["status"] == "done" and result["versions"] == [0, 0, 1] and result["grad_norm"] > 0
