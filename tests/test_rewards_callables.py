"""Reward callables: correctness {0,1} / {-1,+1}, format, DAPO overlong penalty, config combinator."""

import numpy as np
import pytest

from jaxrl_llm.rewards import (
    REWARD_REGISTRY,
    build_reward_fn,
    combine_rewards,
    correctness_reward,
    format_reward,
    overlong_penalty,
    overlong_reward,
    register_reward,
)

COMPLETIONS = [r"so \boxed{4}", r"\boxed{5}", "I give up", "#### 4"]
GOLDS = ["4", "4", "4", "4"]


def test_correctness_binary_and_signed():
    assert correctness_reward(COMPLETIONS, GOLDS) == [1.0, 0.0, 0.0, 1.0]
    assert correctness_reward(COMPLETIONS, GOLDS, signed=True) == [1.0, -1.0, -1.0, 1.0]


def test_format_reward():
    assert format_reward(COMPLETIONS, GOLDS) == [1.0, 1.0, 0.0, 1.0]


def _dapo_reference(length, max_len, buffer, factor):
    # DAPO Eq. 13 written out case by case.
    expected_start = max_len - buffer
    if length <= expected_start:
        return 0.0
    return -(length - expected_start) / buffer * factor


def test_overlong_penalty_matches_the_formula():
    lengths = [0, 100, 3072, 3073, 3584, 4096, 4200]
    got = overlong_penalty(lengths, max_len=4096, buffer=1024, factor=2.0)
    expected = [_dapo_reference(length, 4096, 1024, 2.0) for length in lengths]
    np.testing.assert_allclose(got, expected)
    # Hand values: halfway through the buffer costs factor/2, the hard limit costs the full factor.
    assert got[4] == pytest.approx(-1.0) and got[5] == pytest.approx(-2.0) and got[2] == 0.0


def test_overlong_reward_reads_lengths_from_meta():
    got = overlong_reward(["a", "b"], ["x", "y"], lengths=[10, 20], max_len=20, buffer=10)
    assert got == [0.0, -1.0]
    with pytest.raises(ValueError, match="3 lengths for 2 completions"):
        overlong_reward(["a", "b"], ["x", "y"], lengths=[1, 2, 3], max_len=20, buffer=10)
    with pytest.raises(ValueError, match="buffer must be in"):
        overlong_penalty([1], max_len=10, buffer=0)


def test_combine_rewards_weighted_sum():
    combined = combine_rewards([(correctness_reward, 1.0), (format_reward, 0.5)])
    assert combined(COMPLETIONS, GOLDS) == [1.5, 0.5, 0.0, 1.5]


def test_build_reward_fn_from_config():
    config = {
        "correctness": {"weight": 1.0, "signed": True},
        "format": {"weight": 0.1},
        "overlong": {"weight": 1.0, "max_len": 100, "buffer": 50, "factor": 1.0},
    }
    reward = build_reward_fn(config)
    lengths = [10, 75, 100, 50]
    got = reward(COMPLETIONS, GOLDS, lengths=lengths)
    # correctness {-1,+1} + 0.1 * format + overlong penalty, computed by hand:
    expected = [1 + 0.1 + 0.0, -1 + 0.1 - 0.5, -1 + 0.0 - 1.0, 1 + 0.1 + 0.0]
    np.testing.assert_allclose(got, expected)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"corectness": {"weight": 1.0}}, "unknown reward 'corectness'"),
        ({"format": {"weight": 1.0, "scale": 2}}, "unknown keys \\['scale'\\]"),
        ({"overlong": {"weight": 1.0, "max_len": 10}}, "needs keys \\['buffer'\\]"),
        ({"format": 1.0}, "must be a mapping"),
        ({}, "no rewards given"),
    ],
)
def test_build_reward_fn_rejects_bad_config(config, message):
    with pytest.raises(ValueError, match=message):
        build_reward_fn(config)


def length_bonus(completions, golds, *, per_char=0.0, **meta):
    return [per_char * len(completion) for completion in completions]


def test_register_custom_reward():
    register_reward("length_bonus", length_bonus, options=["per_char"])
    try:
        reward = build_reward_fn({"length_bonus": {"weight": 2.0, "per_char": 0.5}, "format": {"weight": 1.0}})
        assert reward(["ab", r"\boxed{1}"], ["1", "1"]) == [2.0, 2.0 * 0.5 * 9 + 1.0]
    finally:
        del REWARD_REGISTRY["length_bonus"]


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="2 completions but 1 golds"):
        format_reward(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
        combine_rewards([(lambda c, g, **m: [0.0], 1.0)])(["a", "b"], ["1", "2"])


def test_correctness_reward_conventions():
    completions, golds = [r"\boxed{3, 2}", r"\boxed{0.3333}"], ["2, 3", r"\frac{1}{3}"]
    assert correctness_reward(completions, golds) == [1.0, 1.0]
    strict = {"ordered_lists": True, "rel_tol": 0.0}
    assert correctness_reward(completions, golds, conventions=strict) == [0.0, 0.0]
    reward = build_reward_fn({"correctness": {"weight": 1.0, "conventions": strict}})
    assert reward(completions, golds) == [0.0, 0.0]
    with pytest.raises(ValueError, match="unknown conventions"):
        correctness_reward(completions, golds, conventions={"tolerance": 0.1})


def test_correctness_reward_pays_only_stated_answers_and_reads_the_last_box():
    completions = ["8 - 3 = 5", r"\boxed{0}\boxed{5}", r"so \boxed{5}", "The answer is 5"]
    golds = ["5"] * 4
    # the RL reward: an unmarked value is no answer, the last box is the answer (the on-device rule)
    assert correctness_reward(completions, golds) == [0.0, 1.0, 1.0, 1.0]
    # grading conventions (math_reward's defaults): the unmarked 5 counts, the two boxes form "0, 5"
    lenient = {"unmarked_answers": True, "box_groups": True}
    assert correctness_reward(completions, golds, conventions=lenient) == [1.0, 0.0, 1.0, 1.0]
