"""Verifier accuracy and speed on other projects' test cases, ours beside math-verify, in one run.

    python benchmarks/verifier.py [--cases tests/data/verifier_peer_cases.jsonl] [--typical 400] [--workers 2]

Part 1, the peer cases (tests/data/verifier_peer_cases.jsonl, the case marked ``disputed`` left
out): each grader runs in a fresh process (no cache shared between graders), imports and warms
up untimed, then grades every case once, in file order, timing each case. Graders:
- ``jaxrl_llm``: `answers_equal` on bare answers and `math_reward` on completions, each under our
  default time limit (`rewards.DEFAULT_TIMEOUT`);
- ``math-verify (defaults)``: ``verify(parse(gold), parse(pred))`` with math-verify's default
  extraction (LaTeX and plain expressions) and its default timeouts;
- ``math-verify (peer config)``: the same with the extraction targets and float rounding each
  case's own test used (``peer_config``; letters for multiple choice) — its best showing.
Reported: accuracy, precision, recall, verifications per second (cases / total wall time) and
the slowest case.

Part 2 (``--typical N``): throughput on N typical MATH / GSM8K answers after ~400 characters of
reasoning, half right and half wrong, in one process and in a `VerifierPool`.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import pathlib
import random
import time

REASONING = "Let us reason step by step. " * 15
DEFAULT_CASES = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "verifier_peer_cases.jsonl"


def load_cases(path: pathlib.Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [row for row in rows if not row.get("disputed")]


def _ours_judge():
    from jaxrl_llm.rewards import answers_equal, math_reward
    from jaxrl_llm.rewards.parse import warm_up

    warm_up()

    def judge(row: dict) -> bool:
        if row["mode"] == "answer":
            return answers_equal(row["pred"], row["gold"])
        return math_reward(row["pred"], row["gold"]) == 1.0

    return judge


def _mathverify_judge(peer_config: bool):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, StringExtractionConfig, parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    defaults = [LatexExtractionConfig(), ExprExtractionConfig()]

    def configs(row: dict) -> tuple[list, dict]:
        config = row.get("peer_config") or {}
        if not peer_config or config.get("targets", "default") == "default":
            return defaults, {}
        boxed_first = config.get("boxed_priority0")
        latex = LatexExtractionConfig(boxed_match_priority=0) if boxed_first else LatexExtractionConfig()
        kinds = {"latex": latex, "expr": ExprExtractionConfig(), "letters": StringExtractionConfig()}
        rounding = {"float_rounding": config["precision"]} if config.get("precision") else {}
        return [kinds[target] for target in config["targets"]], rounding

    def judge(row: dict) -> bool:
        extraction, options = configs(row)
        return bool(verify(parse(row["gold"], extraction), parse(row["pred"], extraction), **options))

    verify(parse("$1$"), parse("$1$"))  # imports and caches, untimed
    return judge


def _grade(grader: str, path: str, queue) -> None:
    """Run in a fresh process: grade every case, send (verdicts, seconds per case)."""
    judge = _ours_judge() if grader == "jaxrl_llm" else _mathverify_judge(grader.endswith("(peer config)"))
    verdicts, seconds = [], []
    for row in load_cases(pathlib.Path(path)):
        started = time.perf_counter()
        try:
            verdict = bool(judge(row))
        except Exception:  # noqa: BLE001 - a grader that raises on a case answers "not equal"
            verdict = False
        seconds.append(time.perf_counter() - started)
        verdicts.append(verdict)
    queue.put((verdicts, seconds))


def grade_in_fresh_process(grader: str, path: pathlib.Path) -> tuple[list[bool], list[float]]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_grade, args=(grader, str(path), queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def peer_report(path: pathlib.Path) -> None:
    rows = load_cases(path)
    labels = [row["equal"] for row in rows]
    load_before = os.getloadavg()[0]
    print(f"{len(rows)} cases from {path.name} (disputed left out): {sum(labels)} equal, {len(rows) - sum(labels)} not")
    print(f"{'grader':28s} {'accuracy':>8s} {'precision':>9s} {'recall':>6s} {'verif/s':>8s} "
          f"{'slowest s':>9s}  slowest case")
    for grader in ("math-verify (defaults)", "math-verify (peer config)", "jaxrl_llm"):
        verdicts, seconds = grade_in_fresh_process(grader, path)
        tp = sum(v and l for v, l in zip(verdicts, labels))
        fp = sum(v and not l for v, l in zip(verdicts, labels))
        fn = sum(l and not v for v, l in zip(verdicts, labels))
        accuracy = sum(v == l for v, l in zip(verdicts, labels)) / len(rows)
        slowest = max(range(len(rows)), key=seconds.__getitem__)
        case = rows[slowest]
        print(f"{grader:28s} {accuracy:8.3f} {tp / max(tp + fp, 1):9.3f} {tp / max(tp + fn, 1):6.3f} "
              f"{len(rows) / sum(seconds):8.1f} {seconds[slowest]:9.3f}  #{slowest} {case['pred'][-50:]!r}")
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; {os.cpu_count()} CPU cores")


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


def typical_report(count: int, workers: int, timeout: float) -> None:
    from jaxrl_llm.rewards import VerifierPool, math_reward, score_batch
    from jaxrl_llm.rewards.parse import warm_up

    completions, golds = typical_items(count)
    warm_up()
    rows = []
    started, cpu = time.perf_counter(), time.process_time()
    direct = [math_reward(c, g, timeout=None) for c, g in zip(completions, golds)]
    rows.append(("single process, no time limit", time.perf_counter() - started, time.process_time() - cpu))
    fresh_completions, fresh_golds = typical_items(count, seed=1)
    started, cpu = time.perf_counter(), time.process_time()
    score_batch(fresh_completions, fresh_golds, timeout=timeout)
    rows.append(("single process, SIGALRM limit", time.perf_counter() - started, time.process_time() - cpu))
    with VerifierPool(workers, timeout=timeout) as pool:
        pool.wait_ready()
        pooled_completions, pooled_golds = typical_items(count, seed=2)
        started = time.perf_counter()
        pooled = pool.score(pooled_completions, pooled_golds)
        rows.append((f"pool of {workers} workers", time.perf_counter() - started, float("nan")))
        again = pool.score(completions, golds)
    assert pooled == [math_reward(c, g) for c, g in zip(pooled_completions, pooled_golds)]
    assert again == direct
    print(f"\n{count} typical items: {sum(direct):.0f} correct, {count - sum(direct):.0f} wrong")
    print(f"{'path':34s} {'wall s':>7s} {'verif/s':>8s} {'ms/item':>8s} {'cpu ms/item':>11s}")
    for name, seconds, cpu_seconds in rows:
        print(f"{name:34s} {seconds:7.2f} {count / seconds:8.1f} {1000 * seconds / count:8.2f} "
              f"{1000 * cpu_seconds / count:11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=pathlib.Path, default=DEFAULT_CASES)
    parser.add_argument("--typical", type=int, default=0, help="also time N typical items (0: skip)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args()
    peer_report(args.cases)
    if args.typical:
        typical_report(args.typical, args.workers, args.timeout)


if __name__ == "__main__":
    main()
