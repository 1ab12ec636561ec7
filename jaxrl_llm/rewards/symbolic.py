"""Equality of two answer atoms: plain numbers first, then sympy objects.

Rules (as in the MATH / Minerva / math-verify graders):
- numbers: exact for integers and fractions; relative tolerance ``REL_TOL`` = 1e-4 as soon as
  either side is written as a decimal (|a - b| <= 1e-4 * max(|a|, |b|));
- constant expressions (pi, e, sqrt, exp, ...): compared numerically with 60 significant digits
  (exact answers) or with REL_TOL (when a decimal is involved);
- expressions with symbols: evaluated at fixed rational probe points of both signs (so ``sqrt(x^2)``
  is not ``x``); a mismatch is a proof of inequality, agreement at every probe to 1e-20 is taken
  as identity (Schwartz-Zippel style), ``simplify(a - b) == 0`` decides when probes are undefined;
- relations: ``=`` / ``!=`` equal when ``lhs - rhs`` are proportional by a nonzero constant,
  ``<``, ``<=``, ``>``, ``>=`` when they agree in strictness and the ratio is positive.
"""

from __future__ import annotations

import re
from fractions import Fraction

REL_TOL = 1e-4
_EXACT_DIGITS = 60
_EXACT_TOL = 1e-45
_PROBE_TOL = 1e-20
# Rationals of both signs, never integers, so that sqrt(x^2) != x and poles at 0, 1 are avoided.
_PROBES = ((7, 5), (-11, 13), (3, 7), (-23, 10), (5, 3), (-2, 9))

_INTEGER = re.compile(r"[-+]?\d+")
_DECIMAL = re.compile(r"[-+]?\d*\.\d+")
_SLASH_FRACTION = re.compile(r"([-+]?\d+)\s*/\s*(\d+)")
_LATEX_FRACTION = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}")
# A mixed number in plain text, "4 4/9" = 40/9 (the LaTeX form "4\frac{4}{9}" is the parser's).
_MIXED_NUMBER = re.compile(r"([-+]?)(\d+) (\d+)/(\d+)")


def plain_number(text: str) -> tuple[Fraction, bool] | None:
    """(value, written_as_decimal) for an integer, decimal, simple fraction or mixed number
    (``-4 4/9`` = -40/9; a proper fraction only); else None."""
    if len(text) > 400:
        return None
    mixed = _MIXED_NUMBER.fullmatch(text.strip())
    if mixed:
        whole, numerator, denominator = (int(mixed.group(i)) for i in (2, 3, 4))
        if not 0 <= numerator < denominator:
            return None
        value = whole + Fraction(numerator, denominator)
        return (-value if mixed.group(1) == "-" else value), False
    text = text.replace(" ", "")
    try:
        if _INTEGER.fullmatch(text):
            return Fraction(int(text)), False
        if _DECIMAL.fullmatch(text):
            return Fraction(text), True
        match = _SLASH_FRACTION.fullmatch(text)
        if match and int(match.group(2)) != 0:
            return Fraction(int(match.group(1)), int(match.group(2))), False
        match = _LATEX_FRACTION.fullmatch(text)
        if match and int(match.group(3)) != 0:
            value = Fraction(int(match.group(2)), int(match.group(3)))
            return (-value if match.group(1) else value), False
    except (ValueError, ZeroDivisionError):
        return None
    return None


def numbers_equal(a: tuple[Fraction, bool], b: tuple[Fraction, bool], rel_tol: float = REL_TOL) -> bool:
    """Exact equality, or ``rel_tol`` relative closeness when either side was a decimal."""
    (x, x_decimal), (y, y_decimal) = a, b
    if not (x_decimal or y_decimal):
        return x == y
    return abs(x - y) <= Fraction(rel_tol) * max(abs(x), abs(y))


def _as_complex(value) -> complex | None:
    try:
        number = complex(value)
    except (TypeError, ValueError, OverflowError):
        return None
    if number != number or abs(number) == float("inf"):  # nan / inf are not comparable values
        return None
    return number


def _close(x, y, tol: float) -> bool:
    """Relative closeness of two evaluated sympy numbers (also handles matching infinities)."""
    if x == y:
        return True
    a, b = _as_complex(x), _as_complex(y)
    if a is None or b is None:
        return False
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-300)


def _has_float(expr) -> bool:
    import sympy

    return bool(expr.atoms(sympy.Float))


