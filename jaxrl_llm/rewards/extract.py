"""Final-answer extraction from a model completion.

Order of preference (the conventions of the MATH and GSM8K evaluation scripts):
1. the last well-formed ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces allowed) or ``\\boxed 5``;
2. the last GSM8K marker ``#### 42``;
3. the last "The answer is ..." / "Answer: ..." phrase (rest of its line).
Every scan is linear in the text length, so a 20k-character completion costs microseconds.
"""

from __future__ import annotations

import re

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)")
_GSM8K_MARKER = re.compile(r"####[ \t]*([^\n]*)")
# "the final answer is", "answer is:", "Answer:", "Final Answer:" — the rest of that line.
_ANSWER_PHRASE = re.compile(r"(?:answer\s+is|answer\s*:)[ \t:]*([^\n]*)", re.IGNORECASE)


def matching_brace(text: str, open_index: int) -> int | None:
    """Index of the ``}`` that closes the ``{`` at ``open_index``; None when unbalanced.

    Escaped braces ``\\{`` / ``\\}`` count as text, not as grouping.
    """
    depth = 0
    i = open_index
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2  # an escaped character never opens or closes a group
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def closing_braces(text: str) -> dict[int, int]:
    """Map from the index of every balanced ``{`` to the index of its ``}`` (one linear pass)."""
    closers: dict[int, int] = {}
    stack: list[int] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            closers[stack.pop()] = i
        i += 1
    return closers


def _box_content(text: str, command_end: int, closers: dict[int, int]) -> str | None:
    """Content of one box command whose name ends at ``command_end``; None when malformed."""
    i = command_end
    n = len(text)
    while i < n and text[i] in " \t":
        i += 1
    if i >= n:
        return None
    if text[i] == "{":
        close = closers.get(i)
        return None if close is None else text[i + 1 : close]
    if i == command_end:  # "\boxedx" is another command name, not a box
        return None
    # "\boxed 5": the argument is the next run of non-space characters, up to a math delimiter.
    match = re.match(r"[^\s$]+", text[i:])
    return match.group(0) if match else None


def last_boxed(text: str) -> str | None:
    """Content of the last well-formed ``\\boxed`` / ``\\fbox`` in ``text`` (None if none)."""
    boxes = list(_BOX_COMMAND.finditer(text))
    closers = closing_braces(text) if boxes else {}
    for match in reversed(boxes):
        content = _box_content(text, match.end(), closers)
        if content is not None and content.strip():
            return content.strip()
    return None


def _clean_phrase(answer: str) -> str | None:
    answer = answer.strip()
    if answer.startswith("$"):  # "$x = 3$. I hope" -> the math span only
        answer = answer.lstrip("$").split("$", 1)[0]
    else:  # the sentence ends at a period followed by a space (not a decimal point)
        answer = re.split(r"\.\s", answer, maxsplit=1)[0]
    answer = answer.strip()
    # A sentence ending after the answer: "The answer is 5." -> "5".
    answer = re.sub(r"[.\s]+$", "", answer).strip().strip("$").strip()
    return answer or None


def extract_answer(text: str | None) -> str | None:
    """Return the final answer written in ``text``, or None when it states none.

    ``\\boxed{...}`` wins over ``#### x`` which wins over "The answer is x" / "Answer: x"; within
    each kind the last occurrence wins (models restate and correct themselves).
    """
    if not text:
        return None
    if not isinstance(text, str):
        raise TypeError(f"extract_answer expects a string completion, got {type(text).__name__}")
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    markers = list(_GSM8K_MARKER.finditer(text))
    if markers:
        answer = _clean_phrase(markers[-1].group(1))
        if answer is not None:
            return answer
    phrases = list(_ANSWER_PHRASE.finditer(text))
    for phrase in reversed(phrases):
        answer = _clean_phrase(phrase.group(1))
        if answer is not None:
            return answer
    return None
