"""SentencePiece GGUF vocabularies (Llama 2, Mistral): ids equal SentencePiece's own on a model trained
here with Llama 2's settings and written to a GGUF the way llama.cpp's converter reads it."""

import numpy as np
import pytest

from jaxrl_llm.models.tokenizer import Tokenizer, sentencepiece_merges
from tiny_gguf import train_sentencepiece, write_sentencepiece_gguf, write_tiny_gguf

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello 123 world",
    "x = 12345678 + 9.75 - 1,000,000.00",
    r"\frac{1}{2} + \sqrt{x^2} = \boxed{42}",
    "café naïve 日本語 🙂 Ω≈ç — “quotes”",  # mostly outside the vocabulary: byte fallback
    "  leading\n\n\ttabs   and  spaces  \r\n",
    "a1b22c333 don't I'M we'll",
    "[INST] What is 7 + 5? [/INST] The answer is 12.",
    # Words the corpus does not hold whole: their pieces depend on the order of the merges (reversed
    # or score-blind merges give other ids here, not on the corpus sentences above).
    "Thequickest brownish foxes jumped overtly; lazier dogs answered thinking stepwise.",
    "boxedanswer withinthe finalstep outputs 1000000.0075",
    "",
    " ",
]


@pytest.fixture(scope="module")
def spm_folder(tmp_path_factory):
    return train_sentencepiece(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="module")
def pair(spm_folder, tmp_path_factory):
    """(our Tokenizer from the GGUF, SentencePiece's processor of the same model)."""
    import sentencepiece

    path = tmp_path_factory.mktemp("gguf") / "spm.gguf"
    write_sentencepiece_gguf(path, spm_folder)
    reference = sentencepiece.SentencePieceProcessor(model_file=str(spm_folder / "tokenizer.model"))
    return Tokenizer.from_gguf(path), reference


def test_ids_and_text_equal_sentencepiece(pair):
    ours, sp = pair
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == sp.encode(text), text
        assert ours.decode(ids) == sp.decode(ids) == text, text
    # The byte fallback and the merged pieces both occur, so the comparison covers them.
    fallback = ours.encode("日")
    assert [sp.id_to_piece(i) for i in fallback] == ["▁", "<0xE6>", "<0x97>", "<0xA5>"]
    assert len(ours.encode("The quick brown fox")) < len("The quick brown fox") / 2


def test_special_tokens_bos_and_stop_ids(pair):
    ours, sp = pair
    # <s> and </s> are one id each in text; the text after a special token gets SentencePiece's
    # space prefix again, as llama.cpp and Llama 2's own tokenizer.json do.
    assert ours.encode("<s>[INST] hi</s>") == [1, *sp.encode("[INST] hi"), 2]
    # A file without tokenizer.ggml.add_bos_token adds BOS, as llama.cpp does for these vocabularies.
    assert ours.encode("hi", add_special_tokens=True) == [1, *sp.encode("hi")]
    assert ours.decode([1, *sp.encode("hi"), 2]) == "hi"
    assert ours.eos_token_id == 2 and ours.stop_ids == (2,)
    assert ours.vocab_size == sp.vocab_size()


def test_add_bos_flag_off_and_missing_scores(spm_folder, tmp_path):
    write_sentencepiece_gguf(tmp_path / "nobos.gguf", spm_folder, add_bos=False)
    assert Tokenizer.from_gguf(tmp_path / "nobos.gguf").encode("hi", add_special_tokens=True)[0] != 1
    write_sentencepiece_gguf(tmp_path / "noscores.gguf", spm_folder, scores=False)
    with pytest.raises(ValueError, match=r"noscores.gguf: a SentencePiece GGUF vocabulary needs tokenizer.ggml.scores"):
        Tokenizer.from_gguf(tmp_path / "noscores.gguf")


def test_merges_by_hand():
    # "ab" (score -1) joins before "abb" (-2); "bb" is not a piece, so "abb" only forms from "ab" + "b";
    # "<s>" is not mergeable (a control token), so "<" + "s>" is never a merge.
    tokens = ["a", "b", "ab", "abb", "<", "s>", "<s>"]
    scores = [-3.0, -4.0, -1.0, -2.0, -5.0, -6.0, 0.0]
    mergeable = [True] * 6 + [False]
    assert sentencepiece_merges(tokens, scores, mergeable) == [("a", "b"), ("ab", "b")]
    assert sentencepiece_merges(tokens, scores) == [("<", "s>"), ("a", "b"), ("ab", "b")]


def test_save_pretrained_round_trips(pair, tmp_path):
    ours, _ = pair
    back = Tokenizer.from_pretrained(ours.save_pretrained(tmp_path))
    for text in TEXTS + ["<s>[INST] hi</s>"]:
        assert back.encode(text) == ours.encode(text), text
    assert back.encode("hi", add_special_tokens=True) == ours.encode("hi", add_special_tokens=True)


def test_load_gguf_of_a_sentencepiece_llama(pair, spm_folder, tmp_path):
    # A Llama 2 / Mistral shaped file: llama architecture, SentencePiece vocabulary, weights sized to it.
    from jaxrl_llm.models import forward, load_gguf

    _, sp = pair
    write_tiny_gguf(tmp_path / "m.gguf", "llama", sentencepiece=spm_folder, add_bos=True)
    config, params, tokenizer = load_gguf(tmp_path / "m.gguf")
    assert config.vocab_size == tokenizer.vocab_size == sp.vocab_size()
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    ids = tokenizer.encode("The answer is 12.", add_special_tokens=True)
    assert ids == [1, *sp.encode("The answer is 12.")]
    logits = forward(params, config, np.array([ids]), np.arange(len(ids))[None])
    assert logits.shape == (1, len(ids), sp.vocab_size()) and bool(np.isfinite(np.asarray(logits)).all())
