"""Records, gold-answer extraction, and every file/library source on data the tests write."""

import importlib.resources
import json
import sys

import pytest

from jaxrl_llm.data.records import (BadDataError, FieldSpec, fields, gold_answer, gsm8k_final_answer,
                                    last_boxed_content)
from jaxrl_llm.data.sources import load_file, load_hf_disk, load_json, load_jsonl, load_parquet, load_tfds

ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A shop sells 1,200 pens a day for 2 days.", "answer": "1200*2 = 2400\n#### 2,400"},
    {"problem": "Compute $\\frac{1}{2}+\\frac{1}{2}$.", "solution": "We get $\\boxed{1}$."},
    {"problem": "Simplify.", "solution": "So it is $\\boxed{\\frac{\\sqrt{3}}{2}}$ in the end."},
]


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_gold_answer_formats():
    assert gsm8k_final_answer("work\n#### 1,234") == "1234"
    assert gsm8k_final_answer("no marker") is None
    assert last_boxed_content("a \\boxed{x^{2}} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed_content("\\boxed{unbalanced") is None
    assert last_boxed_content("so \\boxed 5$") == "5"
    assert gold_answer("  $\\frac{1}{2}$ ") == "\\frac{1}{2}"
    assert gold_answer(27.0) == "27"
    assert gold_answer(["$3$", "$4$"]) == "3, 4"
    assert gold_answer("x #### 5", "raw") == "x #### 5"
    assert gold_answer("   ") is None
    with pytest.raises(ValueError, match="answer_format"):
        FieldSpec(answer_format="latex")


def test_jsonl_mixed_fields_and_golds(tmp_path):
    path = tmp_path / "mixed.jsonl"
    _write_jsonl(path, [json.dumps(row) for row in ROWS])
    records = load_jsonl(path)
    assert [r["answer"] for r in records] == ["7", "2400", "1", "\\frac{\\sqrt{3}}{2}"]
    assert records[2]["question"] == "Compute $\\frac{1}{2}+\\frac{1}{2}$."
    assert records[0]["id"] == f"{path}-0" and records[0]["source"] == str(path)
    assert records[0]["solution"].startswith("3 + 4")  # GSM8K worked solution kept
    assert records[2]["solution"] == "We get $\\boxed{1}$."


def test_jsonl_configured_field_names(tmp_path):
    path = tmp_path / "custom.jsonl"
    _write_jsonl(path, [json.dumps({"uid": "a1", "prompt_text": "2+2?", "gold": 4, "answer": "wrong field"})])
    records = load_jsonl(path, fields(question="prompt_text", answer="gold", id_key="uid"), source="mine")
    assert records == [{"uid": "a1", "gold": 4, "answer": "4", "id": "a1", "source": "mine",
                        "question": "2+2?"}]


def test_bad_rows_skipped_and_counted(tmp_path, caplog):
    path = tmp_path / "some_bad.jsonl"
    good = [json.dumps({"question": f"q{i}", "answer": str(i)}) for i in range(18)]
    lines = good[:5] + ['{"question": "broken", '] + good[5:12] + [json.dumps({"question": "no answer"})] + good[12:]
    _write_jsonl(path, lines)
    records = load_jsonl(path, max_bad_fraction=0.2)
    assert [r["answer"] for r in records] == [str(i) for i in range(18)]
    warning = caplog.text
    assert "2 of 20 rows" in warning and f"{path}:6: malformed JSON" in warning
    assert f"{path}:14: missing answer field" in warning


def test_bad_rows_above_threshold_name_file_and_line(tmp_path):
    path = tmp_path / "mostly_bad.jsonl"
    _write_jsonl(path, [json.dumps({"question": "q", "answer": "1"}), "not json",
                        json.dumps({"question": "q", "answer": "  "}), json.dumps({"answer": "3"})])
    with pytest.raises(BadDataError) as info:
        load_jsonl(path, max_bad_fraction=0.5)
    message = str(info.value)
    assert "3 of 4 rows" in message
    assert f"{path}:2: malformed JSON" in message
    assert f"{path}:3: empty or unreadable answer" in message
    assert f"{path}:4: missing question field" in message


def test_json_list_and_dispatch(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(ROWS[:2]))
    assert [r["answer"] for r in load_file(path)] == ["7", "2400"]
    assert load_json(path)[1]["question"].startswith("A shop")
    with pytest.raises(ValueError, match="unknown data file type"):
        load_file(tmp_path / "rows.csv")


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "math.parquet"
    table = pa.table({"problem": ["p0", "p1", "p2"], "solution": ["\\boxed{0}", "\\boxed{1}", "none"],
                      "level": [1, 2, 3]})
    pq.write_table(table, path)
    with pytest.raises(BadDataError, match=f"{path}:3: empty or unreadable answer"):
        load_parquet(path, FieldSpec(answer_format="boxed"), max_bad_fraction=0.0)
    records = load_file(path, FieldSpec(answer_format="boxed"), max_bad_fraction=0.5)
    assert [(r["question"], r["answer"], r["level"]) for r in records] == [("p0", "0", 1), ("p1", "1", 2)]


def test_hf_saved_to_disk(tmp_path):
    import datasets
    rows = {"question": ["a", "b", "c"], "answer": ["x\n#### 1", "y\n#### 2", "z\n#### 3"]}
    dataset_dict = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                                         "test": datasets.Dataset.from_dict({k: v[:1] for k, v in rows.items()})})
    dataset_dict.save_to_disk(str(tmp_path / "dd"))
    assert [r["answer"] for r in load_hf_disk(tmp_path / "dd")] == ["1", "2", "3"]
    assert [r["question"] for r in load_file(tmp_path / "dd", split="test")] == ["a"]
    with pytest.raises(KeyError, match="split 'validation' not found"):
        load_hf_disk(tmp_path / "dd", split="validation")


