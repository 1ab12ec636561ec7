"""Gradients of the chunked log-probs (custom VJP) against autodiff of a dense log-softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.train.logprobs import chunked_logprobs


def _dense(hidden, head, targets):
    logits = jnp.einsum("brd,vd->brv", hidden, head)
    logp_all = jax.nn.log_softmax(logits, -1)
    entropy = -(jnp.exp(logp_all) * logp_all).sum(-1)
    return jnp.take_along_axis(logp_all, targets[..., None], -1)[..., 0], entropy


@pytest.mark.parametrize("keep_logits", [True, False], ids=["kept-logits", "recomputed-logits"])
@pytest.mark.parametrize("chunk", [10, 37, 64])  # shorter last chunk, exact fit, one oversized chunk
def test_chunked_logprob_gradients_equal_dense_autodiff(chunk, keep_logits):
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(37, 8)), jnp.float32)
    targets = jnp.asarray([[0, 36, 5], [10, 9, 20]])
    w_logp = jnp.asarray(rng.normal(size=(2, 3)), jnp.float32)
    w_ent = jnp.asarray(rng.normal(size=(2, 3)), jnp.float32)

    def objective(fn):
        def f(h, e):
            logp, entropy = fn(h, e)
            return jnp.sum(w_logp * logp) + jnp.sum(w_ent * entropy)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    want, (want_h, want_e) = objective(lambda h, e: _dense(h, e, targets))(hidden, head)
    got, (got_h, got_e) = objective(
        lambda h, e: chunked_logprobs(h, e, targets, chunk=chunk, with_entropy=True,
                                      keep_logits=keep_logits))(hidden, head)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got_h, want_h, atol=1e-5)
    np.testing.assert_allclose(got_e, want_e, atol=1e-5)
    assert float(jnp.abs(want_e).max()) > 0.1  # the check compares gradients that are not tiny


def test_chunked_logprob_gradient_of_logp_alone_and_under_vmap():
    """Only logp used (the entropy cotangent is zero), and per-row gradients under vmap."""
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.normal(size=(4, 1, 5, 6)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(23, 6)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 23, size=(4, 1, 5)))

    def per_row(fn):
        return jax.vmap(jax.grad(lambda h, t: jnp.sum(fn(h, t))), in_axes=(0, 0))

    got = per_row(lambda h, t: chunked_logprobs(h, head, t, chunk=8))(hidden, targets)
    want = per_row(lambda h, t: _dense(h, head, t)[0])(hidden, targets)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_entropy_without_gradient_is_a_metric_only():
    """entropy_grad=False: the same values, and the gradient of logp + entropy is that of a dense
    log-softmax with the entropy under stop_gradient; the vocabulary (37) ends in a shorter chunk."""
    rng = np.random.default_rng(2)
    hidden = jnp.asarray(rng.normal(size=(2, 4, 8)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(37, 8)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 37, size=(2, 4)))

    def total(fn):
        return jax.jit(jax.value_and_grad(lambda h, e: sum(jnp.sum(x) for x in fn(h, e)), argnums=(0, 1)))

    def dense_metric(h, e):
        logp, entropy = _dense(h, e, targets)
        return logp, jax.lax.stop_gradient(entropy)

    want, want_grads = total(dense_metric)(hidden, head)
    got, got_grads = total(lambda h, e: chunked_logprobs(h, e, targets, chunk=16, with_entropy=True,
                                                         entropy_grad=False))(hidden, head)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-5)
    with_entropy_grad = total(lambda h, e: chunked_logprobs(h, e, targets, chunk=16, with_entropy=True))
    assert float(jnp.abs(with_entropy_grad(hidden, head)[1][1] - want_grads[1]).max()) > 1e-2


def test_recomputed_logits_are_not_residuals():
    """keep_logits=False: what the forward pass hands to the backward pass holds no [tokens, vocab] array
    (the kept-logits VJP does: one [2, 3, 16] block per vocabulary chunk)."""
    hidden = jnp.ones((2, 3, 8), jnp.float32)
    head = jnp.ones((40, 8), jnp.float32)
    targets = jnp.zeros((2, 3), jnp.int32)

    def residual_shapes(keep):
        _, vjp = jax.vjp(lambda h, e: chunked_logprobs(h, e, targets, chunk=16, keep_logits=keep), hidden, head)
        return {tuple(x.shape) for x in jax.tree_util.tree_leaves(vjp)}

    assert {(2, 3, 16), (2, 3, 8)} <= residual_shapes(True)
    assert not any(len(s) == 3 and s[-1] in (16, 8) and s != (2, 3, 8) for s in residual_shapes(False))
    assert (2, 3, 16) not in residual_shapes(False)


def test_recomputed_logits_on_an_8_device_mesh_equal_one_device():
    """model.remat_logits (what the paper presets set) on a data=2, fsdp=2, tensor=2 mesh, the output
    matrix split over its vocabulary by tensor: value and gradients equal kept logits on one device
    (vocabulary 64 in chunks of 16, and 70: a shorter last chunk and an unsplit vocabulary)."""
    import json
    import os
    import subprocess
    import sys
    import textwrap

    code = """
        import json
        import jax, jax.numpy as jnp, numpy as np
        from jaxrl_llm import models
        from jaxrl_llm.models.sharding import make_mesh, param_shardings
        from jaxrl_llm.run.layout import place
        from jaxrl_llm.train.logprobs import row_logprobs

        diffs = {}
        for vocab in (64, 70):
            config = models.ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                                        num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
            params = models.init_params(config, jax.random.PRNGKey(0))
            rng = np.random.default_rng(0)
            tokens = rng.integers(1, vocab, size=(4, 12)).astype(np.int32)
            prompt_lens = np.array([3, 4, 5, 2], np.int32)
            response = rng.integers(1, vocab, size=(4, 6)).astype(np.int32)

            def value_and_grad(p, c):
                f = lambda q: row_logprobs(q, c, tokens, prompt_lens, response, chunk=16).sum()
                return jax.jit(jax.value_and_grad(f))(p)

            want = value_and_grad(params, config)
            mesh = make_mesh("data=2,fsdp=2,tensor=2")
            got = value_and_grad(place(params, param_shardings(params, mesh)), config.replace(remat_logits=True))
            diffs[vocab] = max(float(jnp.abs(a - b).max())
                               for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
            diffs[f"{vocab}_embed_grad"] = float(jnp.abs(want[1]["embed"]).max())
        print(json.dumps(diffs))
    """
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    diffs = json.loads(out.stdout.strip().splitlines()[-1])
    for vocab in (64, 70):
        assert diffs[str(vocab)] < 5e-5 and diffs[f"{vocab}_embed_grad"] > 1e-2, diffs
