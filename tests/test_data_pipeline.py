"""Procedural task split, prompt building, and the grain pipeline (order, resume, sharding)."""

import itertools
import json

import pytest

from jaxrl_llm.data.arithmetic import ArithmeticTask, evaluate_expression
from jaxrl_llm.data.pipeline import LoaderConfig, RecordBatches
from jaxrl_llm.data.prompts import (ARITHMETIC_EXEMPLARS, DEFAULT_SYSTEM_PROMPT, PromptTemplate, build_prompts,
                                    prompt_template)


class CharTokenizer:
    """One token per UTF-8 byte and a ChatML chat template: lengths are easy to compute by hand."""

    def encode(self, text, add_special_tokens=False):
        return ([1] if add_special_tokens else []) + list(text.encode("utf-8"))

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


# -- procedural arithmetic ---------------------------------------------------------------------------

def test_evaluate_expression_precedence():
    assert evaluate_expression((7, 9), ("-",)) == -2
    assert evaluate_expression((2, 3, 4), ("+", "*")) == 14
    assert evaluate_expression((2, 3, 4, 5), ("*", "-", "*")) == -14
    assert evaluate_expression((9, 4, 3), ("-", "-")) == 2


def test_default_task_split_is_fixed_disjoint_and_complete():
    task = ArithmeticTask()
    assert task.space_size == 10 * 10 * 2
    heldout, train = task.heldout_records(), task.train_records()
    assert len(heldout) == 100 and len(train) == 100
    heldout_exprs = {r["expression"] for r in heldout}
    train_exprs = {r["expression"] for r in train}
    assert not heldout_exprs & train_exprs
    every = {f"{a} {op} {b}" for a in range(10) for b in range(10) for op in "+-"}
    assert heldout_exprs | train_exprs == every
    assert heldout == ArithmeticTask().heldout_records()  # fixed: independent of any seed or instance
    for record in heldout + train:
        a, op, b = record["expression"].split()
        assert record["answer"] == str(int(a) + int(b) if op == "+" else int(a) - int(b))
        assert record["question"] == f"Calculate {record['expression']}."
    # exemplars of the demo prompt must not be evaluation problems
    for question, _ in ARITHMETIC_EXEMPLARS:
        assert question.removeprefix("Calculate ").removesuffix(".") in train_exprs


def test_sampled_train_records_deterministic_and_never_heldout():
    task = ArithmeticTask(min_terms=2, max_terms=3, min_digits=1, max_digits=2, operators=("+", "-", "*"))
    assert not task.enumerable
    first = task.train_records(30, seed=5)
    assert first == task.train_records(30, seed=5)
    assert task.train_records(40, seed=5)[:30] == first  # problem i depends only on (seed, i)
    assert first != task.train_records(30, seed=6)
    heldout = task.heldout_records()
    assert len(heldout) == 100 and len({r["expression"] for r in heldout}) == 100
    assert all(task.is_heldout(r["expression"]) for r in heldout)
    assert not any(task.is_heldout(r["expression"]) for r in task.train_records(300, seed=0))
    for record in first:
        numbers = [int(x) for x in record["expression"].split()[::2]]
        assert 2 <= len(numbers) <= 3 and all(0 <= n <= 99 for n in numbers)
        assert record["answer"] == str(eval(record["expression"]))  # the test's own reference evaluator


def test_task_config_errors():
    with pytest.raises(ValueError, match="leaves no training problems"):
        ArithmeticTask(heldout_size=200)
    with pytest.raises(ValueError, match="operators"):
        ArithmeticTask(operators=("/",))
    with pytest.raises(ValueError, match="min_terms"):
        ArithmeticTask(min_terms=1)


# -- prompts ------------------------------------------------------------------------------------------

def test_default_chat_prompt_text():
    template = PromptTemplate()
    text = template.render("What is 1+1?", CharTokenizer())
    assert text == ("<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}."
                    "<|im_end|>\n<|im_start|>user\nWhat is 1+1? Let's think step by step and output the final "
                    "answer within \\boxed{}<|im_end|>\n<|im_start|>assistant\n")
    assert template.system == DEFAULT_SYSTEM_PROMPT


def test_fewshot_prompt_without_system():
    template = prompt_template("arithmetic-2shot")
    assert template.messages("Calculate 1 + 2.") == [
        {"role": "user", "content": "Calculate 8 - 3."}, {"role": "assistant", "content": "8 - 3 = 5 \\boxed{5}"},
        {"role": "user", "content": "Calculate 4 + 3."}, {"role": "assistant", "content": "4 + 3 = 7 \\boxed{7}"},
        {"role": "user", "content": "Calculate 1 + 2."}]


def test_raw_prompt_with_shots_and_overrides():
    template = prompt_template("raw", fewshot=[("1+1?", "2")], user_suffix="", raw_format="Q: {question}\nA:")
    assert template.render("2+2?") == "Q: 1+1?\nA: 2\n\nQ: 2+2?\nA:"
    with pytest.raises(KeyError, match="unknown prompt preset"):
        prompt_template("chatty")


