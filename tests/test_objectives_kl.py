"""KL estimators and entropy against per-element math references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.objectives import entropy_from_logits, kl_penalty

# d = logp - ref over a range that puts k3 beyond its clamp on both sides of the exponential
DIFFS = np.array([[-30.0, -5.0, -1.0, 0.0], [0.5, 3.0, 30.0, -0.1]], np.float32)
REF = np.full_like(DIFFS, -2.0)
LOGP = REF + DIFFS


def k3_math(d):
    x = -d  # ref - logp
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


def test_k1_k2_abs_values():
    np.testing.assert_allclose(np.asarray(kl_penalty(LOGP, REF, "k1")), DIFFS, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(kl_penalty(LOGP, REF, "k2")), 0.5 * DIFFS.astype(np.float64) ** 2,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(kl_penalty(LOGP, REF, "abs")), np.abs(DIFFS), rtol=1e-6, atol=1e-6)


def test_k3_values_and_clamp():
    got = np.asarray(kl_penalty(LOGP, REF, "k3"))
    expected = np.array([[k3_math(float(d)) for d in row] for row in DIFFS])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert got[0, 0] == 10.0 and got[0, 1] == 10.0 and got[1, 2] == 10.0  # clamped
    np.testing.assert_allclose(got[0, 2], math.e - 2.0, rtol=1e-5)  # d = -1: e^1 - 1 - 1


def test_k3_gradient_is_finite_and_zero_beyond_clamp():
    grad = np.asarray(jax.grad(lambda lp: kl_penalty(lp, REF, "k3").sum())(jnp.asarray(LOGP)))
    assert np.all(np.isfinite(grad))
    assert grad[0, 0] == 0.0 and grad[1, 2] == 0.0
    # d/dlogp [exp(-d) + d - 1] = 1 - exp(-d)
    np.testing.assert_allclose(grad[1, 0], 1 - math.exp(-0.5), rtol=1e-5)


def test_kl_jit_vmap_and_bad_kind():
    jitted = jax.jit(kl_penalty, static_argnames="kind")(LOGP, REF, kind="k3")
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(kl_penalty(LOGP, REF, "k3")))
    vmapped = jax.vmap(lambda a, b: kl_penalty(a, b, "k2"))(LOGP, REF)
    np.testing.assert_allclose(np.asarray(vmapped), np.asarray(kl_penalty(LOGP, REF, "k2")))
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(LOGP, REF, "k4")
    with pytest.raises(ValueError, match="shape"):
        kl_penalty(LOGP, REF[:, :2], "k1")


def entropy_math(row):
    finite = [z for z in row if z != -math.inf]
    top = max(finite)
    total = sum(math.exp(z - top) for z in finite)
    probs = [math.exp(z - top) / total for z in finite]
    return -sum(p * math.log(p) for p in probs if p > 0)


def test_entropy_matches_math_reference():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2.0, size=(2, 3, 7)).astype(np.float32)
    logits[0, 1, :3] = -np.inf  # masked vocabulary entries
    logits[1, 2] = 0.0  # uniform: log V
    got = np.asarray(entropy_from_logits(logits))
    expected = np.array([[entropy_math([float(z) for z in logits[b, t]]) for t in range(3)] for b in range(2)])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1, 2], math.log(7), rtol=1e-6)
    grad = jax.grad(lambda z: entropy_from_logits(z).sum())(jnp.asarray(logits))
    assert np.all(np.isfinite(np.asarray(grad)))
    np.testing.assert_allclose(np.asarray(jax.jit(entropy_from_logits)(logits)), got, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.vmap(entropy_from_logits)(logits)), got, rtol=1e-6)
