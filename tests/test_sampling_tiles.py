"""The static engine's tiled response cache (`sampling.decoder`, `response_tile`): same rollouts as one buffer per
layer, writes in place, and a step reads only the tiles generated so far."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.sampling import collect, decode, make_plan, prefill
from jaxrl_llm.sampling.buckets import RESPONSE_TILE, response_tile_size
from jaxrl_llm.sampling.decoder import _write_tiles, decode_step, empty_row_cache, unstack_layers
from jaxrl_llm.sampling.engine import decode_rows
from jaxrl_llm.sampling.plan import stop_array as _stop_array
from tiny_models import tiny_sampler_model

VOCAB = 64
PROMPTS = [np.array(p, np.int32) for p in ([1, 2, 3], list(range(4, 21)), [9], [2, 2], [7, 5, 3, 1, 8, 6])]
COUNTS = np.array([3, 5, 0, 2, 4])
NEW_TOKENS = 30  # bucket 32: tiles of 8 or 4 give 4 or 8 tiles


@pytest.fixture(scope="module")
def tiny():
    return tiny_sampler_model(VOCAB)


def rollout(tiny, tile: int, temperature: float):
    config, params = tiny
    lengths = np.array([len(p) for p in PROMPTS])
    plan = dataclasses.replace(make_plan(lengths, COUNTS, NEW_TOKENS), response_tile=tile)
    state, first = prefill(params, config, PROMPTS, plan)
    state = decode(params, config, state, first, max_new_tokens=NEW_TOKENS, temperature=temperature, top_p=1.0,
                   top_k=0, stop_ids=_stop_array([5], VOCAB), rng=jax.random.key(1), pad_id=0)
    return state, collect(state, plan, NEW_TOKENS)


def test_response_tile_size_hand_values():
    assert RESPONSE_TILE == 128
    assert [response_tile_size(n) for n in (16, 128, 255)] == [0, 0, 0]  # fewer than two tiles: one buffer
    assert [response_tile_size(n) for n in (256, 512, 1024)] == [128, 128, 128]
    assert [response_tile_size(n) for n in (1280, 3072)] == [160, 384]  # at most 8 tiles
    assert make_plan(np.array([5]), np.array([2]), 300).response_tile == 128  # bucket 512
    assert make_plan(np.array([5]), np.array([2]), 24).response_tile == 0


@pytest.mark.parametrize("tile", [8, 4])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tiled_cache_gives_the_rollouts_of_one_buffer(tiny, tile, temperature):
    state, tiled = rollout(tiny, tile, temperature)
    assert all(isinstance(k, tuple) and len(k) == 32 // tile and k[0].shape[-1] == tile
               for k in state.cache.response_k)
    assert all(v[0].shape[2] == tile for v in state.cache.response_v)
    _, whole = rollout(tiny, 0, temperature)
    assert whole.lengths.max() > 2 * tile  # the rows cross tiles
    # Tiles compile another program (log-probs below to rounding); tokens exactly: each row draws with the same
    # key in both, and a draw (64 tokens, ~400 draws) moves only if rounding puts it within ~1e-6 of a CDF boundary.
    np.testing.assert_array_equal(tiled.tokens, whole.tokens)
    np.testing.assert_array_equal(tiled.lengths, whole.lengths)
    np.testing.assert_allclose(tiled.logprobs, whole.logprobs, atol=2e-6)  # a tile's value dot sums in its own order


def test_write_tiles_puts_the_token_in_its_tile_only():
    tiles = tuple(jnp.full((2, 1, 1, 4), float(i)) for i in range(3))  # [B, KV, d, T]: slots 0-3, 4-7, 8-11
    new = jnp.array([10.0, 20.0]).reshape(2, 1, 1, 1)
    written = _write_tiles(tiles, new, jnp.int32(5), axis=3)  # token 5: tile 1, slot 1
    expected = [np.full((2, 1, 1, 4), float(i)) for i in range(3)]
    expected[1][:, 0, 0, 1] = [10.0, 20.0]
    for got, want in zip(written, expected):
        np.testing.assert_array_equal(got, want)


def test_write_tiles_with_a_step_per_row():
    tiles = tuple(jnp.full((2, 1, 4, 1), float(i)) for i in range(3))  # [B, KV, T, d] (values' layout)
    new = jnp.array([10.0, 20.0]).reshape(2, 1, 1, 1)
    written = _write_tiles(tiles, new, jnp.array([5, 8]), axis=2)  # row 0: tile 1 slot 1; row 1: tile 2 slot 0
    expected = [np.full((2, 1, 4, 1), float(i)) for i in range(3)]
    expected[1][0, 0, 1, 0] = 10.0
    expected[2][1, 0, 0, 0] = 20.0
    for got, want in zip(written, expected):
        np.testing.assert_array_equal(got, want)


def test_per_row_steps_over_tiles_equal_one_buffer(tiny):
    """The continuous engine's step (one step per row, rows in different tiles) over a tiled cache gives the
    logits and cache of one buffer per layer."""
    config, params = tiny
    rng = np.random.default_rng(0)
    whole = empty_row_cache(config, 3, 8, 16)
    whole = jax.tree_util.tree_map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), whole)
    tiled = whole._replace(response_k=tuple(tuple(k[..., s: s + 4] for s in range(0, 16, 4)) for k in whole.response_k),
                           response_v=tuple(tuple(v[:, :, s: s + 4] for s in range(0, 16, 4)) for v in whole.response_v))
    tokens, lengths, steps = jnp.array([3, 7, 11]), jnp.array([8, 5, 2]), jnp.array([0, 6, 9])  # tiles 0, 1, 2
    layers = unstack_layers(params)
    want, want_cache = decode_step(params, layers, config, tokens, lengths, steps, whole)
    got, got_cache = decode_step(params, layers, config, tokens, lengths, steps, tiled)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert np.abs(np.asarray(want)).max() > 0.1
    for got_k, want_k in zip(got_cache.response_k, want_cache.response_k):
        np.testing.assert_allclose(jnp.concatenate(got_k, -1), want_k, atol=1e-6, rtol=0)  # layer 2: rounding
    for got_v, want_v in zip(got_cache.response_v, want_cache.response_v):
        np.testing.assert_allclose(jnp.concatenate(got_v, 2), want_v, atol=1e-6, rtol=0)


def test_reading_more_tiles_than_reached_changes_nothing(tiny):
    """A row's attention over the tiles it reached equals its attention over more tiles (the continuous engine reads
    up to its deepest slot's tile, the static engine up to its step's): the extra tiles add nothing."""
    from jaxrl_llm.sampling.decoder import _attend

    config, _ = tiny
    rng = np.random.default_rng(1)
    kv, d, heads = config.num_kv_heads, config.head_dim, config.num_heads

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32))

    rows, prompt, tile = 8, 64, 128  # the engines' tile of 128
    q, prompt_k, prompt_v = normal(rows, heads, d), normal(rows, kv, d, prompt), normal(rows, kv, prompt, d)
    tiles_k, tiles_v = [normal(rows, kv, d, tile) for _ in range(4)], [normal(rows, kv, tile, d) for _ in range(4)]
    lengths = jnp.asarray(rng.integers(1, prompt + 1, rows))
    steps = jnp.asarray(rng.integers(0, 2 * tile, rows))  # all within the first two tiles
    attend = jax.jit(lambda *args: _attend(*args, config))  # compiled, as in the engines' loops
    reached = attend(q, prompt_k, prompt_v, tiles_k[:2], tiles_v[:2], lengths, steps)
    every = attend(q, prompt_k, prompt_v, tiles_k, tiles_v, lengths, steps)
    # To f32 rounding, not bitwise: 2 and 4 tiles are differently shaped programs. Unmasked extra tiles (random
    # keys and values) would move the output far more.
    np.testing.assert_allclose(every, reached, rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(reached)).max() > 0.1


def test_continuous_engine_over_tiles_equals_the_static_engine(tiny):
    """At a 256-token bucket both engines use tiles of 128; with slots equal to the static call's rows they draw
    the same rollouts (the continuous engine's rows cross tiles at different iterations)."""
    from jaxrl_llm.sampling import generate

    config, params = tiny
    kwargs = dict(num_samples=COUNTS, max_new_tokens=140, rng=jax.random.key(3), stop_ids=[5])
    static = generate(params, config, PROMPTS, **kwargs)
    continuous = generate(params, config, PROMPTS, engine="continuous", max_slots=16, **kwargs)
    assert static.lengths.max() > 128 and len(set(static.lengths.tolist())) > 3  # rows cross tiles, end apart
    # The engines are different programs (log-probs to rounding); tokens exactly: each row draws with the same key
    # in both, and a draw moves only if rounding puts it within ~1e-6 of a CDF boundary (~1e-5 a draw here).
    np.testing.assert_array_equal(continuous.tokens, static.tokens)
    np.testing.assert_allclose(continuous.logprobs, static.logprobs, atol=1e-5)


def test_empty_row_cache_checks_the_tile():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="must divide"):
        empty_row_cache(config, 2, 8, 16, response_tile=6)


