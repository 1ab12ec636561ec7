"""Tokenizer: one interface over Hugging Face tokenizer folders and the vocabulary inside a GGUF file.

Both sources end up as a `transformers` fast tokenizer, so encoding, decoding, chat templates
(Jinja, applied by transformers' `apply_chat_template`) and `save_pretrained` behave the same way.
From a GGUF file the tokenizer is rebuilt with `tokenizers` from `tokenizer.ggml.tokens`:

- byte-level BPE (`tokenizer.ggml.model` "gpt2": Llama 3, Qwen, SmolLM) from `tokenizer.ggml.merges`:
  GPT-2's byte-to-unicode alphabet, a ByteLevel pre-tokenizer (after the split llama.cpp uses for
  that vocabulary, `tokenizer.ggml.pre`) and decoder;
- SentencePiece BPE (`tokenizer.ggml.model` "llama": Llama 2, Mistral) from `tokenizer.ggml.scores`:
  the merges SentencePiece would make (a pair merges when the joined piece is in the vocabulary,
  higher score first), spaces written as "▁" with one in front of the text (and after every special
  token, as llama.cpp and the original `tokenizer.json` do), byte fallback to the <0xXX> tokens.

Either way the tokens marked CONTROL are added as special tokens so they are matched whole
("<|im_end|>" is one id, never split).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Mapping, Sequence

# llama.cpp token types (gguf.TokenType): 1 = NORMAL, 2 = UNKNOWN, 3 = CONTROL (special),
# 4 = USER_DEFINED (added, not special), 5 = UNUSED, 6 = BYTE (SentencePiece's <0xXX> fallback pieces).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
_SPIECE_SPACE = "\u2581"
# Tokens that end an assistant turn in the chat formats of the supported families.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>")


def _transformers(name: str):
    """`transformers.<name>`, loaded without transformers' advice that PyTorch is missing (its lazy import
    gives it on first use): only its tokenizers are used here, and they need no PyTorch. The environment is
    restored afterwards."""
    key = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        import transformers

        return getattr(transformers, name)
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before

# Pre-tokenizer split patterns by `tokenizer.ggml.pre`: Llama 3 groups digits in threes, Qwen2 splits
# every digit; both keep contractions, letter runs, punctuation runs and newlines apart.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_BY_PRE = {
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# SmolLM's own tokenizer.json isolates every digit before GPT-2's byte-level regex.
_DIGIT_FIRST_PRE = ("smollm",)


def _byte_level_backend(meta: Mapping[str, Any], source: str):
    """A `tokenizers.Tokenizer` (BPE, byte level) from the tokenizer.ggml.* metadata."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(pair.split(" ", 1)) for pair in meta.get("tokenizer.ggml.merges", [])]
    backend = Backend(models.BPE(vocab={tok: i for i, tok in enumerate(tokens)}, merges=merges,
                                 fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _SPLIT_BY_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in _DIGIT_FIRST_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return _add_marked_tokens(backend, meta, source, special_types=(_CONTROL,))


def _add_marked_tokens(backend, meta: Mapping[str, Any], source: str, special_types: tuple[int, ...]):
    """Add the tokens of `special_types` as special tokens and the USER_DEFINED ones as plain added
    tokens (both matched whole in the text); check the rebuilt vocabulary keeps every id."""
    from tokenizers import AddedToken

    tokens = meta["tokenizer.ggml.tokens"]
    token_types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    backend.add_special_tokens([AddedToken(tok, special=True, normalized=False)
                                for tok, kind in zip(tokens, token_types) if kind in special_types])
    backend.add_tokens([AddedToken(tok, special=False, normalized=False)
                        for tok, kind in zip(tokens, token_types) if kind == _USER_DEFINED])
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(f"{source}: GGUF vocabulary has duplicate tokens; cannot rebuild it id for id")
    return backend


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float],
                         mergeable: Sequence[bool] | None = None) -> list[tuple[str, str]]:
    """BPE merges, best first, equivalent to SentencePiece's BPE: SentencePiece joins the adjacent pair
    whose joined piece has the highest score, so every split (left, right) of a mergeable piece into two
    vocabulary pieces is a merge ranked by the joined piece's score (ties: shorter left piece first).

    >>> sentencepiece_merges(["a", "b", "ab", "abb"], [-3.0, -4.0, -1.0, -2.0])
    [('a', 'b'), ('ab', 'b')]
    """
    mergeable = [True] * len(tokens) if mergeable is None else mergeable
    pieces = {tok for tok, ok in zip(tokens, mergeable) if ok}
    ranked = []
    for tok, score, ok in zip(tokens, scores, mergeable):
        if ok:
            ranked += [(-score, i, tok[:i], tok[i:]) for i in range(1, len(tok))
                       if tok[:i] in pieces and tok[i:] in pieces]
    return [(left, right) for *_, left, right in sorted(ranked)]


