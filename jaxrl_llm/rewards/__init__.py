"""Verifiable rewards for math reasoning: answer extraction, normalisation, sympy equivalence,
time and size limits, a process-pooled batch scorer, and reward callables.

Importing this package loads neither JAX nor sympy; sympy and the LaTeX parser load on first use.
Reward callables share one signature, ``(completions, golds, **meta) -> list[float]``.
"""

from jaxrl_llm.rewards.code import code_reward, extract_code, run_tests
from jaxrl_llm.rewards.equivalence import DEFAULT_TIMEOUT, VerifierConfig, answers_equal, math_reward
from jaxrl_llm.rewards.extract import boxed_answer, extract_answer, extract_choice, last_boxed
from jaxrl_llm.rewards.normalize import choice_letter, normalize_answer
from jaxrl_llm.rewards.parse import to_sympy
from jaxrl_llm.rewards.pool import VerifierPool, score_batch
from jaxrl_llm.rewards.rewards import (
    REWARD_REGISTRY,
    RewardFn,
    build_reward_fn,
    combine_rewards,
    correctness_reward,
    format_reward,
    overlong_penalty,
    overlong_reward,
    register_reward,
)
from jaxrl_llm.rewards.safety import VerifierTimeout, complexity_problem, time_limit

__all__ = [
    "DEFAULT_TIMEOUT",
    "REWARD_REGISTRY",
    "RewardFn",
    "VerifierPool",
    "VerifierConfig",
    "VerifierTimeout",
    "answers_equal",
    "boxed_answer",
    "build_reward_fn",
    "choice_letter",
    "code_reward",
    "combine_rewards",
    "complexity_problem",
    "correctness_reward",
    "extract_answer",
    "extract_choice",
    "extract_code",
    "format_reward",
    "last_boxed",
    "math_reward",
    "normalize_answer",
    "overlong_penalty",
    "overlong_reward",
    "register_reward",
    "run_tests",
    "score_batch",
    "time_limit",
    "to_sympy",
]
