"""Routing replay (R3, issue 57 part 4): `moe.route` with recorded experts against a NumPy reference (values and
the router's gradient), the sampler's recorded experts, the trainer's replay of them, its metrics, and the step
with routing_replay none unchanged. One tiny random Qwen3-MoE, compiled once per pass (module-scoped fixtures)."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jaxrl_llm.models.moe import route, route_dtype


def _route_reference(h, router, recorded, c, top_k, normalize):
    """(weights [N, k], d sum(weights * c) / d router [D, E]) in float64, chosen = recorded where >= 0."""
    logits = h @ router
    own = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    chosen = np.where(recorded[:, :1] >= 0, recorded, own)
    z = np.take_along_axis(logits, chosen, axis=1)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    if normalize:
        w = np.exp(z - z.max(1, keepdims=True))
        w /= w.sum(1, keepdims=True)
        d_z = w * (c - (w * c).sum(1, keepdims=True))
        d_logits = np.zeros_like(logits)
    else:
        w = np.take_along_axis(p, chosen, axis=1)
        d_z = c * w
        d_logits = -p * (c * w).sum(1, keepdims=True)
    for j in range(top_k):
        np.add.at(d_logits, (np.arange(len(h)), chosen[:, j]), d_z[:, j])
    return chosen, w, h.T @ d_logits


@pytest.mark.parametrize("normalize", [True, False])
def test_route_with_recorded_experts_equals_a_numpy_reference(normalize):
    rng = np.random.default_rng(0)
    h, router = rng.normal(size=(5, 3)), rng.normal(size=(3, 6))
    recorded = np.array([[4, 1], [0, 5], [-1, -1], [2, 3], [5, 0]])  # token 2 unrecorded: its own top 2
    c = rng.normal(size=(5, 2))
    chosen, want_w, want_grad = _route_reference(h, router, recorded, c, 2, normalize)

    def weighted(router):
        r = route(jnp.asarray(h, jnp.float32), router, top_k=2, normalize=normalize,
                  experts=jnp.asarray(recorded, jnp.int8))
        return jnp.sum(r.weights * jnp.asarray(c, jnp.float32)), r

    (_, r), grad = jax.value_and_grad(weighted, has_aux=True)(jnp.asarray(router, jnp.float32))
    np.testing.assert_array_equal(r.experts, chosen)
    np.testing.assert_array_equal(r.experts[2], np.argsort(-(h @ router)[2])[:2])
    np.testing.assert_allclose(r.weights, want_w, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
    assert np.abs(want_grad).max() > 0.05  # the router learns through the replayed weights


def test_route_dtype_is_the_smallest_that_holds_the_experts():
    assert route_dtype(8) == jnp.int8 and route_dtype(128) == jnp.int8
    assert route_dtype(129) == jnp.int16 and route_dtype(40000) == jnp.int32
