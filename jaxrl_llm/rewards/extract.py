"""Final-answer extraction from a model completion.

Only the text after the last ``</think>`` is read (an answer inside the reasoning does not count);
a ``<think>`` that never closes states no answer. Then, in order of preference (the conventions of
the MATH, Minerva and GSM8K evaluation scripts):
1. the last group of well-formed ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces allowed) or
   ``\\boxed 5``; boxes separated only by punctuation, spacing or a short phrase holding "and" / "or"
   ("\\boxed{1} and \\boxed{2}") form one answer, joined by ", ". A ``#### x`` line or an answer
   marker written after the last box states the final answer again and wins over it;
2. the last GSM8K marker ``#### 42``;
3. the content of the last ``<answer>...</answer>`` tag, read by these same rules; then the last
   answer marker ("The final answer is", "Answer:", "Réponse :", "答案："): the math span or
   the sentence right after it (spans joined by "and" / "," are one answer); in a sentence of
   prose, the value after its last "is", else its first math span or number (Minerva's
   "Final Answer: The final answer is $24$. I hope it is correct.");
4. with ``fallback=True`` (the default) and no box command at all (an unclosed box is an unfinished
   answer): a short text with no prose and no math delimiters is itself the answer; else the last
   math span (``$..$``, ``$$..$$``, ``\\(..\\)``, ``\\[..\\]``; inline spans never cross a line)
   or the last number outside math, whichever ends later.
Every scan is linear in the text length (only the last 8 markers are tried, each within 6,000
characters), so a 20k-character completion costs microseconds.
"""

from __future__ import annotations

import re

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)")
_GSM8K_MARKER = re.compile(r"####[ \t]*([^\n]*)")
# An answer marker: the word for "answer" and an optional "is" / colon. Only the marker is matched,
# so that "Final Answer: The final answer is $24$" yields its last marker, "answer is".
# A bare "answer" (no "is", no colon) is weak: only a math span or a number right after it counts.
_MARKER = re.compile(
    r"(?<![A-Za-z</])(?:answer|r[ée]ponse|respuesta|antwort)"
    r"(?P<link>\s+(?:is|est|es|ist)(?![A-Za-z]))?[ \t]*(?P<colon>[:：])?"
    r"|答案\s*(?P<cjk>(?:是|为)?\s*[:：]?)",
    re.IGNORECASE,
)
_MATH_TOKEN = re.compile(r"(?<!\\)\$\$|\\\[|\\\]|\\\(|\\\)|(?<!\\)\$")
_CLOSER = {"$$": "$$", "\\[": "\\]", "\\(": "\\)", "$": "$"}
# A number in free text: 1,000.99 / 2,74 / -3 / .4 / 13/28 / 25% / \frac{2}{5}. Neighbouring CJK characters
# are allowed ("为13/28"), neighbouring Latin letters and digits are not ("x2", "v3").
_NUMBER = re.compile(
    r"(?<![A-Za-z0-9_.\\])"
    r"(?:-?\\[dt]?frac\{-?\d+\}\{\d+\}|-?(?:\d+(?:[.,]\d+)*|\.\d+)(?:\s*/\s*\d+(?![.,]\d))?%?)"
    r"(?![0-9_])"
)
# A word of prose: three Latin letters, or any letter of a script other than Latin and Greek (CJK, Arabic).
_PROSE_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}|[^\W\d_\x00-\x7f\u00b2\u00b3\u00b9\u00c0-\u024f\u0370-\u03ff]")
_SENTENCE_END = re.compile(r"\.(?:\s|$)|。|\n")
_COPULA = re.compile(r"\s(?:is|are|est|es|ist|equals|was|were|be)\s|=|是|为", re.IGNORECASE)
_CONNECTIVE_WORD = re.compile(r"(?<![A-Za-z])(?:and|or)(?![A-Za-z])", re.IGNORECASE)
_CONNECTIVE_WORDS = 4
# How far after an answer marker its answer is looked for, and how many of the last markers are
# tried: a text of thousands of markers stays linear.
_MARKER_WINDOW = 6_000  # above equivalence.MAX_ANSWER_CHARS: a long answer is never cut
_MARKERS_TRIED = 8
# The longest worded answer an answer marker may introduce; a longer sentence is talk, not an answer.
_WORDED_ANSWER_WORDS = 4
# A text this short with no prose and no math delimiters is itself the answer.
_BARE_ANSWER_CHARS = 200


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




