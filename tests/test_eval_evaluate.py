"""evaluate(): prompts -> generate -> decode -> metrics, with a scripted generate and with the real sampler."""

import json
from typing import NamedTuple

import numpy as np
import pytest

from jaxrl_llm.data.prompts import prompt_template
from jaxrl_llm.eval.evaluate import evaluate, evaluate_benchmarks


class ByteTokenizer:
    """One token per UTF-8 byte, 256 = end of turn; a ChatML template."""

    stop_ids = (256,)

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class FakeRollout(NamedTuple):
    prompt_index: np.ndarray
    tokens: np.ndarray
    mask: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    finish_reason: np.ndarray


class ScriptedGenerate:
    """Answers each question with scripted responses; records how it was called."""

    def __init__(self, script, width=32):
        self.script, self.width, self.calls = script, width, []

    def __call__(self, params, config, prompts, *, num_samples, max_new_tokens, temperature, top_p, top_k,
                 stop_ids, rng):
        self.calls.append(dict(num_prompts=len(prompts), num_samples=num_samples, max_new_tokens=max_new_tokens,
                               temperature=temperature, stop_ids=stop_ids, rng=np.asarray(rng).tolist()))
        rows = []
        for index, prompt in enumerate(prompts):
            text = bytes(prompt).decode()
            question = text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
            for sample in range(num_samples):
                response, stopped = self.script[question][sample]
                ids = list(response.encode()) + ([256] if stopped else [])
                rows.append((index, ids[:max_new_tokens], stopped))
        tokens = np.zeros((len(rows), self.width), np.int32)
        for row, (_, ids, _) in enumerate(rows):
            tokens[row, :len(ids)] = ids
        lengths = np.array([len(ids) for _, ids, _ in rows], np.int32)
        mask = (np.arange(self.width)[None] < lengths[:, None]).astype(np.float32)
        return FakeRollout(np.array([r[0] for r in rows], np.int32), tokens, mask, np.zeros_like(mask), lengths,
                           np.array([0 if stopped else 1 for _, _, stopped in rows], np.int32))


RECORDS = [{"id": "a", "question": "Calculate 2 + 2.", "answer": "4"},
           {"id": "b", "question": "Calculate 9 - 3.", "answer": "6"},
           {"id": "c", "question": "Calculate 1 - 5.", "answer": "-4"}]
SCRIPT = {
    "Calculate 2 + 2.": [("2 + 2 = 4 \\boxed{4}", True), ("\\boxed{5}", True), ("\\boxed{4}", True)],
    "Calculate 9 - 3.": [("\\boxed{7}", True), ("\\boxed{7}", True), ("9 - 3 = 6 \\boxed{6}", True)],
    "Calculate 1 - 5.": [("1 - 5 = -4 \\boxed{-4}", True), ("1 - 5 = -4", False), ("\\boxed{-4}", True)],
}


def test_evaluate_with_scripted_generate():
    generate = ScriptedGenerate(SCRIPT)
    metrics = evaluate(None, None, ByteTokenizer(), RECORDS, k=3, max_new_tokens=24, template="arithmetic-2shot",
                       samples_per_call=7, seed=5, generate_fn=generate, return_samples=True)
    # correctness: a = [1,0,1], b = [0,0,1], c = [1,1,1] (grading reads the unboxed "1 - 5 = -4" as -4)
    assert metrics["avg@3"] == pytest.approx((2 / 3 + 1 / 3 + 3 / 3) / 3)
    assert metrics["pass@3"] == pytest.approx(1.0)
    assert metrics["maj@3"] == pytest.approx((1 + 0 + 1) / 3)  # b's majority answer is 7
    assert metrics["format_rate"] == pytest.approx(9 / 9)  # every sample states an answer
    expected_lengths = [len(text.encode()) + stopped for texts in SCRIPT.values() for text, stopped in texts]
    assert metrics["mean_length"] == pytest.approx(sum(expected_lengths) / 9)
    assert metrics["truncated_rate"] == pytest.approx(1 / 9) and metrics["dropped_prompts"] == 0
    assert [c["num_prompts"] for c in generate.calls] == [2, 2]  # the last call filled up with a repeat
    assert {c["num_samples"] for c in generate.calls} == {3} and generate.calls[0]["stop_ids"] == (256,)
    assert generate.calls[0]["rng"] != generate.calls[1]["rng"]  # a fresh key per call
    assert metrics["samples"][1]["completions"] == ["\\boxed{7}", "\\boxed{7}", "9 - 3 = 6 \\boxed{6}"]
    assert metrics["samples"][1]["correct"] == [0.0, 0.0, 1.0]


