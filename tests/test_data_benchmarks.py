"""Benchmark registry, shipped offline sets, user benchmark files, and the reasoning-gym adapter."""

import json
import re

import pytest

from jaxrl_llm.data.arithmetic import ArithmeticTask
from jaxrl_llm.data.benchmarks import (BENCHMARKS, champ_from_json, gsm8k100_from_templates, load_benchmark,
                                       register_benchmark)
from jaxrl_llm.rewards import math_reward


def test_gsm8k_100_shipped():
    records = load_benchmark("gsm8k-100")
    assert len(records) == 100 and len({r["id"] for r in records}) == 100
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", r["answer"]) for r in records)
    toula = next(r for r in records if r["id"] == "gsm8k-test-11")
    assert toula["question"].startswith("Toula went to the bakery")
    assert toula["answer"] == str(3 * 68 + 2 * 80 + 6 * 55)  # the problem's own numbers, by hand
    assert all(r["solution"].rsplit("####", 1)[1].strip().replace(",", "") == r["answer"] for r in records)


def test_champ_shipped():
    records = load_benchmark("champ")
    assert len(records) == 270
    counts = {}
    for record in records:
        counts[record["category"]] = counts.get(record["category"], 0) + 1
    assert counts == {"Combinatorics": 40, "Inequality": 50, "Number-Theory": 80, "Polynomial": 50, "Sequence": 50}
    squares = next(r for r in records if r["id"] == "P_Combinatorics_37")
    assert squares["answer"] == "n(n+1)(2n+1)/6" and "or equivalently" in squares["answer_text"]


def test_arithmetic_heldout_registered_and_limit():
    assert load_benchmark("arithmetic-heldout") == ArithmeticTask().heldout_records()
    assert load_benchmark("arithmetic-heldout", limit=3) == ArithmeticTask().heldout_records()[:3]


def test_gsm8k_converter_on_written_toml(tmp_path):
    (tmp_path / "0000.toml").write_text(
        'question = "Ann has 1,000 beads and gets 250 more. How many?"\n'
        'answer = """\n1000 + 250 = <<1000+250=1250>>1250\n#### 1,250\n"""\nid_orig = 42\n')
    (tmp_path / "0001.toml").write_text('question = "q"\nanswer = "no marker"\nid_orig = 1\n')
    with pytest.raises(ValueError, match="0001.toml"):
        gsm8k100_from_templates(tmp_path)
    (tmp_path / "0001.toml").unlink()
    assert gsm8k100_from_templates(tmp_path) == [{
        "id": "gsm8k-test-42", "source": "gsm8k-100", "question": "Ann has 1,000 beads and gets 250 more. How many?",
        "answer": "1250", "solution": "1000 + 250 = <<1000+250=1250>>1250\n#### 1,250"}]


def test_champ_converter_on_written_json(tmp_path):
    path = tmp_path / "v0.json"
    path.write_text(json.dumps({"problems": {"P_Sequence_1": {
        "_text": "Find a_n.", "_answer": "sum of 2^i, or equivalently 2^n-1", "category": "Sequence"}}}))
    assert champ_from_json(path) == [{"id": "P_Sequence_1", "source": "champ", "question": "Find a_n.",
                                      "answer": "2^n-1", "answer_text": "sum of 2^i, or equivalently 2^n-1",
                                      "category": "Sequence"}]


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_user_benchmark_files_in_common_formats(tmp_path):
    math500 = _write(tmp_path / "math500.jsonl", [{
        "problem": "What is $\\frac12+\\frac14$?", "solution": "It is $\\boxed{\\frac{3}{4}}$.",
        "answer": "\\frac{3}{4}", "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"}])
    minerva = _write(tmp_path / "minerva.jsonl", [{"problem": "Speed?", "solution": "So $v=\\boxed{3e8}$ m/s."}])
    olympiad = _write(tmp_path / "olympiadbench.jsonl", [{
        "id": 2231, "question": "Find all x.", "final_answer": ["$1$", "$-2$"], "is_multiple_answer": True}])
    aime = _write(tmp_path / "aime24.jsonl", [{"id": 60, "problem": "Find m+n.", "solution": "...", "answer": "204"}])
    amc = _write(tmp_path / "amc23.jsonl", [{"id": 0, "question": "How many?", "answer": 27.0}])
    expected = {math500: ("test/algebra/1.json", "\\frac{3}{4}"), minerva: ("minerva-0", "3e8"),
                olympiad: ("2231", "1, -2"), aime: ("60", "204"), amc: ("0", "27")}
    for path, (record_id, answer) in expected.items():
        for file_format in (None, path.stem):
            [record] = load_benchmark(path, file_format=file_format)
            assert (record["id"], record["answer"], record["source"]) == (record_id, answer, path.stem)
    with pytest.raises(KeyError, match="unknown benchmark file format"):
        load_benchmark(aime, file_format="aime25")
    with pytest.raises(FileNotFoundError, match="neither a registered benchmark"):
        load_benchmark("math-9000")


def test_register_benchmark():
    register_benchmark("tiny-test-set", lambda: [{"id": "a", "source": "t", "question": "1+1?", "answer": "2"}])
    try:
        assert load_benchmark("tiny-test-set")[0]["answer"] == "2"
        with pytest.raises(KeyError, match="already registered"):
            register_benchmark("tiny-test-set", list)
    finally:
        del BENCHMARKS["tiny-test-set"]


DEMO_CONFIG = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+", "-"),
                   allow_parentheses=False, allow_negation=False)


def test_reasoning_gym_basic_arithmetic_answers_agree_with_verifier():
    import reasoning_gym
    from jaxrl_llm.data.reasoning_gym_tasks import reasoning_gym_records

    records = reasoning_gym_records("basic_arithmetic", size=20, seed=3, **DEMO_CONFIG)
    assert len(records) == 20 and records == reasoning_gym_records("basic_arithmetic", size=20, seed=3, **DEMO_CONFIG)
    dataset = reasoning_gym.create_dataset("basic_arithmetic", size=20, seed=3, **DEMO_CONFIG)
    for record, entry in zip(records, dataset):
        expression = record["metadata"]["expression"]
        assert record["question"] == f"Calculate {expression}."
        assert record["answer"] == str(eval(expression))  # the test's own arithmetic
        assert math_reward(f"{expression} = {record['answer']} \\boxed{{{record['answer']}}}", record["answer"]) == 1.0
        assert math_reward(f"\\boxed{{{int(record['answer']) + 1}}}", record["answer"]) == 0.0
        assert dataset.score_answer(record["answer"], entry) == 1.0


def test_reasoning_gym_chain_sum_gsm_symbolic_and_split():
    from jaxrl_llm.data.reasoning_gym_tasks import reasoning_gym_records, reasoning_gym_split

    for record in reasoning_gym_records("chain_sum", size=5, seed=0, min_terms=2, max_terms=3):
        assert record["answer"] == str(eval(record["metadata"]["expression"]))
    for record in reasoning_gym_records("gsm_symbolic", size=3, seed=0):
        assert record["answer"] == str(record["metadata"]["answer_value"])
        assert record["metadata"]["answer_cot"].rstrip().endswith(f"#### {record['answer']}")
    train, heldout = reasoning_gym_split("basic_arithmetic", train_size=150, heldout_size=50, **DEMO_CONFIG)
    assert len(heldout) == 50 and len(train) < 150  # the 2-term 1-digit space is small: repeats were dropped
    assert not {r["question"] for r in train} & {r["question"] for r in heldout}
    with pytest.raises(ValueError, match="no_such_task"):
        reasoning_gym_records("no_such_task", size=1)
