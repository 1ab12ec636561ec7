"""Loaders from files and dataset libraries into lists of records (see records.py).

Every loader reads the whole source, skips and counts bad rows (malformed line, missing field,
empty answer) and raises ``BadDataError`` naming the file and lines when more than
``max_bad_fraction`` of the rows are bad. Reasoning datasets are small (thousands of problems),
so records are held in memory; the grain pipeline then shuffles, shards and batches them.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from collections.abc import Iterator

from jaxrl_llm.data.records import FieldSpec, records_from_rows


def _read_jsonl_rows(path: pathlib.Path) -> Iterator[dict | Exception]:
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            text = line.strip()
            if not text:
                yield ValueError("empty line")
                continue
            try:
                yield json.loads(text)
            except json.JSONDecodeError as err:
                yield ValueError(f"malformed JSON ({err.msg} at column {err.colno})")


def load_jsonl(path: str | os.PathLike, spec: FieldSpec = FieldSpec(), *, source: str | None = None,
               max_bad_fraction: float = 0.05) -> list[dict]:
    """Records from a JSON-lines file (one object per line; lines are numbered from 1).

    A trailing empty line is ignored; other empty or malformed lines count as bad rows.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"JSONL file not found: {path}")
    rows = list(_read_jsonl_rows(path))
    while rows and isinstance(rows[-1], ValueError) and str(rows[-1]) == "empty line":
        rows.pop()  # trailing blank lines are not rows
    records, _ = records_from_rows(rows, spec, source=source or str(path), max_bad_fraction=max_bad_fraction)
    return records


def load_json(path: str | os.PathLike, spec: FieldSpec = FieldSpec(), *, source: str | None = None,
              max_bad_fraction: float = 0.05) -> list[dict]:
    """Records from a JSON file holding a list of objects (rows are numbered from 1 = list index 0)."""
    path = pathlib.Path(path)
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: malformed JSON ({err.msg})") from err
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON list of objects, got {type(rows).__name__}")
    records, _ = records_from_rows(rows, spec, source=source or str(path), max_bad_fraction=max_bad_fraction)
    return records


def load_parquet(path: str | os.PathLike, spec: FieldSpec = FieldSpec(), *, source: str | None = None,
                 max_bad_fraction: float = 0.05) -> list[dict]:
    """Records from a parquet file (read with ``pyarrow``); rows are numbered from 1."""
    import pyarrow.parquet as pq
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"parquet file not found: {path}")
    rows = pq.read_table(path).to_pylist()
    records, _ = records_from_rows(rows, spec, source=source or str(path), max_bad_fraction=max_bad_fraction)
    return records


def load_hf_disk(path: str | os.PathLike, spec: FieldSpec = FieldSpec(), *, split: str | None = "train",
                 source: str | None = None, max_bad_fraction: float = 0.05) -> list[dict]:
    """Records from a Hugging Face dataset saved with ``save_to_disk`` (read with ``datasets``).

    A saved ``DatasetDict`` needs ``split``; a saved single ``Dataset`` ignores it. Rows are numbered from 1.
    """
    import datasets  # slow to import: only for this source
    loaded = datasets.load_from_disk(str(path))
    name = source or str(path)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise KeyError(f"{path}: split {split!r} not found; available: {sorted(loaded)}")
        loaded = loaded[split]
        name = source or f"{path}[{split}]"
    records, _ = records_from_rows(iter(loaded), spec, source=name, max_bad_fraction=max_bad_fraction)
    return records


def _import_tfds():
    # tensorflow-datasets 4.9.x imports the `importlib_resources` backport when it locates a builder's
    # code; on Python >= 3.9 the standard library module has the same API.
    if "importlib_resources" not in sys.modules:
        try:
            import importlib_resources  # noqa: F401
        except ImportError:
            import importlib.resources
            sys.modules["importlib_resources"] = importlib.resources
    import tensorflow_datasets as tfds
    return tfds


def load_tfds(name: str, spec: FieldSpec = FieldSpec(), *, split: str = "train", data_dir: str | None = None,
              source: str | None = None, max_bad_fraction: float = 0.05) -> list[dict]:
    """Records from a prepared TFDS dataset through ``tfds.data_source`` (array_record format, random access).

    The dataset must already be prepared in ``data_dir`` (e.g. ``gsm8k``, ``math_dataset``); nothing is
    downloaded. Text features arrive as bytes and are decoded as UTF-8. Rows are numbered from 1.
    """
    tfds = _import_tfds()
    try:
        data_source = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except Exception as err:
        raise FileNotFoundError(f"TFDS dataset {name!r} split {split!r} is not prepared in "
                                f"data_dir={data_dir!r} (prepare it with tfds build, file_format=array_record): "
                                f"{err}") from err
    rows = (data_source[index] for index in range(len(data_source)))
    records, _ = records_from_rows(rows, spec, source=source or f"tfds:{name}[{split}]",
                                   max_bad_fraction=max_bad_fraction)
    return records


def load_file(path: str | os.PathLike, spec: FieldSpec = FieldSpec(), **kwargs) -> list[dict]:
    """Records from a file chosen by extension: .jsonl, .json, .parquet, or a saved HF dataset folder."""
    path = pathlib.Path(path)
    if path.is_dir():
        return load_hf_disk(path, spec, **kwargs)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return load_jsonl(path, spec, **kwargs)
    if suffix == ".json":
        return load_json(path, spec, **kwargs)
    if suffix == ".parquet":
        return load_parquet(path, spec, **kwargs)
    raise ValueError(f"{path}: unknown data file type {suffix!r}; expected .jsonl, .json, .parquet "
                     "or a folder written by datasets.save_to_disk")
