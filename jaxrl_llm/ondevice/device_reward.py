"""Correctness of integer answers computed on device, by the host verifier's rule, inside `jit`.

The host path (`train.rollouts.RewardScorer`) decodes each response to text, takes the content of its
last well-formed, non-blank `\\boxed{...}` / `\\fbox{...}` (or `\\boxed 5`) as
`rewards.extract_answer` does, and compares it with the gold answer (`rewards.answers_equal`).
`boxed_integer_reward` runs the same steps on token ids:

1. Text: each token id maps to its decoded bytes (a [V, W] table built once from the tokenizer;
   special tokens are empty, as in `decode(..., skip_special_tokens=True)`). A response's bytes are
   laid end to end into a [C] row, C = N * W, padded with -1, by a scatter at cumulative offsets.
2. Box: box commands are tried from the last one backwards (a `lax.while_loop`, one round unless the
   last box is malformed or blank) until one has an argument: braces are matched as
   `rewards.extract.closing_braces` matches them (a brace after an odd run of backslashes is text,
   so the first closing brace where the depth returns to the opening level closes it); for
   `\\boxed 5` the argument is the run of characters up to whitespace or `$`.
3. Value: the argument, without whitespace and trailing periods, must be an integer: an optional
   sign, then 1 to 9 digits. The reward is 1 where its value equals the gold integer.

Conservative by design: where the host verifier accepts an answer that is not a plain integer in a
box (`\\boxed{5.0}`, `\\boxed{2+3}`, `\\boxed{--5}`, `\\boxed{\\frac{10}{2}}`, or no box but "The
answer is 5" or "#### 5") this reward is 0. On the arithmetic prompts the model writes
"7 - 9 = -2 \\boxed{-2}", where both agree (tests/test_fused_loop.py; benchmarks/fused_loop.py counts
the agreement on real rollouts).
Non-ASCII bytes never match: a multi-byte character cut between tokens decodes to U+FFFD per token,
non-ASCII like the character itself.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Characters Python's str.strip() and the regex class \s remove in the ASCII range.
_WHITESPACE = (9, 10, 11, 12, 13, 28, 29, 30, 31, 32)
_SPACE_TAB = (9, 32)
_BACKSLASH, _OPEN, _CLOSE, _DOLLAR, _PLUS, _MINUS, _PERIOD = 92, 123, 125, 36, 43, 45, 46
_BOXED, _FBOX = tuple(b"\\boxed"), tuple(b"\\fbox")
MAX_DIGITS = 9  # an int32 holds every 9-digit value


class TokenBytes(NamedTuple):
    """Decoded bytes of every token id: bytes uint8 [V, W] (0 past the end), lengths int32 [V]."""

    bytes: np.ndarray
    lengths: np.ndarray


def token_bytes(tokenizer, vocab_size: int) -> TokenBytes:
    """The byte table of `tokenizer` for ids 0..vocab_size-1 (the model's embedding rows).

    Token i's entry is the UTF-8 of `tokenizer.decode([i], skip_special_tokens=True)`; ids the
    tokenizer does not know (embedding padding rows) are empty. This is exact for byte-level BPE
    vocabularies (SmolLM2, Qwen2, Llama 3), whose decoded text is the concatenation of the tokens'
    bytes; a tokenizer whose decode rewrites spaces between tokens (SentencePiece's leading-space
    marker) is refused, checked on a probe answer.
    """
    known = min(vocab_size, int(tokenizer.vocab_size))
    hf = getattr(tokenizer, "hf", None)
    ids = [[i] for i in range(known)]
    if hf is not None:  # one batched call into the Rust decoder instead of 50k Python calls
        texts = hf.batch_decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    else:
        texts = [tokenizer.decode(i, skip_special_tokens=True) for i in ids]
    encoded = [t.encode("utf-8") for t in texts] + [b""] * (vocab_size - known)
    width = max(1, max(len(b) for b in encoded))
    table = np.zeros((vocab_size, width), np.uint8)
    lengths = np.zeros(vocab_size, np.int32)
    for i, raw in enumerate(encoded):
        table[i, :len(raw)] = np.frombuffer(raw, np.uint8)
        lengths[i] = len(raw)
    probe = "7 - 9 = -2 \\boxed{-2}\n \\boxed {12}."
    ids = [i for i in tokenizer.encode(probe) if i < vocab_size]
    if b"".join(encoded[i] for i in ids) != tokenizer.decode(ids, skip_special_tokens=True).encode("utf-8"):
        raise ValueError("token_bytes: this tokenizer's decoded text is not the concatenation of its tokens' "
                         "decoded bytes, so the on-device reward cannot rebuild response text from token ids")
    return TokenBytes(table, lengths)


def gold_integers(answers: Sequence[str]) -> np.ndarray:
    """int32 [P] of gold answers written as integers ("-2", "15"); raises for any other form."""
    out = np.zeros(len(answers), np.int32)
    for i, answer in enumerate(answers):
        text = str(answer).strip()
        digits = text.lstrip("+-")
        if not (digits.isascii() and digits.isdigit() and len(text) - len(digits) <= 1 and len(digits) <= MAX_DIGITS):
            raise ValueError(f"gold answer {i} ({answer!r}) is not an integer of at most {MAX_DIGITS} digits: the "
                             f"on-device reward only checks integer answers")
        out[i] = int(text)
    return out


def response_text(tokens: jax.Array, lengths: jax.Array, table: TokenBytes) -> jax.Array:
    """Bytes of each response, tokens [B, N] with lengths [B] -> int32 [B, N * W], -1 after the end."""
    rows, steps = tokens.shape
    width = table.bytes.shape[1]
    size = steps * width
    token_len = jnp.where(jnp.arange(steps) < lengths[:, None], jnp.asarray(table.lengths)[tokens], 0)
    start = jnp.cumsum(token_len, axis=1) - token_len
    offset = jnp.arange(width)
    dest = jnp.where(offset < token_len[..., None], start[..., None] + offset, size)  # size: dropped
    row = jnp.broadcast_to(jnp.arange(rows)[:, None, None], dest.shape)
    values = jnp.asarray(table.bytes)[tokens].astype(jnp.int32)
    return jnp.full((rows, size), -1, jnp.int32).at[row, dest].set(values, mode="drop")


def _isin(text: jax.Array, chars: Sequence[int]) -> jax.Array:
    return jnp.any(text[..., None] == jnp.asarray(chars, jnp.int32), axis=-1)


def _first(condition: jax.Array, default: int) -> jax.Array:
    """Index of the first True entry of a 1-D mask, or `default` when there is none."""
    return jnp.where(jnp.any(condition), jnp.argmax(condition), default)


def _matches_at(text: jax.Array, pattern: Sequence[int]) -> jax.Array:
    """Bool [C]: text[p:p + len(pattern)] == pattern."""
    padded = jnp.concatenate([text, jnp.full((len(pattern),), -1, text.dtype)])
    hit = jnp.ones(text.shape, bool)
    for k, char in enumerate(pattern):
        hit = hit & (padded[k:k + text.shape[0]] == char)
    return hit


def last_boxed_span(text: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(found, start, end) of the argument of the last well-formed, non-blank box in one text row [C].

    The argument is text[start:end] before stripping, as `rewards.extract.last_boxed` takes it.
    """
    size = text.shape[0]
    index = jnp.arange(size)
    is_backslash = text == _BACKSLASH
    last_other = jax.lax.cummax(jnp.where(is_backslash, -1, index))  # last non-backslash at or before k
    run_before = index - 1 - jnp.concatenate([jnp.array([-1]), last_other[:-1]])  # backslashes just before k
    escaped = run_before % 2 == 1
    opens = (text == _OPEN) & ~escaped
    closes = (text == _CLOSE) & ~escaped
    depth = jnp.cumsum(opens.astype(jnp.int32) - closes.astype(jnp.int32))
    boxed, fbox = _matches_at(text, _BOXED), _matches_at(text, _FBOX)
    command = boxed | fbox
    whitespace = _isin(text, _WHITESPACE)
    ended = text < 0

    def argument(p):
        command_end = p + jnp.where(boxed[p], len(_BOXED), len(_FBOX))
        i = _first((index >= command_end) & ~_isin(text, _SPACE_TAB), size)
        char = jnp.where(i < size, text[jnp.minimum(i, size - 1)], -1)
        # "\boxed{...}": up to the brace that brings the depth back below the opening one
        close = _first((index > i) & closes & (depth == depth[jnp.minimum(i, size - 1)] - 1), size)
        braced = (char == _OPEN) & (close < size)
        # "\boxed 5": the run up to whitespace or "$" (not directly after the command name)
        run_end = _first((index >= i) & (whitespace | (text == _DOLLAR) | ended), size)
        bare = (char >= 0) & (char != _OPEN) & (i > command_end) & (run_end > i)
        start = jnp.where(braced, i + 1, i)
        end = jnp.where(braced, close, run_end)
        blank = ~jnp.any((index >= start) & (index < end) & ~whitespace)
        return (braced | bare) & ~blank, start, end

    def keep_looking(carry):
        found, cursor, _, _ = carry
        return ~found & jnp.any(command & (index < cursor))

    def try_previous(carry):
        _, cursor, _, _ = carry
        p = size - 1 - jnp.argmax((command & (index < cursor))[::-1])
        ok, start, end = argument(p)
        return ok, p, start, end

    zero = jnp.zeros((), jnp.int32)
    found, _, start, end = jax.lax.while_loop(keep_looking, try_previous,
                                              (jnp.zeros((), bool), jnp.asarray(size, jnp.int32), zero, zero))
    return found, start, end


def parse_integer(text: jax.Array, start: jax.Array, end: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(ok, value int32) of text[start:end] when it reads: an optional sign, then 1-9 digits, with
    whitespace anywhere and trailing periods (the verifier compares answers with spaces removed and a
    sentence's final period dropped, so "- 5", "1 2" and "7." are -5, 12 and 7)."""
    size = text.shape[0]
    index = jnp.arange(size)
    inside = (index >= start) & (index < end)
    whitespace = _isin(text, _WHITESPACE)
    solid = inside & ~whitespace
    first = _first(solid, size)
    last = size - 1 - jnp.argmax((solid & (text != _PERIOD))[::-1])
    char = lambda k: text[jnp.clip(k, 0, size - 1)]  # noqa: E731
    signed = (char(first) == _PLUS) | (char(first) == _MINUS)
    digits_from = jnp.where(signed, first + 1, first)
    in_number = (index >= digits_from) & (index <= last)
    digit = in_number & (text >= 48) & (text <= 57)
    count = digit.sum()
    ok = jnp.any(solid) & (count >= 1) & (count <= MAX_DIGITS) & jnp.all(~in_number | digit | whitespace)
    after = count - jnp.cumsum(digit)  # digits to the right of each position
    value = jnp.sum(jnp.where(digit, (text - 48) * jnp.power(10, jnp.where(digit, after, 0)), 0))
    return ok, jnp.where(signed & (char(first) == _MINUS), -value, value).astype(jnp.int32)


def boxed_integer_reward(tokens: jax.Array, lengths: jax.Array, gold: jax.Array, table: TokenBytes) -> jax.Array:
    """1.0 where the last box of response b holds the integer gold[b], else 0.0 -> float32 [B].

    tokens int32 [B, N] response tokens, lengths [B], gold int32 [B] (the row's gold answer).
    """
    text = response_text(tokens, lengths, table)

    def one(row, answer):
        found, start, end = last_boxed_span(row)
        ok, value = parse_integer(row, start, end)
        return (found & ok & (value == answer)).astype(jnp.float32)

    return jax.vmap(one)(text, gold)
