"""Reading answers as their values (rewards.values), math-verify's second opinion (rewards.engine),
and the set and kind helpers of rewards.symbolic: hand-computed values."""

from fractions import Fraction

import pytest

from jaxrl_llm.rewards.engine import mathverify_equal
from jaxrl_llm.rewards.symbolic import comparable, plain_number, set_equal
from jaxrl_llm.rewards.values import answer_values, semicolons, spans_whole


@pytest.mark.parametrize(
    "text, values, names",
    [
        ("x = 2, x = 3", "2, 3", ["x", "x"]),
        ("(p,q)=(3,2)", "(3,2)", ["(p,q)"]),
        ("x = 5+6 = 11", "11", ["x"]),
        ("f(x) = 1", "1", ["f"]),  # a function is named without its argument
        (r"x_{1} = 2", "2", ["x_1"]),
        ("p = 5, q = 2, p = 7, q = 2", "(5, 2), (7, 2)", ["p", "q", "p", "q"]),
        ("x = 1, y = 2", "1, 2", ["x", "y"]),  # one cycle: stays a list
        (r"-2 \leq x \leq 7", "[-2,7]", []),
        (r"x > 5", r"(5,\infty)", []),
        (r"x \leq 5", r"(-\infty,5]", []),
        ("35 + 70 = 105", "105", []),
        ("7 = 11a+c", "7 = 11a+c", []),  # an equation, not a computation: kept
        ("2x + 3", "2x + 3", []),  # already a value
    ],
)
def test_answer_values(text, values, names):
    assert answer_values(text) == (values, names)


def test_answer_values_without_computations_keeps_equations_between_numbers_and_expressions():
    assert answer_values("7 = 11a+c", computations=False) == ("7 = 11a+c", [])
    assert answer_values("k = 1", computations=False) == ("1", ["k"])


def test_semicolons_and_spans_whole():
    assert semicolons("(0;0;6),(4;-2;0)") == "(0,0,6),(4,-2,0)"
    assert semicolons("-12;-11;-10") == "-12, -11, -10"
    assert semicolons("p=5,q=2;p=7,q=2") == "(p=5,q=2), (p=7,q=2)"
    assert semicolons("1, 2") == "1, 2"
    assert spans_whole("(1, [2, 3])")
    assert not spans_whole("(1), (2)")


def test_mathverify_second_opinion():
    union = r"z \in [-\frac{3}{2}, -1] \cup [1, \frac{3}{2}]"
    assert mathverify_equal(union, r"1 \leq |z| \leq \frac{3}{2}", 1e-4)
    assert not mathverify_equal(union, r"1 \leq |z| \leq 2", 1e-4)
    assert not mathverify_equal(r"10^{10^{10}}", r"10^{10^{10}}", 1e-4)  # refused by the screen first


def test_set_equal_comparable_and_mixed_numbers():
    assert set_equal([1, 1, 2], [2, 1], lambda a, b: a == b)  # a repeat counts once
    assert not set_equal([1, 2, 3], [2, 3], lambda a, b: a == b)
    assert not set_equal([], [1], lambda a, b: a == b)
    import sympy

    x = sympy.Symbol("x")
    assert comparable(x + 1, sympy.Integer(2))
    assert not comparable(sympy.Interval(0, 1), x > 1)
    assert plain_number("4 4/9") == (Fraction(40, 9), False)
    assert plain_number("-1 1/2") == (Fraction(-3, 2), False)
    assert plain_number("11 7/6") is None  # an improper fraction is not a mixed number


def test_warm_up_mathverify_imports_it_outside_any_limit():
    import sys

    from jaxrl_llm.rewards.engine import warm_up_mathverify

    warm_up_mathverify()
    assert "math_verify" in sys.modules
    assert mathverify_equal(r"[3, 4] \cup [1, 2]", r"[1, 2] \cup [3, 4]", 1e-4)
