"""Problem records, gold-answer extraction, and the bad-row ledger shared by every source.

A record is a plain dict with at least::

    {"id": str, "source": str, "question": str, "answer": str}

where ``answer`` is the gold final answer (e.g. ``"72"``, ``"\\frac{1}{2}"``), never a full solution.
Sources may add more keys (``"solution"``, ``"category"``...); the pipeline keeps them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl_llm.rewards.extract import last_boxed

logger = logging.getLogger(__name__)

DEFAULT_QUESTION_KEYS = ("question", "problem", "prompt", "query", "input")
DEFAULT_ANSWER_KEYS = ("answer", "final_answer", "solution", "target", "output")
ANSWER_FORMATS = ("auto", "raw", "gsm8k", "boxed")


class BadDataError(ValueError):
    """Too many rows of a data file were unusable (the message names the file and lines)."""


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """Where a source keeps the question and the gold answer, and how to read the answer.

    ``question_keys`` / ``answer_keys`` are tried in order; the first key present in a row wins.
    ``answer_format``: "raw" keeps the field as is; "gsm8k" takes the text after the last ``####``;
    "boxed" takes the content of the last ``\\boxed{...}``; "auto" does "gsm8k" when the field holds
    ``####``, "boxed" when it holds ``\\boxed``, and "raw" otherwise.
    ``id_key`` names a row id field (or a tuple of candidates); rows without one get ``"{source}-{index}"``.
    """

    question_keys: tuple[str, ...] = DEFAULT_QUESTION_KEYS
    answer_keys: tuple[str, ...] = DEFAULT_ANSWER_KEYS
    answer_format: str = "auto"
    id_key: str | tuple[str, ...] | None = "id"

    def __post_init__(self):
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {self.answer_format!r}")
        if isinstance(self.question_keys, str) or isinstance(self.answer_keys, str):
            raise TypeError("question_keys and answer_keys must be tuples of key names, not a single string")


def fields(question: str | Sequence[str] | None = None, answer: str | Sequence[str] | None = None,
           answer_format: str = "auto", id_key: str | tuple[str, ...] | None = "id") -> FieldSpec:
    """FieldSpec from one key name or a list of candidates per field (None keeps the defaults)."""

    def _keys(value, default):
        if value is None:
            return default
        return (value,) if isinstance(value, str) else tuple(value)

    return FieldSpec(_keys(question, DEFAULT_QUESTION_KEYS), _keys(answer, DEFAULT_ANSWER_KEYS),
                     answer_format, id_key)


def last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (the verifier's own parser); None if absent."""
    return last_boxed(text)


def gsm8k_final_answer(solution: str) -> str | None:
    """GSM8K gold: the text after the last ``####`` with thousands separators removed ("1,000" -> "1000")."""
    parts = solution.rsplit("####", 1)
    if len(parts) != 2:
        return None
    answer = parts[1].strip().replace(",", "")
    return answer or None


def _scalar_to_text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # AMC23 stores 27.0 for 27
    if isinstance(value, (list, tuple)):
        # OlympiadBench stores final_answer as a list of LaTeX strings
        return ", ".join(_scalar_to_text(v) for v in value)
    if hasattr(value, "tolist"):  # numpy scalars / arrays from parquet or TFDS
        return _scalar_to_text(value.tolist())
    return str(value)


def gold_answer(value: Any, answer_format: str = "auto") -> str | None:
    """The gold final answer from an answer field, per ``answer_format`` (see FieldSpec); None if empty."""
    if value is None:
        return None
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        # OlympiadBench keeps several final answers as a list of LaTeX strings
        parts = [gold_answer(item, answer_format) for item in value]
        return ", ".join(part for part in parts if part) or None
    text = _scalar_to_text(value).strip()
    fmt = answer_format
    if fmt == "auto":
        fmt = "gsm8k" if "####" in text else "boxed" if ("\\boxed" in text or "\\fbox" in text) else "raw"
    if fmt == "gsm8k":
        answer = gsm8k_final_answer(text)
    elif fmt == "boxed":
        answer = last_boxed_content(text)
    else:
        answer = text
    if answer is None:
        return None
    answer = answer.strip()
    if len(answer) >= 2 and answer.startswith("$") and answer.endswith("$"):
        answer = answer.strip("$").strip()  # "$\frac{1}{2}$" -> "\frac{1}{2}"
    return answer or None


