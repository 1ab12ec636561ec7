"""Reading an answer as its values: what ``x = 5``, ``(p,q) = (3,2)`` or ``-2 \\le x \\le 7`` state.

A prediction or a gold often names what it computes (``k = 1``, ``f(x) = 1``, ``|AB| = 1``), chains
the steps (``x = 5 + 6 = 11``) or writes a set of values as an inequality. `answer_values` turns
such a normalised answer into the bare values, so that `equivalence` can compare it with an answer
written as values; ``;`` separators are read by `semicolons` first.
"""

from __future__ import annotations

import re

from jaxrl_llm.rewards.normalize import split_top_level

_RELATION_OPERATOR = re.compile(r"<|>|\\leq|\\geq")


def spans_whole(text: str) -> bool:
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


def _is_name(text: str) -> bool:
    """True when ``text`` names a quantity rather than computing one: ``k``, ``x_{1}``, ``f(x)``,
    ``(p,q)``, ``|AB|``, ``A:B``, ``\\frac{NO}{BO}`` (letters, subscripts and brackets; no arithmetic)."""
    plain = re.sub(r"_\{[^{}]*\}|_\w|\\[a-zA-Z]+|\^\{?\\prime\}?|'", "", text)
    plain = re.sub(r"\([a-z0-9]\)", "", plain)  # a function's argument: f(x), W(1)
    plain = re.sub(r"[{}()|:,\s]", "", plain)
    return bool(plain) and plain.isalpha() and plain.isascii()


def _interval(item: str) -> str | None:
    """``a \\le x \\le b`` -> ``[a, b]``, ``x > a`` -> ``(a, \\infty)``: an inequality on one name."""
    parts = re.split(r"(<|>|\\leq|\\geq)", item)
    sides, operators = [part.strip() for part in parts[0::2]], parts[1::2]
    if len(sides) not in (2, 3) or not all(sides) or len(set(op in ("<", "\\leq") for op in operators)) != 1:
        return None
    if operators[0] in (">", "\\geq"):  # read every chain from small to large
        sides, operators = sides[::-1], [{">": "<", "\\geq": "\\leq"}[op] for op in operators[::-1]]
    brackets = [("[" if op == "\\leq" else "(", "]" if op == "\\leq" else ")") for op in operators]
    if len(sides) == 3 and _is_name(sides[1]) and not _is_name(sides[0]) and not _is_name(sides[2]):
        return f"{brackets[0][0]}{sides[0]},{sides[2]}{brackets[1][1]}"
    if len(sides) == 2 and _is_name(sides[0]) and not _is_name(sides[1]):
        return f"(-\\infty,{sides[1]}{brackets[0][1]}"
    if len(sides) == 2 and _is_name(sides[1]) and not _is_name(sides[0]):
        return f"{brackets[0][0]}{sides[0]},\\infty)"
    return None


def _is_arithmetic(text: str) -> bool:
    """True when ``text`` is a computation on numbers only (``35 + 70``, ``\\frac{1}{2}``)."""
    return re.search(r"\d", text) is not None and re.search(r"[a-zA-Z]", re.sub(r"\\[a-zA-Z]+", "", text)) is None


def _name_key(name: str) -> str:
    """``W(x)`` and ``W(n)`` name the same function; ``x_{1}`` is ``x_1``."""
    return re.sub(r"\([^()]*\)|[{}\s]", "", name) or name


def _item_value(item: str, computations: bool) -> tuple[str, str | None]:
    """(value, the name it was assigned to or "" for a computation) of one list item; the name is
    None when the item is already a value. See `answer_values`."""
    if len(item) > 2 and item[0] == "(" and item[-1] == ")" and spans_whole(item) and "=" in item:
        item = item[1:-1].strip()  # "(35 + 70 = 105)"
    marked = re.sub(r"\\in(?![a-zA-Z])", "\u2208", item)  # "\in" but not "\infty"
    for operator in ("=", "\u2208"):
        sides = split_top_level(marked, operator)
        if len(sides) > 2 and all(sides):  # a chained equation: its last side
            return sides[-1].replace("\u2208", "\\in "), _name_key(sides[0]) if _is_name(sides[0]) else ""
        computed = computations and _is_arithmetic(sides[0]) and _is_arithmetic(sides[-1])
        if len(sides) == 2 and sides[1] and (_is_name(sides[0]) or computed):
            return sides[1].replace("\u2208", "\\in "), _name_key(sides[0]) if _is_name(sides[0]) else ""
    if _RELATION_OPERATOR.search(item):
        interval = _interval(item)
        if interval is not None:
            return interval, ""
    return item, None


def answer_values(text: str, *, computations: bool = True) -> tuple[str, list[str]]:
    """A normalised answer read as its values, and the names the values were assigned to.

    ``"x = 2, x = 3"`` -> ``"2, 3"``; ``"(p,q)=(3,2)"`` -> ``"(3,2)"``; ``"x = 5+6 = 11"`` -> ``"11"``;
    ``"(p=5, q=2), (p=7, q=2)"`` and ``"p=5, q=2, p=7, q=2"`` -> ``"(5, 2), (7, 2)"``;
    ``"-2 \\leq x \\leq 7"`` -> ``"[-2,7]"``. ``computations``: also read ``35 + 70 = 105`` as
    ``105`` (for predictions; a gold equation between numbers and a name, ``7 = 11a + c``, is itself
    the answer).
    """
    values, names = [], []
    for item in split_top_level(text, ","):
        if len(item) > 2 and item[0] == "(" and item[-1] == ")" and spans_whole(item):
            inner = [_item_value(part, computations) for part in split_top_level(item[1:-1], ",")]
            if len(inner) > 1 and all(name is not None for _, name in inner):
                values.append("(" + ", ".join(value for value, _ in inner) + ")")
                names += [name for _, name in inner if name]
                continue
        value, name = _item_value(item, computations)
        values.append(value)
        names += [name] if name else []
    if len(names) == len(values):
        values = _solution_tuples(values, names)
    return ", ".join(values), names


def _solution_tuples(values: list[str], names: list[str]) -> list[str]:
    """A flat list of assignments that repeats one cycle of names is one tuple per repetition:
    ``p=5, q=2, p=7, q=2`` -> ``(5, 2), (7, 2)``; ``x=1, y=2`` stays ``1, 2``."""
    for width in range(2, len(names) // 2 + 1):
        cycle = names[:width]
        if len(set(cycle)) == width and len(names) % width == 0 and names == cycle * (len(names) // width):
            return ["(" + ", ".join(values[i : i + width]) + ")" for i in range(0, len(values), width)]
    return values


def semicolons(text: str) -> str:
    """``;`` as a separator: ``(0;1)`` -> ``(0,1)``; ``a;b`` -> ``a, b``; groups holding commas
    (``p=5,q=2;p=7,q=2``) become tuples ``(p=5,q=2), (p=7,q=2)``."""
    if ";" not in text:
        return text
    text = re.sub(r"\(([^(),;]*(?:;[^(),;]*)+)\)", lambda m: "(" + m.group(1).replace(";", ",") + ")", text)
    groups = split_top_level(text, ";")
    if len(groups) == 1:
        return text
    if any(len(split_top_level(group, ",")) > 1 for group in groups):
        groups = [f"({group})" if len(split_top_level(group, ",")) > 1 else group for group in groups]
    return ", ".join(groups)
