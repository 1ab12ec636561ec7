"""extract_answer: boxed (nested, \\fbox, \\boxed 5), GSM8K ####, answer phrases, None."""

import time

import pytest

from jaxrl_llm.rewards import boxed_answer, extract_answer, extract_choice, last_boxed


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


@pytest.mark.parametrize(
    "text, answer",
    [
        # Minerva: the last marker of the line, then the math span after it
        ("Final Answer: The final answer is $24$. I hope it is correct.", "24"),
        ("Final Answer: The largest $n$ is 34.", "34"),  # prose: the value after its last "is"
        ("Final Answer: Jane started Sphere 3 hours ago. I hope it is correct.", "3"),  # first value
        (r"so \boxed{255} dollars. Final Answer: The final answer is $10,455$.", "10,455"),  # a later marker
        (r"Answer \( (9+1) \)", "(9+1)"),
        ("Answer $$ \n 9 \n $$", "9"),  # display math may span lines
        (r"\boxed{1} and \boxed{2}", "1, 2"),  # one answer in two boxes
        (r"$\boxed{2}, \boxed{3}$", "2, 3"),
        (r"\boxed{1} and and and or thus but \boxed{2}", "2"),  # far apart: the last box
        ("We find that $x < 3$.", "x < 3"),  # no marker: the last math span
        ("the number is not 10 which is 1,000.99m", "1,000.99"),  # ... or the last number after it
        ("答案：每份应该是 12 吨。", "12"),
        ('Final Answer: The final answer is \\"$12 $ and $13 $\\". I hope', "12, 13"),  # quoted spans
    ],
)
def test_extract_answer_markers_groups_and_fallback(text, answer):
    assert extract_answer(text) == answer


def test_extract_answer_without_fallback():
    assert extract_answer("so there are 12 of them", fallback=False) is None
    assert extract_answer("so there are 12 of them") == "12"
    assert extract_answer(r"so \boxed{12", fallback=True) is None  # an unclosed box is unfinished


def test_inline_math_does_not_cross_lines():
    from jaxrl_llm.rewards.extract import math_spans

    assert math_spans("a $x$ b $$y$$ c \\(z\\) d") == [(2, 5, "x"), (8, 13, "y"), (16, 21, "z")]
    assert math_spans("costs $5\nand $6") == []
    assert math_spans(r"pay \$5 and $7$") == [(12, 15, "7")]


def test_boxed_answer_groups():
    assert boxed_answer(r"\boxed{-2} \quad \text{and} \quad \boxed{1}") == "-2, 1"
    assert boxed_answer(r"first \boxed{3}, finally \boxed{4}") == "4"
    assert boxed_answer("no box") is None


@pytest.mark.parametrize(
    "text, letter",
    [
        ("D. it can't be A or B", "D"),  # a letter that opens the completion
        ("The answer is for sure D, it can't be A or B", "D"),  # the first letter after the marker
        ("It's not A because of x, therefore I think it's B", "B"),  # A sits in a negated clause
        ("B。不是 A", "B"),
        (r"so \boxed{(C)}", "C"),
        ("A triangle has three sides, so the answer is C", "C"),  # "A" here is an article
        ("I cannot tell", None),
    ],
)
def test_extract_choice(text, letter):
    assert extract_choice(text) == letter


def test_extraction_stays_fast_on_many_markers_and_dollars():
    text = "The answer is $ " * 3_000 + "answer: " * 3_000 + r"\boxed{" * 2_000 + "$ 1 $" * 2_000
    started = time.perf_counter()
    extract_answer(text)
    extract_choice(text)
    assert time.perf_counter() - started < 2.0  # quadratic scans took minutes here


def test_answer_tags_and_bare_answers():
    assert extract_answer("<think>2 + 2 is 4</think><answer>\nx^2+1\n</answer>") == "x^2+1"
    assert extract_answer("<think>so</think><answer>42</answer>", fallback=False) == "42"  # a tag states it
    assert extract_answer(r"<answer>$\boxed{4}$</answer>") == "4"
    assert extract_answer("x^2+1") == "x^2+1"  # a short text without prose is itself the answer
    assert extract_answer("1, 2") == "1, 2"
    assert extract_answer("x^2+1", fallback=False) is None


def test_worded_answers_after_a_marker():
    assert extract_answer("Thus the answer is Monday.") == "Monday"
    assert extract_answer("The answer is not clear yet, let me think. So 5") == "5"  # talk, not an answer


def test_a_word_set_as_math_is_an_answer():
    assert extract_answer("so the sum is $odd$") == "odd"
    assert extract_answer("how many $? just about 1$") == "1"  # prose between dollar signs: its number


def test_only_the_text_after_thinking_counts():
    assert extract_answer(r"<think> maybe \boxed{42} </think> so \boxed{43}.") == "43"
    assert extract_answer(r"<think> my answer is \boxed{42} </think> Some other text.") is None
    assert extract_answer(r"reasoning </think> \boxed{7}") == "7"
    assert extract_answer(r"<think> unfinished, \boxed{7}") is None
    assert extract_choice("<think>A or B?</think> B") == "B"


def test_a_negated_value_after_a_marker_is_ruled_out():
    assert extract_answer("The answer is not 5, it is 6.") == "6"
