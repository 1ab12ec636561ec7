"""The decoder's building blocks against hand values and NumPy re-implementations."""

import jax.numpy as jnp
import numpy as np
from numpy_reference import numpy_attention

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.models.layers import apply_rope, attention, rms_norm, rope_inv_freq, gated_mlp


def test_rms_norm_by_hand():
    x = jnp.array([[3.0, 4.0]])  # mean square 12.5
    out = rms_norm(x, jnp.array([1.0, 2.0]), eps=0.0)
    np.testing.assert_allclose(np.asarray(out), [[3 / np.sqrt(12.5), 8 / np.sqrt(12.5)]], rtol=1e-6)
    assert rms_norm(x.astype(jnp.bfloat16), jnp.ones(2), 1e-6).dtype == jnp.bfloat16


def test_rope_frequencies_and_rotation_by_hand():
    config = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                         num_kv_heads=1, head_dim=4, rope_theta=100.0)
    inv_freq = rope_inv_freq(config)
    np.testing.assert_allclose(inv_freq, [1.0, 0.1], rtol=1e-7)  # 100^(-0/4), 100^(-2/4)
    # rotate-half pairs dimension i with i + d/2: (x0, x2) turns by angle p * 1, (x1, x3) by p * 0.1
    x = jnp.array([1.0, 2.0, 0.0, 0.0]).reshape(1, 1, 1, 4)
    out = np.asarray(apply_rope(x, jnp.array([[3]]), inv_freq)).ravel()
    expected = [np.cos(3.0), 2 * np.cos(0.3), np.sin(3.0), 2 * np.sin(0.3)]
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)


def test_grouped_query_attention_matches_numpy():
    rng = np.random.RandomState(0)
    q = rng.normal(size=(2, 3, 6, 4)).astype(np.float32)
    k = rng.normal(size=(2, 5, 2, 4)).astype(np.float32)
    v = rng.normal(size=(2, 5, 2, 4)).astype(np.float32)
    mask = rng.rand(2, 3, 5) < 0.6
    mask[:, :, 0] = True  # every query sees at least one key
    out = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(out), numpy_attention(q, k, v, mask), rtol=1e-5, atol=1e-6)


def test_fully_masked_query_stays_finite():
    q = jnp.ones((1, 1, 2, 4))
    kv = jnp.ones((1, 3, 1, 4))
    out = attention(q, kv, kv, jnp.zeros((1, 1, 3), bool))
    assert np.all(np.isfinite(np.asarray(out)))


def test_swiglu_by_hand():
    x = jnp.array([[1.0, -2.0]])
    gate = jnp.array([[1.0], [0.0]])   # x @ gate = 1
    up = jnp.array([[0.0], [1.0]])     # x @ up = -2
    down = jnp.array([[3.0, 1.0]])
    silu_1 = 1.0 / (1.0 + np.exp(-1.0))
    np.testing.assert_allclose(np.asarray(gated_mlp(x, gate, up, down)), [[-6 * silu_1, -2 * silu_1]], rtol=1e-6)


def test_dense_gradients_are_the_textbook_products():
    """dense's own backward rule: dx = dy w^T, dw = x^T dy (NumPy), for a batched x, in f32 and bf16."""
    import jax

    from jaxrl_llm.models.layers import dense

    rng = np.random.RandomState(0)
    x = rng.normal(size=(2, 3, 4)).astype(np.float32)
    w = rng.normal(size=(4, 5)).astype(np.float32)
    dy = rng.normal(size=(2, 3, 5)).astype(np.float32)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
        out, vjp = jax.vjp(dense, jnp.asarray(x, dtype), jnp.asarray(w, dtype))
        dx, dw = vjp(jnp.asarray(dy, dtype))
        assert out.dtype == dx.dtype == dw.dtype == dtype
        np.testing.assert_allclose(np.asarray(out, np.float32), x @ w, rtol=tol, atol=tol)
        np.testing.assert_allclose(np.asarray(dx, np.float32), dy @ w.T, rtol=tol, atol=tol)
        np.testing.assert_allclose(np.asarray(dw, np.float32), x.reshape(-1, 4).T @ dy.reshape(-1, 5),
                                   rtol=tol, atol=tol)
