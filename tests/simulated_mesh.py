"""Run Python in a child process on a simulated multi-device CPU (the device count is fixed when JAX starts)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_on_devices(args: list[str], devices: int = 8, timeout: int = 600) -> dict:
    """`python *args` from the repository root with `devices` CPU devices; the JSON the child printed on its
    "RESULT " line. Fails with the child's output tails when it exits non-zero."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])
