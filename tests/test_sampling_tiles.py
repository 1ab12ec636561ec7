"""The static engine's tiled response cache (`sampling.decoder`, `response_tile`): same rollouts as one buffer per
layer, writes in place, and a step reads only the tiles generated so far."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.sampling import collect, decode, make_plan, prefill
from jaxrl_llm.sampling.decoder import (
    RESPONSE_TILE,
    _write_tiles,
    decode_step,
    empty_row_cache,
    response_tile_size,
    unstack_layers,
)
from jaxrl_llm.sampling.engine import decode_rows
from jaxrl_llm.sampling.generate import _stop_array

VOCAB = 64
PROMPTS = [np.array(p, np.int32) for p in ([1, 2, 3], list(range(4, 21)), [9], [2, 2], [7, 5, 3, 1, 8, 6])]
COUNTS = np.array([3, 5, 0, 2, 4])
NEW_TOKENS = 30  # bucket 32: tiles of 8 or 4 give 4 or 8 tiles


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, tie_word_embeddings=True, max_position_embeddings=512)
    params = init_params(config, jax.random.key(0))
    params["embed"] = params["embed"] * 3.0  # logits spread over a few nats
    return config, params


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


def test_tiled_cache_refuses_per_row_steps(tiny):
    config, params = tiny
    cache = empty_row_cache(config, 2, 8, 16, response_tile=8)
    with pytest.raises(ValueError, match="one step for all rows"):
        decode_step(params, unstack_layers(params), config, jnp.zeros(2, jnp.int32), jnp.full(2, 3),
                    jnp.array([0, 1]), cache)
    with pytest.raises(ValueError, match="must divide"):
        empty_row_cache(config, 2, 8, 16, response_tile=6)


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
    rows = plan.row_bucket
    shapes = {f"f32[{rows},{config.num_kv_heads},{config.head_dim},8]", f"f32[{rows},{config.num_kv_heads},8,"
              f"{config.head_dim}]"}
    copies, computation = [], None
    for line in text.splitlines():  # a computation opens at column 0; fused ones are one kernel's body
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            computation = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
        found = re.search(r"= (\w+\[[\d,]*\])\{[\d,]*\} copy\(", line)
        if found and found.group(1) in shapes and not computation.startswith("fused"):
            copies.append((computation, found.group(1)))
    assert re.search(r"while\(", text) and re.search(r"conditional\(", text) and copies == []