def _probe_points(symbols) -> list[dict]:
    import sympy

    ordered = sorted(symbols, key=str)
    points = []
    for shift in range(len(_PROBES)):
        point = {}
        for index, symbol in enumerate(ordered):
            numerator, denominator = _PROBES[(shift + index) % len(_PROBES)]
            point[symbol] = sympy.Rational(numerator, denominator)
        points.append(point)
    return points


def _evaluate(expr, point: dict):
    value = expr.xreplace(point).evalf(_EXACT_DIGITS)
    return value if value.is_number else None


def _symbolic_operator(expr) -> bool:
    """True when ``expr`` holds a sum, product, integral, limit or derivative and a free symbol.

    Such answers are compared by their tree only: evaluating ``\\sum_{k=0}^{n-1} F_k F_{n-k-1}`` at
    probe points of n costs sympy many seconds, and the two sides of a correct answer written the
    same way are the same tree.
    """
    import sympy

    if not isinstance(expr, sympy.Basic) or not expr.free_symbols:
        return False
    return bool(expr.atoms(sympy.Sum, sympy.Product, sympy.Integral, sympy.Limit, sympy.Derivative))


def _undefined(expr) -> bool:
    """True for an expression holding complex infinity or nan (``1/0``, ``0/0``): it has no value."""
    import sympy

    return bool(expr.has(sympy.zoo, sympy.nan))


def _imaginary_unit(a, b):
    """A bare ``i`` is the imaginary unit when the other side's value is complex (``\\sqrt{-4}`` against
    ``2i``): the parser reads ``i`` as a variable and ``\\sqrt{-4}`` as ``2 I``."""
    import sympy

    def named_i(expr):
        return next((s for s in expr.free_symbols if s.name == "i"), None)

    def complex_valued(expr):
        if expr.has(sympy.I):
            return True
        value = None if expr.free_symbols else _as_complex(expr.evalf(_EXACT_DIGITS))
        return value is not None and value.imag != 0

    for x, y in ((a, b), (b, a)):
        symbol = named_i(y)
        if symbol is not None and named_i(x) is None and not y.has(sympy.I) and complex_valued(x):
            y = y.subs(symbol, sympy.I)
            return (x, y) if x is a else (y, x)
    return a, b


def expressions_equal(a, b, rel_tol: float = REL_TOL) -> bool:
    """Equality of two sympy expressions under the rules in the module docstring."""
    import sympy

    if _undefined(a) or _undefined(b):
        return False  # 1/0 is no number, so it equals nothing (5/0 included)
    if a == b:
        return True
    a, b = _imaginary_unit(a, b)
    tolerant = _has_float(a) or _has_float(b)
    symbols = a.free_symbols | b.free_symbols
    if not symbols:
        x, y = a.evalf(_EXACT_DIGITS), b.evalf(_EXACT_DIGITS)
        if not (x.is_number and y.is_number):
            return False
        return _close(x, y, rel_tol if tolerant else _EXACT_TOL)
    agreed = 0
    for point in _probe_points(symbols):
        x, y = _evaluate(a, point), _evaluate(b, point)
        if x is None or y is None or _as_complex(x) is None or _as_complex(y) is None:
            continue
        if not _close(x, y, rel_tol if tolerant else _PROBE_TOL):
            return False
        agreed += 1
    if agreed >= 3:
        return True
    return sympy.simplify(a - b) == 0


def _oriented_difference(relation):
    """(d, kind) with the relation read as ``d > 0`` / ``d >= 0`` / ``d = 0`` / ``d != 0``."""
    import sympy

    lhs, rhs = relation.lhs, relation.rhs
    if isinstance(relation, (sympy.StrictGreaterThan, sympy.GreaterThan)):
        return lhs - rhs, ">" if isinstance(relation, sympy.StrictGreaterThan) else ">="
    if isinstance(relation, (sympy.StrictLessThan, sympy.LessThan)):
        return rhs - lhs, ">" if isinstance(relation, sympy.StrictLessThan) else ">="
    return lhs - rhs, "=" if isinstance(relation, sympy.Equality) else "!="