def make_record(row: Mapping[str, Any], spec: FieldSpec, *, source: str, index: int) -> dict:
    """A record from one raw row, or raise ``KeyError``/``ValueError`` saying what is missing or empty."""
    question_key = next((k for k in spec.question_keys if k in row), None)
    if question_key is None:
        raise KeyError(f"missing question field (looked for {list(spec.question_keys)})")
    answer_key = next((k for k in spec.answer_keys if k in row), None)
    if answer_key is None:
        raise KeyError(f"missing answer field (looked for {list(spec.answer_keys)})")
    question = _scalar_to_text(row[question_key]).strip() if row[question_key] is not None else ""
    if not question:
        raise ValueError(f"empty question in field {question_key!r}")
    answer = gold_answer(row[answer_key], spec.answer_format)
    if answer is None:
        raise ValueError(f"empty or unreadable answer in field {answer_key!r}")
    record = {key: (value.decode("utf-8") if isinstance(value, bytes) else value)
              for key, value in row.items() if key != question_key}
    raw_answer = _scalar_to_text(row[answer_key])
    if answer_key == "answer" and raw_answer.strip() != answer and "solution" not in row:
        record["solution"] = raw_answer  # keep GSM8K's worked solution once "answer" holds the number
    id_keys = (spec.id_key,) if isinstance(spec.id_key, str) else (spec.id_key or ())
    raw_id = next((row[key] for key in id_keys if row.get(key) is not None), None)
    record.update(id=_scalar_to_text(raw_id) if raw_id is not None else f"{source}-{index}",
                  source=source, question=question, answer=answer)
    return record


class BadRows:
    """Skips and counts unusable rows; raises BadDataError once the whole file is read if too many were bad.

    ``max_bad_fraction``: allowed fraction of bad rows (0.0 = any bad row is an error).
    ``show``: how many bad rows are quoted in the warning and the error.
    """

    def __init__(self, source: str, *, max_bad_fraction: float = 0.05, show: int = 5):
        if not 0.0 <= max_bad_fraction <= 1.0:
            raise ValueError(f"max_bad_fraction must be in [0, 1], got {max_bad_fraction}")
        self.source = source
        self.max_bad_fraction = max_bad_fraction
        self.show = show
        self.count = 0
        self.examples: list[str] = []

    def add(self, line: int | str, reason: str) -> None:
        self.count += 1
        if len(self.examples) < self.show:
            self.examples.append(f"{self.source}:{line}: {reason}")

    def check(self, total: int) -> None:
        """Warn about skipped rows; raise if bad/total exceeds the allowed fraction."""
        if self.count == 0:
            return
        fraction = self.count / max(total, 1)
        summary = (f"{self.source}: {self.count} of {total} rows unusable ({fraction:.1%}); first: "
                   + "; ".join(self.examples))
        if fraction > self.max_bad_fraction:
            raise BadDataError(f"{summary}. More than the allowed {self.max_bad_fraction:.1%} "
                               "(raise max_bad_fraction to accept)")
        logger.warning("skipped rows: %s", summary)


def records_from_rows(rows, spec: FieldSpec, *, source: str, max_bad_fraction: float = 0.05,
                      first_line: int = 1) -> tuple[list[dict], BadRows]:
    """Records from an iterable of row mappings; row i is reported as line ``first_line + i``.

    Rows given as ``Exception`` instances (a parse error upstream) are counted as bad.
    """
    bad = BadRows(source, max_bad_fraction=max_bad_fraction)
    records, total = [], 0
    for index, row in enumerate(rows):
        total += 1
        line = first_line + index
        if isinstance(row, Exception):
            bad.add(line, str(row))
            continue
        if not isinstance(row, Mapping):
            bad.add(line, f"expected an object with fields, got {type(row).__name__}")
            continue
        try:
            records.append(make_record(row, spec, source=source, index=index))
        except (KeyError, ValueError) as err:
            bad.add(line, err.args[0] if err.args else str(err))
    bad.check(total)
    return records, bad
