"""`calculator`: exact arithmetic on an expression a model wrote, without exec.

The expression is parsed with Python's `ast` and only numbers, parentheses, unary + and -, and the binary
operators + - * / // % ** are evaluated, on exact rationals (`fractions.Fraction`): `0.1 + 0.2` is 0.3,
`2 ** 100` has all its 31 digits. `^` means power and `×` / `÷` mean * and / (how people write them).
A non-integer power falls back to a float. Sizes are bounded (expression length, nesting, bits of every
intermediate value), and any bad input comes back as an error in the result, never as an exception.
"""

import ast
import decimal
import fractions
import math
import operator

from jaxrl_llm.tools.sandbox import ToolResult

MAX_EXPRESSION_CHARS = 2000
MAX_BITS = 100_000  # numerator + denominator of any intermediate value (about 30,000 decimal digits)
MAX_DECIMAL_PLACES = 30  # 1/8 prints as 0.125; longer terminating decimals print as a fraction

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


class _Refused(ValueError):
    pass


def calculator(expression: str) -> ToolResult:
    """Evaluates `expression` exactly; stdout is the value (an integer, a terminating decimal, `p/q` with
    its float beside it, or a float from a fractional power), returncode 0; on a malformed or oversized
    expression stdout is empty, stderr says why and returncode is 1.

    >>> calculator("12345 * 6789").stdout
    '83810205'
    >>> calculator("(1 + 2) / 4 - 0.1").stdout
    '0.65'
    >>> calculator("2 / 3").stdout
    '2/3 ≈ 0.6666666666666666'
    >>> calculator("1 / 0").stderr
    'error: division by zero'
    """
    try:
        value = _evaluate(expression)
    except _Refused as exc:
        return ToolResult("", f"error: {exc}", 1, False, isolation="calculator")
    return ToolResult(_format(value), "", 0, False, isolation="calculator")


def _evaluate(expression):
    if not isinstance(expression, str):
        raise _Refused(f"expected a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise _Refused(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    text = expression.replace("^", "**").replace("×", "*").replace("÷", "/").strip()
    if not text:
        raise _Refused("empty expression")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise _Refused(f"not an arithmetic expression: {getattr(exc, 'msg', exc)}") from None
    try:
        return _node(tree.body, text)
    except RecursionError:
        raise _Refused("expression nested too deeply") from None


def _node(node, text):
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise _Refused(f"only numbers are allowed, got {ast.get_source_segment(text, node) or node.value!r}")
        if isinstance(node.value, int):
            return _bounded(fractions.Fraction(node.value))
        literal = decimal.Decimal((ast.get_source_segment(text, node) or repr(node.value)).replace("_", ""))
        if abs(literal.adjusted()) > MAX_BITS // 4:  # 1e999999999 would take 10**999999999 to make exact
            raise _Refused(f"result too large (over {MAX_BITS} bits)")
        return _bounded(fractions.Fraction(literal))  # the decimal as written, exactly
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _node(node.operand, text)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return _power(_node(node.left, text), _node(node.right, text))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _node(node.left, text), _node(node.right, text)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise _Refused("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    segment = ast.get_source_segment(text, node) or type(node).__name__
    raise _Refused(f"only numbers and + - * / // % ** ( ) are allowed, got {segment!r}")


def _power(base, exponent):
    if isinstance(base, float) or isinstance(exponent, float) or exponent.denominator != 1:
        if base < 0:
            raise _Refused("a fractional power of a negative number is not a real number")
        try:
            return float(base) ** float(exponent)
        except (OverflowError, ZeroDivisionError) as exc:
            raise _Refused(f"power out of range: {exc}") from None
    if base == 0 and exponent < 0:
        raise _Refused("division by zero")
    bits = max(base.numerator.bit_length(), base.denominator.bit_length()) if abs(base) != 1 else 0
    if bits * abs(exponent.numerator) > MAX_BITS:
        raise _Refused(f"result too large (over {MAX_BITS} bits)")
    return _bounded(base ** exponent.numerator)


def _bounded(value):
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _Refused("result out of float range")
        return value
    if value.numerator.bit_length() + value.denominator.bit_length() > MAX_BITS:
        raise _Refused(f"result too large (over {MAX_BITS} bits)")
    return value


def _format(value) -> str:
    if isinstance(value, float):
        return repr(value)
    if value.denominator == 1:
        return str(value.numerator)
    denominator, twos, fives = value.denominator, 0, 0
    while denominator % 2 == 0:
        denominator, twos = denominator // 2, twos + 1
    while denominator % 5 == 0:
        denominator, fives = denominator // 5, fives + 1
    places = max(twos, fives)
    if denominator == 1 and places <= MAX_DECIMAL_PLACES:  # a terminating decimal, written out exactly
        digits = str(abs(value.numerator) * 10 ** places // value.denominator).rjust(places + 1, "0")
        return ("-" if value < 0 else "") + digits[:-places] + "." + digits[-places:]
    return f"{value.numerator}/{value.denominator} ≈ {float(value)!r}"
