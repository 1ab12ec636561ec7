"""Helpers of the multi-process tests: a free localhost port for `jax.distributed.initialize`, and
waiting for a set of worker processes (each must exit 0)."""

import socket
import subprocess


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
