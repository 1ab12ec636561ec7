"""`answers_equal` and `math_reward`: is a predicted final answer the gold one?

Pipeline for one pair (each stage only runs when the previous ones could not decide):
1. normalise both strings (`normalize.normalize_answer`, which drops a percent sign); a number
   written as a percent on one side only also stands for its hundredth (28% is 28 and 0.28); a
   gold multiple-choice letter (or a choice written out, "(D) Alina") is compared with the letter
   the prediction names;
2. ``;`` separators: ``(0;1)`` is ``(0,1)``, ``p=5,q=2;p=7,q=2`` is the list of two tuples;
3. identical compact strings -> equal;
4. structure: matrices (shape + entries), intervals and tuples (matching brackets, element-wise),
   ratios and clock times ``a:b`` (element-wise, so 4:30 is not 2:15), sets, ``\\cup`` unions,
   ``a \\pm b`` pairs and bare comma lists (as sets unless ``ordered_lists``, as multisets when
   the gold repeats an item; a bare list against a ``( , )`` tuple is read in order);
5. atoms: plain numbers without sympy, then sympy (`symbolic.sympy_equal`);
6. values: when the pair is still unequal, both sides are read as their values and compared again
   (`answer_values`): a chained equation by its last side (``x = 5+6 = 11``), ``name = value`` and
   ``name \\in value`` by the value (``k=1``, ``(p,q)=(3,2)``, ``f(x)=1``), an inequality on one
   name by its interval (``-2 \\le x \\le 7`` is ``[-2, 7]``). The gold side is read so only when
   ``VerifierConfig.gold_assignments`` is on (the default);
7. second opinion: a pair still unequal because an answer could not be read or related by the
   rules above is handed whole to math-verify (`engine.mathverify_equal`).
The first call in a process imports and warms sympy and the parser (1-5 s, outside any limit);
every comparison then runs under a wall-clock limit (`safety.time_limit`). A timeout, an input
that fails the size screen or any parser error counts as "not equal", never an exception.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading

from jaxrl_llm.rewards.extract import extract_answer, extract_choice
from jaxrl_llm.rewards.normalize import choice_letter, compact, normalize_answer, split_top_level
from jaxrl_llm.rewards.parse import to_sympy, warm_up
from jaxrl_llm.rewards.safety import VerifierTimeout, time_limit
from jaxrl_llm.rewards.symbolic import (
    REL_TOL,
    answer_kind,
    comparable,
    numbers_equal,
    plain_number,
    set_equal,
    sympy_equal,
    unordered_equal,
)
from jaxrl_llm.rewards.values import answer_values, semicolons, spans_whole


@dataclasses.dataclass(frozen=True)
class VerifierConfig:
    """Grading conventions (the defaults suit RL rewards: they credit every standard way of writing
    a right answer and nothing looser).

    - ``ordered_lists``: bare comma lists ("2, 3") are compared in order; off by default, since a
      list answer is most often the solutions of an equation, whose order is free. Tuples, intervals
      and matrices are always ordered, ``\\{...\\}`` sets never.
    - ``rel_tol``: relative tolerance when either side is written as a decimal (0.0: exact). 1e-4
      accepts 0.3333 for 1/3 and rejects 0.33; an exact fraction against an exact fraction is exact.
    - ``gold_assignments``: a gold ``lhs = value`` whose lhs is a name (``k=1``, ``(p,q)=(3,2)``,
      ``|AB|=1``) also accepts the bare value; a chained gold equation is read by its last side.
    - ``second_opinion``: ask math-verify (`engine.mathverify_equal`) about a pair our rules left
      undecided (an answer sympy could not read, or two kinds it cannot relate, such as a union of
      intervals against an inequality). Never asked when one side is a relation and the other not.
    - ``unmarked_answers``: `math_reward` also reads a completion that states no answer (no box,
      ``####``, answer marker or ``<answer>`` tag) by its last math span or number, as math-verify
      does (`extract.extract_answer` with ``fallback``). On for grading; the RL reward
      `rewards.correctness_reward` turns it off by default, so that the policy is paid only for an
      answer it states (as the on-device reward of the fused loop, which reads boxes only).
    - ``box_groups``: boxes of a completion separated only by punctuation or a short "and" / "or"
      phrase form one answer (``\\boxed{1} and \\boxed{2}`` is ``1, 2``); off, the last box alone
      counts. On for grading; off in `rewards.correctness_reward`, whose verdicts then equal the
      on-device reward's last-box rule. A gold's boxes always group.
    """

    ordered_lists: bool = False
    rel_tol: float = REL_TOL
    gold_assignments: bool = True
    second_opinion: bool = True
    unmarked_answers: bool = True
    box_groups: bool = True


DEFAULT_CONFIG = VerifierConfig()
# Set when a comparison met an answer our rules could not read or relate: only then is math-verify asked.
_undecided = threading.local()

DEFAULT_TIMEOUT = 5.0
# Answers longer than this are compared as stripped strings only (no normalisation, no parsing).
MAX_ANSWER_CHARS = 5_000
# One matrix environment: its body holds no other \begin or \end ("A + B" is two matrices).
_MATRIX = re.compile(
    r"\\begin\{([pbvBV]?matrix|smallmatrix|array)\}(?:\{[^{}]*\})?((?:(?!\\begin\{|\\end\{).)*)\\end\{\1\}",
    re.DOTALL,
)
_GOLD_CHOICE = re.compile(r"\(?([A-J])\)?")
# A gold that writes out a choice: "(D) Alina", "C. 12 apples", "C Cecile" (a capitalised word).
_GOLD_CHOICE_TEXT = re.compile(r"\(([A-J])\)\s*\S.*|([A-J])[.:]\s+\S.*|([A-J])\s+[A-Z][a-z]+.*", re.DOTALL)
_PERCENT = re.compile(r"%\s*\$?\s*\.?\s*$|(?<![A-Za-z])(?:percent(?:age)?s?|pct)\s*\.?\s*\$?\s*$", re.IGNORECASE)
_CHOICE_PREFIX = re.compile(r"\(([A-J])\)")
_WORDS = re.compile(r"[A-Za-z][A-Za-z ]+")


def _structure(text: str) -> tuple:
    """Classify a normalised answer: ("matrix", rows) / ("ordered", open, close, items) /
    ("set", items) / ("list", items) / ("atom", text)."""
    matrix = _MATRIX.fullmatch(text)
    if matrix:
        rows = [row for row in re.split(r"\\\\", matrix.group(2)) if row.strip() and row.strip() != "\\hline"]
        return ("matrix", [[cell.strip() for cell in row.split("&")] for row in rows])
    union = split_top_level(re.sub(r"\\cup(?![a-zA-Z])", "\u222a", text), "\u222a")
    if len(union) > 1:
        return ("set", union)
    plus_minus = split_top_level(re.sub(r"\\pm(?![a-zA-Z])", "\u00b1", text), "\u00b1")
    if len(plus_minus) == 2 and plus_minus[1]:  # "a \pm b" is the pair {a + b, a - b}
        center, offset = plus_minus[0] or "0", plus_minus[1]
        return ("set", [f"{center}+({offset})", f"{center}-({offset})"])
    if text.startswith("\\{") and text.endswith("\\}"):
        inner = text[2:-2].strip()
        return ("set", split_top_level(inner, ",") if inner else [])
    if len(text) >= 2 and text[0] in "([" and text[-1] in ")]" and spans_whole(text):
        items = split_top_level(text[1:-1], ",")
        if len(items) > 1:
            return ("ordered", text[0], text[-1], items)
    items = split_top_level(text, ",")
    if len(items) > 1:
        return ("list", items)
    ratio = split_top_level(text, ":")
    if len(ratio) > 1 and all(ratio) and ":=" not in text:  # 7:32, 4:30 — a pair, never a quotient
        return ("ordered", ":", ":", ratio)
    return ("atom", text)


def _decimal_comma(text: str) -> str:
    """``1,22`` / ``0,111`` / ``1000,99`` -> the decimal they write with a comma; other text unchanged.

    A comma that could group thousands (``1,234``) or that separates single digits (``2,3``) is
    left alone.
    """
    match = re.fullmatch(r"(-?)(\d+),(\d+)", text)
    if match is None:
        return text
    whole, fraction = match.group(2), match.group(3)
    if len(fraction) < 2 or len(fraction) == 3 and len(whole) <= 3 and not whole.startswith("0"):
        return text  # "2,3" is a list of two digits, "1,234" a thousands separator
    return f"{match.group(1)}{whole}.{fraction}"


def _atoms_equal(pred: str, gold: str, config: VerifierConfig) -> bool:
    if compact(pred) == compact(gold):
        return True
    if _WORDS.fullmatch(pred) and _WORDS.fullmatch(gold) and min(len(pred), len(gold)) >= 4:
        return pred.lower().split() == gold.lower().split()  # worded answers: case does not matter
    pred_number, gold_number = plain_number(pred), plain_number(gold)
    if pred_number is not None and gold_number is not None:
        return numbers_equal(pred_number, gold_number, config.rel_tol)
    pred_expr = to_sympy(pred)
    gold_expr = None if pred_expr is None else to_sympy(gold)
    if pred_expr is None or gold_expr is None:
        _undecided.flag = True  # an answer we could not read
        return False
    if not comparable(pred_expr, gold_expr):
        # two known kinds that differ (a set is not a number) are unequal; an interval, a union or a
        # boolean against anything else is a pair our rules do not relate
        _undecided.flag = _undecided.flag or "other" in (answer_kind(pred_expr), answer_kind(gold_expr))
        return False
    return sympy_equal(pred_expr, gold_expr, config.rel_tol)


def _second_opinion(pred: str, gold: str, config: VerifierConfig) -> bool:
    """math-verify on the whole pair, when our rules left it undecided (`engine.mathverify_equal`).

    Never for an equation against a non-equation: math-verify reads ``x + y = 5`` as its last side.
    """
    if not config.second_opinion or not _undecided.flag or ("=" in pred) != ("=" in gold):
        return False  # an equation is not one of its sides (math-verify would compare the last side)
    from jaxrl_llm.rewards.engine import mathverify_equal

    return mathverify_equal(pred, gold, config.rel_tol)


def _normalized_equal(pred: str, gold: str, config: VerifierConfig = DEFAULT_CONFIG) -> bool:
    """Equality of two normalised answers, structure first, atoms last."""
    if compact(pred) == compact(gold):
        return True
    equal = functools.partial(_normalized_equal, config=config)
    if "," in pred and "," not in gold and plain_number(gold) is not None:
        pred = _decimal_comma(pred)
    elif "," in gold and "," not in pred and plain_number(pred) is not None:
        gold = _decimal_comma(gold)
    pred_kind, gold_kind = _structure(pred), _structure(gold)
    kinds = {pred_kind[0], gold_kind[0]}
    if kinds == {"atom"}:
        return _atoms_equal(pred, gold, config)
    if "matrix" in kinds:
        return _matrix_equal(pred, gold, pred_kind, gold_kind, config)
    if kinds == {"list", "ordered"}:  # "1, 3" against "(1, 3)": the list read in order
        listed, ordered = (pred_kind, gold_kind) if pred_kind[0] == "list" else (gold_kind, pred_kind)
        return ordered[1:3] == ("(", ")") and _in_order(listed[1], ordered[3], equal)
    if kinds == {"list"} and config.ordered_lists:
        return _in_order(pred_kind[1], gold_kind[1], equal)
    if kinds & {"set", "list"}:
        pred_items = pred_kind[1] if pred_kind[0] in ("set", "list") else [pred]
        gold_items = gold_kind[1] if gold_kind[0] in ("set", "list") else [gold]
        if pred_items == [pred] and gold_items == [gold]:
            return False  # an ordered tuple against an atom
        if len({compact(item) for item in gold_items}) < len(gold_items):
            return unordered_equal(pred_items, gold_items, equal)  # the gold counts multiplicity
        return set_equal(pred_items, gold_items, equal)
    if kinds == {"ordered"}:
        _, pred_open, pred_close, pred_items = pred_kind
        _, gold_open, gold_close, gold_items = gold_kind
        return (pred_open, pred_close) == (gold_open, gold_close) and _in_order(pred_items, gold_items, equal)
    _undecided.flag = True  # a tuple or interval against an atom: kinds our rules do not relate
    return False


def _in_order(left: list, right: list, equal) -> bool:
    return len(left) == len(right) and all(equal(x, y) for x, y in zip(left, right))


def _matrix_equal(pred: str, gold: str, pred_kind: tuple, gold_kind: tuple, config: VerifierConfig) -> bool:
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
    if pred_cells is None or gold_cells is None:  # a matrix expression ("A + B", "AB"): sympy decides
        atoms = (pred_kind, gold_kind)
        if all(kind[0] in ("matrix", "atom") for kind in atoms) and any(kind[0] == "atom" for kind in atoms):
            return _atoms_equal(pred, gold, config)
        return False
    (pred_shape, pred_items), (gold_shape, gold_items) = pred_cells, gold_cells
    if 0 in (pred_shape[0], gold_shape[0]):
        matrix_shape = gold_shape if pred_shape[0] == 0 else pred_shape
        if 1 not in matrix_shape:
            return False
    elif pred_shape != gold_shape:
        return False
    return len(pred_items) == len(gold_items) and all(
        _normalized_equal(p, g, config) for p, g in zip(pred_items, gold_items)
    )


def _choice_equal(pred: str, gold: str) -> bool | None:
    """Equality when the gold is a choice letter (or a written-out choice); None when it is not."""
    gold_choice = _GOLD_CHOICE.fullmatch(gold)
    prefix = _CHOICE_PREFIX.match(pred)
    named = choice_letter(pred) or (prefix.group(1) if prefix else None)
    if gold_choice:
        return named == gold_choice.group(1)
    written = _GOLD_CHOICE_TEXT.fullmatch(gold)
    if written and choice_letter(pred):  # "D" against "(D) Alina"
        return choice_letter(pred) == next(group for group in written.groups() if group)
    return None


def _percent_equal(pred_raw: str, gold_raw: str, pred: str, gold: str, config: VerifierConfig) -> bool:
    """A number written as a percent also stands for its hundredth: 28% is 0.28 as well as 28."""
    pred_percent, gold_percent = bool(_PERCENT.search(pred_raw)), bool(_PERCENT.search(gold_raw))
    if pred_percent == gold_percent:
        return False
    pred_number, gold_number = plain_number(pred), plain_number(gold)
    if pred_number is None or gold_number is None:
        return False
    if pred_percent:
        pred_number = (pred_number[0] / 100, pred_number[1])
    else:
        gold_number = (gold_number[0] / 100, gold_number[1])
    return numbers_equal(pred_number, gold_number, config.rel_tol)


def _equal(pred: str, gold: str, config: VerifierConfig = DEFAULT_CONFIG) -> bool:
    pred_raw, gold_raw = pred, gold
    pred, gold = normalize_answer(pred), normalize_answer(gold)
    if not pred or not gold:
        return False
    if _percent_equal(pred_raw, gold_raw, pred, gold, config):
        return True
    choice = _choice_equal(pred, gold)
    if choice is not None:
        return choice
    pred, gold = semicolons(pred), semicolons(gold)
    _undecided.flag = False
    if _normalized_equal(pred, gold, config):
        return True
    pred_values, pred_names = answer_values(pred)
    gold_values, gold_names = answer_values(gold, computations=False) if config.gold_assignments else (gold, [])
    if (pred_values, gold_values) != (pred, gold):
        if pred_names and gold_names and set(pred_names) != set(gold_names):
            return False  # "x = 2" is not "y = 2"
        if _normalized_equal(pred_values, gold_values, config):
            return True
    return _second_opinion(pred, gold, config)


def answers_equal(
    pred: str | None,
    gold: str | None,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
    config: VerifierConfig = DEFAULT_CONFIG,
) -> bool:
    """True when the predicted answer ``pred`` is mathematically the gold answer ``gold``.

    Both are answer strings (LaTeX or plain); a ``\\boxed{}`` inside either is unwrapped, and a gold
    that states its answer (a box, ``#### x``, "The answer is x") is read by that answer. At most
    ``timeout`` seconds of wall time (SIGALRM, main thread only; None disables); a timeout, an
    oversized or unparsable input answers False. See the module docstring for the rules and
    `VerifierConfig` for the conventions.
    """
    if pred is None or gold is None:
        return False
    if not isinstance(pred, str) or not isinstance(gold, str):
        raise TypeError(
            f"answers_equal expects strings, got pred={type(pred).__name__}, gold={type(gold).__name__}"
        )
    gold = extract_answer(gold, fallback=False) or gold  # a worked solution as the gold: its stated answer
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return pred.strip() == gold.strip()
    warm_up()  # imports must never run under the timer (see parse.warm_up)
    try:
        with time_limit(timeout):
            return _equal(pred, gold, config)
    except VerifierTimeout:
        return False
    except (Exception, RecursionError, MemoryError):  # a hostile answer must never crash the trainer
        return False


def math_reward(
    completion: str | None,
    gold: str,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
    config: VerifierConfig = DEFAULT_CONFIG,
) -> float:
    """1.0 when the final answer extracted from ``completion`` equals ``gold``, else 0.0.

    ``reward = 1[answers_equal(extract_answer(completion), gold)]``; no final answer scores 0
    (``config.unmarked_answers`` decides whether an unmarked last value counts as one).
    A gold that states its answer (a box, ``#### x``, "The answer is x") is read by that answer.
    When the gold is a choice letter, the prediction is the letter the completion picks
    (`extract.extract_choice`).
    """
    if not isinstance(gold, str) or not gold.strip():
        return 0.0
    gold = extract_answer(gold, fallback=False) or gold  # a worked solution as the gold: its stated answer
    if completion is not None and len(gold) < 100 and _GOLD_CHOICE.fullmatch(normalize_answer(gold)):
        prediction = extract_choice(completion, fallback=config.unmarked_answers)
    else:
        prediction = extract_answer(completion, fallback=config.unmarked_answers, box_groups=config.box_groups)
    if prediction is None:
        return 0.0
    return 1.0 if answers_equal(prediction, gold, timeout=timeout, config=config) else 0.0
