"""answers_equal on the hand-written table (precision / recall printed), normalisation and math_reward."""

import pytest

from jaxrl_llm.rewards import answers_equal, choice_letter, math_reward, normalize_answer
from verifier_cases import CASES


def _confusion(rows):
    counts = {"tp": 0, "fp": 0, "fn": 0, "tn": 0}
    wrong = []
    for prediction, gold, expected in rows:
        got = answers_equal(prediction, gold)
        key = ("t" if got == expected else "f") + ("p" if got else "n")
        counts[key] += 1
        if got != expected:
            wrong.append((prediction, gold, expected))
    return counts, wrong


def test_table_precision_and_recall(capsys):
    rows = [row for category in CASES.values() for row in category]
    assert len(rows) >= 150
    lines = [f"{'category':24s} {'cases':>5s} {'equal':>5s} {'prec':>6s} {'recall':>6s}"]
    total = {"tp": 0, "fp": 0, "fn": 0, "tn": 0}
    all_wrong = []
    for name, category in CASES.items():
        equal = sum(expected for _, _, expected in category)
        assert 0.3 <= equal / len(category) <= 0.7, f"{name} is not balanced: {equal}/{len(category)} equal"
        counts, wrong = _confusion(category)
        all_wrong += wrong
        for key in total:
            total[key] += counts[key]
        precision = counts["tp"] / max(counts["tp"] + counts["fp"], 1)
        recall = counts["tp"] / max(counts["tp"] + counts["fn"], 1)
        lines.append(f"{name:24s} {len(category):5d} {equal:5d} {precision:6.3f} {recall:6.3f}")
    precision = total["tp"] / (total["tp"] + total["fp"])
    recall = total["tp"] / (total["tp"] + total["fn"])
    lines.append(f"{'ALL':24s} {len(rows):5d} {total['tp'] + total['fn']:5d} {precision:6.3f} {recall:6.3f}")
    with capsys.disabled():
        print("\nverifier table:\n" + "\n".join(lines))
        for prediction, gold, expected in all_wrong:
            print(f"  mismatch: {prediction!r} vs {gold!r}, expected {expected}")
    assert precision == 1.0, f"false positives: {[w for w in all_wrong if not w[2]]}"
    assert recall >= 0.95, f"false negatives: {[w for w in all_wrong if w[2]]}"


@pytest.mark.parametrize(
    "raw, normalized",
    [
        (r"$\dfrac12$", r"\frac{1}{2}"),
        (r"\tfrac{3}{4}", r"\frac{3}{4}"),
        (r"\frac1{x}", r"\frac{1}{x}"),
        ("1{,}000", "1000"),
        ("1,234,567", "1234567"),
        ("1, 234", "1, 234"),  # a list, not a thousands separator
        (r"30^\circ", "30"),
        (r"45^{\circ}", "45"),
        (r"5\text{ cm}.", "5"),
        (r"\text{Monday}", "Monday"),
        (r"\left( 1,2 \right)", "(1,2)"),
        (r"50\%", "50"),
        (r"\$5", "5"),
        (r"2\,\sqrt2", r"2 \sqrt{2}"),
        ("7 apples", "7"),
        (".5", "0.5"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        ("infinity", r"\infty"),
        (r"\mathrm{km}", "km"),  # a bare unit word is kept: it is the whole answer
    ],
)
def test_normalize_answer(raw, normalized):
    assert normalize_answer(raw) == normalized


def test_choice_letter():
    assert choice_letter("(B)") == "B"
    assert choice_letter("option c") == "C"
    assert choice_letter("D.") == "D"
    assert choice_letter("12") is None
    assert choice_letter("AB") is None


def test_math_reward_extracts_then_compares():
    assert math_reward(r"so the total is $\boxed{\dfrac{1}{2}}$.", "0.5") == 1.0
    assert math_reward(r"first \boxed{3}, then corrected: \boxed{4}", "4") == 1.0
    assert math_reward(r"first \boxed{4}, then corrected: \boxed{3}", "4") == 0.0
    assert math_reward("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72") == 1.0
    assert math_reward("I am not sure.", "72") == 0.0  # no final answer
    assert math_reward(r"The answer is $x = 5$.", r"\boxed{5}") == 1.0


def test_answers_equal_inputs():
    assert answers_equal(None, "1") is False
    assert answers_equal("1", None) is False
    assert answers_equal("", "") is False
    with pytest.raises(TypeError, match="answers_equal expects strings"):
        answers_equal(1, "1")


def test_decimal_tolerance_is_relative_and_only_for_decimals():
    assert answers_equal("100.005", "100")  # |d| / 100.005 = 5e-5 <= 1e-4
    assert not answers_equal("100.02", "100")  # 2e-4 > 1e-4
    assert not answers_equal("100001", "100000")  # integers are exact
    assert not answers_equal(r"\frac{100001}{1000}", "100")  # fractions are exact