def relations_equal(a, b, rel_tol: float = REL_TOL) -> bool:
    """Two relations are equal when they define the same set: see the module docstring."""
    if a == b:
        return True  # the same relation up to sympy's canonical order (no evaluation needed)
    d1, kind1 = _oriented_difference(a)
    d2, kind2 = _oriented_difference(b)
    if kind1 != kind2:
        return False
    symbols = d1.free_symbols | d2.free_symbols
    if not symbols or d1.free_symbols != d2.free_symbols:
        return not symbols and expressions_equal(d1, d2, rel_tol)
    ratios = []
    for point in _probe_points(symbols):
        x, y = _evaluate(d1, point), _evaluate(d2, point)
        x, y = (None, None) if x is None or y is None else (_as_complex(x), _as_complex(y))
        if x is None or y is None or abs(y) < 1e-30:
            continue
        ratios.append(x / y)
    if len(ratios) < 3 or abs(ratios[0]) < 1e-30:
        return False
    if kind1 in (">", ">=") and (abs(ratios[0].imag) > 1e-30 or ratios[0].real <= 0):
        return False
    return all(abs(r - ratios[0]) <= _PROBE_TOL * abs(ratios[0]) for r in ratios)


def answer_kind(x) -> str:
    """What `sympy_equal` sees in a parsed answer: "relation", "matrix", "finite" (a finite set),
    "tuple", "expr", or "other" (an interval, a union, a boolean, ...)."""
    import sympy
    from sympy.core.relational import Relational

    for name, types in (("relation", Relational), ("matrix", (sympy.MatrixBase, sympy.MatrixExpr)),
                        ("finite", sympy.FiniteSet), ("tuple", (tuple, sympy.Tuple)), ("expr", sympy.Expr)):
        if isinstance(x, types):
            return name
    return "other"


def comparable(a, b) -> bool:
    """True when `sympy_equal` can relate the kinds of ``a`` and ``b`` (expressions, relations,
    matrices, finite sets, tuples); False for two kinds it only compares as trees (an interval
    union against an inequality)."""
    kinds = {answer_kind(a), answer_kind(b)}
    return "other" not in kinds and len(kinds) == 1


def sympy_equal(a, b, rel_tol: float = REL_TOL) -> bool:
    """Equality of two parsed answers: relations, sets, matrices, tuples or expressions."""
    import functools

    import sympy
    from sympy.core.relational import Relational

    equal = functools.partial(sympy_equal, rel_tol=rel_tol)
    if isinstance(a, sympy.Basic) and isinstance(b, sympy.Basic) and sympy.srepr(a) == sympy.srepr(b):
        return not (_undefined(a) or _undefined(b))  # the same tree (symbols compared by name)
    if _symbolic_operator(a) or _symbolic_operator(b):
        return False  # a sum or integral over a free symbol: probing it costs seconds, see _symbolic_operator
    if isinstance(a, sympy.MatrixExpr) or isinstance(b, sympy.MatrixExpr):  # "A + B", "AB" of explicit matrices
        a, b = (x.doit() if isinstance(x, sympy.MatrixExpr) else x for x in (a, b))
    if isinstance(a, Relational) or isinstance(b, Relational):
        return isinstance(a, Relational) and isinstance(b, Relational) and relations_equal(a, b, rel_tol)
    if isinstance(a, sympy.MatrixBase) or isinstance(b, sympy.MatrixBase):
        if not (isinstance(a, sympy.MatrixBase) and isinstance(b, sympy.MatrixBase)) or a.shape != b.shape:
            return False
        return all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, sympy.FiniteSet) and isinstance(b, sympy.FiniteSet):
        return set_equal(list(a.args), list(b.args), equal)
    if isinstance(a, (sympy.Set, sympy.And, sympy.Or)) or isinstance(b, (sympy.Set, sympy.And, sympy.Or)):
        return a == b
    if isinstance(a, (tuple, sympy.Tuple)) or isinstance(b, (tuple, sympy.Tuple)):
        if not (isinstance(a, (tuple, sympy.Tuple)) and isinstance(b, (tuple, sympy.Tuple))):
            return False
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if not (isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr)):
        return a == b
    return expressions_equal(a, b, rel_tol)


def set_equal(left: list, right: list, equal) -> bool:
    """Equality of two lists read as sets under ``equal``: every item of each has a match in the other.

    A repeated item counts once: ``[1, 1, 2]`` equals ``[2, 1]``.
    """
    if not left or not right:
        return not left and not right
    return all(any(equal(x, y) for y in right) for x in left) and all(any(equal(x, y) for x in left) for y in right)


def unordered_equal(left: list, right: list, equal) -> bool:
    """Multiset equality of two lists under ``equal`` (each right item used once)."""
    if len(left) != len(right):
        return False
    unused = list(right)
    for item in left:
        for index, candidate in enumerate(unused):
            if equal(item, candidate):
                del unused[index]
                break
        else:
            return False
    return True
