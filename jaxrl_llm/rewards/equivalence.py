"""`answers_equal` and `math_reward`: is a predicted final answer the gold one?

Pipeline for one pair (each stage only runs when the previous ones could not decide):
1. normalise both strings (`normalize.normalize_answer`); a gold multiple-choice letter is
   compared with the letter the prediction names;
2. ``x = 5`` -> ``5`` when the gold is a bare value (no relation);
3. identical compact strings -> equal;
4. structure: matrices (shape + entries), intervals and tuples (matching brackets, element-wise),
   sets, ``\\cup`` unions, ``a \\pm b`` pairs and bare comma lists (order ignored);
5. atoms: plain numbers without sympy, then sympy (`symbolic.sympy_equal`).
The first call in a process imports and warms sympy and the parser (1-5 s, outside any limit);
every comparison then runs under a wall-clock limit (`safety.time_limit`). A timeout, an input
that fails the size screen or any parser error counts as "not equal", never an exception.
"""

from __future__ import annotations

import re

from jaxrl_llm.rewards.extract import extract_answer
from jaxrl_llm.rewards.normalize import choice_letter, compact, normalize_answer, split_top_level
from jaxrl_llm.rewards.parse import to_sympy, warm_up
from jaxrl_llm.rewards.safety import VerifierTimeout, time_limit
from jaxrl_llm.rewards.symbolic import numbers_equal, plain_number, sympy_equal, unordered_equal

DEFAULT_TIMEOUT = 5.0
# Answers longer than this are compared as stripped strings only (no normalisation, no parsing).
MAX_ANSWER_CHARS = 5_000
_MATRIX = re.compile(r"\\begin\{([pbvBV]?matrix|smallmatrix|array)\}(?:\{[^{}]*\})?(.*)\\end\{\1\}", re.DOTALL)
_GOLD_CHOICE = re.compile(r"\(?([A-J])\)?")
_ASSIGNMENT_TARGET = re.compile(r"[a-zA-Z](?:_\{?\w+\}?)?|\\[a-zA-Z]+|[a-zA-Z]\(\w\)")
_CHOICE_PREFIX = re.compile(r"\(([A-J])\)")
_WORDS = re.compile(r"[A-Za-z][A-Za-z ]+")


