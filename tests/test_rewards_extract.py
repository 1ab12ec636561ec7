"""extract_answer: boxed (nested, \\fbox, \\boxed 5), GSM8K ####, answer phrases, None."""

import time

import pytest

from jaxrl_llm.rewards import extract_answer, last_boxed


@pytest.mark.parametrize(
    "text, answer",
    [
        (r"so $\boxed{5}$.", "5"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\frac{\sqrt{3}}{2}} is it", r"\frac{\sqrt{3}}{2}"),  # nested braces
        (r"first \boxed{3}, finally \boxed{4}", "4"),  # the last box wins
        (r"\fbox{7}", "7"),
        (r"\boxed 5", "5"),
        (r"$\boxed 12$", "12"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces inside a box
        (r"\boxed{\text{(B)}}", r"\text{(B)}"),
        (r"ok \boxed{2} then \boxed{3", "2"),  # a truncated last box is skipped
        ("Natalia sold 72 clips.\n#### 72", "72"),
        ("#### 1,234\n", "1,234"),
        ("Thus, the answer is 7.", "7"),
        ("The final answer is $x = 3$. I hope", "x = 3"),
        ("Reasoning...\nAnswer: 12", "12"),
        ("Answer: 3\nwait, no.\nFinal Answer: 4", "4"),
        (r"The answer is 5 but \boxed{6}", "6"),  # a box beats a phrase
        ("#### 9\nThe answer is 8", "9"),  # the GSM8K marker beats a phrase
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    "text", ["", None, "I do not know.", r"\boxed{}", r"\boxed{unclosed", r"\boxedx 5", "The answer is", "####"]
)
def test_no_final_answer(text):
    assert extract_answer(text) is None


def test_last_boxed_ignores_malformed():
    assert last_boxed(r"\boxed{1} \boxed{2}") == "2"
    assert last_boxed("no box") is None


def test_extract_rejects_non_strings():
    with pytest.raises(TypeError, match="string completion"):
        extract_answer(42)


def test_extraction_is_linear_on_long_text():
    text = "{" * 20_000 + r"\boxed{" * 5_000 + "x" * 20_000 + "The answer is 3"
    started = time.perf_counter()
    assert extract_answer(text) == "3"
    assert time.perf_counter() - started < 1.0
