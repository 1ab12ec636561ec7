"""Preemption and --resume with two local processes x 4 simulated CPU devices (one data=2,fsdp=2,tensor=2
mesh, `jax.distributed.initialize` on localhost, as in tests/test_multihost.py).

Three 2-process runs of the same 4-step config with GVM allocation refreshed every other step (steps 1
and 3 run stage 1, per-sample gradient norms and the allocation on the mesh; steps 2 and 4 sample
uniformly), scored by a stub verifier so the random policy has accepted samples. `straight` runs all 4
steps; `stop` gets SIGTERM on process 1 only during step 2, so both processes (told through the
all-gathered preemption flag) save step 2 through orbax and stop; `resume` continues the `stop`
directory with resume=True. The resumed run must end with bitwise the same parameters, losses, GVM
allocations and counters as the straight one, and every process must draw the same prompt batches at
the same steps (the data-iterator state is restored, no batch is repeated or skipped). Bitwise holds
because the resumed pair compiles the same programs for the same device layout (sampler keys are
fold_in(seed, step)) and orbax restores the float32 state exactly. This file is also the worker script
(`python tests/test_multihost_resume.py ID COUNT PORT DIR MODE`)."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest
from process_helpers import distributed_env, finish, free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
MESH = "data=2,fsdp=2,tensor=2"
STEPS = 4
STOP_AFTER = 2  # the step during which process 1 receives SIGTERM


def _launch_pair(out_dir: pathlib.Path, mode: str) -> list[subprocess.Popen]:
    # No shared persistent compilation cache (`distributed_env`): with one, the resumed pair's step after a GVM step
    # differed from the straight run in the last bits of the gradient norm; compiled afresh, every run is bitwise.
    env = distributed_env(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    port = free_port()
    return [subprocess.Popen([sys.executable, __file__, str(i), "2", str(port), str(out_dir), mode],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
            for i in range(2)]


def _stdouts(procs) -> list[str]:
    return [out for out, _ in finish(procs, timeout=500)]


def _summary(stdout: str) -> dict:
    return json.loads(next(l for l in stdout.splitlines() if l.startswith("SUMMARY "))[len("SUMMARY "):])


def _step_rows(run_dir: pathlib.Path) -> list[dict]:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r for r in rows if "accuracy" in r]


def _prompts(run_dir: pathlib.Path, process: int) -> list[list[str]]:
    """The prompt batches process `process` drew, in order (one list of questions per step)."""
    path = run_dir / f"prompts.{process}.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


@pytest.mark.slow  # three 2-process runs: 3 to 5 min of wall time on 2 busy shared cores
def test_sigterm_then_resume_on_two_processes_equals_uninterrupted(tmp_path):
    from safetensors.numpy import load_file

    straight, broken = tmp_path / "straight", tmp_path / "broken"
    # The uninterrupted run and the interrupted one run side by side (each pair has its own coordinator).
    outputs = _stdouts(_launch_pair(straight, "straight") + _launch_pair(broken, "stop"))
    straight_out, stop_out = outputs[:2], outputs[2:]
    assert [_summary(o)["status"] for o in straight_out] == ["done", "done"]
    # Process 1 alone got SIGTERM; process 0 learnt of it from the all-gathered flag, and both saved step 2.
    assert [_summary(o)["status"] for o in stop_out] == ["preempted", "preempted"], stop_out
    assert f"SIGTERM: saved step {STOP_AFTER}" in stop_out[0]
    assert [r["step"] for r in _step_rows(broken)] == list(range(1, STOP_AFTER + 1))
    assert sorted(int(p.name) for p in (broken / "checkpoints").iterdir() if p.name.isdigit()) == [1, STOP_AFTER]

    resume_out = _stdouts(_launch_pair(broken, "resume"))
    assert [_summary(o)["status"] for o in resume_out] == ["done", "done"]
    assert f"resumed from step {STOP_AFTER}" in resume_out[0] and "resumed from" not in resume_out[1]

    # Data position: each process drew, step by step, the batches of the uninterrupted run.
    want_prompts = _prompts(straight, 0)
    assert len(want_prompts) == STEPS and len({tuple(b) for b in want_prompts}) == STEPS  # distinct batches
    for process in (0, 1):
        assert _prompts(straight, process) == want_prompts  # every process draws the same global batch
        assert _prompts(broken, process) == want_prompts, process
    # Metrics (process 0 only, one row per step across both runs) and counters continue bitwise.
    want_rows, rows = _step_rows(straight), _step_rows(broken)
    assert [r["step"] for r in rows] == [r["step"] for r in want_rows] == list(range(1, STEPS + 1))
    for a, b in zip(want_rows, rows):
        for key in ("reward", "response_length", "samples_drawn", "loss", "policy_loss", "entropy", "grad_norm"):
            assert a[key] == b[key], (key, a, b)
    assert rows[-1]["samples_drawn"] == _summary(resume_out[0])["samples_drawn"] == want_rows[-1]["samples_drawn"]
    for a, b in zip(want_rows[::2], rows[::2]):  # the GVM steps: same acceptance rates, norms and n_i
        for key in ("gvm_p", "gvm_grad_norm", "gvm_n"):
            assert a[key] == b[key], (key, a, b)
        assert sum(a["gvm_n"]) > 0, a
    assert want_rows[-1]["grad_norm"] > 0  # the policy moved
    want = load_file(str(straight / "final" / "model.safetensors"))
    got = load_file(str(broken / "final" / "model.safetensors"))
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _record_prompts(out_dir: pathlib.Path, process: int) -> None:
    """Append every prompt batch this process draws to out_dir/prompts.<process>.jsonl."""
    from jaxrl_llm import data as data_lib

    draw = data_lib.RecordBatches.__next__
    path = out_dir / f"prompts.{process}.jsonl"

    def recording_next(self):
        records = draw(self)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps([r["question"] for r in records]) + "\n")
        return records

    data_lib.RecordBatches.__next__ = recording_next


def _stub_verifier() -> None:
    """Accept a sample when its text's character codes sum to an even number (the same verdict on every
    process, whichever share of the samples it verifies)."""
    from jaxrl_llm.train import rollouts
    def verdicts(self, texts, golds, lengths):
        correct = np.array([sum(map(ord, text)) % 2 == 0 for text in texts], bool)
        self.last_seconds = 0.0
        return correct, correct.astype(np.float32)

    rollouts.RewardScorer.__call__ = verdicts


def _sigterm_during_step(step_index: int) -> None:
    """Deliver SIGTERM to this process while it updates on step `step_index` (0-based), as a preempted
    host would receive it mid-step."""
    from jaxrl_llm.train import loop
    update = loop.update_policy

    def update_then_signal(run, scored, step):
        if step == step_index:
            os.kill(os.getpid(), signal.SIGTERM)
        return update(run, scored, step)

    loop.update_policy = update_then_signal


def _worker(process_id: int, num_processes: int, port: int, out_dir: str, mode: str) -> None:
    import jax

    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=num_processes,
                               process_id=process_id)
    sys.path.insert(0, str(ROOT / "tests"))
    from loop_runner import TINY_RUN, tiny_policy

    from jaxrl_llm.train import load_config
    from jaxrl_llm.train.loop import train

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _record_prompts(out, process_id)
    _stub_verifier()
    if mode == "stop" and process_id == 1:  # only one host is preempted; the flag is all-gathered
        _sigterm_during_step(STOP_AFTER - 1)
    overrides = TINY_RUN + [f"train.out_dir={out}", f"train.mesh={MESH}", f"train.steps={STEPS}",
                            "train.eval_problems=0", "train.save_every=1", "sampling.allocation=gvm",
                            "sampling.gvm_refresh_every=2", "sampling.gvm_stage1_samples=2",
                            "sampling.gvm_samples_per_prompt=2"]
    summary = train(load_config(None, overrides), resume=mode == "resume", policy=tiny_policy())
    print("SUMMARY", json.dumps({"process": jax.process_index(), "status": summary["status"],
                                 "samples_drawn": summary.get("samples_drawn")}), flush=True)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