def _spans_whole(text: str) -> bool:
    """True when the bracket at index 0 closes at the last character (any bracket kinds)."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i == len(text) - 1
    return False


def _structure(text: str) -> tuple:
    """Classify a normalised answer: ("matrix", rows) / ("ordered", open, close, items) /
    ("unordered", items) / ("atom", text)."""
    matrix = _MATRIX.fullmatch(text)
    if matrix:
        rows = [row for row in re.split(r"\\\\", matrix.group(2)) if row.strip() and row.strip() != "\\hline"]
        return ("matrix", [[cell.strip() for cell in row.split("&")] for row in rows])
    union = split_top_level(re.sub(r"\\cup(?![a-zA-Z])", "\u222a", text), "\u222a")
    if len(union) > 1:
        return ("unordered", union)
    plus_minus = split_top_level(re.sub(r"\\pm(?![a-zA-Z])", "\u00b1", text), "\u00b1")
    if len(plus_minus) == 2 and plus_minus[1]:  # "a \pm b" is the pair {a + b, a - b}
        center, offset = plus_minus[0] or "0", plus_minus[1]
        return ("unordered", [f"{center}+({offset})", f"{center}-({offset})"])
    if text.startswith("\\{") and text.endswith("\\}"):
        inner = text[2:-2].strip()
        return ("unordered", split_top_level(inner, ",") if inner else [])
    if len(text) >= 2 and text[0] in "([" and text[-1] in ")]" and _spans_whole(text):
        items = split_top_level(text[1:-1], ",")
        if len(items) > 1:
            return ("ordered", text[0], text[-1], items)
    items = split_top_level(text, ",")
    if len(items) > 1:
        return ("unordered", items)
    return ("atom", text)


def _atoms_equal(pred: str, gold: str) -> bool:
    if compact(pred) == compact(gold):
        return True
    if _WORDS.fullmatch(pred) and _WORDS.fullmatch(gold) and min(len(pred), len(gold)) >= 4:
        return pred.lower().split() == gold.lower().split()  # worded answers: case does not matter
    pred_number, gold_number = plain_number(pred), plain_number(gold)
    if pred_number is not None and gold_number is not None:
        return numbers_equal(pred_number, gold_number)
    pred_expr = to_sympy(pred)
    if pred_expr is None:
        return False
    gold_expr = to_sympy(gold)
    return gold_expr is not None and sympy_equal(pred_expr, gold_expr)


def _normalized_equal(pred: str, gold: str) -> bool:
    """Equality of two normalised answers, structure first, atoms last."""
    if compact(pred) == compact(gold):
        return True
    pred_kind, gold_kind = _structure(pred), _structure(gold)
    if pred_kind[0] == "atom" and gold_kind[0] == "atom":
        return _atoms_equal(pred, gold)
    if pred_kind[0] == "matrix" or gold_kind[0] == "matrix":
        return _matrix_equal(pred_kind, gold_kind)
    if pred_kind[0] == "unordered" or gold_kind[0] == "unordered":
        pred_items = pred_kind[1] if pred_kind[0] == "unordered" else [pred]
        gold_items = gold_kind[1] if gold_kind[0] == "unordered" else [gold]
        if pred_items == [pred] and gold_items == [gold]:
            return False  # an ordered tuple against an atom
        return unordered_equal(pred_items, gold_items, _normalized_equal)
    if pred_kind[0] == "ordered" and gold_kind[0] == "ordered":
        _, pred_open, pred_close, pred_items = pred_kind
        _, gold_open, gold_close, gold_items = gold_kind
        return (
            (pred_open, pred_close) == (gold_open, gold_close)
            and len(pred_items) == len(gold_items)
            and all(_normalized_equal(p, g) for p, g in zip(pred_items, gold_items))
        )
    return False


def _matrix_equal(pred_kind: tuple, gold_kind: tuple) -> bool:
    """Matrices entry-wise; a one-row or one-column matrix also equals a ``( , )`` tuple."""

    def cells(kind: tuple) -> tuple[tuple[int, int], list[str]] | None:
        if kind[0] == "matrix":
            rows = kind[1]
            if len({len(row) for row in rows}) != 1:
                return None
            return (len(rows), len(rows[0])), [cell for row in rows for cell in row]
        if kind[0] == "ordered" and kind[1:3] == ("(", ")"):
            return (0, len(kind[3])), kind[3]  # shape 0: "a vector of this length"
        return None

    pred_cells, gold_cells = cells(pred_kind), cells(gold_kind)
    if pred_cells is None or gold_cells is None:
        return False
    (pred_shape, pred_items), (gold_shape, gold_items) = pred_cells, gold_cells
    if 0 in (pred_shape[0], gold_shape[0]):
        matrix_shape = gold_shape if pred_shape[0] == 0 else pred_shape
        if 1 not in matrix_shape:
            return False
    elif pred_shape != gold_shape:
        return False
    return len(pred_items) == len(gold_items) and all(
        _normalized_equal(p, g) for p, g in zip(pred_items, gold_items)
    )


def _is_relation(text: str) -> bool:
    return bool(re.search(r"=|<|>|\\[lg]eq?(?![a-zA-Z])|\\neq|\\in(?![a-zA-Z])", text))


def _drop_assignment(pred: str) -> str:
    """``x = 5`` / ``x \\in [1, 2]`` -> the right-hand side, when the left side is one variable."""
    marked = re.sub(r"\\in(?![a-zA-Z])", "\u2208", pred)  # "\in" but not "\infty"
    for operator in ("=", "\u2208"):
        parts = split_top_level(marked, operator)
        if len(parts) == 2 and _ASSIGNMENT_TARGET.fullmatch(parts[0]) and parts[1]:
            return parts[1]
    return pred


def _equal(pred: str, gold: str) -> bool:
    pred, gold = normalize_answer(pred), normalize_answer(gold)
    if not pred or not gold:
        return False
    gold_choice = _GOLD_CHOICE.fullmatch(gold)
    if gold_choice:
        prefix = _CHOICE_PREFIX.match(pred)
        named = choice_letter(pred) or (prefix.group(1) if prefix else None)
        return named == gold_choice.group(1)
    if not _is_relation(gold):  # "x = 2, x = 3" -> "2, 3"
        pred = ", ".join(_drop_assignment(item) for item in split_top_level(pred, ","))
    return _normalized_equal(pred, gold)


def answers_equal(pred: str | None, gold: str | None, *, timeout: float | None = DEFAULT_TIMEOUT) -> bool:
    """True when the predicted answer ``pred`` is mathematically the gold answer ``gold``.

    Both are answer strings (LaTeX or plain); a ``\\boxed{}`` inside either is unwrapped. At most
    ``timeout`` seconds of wall time (SIGALRM, main thread only; None disables); a timeout, an
    oversized or unparsable input answers False. See the module docstring for the rules.
    """
    if pred is None or gold is None:
        return False
    if not isinstance(pred, str) or not isinstance(gold, str):
        raise TypeError(
            f"answers_equal expects strings, got pred={type(pred).__name__}, gold={type(gold).__name__}"
        )
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return pred.strip() == gold.strip()
    warm_up()  # imports must never run under the timer (see parse.warm_up)
    try:
        with time_limit(timeout):
            return _equal(pred, gold)
    except VerifierTimeout:
        return False
    except (Exception, RecursionError, MemoryError):  # a hostile answer must never crash the trainer
        return False


def math_reward(completion: str | None, gold: str, *, timeout: float | None = DEFAULT_TIMEOUT) -> float:
    """1.0 when the final answer extracted from ``completion`` equals ``gold``, else 0.0.

    ``reward = 1[answers_equal(extract_answer(completion), gold)]``; no final answer scores 0.
    """
    prediction = extract_answer(completion)
    if prediction is None:
        return 0.0
    return 1.0 if answers_equal(prediction, gold, timeout=timeout) else 0.0
