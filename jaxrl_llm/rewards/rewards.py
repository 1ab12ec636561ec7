"""Reward functions as plain callables ``(completions, golds, **meta) -> list[float]``.

Built-ins: correctness in {0, 1} (RAFT, GRPO) or {-1, +1} (Reinforce-Rej), a format reward (a
final answer is present), DAPO's overlong penalty (Yu et al., 2025, "DAPO", Eq. 13):

    penalty(L) = min(-(L - (L_max - L_buf)) / L_buf * factor, 0)

and `combine_rewards` / `build_reward_fn`, which sum weighted rewards named in a config dict:

    {"correctness": {"weight": 1.0, "signed": False, "conventions": {"rel_tol": 1e-4}},
     "format": {"weight": 0.1},
     "overlong": {"weight": 1.0, "max_len": 4096, "buffer": 512, "factor": 1.0}}

Any callable with the same signature can be added with `register_reward`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping, Sequence

from jaxrl_llm.rewards.code import code_reward
from jaxrl_llm.rewards.equivalence import DEFAULT_TIMEOUT, VerifierConfig, math_reward
from jaxrl_llm.rewards.extract import extract_answer
from jaxrl_llm.rewards.pool import VerifierPool, score_batch

RewardFn = Callable[..., list[float]]
# Conventions of the RL reward that differ from VerifierConfig's grading defaults: pay only for a stated
# answer, and read the last box alone, as the on-device reward of the fused loop does.
REWARD_CONVENTIONS = {"unmarked_answers": False, "box_groups": False}


def _check_lengths(name: str, completions: Sequence, golds: Sequence) -> None:
    if len(completions) != len(golds):
        raise ValueError(f"{name}: {len(completions)} completions but {len(golds)} golds")


def correctness_reward(
    completions: Sequence[str],
    golds: Sequence[str],
    *,
    signed: bool = False,
    pool: VerifierPool | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    conventions: Mapping | None = None,
    **meta,
) -> list[float]:
    """r = 1 if the extracted final answer equals the gold answer else 0; ``signed``: 2r - 1.

    With ``pool`` the checks run in its worker processes (per-item timeout, memory cap); without,
    in this process under a SIGALRM limit. A timeout or crash counts as incorrect.
    ``conventions``: fields of `VerifierConfig` (``{"rel_tol": 0.0, "ordered_lists": True}``) over
    this reward's defaults, which are `VerifierConfig`'s except ``unmarked_answers=False`` and
    ``box_groups=False`` (`REWARD_CONVENTIONS`): the policy is paid for an answer it states (a box,
    ``#### x``, an answer marker or tag), not for the last number of a text that states none, and
    its last box is its answer, so that these verdicts equal the fused loop's on-device reward.
    """
    _check_lengths("correctness_reward", completions, golds)
    known = {field.name for field in dataclasses.fields(VerifierConfig)}
    unknown = set(conventions or {}) - known
    if unknown:
        raise ValueError(f"correctness_reward: unknown conventions {sorted(unknown)}; known: {sorted(known)}")
    config = VerifierConfig(**{**REWARD_CONVENTIONS, **(conventions or {})})
    reward_fn = functools.partial(math_reward, config=config)
    if pool is not None:
        correct = pool.score(completions, golds, timeout=timeout, reward_fn=reward_fn)
    else:
        correct = score_batch(completions, golds, timeout=timeout, reward_fn=reward_fn)
    return [2.0 * value - 1.0 for value in correct] if signed else [float(value) for value in correct]


def format_reward(completions: Sequence[str], golds: Sequence[str], **meta) -> list[float]:
    """1.0 when the completion states a final answer (a box, ``#### x`` or an answer marker), else 0.0.

    The last-number fallback of `extract_answer` does not count: any text holds a number.
    """
    _check_lengths("format_reward", completions, golds)
    return [0.0 if extract_answer(completion, fallback=False) is None else 1.0 for completion in completions]


def overlong_penalty(lengths, *, max_len: int, buffer: int, factor: float = 1.0):
    """DAPO soft overlong punishment per sequence: min(-(L - (max_len - buffer)) / buffer * factor, 0).

    0 up to ``max_len - buffer`` tokens, then linear down to ``-factor`` at ``max_len`` (no lower
    clamp, as in the paper's formula). NumPy twin of `jaxrl_llm.objectives.overlong_penalty`.
    """
    import numpy as np  # lazily: `import jaxrl_llm.rewards` stays light

    if buffer <= 0 or buffer > max_len:
        raise ValueError(f"overlong_penalty: buffer must be in (0, max_len={max_len}], got {buffer}")
    lengths = np.asarray(lengths, dtype=np.float64)
    return np.minimum(-(lengths - (max_len - buffer)) / buffer * factor, 0.0)


def overlong_reward(
    completions: Sequence[str],
    golds: Sequence[str],
    *,
    lengths: Sequence[int],
    max_len: int,
    buffer: int,
    factor: float = 1.0,
    **meta,
) -> list[float]:
    """`overlong_penalty` of ``lengths`` (response token counts, passed as meta)."""
    _check_lengths("overlong_reward", completions, golds)
    if len(lengths) != len(completions):
        raise ValueError(f"overlong_reward: {len(lengths)} lengths for {len(completions)} completions")
    return overlong_penalty(lengths, max_len=max_len, buffer=buffer, factor=factor).tolist()


def _bind(reward: RewardFn, **bound) -> RewardFn:
    """``reward`` with keyword arguments fixed (meta given at call time cannot override them)."""

    def bound_reward(completions, golds, **meta):
        return reward(completions, golds, **{**meta, **bound})

    bound_reward.__name__ = getattr(reward, "__name__", "reward")
    return bound_reward


def combine_rewards(weighted: Sequence[tuple[RewardFn, float]]) -> RewardFn:
    """r_i = sum_k w_k * r_k(completions, golds, **meta)_i over the (reward, weight) pairs."""
    weighted = list(weighted)
    if not weighted:
        raise ValueError("combine_rewards: no rewards given")

    def combined(completions, golds, **meta):
        import numpy as np

        total = np.zeros(len(completions), dtype=np.float64)
        for reward, weight in weighted:
            values = reward(completions, golds, **meta)
            if len(values) != len(completions):
                name = getattr(reward, "__name__", repr(reward))
                raise ValueError(f"reward {name} returned {len(values)} values for {len(completions)} completions")
            total += weight * np.asarray(values, dtype=np.float64)
        return total.tolist()

    return combined


# name -> (reward callable, options a config entry may set besides "weight", options it must set)
REWARD_REGISTRY: dict[str, tuple[RewardFn, frozenset[str], frozenset[str]]] = {
    "correctness": (correctness_reward, frozenset({"signed", "timeout", "conventions"}), frozenset()),
    "format": (format_reward, frozenset(), frozenset()),
    "overlong": (overlong_reward, frozenset({"max_len", "buffer", "factor"}), frozenset({"max_len", "buffer"})),
    "code_tests": (code_reward, frozenset({"mode", "timeout_s", "memory_mb", "isolation", "workers"}), frozenset()),
}


def register_reward(name: str, reward: RewardFn, options: Sequence[str] = (), required: Sequence[str] = ()) -> None:
    """Make ``reward`` available to `build_reward_fn` under ``name`` with the given config options."""
    REWARD_REGISTRY[name] = (reward, frozenset(options) | frozenset(required), frozenset(required))


def build_reward_fn(config: Mapping[str, Mapping], *, pool: VerifierPool | None = None) -> RewardFn:
    """The weighted sum of the rewards named in ``config`` (see the module docstring).

    Each entry is ``name: {"weight": w, **options}``; ``pool`` (if given) runs correctness checks.
    """
    weighted = []
    for name, entry in config.items():
        if name not in REWARD_REGISTRY:
            raise ValueError(f"reward config: unknown reward {name!r}; known: {sorted(REWARD_REGISTRY)}")
        if not isinstance(entry, Mapping):
            raise ValueError(f"reward config: entry {name!r} must be a mapping like {{'weight': 1.0}}, got {entry!r}")
        reward, allowed, required = REWARD_REGISTRY[name]
        options = {key: value for key, value in entry.items() if key != "weight"}
        unknown = set(options) - allowed
        if unknown:
            raise ValueError(f"reward config: {name!r} has unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        missing = required - set(options)
        if missing:
            raise ValueError(f"reward config: {name!r} needs keys {sorted(missing)}")
        if reward is correctness_reward and pool is not None:
            options["pool"] = pool
        weighted.append((_bind(reward, **options), float(entry.get("weight", 1.0))))
    return combine_rewards(weighted)
