"""The static engine's prompt entries shared by groups of rows (`buckets.prompt_group_size`, `decoder.empty_row_cache`'s
`prompt_group`): the rule's hand values, one entry per group holding its prompt's keys, the attention of a group
over its entry equal to each row's over its own copy, and the same rollouts as one entry per row."""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.sampling import buckets, collect, decode, generate, make_plan, prefill
from jaxrl_llm.sampling.buckets import prompt_group_size
from jaxrl_llm.sampling.decoder import _attend, empty_row_cache, prefill_cache
from jaxrl_llm.sampling.plan import plan_calls
from jaxrl_llm.sampling.plan import stop_array as _stop_array
from tiny_models import tiny_sampler_model

plan_module = importlib.import_module("jaxrl_llm.sampling.plan")

VOCAB = 64
PROMPTS = [np.array(p, np.int32) for p in ([1, 2, 3], list(range(4, 21)), [9], [2, 2], [7, 5, 3, 1, 8, 6])]


@pytest.fixture(scope="module")
def tiny():
    return tiny_sampler_model(VOCAB)


def test_prompt_group_size_hand_values():
    assert prompt_group_size([8] * 8, 64) == 8
    assert prompt_group_size([8, 4], 16) == 4
    assert prompt_group_size([6, 6], 64) == 2
    assert prompt_group_size([3, 5], 8) == 1
    assert prompt_group_size([0, 8, 0, 8], 16) == 8  # prompts without samples have no rows
    assert prompt_group_size([8, 8], 4) == 4  # a group never straddles two devices' rows
    lengths = np.array([len(p) for p in PROMPTS])
    assert make_plan(lengths, np.array([4, 4, 0, 4, 4]), 8).prompt_group == 4  # 16 rows
    assert make_plan(lengths, np.array([4, 4, 0, 4, 4]), 8, row_multiple=8).prompt_group == 2  # 2 rows per device
    assert make_plan(lengths, np.array([3, 5, 0, 2, 4]), 8).prompt_group == 1


def test_runs_of_a_chunked_step_share_one_group():
    lengths = np.array([len(p) for p in PROMPTS])
    plan = make_plan(lengths, np.array([8, 8, 0, 8, 8]), 8)
    assert plan.prompt_group == 8
    # runs of 12 rows: prompt 0's 8 rows + 4 of prompt 1, then 4 + 8 ...: every group of 4 rows is one prompt's
    runs = plan_calls(lengths, np.array([8, 8, 0, 8, 8]), 8, max_rows_per_call=12)
    assert [call.shapes.prompt_group for call in runs] == [4, 4, 4]
    assert [call.shapes.row_bucket for call in runs] == [16, 16, 16]


def test_empty_row_cache_holds_one_entry_per_group(tiny):
    config, _ = tiny
    cache = empty_row_cache(config, 16, 8, 16, prompt_group=4)
    assert cache.prompt_k[0].shape == (4, 2, 8, 8) and cache.prompt_v[0].shape == (4, 2, 8, 8)
    assert cache.response_k[0].shape == (16, 2, 8, 16)  # responses stay one per row
    with pytest.raises(ValueError, match="prompt_group 3 must be >= 1 and divide the rows"):
        empty_row_cache(config, 16, 8, 16, prompt_group=3)


def test_prefill_writes_each_prompt_once_into_its_groups_entry(tiny):
    config, params = tiny
    lengths = np.array([len(p) for p in PROMPTS])
    counts = np.array([4, 0, 0, 8, 4])  # rows 0-3: prompt 0, 4-11: prompt 3, 12-15: prompt 4
    plan = make_plan(lengths, counts, 8)
    assert plan.prompt_group == 4 and plan.row_bucket == 16
    state, _ = prefill(params, config, PROMPTS, plan)
    keys = state.cache.prompt_k[1]  # layer 1
    assert keys.shape[0] == 4
    for entry, prompt in enumerate([0, 3, 3, 4]):
        tokens = np.zeros((1, plan.prompt_bucket), np.int32)
        tokens[0, :lengths[prompt]] = PROMPTS[prompt]
        _, want, _ = prefill_cache(params, config, jnp.asarray(tokens), jnp.asarray(lengths[prompt:prompt + 1]))
        np.testing.assert_allclose(keys[entry, ..., :lengths[prompt]], want[1, 0, ..., :lengths[prompt]], atol=1e-6)


