"""Logits parity of the JAX decoder with transformers' PyTorch Llama / Qwen2 / Qwen3 (float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")

from numpy_reference import numpy_attention  # noqa: E402
from tiny_models import (FAMILIES, load_torch_model, position_ids, random_tokens,  # noqa: E402
                         tiny_hf_config, torch_logits)

from jaxrl_llm.models import (  # noqa: E402
    decoder_layer,
    embed_tokens,
    forward,
    forward_cached,
    hidden_states,
    init_cache,
    load_hf,
    output_logits,
)
from jaxrl_llm.models.layers import rope_inv_freq  # noqa: E402

pytestmark = pytest.mark.reference
TOL = 1e-4
CACHE_LEN = 16  # one cache length everywhere so compiled functions are shared between tests
forward_jit = jax.jit(forward, static_argnums=1)
forward_cached_jit = jax.jit(forward_cached, static_argnums=1)


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    config, params = load_hf(path)
    return config, params, load_torch_model(path)


def test_full_forward_matches_transformers(family_model):
    config, params, torch_model = family_model
    tokens = random_tokens(2, 13)
    ours = np.asarray(forward_jit(params, config, tokens, position_ids(2, 13)))
    ref = torch_logits(torch_model, tokens)
    assert np.abs(ref).max() > 1.0  # the random model has logits worth comparing
    assert np.abs(ours - ref).max() <= TOL


def test_left_padded_batch_matches_transformers(family_model):
    config, params, torch_model = family_model
    tokens = random_tokens(2, 10, seed=1)
    mask = np.ones_like(tokens)
    mask[1, :4] = 0  # row 1 is left-padded with 4 pads
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    ours = np.asarray(forward_jit(params, config, tokens, positions, attention_mask=mask))
    ref = torch_logits(torch_model, tokens, positions, mask)
    assert np.abs(ours - ref)[mask == 1].max() <= TOL
    # The padded row's real tokens give the same logits as that row alone without padding.
    alone = torch_logits(torch_model, tokens[1:, 4:])
    assert np.abs(ours[1, 4:] - alone[0]).max() <= TOL


def test_hidden_states_match_transformers_last_hidden_state(family_model):
    import torch

    config, params, torch_model = family_model
    tokens = random_tokens(1, 7, seed=2)
    hidden = hidden_states(params, config, tokens, position_ids(1, 7))
    with torch.no_grad():
        ref = torch_model(torch.as_tensor(tokens, dtype=torch.long), output_hidden_states=True)
    # transformers' last hidden state is taken after the final norm, as ours.
    assert np.abs(np.asarray(hidden) - ref.hidden_states[-1].numpy()).max() <= TOL
    logits = output_logits(params, config, hidden)
    assert logits.dtype == jnp.float32
    assert np.abs(np.asarray(logits) - ref.logits.numpy()).max() <= TOL


def test_one_public_decoder_layer_with_numpy_attention_matches_transformers_first_layer(family_model):
    """The pieces a pass of one's own is built from: `embed_tokens`, then `decoder_layer` with an
    attention supplied by the caller (here NumPy's, float64, causal), give transformers' hidden state
    after the first layer; what the attention returns beside its output comes back unchanged."""
    import torch

    config, params, torch_model = family_model
    tokens = random_tokens(2, 9, seed=4)
    seen = {}

    def numpy_causal(q, k, v):
        seen["shapes"] = (q.shape, k.shape, v.shape)
        keep = np.broadcast_to(np.tril(np.ones((9, 9), bool)), (2, 9, 9))
        out = numpy_attention(*(np.asarray(a, np.float64) for a in (q, k, v)), keep)
        return jnp.asarray(out, jnp.float32), "aux"

    first = jax.tree_util.tree_map(lambda a: a[0], params["layers"])
    x0 = embed_tokens(params, config, jnp.asarray(tokens))
    x1, aux = decoder_layer(first, config, x0, jnp.asarray(position_ids(2, 9)), numpy_causal)
    with torch.no_grad():
        ref = torch_model(torch.as_tensor(tokens, dtype=torch.long), output_hidden_states=True).hidden_states
    assert np.abs(np.asarray(x0) - ref[0].numpy()).max() <= 1e-6
    assert np.abs(np.asarray(x1) - ref[1].numpy()).max() <= TOL
    assert np.abs(ref[1].numpy() - ref[0].numpy()).max() > 0.1  # the layer changed the stream
    assert aux == "aux"
    assert seen["shapes"] == ((2, 9, config.num_heads, config.head_dim),
                              *[(2, 9, config.num_kv_heads, config.head_dim)] * 2)


def test_token_by_token_decoding_matches_full_forward(family_model):
    config, params, torch_model = family_model
    tokens = random_tokens(2, 9, seed=3)
    ref = torch_logits(torch_model, tokens)
    cache = init_cache(config, batch=2, max_len=CACHE_LEN)
    for t in range(tokens.shape[1]):
        logits, cache = forward_cached_jit(params, config, tokens[:, t:t + 1], position_ids(2, 1, start=t), cache)
        assert np.abs(np.asarray(logits[:, 0]) - ref[:, t]).max() <= TOL, f"step {t}"


def test_prefill_chunk_then_decode_matches_full_forward(family_model):
    config, params, torch_model = family_model
    tokens = random_tokens(2, 11, seed=4)
    ref = torch_logits(torch_model, tokens)
    cache = init_cache(config, batch=2, max_len=CACHE_LEN)
    logits, cache = forward_cached_jit(params, config, tokens[:, :6], position_ids(2, 6), cache)
    assert np.abs(np.asarray(logits) - ref[:, :6]).max() <= TOL
    for t in range(6, 11):
        logits, cache = forward_cached_jit(params, config, tokens[:, t:t + 1], position_ids(2, 1, start=t), cache)
        assert np.abs(np.asarray(logits[:, 0]) - ref[:, t]).max() <= TOL, f"step {t}"


def test_rows_at_different_positions_in_one_batch(family_model):
    """Right-padded prefill of prompts of lengths 3 and 6, then decode with per-row positions."""
    config, params, torch_model = family_model
    full = random_tokens(2, 9, seed=5)
    lengths = [3, 6]
    prompt = full[:, :6].copy()
    prompt[0, 3:] = 0  # pad tokens write slots 3..5 of row 0; decode must overwrite them first
    cache = init_cache(config, batch=2, max_len=CACHE_LEN)
    logits, cache = forward_cached_jit(params, config, prompt, position_ids(2, 6), cache)
    for row, length in enumerate(lengths):
        ref = torch_logits(torch_model, full[row:row + 1, :length])[0]
        assert np.abs(np.asarray(logits[row, :length]) - ref).max() <= TOL
    for step in range(3):
        positions = np.array([[lengths[0] + step], [lengths[1] + step]], dtype=np.int32)
        step_tokens = np.take_along_axis(full, positions, axis=1)
        logits, cache = forward_cached_jit(params, config, step_tokens, positions, cache)
        for row in range(2):
            p = positions[row, 0]
            ref = torch_logits(torch_model, full[row:row + 1, :p + 1])[0, -1]
            assert np.abs(np.asarray(logits[row, 0]) - ref).max() <= TOL, f"row {row} step {step}"


def test_cache_slots_beyond_the_position_are_ignored(family_model):
    config, params, _ = family_model
    tokens = random_tokens(2, 6, seed=6)
    clean = init_cache(config, batch=2, max_len=CACHE_LEN)
    rng = np.random.RandomState(0)
    dirty = type(clean)(*(jnp.asarray(rng.normal(size=c.shape) * 10, c.dtype) for c in clean))
    a, cache_a = forward_cached_jit(params, config, tokens, position_ids(2, 6), clean)
    b, cache_b = forward_cached_jit(params, config, tokens, position_ids(2, 6), dirty)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the chunk wrote exactly slots 0..5; later slots keep what was there
    np.testing.assert_array_equal(np.asarray(cache_a.k[:, :, :6]), np.asarray(cache_b.k[:, :, :6]))
    np.testing.assert_array_equal(np.asarray(cache_b.k[:, :, 6:]), np.asarray(dirty.k[:, :, 6:]))
    # positions past the cache end are dropped, not wrapped or clamped onto the last slot
    _, cache_c = forward_cached_jit(params, config, tokens, position_ids(2, 6, start=CACHE_LEN - 2), clean)
    written = np.any(np.asarray(cache_c.k) != 0, axis=(0, 3, 4))  # [B, S]
    assert written[:, CACHE_LEN - 2:].all() and not written[:, :CACHE_LEN - 2].any()


def test_llama3_rope_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxrl_llm.models import ModelConfig

    hf_config = tiny_hf_config("llama")
    ref, scale = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    config = ModelConfig.from_hf_dict(hf_config.to_dict())
    ours = rope_inv_freq(config)
    assert scale == 1.0
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6, atol=0)
    plain = rope_inv_freq(config.replace(rope_scaling=None))
    # the tiny config puts frequencies in all three bands: kept, interpolated, divided by factor
    assert ours[0] == plain[0] and np.isclose(ours[-1], plain[-1] / 8.0)
    assert np.any((ours != plain) & ~np.isclose(ours, plain / 8.0))


def test_bfloat16_forward_is_close_to_float32(tiny_checkpoint):
    config, params = load_hf(tiny_checkpoint("qwen3"))
    tokens = random_tokens(2, 10, seed=7)
    f32 = np.asarray(forward_jit(params, config, tokens, position_ids(2, 10)))
    bf16_config = config.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    bf16_params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    bf16 = forward_jit(bf16_params, bf16_config, tokens, position_ids(2, 10))
    assert bf16.dtype == jnp.float32
    bf16 = np.asarray(bf16)
    assert np.all(np.isfinite(bf16))
    assert np.abs(bf16 - f32).max() <= 0.1 * np.abs(f32).max()
    assert np.mean(bf16.argmax(-1) == f32.argmax(-1)) >= 0.9


def test_remat_gives_same_logits_and_gradients(tiny_checkpoint):
    config, params = load_hf(tiny_checkpoint("llama"))
    tokens = random_tokens(1, 6, seed=8)

    def loss(p, cfg):
        return jnp.mean(forward(p, cfg, tokens, position_ids(1, 6)) ** 2)

    loss_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    plain_loss, plain_grad = loss_and_grad(params, config)
    remat_loss, remat_grad = loss_and_grad(params, config.replace(remat=True))
    np.testing.assert_allclose(remat_loss, plain_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(plain_grad), jax.tree.leaves(remat_grad)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
