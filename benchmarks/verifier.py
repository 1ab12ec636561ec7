"""Verifier throughput: verifications per second on typical answers, in one process and pooled.

    python benchmarks/verifier.py [--items 400] [--workers 2] [--timeout 5]

Items mix the answer forms of MATH / GSM8K grading (integers, fractions vs decimals, radicals,
polynomials, tuples, GSM8K markers), half right and half wrong, each after ~400 characters of
reasoning. Numbers vary per item so sympy's result cache does not flatter the timings.
"""

from __future__ import annotations

import argparse
import os
import random
import time

from jaxrl_llm.rewards import VerifierPool, math_reward, score_batch
from jaxrl_llm.rewards.parse import warm_up

REASONING = "Let us reason step by step. " * 15


def _item(kind: int, rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    k, m = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7, 10, 11])
    wrong = rng.random() < 0.5
    if kind == 0:
        return rf"{REASONING} so $\boxed{{{a + wrong}}}$.", str(a)
    if kind == 1:
        return rf"{REASONING} $\boxed{{\frac{{{a}}}{{{b}}}}}$", f"{a / b + wrong:.6f}"
    if kind == 2:
        return rf"{REASONING} \boxed{{\sqrt{{{k * k * m}}}}}", rf"{k + wrong}\sqrt{{{m}}}"
    if kind == 3:
        return rf"{REASONING} \boxed{{(x+{a})^2}}", f"x^2+{2 * a + wrong}x+{a * a}"
    if kind == 4:
        return rf"{REASONING} The answer is $({a}, {b})$.", f"({a}, {b + wrong})"
    return f"{REASONING}\n#### {a:,}", str(a * 1000 + wrong) if a >= 1000 else str(a + wrong)


def typical_items(count: int, seed: int = 0) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    pairs = [_item(index % 6, rng) for index in range(count)]
    return [pair[0] for pair in pairs], [pair[1] for pair in pairs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=400)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args()

    completions, golds = typical_items(args.items)
    warm_up()
    rows = []

    started, cpu = time.perf_counter(), time.process_time()
    direct = [math_reward(c, g, timeout=None) for c, g in zip(completions, golds)]
    rows.append(("single process, no time limit", time.perf_counter() - started, time.process_time() - cpu))

    fresh_completions, fresh_golds = typical_items(args.items, seed=1)
    started, cpu = time.perf_counter(), time.process_time()
    score_batch(fresh_completions, fresh_golds, timeout=args.timeout)
    rows.append(("single process, SIGALRM limit", time.perf_counter() - started, time.process_time() - cpu))

    with VerifierPool(args.workers, timeout=args.timeout) as pool:
        pool.wait_ready()
        pooled_completions, pooled_golds = typical_items(args.items, seed=2)
        started = time.perf_counter()
        pooled = pool.score(pooled_completions, pooled_golds)
        rows.append((f"pool of {args.workers} workers", time.perf_counter() - started, float("nan")))
        again = pool.score(completions, golds)
    assert pooled == [math_reward(c, g) for c, g in zip(pooled_completions, pooled_golds)]
    assert again == direct

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {os.cpu_count()} CPU cores, load average {load:.1f}; {args.items} items; "
          f"{sum(direct):.0f} correct, {args.items - sum(direct):.0f} wrong")
    print(f"{'path':34s} {'wall s':>7s} {'verif/s':>8s} {'ms/item':>8s} {'cpu ms/item':>11s}")
    for name, seconds, cpu_seconds in rows:
        print(f"{name:34s} {seconds:7.2f} {args.items / seconds:8.1f} {1000 * seconds / args.items:8.2f} "
              f"{1000 * cpu_seconds / args.items:11.2f}")


if __name__ == "__main__":
    main()
