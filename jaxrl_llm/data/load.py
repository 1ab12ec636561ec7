"""One entry point from a config value to records, so a YAML config can name any source.

    load_records("arithmetic")                                  # the demo task's training split
    load_records({"kind": "arithmetic", "max_terms": 3, "num": 5000, "seed": 1})
    load_records({"kind": "reasoning_gym", "task": "chain_sum", "size": 1000, "seed": 0})
    load_records({"kind": "jsonl", "path": "train.jsonl", "question": "problem", "answer": "solution"})
    load_records({"kind": "tfds", "name": "gsm8k", "split": "train", "data_dir": "~/tfds"})
    load_records("gsm8k-100")  /  load_records("data/math500.jsonl")   # benchmark name or file path
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping

from jaxrl_llm.data.arithmetic import ArithmeticTask
from jaxrl_llm.data.benchmarks import BENCHMARKS, load_benchmark
from jaxrl_llm.data.records import fields
from jaxrl_llm.data.sources import load_file, load_hf_disk, load_json, load_jsonl, load_parquet, load_tfds

_FILE_LOADERS = {"jsonl": load_jsonl, "json": load_json, "parquet": load_parquet, "hf_disk": load_hf_disk,
                 "file": load_file}
_FIELD_OPTIONS = ("question", "answer", "answer_format", "id_key")
KINDS = ("arithmetic", "arithmetic_heldout", "reasoning_gym", "tfds", "benchmark", *_FILE_LOADERS)


def _split_field_options(options: dict) -> tuple[dict, dict]:
    field_options = {key: options.pop(key) for key in _FIELD_OPTIONS if key in options}
    return fields(**field_options), options


def _required(options: dict, key: str, kind: str):
    if key not in options:
        raise ValueError(f"data source of kind {kind!r} needs {key!r}")
    return options.pop(key)


def load_records(spec: str | Mapping) -> list[dict]:
    """Records from a source description (see the module docstring); ``kind`` is one of KINDS.

    File kinds take ``path`` plus the FieldSpec options ``question``, ``answer``, ``answer_format``,
    ``id_key`` and the loader's own options (``max_bad_fraction``, ``split``...). ``arithmetic`` takes
    ArithmeticTask fields plus ``num`` (None = every training problem once) and ``seed``.
    """
    if isinstance(spec, str):
        if spec == "arithmetic":
            return ArithmeticTask().train_records()
        if spec in BENCHMARKS or pathlib.Path(spec).exists():
            return load_benchmark(spec) if spec in BENCHMARKS else load_file(spec)
        raise ValueError(f"data source {spec!r} is neither 'arithmetic', a benchmark name ({sorted(BENCHMARKS)}) "
                         "nor an existing file")
    options = dict(spec)
    kind = options.pop("kind", None)
    if kind not in KINDS:
        raise ValueError(f"data source needs 'kind' in {KINDS}, got {kind!r}")
    if kind in ("arithmetic", "arithmetic_heldout"):
        num, seed = options.pop("num", None), options.pop("seed", 0)
        known = {f.name for f in dataclasses.fields(ArithmeticTask)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown arithmetic option(s) {unknown}; known: {sorted(known | {'num', 'seed'})}")
        if "operators" in options:
            options["operators"] = tuple(options["operators"])
        task = ArithmeticTask(**options)
        return task.heldout_records() if kind == "arithmetic_heldout" else task.train_records(num, seed=seed)
    if kind == "reasoning_gym":
        from jaxrl_llm.data.reasoning_gym_tasks import reasoning_gym_records

        return reasoning_gym_records(_required(options, "task", kind), **options)
    if kind == "benchmark":
        return load_benchmark(_required(options, "name", kind), **options)
    spec_fields, options = _split_field_options(options)
    if kind == "tfds":
        return load_tfds(_required(options, "name", kind), spec_fields, **options)
    return _FILE_LOADERS[kind](_required(options, "path", kind), spec_fields, **options)
