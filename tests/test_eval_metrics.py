"""pass@k / avg@k / maj@k / format rate against hand-computed values; table and JSON output."""

import json
from fractions import Fraction
from math import comb

import pytest

from jaxrl_llm.eval.metrics import compute_metrics, format_table, majority_index, pass_at_k, write_json


def _pass_at_k_exact(n, c, k):
    return 1 - Fraction(comb(n - c, k), comb(n, k))  # comb(a, k) = 0 when a < k


@pytest.mark.parametrize("n,c,k,expected", [
    (5, 2, 2, 1 - 3 / 10),        # C(3,2)/C(5,2) = 3/10
    (10, 3, 5, 1 - 21 / 252),     # C(7,5)/C(10,5) = 21/252
    (4, 0, 1, 0.0),
    (4, 4, 1, 1.0),
    (3, 1, 3, 1.0),               # n - c < k: any 3 of 3 contain the correct one
    (8, 1, 1, 1 / 8),             # pass@1 = c / n
    (8, 5, 1, 5 / 8),
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_large_n_is_stable():
    for n, c, k in [(1000, 10, 100), (2000, 3, 1500), (500, 250, 64)]:
        assert pass_at_k(n, c, k) == pytest.approx(float(_pass_at_k_exact(n, c, k)), rel=1e-9)


def test_pass_at_k_bad_arguments():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)


def _numeric_equal(a, b):
    return float(a) == float(b)


def test_majority_index_groups_and_ties():
    assert majority_index(["5", "5.0", "6", "6", "6", None], _numeric_equal) == 2
    assert majority_index(["6", "5", "5.0", "6.00"], _numeric_equal) == 0  # 2-2 tie: the first group
    assert majority_index(["1", "2", "2.0"], _numeric_equal) == 1
    assert majority_index([None, None], _numeric_equal) is None


COMPLETIONS = [
    ["so \\boxed{3}", "so \\boxed{4}", "no answer here", "then \\boxed{3}"],   # gold 3: correct 1,0,0,1
    ["\\boxed{7}", "\\boxed{7}", "\\boxed{2}", "I give up"],                   # gold 2: correct 0,0,1,0
]
GOLDS = ["3", "2"]


def test_compute_metrics_all_samples():
    metrics = compute_metrics(COMPLETIONS, GOLDS)  # the project's verifier, extractor and equality
    assert metrics["k"] == 4 and metrics["num_problems"] == 2 and metrics["num_samples"] == 8
    assert metrics["avg@4"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert metrics["pass@1"] == pytest.approx(0.375)
    assert metrics["pass@4"] == pytest.approx(1.0)
    assert metrics["maj@4"] == pytest.approx((1.0 + 0.0) / 2)  # problem 1 votes 3 (right), problem 2 votes 7
    assert metrics["format_rate"] == pytest.approx(6 / 8)
    assert metrics["mean_length"] == pytest.approx(sum(len(t) for p in COMPLETIONS for t in p) / 8)


def test_compute_metrics_k_smaller_than_n():
    metrics = compute_metrics(COMPLETIONS, GOLDS, k=2, lengths=[[10, 20, 30, 40], [1, 2, 3, 4]])
    assert metrics["avg@2"] == pytest.approx((1 / 2 + 0) / 2)        # first two samples only
    # problem 1: n=4, c=2 -> 1 - C(2,2)/C(4,2) = 5/6; problem 2: n=4, c=1 -> 1 - C(3,2)/C(4,2) = 1/2
    assert metrics["pass@2"] == pytest.approx((5 / 6 + 1 / 2) / 2)
    assert metrics["maj@2"] == pytest.approx((1.0 + 0.0) / 2)         # 3-vs-4 tie -> 3; 7,7 -> 7
    assert metrics["mean_length"] == pytest.approx((100 + 10) / 8)


def test_compute_metrics_custom_verifier_and_errors():
    exact = lambda text, gold: float(text.strip() == gold)  # noqa: E731
    metrics = compute_metrics([["a", "b"], ["c", "c"]], ["a", "c"], exact, extract=lambda t: t, equal=str.__eq__)
    assert (metrics["avg@2"], metrics["maj@2"], metrics["pass@2"]) == (0.75, 1.0, 1.0)
    with pytest.raises(ValueError, match="k=3"):
        compute_metrics([["a", "b"]], ["a"], exact, k=3)
    with pytest.raises(ValueError, match="gold answers"):
        compute_metrics([["a"]], ["a", "b"], exact)


def test_table_and_json(tmp_path):
    results = {"gsm8k-100": {"num_problems": 100, "k": 8, "avg@8": 0.25, "pass@1": 0.25, "pass@8": 0.6,
                             "maj@8": 0.3, "mean_length": 181.25, "format_rate": 0.9},
               "arithmetic-heldout": {"num_problems": 100, "k": 8, "avg@8": 0.5, "pass@1": 0.5, "pass@8": 0.9,
                                      "maj@8": 0.6, "mean_length": 12.0, "format_rate": 1.0}}
    table = format_table(results).splitlines()
    assert table[0].split() == ["benchmark", "num_problems", "avg@8", "pass@1", "pass@8", "maj@8", "mean_length",
                                "format_rate"]
    assert table[2].split() == ["gsm8k-100", "100", "0.2500", "0.2500", "0.6000", "0.3000", "181.2", "0.9000"]
    assert len({len(line) for line in table}) == 1  # aligned columns
    path = write_json(tmp_path / "out" / "eval.json", results, settings={"k": 8})
    assert json.loads(path.read_text()) == {"results": results, "settings": {"k": 8}}
