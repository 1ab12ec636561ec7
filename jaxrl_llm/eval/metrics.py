"""Benchmark metrics over k sampled completions per problem: avg@k, pass@k, maj@k, length, format rate.

- avg@k: mean over problems of the fraction of the first k samples judged correct (DESIGN.md's
  evaluation metric; equals pass@1 estimated from k samples).
- pass@k: the unbiased estimator of Chen et al. 2021 (Codex, "Evaluating Large Language Models
  Trained on Code"), from all n >= k samples with c correct: 1 - C(n-c, k) / C(n, k), evaluated as
  1 - prod_{i=n-c+1..n} (1 - k / i) so no binomial coefficient overflows.
- maj@k: the first k samples' extracted answers are grouped with an equality function; the largest
  group wins (ties: the group seen first); the problem counts as solved when that group's first
  sample is correct. Samples with no extracted answer do not vote.
- mean_length: mean generated tokens per sample (characters when no token lengths are given).
- format_rate: fraction of samples with an extractable final answer.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Callable, Sequence

Verifier = Callable[[str, str], float]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority_index(answers: Sequence[str | None], equal: Callable[[str, str], bool]) -> int | None:
    """Index of the first member of the largest group of equal answers (ties: first group); None if no answer.

    Answers are compared with ``equal`` against each group's first member (exact string match is tried first).
    """
    groups: list[list[int]] = []
    for index, answer in enumerate(answers):
        if answer is None:
            continue
        for group in groups:
            representative = answers[group[0]]
            if answer == representative or equal(answer, representative):
                group.append(index)
                break
        else:
            groups.append([index])
    if not groups:
        return None
    best = max(groups, key=len)  # max keeps the first of equally large groups
    return best[0]


def _default_extract():
    from jaxrl_llm.rewards import extract_answer

    return extract_answer


def _default_equal():
    from jaxrl_llm.rewards import answers_equal

    return answers_equal


def _default_verify():
    from jaxrl_llm.rewards import math_reward

    return math_reward


def score_samples(completions: Sequence[Sequence[str]], golds: Sequence[str], verify: Verifier | None = None,
                  *, extract: Callable[[str], str | None] | None = None):
    """Per-sample correctness (1.0/0.0: verify(completion, gold) > 0) and extracted answers, per problem."""
    if len(completions) != len(golds):
        raise ValueError(f"{len(completions)} problems of completions but {len(golds)} gold answers")
    verify = verify or _default_verify()
    extract = extract or _default_extract()
    correct = [[1.0 if verify(text, gold) > 0 else 0.0 for text in texts] for texts, gold in zip(completions, golds)]
    answers = [[extract(text) for text in texts] for texts in completions]
    return correct, answers


def compute_metrics(completions: Sequence[Sequence[str]], golds: Sequence[str], verify: Verifier | None = None, *,
                    k: int | None = None, extract: Callable[[str], str | None] | None = None,
                    equal: Callable[[str, str], bool] | None = None,
                    lengths: Sequence[Sequence[int]] | None = None, scored=None) -> dict:
    """The metrics dict for n completions per problem (see the module docstring for each formula).

    k defaults to the smallest n; every problem needs n >= k samples. ``verify`` defaults to
    ``jaxrl_llm.rewards.math_reward``, ``extract`` to ``extract_answer``, ``equal`` to ``answers_equal``.
    ``scored`` = (correct, answers) from ``score_samples`` skips re-verifying.
    Keys: num_problems, num_samples, k, avg@k, pass@1, pass@k, maj@k, mean_length, format_rate.
    """
    if not completions:
        raise ValueError("no problems to score")
    n_min = min(len(texts) for texts in completions)
    k = n_min if k is None else k
    if not 1 <= k <= n_min:
        raise ValueError(f"k={k} needs at least k samples for every problem; the fewest is {n_min}")
    correct, answers = scored if scored is not None else score_samples(completions, golds, verify, extract=extract)
    equal = equal or _default_equal()
    avg, pass_1, pass_k, maj = [], [], [], []
    for problem_correct, problem_answers in zip(correct, answers):
        n, c = len(problem_correct), int(sum(problem_correct))
        avg.append(sum(problem_correct[:k]) / k)
        pass_1.append(pass_at_k(n, c, 1))
        pass_k.append(pass_at_k(n, c, k))
        winner = majority_index(problem_answers[:k], equal)
        maj.append(problem_correct[winner] if winner is not None else 0.0)
    all_answers = [answer for problem_answers in answers for answer in problem_answers]
    if lengths is not None:
        all_lengths = [int(length) for problem_lengths in lengths for length in problem_lengths]
    else:
        all_lengths = [len(text) for texts in completions for text in texts]
    mean = lambda values: sum(values) / len(values)  # noqa: E731 - a one-line helper
    metrics = {"num_problems": len(completions), "num_samples": len(all_answers), "k": k,
               f"avg@{k}": mean(avg), "pass@1": mean(pass_1), f"pass@{k}": mean(pass_k), f"maj@{k}": mean(maj),
               "mean_length": mean(all_lengths),
               "format_rate": sum(answer is not None for answer in all_answers) / len(all_answers)}
    return metrics


_TABLE_KEYS = ("avg@", "pass@", "maj@", "mean_length", "format_rate", "num_problems")


def format_table(results: dict[str, dict]) -> str:
    """A plain-text table: one row per benchmark, columns avg@k, pass@1, pass@k, maj@k, length, format, n."""
    columns: list[str] = []
    for metrics in results.values():
        for key in metrics:
            if key.startswith(_TABLE_KEYS) and key not in columns:
                columns.append(key)
    header = ["benchmark"] + columns
    rows = [[name] + [_cell(metrics.get(key)) for key in columns] for name, metrics in results.items()]
    widths = [max(len(str(row[i])) for row in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(width) if i == 0 else str(cell).rjust(width)
                       for i, (cell, width) in enumerate(zip(row, widths))) for row in [header] + rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if value <= 1.0 else f"{value:.1f}"
    return str(value)


def print_table(results: dict[str, dict]) -> None:
    print(format_table(results))


def write_json(path: str | os.PathLike, results: dict, **extra) -> pathlib.Path:
    """Writes ``{"results": results, **extra}`` as indented JSON (parent folders created); returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"results": results, **extra}, indent=2, sort_keys=False) + "\n")
    return path
