"""Helpers of the multi-process tests: a free localhost port for `jax.distributed.initialize`, the environment of
their processes, waiting for a set of worker processes (each must exit 0), and the loop runner's runs and metrics."""

import json
import os
import pathlib
import socket
import subprocess
import sys

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
