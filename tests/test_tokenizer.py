"""Tokenizer: ids and chat templates equal to transformers' own loaders, round trips, stop ids."""

import json

import pytest

from jaxrl_llm.models.tokenizer import Tokenizer
from tiny_gguf import write_tiny_gguf

STRINGS = [
    "Hello 123 world",
    "x = 12345678 + 9.75 - 1,000,000.00",
    r"\frac{1}{2} + \sqrt{x^2} = \boxed{42}",
    r"$$\int_0^1 x\,dx = \tfrac{1}{2}$$ and \(a_{n+1} \leq 3^{n}\)",
    "café naïve 日本語 🙂 Ω≈ç — “quotes”",
    "  leading\n\n\ttabs   and  spaces  \r\n",
    "a1b22c333 don't I'M we'll",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>x<repo_name>y",
    "",
    " ",
]
MESSAGES = [
    {"role": "system", "content": "Please reason step by step."},
    {"role": "user", "content": "What is 7 + 5?"},
    {"role": "assistant", "content": "7 + 5 = 12 \\boxed{12}"},
    {"role": "user", "content": "And 3 \u00d7 4?"},
]


@pytest.fixture(scope="module")
def bundled_pair():
    """(our Tokenizer from the bundled GGUF, transformers' tokenizer from the same file)."""
    from transformers import AutoTokenizer

    from jaxrl_llm.models.bundled import bundled_gguf_path

    path = bundled_gguf_path()
    return Tokenizer.from_gguf(path), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_bundled_ids_equal_transformers_gguf_tokenizer(bundled_pair):
    ours, ref = bundled_pair
    for text in STRINGS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("<|im_end|>") == [2]
    assert ours.encode("123") == [33, 34, 35]  # SmolLM2 writes each digit as its own token


def test_bundled_chat_template_equals_transformers(bundled_pair):
    ours, ref = bundled_pair
    for messages in (MESSAGES, MESSAGES[1:2]):
        for gen in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == ref.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)
    assert ours.apply_chat_template(MESSAGES[1:2]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 7 + 5?<|im_end|>\n<|im_start|>assistant\n")


def test_bundled_special_ids(bundled_pair):
    ours, _ = bundled_pair
    assert ours.eos_token_id == 2 and ours.pad_token_id == 2
    assert ours.stop_ids == (2, 0)  # <|im_end|>, then <|endoftext|>
    assert ours.vocab_size == 49152
    assert ours.decode([1, 41, 2, 0]) == "9"  # special tokens dropped by default


def test_save_pretrained_round_trips_through_transformers(bundled_pair, tmp_path):
    from transformers import AutoTokenizer

    ours, _ = bundled_pair
    ours.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in STRINGS:
        assert reloaded.encode(text, add_special_tokens=False) == ours.encode(text), text
    again = Tokenizer.from_pretrained(tmp_path)
    assert again.apply_chat_template(MESSAGES) == ours.apply_chat_template(MESSAGES)
    assert again.stop_ids == ours.stop_ids and again.pad_token_id == 2


def test_tiny_vocabulary_ids_by_hand(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", "llama")
    tok = Tokenizer.from_gguf(tmp_path / "t.gguf")
    # ids: 0-2 specials, 3 + byte for the 256 byte symbols, then merges Ġt=259, he=260, Ġthe=261, 12=262.
    assert tok.encode(" the 12 hello<|im_end|>") == [261, 35, 262, 35, 260, 3 + ord("l"), 3 + ord("l"),
                                                      3 + ord("o"), 2]
    assert tok.encode("é") == [3 + 0xC3, 3 + 0xA9]  # two UTF-8 bytes
    assert tok.decode([261, 2, 3 + 0xC3, 3 + 0xA9]) == " theé"
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")
    assert tok.pad_token_id == 0 and tok.eos_token_id == 2 and tok.stop_ids == (2, 0)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == (
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n")


def test_add_bos_flag_prepends_bos(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", "llama", add_bos=True)
    tok = Tokenizer.from_gguf(tmp_path / "t.gguf")
    assert tok.encode(" the", add_special_tokens=True) == [1, 261]
    assert tok.encode(" the") == [261]


@pytest.mark.parametrize("pre, text, expected", [
    ("default", " 1212", [35, 262, 262]),  # GPT-2 regex keeps " 1212" together; BPE merges "12"
    ("smollm", " 1212", [35, 3 + ord("1"), 3 + ord("2"), 3 + ord("1"), 3 + ord("2")]),  # digits isolated
    ("qwen2", " 1212", [35, 3 + ord("1"), 3 + ord("2"), 3 + ord("1"), 3 + ord("2")]),
    ("llama-bpe", " 1212", [35, 262, 3 + ord("1"), 3 + ord("2")]),  # digits grouped in threes: "121", "2"
])
def test_pre_tokenizer_follows_gguf_pre_type(tmp_path, pre, text, expected):
    write_tiny_gguf(tmp_path / "t.gguf", "llama", pre=pre)
    assert Tokenizer.from_gguf(tmp_path / "t.gguf").encode(text) == expected


def test_generation_config_eos_ids_become_stop_ids(bundled_pair, tmp_path):
    ours, _ = bundled_pair
    ours.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert Tokenizer.from_pretrained(tmp_path).stop_ids == (2, 7, 0)


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing_dir: no such tokenizer directory"):
        Tokenizer.from_pretrained(tmp_path / "missing_dir")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: no loadable tokenizer files"):
        Tokenizer.from_pretrained(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="x.gguf: no such GGUF file"):
        Tokenizer.from_gguf(tmp_path / "x.gguf")
    with pytest.raises(ValueError, match=r"m.gguf: GGUF tokenizer model 'bert' is not supported \(supported: "
                                         r"'gpt2', 'llama'\)"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert"}, source="m.gguf")
    write_tiny_gguf(tmp_path / "t.gguf", "llama")
    tok = Tokenizer.from_gguf(tmp_path / "t.gguf")
    tok.hf.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("pre", ["default", "qwen2", "llama-bpe"])
def test_tiny_vocabulary_ids_equal_transformers_for_each_split(tmp_path, pre):
    from transformers import AutoTokenizer

    write_tiny_gguf(tmp_path / "t.gguf", "llama", pre=pre)
    ours = Tokenizer.from_gguf(tmp_path / "t.gguf")
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    for text in STRINGS + [" 1212 12345 the12the", "I'll  don't\n\n  x"]:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
