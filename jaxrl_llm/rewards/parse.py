"""Answer string -> sympy object, without ever evaluating text as code.

Plain-text math (``sqrt(2)/2``, ``2*pi``, ``1.5e3``, ``x**2``) is first rewritten into LaTeX, then
everything goes through one parser: the ANTLR LaTeX grammar of ``latex2sympy2_extended`` (the
parser behind Hugging Face's math-verify), which builds sympy objects node by node — no
``eval``, ``exec`` or ``sympify`` of the input. Inputs that fail the static screen of
`safety.complexity_problem` are never parsed.
"""

from __future__ import annotations

import functools
import re

from jaxrl_llm.rewards.safety import MAX_SYMPY_CHARS, complexity_problem

_SCIENTIFIC = re.compile(r"(?<![\w.\\])(\d+(?:\.\d+)?)[eE]([-+]?\d+)(?![\w.])")
_PLAIN_FUNCTION = re.compile(r"(?<![\\a-zA-Z])(sin|cos|tan|cot|sec|csc|log|ln|exp|arcsin|arccos|arctan)(?=\s*\()")
_PLAIN_CONSTANT = re.compile(r"(?<![\\a-zA-Z])(pi|infty|infinity|inf)(?![a-zA-Z])")
_PLAIN_SQRT = re.compile(r"(?<![\\a-zA-Z])sqrt\s*(?=[({])")


def _rewrite_plain_sqrt(text: str) -> str:
    """``sqrt(2+x)`` -> ``\\sqrt{2+x}`` (balanced parentheses only)."""
    out, position = [], 0
    for match in _PLAIN_SQRT.finditer(text):
        if match.start() < position:
            continue
        open_index = match.end()
        opener = text[open_index]
        closer = ")" if opener == "(" else "}"
        depth = 0
        for i in range(open_index, len(text)):
            if text[i] == opener:
                depth += 1
            elif text[i] == closer:
                depth -= 1
                if depth == 0:
                    out.append(text[position : match.start()])
                    out.append("\\sqrt{" + text[open_index + 1 : i] + "}")
                    position = i + 1
                    break
    out.append(text[position:])
    return "".join(out)


def plain_to_latex(text: str) -> str:
    """Rewrite plain-text math into the LaTeX the parser reads (``x**2`` -> ``x^2``, ``pi`` -> ``\\pi``)."""
    text = text.replace("**", "^").replace(">=", "\\geq ").replace("<=", "\\leq ").replace("!=", "\\neq ")
    text = _SCIENTIFIC.sub(lambda m: f"{m.group(1)}\\times 10^{{{m.group(2)}}}", text)
    text = _rewrite_plain_sqrt(text)
    text = _PLAIN_FUNCTION.sub(r"\\\1", text)
    constants = {"pi": "\\pi", "infty": "\\infty", "infinity": "\\infty", "inf": "\\infty"}
    return _PLAIN_CONSTANT.sub(lambda m: constants[m.group(1)], text)


@functools.lru_cache(maxsize=1)
def _converter():
    # Imported here: sympy and the ANTLR runtime cost ~0.5 s, paid on the first parse only.
    from latex2sympy2_extended.latex2sympy2 import ConversionConfig, latex2sympy

    config = ConversionConfig(
        interpret_as_mixed_fractions=True,  # "2\frac{1}{2}" is 5/2 in competition answers
        interpret_simple_eq_as_assignment=False,
        interpret_contains_as_eq=False,
        lowercase_symbols=False,  # "A" and "a" are different answers
    )
    return functools.partial(latex2sympy, normalization_config=None, conversion_config=config)


@functools.lru_cache(maxsize=1)
def warm_up() -> None:
    """Import sympy, the parser and the modules sympy loads lazily, once, before any time limit.

    An import cut short by a timeout leaves a half-initialised module behind (for example
    ``sympy`` without ``sympy.assumptions``) and breaks every later comparison in the process.
    """
    import sympy

    expression = _converter()(r"\frac{x^2-1}{x-1} + \sqrt{2} \cdot \pi")
    sympy.simplify(expression - sympy.Symbol("x")).evalf(30)
    sympy.simplify(sympy.sin(sympy.Symbol("y")) ** 2 + sympy.cos(sympy.Symbol("y")) ** 2)
    for text in (r"x \leq 3", r"\begin{pmatrix}1\\2\end{pmatrix}", r"(1, 2]", r"\{1, 2\}", r"10!", r"\log_2 8"):
        _converter()(text)
    # The parser builds its prediction tables per construct on first sight (0.5 s for a first sum):
    # meet the big operators here, not inside a timed comparison.
    for text in (r"F_n = \sum_{k=0}^{n-1} F_k F_{n-k-1}", r"\prod_{k=1}^{n} (1 + a_k)", r"\int_0^1 x^2 \, dx",
                 r"\lim_{x \to 0} \frac{\sin x}{x}", r"y = \frac{d}{dx} x^2"):
        _converter()(text)
    from jaxrl_llm.rewards.engine import warm_up_mathverify

    warm_up_mathverify()


@functools.lru_cache(maxsize=4096)
def to_sympy(text: str):
    """Parse one normalised answer atom into a sympy object; None when unsafe or unparsable.

    Cached: a gold answer is parsed once for all the samples of its prompt (sympy objects are
    immutable; a parse cut short by a timeout raises and is not cached).
    """
    if len(text) > 2 * MAX_SYMPY_CHARS:  # keep the rewrites below cheap; the screen would refuse it anyway
        return None
    latex = plain_to_latex(text)
    if not latex.strip() or complexity_problem(latex) is not None:
        return None
    try:
        return _converter()(latex)
    except (Exception, RecursionError):  # the parser reports bad input with bare Exception
        return None
