"""Advantage estimators and DAPO shaping against hand values and loop-based NumPy references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.objectives import (
    ADVANTAGE_ESTIMATORS,
    grpo_advantages,
    mixed_group_mask,
    mixed_groups,
    overlong_penalty,
    raft_advantages,
    reinforce_rej_advantages,
    rloo_advantages,
)

# Groups of sizes 3 (mixed), 1 (single), 2 (equal rewards), 0 (id 3 unused), 4 (mixed).
REWARDS = np.array([1.0, 0.0, 1.0, 5.0, 2.0, 2.0, 1.0, -1.0, -1.0, 1.0], np.float32)
GROUP_IDS = np.array([0, 0, 0, 1, 2, 2, 4, 4, 4, 4], np.int32)


def members(group_ids, i):
    return [j for j in range(len(group_ids)) if group_ids[j] == group_ids[i]]


def grpo_loop(rewards, group_ids, scale_by_std=True, eps=1e-6):
    out = []
    for i in range(len(rewards)):
        rs = [float(rewards[j]) for j in members(group_ids, i)]
        if len(rs) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(rs) / len(rs)
            std = math.sqrt(sum((x - mean) ** 2 for x in rs) / (len(rs) - 1))
        out.append((rewards[i] - mean) / (std + eps) if scale_by_std else rewards[i] - mean)
    return np.array(out)


def rloo_loop(rewards, group_ids):
    out = []
    for i in range(len(rewards)):
        others = [float(rewards[j]) for j in members(group_ids, i) if j != i]
        out.append(rewards[i] - (sum(others) / len(others) if others else 0.0))
    return np.array(out)


def test_grpo_hand_values():
    adv = np.asarray(grpo_advantages(REWARDS, GROUP_IDS))
    # group 0: mean 2/3, unbiased std sqrt(1/3)
    std0 = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)
    np.testing.assert_allclose(adv[:3], np.array([1 / 3, -2 / 3, 1 / 3]) / (std0 + 1e-6), rtol=1e-5)
    np.testing.assert_allclose(adv[3], 5.0 / (1.0 + 1e-6), rtol=1e-6)  # group of one: mean 0, std 1
    np.testing.assert_array_equal(adv[4:6], [0.0, 0.0])  # equal rewards
    # group 4: mean 0, std sqrt(4/3)
    np.testing.assert_allclose(adv[6:], np.array([1, -1, -1, 1]) / (math.sqrt(4 / 3) + 1e-6), rtol=1e-5)


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_matches_loop_reference_random_groups(scale_by_std):
    rng = np.random.default_rng(0)
    group_ids = rng.integers(0, 7, size=40).astype(np.int32)
    rewards = rng.normal(size=40).astype(np.float32)
    expected = grpo_loop(rewards, group_ids, scale_by_std)
    got = grpo_advantages(rewards, group_ids, num_groups=9, scale_by_std=scale_by_std)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-5)


def test_drgrpo_no_std_and_single_group():
    adv = np.asarray(grpo_advantages(REWARDS, GROUP_IDS, scale_by_std=False))
    np.testing.assert_allclose(adv, [1 / 3, -2 / 3, 1 / 3, 5.0, 0, 0, 1, -1, -1, 1], rtol=1e-6, atol=1e-7)


def test_rloo_hand_and_loop():
    adv = np.asarray(rloo_advantages(REWARDS, GROUP_IDS))
    np.testing.assert_allclose(adv[:3], [1 - 0.5, 0 - 1.0, 1 - 0.5], rtol=1e-6)
    assert adv[3] == 5.0  # group of one: baseline 0
    np.testing.assert_allclose(adv[6:], [1 + 1 / 3, -1 - 1 / 3, -1 - 1 / 3, 1 + 1 / 3], rtol=1e-6)
    np.testing.assert_allclose(adv, rloo_loop(REWARDS, GROUP_IDS), rtol=1e-6, atol=1e-6)


def test_raft_is_positive_part():
    np.testing.assert_array_equal(np.asarray(raft_advantages(jnp.array([1.0, -1.0, 0.0, 0.5]))), [1, 0, 0, 0.5])
    assert raft_advantages(jnp.array([1, -1])).dtype == jnp.float32


def test_reinforce_rej_and_mixed_masks():
    adv = np.asarray(reinforce_rej_advantages(REWARDS, GROUP_IDS))
    np.testing.assert_array_equal(adv, [1, 0, 1, 0, 0, 0, 1, -1, -1, 1])
    mixed = np.asarray(mixed_group_mask(REWARDS, GROUP_IDS))
    np.testing.assert_array_equal(mixed, [1, 1, 1, 0, 0, 0, 1, 1, 1, 1])
    per_group = np.asarray(mixed_groups(REWARDS, GROUP_IDS, num_groups=6))
    np.testing.assert_array_equal(per_group, [True, False, False, False, True, False])  # 3 and 5 empty


def test_padding_ids_are_ignored():
    rewards = np.array([1.0, 0.0, 7.0, 1.0], np.float32)
    group_ids = np.array([0, 0, -1, 0], np.int32)
    adv = np.asarray(grpo_advantages(rewards, group_ids, num_groups=1, scale_by_std=False))
    np.testing.assert_allclose(adv, [1 / 3, -2 / 3, 0.0, 1 / 3], rtol=1e-6)
    assert np.asarray(rloo_advantages(rewards, group_ids, num_groups=1))[2] == 0.0
    assert not np.asarray(mixed_group_mask(rewards, group_ids, num_groups=1))[2]


def test_jit_needs_static_num_groups_and_vmap_works():
    jitted = jax.jit(lambda r, g: grpo_advantages(r, g, num_groups=5))
    np.testing.assert_allclose(np.asarray(jitted(REWARDS, GROUP_IDS)),
                               np.asarray(grpo_advantages(REWARDS, GROUP_IDS)), rtol=1e-6)
    with pytest.raises(ValueError, match="num_groups"):
        jax.jit(grpo_advantages)(REWARDS, GROUP_IDS)
    batch = np.stack([REWARDS, -REWARDS, 2 * REWARDS])
    for fn in (rloo_advantages, reinforce_rej_advantages, grpo_advantages):
        vmapped = jax.jit(jax.vmap(lambda r, fn=fn: fn(r, GROUP_IDS, num_groups=5)))(batch)
        for k in range(3):
            np.testing.assert_allclose(np.asarray(vmapped[k]), np.asarray(fn(batch[k], GROUP_IDS)), rtol=1e-6)
    jm = jax.jit(lambda r, g: mixed_group_mask(r, g, num_groups=5))(REWARDS, GROUP_IDS)
    np.testing.assert_array_equal(np.asarray(jm), np.asarray(mixed_group_mask(REWARDS, GROUP_IDS)))
    np.testing.assert_array_equal(np.asarray(jax.jit(raft_advantages)(REWARDS)), np.maximum(REWARDS, 0))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="integers"):
        grpo_advantages(REWARDS, GROUP_IDS.astype(np.float32))
    with pytest.raises(ValueError, match="same shape"):
        rloo_advantages(REWARDS, GROUP_IDS[:3])
    with pytest.raises(ValueError, match=r"\[B\]"):
        grpo_advantages(REWARDS.reshape(2, 5), GROUP_IDS.reshape(2, 5))


def test_registry_names():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "drgrpo", "rloo", "raft", "reinforce_rej", "reinforce_pp",
                                         "reinforce_pp_baseline"}
    np.testing.assert_allclose(np.asarray(ADVANTAGE_ESTIMATORS["drgrpo"](REWARDS, GROUP_IDS)),
                               np.asarray(grpo_advantages(REWARDS, GROUP_IDS, scale_by_std=False)))
    np.testing.assert_array_equal(np.asarray(ADVANTAGE_ESTIMATORS["raft"](REWARDS, GROUP_IDS)),
                                  np.maximum(REWARDS, 0))


def test_overlong_penalty_hand_values():
    lengths = jnp.array([0, 80, 90, 100, 110])
    got = np.asarray(overlong_penalty(lengths, max_len=100, buffer=20, factor=0.5))
    # expected length 80: 0 up to it, then -(L - 80) / 20 * 0.5
    np.testing.assert_allclose(got, [0.0, 0.0, -0.25, -0.5, -0.75], rtol=1e-6)
    jitted = jax.jit(lambda x: overlong_penalty(x, max_len=100, buffer=20, factor=0.5))(lengths)
    np.testing.assert_allclose(np.asarray(jitted), got)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, max_len=100, buffer=0)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, max_len=10, buffer=20)


def test_registry_entries_are_public_functions_of_objectives():
    import jaxrl_llm.objectives as objectives

    for name, fn in ADVANTAGE_ESTIMATORS.items():
        assert not fn.__name__.startswith("_") and getattr(objectives, fn.__name__) is fn, name
        assert fn.__name__ in objectives.__all__, name


def test_reinforce_pp_batch_hand_values_and_padding():
    from jaxrl_llm.objectives import reinforce_pp_batch_advantages

    # rewards 1, 0, 1, 0 (row 4 is padding): mean 1/2, population std 1/2, so A = +-1 / (1/2 + eps) * 1/2 = +-1.
    rewards = np.array([1.0, 0.0, 1.0, 0.0, 9.0], np.float32)
    ids = np.array([0, 0, 1, 1, -1], np.int32)
    adv = np.asarray(reinforce_pp_batch_advantages(rewards, ids, num_groups=2))
    np.testing.assert_allclose(adv, [1.0, -1.0, 1.0, -1.0, 0.0], rtol=1e-5)
    assert ADVANTAGE_ESTIMATORS["reinforce_pp"] is reinforce_pp_batch_advantages


def test_raft_and_drgrpo_registry_functions_hand_values():
    from jaxrl_llm.objectives import drgrpo_advantages, raft_group_advantages

    np.testing.assert_array_equal(np.asarray(raft_group_advantages(np.array([-1.0, 0.5]), np.array([0, 0]))),
                                  [0.0, 0.5])
    # group 0: 1, 0, 1 -> mean 2/3; a group of one keeps its reward.
    np.testing.assert_allclose(np.asarray(drgrpo_advantages(np.array([1.0, 0.0, 1.0, 5.0]), np.array([0, 0, 0, 1]))),
                               [1 / 3, -2 / 3, 1 / 3, 5.0], rtol=1e-6)


def test_mixed_group_mask_takes_num_groups_as_keyword_like_mixed_groups():
    import inspect

    for fn in (mixed_group_mask, mixed_groups):
        assert inspect.signature(fn).parameters["num_groups"].kind is inspect.Parameter.KEYWORD_ONLY
    with pytest.warns(DeprecationWarning, match="keyword"):  # the old positional call still works, once warned
        old = mixed_group_mask(REWARDS, GROUP_IDS, 5)
    np.testing.assert_array_equal(np.asarray(old), np.asarray(mixed_group_mask(REWARDS, GROUP_IDS, num_groups=5)))
    with pytest.raises(TypeError, match="num_groups"):
        mixed_group_mask(REWARDS, GROUP_IDS, 5, num_groups=5)
