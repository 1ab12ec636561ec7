"""Code-execution rewards: the completion's Python run against a task's tests in the sandbox.

A code task's gold answer is its tests, one Python statement per line (``assert add(2, 3) == 5``), as in the
bundled ``code-basic`` set (`jaxrl_llm.data.benchmarks`). The completion's program is its last fenced
```python block (else the whole text when it compiles as Python); it runs once per completion in
`jaxrl_llm.tools.run_python`'s sandbox, followed by a harness that runs each test on its own (an exception or
a failed assert fails that test only) and prints the count under a marker. The reward is the fraction of tests
passed (``mode="fraction"``) or 1 only when all pass (``mode="all"``); a program that does not compile, exits
early, times out or prints no count gets 0.

Limits: the program and the harness share one interpreter, so a program written to read the harness (its
source file, its frames) could forge the count; the marker is random per call, which defeats one that only
prints a line or exits early. The sandbox keeps whatever it does away from the run (docs/tools.md).
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import secrets
from typing import Sequence

_BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.S)


def extract_code(completion: str) -> str:
    """The program of a completion: its last ```python block, else the whole text if it compiles, else ""."""
    blocks = _BLOCK.findall(completion)
    if blocks:
        return blocks[-1]
    try:
        compile(completion, "<completion>", "exec")
    except (SyntaxError, ValueError):
        return ""
    return completion


def split_tests(tests: str | Sequence[str]) -> list[str]:
    """The tests of a gold answer: its non-empty lines (or the given statements)."""
    lines = tests.splitlines() if isinstance(tests, str) else list(tests)
    return [line for line in (t.strip() for t in lines) if line]


def _harness(code: str, tests: list[str], marker: str) -> str:
    return (f"{code}\n\n"
            f"def _jaxrl_llm_tests(_tests={json.dumps(tests)}):\n"
            "    passed = 0\n"
            "    for _test in _tests:\n"
            "        try:\n"
            "            exec(_test, globals())\n"
            "            passed += 1\n"
            "        except BaseException:\n"
            "            pass\n"
            f"    print({marker!r}, passed, len(_tests))\n\n"
            "_jaxrl_llm_tests()\n")


def run_tests(completion: str, tests: str | Sequence[str], *, timeout_s: float = 5.0, memory_mb: int = 512,
              isolation: str = "auto") -> tuple[int, int]:
    """(tests passed, tests) of the completion's program (`extract_code`) against `tests`, in the sandbox."""
    from jaxrl_llm.tools import run_python

    lines = split_tests(tests)
    if not lines:
        raise ValueError("run_tests: a code task needs at least one test line")
    code = extract_code(completion)
    if not code.strip():
        return 0, len(lines)
    try:
        compile(code, "<completion>", "exec")
    except (SyntaxError, ValueError):
        return 0, len(lines)
    marker = f"__jaxrl_llm_tests_{secrets.token_hex(8)}__"
    result = run_python(_harness(code, lines, marker), timeout_s=timeout_s, memory_mb=memory_mb, isolation=isolation)
    found = re.findall(re.escape(marker) + r" (\d+) (\d+)", result.stdout)
    if result.timed_out or not found:
        return 0, len(lines)
    passed, total = (int(x) for x in found[-1])
    return (min(passed, len(lines)), len(lines)) if total == len(lines) else (0, len(lines))


def code_reward(completions: Sequence[str], golds: Sequence[str], *, mode: str = "fraction", timeout_s: float = 5.0,
                memory_mb: int = 512, isolation: str = "auto", workers: int = 4, **meta) -> list[float]:
    """r = tests passed / tests (``mode="fraction"``) or 1 when every test passes (``mode="all"``), each gold
    being a task's tests (`run_tests`); `workers` sandboxed programs at once."""
    if mode not in ("fraction", "all"):
        raise ValueError(f"code_reward: mode must be 'fraction' or 'all', got {mode!r}")
    if len(completions) != len(golds):
        raise ValueError(f"code_reward: {len(completions)} completions but {len(golds)} golds")

    def score(pair):
        passed, total = run_tests(pair[0], pair[1], timeout_s=timeout_s, memory_mb=memory_mb, isolation=isolation)
        return passed / total if mode == "fraction" else float(passed == total)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(score, zip(completions, golds)))