def copies_in_loops(text: str, shapes: set) -> list:
    """(computation, shape) of every `copy` of a buffer of one of `shapes` in the compiled program's text, outside
    the entry computation (which sets up the loop's state once) and fused kernels (one kernel's body)."""
    found, computation = [], None
    for line in text.splitlines():  # a computation opens at column 0
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            computation = None if line.startswith("ENTRY") else line.split()[0].lstrip("%")
        copy = re.search(r"= (\w+\[[\d,]*\])\{[\d,]*\} copy\(", line)
        if copy and copy.group(1) in shapes and computation and not computation.startswith("fused"):
            found.append((computation, copy.group(1)))
    return found


def tile_shapes(config, rows: int, tile: int) -> set:
    kv, d = config.num_kv_heads, config.head_dim
    return {f"f32[{rows},{kv},{d},{tile}]", f"f32[{rows},{kv},{tile},{d}]"}


def test_tiled_decode_loop_writes_its_tiles_in_place(tiny):
    """The compiled decode loop holds no copy of a tile buffer (a conditional write into the tile of the step
    copied every tile of every layer at every step). Checked on the compiled program's text."""
    config, params = tiny
    lengths = np.array([len(p) for p in PROMPTS])
    plan = dataclasses.replace(make_plan(lengths, COUNTS, NEW_TOKENS), response_tile=8)
    state, first = prefill(params, config, PROMPTS, plan)
    text = decode_rows.lower(params, config, None, state, first, jax.random.key(1), jnp.float32(1.0),
                             jnp.float32(1.0), jnp.int32(NEW_TOKENS), jnp.asarray(_stop_array([5], VOCAB)),
                             jnp.int32(0), jnp.int32(0), greedy=False, top_k=0,
                             use_top_p=False).compile().as_text()
    assert re.search(r"while\(", text) and re.search(r"conditional\(", text)
    assert copies_in_loops(text, tile_shapes(config, plan.row_bucket, 8)) == []


def test_continuous_slot_loop_writes_its_tiles_in_place(tiny, monkeypatch):
    """The same for the continuous engine's slot loop at a 256-token bucket (tiles of 128, per-row writes)."""
    import jaxrl_llm.sampling.continuous as continuous
    from jaxrl_llm.sampling import generate

    config, params = tiny
    calls, real = [], continuous.decode_slots

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(continuous, "decode_slots", spy)
    generate(params, config, PROMPTS, num_samples=COUNTS, max_new_tokens=6, rng=jax.random.key(0),
             engine="continuous", max_slots=4)
    (args, kwargs), = calls
    keys = args[3].keys[0]
    args = (args[0], args[1], args[2], continuous.empty_prompt_cache(config, keys.shape[0], keys.shape[-1])) + args[4:]
    text = real.lower(*args, **dict(kwargs, new_token_bucket=256)).compile().as_text()
    assert re.search(r"conditional\(", text)  # the switch over the tiles reached
    assert copies_in_loops(text, tile_shapes(config, 4, 128)) == []