def test_build_prompts_drops_long_and_counts():
    records = [{"id": "short", "question": "ab"}, {"id": "long", "question": "x" * 50}, {"id": "mid", "question": "abcd"}]
    template = prompt_template("raw", user_suffix="", raw_format="{question}", add_special_tokens=True)
    kept, stats = build_prompts(records, CharTokenizer(), template, max_prompt_tokens=5)
    assert [r["id"] for r in kept] == ["short", "mid"]
    assert kept[0]["prompt_ids"] == [1, ord("a"), ord("b")] and kept[1]["prompt"] == "abcd"
    assert (stats.kept, stats.dropped, stats.longest_kept) == (2, 1, 5)
    assert stats.dropped_ids == ["long (51 tokens)"]
    with pytest.raises(ValueError, match="every prompt is too long"):
        build_prompts(records[1:2], CharTokenizer(), template, max_prompt_tokens=5)


# -- grain pipeline -----------------------------------------------------------------------------------

RECORDS = [{"id": str(i), "question": f"q{i}", "answer": str(i)} for i in range(20)]


def _ids(batch):
    return [r["id"] for r in batch]


def test_epochs_are_permutations_and_seeded():
    loader = RecordBatches(RECORDS, LoaderConfig(batch_size=5, seed=3, shard_index=0, shard_count=1))
    assert loader.batches_per_epoch == 4
    epochs = [sum((_ids(next(loader)) for _ in range(4)), []) for _ in range(3)]
    for epoch in epochs:
        assert sorted(epoch, key=int) == [str(i) for i in range(20)]
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch
    again = RecordBatches(RECORDS, LoaderConfig(batch_size=5, seed=3, shard_index=0, shard_count=1))
    assert sum((_ids(next(again)) for _ in range(4)), []) == epochs[0]
    other_seed = RecordBatches(RECORDS, LoaderConfig(batch_size=5, seed=4, shard_index=0, shard_count=1))
    assert sum((_ids(next(other_seed)) for _ in range(4)), []) != epochs[0]


def test_finite_epochs_and_remainder():
    config = LoaderConfig(batch_size=6, shuffle=False, num_epochs=2, shard_index=0, shard_count=1,
                          drop_remainder=False)
    batches = [_ids(b) for b in RecordBatches(RECORDS, config)]
    assert [len(b) for b in batches] == [6, 6, 6, 2] * 2
    assert batches[0] == ["0", "1", "2", "3", "4", "5"]
    dropped = list(RecordBatches(RECORDS, LoaderConfig(batch_size=6, num_epochs=1, shard_index=0, shard_count=1)))
    assert [len(b) for b in dropped] == [6, 6, 6]


def test_resume_gives_identical_next_batches():
    config = LoaderConfig(batch_size=3, seed=11, shard_index=0, shard_count=1)
    uninterrupted = RecordBatches(RECORDS, config)
    reference = [_ids(next(uninterrupted)) for _ in range(15)]  # crosses two epoch boundaries

    first_run = RecordBatches(RECORDS, config)
    seen = [_ids(next(first_run)) for _ in range(7)]
    saved = json.dumps(first_run.get_state())  # what a checkpoint stores
    resumed = RecordBatches(RECORDS, config)
    resumed.set_state(json.loads(saved))
    seen += [_ids(next(resumed)) for _ in range(8)]
    assert seen == reference
    assert json.loads(saved) == {"next_index": 7, "seed": 11, "shard": [0, 1]}


def test_resume_refuses_other_seed_or_shard():
    state = RecordBatches(RECORDS, LoaderConfig(batch_size=2, seed=1, shard_index=0, shard_count=2)).get_state()
    with pytest.raises(ValueError, match="seed"):
        RecordBatches(RECORDS, LoaderConfig(batch_size=2, seed=2, shard_index=0, shard_count=2)).set_state(state)
    with pytest.raises(ValueError, match="shard"):
        RecordBatches(RECORDS, LoaderConfig(batch_size=2, seed=1, shard_index=1, shard_count=2)).set_state(state)


def test_two_processes_see_disjoint_complete_halves():
    halves = []
    for index in range(2):
        loader = RecordBatches(RECORDS, LoaderConfig(batch_size=2, seed=7, shard_index=index, shard_count=2))
        assert loader.batches_per_epoch == 5
        halves.append(list(itertools.chain.from_iterable(_ids(next(loader)) for _ in range(5))))
    assert len(halves[0]) == len(halves[1]) == 10
    assert not set(halves[0]) & set(halves[1])
    assert set(halves[0]) | set(halves[1]) == {r["id"] for r in RECORDS}
    # an odd count drops one tail record so both processes take the same number of steps
    odd = [RecordBatches(RECORDS[:9], LoaderConfig(batch_size=4, shuffle=False, num_epochs=1, shard_index=i,
                                                   shard_count=2)) for i in range(2)]
    assert [[_ids(b) for b in loader] for loader in odd] == [[["0", "2", "4", "6"]], [["1", "3", "5", "7"]]]


def test_default_shard_is_the_jax_process():
    implicit = RecordBatches(RECORDS, LoaderConfig(batch_size=4, seed=2))
    explicit = RecordBatches(RECORDS, LoaderConfig(batch_size=4, seed=2, shard_index=0, shard_count=1))
    assert (implicit.shard_index, implicit.shard_count) == (0, 1)
    assert [_ids(next(implicit)) for _ in range(6)] == [_ids(next(explicit)) for _ in range(6)]
    with pytest.raises(ValueError, match="fewer than batch_size"):
        RecordBatches(RECORDS[:3], LoaderConfig(batch_size=4, shard_index=0, shard_count=1))


def test_bare_prompt_is_question_and_equals_sign():
    assert prompt_template("bare").render("27+385") == "27+385="
    assert prompt_template("bare", fewshot=[("1+1", "2")]).render("3+4") == "1+1= 2\n\n3+4="
