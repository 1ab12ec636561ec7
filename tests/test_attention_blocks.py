"""Blocked (online-softmax) attention: the same values and gradients as full attention, less memory.

`ModelConfig.attention_block_size` switches `models.hidden_states` to `layers.blocked_attention`. These
tests pin the tiles against a NumPy softmax, the model's logits and parameter gradients against the full
path (plain causal rows, packed rows with several segments, a key mask, with and without remat, lengths
that are not a multiple of the block), the config knob's validation and its absence from config.json,
the run-config key, and that the compiled backward pass needs less temporary memory with blocks on.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy_reference import numpy_attention

from jaxrl_llm import models
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.models.layers import attention, attention_keep_mask, blocked_attention
from jaxrl_llm.run.config import ConfigError, load_config

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8)


def _packed_row_inputs():
    """Two packed rows of 31 tokens: a prompt (segment 0), responses restarting their positions where the
    prompt ends (segments 1..3), then padding in its own segment at a harmless position."""
    layouts = [(5, (7, 9, 6)), (9, (4, 11, 3))]
    length = 31
    positions = np.zeros((2, length), np.int32)
    segments = np.zeros((2, length), np.int32)
    for row, (prompt, responses) in enumerate(layouts):
        positions[row, :prompt] = np.arange(prompt)
        start = prompt
        for slot, n in enumerate(responses):
            positions[row, start:start + n] = prompt + np.arange(n)
            segments[row, start:start + n] = slot + 1
            start += n
        positions[row, start:] = prompt
        segments[row, start:] = len(responses) + 1
    tokens = np.random.RandomState(3).randint(0, TINY.vocab_size, size=(2, length)).astype(np.int32)
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments)


def test_keep_mask_by_hand():
    positions = jnp.array([[0, 1, 2, 1, 2]])  # a 1-token prompt, then two 2-token responses both starting at 1
    segments = jnp.array([[0, 1, 1, 2, 2]])
    keep = np.asarray(attention_keep_mask(positions, positions, q_segments=segments, k_segments=segments,
                                          key_mask=jnp.array([[1, 1, 1, 1, 0]])))
    expected = np.array([[1, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0],
                         [1, 1, 1, 0, 0],
                         [1, 0, 0, 1, 0],
                         [1, 0, 0, 1, 0]], bool)  # the last key is masked out, so token 4 misses itself
    np.testing.assert_array_equal(keep[0], expected)


@pytest.mark.parametrize("block_size", [4, 5, 13, 64])
def test_blocked_attention_matches_numpy_softmax(block_size):
    rng = np.random.RandomState(block_size)
    batch, length = 2, 13
    q = rng.normal(size=(batch, length, 6, 4)).astype(np.float32)
    k = rng.normal(size=(batch, length, 2, 4)).astype(np.float32)
    v = rng.normal(size=(batch, length, 2, 4)).astype(np.float32)
    positions = np.tile(np.arange(length, dtype=np.int32), (batch, 1))
    segments = rng.randint(0, 3, size=(batch, length)).astype(np.int32)
    key_mask = (rng.rand(batch, length) < 0.8).astype(np.int32)
    key_mask[:, 0] = 1
    segments[:, 0] = 0  # every query sees key 0, so no row is fully masked
    keep = ((positions[:, None, :] <= positions[:, :, None]) & (key_mask[:, None, :] != 0)
            & ((segments[:, None, :] == segments[:, :, None]) | (segments[:, None, :] == 0)))
    out = blocked_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(positions), block_size,
                            segment_ids=jnp.asarray(segments), key_mask=jnp.asarray(key_mask))
    np.testing.assert_allclose(np.asarray(out), numpy_attention(q, k, v, keep), rtol=1e-5, atol=1e-6)


def test_tiles_no_query_may_read_are_skipped():
    # A packed row: a 4-token prompt, then two responses of 4 tokens, in blocks of 4. Response 1's keys and
    # values are NaN: the tile of response 2's queries against them is masked whole, so it must not be
    # computed at all (a computed tile would give 0 x NaN = NaN), while response 1's own tiles are.
    rng = np.random.RandomState(1)
    q, k, v = (rng.normal(size=(1, 12, 4, 8)).astype(np.float32) for _ in range(3))
    positions = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7]], np.int32)
    segments = np.array([[0] * 4 + [1] * 4 + [2] * 4], np.int32)
    k[:, 4:8], v[:, 4:8] = np.nan, np.nan
    run = jax.jit(lambda q, k, v: blocked_attention(q, k, v, jnp.asarray(positions), 4,
                                                    segment_ids=jnp.asarray(segments)))
    out = np.asarray(run(q, k, v))
    keep = ((positions[:, None, :] <= positions[:, :, None])
            & ((segments[:, None, :] == segments[:, :, None]) | (segments[:, None, :] == 0)))
    expected = numpy_attention(q, np.nan_to_num(k), np.nan_to_num(v), keep)
    assert np.isnan(out[0, 4:8]).all()  # response 1 reads its own NaN keys
    np.testing.assert_allclose(out[0, np.r_[0:4, 8:12]], expected[0, np.r_[0:4, 8:12]], rtol=1e-5, atol=1e-6)
    grad_q = jax.grad(lambda q: run(q, k, v)[0, 8:].sum())(jnp.asarray(q))
    assert np.isfinite(np.asarray(grad_q)[0, 8:]).all()


def test_fully_masked_queries_average_the_real_keys_like_full_attention():
    # With every key masked, full attention's finite floor gives equal weights over all keys; the tiles must
    # do the same, and the padding that makes 5 keys into blocks of 2 must get weight exactly 0.
    rng = np.random.RandomState(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 5, 2, 4)).astype(np.float32)) for _ in range(3))
    positions = jnp.arange(5)[None]
    key_mask = jnp.zeros((1, 5), jnp.int32)
    out = blocked_attention(q, k, v, positions, 2, key_mask=key_mask)
    full = attention(q, k, v, attention_keep_mask(positions, positions, key_mask=key_mask))
    mean_v = np.asarray(v)[0].mean(axis=0).reshape(-1)  # [heads * d]: each query head reads its KV head's mean
    np.testing.assert_allclose(np.asarray(out)[0], np.tile(mean_v, (5, 1)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out), np.asarray(full), rtol=1e-5, atol=1e-6)


def _loss(params, config, tokens, positions, segments, attention_mask=None):
    """A scalar touching every logit, so its gradient reaches every parameter through every query;
    the logits ride along as the auxiliary output."""
    hidden = models.hidden_states(params, config, tokens, positions, segment_ids=segments,
                                  attention_mask=attention_mask)
    logits = models.output_logits(params, config, hidden)
    return jnp.sum(jax.nn.log_softmax(logits)[..., :7] * jnp.linspace(-1.0, 1.0, 7)), logits


def _assert_same_values_and_grads(config, block_size, tokens, positions, segments=None, attention_mask=None):
    params = models.init_params(config, jax.random.PRNGKey(0))
    run = jax.jit(jax.value_and_grad(_loss, has_aux=True), static_argnums=1)
    (value_full, logits_full), grads_full = run(params, config, tokens, positions, segments, attention_mask)
    (value_blocked, logits_blocked), grads_blocked = run(params, config.replace(attention_block_size=block_size),
                                                         tokens, positions, segments, attention_mask)
    np.testing.assert_allclose(np.asarray(logits_blocked), np.asarray(logits_full), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(value_blocked), float(value_full), rtol=1e-5)
    for path, g_full in jax.tree_util.tree_leaves_with_path(grads_full):
        g_blocked = np.asarray(_at(grads_blocked, path))
        scale = float(np.max(np.abs(np.asarray(g_full))))
        assert scale > 0, f"zero gradient for {jax.tree_util.keystr(path)}: the loss does not test it"
        np.testing.assert_allclose(g_blocked, np.asarray(g_full), rtol=1e-5, atol=1e-5 * scale,
                                   err_msg=jax.tree_util.keystr(path))


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


@pytest.mark.parametrize("remat", [False, True])
def test_packed_rows_match_full_attention(remat):
    tokens, positions, segments = _packed_row_inputs()
    _assert_same_values_and_grads(TINY.replace(remat=remat), 8, tokens, positions, segments)


def test_plain_causal_rows_with_a_key_mask_match_full_attention():
    tokens, _, _ = _packed_row_inputs()
    positions = jnp.tile(jnp.arange(tokens.shape[1]), (2, 1))
    attention_mask = (jnp.arange(tokens.shape[1]) < jnp.array([[31], [24]])).astype(jnp.int32)  # right padding
    config = TINY.replace(remat=True, remat_policy="dots", num_kv_heads=1)
    _assert_same_values_and_grads(config, 6, tokens, positions)
    _assert_same_values_and_grads(config, 6, tokens, positions, attention_mask=attention_mask)


def test_packed_response_logits_equal_its_unpacked_row():
    # Independent of the full path: response 2 of a packed row scores like prompt + response 2 on its own.
    tokens, positions, segments = _packed_row_inputs()
    config = TINY.replace(attention_block_size=4)
    params = models.init_params(config, jax.random.PRNGKey(1))
    logits = jax.jit(lambda p, t, pos, seg: models.output_logits(
        p, config, models.hidden_states(p, config, t, pos, segment_ids=seg)))
    packed = logits(params, tokens, positions, segments)
    alone_tokens = jnp.concatenate([tokens[:1, :5], tokens[:1, 12:21]], axis=1)  # prompt 5, response 2 = 9
    alone = logits(params, alone_tokens, jnp.arange(14)[None], jnp.zeros((1, 14), jnp.int32))
    np.testing.assert_allclose(np.asarray(packed[0, 12:21]), np.asarray(alone[0, 5:]), rtol=1e-5, atol=1e-5)


def test_bfloat16_tiles_err_like_full_bfloat16_attention():
    # bf16 rounds differently in tiles, so compare both bf16 paths with the f32 logits: similar errors.
    tokens, positions, segments = _packed_row_inputs()
    config = TINY.replace(compute_dtype="bfloat16")
    params = models.init_params(config, jax.random.PRNGKey(0))
    logits = jax.jit(lambda p, c: models.output_logits(
        p, c, models.hidden_states(p, c, tokens, positions, segment_ids=segments)), static_argnums=1)
    exact = np.asarray(logits(params, TINY))
    err_full = np.max(np.abs(np.asarray(logits(params, config)) - exact))
    err_blocked = np.max(np.abs(np.asarray(logits(params, config.replace(attention_block_size=8))) - exact))
    assert err_blocked <= 2 * err_full + 1e-3, (err_blocked, err_full)


def test_block_size_validation_and_config_json(tmp_path):
    for bad in (0, -4, 2.5, True, "64"):
        with pytest.raises(ValueError, match="attention_block_size"):
            TINY.replace(attention_block_size=bad)
    blocked = TINY.replace(attention_block_size=64)
    assert blocked.to_hf_dict() == TINY.to_hf_dict()  # a runtime knob: config.json never carries it
    assert ModelConfig.from_hf_dict(TINY.to_hf_dict(), attention_block_size=64) == blocked
    params = models.init_params(TINY, jax.random.PRNGKey(0))
    models.save_hf(tmp_path / "full", TINY, params)
    models.save_hf(tmp_path / "blocked", blocked, params)
    full_json = json.loads((tmp_path / "full" / "config.json").read_text())
    assert json.loads((tmp_path / "blocked" / "config.json").read_text()) == full_json
    assert "attention_block_size" not in full_json
    loaded, _ = models.load_hf(tmp_path / "blocked")
    assert loaded.attention_block_size is None and loaded == TINY


def test_run_config_key_reaches_the_policy(tmp_path):
    from jaxrl_llm.models.bundled import bundled_gguf_path
    from jaxrl_llm.models.tokenizer import Tokenizer
    from jaxrl_llm.run.setup import load_policy

    cfg = load_config(None, ["model.attention_block_size=512", "model.attention_block_min_length=2048"])
    assert (cfg.model.attention_block_size, cfg.model.attention_block_min_length) == (512, 2048)
    default = load_config(None, []).model
    assert (default.attention_block_size, default.attention_block_min_length) == (256, 1024)
    assert load_config(None, ["model.attention_block_size=null"]).model.attention_block_size is None
    with pytest.raises(ConfigError, match="model.attention_block_size"):
        load_config(None, ["model.attention_block_size=0"])
    with pytest.raises(ConfigError, match="model.attention_block_min_length"):
        load_config(None, ["model.attention_block_min_length=-1"])
    tokenizer = Tokenizer.from_gguf(bundled_gguf_path())
    config = TINY.replace(vocab_size=tokenizer.vocab_size, hidden_size=8, intermediate_size=8, num_layers=1,
                          num_heads=2, num_kv_heads=1, head_dim=4)
    models.save_hf(tmp_path, config, models.init_params(config, jax.random.PRNGKey(0)), tokenizer=tokenizer)
    loaded, _, _ = load_policy(str(tmp_path), attention_block_size=cfg.model.attention_block_size,
                               attention_block_min_length=cfg.model.attention_block_min_length)
    assert (loaded.attention_block_size, loaded.attention_block_min_length) == (512, 2048)


def test_rows_shorter_than_the_minimum_length_take_full_attention():
    # With tiles of 4 from 16 tokens on: a 12-token row computes exactly what full attention computes (the
    # same program: no tile conditionals in it), a 16-token row exactly what tiles without a minimum compute.
    # The XLA path is named: "auto" adds the TPU branch's platform switch (a cond) to every jaxpr.
    config = TINY.replace(attention_block_size=4, attention_block_min_length=16, attention_impl="xla")
    params = models.init_params(config, jax.random.PRNGKey(2))

    def hidden(cfg, length):
        tokens = jnp.asarray(np.random.RandomState(length).randint(0, TINY.vocab_size, size=(2, length)), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(length), (2, length))
        fn = lambda p: models.hidden_states(p, cfg, tokens, positions)  # noqa: E731
        return np.asarray(jax.jit(fn)(params)), "cond" in str(jax.make_jaxpr(fn)(params))

    short, short_tiled = hidden(config, 12)
    full, full_tiled = hidden(config.replace(attention_block_size=None), 12)
    assert not short_tiled and not full_tiled
    np.testing.assert_array_equal(short, full)
    long, long_tiled = hidden(config, 16)
    tiles, _ = hidden(config.replace(attention_block_min_length=0), 16)
    assert long_tiled
    np.testing.assert_array_equal(long, tiles)
    assert hidden(config.replace(attention_block_min_length=0), 12)[1]
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="attention_block_min_length"):
            TINY.replace(attention_block_min_length=bad)


def _grad_temp_bytes(config, length):
    tokens = jnp.zeros((1, length), jnp.int32)
    positions = jnp.arange(length)[None]
    segments = (jnp.arange(length)[None] >= 64).astype(jnp.int32)
    params = jax.eval_shape(lambda: models.init_params(config, jax.random.PRNGKey(0)))
    grad = jax.jit(jax.grad(_loss, has_aux=True), static_argnums=1)
    compiled = grad.lower(params, config, tokens, positions, segments).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blocks_lower_the_backward_pass_temporary_memory():
    # Full attention keeps [1, heads, 1024, 1024] float32 scores (16 MiB) per layer for the backward pass;
    # tiles of 128 keep one query block's running sums per key block instead.
    config = TINY.replace(num_layers=1)
    full = _grad_temp_bytes(config, 1024)
    blocked = _grad_temp_bytes(config.replace(attention_block_size=128), 1024)
    assert blocked < full / 4, (blocked, full)
