"""Hostile answers: every one returns False within the configured time limit, none runs code."""

import subprocess
import sys
import time

import pytest

from jaxrl_llm.rewards import (
    VerifierTimeout,
    answers_equal,
    complexity_problem,
    math_reward,
    time_limit,
    to_sympy,
)
from verifier_cases import HOSTILE

TIMEOUT = 1.0
# SIGALRM delivery and unwinding on a loaded machine: wide, since CI machines are loaded (0.53 s past the limit was
# seen beside a 2-worker test run); an input the limit failed to stop runs far longer (sympy on 10^{9999}).
OVERHEAD = 4.0


@pytest.fixture(scope="module", autouse=True)
def warm_parser():
    answers_equal(r"\frac{1}{2}", "0.5")  # sympy and the parser load once, outside the measurements


def test_hostile_inputs_return_false_within_timeout(capsys):
    assert len(HOSTILE) >= 20
    slowest = 0.0
    for prediction, gold in HOSTILE:
        started = time.perf_counter()
        result = answers_equal(prediction, gold, timeout=TIMEOUT)
        elapsed = time.perf_counter() - started
        slowest = max(slowest, elapsed)
        assert result is False, prediction[:60]
        assert elapsed < TIMEOUT + OVERHEAD, f"{prediction[:60]!r} took {elapsed:.2f} s"
        assert math_reward(r"\boxed{" + prediction + "}", gold, timeout=TIMEOUT) == 0.0
    with capsys.disabled():
        print(f"\n{len(HOSTILE)} hostile inputs, slowest {slowest:.3f} s (limit {TIMEOUT} s)")


@pytest.mark.parametrize(
    "text, reason",
    [
        (r"10^{10^{10}}", "power tower"),
        ("2^{123456}", "exponent above"),
        ("1000000!", "factorial above"),
        ("(5!)!", "factorial of a factorial"),
        (r"\binom{100000}{3}", "binomial above"),
        ("{" * 20 + "}" * 20, "nested deeper"),
        (r"\frac{1}{2", "unbalanced braces"),
        ("1" * 401, "longer than"),
        (r"\frac{x^{9999}-1}{x-1}", "on a variable"),
        ("(x+1)^{1001}", "on a variable"),
        ("2y ** 5000", "on a variable"),
    ],
)
def test_complexity_screen(text, reason):
    assert reason in complexity_problem(text)


def test_complexity_screen_lets_ordinary_answers_through():
    for text in [r"2^{10}", r"\frac{\sqrt{3}}{2}", "10!", r"\binom{10}{3}", "(x+1)^2", "9" * 300, "2^{5000}",
                 r"\pi^{2000}", "x^{1000}", r"\sum_{k=1}^{2000} k", r"\prod_{k=1}^{1500} (1 + k)"]:
        assert complexity_problem(text) is None, text
    assert to_sympy("9" * 300) == int("9" * 300)


def test_code_like_strings_are_not_executed():
    marker = "jaxrl_llm_verifier_probe"
    attacks = [
        f"__import__('sys').modules.__setitem__('{marker}', 1)",
        f"setattr(__import__('sys'), '{marker}', 1)",
        f"exec(\"import sys; sys.{marker} = 1\")",
    ]
    for attack in attacks:
        assert answers_equal(attack, "1") is False
        assert to_sympy(attack) is None or marker not in sys.modules
    assert marker not in sys.modules and not hasattr(sys, marker)


def test_time_limit_interrupts_and_restores_outer_limit():
    started = time.perf_counter()
    with pytest.raises(VerifierTimeout):
        with time_limit(0.2):
            while True:
                pass
    assert 0.15 < time.perf_counter() - started < 0.2 + OVERHEAD  # a busy loop: only the alarm ends it
    # An inner limit inside a longer outer one: the inner fires first, the outer still fires later.
    with pytest.raises(VerifierTimeout):
        with time_limit(0.5):
            with pytest.raises(VerifierTimeout):
                with time_limit(0.1):
                    while True:
                        pass
            while True:
                pass
    assert time.perf_counter() - started < 0.5 + OVERHEAD


def test_answers_equal_timeout_is_honoured(monkeypatch):
    # The screens now turn every slow input we know of away before sympy (the old case here, a 9997-term sum,
    # returned in 0.0 s), so the comparison itself is made to spin: only the timer can stop it.
    from jaxrl_llm.rewards import equivalence

    def spin(*args):
        while True:
            pass

    monkeypatch.setattr(equivalence, "_equal", spin)
    started = time.perf_counter()
    assert answers_equal("1", "2", timeout=0.3) is False
    assert 0.25 < time.perf_counter() - started < 0.3 + OVERHEAD  # it spun until the alarm


def test_import_loads_neither_jax_nor_sympy():
    code = (
        "import sys, jaxrl_llm.rewards; "
        "heavy = [m for m in ('jax', 'flax', 'transformers', 'grain', 'sympy') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_mathverify_second_opinion_does_not_execute_code():
    from jaxrl_llm.rewards.engine import mathverify_equal

    marker = "jaxrl_llm_verifier_probe_mv"
    attacks = [
        f"__import__('sys').modules.__setitem__('{marker}', 1)",
        f"(lambda: __import__('sys').modules.__setitem__('{marker}', 1))()",
        f"\\text{{__import__('sys').modules.__setitem__('{marker}', 1)}}",
    ]
    for attack in attacks:
        assert mathverify_equal(attack, "1", 1e-4) is False
        assert answers_equal(r"\{" + attack + r"\}", r"\{1\}") is False
    assert marker not in sys.modules
