"""Benchmark evaluation: avg@k, pass@k (unbiased), maj@k, mean length and format rate of k samples."""

from jaxrl_llm.eval.evaluate import evaluate, evaluate_benchmarks
from jaxrl_llm.eval.metrics import (compute_metrics, format_table, majority_index, pass_at_k, print_table,
                                    score_samples, write_json)

__all__ = ["compute_metrics", "evaluate", "evaluate_benchmarks", "format_table", "majority_index", "pass_at_k",
           "print_table", "score_samples", "write_json"]
