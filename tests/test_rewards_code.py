"""Code-execution rewards (rewards.code): the program of a completion, its tests in the sandbox, the reward kinds,
the bundled code-basic task and the scorer with algorithm.verifier code."""

import numpy as np
import pytest

from jaxrl_llm.data import load_benchmark
from jaxrl_llm.rewards import code_reward, extract_code, run_tests
from jaxrl_llm.tools import SandboxUnavailableError, resolve_isolation

try:
    resolve_isolation("auto")
    SANDBOX = ""
except SandboxUnavailableError as err:  # the hostile-program tests assert that this machine has one
    SANDBOX = str(err)
needs_sandbox = pytest.mark.skipif(bool(SANDBOX), reason=f"no sandbox here: {SANDBOX}")

TESTS = "assert add(2, 3) == 5\nassert add(-4, 4) == 0\n\nassert add(100, 23) == 123"


def test_extract_code_takes_the_last_python_block_or_a_program():
    text = "Try:\n```python\ndef f(): return 1\n```\nBetter:\n```python\ndef f(): return 2\n```\nDone."
    assert extract_code(text) == "def f(): return 2\n"
    assert extract_code("def f():\n    return 3\n") == "def f():\n    return 3\n"  # a bare program
    assert extract_code("The answer is f(x) = 3.") == ""  # prose is no program
    assert extract_code("```py\nx = 1\n```") == "x = 1\n"


@needs_sandbox
def test_tests_pass_fail_and_break_one_by_one():
    right = "```python\ndef add(a, b):\n    return a + b\n```"
    off = "```python\ndef add(a, b):\n    return a - b if a < 0 else a + b\n```"  # fails add(-4, 4) only
    assert run_tests(right, TESTS) == (3, 3)
    assert run_tests(off, TESTS) == (2, 3)
    raising = "```python\ndef add(a, b):\n    raise RuntimeError('no')\n```"
    assert run_tests(raising, TESTS) == (0, 3)
    assert run_tests("no code here", TESTS) == (0, 3)
    assert run_tests("```python\ndef add(a, b) return\n```", TESTS) == (0, 3)  # a syntax error
    golds = [TESTS] * 3
    assert code_reward([right, off, raising], golds) == pytest.approx([1.0, 2 / 3, 0.0])
    assert code_reward([right, off, raising], golds, mode="all") == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="mode"):
        code_reward([right], [TESTS], mode="most")


@needs_sandbox
def test_a_program_that_exits_early_or_prints_a_count_gets_nothing():
    """The harness's marker is random per call: printing a pass count or leaving before the tests earns 0, and
    a program that never ends times out with 0."""
    fake = "```python\nprint('__jaxrl_llm_tests_0000000000000000__ 3 3')\nimport os\nos._exit(0)\n```"
    assert run_tests(fake, TESTS) == (0, 3)
    leaving = "```python\nimport sys\ndef add(a, b):\n    return a + b\nsys.exit(0)\n```"
    assert run_tests(leaving, TESTS) == (0, 3)
    looping = "```python\nwhile True:\n    pass\n```"
    assert run_tests(looping, TESTS, timeout_s=1.0) == (0, 3)


@needs_sandbox
def test_the_bundled_code_task_is_solvable_and_its_tests_discriminate():
    """Every code-basic record's tests pass on a reference solution written here and fail on a constant one."""
    records = load_benchmark("code-basic")
    assert len(records) == 32 and len({r["id"] for r in records}) == 32
    solutions = {
        "add": "def add(a, b): return a + b", "square": "def square(n): return n * n",
        "factorial": "import math\ndef factorial(n): return math.factorial(n)",
        "fizzbuzz": "def fizzbuzz(n):\n    return 'FizzBuzz' if n % 15 == 0 else 'Fizz' if n % 3 == 0 else "
                    "'Buzz' if n % 5 == 0 else str(n)",
        "unique": "def unique(xs):\n    out = []\n    for x in xs:\n        if x not in out: out.append(x)\n"
                  "    return out",
    }
    by_name = {r["id"].removeprefix("code-basic-"): r for r in records}
    texts = [f"```python\n{solutions[name]}\n```" for name in solutions]
    golds = [by_name[name]["answer"] for name in solutions]
    assert code_reward(texts, golds) == [1.0] * len(solutions)
    constant = [f"```python\ndef {name}(*args): return 0\n```" for name in solutions]
    assert all(r < 1.0 for r in code_reward(constant, golds))


@needs_sandbox
def test_the_scorer_with_the_code_verifier():
    from jaxrl_llm.run.config import load_config
    from jaxrl_llm.train.rollouts import RewardScorer

    cfg = load_config(None, ["algorithm.verifier=code", "algorithm.code_reward=fraction"])
    scorer = RewardScorer(cfg.algorithm, cfg.sampling, timeout=5.0, workers=0)
    right = "```python\ndef add(a, b):\n    return a + b\n```"
    off = "```python\ndef add(a, b):\n    return a - b if a < 0 else a + b\n```"
    correct, reward = scorer([right, off], [TESTS, TESTS], np.array([10, 10]))
    assert correct.tolist() == [True, False] and reward == pytest.approx([1.0, 2 / 3])
