"""Run metrics: one JSON line per step and TensorBoard events; `plot.py` draws them (`jaxrl-llm plot`)."""

from __future__ import annotations

import json
import math
import pathlib
import sys
from typing import Any

import jax

class MetricsWriter:
    """Appends metrics to RUN_DIR/metrics.jsonl and TensorBoard events; only process 0 writes."""

    def __init__(self, run_dir: str | pathlib.Path, *, tensorboard: bool = True):
        self.run_dir = pathlib.Path(run_dir)
        self.enabled = jax.process_index() == 0
        self._tb = None
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        if tensorboard:
            self._tb = _summary_writer_class()(str(self.run_dir / "tensorboard"))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: _plain(v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in clean.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            if self._tb is not None:
                self._tb.close()


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch whenever it is installed
    (2.5-4 s, in every training process of a machine with the test extra) only to accept torch tensors, and this
    writer passes Python floats. A `None` entry in `sys.modules` makes that `import torch` fail as if torch were
    absent; the entry is removed again, so torch stays importable by anything else. Where torch is already
    imported, tensorboardX takes it as it is."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide:
            del sys.modules["torch"]
    return SummaryWriter


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "size", 2) == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def read_metrics(run_dir: str | pathlib.Path) -> list[dict[str, Any]]:
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory?")
    rows = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not a JSON line ({err})") from None
    return rows
