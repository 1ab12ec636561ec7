"""On the CPU backend `hidden_states` unrolls the stacked layers; elsewhere it scans them. Both give
the same hidden states and gradients (the scan path is forced by reporting another backend)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models

TINY = models.ModelConfig(vocab_size=29, hidden_size=16, intermediate_size=24, num_layers=3, num_heads=4,
                          num_kv_heads=2, head_dim=4)


def _value_and_grad(params, config, tokens, positions):
    def loss(p):
        hidden = models.hidden_states(p, config, tokens, positions)
        return jnp.sum(jnp.sin(hidden)), hidden
    (_, hidden), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return hidden, grads


@pytest.mark.parametrize("remat", [False, True])
def test_unrolled_layers_equal_scanned_layers(monkeypatch, remat):
    config = TINY.replace(remat=remat)
    params = models.init_params(config, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 0, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
    assert jax.default_backend() == "cpu"

    def run():  # fresh closures: JAX's trace caches must not hand back the other path
        jaxpr = jax.make_jaxpr(lambda p: models.hidden_states(p, config, tokens, positions))(params)
        return "scan" in str(jaxpr), jax.jit(lambda p: _value_and_grad(p, config, tokens, positions))(params)

    has_scan, unrolled = run()
    assert not has_scan
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    has_scan, scanned = run()
    assert has_scan
    for a, b in zip(jax.tree_util.tree_leaves(unrolled), jax.tree_util.tree_leaves(scanned)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(unrolled[1]["layers"]["q_proj"]).max()) > 1e-3  # compared gradients are not zero


def test_scan_layers_overrides_the_backend_default():
    params = models.init_params(TINY, jax.random.PRNGKey(0))
    tokens = jnp.zeros((1, 5), jnp.int32)
    positions = jnp.arange(5)[None]
    for scan, expect in ((True, True), (False, False), (None, jax.default_backend() != "cpu")):
        config = TINY.replace(scan_layers=scan)
        jaxpr = jax.make_jaxpr(lambda p: models.hidden_states(p, config, tokens, positions))(params)
        assert ("scan" in str(jaxpr)) == expect, scan
    with pytest.raises(ValueError, match="scan_layers"):
        TINY.replace(scan_layers=1)