def _build_tfds_dataset(data_dir, rows):
    """Writes a tiny dataset in TFDS array_record format with a GeneratorBasedBuilder (no TensorFlow)."""
    if "importlib_resources" not in sys.modules:  # tfds 4.9 imports the backport when locating builder code
        sys.modules["importlib_resources"] = importlib.resources
    import tensorflow_datasets as tfds

    class TinyGsm(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"question": tfds.features.Text(), "answer": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(rows)}

        def _generate_examples(self, items):
            for index, item in enumerate(items):
                yield index, item

    TinyGsm(data_dir=str(data_dir), file_format="array_record").download_and_prepare()


def test_tfds_data_source(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"step\n#### {i * 10}"} for i in range(6)]
    rows[4] = {"question": "q4", "answer": "no marker and no box"}  # raw answer stays as written
    _build_tfds_dataset(tmp_path, rows)
    records = load_tfds("tiny_gsm", split="train", data_dir=str(tmp_path))
    by_question = {r["question"]: r["answer"] for r in records}
    assert by_question == {"q0": "0", "q1": "10", "q2": "20", "q3": "30", "q4": "no marker and no box", "q5": "50"}
    assert records[0]["source"] == "tfds:tiny_gsm[train]"
    gsm_only = load_tfds("tiny_gsm", FieldSpec(answer_format="gsm8k"), data_dir=str(tmp_path), max_bad_fraction=0.2)
    assert len(gsm_only) == 5
    with pytest.raises(FileNotFoundError, match="not prepared"):
        load_tfds("tiny_gsm", split="train", data_dir=str(tmp_path / "elsewhere"))


def test_load_records_from_config_values(tmp_path):
    from jaxrl_llm.data.arithmetic import ArithmeticTask
    from jaxrl_llm.data.load import load_records

    assert load_records("arithmetic") == ArithmeticTask().train_records()
    assert load_records({"kind": "arithmetic_heldout"}) == ArithmeticTask().heldout_records()
    three = load_records({"kind": "arithmetic", "max_terms": 3, "operators": ["+"], "num": 4, "seed": 2})
    assert three == ArithmeticTask(max_terms=3, operators=("+",)).train_records(4, seed=2)
    path = tmp_path / "train.jsonl"
    _write_jsonl(path, [json.dumps({"prob": "1+1?", "sol": "so \\boxed{2}"})])
    [record] = load_records({"kind": "jsonl", "path": str(path), "question": "prob", "answer": "sol"})
    assert (record["question"], record["answer"]) == ("1+1?", "2")
    assert load_records({"kind": "benchmark", "name": "gsm8k-100", "limit": 2})[1]["id"] == "gsm8k-test-20"
    with pytest.raises(ValueError, match="needs 'path'"):
        load_records({"kind": "jsonl"})
    with pytest.raises(ValueError, match="unknown arithmetic option"):
        load_records({"kind": "arithmetic", "digits": 2})
    with pytest.raises(ValueError, match="'kind' in"):
        load_records({"kind": "csv"})
    with pytest.raises(ValueError, match="neither 'arithmetic'"):
        load_records("no/such/file.jsonl")