def _boxes(text: str) -> list[tuple[int, int, str]]:
    """(start, end, content) of every well-formed, non-empty box, in order."""
    found = []
    matches = list(_BOX_COMMAND.finditer(text))
    closers = closing_braces(text) if matches else {}
    for match in matches:
        content = _box_content(text, match.end(), closers)
        if content is None or not content.strip():
            continue
        i = match.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        end = closers[i] + 1 if text[i : i + 1] == "{" else i + len(content)
        found.append((match.start(), end, content.strip()))
    return found


def _joins_boxes(separator: str) -> bool:
    """True when the text between two boxes makes them one answer (", ", "and", "\\quad or \\quad")."""
    plain = re.sub(r"\\(?:text|mbox|textrm|mathrm)\s*\{([^{}]*)\}", r"\1", separator)
    plain = re.sub(r"\\[a-zA-Z]+|\\.|[$]", " ", plain)
    words = re.findall(r"[^\W\d_]+", plain)
    if not words:
        return True
    return len(words) <= _CONNECTIVE_WORDS and _CONNECTIVE_WORD.search(plain) is not None


def _group_before(text: str, spans: list[tuple[int, int, str]]) -> str:
    """The last of ``spans`` joined by ", " with the spans before it that only a connective separates."""
    group = [spans[-1]]
    for span in reversed(spans[:-1]):
        if span[1] > group[0][0] or not _joins_boxes(text[span[1] : group[0][0]]):
            break
        group.insert(0, span)
    return ", ".join(content for _, _, content in group)


def _group_after(text: str, spans: list[tuple[int, int, str]]) -> str:
    """The first of ``spans`` joined with the spans after it that only a connective separates."""
    group = [spans[0]]
    for span in spans[1:]:
        if span[0] < group[-1][1] or not _joins_boxes(text[group[-1][1] : span[0]]) or _is_prose(span[2]):
            break
        group.append(span)
    return ", ".join(content for _, _, content in group)


def boxed_answer(text: str) -> str | None:
    """Content of the last group of boxes in ``text``, joined by ", " (None if there is no box).

    ``"\\boxed{1} and \\boxed{2}"`` -> ``"1, 2"``; ``"first \\boxed{3}, finally \\boxed{4}"`` -> ``"4"``.
    """
    boxes = _boxes(text)
    return _group_before(text, boxes) if boxes else None


