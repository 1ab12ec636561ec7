"""Helpers of the multi-process tests: a free localhost port for `jax.distributed.initialize`, the environment of
their processes, waiting for a set of worker processes (each must exit 0), the loop runner's runs and metrics, and
the random response groups the mesh tests' subprocesses pack."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np

# The suite's persistent compilation cache (conftest) stays out of `jax.distributed` processes: with it, a resumed
# two-process run once differed from the straight one in the last bits of a gradient norm, and a pair whose
# processes hit and missed the cache apart waited on each other past the test's timeout.
_CACHE_VARIABLES = ("JAX_COMPILATION_CACHE_DIR", "JAXRL_TEST_CACHE_OWNER", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


def distributed_env(**variables: str) -> dict[str, str]:
    """This process's environment without the suite's compilation cache, with `variables` set."""
    env = {k: v for k, v in os.environ.items() if k not in _CACHE_VARIABLES}
    env.update(variables)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """(stdout, stderr) of every process; kills the rest if one times out, fails if one exits non-zero."""
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, out[-3000:] + err[-5000:]
    return outputs


ROOT = pathlib.Path(__file__).resolve().parents[1]
LOOP_RUNNER = [sys.executable, str(ROOT / "tests" / "loop_runner.py")]


def run_loop(out_dir, *extra) -> subprocess.CompletedProcess:
    """tests/loop_runner.py into `out_dir` with config overrides `extra`; fails the test with its output's tail."""
    proc = subprocess.run(LOOP_RUNNER + [f"train.out_dir={out_dir}", *extra], capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def accuracy_rows(out_dir) -> list[dict]:
    """The step rows of a run's metrics.jsonl (those with an accuracy); [] before the first is written."""
    path = pathlib.Path(out_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "accuracy" in r]


def random_response_groups(groups: int = 8, per_group: int = 3, width: int = 6, vocab: int = 64, seed: int = 0):
    """`groups` random prompts of 2-6 tokens with `per_group` responses each of 1..`width` tokens (ids 1..vocab-1):
    (rng for the draws that follow, prompts, responses [groups x per_group, width] int32, lengths, members, mask)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, vocab, size=rng.integers(2, 7)).tolist() for _ in range(groups)]
    responses = rng.integers(1, vocab, size=(groups * per_group, width)).astype(np.int32)
    lengths = rng.integers(1, width + 1, size=groups * per_group)
    members = [np.arange(per_group * g, per_group * (g + 1)) for g in range(groups)]
    mask = (np.arange(width)[None] < lengths[:, None]).astype(np.float32)
    return rng, prompts, responses, lengths, members, mask
