"""`ModelConfig.scan_layers`: the training forward's stacked layers as one `lax.scan` (the default) or
unrolled give the same hidden states and gradients."""

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
def test_unrolled_layers_equal_scanned_layers(remat):
    params = models.init_params(TINY, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 0, TINY.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
    results = {}
    for scan in (True, False):
        # The XLA path named: "auto" also traces the TPU branch (splash), whose kernel holds scans of its own.
        config = TINY.replace(remat=remat, scan_layers=scan, attention_impl="xla")
        jaxpr = jax.make_jaxpr(lambda p: models.hidden_states(p, config, tokens, positions))(params)
        assert ("scan" in str(jaxpr)) == scan
        results[scan] = jax.jit(lambda p: _value_and_grad(p, config, tokens, positions))(params)
    assert TINY.scan_layers  # the default
    for a, b in zip(jax.tree_util.tree_leaves(results[False]), jax.tree_util.tree_leaves(results[True])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(results[False][1]["layers"]["q_proj"]).max()) > 1e-3  # compared gradients are not zero
    with pytest.raises(ValueError, match="scan_layers"):
        TINY.replace(scan_layers=None)