def test_evaluate_without_padding_the_last_call_gives_the_same_metrics():
    padded = evaluate(None, None, ByteTokenizer(), RECORDS, k=3, max_new_tokens=24, template="arithmetic-2shot",
                      samples_per_call=7, seed=5, generate_fn=ScriptedGenerate(SCRIPT), return_samples=True)
    generate = ScriptedGenerate(SCRIPT)
    unpadded = evaluate(None, None, ByteTokenizer(), RECORDS, k=3, max_new_tokens=24, template="arithmetic-2shot",
                        samples_per_call=7, seed=5, generate_fn=generate, return_samples=True, pad_last_call=False)
    assert [c["num_prompts"] for c in generate.calls] == [2, 1]
    padded.pop("seconds"), unpadded.pop("seconds")
    assert padded == unpadded and padded["num_samples"] == 9  # the repeat's 3 samples were thrown away


def test_evaluate_pads_the_last_call_of_the_real_sampler_to_the_earlier_shape():
    import jax
    from jaxrl_llm.models import ModelConfig, init_params
    from jaxrl_llm.sampling import generate

    config = ModelConfig(vocab_size=264, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16, max_position_embeddings=512)
    params = init_params(config, jax.random.PRNGKey(0))
    template = prompt_template("raw", user_suffix="", raw_format="Q: {question}\nA:")
    calls = []

    def recording(*args, **kwargs):
        calls.append(len(args[2]))
        return generate(*args, **kwargs)

    runs = [evaluate(params, config, ByteTokenizer(), RECORDS, k=2, max_new_tokens=5, template=template,
                     samples_per_call=4, seed=3, return_samples=True, generate_fn=recording, pad_last_call=pad)
            for pad in (True, False)]
    assert calls == [2, 2, 2, 1]
    # the third prompt's samples: drawn with the same keys; the 4-row call rounds like the 2-row one here
    assert runs[0]["samples"] == runs[1]["samples"] and runs[0]["num_samples"] == 6


def test_evaluate_drops_long_prompts():
    template = prompt_template("raw", user_suffix="", raw_format="<|im_start|>user\n{question}<|im_end|>")
    records = RECORDS + [{"id": "long", "question": "Calculate " + "1 + " * 40 + "1.", "answer": "41"}]
    metrics = evaluate(None, None, ByteTokenizer(), records, k=2, max_new_tokens=24, template=template,
                       max_prompt_tokens=60, generate_fn=ScriptedGenerate(SCRIPT), progress=True)
    assert metrics["dropped_prompts"] == 1 and metrics["num_problems"] == 3


def test_evaluate_benchmarks_writes_json(tmp_path):
    path = tmp_path / "bench.jsonl"
    path.write_text("".join(json.dumps({"problem": r["question"], "answer": r["answer"]}) + "\n" for r in RECORDS))
    results = evaluate_benchmarks(None, None, ByteTokenizer(), [str(path)], k=3, max_new_tokens=24,
                                  out_path=tmp_path / "eval.json", generate_fn=ScriptedGenerate(SCRIPT),
                                  template="arithmetic-2shot", print_results=False)
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["results"][str(path)]["avg@3"] == pytest.approx(results[str(path)]["avg@3"]) == pytest.approx(6 / 9)
    assert saved["settings"]["k"] == 3 and saved["settings"]["template"] == "arithmetic-2shot"


def test_evaluate_with_real_sampler_on_tiny_model():
    import jax
    from jaxrl_llm.models import ModelConfig, init_params

    config = ModelConfig(vocab_size=264, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16, max_position_embeddings=512)
    params = init_params(config, jax.random.PRNGKey(0))
    template = prompt_template("raw", user_suffix="", raw_format="Q: {question}\nA:")
    metrics = evaluate(params, config, ByteTokenizer(), RECORDS[:2], k=2, max_new_tokens=6, template=template,
                       return_samples=True, seed=1)
    assert metrics["num_samples"] == 4 and metrics["num_problems"] == 2
    assert 1 <= metrics["mean_length"] <= 6
    again = evaluate(params, config, ByteTokenizer(), RECORDS[:2], k=2, max_new_tokens=6, template=template,
                     return_samples=True, seed=1)
    assert again["samples"] == metrics["samples"]  # same seed, same completions
