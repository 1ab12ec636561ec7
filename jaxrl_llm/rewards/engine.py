"""math-verify (Hugging Face, Apache-2.0) as a second opinion on answer atoms our own rules could not match.

What it adds: its LaTeX normalisation (latex2sympy2_extended's, with units, ``\\text`` and
malformed operators), its set, interval and matrix comparison (``z \\in [-3/2, -1] \\cup [1, 3/2]``
against ``1 \\le |z| \\le 3/2``; ``A + B`` against the matrix it sums to).

How it is kept safe and bounded:
- only LaTeX extraction is used (`LatexExtractionConfig`): math-verify's plain-text path runs
  sympy's ``parse_expr``, an ``eval`` of the text, so it is never called; the LaTeX path builds
  sympy objects node by node from the ANTLR parse tree, as `parse.to_sympy` does;
- both strings pass `safety.complexity_problem` first (size, nesting, power towers, huge
  factorials), the same screen as our own parser;
- math-verify's own timeouts (``signal.alarm``, main thread only, and a SIGALRM handler of its
  own that would replace ours) are switched off with ``parsing_timeout=None`` /
  ``timeout_seconds=None``: the caller's `safety.time_limit` and the worker pool's kill are the
  only limits, and `VerifierTimeout` (a BaseException) passes through math-verify's
  ``except Exception`` blocks;
- it may only say "equal" for atoms that are not both plain numbers (those are decided exactly
  by `symbolic.numbers_equal`), and its float rounding is set from ``rel_tol``.
When math-verify is not installed this answers False and the verifier runs on its own rules.
"""

from __future__ import annotations

import functools
import logging
import math

from jaxrl_llm.rewards.parse import plain_to_latex
from jaxrl_llm.rewards.safety import complexity_problem


@functools.lru_cache(maxsize=1)
def _mathverify():
    """(parse, verify, extraction config) of math-verify, or None when it is not installed."""
    try:
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        return None
    # math-verify warns once per process that its timeouts are off: ours are the authority.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return parse, verify, [LatexExtractionConfig(boxed_match_priority=0)]


def _parse(text: str):
    """math-verify's parse of one LaTeX answer (a list: sympy object and string), [] if refused."""
    latex = plain_to_latex(text)
    if not latex.strip() or complexity_problem(latex) is not None:
        return []
    parse, _, config = _mathverify()
    return parse(f"${latex}$", extraction_config=config, parsing_timeout=None)


def mathverify_equal(pred: str, gold: str, rel_tol: float) -> bool:
    """math-verify's ``verify(parse(gold), parse(pred))`` on two normalised answers, screened first.

    Float rounding: the number of decimals that ``rel_tol`` keeps for values near 1 (1e-4 -> 4);
    ``rel_tol`` of 0 asks for 15.
    """
    if _mathverify() is None:
        return False
    gold_parsed = _parse(gold)
    pred_parsed = _parse(pred) if gold_parsed else []
    if not gold_parsed or not pred_parsed:
        return False
    _, verify, _ = _mathverify()
    digits = 15 if rel_tol <= 0 else max(1, min(15, round(-math.log10(rel_tol))))
    return bool(verify(gold_parsed, pred_parsed, float_rounding=digits, timeout_seconds=None))


def warm_up_mathverify() -> None:
    """Import math-verify and run one comparison, outside any time limit (see `parse.warm_up`)."""
    if _mathverify() is not None:
        mathverify_equal(r"[1, 2] \cup [3, 4]", r"[3, 4] \cup [1, 2]", 1e-4)
