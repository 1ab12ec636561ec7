"""PRL step advantages and GVM sample allocation against loop references written from the definitions."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.objectives import gvm_allocate, prl_advantages


def prl_loop(outcome, old, ref, mask, eta, step_len=None, step_ends=None):
    b_size, t_size = old.shape
    out = np.zeros((b_size, t_size))
    for b in range(b_size):
        response = [t for t in range(t_size) if mask[b, t]]
        if not response:
            continue
        suffix = {t: sum(old[b, s] - ref[b, s] for s in response if s >= t) for t in response}
        ends = set()
        for k, t in enumerate(response, start=1):
            if step_len is not None:
                is_end = k % step_len == 0
            elif step_ends is not None:
                is_end = bool(step_ends[b, t])
            else:
                is_end = True
            if is_end or t == response[-1]:
                ends.add(t)
        for t in response:
            end = min(s for s in ends if s >= t)
            out[b, t] = outcome[b] - suffix[end] / eta
    return out


def test_prl_hand_values_fixed_step():
    old = jnp.full((2, 5), -1.0)
    ref = jnp.full((2, 5), -2.0)  # delta = 1 per response token
    mask = jnp.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], jnp.float32)
    got = np.asarray(prl_advantages(jnp.array([1.0, 2.0]), old, ref, mask, eta=2.0, step_len=2))
    # row 0: S = [4, 3, 2, 1], ends at tokens 2 and 4 -> 1 - 3/2 and 1 - 1/2
    # row 1: S = [3, 2, 1], ends at token 2 and the last token 3 -> 2 - 2/2 and 2 - 1/2
    np.testing.assert_allclose(got, [[-0.5, -0.5, 0.5, 0.5, 0.0], [1.0, 1.0, 1.5, 0.0, 0.0]], rtol=1e-6)


def random_prl_case(seed):
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.0, 0.5, size=(4, 9)).astype(np.float32)
    ref = rng.normal(-1.0, 0.5, size=(4, 9)).astype(np.float32)
    mask = np.zeros((4, 9), np.float32)
    mask[0, :9] = 1  # full row
    mask[1, 2:7] = 1  # response after a 2-token prompt, then padding
    mask[3, 0:1] = 1  # a single token
    outcome = rng.normal(size=4).astype(np.float32)  # row 2 is all masked
    step_ends = rng.random((4, 9)) < 0.3
    return outcome, old, ref, mask, step_ends


@pytest.mark.parametrize("step_len", [None, 1, 2, 3, 20])
def test_prl_fixed_length_matches_loop(step_len):
    outcome, old, ref, mask, _ = random_prl_case(4)
    got = prl_advantages(outcome, old, ref, mask, eta=0.5, step_len=step_len)
    expected = prl_loop(outcome, old.astype(np.float64), ref.astype(np.float64), mask, 0.5, step_len=step_len)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[2] == 0.0)


def test_prl_given_step_ends_matches_loop():
    outcome, old, ref, mask, step_ends = random_prl_case(5)
    step_ends[1, 0] = True  # a marker on a prompt token is ignored
    got = prl_advantages(outcome, old, ref, mask, eta=2.0, step_ends=step_ends)
    expected = prl_loop(outcome, old.astype(np.float64), ref.astype(np.float64), mask, 2.0, step_ends=step_ends)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)
    # hand case: newline markers at positions 1 and 3 of a 5-token response
    tokens = np.array([[5, 10, 7, 10, 8]])
    one = prl_advantages(np.array([1.0], np.float32), np.zeros((1, 5), np.float32), -np.ones((1, 5), np.float32),
                         np.ones((1, 5), np.float32), eta=1.0, step_ends=tokens == 10)
    # S = [5, 4, 3, 2, 1]; ends at 1, 3 and the last token 4
    np.testing.assert_allclose(np.asarray(one), [[-3.0, -3.0, -1.0, -1.0, 0.0]], rtol=1e-6)


def test_prl_jit_vmap_and_bad_inputs():
    outcome, old, ref, mask, step_ends = random_prl_case(6)
    fn = functools.partial(prl_advantages, eta=0.5, step_len=2)
    np.testing.assert_allclose(np.asarray(jax.jit(fn)(outcome, old, ref, mask)),
                               np.asarray(fn(outcome, old, ref, mask)), rtol=1e-6)
    stacked = [np.stack([x, x[::-1]]) for x in (outcome, old, ref, mask)]
    vm = jax.vmap(fn)(*stacked)
    np.testing.assert_allclose(np.asarray(vm[1]), np.asarray(fn(*[x[::-1] for x in (outcome, old, ref, mask)])),
                               rtol=1e-6)
    with pytest.raises(ValueError, match="not both"):
        prl_advantages(outcome, old, ref, mask, eta=1.0, step_len=2, step_ends=step_ends)
    with pytest.raises(ValueError, match="eta"):
        prl_advantages(outcome, old, ref, mask, eta=0.0)
    with pytest.raises(ValueError, match="step_len"):
        prl_advantages(outcome, old, ref, mask, eta=1.0, step_len=0)
    with pytest.raises(ValueError, match="outcome_adv"):
        prl_advantages(outcome[:2], old, ref, mask, eta=1.0)


def gvm_loop(p, g, budget, alpha=1e-3, beta=2.0, filter_threshold=1.0, filter_insufficient=0.0):
    """The allocation rule of the GVM paper, written out with Python floats and lists."""
    raw = [0.0 if gi == 0 or pi == 0 else gi / math.sqrt(pi + alpha / pi ** (beta - 1)) for pi, gi in zip(p, g)]
    total = sum(raw)
    w = [x / total if total else 0.0 for x in raw]
    w = [wi if pi <= filter_threshold else 0.0 for wi, pi in zip(w, p)]
    if filter_insufficient > 0:
        w = [wi if pi * wi * budget >= filter_insufficient else 0.0 for wi, pi in zip(w, p)]
    total = sum(w)
    if total == 0:
        return [0] * len(p)
    w = [wi / total for wi in w]
    counts = [round(wi * budget) for wi in w]  # Python round: half to even
    while sum(counts) != budget:
        step = 1 if sum(counts) < budget else -1
        residuals = [(wi * budget - c) * step if wi > 0 else -math.inf for wi, c in zip(w, counts)]
        best = max(range(len(w)), key=lambda i: (residuals[i], -i))  # ties: lower index
        counts[best] += step
        w_budget = w[best] * budget
        assert math.floor(w_budget) <= counts[best] <= math.ceil(w_budget)
    return counts


def test_gvm_hand_case():
    p, g = [0.5, 0.25, 0.0, 1.0], [1.0, 2.0, 3.0, 1.0]
    got = np.asarray(gvm_allocate(np.array(p), np.array(g), 32))
    w = [1 / math.sqrt(0.5 + 0.001 / 0.5), 2 / math.sqrt(0.25 + 0.001 / 0.25), 0.0, 1 / math.sqrt(1.001)]
    shares = [x / sum(w) * 32 for x in w]  # 7.08, 19.91, 0, 5.01
    np.testing.assert_array_equal(got, [round(s) for s in shares])
    np.testing.assert_array_equal(got, [7, 20, 0, 5])
    assert got.dtype == np.int32


def test_gvm_zero_gradient_or_acceptance_and_all_zero():
    got = np.asarray(gvm_allocate(np.array([0.5, 0.5, 0.0]), np.array([0.0, 1.0, 1.0]), 10))
    np.testing.assert_array_equal(got, [0, 10, 0])
    np.testing.assert_array_equal(np.asarray(gvm_allocate(np.zeros(4), np.ones(4), 16)), [0, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(gvm_allocate(np.ones(3), np.zeros(3), 16)), [0, 0, 0])


def test_gvm_rounding_ties():
    equal = dict(accept_rate=np.full(2, 0.5), grad_norm=np.ones(2))
    # 1.5 and 1.5 round (half to even) to 2 and 2; one is removed, lower index first
    np.testing.assert_array_equal(np.asarray(gvm_allocate(budget=3, **equal)), [1, 2])
    three = dict(accept_rate=np.full(3, 0.5), grad_norm=np.ones(3))
    # 4/3 each rounds to 1; the one extra goes to the lowest index
    np.testing.assert_array_equal(np.asarray(gvm_allocate(budget=4, **three)), [2, 1, 1])
    four = dict(accept_rate=np.full(4, 0.5), grad_norm=np.ones(4))
    # 0.5 each rounds to 0; two are added, lower indices first
    np.testing.assert_array_equal(np.asarray(gvm_allocate(budget=2, **four)), [1, 1, 0, 0])
    for budget in (3, 2):
        assert gvm_loop([0.5] * 2, [1.0] * 2, budget) == list(np.asarray(gvm_allocate(budget=budget, **equal)))


def test_gvm_filters():
    p = np.array([1.0, 0.9, 0.5, 0.125])
    g = np.array([1.0, 1.0, 1.0, 1.0])
    kept = np.asarray(gvm_allocate(p, g, 40, filter_threshold=0.8))
    assert kept[0] == 0 and kept[1] == 0 and kept.sum() == 40
    assert list(kept) == gvm_loop(list(p), list(g), 40, filter_threshold=0.8)
    # expected accepted samples p_i w_i N: the last prompt gets about 0.125 * 0.44 * 40 = 2.2 < 3
    share = 1 / math.sqrt(0.125 + 0.001 / 0.125) / sum(1 / math.sqrt(x + 0.001 / x) for x in p)
    assert 0.125 * share * 40 < 3.0
    insufficient = np.asarray(gvm_allocate(p, g, 40, filter_insufficient=3.0))
    assert insufficient[3] == 0 and insufficient.sum() == 40
    assert list(insufficient) == gvm_loop(list(p), list(g), 40, filter_insufficient=3.0)
    both = np.asarray(gvm_allocate(p, g, 40, filter_threshold=0.95, filter_insufficient=3.0))
    assert list(both) == gvm_loop(list(p), list(g), 40, filter_threshold=0.95, filter_insufficient=3.0)
    assert both[0] == 0 and both[3] == 0


@pytest.mark.parametrize("seed", range(4))
def test_gvm_random_matches_loop_and_properties(seed):
    rng = np.random.default_rng(seed)
    n = 12
    p = rng.integers(0, 9, size=n) / 8.0  # acceptance rates of 8 stage-1 samples, zeros included
    g = rng.gamma(2.0, 1.0, size=n) * (rng.random(n) > 0.2)
    budget = int(rng.integers(1, 200))
    got = np.asarray(gvm_allocate(p.astype(np.float32), g.astype(np.float32), budget, alpha=1e-2, beta=1.5))
    assert list(got) == gvm_loop(list(p), list(g), budget, alpha=1e-2, beta=1.5)
    assert got.sum() == budget
    usable = (p > 0) & (g > 0)
    w = np.where(usable, g / np.sqrt(np.where(usable, p, 1) + 1e-2 / np.where(usable, p, 1) ** 0.5), 0)
    scaled = w / w.sum() * budget
    assert np.all((got == np.floor(scaled)) | (got == np.ceil(scaled)))
    assert np.all(got[~usable] == 0)


def test_gvm_jit_and_bad_inputs():
    p, g = np.array([0.5, 0.25, 0.0, 1.0]), np.array([1.0, 2.0, 3.0, 1.0])
    jitted = jax.jit(functools.partial(gvm_allocate, filter_insufficient=0.0))
    np.testing.assert_array_equal(np.asarray(jitted(p, g, jnp.int32(32))), [7, 20, 0, 5])
    np.testing.assert_array_equal(np.asarray(jitted(p, g, jnp.int32(9))), np.asarray(gvm_allocate(p, g, 9)))
    with pytest.raises(ValueError, match="accept_rate"):
        gvm_allocate(np.array([1.5]), np.array([1.0]), 4)
    with pytest.raises(ValueError, match="grad_norm"):
        gvm_allocate(np.array([0.5]), np.array([-1.0]), 4)
    with pytest.raises(ValueError, match="budget"):
        gvm_allocate(np.array([0.5]), np.array([1.0]), -3)
    with pytest.raises(ValueError, match="filter_threshold"):
        gvm_allocate(p, g, 8, filter_threshold=0.0)
    with pytest.raises(ValueError, match=r"\[N\]"):
        gvm_allocate(p, g[:2], 8)


def test_gvm_vmap_over_iterations():
    p = np.array([[0.5, 0.25, 0.0, 1.0], [0.125, 0.5, 0.75, 0.5]])
    g = np.array([[1.0, 2.0, 3.0, 1.0], [1.0, 0.0, 2.0, 0.5]])
    both = jax.vmap(lambda a, b: gvm_allocate(a, b, 32))(p, g)
    for k in range(2):
        assert list(np.asarray(both[k])) == gvm_loop(list(p[k]), list(g[k]), 32)
