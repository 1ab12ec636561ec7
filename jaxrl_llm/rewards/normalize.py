"""String normalisation of math answers before any comparison.

Follows the rules of the MATH benchmark's answer normaliser (Hendrycks et al., 2021, "strip_string")
and the Minerva normaliser (Lewkowycz et al., 2022), written anew: drop ``$`` and math delimiters,
``\\text{}``/``\\mathrm{}`` wrappers, units, ``\\%``, degrees, ``\\left``/``\\right``, spacing
commands and thousands separators; unify ``\\dfrac``/``\\tfrac``/``\\frac12`` into ``\\frac{1}{2}``;
drop a trailing period. Every step is a linear scan or a backtracking-free regex.
"""

from __future__ import annotations

import re

from jaxrl_llm.rewards.extract import boxed_answer, matching_brace

# Unit words dropped after a number ("5 cm", "12 \text{ dollars}"); plural "s" is optional.
UNIT_WORDS = (
    "mm", "cm", "m", "km", "meter", "metre", "centimeter", "kilometer", "inch", "inches", "foot",
    "feet", "ft", "yard", "mile", "miles", "mph", "second", "sec", "minute", "min", "hour", "hr", "day",
    "week", "month", "year", "gram", "g", "kg", "pound", "lb", "lbs", "ounce", "oz", "liter", "litre",
    "ml", "gallon", "degree", "unit", "dollar", "cent", "euro", "point", "percent", "sq", "square",
    "cubic", "people", "person", "student", "apple", "book", "page", "ways", "way", "times",
    "pct", "percentage",
)
_UNIT_PATTERN = "|".join(sorted(UNIT_WORDS, key=len, reverse=True))
_TRAILING_UNITS = re.compile(
    rf"(?<=[\d}}).])\s+(?:(?:{_UNIT_PATTERN})(?:s|es)?(?:\^?\{{?[23]\}}?)?\s*)+$", re.IGNORECASE
)
_TEXT_WRAPPERS = re.compile(
    r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mathsf|mathnormal|mbox|"
    r"operatorname|boldsymbol|bm|rm)\s*\{"
)
_SPACING = re.compile(r"(?<!\\)\\(?:,|;|:|!|>|quad|qquad|displaystyle|textstyle|scriptstyle| )|~")
_SIZING = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|biggl|biggr|big|Big|bigg|Bigg)(?![a-zA-Z])\s*")
# Degrees are a unit only at the end ("30^\circ"); inside "\cos 60^\circ" they are not dropped.
_DEGREES = re.compile(r"(?:\^\s*\{?\s*\\circ\s*\}?|°|\\degree(?:s)?(?![a-zA-Z]))\s*$")
# "2 or 3", "x=2 \text{ and } x=3": a list of values.
_WORD_SEPARATOR = re.compile(r"(?<=[\w})\]])\s+(?:and|or)\s+(?=[-\w\\({\[])")
_FRAC_SHORT = re.compile(r"\\frac\s*(\d|\\?[a-zA-Z])\s*(\d|\\?[a-zA-Z]|\{)")
_SQRT_SHORT = re.compile(r"\\sqrt\s*(\d|[a-zA-Z])")
_THOUSANDS = re.compile(r"-?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?")
# A command written with a doubled backslash ("\\\\frac", an escaping slip in JSON or Python source);
# a real row break "\\\\" is never followed directly by one of these names.
_DOUBLED_COMMAND = re.compile(
    r"(?<!\\)\\\\(?=(?:frac|dfrac|tfrac|sqrt|left|right|le|leq|ge|geq|lt|gt|neq|ne|in|notin|cup|cap|pm|mp|"
    r"cdot|times|div|pi|infty|text|mathrm|mathbf|boxed|approx|quad|qquad|sum|prod|int|log|ln|sin|cos|tan|"
    r"emptyset|varnothing|alpha|beta|gamma|theta|lambda|mu|sigma|omega)(?![a-zA-Z]))"
)
# "1 or 2" written without spaces: "(11,7)or(7,11)", "1orW(x)=-1".
_GLUED_WORD_SEPARATOR = re.compile(r"(?<=[\d)\]}])(?:or|and)(?=[-\d(\[{A-Z\\])")
# A trailing \text{...} of words after a value ("17\text{ any text}") says what the value counts.
_TRAILING_TEXT = re.compile(r"(?<=[\d}).])\s*\\(?:text|mbox|textrm|mathrm)\s*\{\s*[^\W\d_][^{}\d]*\}\s*\.?\s*$")
_CHOICE = re.compile(r"(?:option|choice)?\s*\(?\s*([A-J])\s*\)?\s*[.:]?", re.IGNORECASE)


