"""Attention sinks (gpt-oss: a learned logit per head in the softmax's denominator) on every attention path that
takes them, against a float64 NumPy loop: the packed rows' XLA attention (full, and in tiles), the regrouped XLA
rows (a GPU's path) and splash in interpret mode (a TPU's); values and gradients, the sinks' own included. cuDNN
takes none: the dispatch refuses it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.models import attention as dispatch
from jaxrl_llm.models.attention import group_width, regroup_layout, resolve, self_attention
from jaxrl_llm.train.packing import pack_groups

HEADS, KV, DIM = 4, 2, 8
SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)


def _config(impl="xla", block=None):
    return ModelConfig(vocab_size=50, hidden_size=HEADS * DIM, intermediate_size=8, num_layers=1, num_heads=HEADS,
                       num_kv_heads=KV, head_dim=DIM, model_type="gpt_oss", attention_bias=True,
                       attention_out_bias=True, attention_impl=impl, attention_block_size=block)


@pytest.fixture(scope="module")
def packed():
    """Two packed rows: prompts of 5 and 3 tokens with 2 and 1 responses of up to 6 tokens, random q, k, v."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 50, n) for n in (5, 3)]
    responses = rng.integers(1, 50, (3, 6))
    batch = pack_groups(prompts, [np.arange(2), np.arange(2, 3)], responses, np.array([6, 2, 4]))
    rows, length = batch.tokens.shape
    q, k, v = (jnp.asarray(3 * rng.normal(size=(rows, length, h, DIM)), jnp.float32) for h in (HEADS, KV, KV))
    return batch, q, k, v


def _numpy(q, k, v, batch, sinks):
    """float64: query i sees key j iff positions[j] <= positions[i] and segment j is i's or 0; head h's softmax
    over those keys and sinks[h]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    pos, seg = batch.positions, batch.segments
    out = np.zeros(q.shape)
    for b in range(q.shape[0]):
        keep = (pos[b][None, :] <= pos[b][:, None]) & ((seg[b][None, :] == seg[b][:, None]) | (seg[b][None, :] == 0))
        for h in range(HEADS):
            s = q[b, :, h] @ k[b, :, h // (HEADS // KV)].T / np.sqrt(DIM)
            s = np.where(keep, s, -np.inf)
            top = np.maximum(s.max(-1, keepdims=True), sinks[h])
            w = np.exp(s - top)
            out[b, :, h] = (w / (w.sum(-1, keepdims=True) + np.exp(sinks[h] - top))) @ v[b, :, h // (HEADS // KV)]
    return out.reshape(*q.shape[:2], -1)


@pytest.mark.parametrize("impl", ["xla", "blocked", "xla_rows", "splash"])
def test_attention_sinks_equal_a_float64_loop_values_and_gradients(packed, impl):
    batch, q, k, v = packed
    positions, segments = jnp.asarray(batch.positions), jnp.asarray(batch.segments)
    slots, resp_len = batch.pred_index.shape[1:]
    real = np.asarray(batch.segments) <= slots
    weights = jax.random.normal(jax.random.key(1), (*q.shape[:2], HEADS * DIM)) * real[..., None]

    def f(config, q, k, v, sinks):
        if impl == "xla_rows":  # what a GPU runs for a model with sinks, run here on its regrouped rows
            groups = regroup_layout(segments, q.shape[0], q.shape[1], slots, group_width(config, q.shape[1], resp_len))
            return dispatch._fused("xla_rows", q, k, v, groups, config, None, "cpu", sinks)
        return self_attention(q, k, v, positions, config, segment_ids=segments, slots=slots, response_len=resp_len,
                              sinks=sinks)

    config = {"blocked": _config(block=4), "splash": _config("splash")}.get(impl, _config())
    run = jax.jit(jax.value_and_grad(lambda *a: (f(config, *a) * weights).sum(), argnums=(0, 1, 2, 3)))
    reference = jax.jit(jax.value_and_grad(lambda *a: (f(_config(), *a) * weights).sum(), argnums=(0, 1, 2, 3)))
    got = np.asarray(jax.jit(lambda *a: f(config, *a))(q, k, v, SINKS))
    want = _numpy(q, k, v, batch, SINKS)
    assert np.abs(want[real]).max() > 2.0
    np.testing.assert_allclose(got[real], want[real], atol=1e-5, rtol=1e-5)  # float32 rounding
    _, grads = run(q, k, v, jnp.asarray(SINKS))
    _, want_grads = reference(q, k, v, jnp.asarray(SINKS))
    assert np.abs(np.asarray(want_grads[3])).min() > 1e-3  # the sinks learn
    for a, b in zip(grads, want_grads):
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(b).max())), rtol=1e-5)


def test_the_dispatch_refuses_cudnn_for_attention_sinks():
    assert resolve(_config("auto"), "gpu") == "xla_rows" and resolve(_config("auto"), "gpu", prefill=True) == "xla"
    assert resolve(_config("auto"), "tpu") == "splash"  # splash takes sinks
    with pytest.raises(ValueError, match="takes no attention sinks"):
        resolve(_config("cudnn"), "gpu")


@pytest.mark.parametrize("sinks_dtype", [jnp.bfloat16, jnp.float32])
def test_a_bf16_gradient_with_sinks_lowers_for_every_platform(packed, sinks_dtype):
    """bf16 q, k, v with sinks in bf16 or float32: the gradient of the dispatched attention lowers for CPU, GPU and
    TPU (the splash branch gave the sinks' gradient in q's dtype, the XLA ones in the sinks', and the platforms'
    case refused to lower for a CPU or GPU)."""
    batch, q, k, v = packed
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    config = _config("auto").replace(compute_dtype="bfloat16")

    def loss(q, k, v, sinks):
        return self_attention(q, k, v, jnp.asarray(batch.positions), config, segment_ids=jnp.asarray(batch.segments),
                              slots=2, response_len=6, sinks=sinks).astype(jnp.float32).sum()

    traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, k, v, jnp.asarray(SINKS, sinks_dtype))
    for platform in ("cpu", "cuda", "tpu"):
        traced.lower(lowering_platforms=(platform,))
