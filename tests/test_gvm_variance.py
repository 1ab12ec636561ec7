"""The GVM variance benchmark's allocation rules and estimators (benchmarks/gvm_variance.py) on hand values."""

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

BENCH = pathlib.Path(__file__).parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("gvm_variance", BENCH / "gvm_variance.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def test_optimal_counts_minimise_the_lemma1_variance(bench):
    # c = [4, 1, 0], budget 5: from [1, 1, 0] the marginal gains 2, 2/3 (prompt 0) beat 1/2 (prompt 1), then
    # 1/2 beats 1/3: [3, 2, 0], sum c / n = 4/3 + 1/2, below [4, 1] (2) and [2, 3] (7/3).
    np.testing.assert_array_equal(bench.optimal_counts(np.array([4.0, 1.0, 0.0]), 5), [3, 2, 0])
    rng = np.random.default_rng(0)
    c = rng.uniform(0.1, 5, size=4)
    best = bench.optimal_counts(c, 12)
    # Exhaustive check over every split of 12 into 4 positive parts.
    splits = [(a, b, d, 12 - a - b - d) for a in range(1, 10) for b in range(1, 10) for d in range(1, 10)
              if 12 - a - b - d >= 1]
    assert min((c / np.array(s)).sum() for s in splits) == pytest.approx((c / best).sum())


def test_even_counts_and_grpo_weights(bench):
    np.testing.assert_array_equal(bench.even_counts(np.array([True, False, True, True]), 8), [3, 0, 3, 2])
    # Group 0: rewards 1, 0 -> mean 0.5, unbiased std sqrt(0.5); group 1 of one sample: A = r.
    np.testing.assert_allclose(bench.grpo_weights(np.array([1.0, 0.0, 1.0]), np.array([0, 0, 1]), 2),
                               [0.5 / (np.sqrt(0.5) + 1e-6), -0.5 / (np.sqrt(0.5) + 1e-6), 1.0], rtol=1e-6)


def test_estimators_by_hand(bench):
    grad = np.array([[[1.0, 0.0], [3.0, 0.0]], [[0.0, 2.0], [0.0, 4.0]]], np.float32)  # [P=2, K=2, d=2]
    reward = np.array([[1.0, 0.0], [1.0, 1.0]])
    length = np.full((2, 2), 2.0)
    # Draws: prompt 0 columns 0 (accepted, g = [1, 0]) and 1 (rejected); prompt 1 column 1 (g = [0, 4]).
    est = bench.estimates(grad, reward, length, np.array([0, 0, 1]), np.array([0, 1, 1]), np.array([0.25, 1.0]), 2)
    np.testing.assert_allclose(est["paper_alg1"], [0.5, 2.0])  # (1/2) ([1, 0] / 1 + [0, 4] / 1)
    np.testing.assert_allclose(est["paper_lemma1"], [1.0, 2.0])  # n p = [0.5, 1]
    np.testing.assert_allclose(est["tokenmean_raftpp"], [1 / 6, 2 / 3], rtol=1e-6)  # 6 tokens drawn
    a = 0.5 / (np.sqrt(0.5) + 1e-6)
    np.testing.assert_allclose(est["tokenmean_grpo"], [(a * 1 - a * 3) / 6, 4 / 6], rtol=1e-5)


def test_analyse_schema_and_uniform_on_a_synthetic_pool(bench):
    rng = np.random.default_rng(1)
    num, size, dim = 6, 32, 8
    p = np.array([0.0, 0.05, 0.3, 0.5, 0.8, 1.0])
    pool = {"reward": (rng.random((num, size)) < p[:, None]).astype(np.float32),
            "length": rng.integers(2, 6, size=(num, size)).astype(np.float32),
            "embed_norm": rng.uniform(1, 3, size=(num, size)).astype(np.float32),
            "grad": rng.normal(size=(num, size, dim)).astype(np.float32) + np.arange(num)[:, None, None]}
    pool["full_sq"] = (pool["grad"] ** 2).sum(-1)
    res = bench.analyse(pool, per_prompt=4, stage1=4, replicates=20, cap=8, seed=0)
    assert set(res["estimators"]) == set(bench.ESTIMATORS)
    for by_alloc in res["estimators"].values():
        assert set(by_alloc) == set(bench.ALLOCATIONS) >= {"uniform", "gvm", "gvm_oracle", "optimal",
                                                          "uniform_drop_unsolved", "gvm_capped"}
        for cell in by_alloc.values():
            assert cell["ci95"][0] <= cell["rel_mse"] <= cell["ci95"][1] and -1 <= cell["cosine"] <= 1
    assert res["frac_unsolved"] == pytest.approx(float((pool["reward"].mean(1) == 0).mean()), abs=1e-4)
    assert res["allocation_stats"]["uniform"] == {"zero_frac": 0.0, "max_share": pytest.approx(1 / 6, abs=1e-4),
                                                  "effective_prompts": pytest.approx(6.0)}
    assert set(res["diagnostics"]) >= {"zero_frac", "max_share", "effective_prompts", "g_rank_corr", "noise_scale"}