def _unwrap_commands(text: str) -> str:
    """Replace ``\\text{abc}`` (and kin) by ``abc``; a unit word right after a number is dropped."""
    out = []
    position = 0
    for _ in range(len(text)):  # bounded: each round consumes at least one wrapper
        match = _TEXT_WRAPPERS.search(text, position)
        if match is None:
            break
        close = matching_brace(text, match.end() - 1)
        if close is None:
            break
        inner = text[match.end() : close]
        before = text[position : match.start()]
        is_unit = re.fullmatch(rf"\s*(?:(?:{_UNIT_PATTERN})(?:s|es)?\s*)+\.?\s*", inner, re.IGNORECASE)
        follows_value = before.rstrip()[-1:].isdigit() or before.rstrip()[-1:] in ("}", ")")
        out.append(before)
        position = close + 1
        if not (is_unit and follows_value):
            out.append(inner)
        else:  # "15\mbox{ cm}^2": the unit's power goes with it
            power = re.match(r"\s*\^\s*(?:\{\s*[23]\s*\}|[23])", text[position:])
            position += power.end() if power else 0
    out.append(text[position:])
    return "".join(out)


def _expand_short_fracs(text: str) -> str:
    r"""``\frac12`` -> ``\frac{1}{2}``, ``\frac1{x}`` -> ``\frac{1}{x}``, ``\sqrt2`` -> ``\sqrt{2}``."""

    def fix(match: re.Match) -> str:
        first, second = match.group(1), match.group(2)
        return "\\frac{" + first + "}" + ("{" if second == "{" else "{" + second + "}")

    text = _FRAC_SHORT.sub(fix, text)
    return _SQRT_SHORT.sub(lambda m: "\\sqrt{" + m.group(1) + "}", text)


def _strip_math_delimiters(text: str) -> str:
    text = text.replace("\\$", "").replace("$", "")
    for delimiter in ("\\(", "\\)", "\\[", "\\]"):
        text = text.replace(delimiter, "")
    return text


_REPEATING_DECIMAL = re.compile(r"(?<![\d.])(\d*)\.(\d*)\\(?:overline|bar|dot)\s*(?:\{(\d+)\}|(\d))")


def _repeating_decimal_fraction(match: re.Match) -> str:
    """``0.1\\overline{6}`` -> ``\\frac{15}{90}``: x = (IFR - IF) / (10^|F| (10^|R| - 1)) for the integer
    part I, the fixed digits F and the repeating digits R, each read as a digit string."""
    whole, fixed, repeat = match.group(1) or "0", match.group(2), match.group(3) or match.group(4)
    numerator = int(whole + fixed + repeat) - int(whole + fixed)
    return "\\frac{%d}{%d}" % (numerator, 10 ** len(fixed) * (10 ** len(repeat) - 1))