@pytest.mark.parametrize("window", [None, 5])
def test_group_attention_equals_each_rows_own_copy(window):
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=6,
                         num_kv_heads=2, head_dim=8, attn_logit_softcapping=20.0, max_position_embeddings=512)
    rng = np.random.default_rng(0)
    entries, group, kv, d, prompt_slots, slots = 3, 4, 2, 8, 12, 16
    rows = entries * group

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32))

    q = normal(rows, 6, d)
    prompt_k, prompt_v = normal(entries, kv, d, prompt_slots), normal(entries, kv, prompt_slots, d)
    response_k, response_v = normal(rows, kv, d, slots), normal(rows, kv, slots, d)
    lengths = jnp.repeat(jnp.array([12, 5, 9], jnp.int32), group)
    step = jnp.int32(6)
    grouped = _attend(q, prompt_k, prompt_v, response_k, response_v, lengths, step, config, window)
    own = np.repeat(np.arange(entries), group)  # each row's copy of its entry
    per_row = _attend(q, prompt_k[own], prompt_v[own], response_k, response_v, lengths, step, config, window)
    np.testing.assert_allclose(grouped, per_row, rtol=1e-6, atol=1e-6)
    # and against the softmax written out for one row (row 5: entry 1, prompt length 5)
    r, e = 5, 1
    keys = np.concatenate([np.asarray(prompt_k[e])[..., :5], np.asarray(response_k[r])[..., :7]], -1)  # [KV, d, 12]
    values = np.concatenate([np.asarray(prompt_v[e])[:, :5], np.asarray(response_v[r])[:, :7]], 1)  # [KV, 12, d]
    positions = np.concatenate([np.arange(5), 5 + np.arange(7)])
    keep = np.ones(12, bool) if window is None else (5 + 6 - positions) < window
    want = []
    for h in range(6):
        scores = np.asarray(q[r, h]) @ keys[h // 3] / np.sqrt(d)
        scores = 20.0 * np.tanh(scores / 20.0)
        weights = np.where(keep, np.exp(scores - scores[keep].max()), 0.0)
        want.append(weights / weights.sum() @ values[h // 3])
    np.testing.assert_allclose(np.asarray(grouped[r]).reshape(6, d), np.stack(want), rtol=1e-5, atol=1e-5)


def test_group_needs_one_step_for_all_rows(tiny):
    config, _ = tiny
    q = jnp.zeros((4, 4, 8))
    with pytest.raises(ValueError, match="needs one step for all rows"):
        _attend(q, jnp.zeros((2, 2, 8, 4)), jnp.zeros((2, 2, 4, 8)), jnp.zeros((4, 2, 8, 8)), jnp.zeros((4, 2, 8, 8)),
                jnp.full((4,), 3), jnp.zeros((4,), jnp.int32), config)


def rollout(tiny, counts, group, temperature, new_tokens=20):
    config, params = tiny
    lengths = np.array([len(p) for p in PROMPTS])
    plan = make_plan(lengths, counts, new_tokens)
    plan = dataclasses.replace(plan, prompt_group=plan.prompt_group if group is None else group)
    state, first = prefill(params, config, PROMPTS, plan)
    state = decode(params, config, state, first, max_new_tokens=new_tokens, temperature=temperature, top_p=1.0,
                   top_k=0, stop_ids=_stop_array([5], VOCAB), rng=jax.random.key(1), pad_id=0)
    return plan, state, collect(state, plan, new_tokens)


@pytest.mark.parametrize("counts", [[4, 4, 0, 4, 4], [6, 2, 2, 0, 6]])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grouped_entries_give_the_rollouts_of_one_entry_per_row(tiny, counts, temperature):
    plan, state, grouped = rollout(tiny, np.array(counts), None, temperature)
    assert plan.prompt_group == (4 if counts[0] == 4 else 2)
    assert state.cache.prompt_k[0].shape[0] == plan.row_bucket // plan.prompt_group
    _, _, per_row = rollout(tiny, np.array(counts), 1, temperature)
    assert grouped.lengths.max() > 3  # rows decode several tokens over the shared entries
    # Grouped entries are another program (log-probs to rounding); tokens exactly: each row draws with the same key,
    # and a draw moves only if rounding puts it within ~1e-6 of a CDF boundary (greedy: a top-two near-tie).
    np.testing.assert_array_equal(grouped.tokens, per_row.tokens)
    np.testing.assert_array_equal(grouped.lengths, per_row.lengths)
    np.testing.assert_allclose(grouped.logprobs, per_row.logprobs, atol=1e-6)


def test_generate_over_tiles_and_groups_equals_one_entry_per_row(tiny, monkeypatch):
    """`generate` end to end at a 256-token bucket (response tiles) with 8 samples per prompt in runs of 16 rows,
    against the same call with the group rule forced to one row per entry."""
    config, params = tiny
    # top_k=2: the two calls are different programs, and 4800 draws over 64 tokens could put one within f32 rounding
    # (~1e-6) of a CDF boundary (a few percent); between two tokens that takes a draw within ~1e-7 of one boundary.
    kwargs = dict(num_samples=8, max_new_tokens=200, temperature=1.0, top_k=2, stop_ids=(), rng=jax.random.key(2),
                  max_rows_per_call=16)
    grouped = generate(params, config, PROMPTS[:3], **kwargs)
    monkeypatch.setattr(buckets, "prompt_group_size", lambda counts, rows: 1)
    monkeypatch.setattr(plan_module, "prompt_group_size", lambda counts, rows: 1)
    per_row = generate(params, config, PROMPTS[:3], **kwargs)
    assert grouped.lengths.min() == 200
    assert len({tuple(row) for row in grouped.tokens}) == len(grouped.tokens)  # a prompt's rows differ from one another
    np.testing.assert_array_equal(grouped.tokens, per_row.tokens)
    np.testing.assert_allclose(grouped.logprobs, per_row.logprobs, atol=1e-6)