def math_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, content) of the math spans ``$..$``, ``$$..$$``, ``\\(..\\)``, ``\\[..\\]``.

    One pass over the delimiters; inline spans (``$``, ``\\(``) never cross a line, an escaped
    ``\\$`` is a dollar sign, not a delimiter.
    """
    spans = []
    opened = None
    for match in _MATH_TOKEN.finditer(text):
        token = match.group(0)
        if opened is None:
            if token in _CLOSER:
                opened = match
            continue
        if token != _CLOSER[opened.group(0)]:
            continue
        content = text[opened.end() : match.start()]
        if opened.group(0) in ("$", "\\(") and "\n" in content:
            opened = match if token == "$" else None  # not a span: this "$" may open the next one
            continue
        if content.strip():
            spans.append((opened.start(), match.end(), content.strip()))
        opened = None
    return spans


def _is_prose(text: str) -> bool:
    """True when ``text`` holds a word of three or more letters outside LaTeX commands and math."""
    outside = re.sub(r"\\(?:text|mbox|mathrm|begin|end|operatorname|mathbf|textbf)\s*\{[^{}]*\}", " ", text)
    for start, end, _ in reversed(math_spans(outside)):
        outside = outside[:start] + " " + outside[end:]
    return _PROSE_WORD.search(outside) is not None


def _last_value(text: str) -> tuple[int, str] | None:
    """(end, value) of the last math span or bare number in ``text``, whichever ends later."""
    spans = math_spans(text)
    candidates = []
    if spans:
        start, end, content = spans[-1]
        if _is_prose(content):  # "$? just about 1$": a dollar sign, not math
            number = _last_number(content)
            if number is not None:
                candidates.append((end, number))
            elif len(content.split()) <= _WORDED_ANSWER_WORDS:  # "$odd$": a word set as math
                candidates.append((end, content))
        else:  # "$x = 2$ and $x = -3$": one answer in two spans
            candidates.append((end, _group_before(text, [span for span in spans if not _is_prose(span[2])])))
    outside = text
    for start, end, _ in reversed(spans):
        outside = outside[:start] + " " * (end - start) + outside[end:]
    numbers = list(_NUMBER.finditer(outside))
    if numbers:
        candidates.append((numbers[-1].end(), numbers[-1].group(0)))
    return max(candidates, key=lambda candidate: candidate[0]) if candidates else None


def _last_number(text: str) -> str | None:
    numbers = list(_NUMBER.finditer(text))
    return numbers[-1].group(0) if numbers else None


def _strong(marker: re.Match) -> bool:
    return bool(marker.group("link") or marker.group("colon") or (marker.group("cjk") or "").strip())


def _answer_after_marker(rest: str, strong: bool = True) -> str | None:
    """The answer stated right after an answer marker (see the module docstring, rule 3); after a
    weak marker (a bare "answer"), only a math span or a text without prose."""
    rest = re.sub(r"^(?:[\s:：]|\\?[\"“”'])+", "", rest)  # spacing, a colon, opening quotes
    spans = math_spans(rest)
    if spans and spans[0][0] == 0:
        return _group_after(rest, spans)
    end = _SENTENCE_END.search(rest)
    sentence = (rest if end is None else rest[: end.start()]).strip()
    sentence = re.sub(r"^\*+|\*+$", "", sentence).strip()
    if not sentence:
        return None
    if not _is_prose(sentence):
        return sentence.rstrip(" .").strip() or None
    if not strong:
        return None
    kept = _NEGATED_CLAUSE.sub(" ", sentence).strip(" ,;")  # "is not 5, it is 6": 5 is ruled out
    if not kept:
        return None
    negated, sentence = kept != sentence, kept
    copulas = list(_COPULA.finditer(sentence))
    if copulas:
        tail = sentence[copulas[-1].end() :].strip()
        if tail and not _is_prose(tail):
            return _answer_after_marker(tail)
        sentence = tail or sentence
    value = _first_value(sentence)
    if value is not None:
        return value[1]
    # A few words and no number: a worded answer ("Evelyn", "no solution", "(C) Cecile").
    return sentence if len(sentence.split()) <= _WORDED_ANSWER_WORDS and not negated else None


def _first_value(text: str) -> tuple[int, str] | None:
    """(start, value) of the first math span or bare number in ``text``, whichever starts first."""
    spans = [span for span in math_spans(text) if not _is_prose(span[2])]
    number = _NUMBER.search(text)
    candidates = [(spans[0][0], spans[0][2])] if spans else []
    if number is not None and not any(start <= number.start() < end for start, end, _ in spans):
        candidates.append((number.start(), number.group(0)))
    return min(candidates, key=lambda candidate: candidate[0]) if candidates else None


def _after_thinking(text: str) -> str | None:
    """The text after the last ``</think>``; None when a ``<think>`` was opened and never closed
    (an unfinished reasoning states no answer); the whole text when it has no thinking tags."""
    _, closed, after = text.rpartition("</think>")
    if closed:
        return after
    return None if "<think>" in text else text


def _is_bare_answer(text: str) -> bool:
    """True for a short text that is only math: a digit or a letter, no two Latin letters in a row
    outside LaTeX commands ("so it is 4" is prose), no other script, no math delimiters."""
    plain = re.sub(r"\\[a-zA-Z]+", " ", text)
    return (
        re.search(r"[0-9A-Za-z]", plain) is not None
        and re.search(r"[A-Za-z]{2}", plain) is None
        and not _is_prose(text)
        and not math_spans(text)
        and "#" not in text
    )


def _answer_tag(text: str) -> str | None:
    """Content of the last closed ``<answer>...</answer>`` tag (R1-style completions), else None."""
    lowered = text.lower()
    start = lowered.rfind("<answer>")
    end = lowered.find("</answer>", start) if start >= 0 else -1
    if end < 0:
        return None
    return text[start + len("<answer>") : end].strip() or None


def _last_markers(text: str, start: int = 0) -> list[re.Match]:
    """The last `_MARKERS_TRIED` answer markers of ``text`` after ``start``, the last first."""
    return list(_MARKER.finditer(text, start))[-_MARKERS_TRIED:][::-1]


def extract_answer(text: str | None, *, fallback: bool = True, box_groups: bool = True) -> str | None:
    """Return the final answer written in ``text``, or None when it states none.

    The last statement wins: a box group, a ``#### x`` line or an answer marker ("The answer is x",
    "Answer: x") after the last box is the answer, else that box group; without a box, ``#### x``
    wins over a marker; within each kind the last occurrence wins (models restate and correct
    themselves).
    ``fallback``: without any of these, the last math span or number of the text (rule 4).
    ``box_groups``: off, only the last box counts (the rule of the on-device reward).
    """
    if not text:
        return None
    if not isinstance(text, str):
        raise TypeError(f"extract_answer expects a string completion, got {type(text).__name__}")
    text = _after_thinking(text)
    if not text:
        return None
    boxes = _boxes(text)
    markers = list(_GSM8K_MARKER.finditer(text))
    if markers and (not boxes or markers[-1].start() > boxes[-1][1]):
        answer = _answer_after_marker(markers[-1].group(1))
        if answer is not None:
            return answer
    last_box_end = boxes[-1][1] if boxes else -1
    for marker in _last_markers(text, max(last_box_end, 0)):
        answer = _answer_after_marker(text[marker.end() : marker.end() + _MARKER_WINDOW], _strong(marker))
        if answer is not None:
            return answer
    if boxes:
        return boxed_answer(text) if box_groups else boxes[-1][2]
    tagged = _answer_tag(text)
    if tagged is not None:
        return extract_answer(tagged, box_groups=box_groups)  # the tag states an answer: all of it may be
    for marker in _last_markers(text):
        answer = _answer_after_marker(text[marker.end() : marker.end() + _MARKER_WINDOW], _strong(marker))
        if answer is not None:
            return answer
    if not fallback or _BOX_COMMAND.search(text):
        return None  # a box that never closes is an unfinished answer, not a number to pick up
    bare = text.strip()
    if len(bare) <= _BARE_ANSWER_CHARS and _is_bare_answer(bare):
        return bare.rstrip(" .") or None  # the whole text is an answer: "x^2+1", "1, 2"
    value = _last_value(text)
    return None if value is None else value[1].strip()


# A choice letter standing alone: not inside a word, not the article "A" before a lower-case word.
_LETTER = re.compile(r"(?<![A-Za-z0-9'’])([A-J])(?![A-Za-z0-9'’])(?!\s+[a-z])")
_LEADING_LETTER = re.compile(r"^[\s*(\[]*([A-J])(?:[)\].:：。,，]|\s*$|(?=[^\x00-\x7f])|\s+(?![A-Za-z]))")
# A clause that rules options out: "not A", "can't be A or B", "non A", "不是 A"; it ends at , ; . 。
_NEGATED_CLAUSE = re.compile(
    r"(?:(?<![A-Za-z])(?:not|non|never|n't(?:\s+be)?)(?![A-Za-z])|不是|不)[^,;.。，；\n]*"
)


def _unnegated_letters(text: str) -> list[str]:
    kept = _NEGATED_CLAUSE.sub(" ", text)
    return _LETTER.findall(kept)


def extract_choice(text: str | None, *, fallback: bool = True) -> str | None:
    """The multiple-choice letter (A-J) a completion picks, or None.

    A letter that opens the completion ("D. it can't be A or B") wins; then a box; then the first
    letter after the last answer marker; then, with ``fallback``, the last letter outside a negated
    clause ("It's not A ..., I think it's B" -> "B").
    """
    if not text:
        return None
    if not isinstance(text, str):
        raise TypeError(f"extract_choice expects a string completion, got {type(text).__name__}")
    text = _after_thinking(text)
    if not text:
        return None
    leading = _LEADING_LETTER.match(text)
    if leading:
        return leading.group(1)
    boxed = boxed_answer(text)
    if boxed is not None:
        letters = _LETTER.findall(re.sub(r"\\[a-zA-Z]+", " ", boxed))
        return letters[0] if letters else None
    for marker in _last_markers(text):
        letters = _unnegated_letters(text[marker.end() : marker.end() + _MARKER_WINDOW].split("\n", 1)[0])
        if letters:
            return letters[0]
    if not fallback:
        return None
    letters = _unnegated_letters(text)
    return letters[-1] if letters else None