def normalize_answer(answer: str) -> str:
    """Canonical string form of one answer (whitespace collapsed to single spaces).

    ``"$\\dfrac12$"`` -> ``"\\frac{1}{2}"``; ``"1{,}000"``/``"1,000"`` -> ``"1000"``;
    ``"30^\\circ"`` -> ``"30"``; ``"5\\text{ cm}."`` -> ``"5"``; ``"\\left( 1,2 \\right)"`` -> ``"(1,2)"``.
    """
    if not isinstance(answer, str):
        raise TypeError(f"normalize_answer expects a string, got {type(answer).__name__}")
    text = _DOUBLED_COMMAND.sub(lambda match: "\\", answer.strip())
    boxed = boxed_answer(text) if ("\\boxed" in text or "\\fbox" in text) else None
    if boxed is not None:
        text = boxed
    elif text.startswith("\\boxed{"):  # a box left open: its content runs to the end
        text = text[len("\\boxed{") :]
    text = _strip_math_delimiters(text)
    text = _REPEATING_DECIMAL.sub(_repeating_decimal_fraction, text)
    text = _TRAILING_TEXT.sub("", text)
    text = re.sub(r",\\!\s*(?=\d{3})", ",", text)  # "11,\\! 111" is a thousands separator
    text = text.replace("\n", " ").replace("\\!", "")
    text = _SPACING.sub(" ", text)
    text = _SIZING.sub("", text).replace("\\middle", "")
    text = _DEGREES.sub("", text)
    text = text.replace("\\%", "").replace("%", "")
    text = _unwrap_commands(text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = re.sub(r"\s*\{\s*,\s*\}\s*", "", text).replace("\\cdotp", "\\cdot")  # "14{,}916"
    text = re.sub(r"\\le(?![a-zA-Z])", r"\\leq", text)
    text = re.sub(r"\\ge(?![a-zA-Z])", r"\\geq", text)
    text = re.sub(r"\\ne(?![a-zA-Z])", r"\\neq", text)
    text = text.replace("\\lt", "<").replace("\\gt", ">").replace("!=", "\\neq ")
    text = text.replace(">=", "\\geq ").replace("<=", "\\leq ")
    if "\\approx" in text:
        before = text.split("\\approx", 1)[0]
        if re.fullmatch(r"\s*[A-Za-z](?:_\{?\w+\}?)?\s*", before):  # "x \approx 11": the value
            text = text.replace("\\approx", "=", 1)
        elif before.strip():  # "x = 1/3 \approx 0.33", "\pi \approx 3.14": the exact value before it
            text = before
    text = text.replace("\\varnothing", "\\emptyset").replace("\\mathbb{R}", "(-\\infty,\\infty)")
    text = text.replace("\\lbrace", "\\{").replace("\\rbrace", "\\}")
    text = re.sub(r"\s+", " ", text).strip()
    if len(text) < 200 and re.search(r"\d", text):
        text = _GLUED_WORD_SEPARATOR.sub(", ", text)
        text = _WORD_SEPARATOR.sub(", ", text)
    text = re.sub(r"([(\[{]) | (?=[)\]}])", r"\1", text)  # "( 1,2 )" -> "(1,2)"
    if len(text) < 200:  # unit words only follow short answers; keeps the regex linear overall
        text = _TRAILING_UNITS.sub("", text).strip()
    text = _expand_short_fracs(text)
    text = re.sub(r"(?<![\d}])\.(\d)", r"0.\1", text)  # ".5" -> "0.5"
    text = re.sub(r"(?:\s*[.,;])+$", "", text).strip()  # a sentence's final period or comma
    text = re.sub(r"(?<!\\)\\$", "", text).strip()  # a stray backslash at the end
    if text.startswith("{") and matching_brace(text, 0) == len(text) - 1 and len(split_top_level(text[1:-1], ",")) > 1:
        text = text[1:-1].strip()  # "{1,3}": LaTeX grouping braces around a list, not a set
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    if text.lower() in ("infinity", "inf", "+\\infty"):
        text = "\\infty"
    if text.replace(" ", "") == "\\{\\}":
        text = "\\emptyset"
    return text


def compact(text: str) -> str:
    """``normalize_answer`` output with every space removed: the key for exact string matching."""
    return text.replace(" ", "")


def choice_letter(answer: str) -> str | None:
    """The multiple-choice letter an answer names (``"(B)"``, ``"B."``, ``"Option b"`` -> ``"B"``)."""
    match = _CHOICE.fullmatch(answer.strip())
    return match.group(1).upper() if match else None


def split_top_level(text: str, separator: str) -> list[str]:
    """Split on ``separator`` where it is outside every (), [], {} pair."""
    parts, depth, start, i = [], 0, 0, 0
    width = len(separator)
    while i < len(text):
        ch = text[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and text.startswith(separator, i):
            parts.append(text[start:i])
            start = i + width
            i += width
            continue
        i += 1
    parts.append(text[start:])
    return [part.strip() for part in parts]
