"""GVM's M-step aggregation (each prompt weighted equally, its samples averaged) against hand values and a
NumPy loop written from the paper's formulas (Yao et al. 2025, Algorithm 1 and Lemma 1)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.objectives import (
    PROMPT_MEAN_MODES,
    prompt_mean,
    prompt_mean_terms,
    prompt_mean_weights,
)


def mstep_loop(x, mask, group_ids, counted, accept_rate=None):
    """(1/m) sum_i (1/c_i) sum_{j in D_i} sum_t x_jt m_jt, c_i = |D_i| or n_i p_i; a loop over prompts."""
    prompts = sorted({int(g) for g in group_ids if g >= 0})
    total = 0.0
    for i in prompts:
        rows = [b for b in range(len(group_ids)) if group_ids[b] == i]
        accepted = [b for b in rows if counted[b]]
        divisor = len(accepted) if accept_rate is None else len(rows) * accept_rate[i]
        if divisor > 0:
            total += sum(float(np.sum(x[b] * mask[b])) for b in accepted) / divisor
    return total / len(prompts) if prompts else 0.0


def test_weights_by_hand():
    ids = np.array([0, 0, 0, 1, 1, -1])  # the last row is padding
    counted = np.array([1, 1, 0, 1, 0, 1])
    # Algorithm 1: |D_0| = 2, |D_1| = 1; uncounted and padding rows weigh 0.
    np.testing.assert_allclose(prompt_mean_weights(ids, num_groups=2, counted=counted), [0.5, 0.5, 0, 1, 0, 0])
    # Every row counted: 1 / n_i.
    np.testing.assert_allclose(prompt_mean_weights(ids, num_groups=2), [1 / 3] * 3 + [0.5, 0.5, 0.0], rtol=1e-6)
    # Lemma 1: n_0 p_0 = 3 x 0.5 = 1.5, n_1 p_1 = 2 x 0.25 = 0.5.
    np.testing.assert_allclose(prompt_mean_weights(ids, num_groups=2, counted=counted, accept_rate=[0.5, 0.25]),
                               [2 / 3, 2 / 3, 0, 2, 0, 0], rtol=1e-6)
    # p_i = 0 or nothing accepted: the prompt weighs 0 (no NaN).
    np.testing.assert_array_equal(prompt_mean_weights(ids, num_groups=2, counted=counted, accept_rate=[0.0, 0.5]),
                                  [0, 0, 0, 1, 0, 0])
    # The prompt shares (every row counted) sum to m = 2: group 2 holds no row, padding shares nothing.
    assert float(prompt_mean_weights(ids, num_groups=3).sum()) == pytest.approx(2.0)


def test_prompt_mean_by_hand():
    # Row sums 1, 5, 9 (prompt 0) and 13, 17 (prompt 1); D_0 = rows 0, 1, D_1 = row 3.
    x = np.arange(10.0).reshape(5, 2)
    mask = np.ones((5, 2))
    ids = np.array([0, 0, 0, 1, 1])
    counted = np.array([1, 1, 0, 1, 0])
    assert float(prompt_mean(x, mask, ids, counted=counted)) == pytest.approx(((1 + 5) / 2 + 13) / 2)
    # Lemma 1 with p = [0.5, 0.25]: ((1 + 5) / 1.5 + 13 / 0.5) / 2 = 15.
    assert float(prompt_mean(x, mask, ids, counted=counted, accept_rate=[0.5, 0.25])) == pytest.approx(15.0)
    # Every row counted: the mean of the prompts' sample means, (5 + 15) / 2, not the token-mean 4.5.
    assert float(prompt_mean(x, mask, ids)) == pytest.approx(10.0)
    assert float(prompt_mean(np.zeros((0, 2)), np.zeros((0, 2)), np.zeros(0, np.int32), num_groups=0)) == 0.0


@pytest.mark.parametrize("unbiased", [False, True])
def test_against_numpy_loop(unbiased):
    rng = np.random.default_rng(0)
    sizes = [1, 5, 3, 8, 2]  # GVM: a different n_i per prompt
    ids = np.concatenate([[i] * n for i, n in enumerate(sizes)]).astype(np.int32)
    x = rng.normal(size=(ids.size, 7))
    mask = (rng.random((ids.size, 7)) < 0.7).astype(np.float32)
    x_garbage = np.where(mask > 0, x, np.nan)  # masked positions never leak in
    counted = rng.random(ids.size) < 0.6
    p = rng.uniform(0.05, 1.0, size=len(sizes)) if unbiased else None
    want = mstep_loop(x, mask, ids, counted, p)
    got = prompt_mean(x_garbage, mask, ids, num_groups=len(sizes), counted=counted, accept_rate=p)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_exact_over_micro_batches_that_split_prompts():
    rng = np.random.default_rng(1)
    ids = np.array([0, 0, 0, 1, 2, 2, 2, 2, 1, 0], np.int32)
    x = rng.normal(size=(10, 4))
    mask = (rng.random((10, 4)) < 0.8).astype(np.float32)
    counted = np.array([1, 0, 1, 1, 1, 1, 0, 1, 1, 1])
    weights = prompt_mean_weights(ids, num_groups=3, counted=counted, accept_rate=[0.4, 0.9, 0.6])
    share = prompt_mean_weights(ids, num_groups=3)
    whole = prompt_mean_terms(x, mask, weights, share)
    parts = [slice(0, 3), slice(3, 7), slice(7, 10)]  # prompt 0 and prompt 1 straddle micro-batches
    summed = jax.tree.map(lambda *t: sum(t), *[prompt_mean_terms(x[s], mask[s], weights[s], share[s]) for s in parts])
    np.testing.assert_allclose(float(summed.value()), float(whole.value()), rtol=1e-6)
    np.testing.assert_allclose(float(whole.value()),
                               mstep_loop(x, mask, ids, counted, [0.4, 0.9, 0.6]), rtol=1e-5)


def test_gradient_is_the_papers_estimator():
    """With the vanilla loss -A log pi and RAFT's A = 1 on accepted samples, d loss / d logp_jt is
    -1 / (m |D_i|) on the accepted samples' tokens and 0 elsewhere (Algorithm 1)."""
    ids = np.array([0, 0, 0, 1, 1], np.int32)
    accepted = np.array([1.0, 0.0, 1.0, 1.0, 0.0])
    mask = np.ones((5, 3), np.float32)
    adv = accepted[:, None] * mask

    def loss(logp):
        return prompt_mean(-adv * logp, mask, ids, num_groups=2, counted=accepted)

    grad = jax.grad(loss)(jnp.zeros((5, 3)))
    want = -np.array([1 / 4, 0, 1 / 4, 1 / 2, 0])[:, None] * mask  # m = 2, |D_0| = 2, |D_1| = 1
    np.testing.assert_allclose(grad, want, rtol=1e-6)


def test_jit_with_static_group_count_and_errors():
    ids = jnp.array([0, 1, 1])
    fn = jax.jit(lambda x, m, g: prompt_mean(x, m, g, num_groups=2))
    assert float(fn(jnp.ones((3, 2)), jnp.ones((3, 2)), ids)) == pytest.approx(2.0)
    assert PROMPT_MEAN_MODES == ("prompt-mean", "prompt-mean-unbiased")
    with pytest.raises(ValueError, match="accept_rate must lie in"):
        prompt_mean_weights(ids, num_groups=2, accept_rate=[0.5, 1.5])
    with pytest.raises(ValueError, match=r"accept_rate must be \[num_groups\]"):
        prompt_mean_weights(ids, num_groups=2, accept_rate=[0.5])
    with pytest.raises(ValueError, match="counted must be"):
        prompt_mean_weights(ids, num_groups=2, counted=[1, 0])
    with pytest.raises(ValueError, match="sample_weight must be"):
        prompt_mean_terms(jnp.ones((3, 2)), jnp.ones((3, 2)), jnp.ones(2), jnp.ones(3))
    with pytest.raises(ValueError, match="int"):
        prompt_mean_weights(jnp.array([0.0, 1.0]))
