"""Limits that keep a hostile answer from stalling the verifier.

Two layers: a static screen (`complexity_problem`) that rejects inputs sympy could spend unbounded
time or memory on *before* sympy sees them — a C-level big-integer power such as
``10^{10^{10}}`` cannot be interrupted by any signal — and a wall-clock limit (`time_limit`) for
everything else. The process pool in `pool.py` adds a hard kill on top of both.
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
import time
from typing import Iterator

# Longest answer string handed to sympy; longer answers are compared as strings only.
MAX_SYMPY_CHARS = 400
# Deepest nesting of {}, () and [] handed to sympy (the ANTLR parser recurses per level).
MAX_NESTING = 16
# Largest integer allowed inside an exponent, a factorial or a binomial (2^{10000} has 3011 digits).
MAX_OPERATOR_INTEGER = 10_000
# Longest integer literal anywhere (a 1000-digit literal is still cheap; a million digits is not).
MAX_INTEGER_DIGITS = 1_000
# Largest integer exponent on a base that holds a variable: x^{9999} makes sympy's polynomial
# arithmetic (cancel, expand) work on thousands of terms, partly in C where no signal can stop it.
MAX_SYMBOLIC_EXPONENT = 1_000

_INTEGER = re.compile(r"\d+")
_FACTORIAL_OPERAND = re.compile(r"(\d+)\s*!")


class VerifierTimeout(BaseException):
    """Raised inside a comparison when its time limit expires.

    A BaseException so that the broad ``except Exception`` blocks inside sympy and the LaTeX
    parser cannot swallow it (the same reason KeyboardInterrupt is one).
    """


def _braced_or_token(text: str, start: int) -> str:
    """The operand that starts at ``start``: a balanced {...} group or one token."""
    while start < len(text) and text[start] == " ":
        start += 1
    if start < len(text) and text[start] in "{(":
        closer = "}" if text[start] == "{" else ")"
        depth = 0
        for i in range(start, len(text)):
            if text[i] == text[start]:
                depth += 1
            elif text[i] == closer:
                depth -= 1
                if depth == 0:
                    return text[start + 1 : i]
        return text[start + 1 :]
    match = re.match(r"-?[\w.]+|\\[a-zA-Z]+", text[start:])
    return match.group(0) if match else ""


def _exponents(text: str) -> Iterator[tuple[str, str]]:
    """(base, exponent) of every ``^`` or ``**`` in ``text``."""
    for match in re.finditer(r"\^|\*\*", text):
        yield _base_before(text, match.start()), _braced_or_token(text, match.end())


def _group_opening(text: str, close: int) -> int | None:
    """Index of the ``(`` or ``{`` that the ``)`` or ``}`` at ``close`` closes, or None when unbalanced."""
    closer = text[close]
    opener = "(" if closer == ")" else "{"
    depth = 0
    for i in range(close, -1, -1):
        if text[i] == closer:
            depth += 1
        elif text[i] == opener:
            depth -= 1
            if depth == 0:
                return i
    return None


def _base_before(text: str, end: int) -> str:
    """The operand that ends at ``end``: a balanced {...} or (...) group or one token."""
    while end > 0 and text[end - 1] == " ":
        end -= 1
    if end > 0 and text[end - 1] in "})":
        i = _group_opening(text, end - 1)
        if i is None:
            return text[:end - 1]
        # _{...}^{...} is a sum's, product's or integral's limits, not a power
        return "" if i > 0 and text[i - 1] == "_" else text[i + 1 : end - 1]
    match = re.search(r"(?:\\[a-zA-Z]+|[\w.]+)$", text[:end])
    return match.group(0) if match else ""


def _holds_variable(operand: str) -> bool:
    """True when ``operand`` has a letter outside LaTeX command names (\\pi, \\frac are not variables)."""
    return re.search(r"[a-zA-Z]", re.sub(r"\\[a-zA-Z]+", "", operand)) is not None


def _too_big(operand: str, limit: int = MAX_OPERATOR_INTEGER) -> bool:
    return any(int(number) > limit for number in _INTEGER.findall(operand[:200]))


def _factorial_of_factorial(text: str) -> bool:
    """True when a bracketed group followed by ``!`` holds another ``!`` (e.g. ``(10!)!``)."""
    for match in re.finditer(r"[)}]\s*!", text):
        i = _group_opening(text, match.start())
        if i is not None and "!" in text[i : match.start()]:
            return True
    return False


def complexity_problem(text: str) -> str | None:
    """Why ``text`` must not reach sympy, or None when it is safe to parse.

    Rejects: more than MAX_SYMPY_CHARS characters; nesting deeper than MAX_NESTING; unbalanced
    braces; power towers (an exponent that holds another ``^``); exponents, factorials or
    binomials with an integer above MAX_OPERATOR_INTEGER; exponents above MAX_SYMBOLIC_EXPONENT on a
    base that holds a variable; factorials of factorials; integer literals longer than MAX_INTEGER_DIGITS.
    """
    if len(text) > MAX_SYMPY_CHARS:
        return f"longer than {MAX_SYMPY_CHARS} characters"
    depth = 0
    for i, ch in enumerate(text):
        if ch in "{([" and (i == 0 or text[i - 1] != "\\" or ch == "{"):
            depth += 1
            if depth > MAX_NESTING:
                return f"nested deeper than {MAX_NESTING}"
        elif ch in "})]":
            depth = max(depth - 1, 0)
    if text.count("{") != text.count("}"):
        return "unbalanced braces"
    for base, exponent in _exponents(text):
        if "^" in exponent or "**" in exponent or "!" in exponent or "\\exp" in exponent:
            return "power tower in an exponent"
        if _too_big(exponent):
            return f"exponent above {MAX_OPERATOR_INTEGER}"
        if _holds_variable(base) and _too_big(exponent, MAX_SYMBOLIC_EXPONENT):
            return f"exponent above {MAX_SYMBOLIC_EXPONENT} on a variable"
    for match in _FACTORIAL_OPERAND.finditer(text):
        if int(match.group(1)) > MAX_OPERATOR_INTEGER // 10:
            return f"factorial above {MAX_OPERATOR_INTEGER // 10}!"
    if _factorial_of_factorial(text):
        return "factorial of a factorial"
    for match in re.finditer(r"\\(?:binom|dbinom|tbinom|choose)", text):
        if _too_big(text[match.end() : match.end() + 80]):
            return f"binomial above {MAX_OPERATOR_INTEGER}"
    if any(len(number) > MAX_INTEGER_DIGITS for number in _INTEGER.findall(text)):
        return f"integer longer than {MAX_INTEGER_DIGITS} digits"
    return None


# Re-raise interval and how long to keep re-raising: library code with a bare `except:` (sympy's evalf
# has some) can swallow one VerifierTimeout and carry on computing, so the limit fires again until the
# block has really been left.
_RETRY_INTERVAL = 0.05
_RETRY_FOR = 5.0
_deadline = [0.0]


def _raise_timeout(signum, frame):  # noqa: ARG001 - signal handler signature
    if time.monotonic() < _deadline[0]:
        signal.setitimer(signal.ITIMER_REAL, _RETRY_INTERVAL)
    raise VerifierTimeout()


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise VerifierTimeout in the block after ``seconds`` of wall time (SIGALRM based).

    Works in the main thread of a POSIX process; elsewhere it is a no-op and only the static
    screen (and the process pool's hard kill) protect the caller. An outer limit that expires
    sooner is kept, and re-armed with its remaining time on exit.
    """
    usable = (
        seconds is not None
        and seconds > 0
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return
    started = time.monotonic()
    previous_handler = signal.signal(signal.SIGALRM, _raise_timeout)
    outer_remaining, _ = signal.setitimer(signal.ITIMER_REAL, 0)
    own = seconds if outer_remaining <= 0 else min(seconds, outer_remaining)
    outer_deadline = _deadline[0]
    _deadline[0] = started + own + _RETRY_FOR
    signal.setitimer(signal.ITIMER_REAL, own)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _deadline[0] = outer_deadline
        signal.signal(signal.SIGALRM, previous_handler)
        if outer_remaining > 0:
            left = outer_remaining - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))
