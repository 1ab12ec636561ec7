"""Two local processes x 4 simulated CPU devices, joined by `jax.distributed.initialize` on localhost
(cross-process CPU collectives over gloo), train a tiny policy on one data=2,fsdp=2,tensor=2 mesh and
match a single-process, single-device run: same rewards, and losses and final parameters to float
tolerance, with either sampling engine on the mesh (the reference samples with the static one). Only process 0 writes metrics, TensorBoard events, log lines and the exported model;
checkpoints are written through orbax by both. This file is also the worker script
(`python tests/test_multihost.py ID COUNT PORT DIR MESH [KEY=VALUE ...]`)."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from process_helpers import distributed_env, finish, free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
MESH = "data=2,fsdp=2,tensor=2"
STEPS = 2


def _launch(process_id: int, num_processes: int, port: int, out_dir: pathlib.Path, devices: int, *extra: str):
    env = distributed_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    mesh = MESH if num_processes > 1 else ""  # the reference: one process, one device
    return subprocess.Popen([sys.executable, __file__, str(process_id), str(num_processes), str(port), str(out_dir),
                             mesh, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _summary(stdout: str) -> dict:
    return json.loads(next(l for l in stdout.splitlines() if l.startswith("SUMMARY "))[len("SUMMARY "):])


def _rows(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_two_processes_match_one_process(tmp_path, engine, once_per_run):
    from safetensors.numpy import load_file

    # The reference, the same for both engines, is made once per test run.
    one = once_per_run("multihost_reference", lambda folder: finish([_launch(0, 1, 0, folder, 1)], timeout=400))
    two = tmp_path / "two"
    port = free_port()
    (out0, _), (out1, _) = finish([_launch(i, 2, port, two, 4, f"sampling.engine={engine}") for i in range(2)],
                                  timeout=400)

    for out, index in ((out0, 0), (out1, 1)):
        s = _summary(out)
        assert (s["process"], s["processes"], s["devices"], s["local_devices"]) == (index, 2, 8, 4), s
        assert s["status"] == "done", s
        # Verification split over processes: 5 samples -> process 0 checks 3, process 1 checks 2, and
        # both end with all 5 verdicts.
        assert s["scored_here"] == [3, 2][index], s
        assert s["verdicts"] == [True, False, True, True, False] and s["rewards"] == [1.0, 0.0, 1.0, 1.0, 0.0], s
    # Only process 0 logs, writes metrics (one line per step, not two) and TensorBoard events.
    assert "samples drawn:" in out0 and "samples drawn:" not in out1
    ref_rows, rows = _rows(one), _rows(two)
    assert len(rows) == len(ref_rows) == STEPS
    assert len(list((two / "tensorboard").glob("events.*"))) == 1
    for a, b in zip(ref_rows, rows):
        assert a["step"] == b["step"]
        # Exactly, though the mesh's programs round differently: see test_train_loop_on_mesh_equals_single_device.
        for key in ("reward", "accuracy", "response_length", "groups_kept"):
            assert a.get(key) == b.get(key), (key, a, b)
        for key in ("loss", "policy_loss", "kl", "entropy", "grad_norm"):
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (key, a, b)
    # Both processes took part in every orbax save (a save is a collective: a missing process hangs it).
    assert sorted(int(p.name) for p in (two / "checkpoints").iterdir() if p.name.isdigit()) == [1, 2]
    ref_params = load_file(str(one / "final" / "model.safetensors"))
    params = load_file(str(two / "final" / "model.safetensors"))
    assert ref_params.keys() == params.keys()
    for name, value in ref_params.items():
        np.testing.assert_allclose(params[name], value, atol=1e-4, err_msg=name)


def _worker(process_id: int, num_processes: int, port: int, out_dir: str, mesh: str, extra: list[str]) -> None:
    import jax

    if num_processes > 1:
        jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=num_processes,
                                   process_id=process_id)
    sys.path.insert(0, str(ROOT / "tests"))
    from loop_runner import TINY_RUN, tiny_policy

    from jaxrl_llm.run.config import AlgorithmSection, SamplingSection
    from jaxrl_llm.run.setup import ProcessShareScorer
    from jaxrl_llm.train import load_config
    from jaxrl_llm.train.loop import train
    from jaxrl_llm.train.rollouts import RewardScorer

    # No evaluation (it compiles the sampler for a second shape); kl_coef > 0 keeps a reference policy.
    overrides = TINY_RUN + [f"train.out_dir={out_dir}", f"train.mesh={mesh}", f"train.steps={STEPS}",
                            "train.eval_problems=0", "algorithm.kl_coef=0.01", *extra]
    summary = train(load_config(None, overrides), policy=tiny_policy())

    seen = []
    inner = RewardScorer(AlgorithmSection(), SamplingSection(), timeout=5.0, workers=0)
    counting = lambda texts, golds, lengths: seen.append(len(texts)) or inner(texts, golds, lengths)  # noqa: E731
    scorer = ProcessShareScorer(counting)
    texts = ["so \\boxed{3}", "\\boxed{4}", "\\boxed{1/2}", "\\boxed{0.5}", "no answer"]
    verdicts, rewards = scorer(texts, ["3", "5", "0.5", "1/2", "7"], [5, 5, 5, 5, 5])
    print("SUMMARY", json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                                 "devices": jax.device_count(), "local_devices": jax.local_device_count(),
                                 "status": summary["status"], "scored_here": sum(seen),
                                 "verdicts": [bool(v) for v in verdicts], "rewards": [float(r) for r in rewards]}),
          flush=True)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6:])