def _sentencepiece_backend(meta: Mapping[str, Any], source: str):
    """A `tokenizers.Tokenizer` (SentencePiece BPE with byte fallback) from the tokenizer.ggml.* metadata."""
    from tokenizers import decoders, models, normalizers
    from tokenizers import Tokenizer as Backend

    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError(f"{source}: a SentencePiece GGUF vocabulary needs tokenizer.ggml.scores, one per token")
    token_types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    # SentencePiece builds text from normal pieces only; <unk>, <s>, bytes and unused pieces never merge.
    mergeable = [kind in (_NORMAL, _USER_DEFINED) for kind in token_types]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    backend = Backend(models.BPE(vocab={tok: i for i, tok in enumerate(tokens)},
                                 merges=sentencepiece_merges(tokens, scores, mergeable),
                                 unk_token=tokens[unk_id] if unk_id is not None else None,
                                 fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Replace(" ", _SPIECE_SPACE)]
    decode = [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True):  # SentencePiece's add_dummy_prefix
        steps.insert(0, normalizers.Prepend(_SPIECE_SPACE))
        decode.append(decoders.Strip(" ", 1, 0))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence(decode)
    return _add_marked_tokens(backend, meta, source, special_types=(_CONTROL, _UNKNOWN))


_BACKENDS = {"gpt2": _byte_level_backend, "llama": _sentencepiece_backend}


class Tokenizer:
    """Text <-> token ids, chat templates and stop ids, over a `transformers` fast tokenizer (`.hf`).

    `vocab_size` counts the tokenizer's ids (added tokens included); a model's embedding may have
    more rows (padding to a multiple of 64 or 128 is common).
    """

    def __init__(self, hf_tokenizer, extra_stop_ids: Sequence[int] = ()):
        if hf_tokenizer.eos_token_id is None:
            raise ValueError("tokenizer has no eos token; cannot tell where a generation ends")
        self.hf = hf_tokenizer
        vocab = hf_tokenizer.get_vocab()
        special = set(hf_tokenizer.all_special_tokens) | {
            t.content for t in hf_tokenizer.added_tokens_decoder.values() if t.special}
        turn_ends = [vocab[tok] for tok in END_OF_TURN_TOKENS if tok in special and tok in vocab]
        ordered = [hf_tokenizer.eos_token_id, *extra_stop_ids, *turn_ends]
        self._stop_ids = tuple(dict.fromkeys(int(i) for i in ordered))

    @classmethod
    def from_pretrained(cls, directory) -> "Tokenizer":
        """Tokenizer of a local Hugging Face folder (tokenizer.json / tokenizer_config.json), via
        transformers.AutoTokenizer; eos ids listed in generation_config.json become stop ids too."""
        folder = pathlib.Path(directory)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: no such tokenizer directory")
        try:
            hf = _transformers("AutoTokenizer").from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(f"{folder}: no loadable tokenizer files ({err})") from None
        extra = []
        generation_config = folder / "generation_config.json"
        if generation_config.is_file():
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
            extra = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(hf, extra)

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        """Tokenizer rebuilt from the vocabulary, merges and chat template inside a GGUF file."""
        from jaxrl_llm.models.gguf import read_gguf_metadata

        return cls.from_gguf_metadata(read_gguf_metadata(path), source=str(path))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], source: str = "<gguf>") -> "Tokenizer":
        """As `from_gguf`, from already-read metadata (`read_gguf_metadata`); `source` names the file
        in errors. Byte-level BPE (tokenizer.ggml.model "gpt2") and SentencePiece BPE ("llama")
        vocabularies are supported."""
        kind = meta.get("tokenizer.ggml.model")
        if kind not in _BACKENDS:
            raise ValueError(f"{source}: GGUF tokenizer model {kind!r} is not supported "
                             f"(supported: {', '.join(map(repr, _BACKENDS))})")
        if "tokenizer.ggml.tokens" not in meta:
            raise ValueError(f"{source}: GGUF metadata key tokenizer.ggml.tokens is missing")
        tokens = meta["tokenizer.ggml.tokens"]
        named = {}
        for role, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
            token_id = meta.get(f"tokenizer.ggml.{key}")
            if token_id is not None and 0 <= token_id < len(tokens):
                named[role] = tokens[token_id]
        hf = _transformers("PreTrainedTokenizerFast")(
            tokenizer_object=_BACKENDS[kind](meta, source),
            chat_template=meta.get("tokenizer.chat_template"),
            # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
            add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            clean_up_tokenization_spaces=False,
            **named,
        )
        extra = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
        return cls(hf, extra)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it ("<|im_start|>") map to their single id."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}]) from the Jinja chat template;
        `tools`: function schemas for a template with a tool role (ignored by one without)."""
        if not self.hf.chat_template:
            raise ValueError("tokenizer has no chat template")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           tools=tools)

    @property
    def eos_token_id(self) -> int:
        return int(self.hf.eos_token_id)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """eos first, then the end-of-turn ids (e.g. <|im_end|>, <|endoftext|>) of this vocabulary."""
        return self._stop_ids

    @property
    def pad_token_id(self) -> int:
        """The pad id, or eos when the vocabulary names no pad token."""
        pad = self.hf.pad_token_id
        return int(pad) if pad is not None else self.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def save_pretrained(self, directory) -> pathlib.Path:
        """Write tokenizer.json, tokenizer_config.json (with the chat template) and special tokens so
        transformers.AutoTokenizer.from_pretrained(directory) gives the same ids."""
        folder = pathlib.Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        self.hf.save_pretrained(str(folder))
        return folder
