"""jaxrl_llm.sampling's continuous-batching engine: the same rollouts as the static engine (tokens exactly,
log-probs to f32 rounding) while decode slots turn over, no recompiles as they do, clear errors."""

import jax
import numpy as np
import pytest

from tiny_models import tiny_sampler_model

from jaxrl_llm.sampling import FINISH_STOP, generate
from jaxrl_llm.sampling.continuous import SlotStats, generate_slots
from jaxrl_llm.sampling.plan import stop_array as _stop_array

VOCAB = 24
PROMPTS = [[1, 2, 3], list(range(4, 21)), [9], [2, 2], [7, 5, 3, 1, 8, 6]]  # 17 tokens: the second bucket
COUNTS = [3, 5, 0, 2, 4]  # variable n_i, one prompt without samples


def _tiny(**overrides):
    return tiny_sampler_model(VOCAB, **overrides)  # largest next-token probability ~0.2


@pytest.fixture(scope="module")
def tiny():
    """The 2-layer GQA model of tests/test_sampling.py."""
    return _tiny()


def assert_same_rollout(static, continuous):
    # The engines compile different programs (slots vs rows), so log-probs agree to f32 rounding. Tokens (and the
    # lengths, stops and masks they decide) exactly: both draw sample k's token t with the same key, and on these
    # tiny models (24 tokens, a few hundred draws) a draw moves only if rounding puts it within ~1e-6 of a CDF
    # boundary (greedy: a near-tie of the top two logits).
    np.testing.assert_array_equal(continuous.prompt_index, static.prompt_index)
    np.testing.assert_array_equal(continuous.lengths, static.lengths)
    np.testing.assert_array_equal(continuous.finish_reason, static.finish_reason)
    np.testing.assert_array_equal(continuous.mask, static.mask)
    np.testing.assert_array_equal(continuous.tokens * continuous.mask, static.tokens * static.mask)
    np.testing.assert_allclose(continuous.logprobs, static.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature,top_k,top_p,max_slots", [
    (1.0, 0, 1.0, 3),   # slots turn over several times (14 samples on 3 slots)
    (0.7, 5, 1.0, 2),
    (1.3, 0, 0.8, 4),
    (0.9, 6, 0.9, 16),  # more slots than samples: one slot per sample
])
def test_sampled_rollouts_equal_static_engine(tiny, temperature, top_k, top_p, max_slots):
    config, params = tiny
    kwargs = dict(num_samples=COUNTS, max_new_tokens=14, temperature=temperature, top_k=top_k, top_p=top_p,
                  rng=jax.random.key(3))
    free = generate(params, config, PROMPTS, **kwargs)
    stop = (int(free.tokens[0, 2]),)  # row 0 ends within 3 tokens, the same draws as without the stop id
    static = generate(params, config, PROMPTS, stop_ids=stop, **kwargs)
    continuous = generate(params, config, PROMPTS, stop_ids=stop, engine="continuous", max_slots=max_slots, **kwargs)
    assert_same_rollout(static, continuous)
    np.testing.assert_array_equal(continuous.tokens, static.tokens)  # pad_id 0: the padding agrees too
    assert static.lengths[0] <= 3 and static.lengths.max() >= 10  # rows end at very different times
    assert (static.finish_reason == FINISH_STOP).any()


def test_greedy_rollouts_equal_static_engine_with_early_stops(tiny):
    config, params = tiny
    free = generate(params, config, PROMPTS, num_samples=1, max_new_tokens=12, temperature=0.0,
                    rng=jax.random.key(0))
    stop = (int(free.tokens[0, 1]), int(free.tokens[3, 6]))  # prompt 0 ends after <= 2 tokens, prompt 3 later
    # 32 prompt tokens per prefill call: the 4 prompts with samples are prefilled one at a time
    kwargs = dict(num_samples=[2, 3, 1, 0, 2], max_new_tokens=12, temperature=0.0, stop_ids=stop,
                  rng=jax.random.key(0), pad_id=VOCAB - 1, prefill_tokens_per_call=32)
    static = generate(params, config, PROMPTS, **kwargs)
    continuous = generate(params, config, PROMPTS, engine="continuous", max_slots=2, **kwargs)
    assert_same_rollout(static, continuous)
    assert static.lengths[0] <= 2 and static.lengths.max() > 6
    # After a row's end the continuous engine holds pad_id in every column.
    assert (continuous.tokens[continuous.mask == 0] == VOCAB - 1).all()


def test_slots_turn_over_with_hand_counted_iterations(tiny):
    """5 samples of 5 tokens (no stop id) on 2 slots: slot 0 decodes samples 0, 2, 4 and slot 1 samples 1, 3,
    so the loop runs 15 iterations, 25 of its 30 slot-steps generate a token."""
    config, params = tiny
    prompts = [np.array([1, 2, 3], np.int32), np.array([5, 6], np.int32)]
    *_, stats = generate_slots(params, config, prompts, np.array([3, 2]), max_new_tokens=5, temperature=1.0,
                               top_p=1.0, top_k=0, stop_ids=_stop_array((), VOCAB), rng=jax.random.key(0), pad_id=0,
                               max_slots=2)
    assert stats == SlotStats(slots=2, iterations=15, useful_slot_steps=25)
    assert stats.occupancy == pytest.approx(25 / 30)


@pytest.mark.parametrize("temperature,max_slots,max_entries", [(1.0, 2, 0), (0.8, 3, 0), (1.0, 3, 1)])
def test_prompt_cache_bounded_by_the_slots_prefills_in_the_loop(tiny, temperature, max_slots, max_entries):
    """12 prompts of 1-13 tokens (3 without samples, 1-4 samples each) with one prompt per prefill (16 prompt
    tokens per prefill call, the prompt bucket) on 2-3 slots: the prompt cache has slots + 1 entries, so 9 prompts are prefilled inside
    the loop into entries freed by finished prompts; the rollout is still the static engine's. With one
    entry (`max_prompt_entries=1`) slots wait for the prompt before them to finish: the same rollout, more
    loop iterations."""
    from jaxrl_llm.sampling.continuous import prompt_entries

    config, params = tiny
    prompts = [[(3 * i + j) % 20 + 1 for j in range(1 + (5 * i) % 13)] for i in range(12)]  # 1-13 tokens
    counts = [2, 1, 0, 3, 4, 1, 0, 2, 1, 3, 0, 2]
    assert prompt_entries(9, max_slots, 1) == max_slots + 1 < 9
    kwargs = dict(num_samples=counts, max_new_tokens=9, temperature=temperature, rng=jax.random.key(5),
                  prefill_tokens_per_call=16)
    free = generate(params, config, prompts, **kwargs)
    stop = (int(free.tokens[3, 1]),)  # rows end at different times, so entries free out of order
    static = generate(params, config, prompts, stop_ids=stop, **kwargs)
    continuous, stats = generate(params, config, prompts, stop_ids=stop, engine="continuous", max_slots=max_slots,
                                 max_prompt_entries=max_entries, return_stats=True, **kwargs)
    assert_same_rollout(static, continuous)
    assert static.lengths.min() <= 2 and static.lengths.max() == 9
    assert stats.useful_slot_steps == static.lengths.sum()
    if max_entries == 1:  # one prompt at a time: the loop runs at least each prompt's longest sample in turn
        longest = [static.lengths[static.prompt_index == p].max() for p in np.unique(static.prompt_index)]
        assert stats.iterations >= sum(longest)
    else:
        assert stats.occupancy > 0.5


def test_prompt_entries_hand_values():
    from jaxrl_llm.sampling.continuous import prompt_entries

    # (prompts, slots, prefill chunk): every prompt's bucket when it is smaller, else slots + chunk rounded up
    cases = {(5, 2, 1): 3, (5, 16, 4): 8, (1024, 64, 4): 68, (1024, 64, 8): 72, (100, 60, 8): 72, (3, 2, 4): 4,
             # with a limit: rounded up to the chunk, never above the default
             (1024, 64, 4, 16): 16, (1024, 64, 4, 13): 16, (5, 2, 1, 1): 1, (5, 16, 4, 2): 4, (1024, 64, 4, 500): 68}
    assert {case: prompt_entries(*case) for case in cases} == cases


def test_slot_count_hand_values():
    from jaxrl_llm.sampling.continuous import slot_count

    # (max_slots, samples, devices): capped by the samples' row bucket, at least 2, a multiple of the devices
    cases = {(3, 14, 1): 3, (64, 14, 1): 16, (1, 5, 1): 2, (3, 10, 4): 4, (5, 100, 4): 8, (8, 3, 1): 4}
    assert {case: slot_count(*case) for case in cases} == cases


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3_text"])
def test_sliding_window_models_equal_static_engine(family):
    """Windows of 4 tokens, shorter than prompt + response, so the response ring wraps around."""
    overrides = {
        "mistral": dict(model_type="mistral", sliding_window=4, tie_word_embeddings=False),
        "gemma2": dict(model_type="gemma2", sliding_window=4, layer_types=("sliding_attention", "full_attention"),
                       query_pre_attn_scalar=12.0, attn_logit_softcapping=5.0, final_logit_softcapping=4.0),
        "gemma3_text": dict(model_type="gemma3_text", num_layers=3, sliding_window=4, qk_norm=True,
                            rope_local_theta=10000.0, query_pre_attn_scalar=12.0,
                            layer_types=("sliding_attention", "full_attention", "sliding_attention")),
    }[family]
    config, params = _tiny(**overrides)
    kwargs = dict(num_samples=[2, 3, 1], max_new_tokens=12, temperature=1.0, stop_ids=(4,), rng=jax.random.key(1))
    static = generate(params, config, PROMPTS[:3], **kwargs)
    continuous = generate(params, config, PROMPTS[:3], engine="continuous", max_slots=2, **kwargs)
    assert_same_rollout(static, continuous)


def test_new_row_end_patterns_do_not_recompile(tiny):
    config, params = tiny
    compiles = []

    def on_event(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    def run(stop_ids, seed, counts=(3, 1, 2)):
        prompts = [np.arange(1, n + 1, dtype=np.int32) for n in (4, 9, 2)]
        *_, stats = generate_slots(params, config, prompts, np.array(counts), max_new_tokens=10, temperature=1.0,
                                   top_p=1.0, top_k=0, stop_ids=_stop_array(stop_ids, VOCAB), rng=jax.random.key(seed),
                                   pad_id=0, max_slots=2)
        return stats

    first = run((3,), 0)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        second = run((5, 8, 13), 1)
        third = run((), 2, counts=(2, 2, 1))  # no stop id: every row runs to max_new_tokens
        assert compiles == []
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert len({first.iterations, second.iterations, third.iterations}) == 3  # different end patterns
    assert third.iterations == 30 and third.useful_slot_steps == 50


def test_return_stats_hand_counted_for_both_engines(tiny):
    """14 samples of 5 tokens (no stop id). Static, 4 rows per call: calls of 4, 4, 4, 2 rows on a row bucket
    of 4, each decoding 5 steps -> 4 slots x 20 steps, 70 of 80 slot-steps useful. Continuous, 3 slots: they
    take 5, 5 and 4 samples -> 25 iterations, 70 of 75 slot-steps useful. The rollouts are the plain ones."""
    config, params = tiny
    kwargs = dict(num_samples=COUNTS, max_new_tokens=5, rng=jax.random.key(2))
    static, static_stats = generate(params, config, PROMPTS, max_rows_per_call=4, return_stats=True, **kwargs)
    continuous, slot_stats = generate(params, config, PROMPTS, engine="continuous", max_slots=3, return_stats=True,
                                      **kwargs)
    assert static_stats == SlotStats(slots=4, iterations=20, useful_slot_steps=70)
    assert static_stats.slot_steps == 80 and static_stats.occupancy == pytest.approx(70 / 80)
    assert slot_stats == SlotStats(slots=3, iterations=25, useful_slot_steps=70)
    assert slot_stats.occupancy == pytest.approx(70 / 75)
    assert_same_rollout(generate(params, config, PROMPTS, **kwargs), static)
    assert_same_rollout(static, continuous)
    empty, stats = generate(params, config, [[1]], num_samples=0, max_new_tokens=3, rng=jax.random.key(0),
                            return_stats=True)
    assert empty.tokens.shape == (0, 3) and stats == SlotStats(slots=0, iterations=0, useful_slot_steps=0)


def test_only_zero_counts_gives_an_empty_rollout(tiny):
    config, params = tiny
    out = generate(params, config, [[1], [2]], num_samples=[0, 0], max_new_tokens=3, rng=jax.random.key(0),
                   engine="continuous", max_slots=2)
    assert out.tokens.shape == (0, 3) and out.prompt_index.shape == (0,)


def test_bad_engine_options_raise_clear_errors(tiny):
    config, params = tiny
    key = jax.random.key(0)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="max_slots must be an int >= 1"):
            generate(params, config, [[1]], num_samples=1, max_new_tokens=2, rng=key, engine="continuous",
                     max_slots=bad)
    with pytest.raises(ValueError, match="max_slots must be an int >= 1"):
        generate_slots(params, config, [np.array([1], np.int32)], np.array([1]), max_new_tokens=2, temperature=1.0,
                       top_p=1.0, top_k=0, stop_ids=_stop_array((), VOCAB), rng=key, pad_id=0, max_slots=0)
    with pytest.raises(ValueError, match="max_slots applies to engine='continuous'"):
        generate(params, config, [[1]], num_samples=1, max_new_tokens=2, rng=key, max_slots=4)
    with pytest.raises(ValueError, match="engine must be one of"):
        generate(params, config, [[1]], num_samples=1, max_new_tokens=2, rng=key, engine="paged")
    with pytest.raises(ValueError, match="max_prompt_entries applies to engine='continuous'"):
        generate(params, config, [[1]], num_samples=1, max_new_tokens=2, rng=key, max_prompt_entries=2)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_prompt_entries must be an int >= 0"):
            generate(params, config, [[1]], num_samples=1, max_new_tokens=2, rng=key, engine="continuous",
                     max_prompt_entries=bad)
    with pytest.raises(ValueError, match="max_rows_per_call applies to the static engine"):
        generate(params, config, [[1]], num_samples=1, max_new_tokens=2, rng=key, engine="continuous",
                 max_rows_per_call=4)


def test_config_selects_and_checks_the_engine():
    from jaxrl_llm.run.config import ConfigError
    from jaxrl_llm.train import load_config
    from jaxrl_llm.train.rollouts import engine_options

    assert engine_options(load_config(None, []).sampling) == {}  # the default: static, generate's own default
    chosen = load_config(None, ["sampling.engine=continuous", "sampling.max_slots=6",
                                "sampling.max_prompt_entries=3"]).sampling
    assert engine_options(chosen) == {"engine": "continuous", "max_slots": 6, "max_prompt_entries": 3}
    assert engine_options(load_config(None, ["sampling.engine=continuous"]).sampling)["max_slots"] is None
    for overrides, key in ([["sampling.engine=paged"], "sampling.engine"],
                           [["sampling.engine=continuous", "sampling.max_slots=-1"], "sampling.max_slots"],
                           [["sampling.max_slots=4"], "sampling.max_slots"],
                           [["sampling.max_prompt_entries=4"], "sampling.max_prompt_entries"],
                           [["sampling.engine=continuous", "sampling.max_prompt_entries=-1"],
                            "sampling.max_prompt_entries"],
                           [["sampling.engine=continuous", "sampling.max_rows_per_call=8"], "sampling.max_rows_per_call"]):
        with pytest.raises(ConfigError, match=key):
            load_config(None, overrides)


def scheduled_iterations(lengths, slots: int) -> int:
    """Iterations of the slot loop, from the samples' lengths in queue order: each sample goes to the slot
    that frees first (the lower index on a tie) and holds it for as many iterations as it has tokens."""
    free_at = [0] * slots
    for length in lengths:
        slot = min(range(slots), key=lambda s: (free_at[s], s))
        free_at[slot] += int(length)
    return max(free_at)


def test_scheduled_iterations_hand_values():
    assert scheduled_iterations([5] * 5, 2) == 15  # test_slots_turn_over_with_hand_counted_iterations
    assert scheduled_iterations([1, 6, 2, 2], 2) == 6  # slot 0: 1, 2, 2; slot 1: 6
    assert scheduled_iterations([3, 1], 4) == 3


def test_two_training_steps_log_the_same_metrics_with_both_engines(tmp_path, monkeypatch):
    """The RL loop on a tiny random policy (tests/loop_runner.py): rollouts, update and evaluation agree.
    The continuous run's rows add the slot occupancy of each step's (and evaluation's) sampler calls."""
    import importlib
    import json

    from loop_runner import TINY_RUN, tiny_policy

    from jaxrl_llm.plot import SCHEDULE
    from jaxrl_llm.train import load_config
    from jaxrl_llm.train.loop import train

    generate_module = importlib.import_module("jaxrl_llm.sampling.generate")  # the package's `generate` is the function
    calls, lengths = [], []
    original = generate_module.generate_slots

    def counted(*args, **kwargs):
        calls.append(kwargs["max_slots"])
        out = original(*args, **kwargs)
        lengths.append(out[2])
        return out

    monkeypatch.setattr(generate_module, "generate_slots", counted)
    rows = {}
    for engine in ("static", "continuous"):
        out = tmp_path / engine
        # top_k=2: the engines are different programs, and over the random policy's ~flat 49k-token distribution
        # f32 rounding could move a draw to a neighbouring token (~1 in 100); between two tokens it would take a
        # draw within ~1e-7 of the boundary, so both runs see the same samples.
        overrides = TINY_RUN + ["train.steps=2", f"train.out_dir={out}", f"sampling.engine={engine}",
                                "sampling.max_new_tokens=8", "sampling.top_k=2"] + (
                                    ["sampling.max_slots=3"] if engine == "continuous" else [])
        assert train(load_config(None, overrides), policy=tiny_policy(), log=lambda *a, **k: None)["status"] == "done"
        lines = (out / "metrics.jsonl").read_text().splitlines()
        rows[engine] = [{k: v for k, v in json.loads(line).items()
                         if not k.startswith(("time_", "tokens_per_s")) and k not in SCHEDULE}  # clock readings
                        for line in lines]
        if engine == "static":
            assert calls == []
    assert calls and set(calls) == {3}  # both training steps and the evaluations used the continuous engine
    assert [r["step"] for r in rows["static"]] == [0, 1, 2, 2] and rows["static"][1]["samples_drawn"] == 4
    # sampler calls: the evaluation before, step 1, step 2, the evaluation after (as many as before)
    evals = (len(lengths) - 2) // 2
    assert evals >= 1 and len(lengths) == 2 * evals + 2
    groups = [lengths[:evals], lengths[evals:evals + 1], lengths[evals + 1:evals + 2], lengths[evals + 2:]]
    expected = []
    for group in groups:  # 3 slots (max_slots 3 <= the 4 samples of a call); useful slot-steps = sampled tokens
        useful = sum(int(np.sum(x)) for x in group)
        expected.append(useful / sum(3 * scheduled_iterations(x, 3) for x in group))
    assert sum(int(np.sum(x)) for x in groups[1]) == rows["continuous"][1]["response_length"] * 4
    occupancy = [rows["continuous"][0].pop("eval_slot_occupancy"), rows["continuous"][1].pop("sampling_slot_occupancy"),
                 rows["continuous"][2].pop("sampling_slot_occupancy"), rows["continuous"][3].pop("eval_slot_occupancy")]
    assert occupancy == pytest.approx(expected) and all(0 < x <= 1 for x in occupancy)
    # The same metrics to f32 rounding: the old log-probs come from the sampler, whose programs differ by engine,
    # and pass through the ratio into the loss and gradient (relative ~1e-6).
    assert len(rows["continuous"]) == len(rows["static"])
    for continuous_row, static_row in zip(rows["continuous"], rows["static"]):
        assert continuous_row == pytest.approx(static_row, rel=1e-5, abs=1e-9), (continuous_row, static_row)


@pytest.mark.parametrize("window", [None, 4])
def test_decode_step_with_per_row_steps_and_shared_prompt_cache_matches_forward(window):
    """Rows at different token steps (row 1 lags 3 steps behind row 0) reading prompt-cache entries 2 and 0 of 3:
    every step's logits equal the full forward pass at position prompt_length + step (window 4: a ring of 4
    response slots on every layer, wrapped around by 9 steps)."""
    import jax.numpy as jnp

    from jaxrl_llm.models import forward
    from jaxrl_llm.sampling.decoder import RowCache, decode_step, empty_row_cache, prefill_cache, unstack_layers

    extra = {} if window is None else dict(model_type="mistral", sliding_window=window, tie_word_embeddings=False)
    config, params = _tiny(**extra)
    lengths = np.array([5, 2, 7], np.int32)
    sequences = np.random.default_rng(0).integers(0, VOCAB, size=(3, 7 + 9)).astype(np.int32)
    prompts = np.where(np.arange(8) < lengths[:, None], np.pad(sequences[:, :7], ((0, 0), (0, 1))), 0)
    _, keys, values = prefill_cache(params, config, jnp.asarray(prompts), jnp.asarray(lengths))
    rows = np.array([2, 0], np.int32)  # row b continues prompt rows[b]
    empty = empty_row_cache(config, 2, 1, 16)
    cache = RowCache(tuple(keys), tuple(values), empty.response_k, empty.response_v)
    layers = unstack_layers(params)
    step_fn = jax.jit(lambda c, tok, s: decode_step(params, layers, config, tok, jnp.asarray(lengths[rows]), s, c,
                                                    prompt_rows=jnp.asarray(rows)))
    reference = np.asarray(forward(params, config, jnp.asarray(sequences), jnp.arange(16)[None]))
    for t in range(9):
        steps = np.array([t, max(t - 3, 0)], np.int32)  # row 1 redoes step 0 three times: same token, same slot
        fed = sequences[rows, lengths[rows] + steps]
        logits, cache = step_fn(cache, jnp.asarray(fed), jnp.asarray(steps))
        want = reference[rows, lengths[rows] + steps]
        np.testing.assert_allclose(np.asarray(logits), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 4])
def test_prefill_layers_matches_the_scanned_prefill_and_the_forward(window):
    """The continuous engine's layer-by-layer prefill (per-layer weights, per-layer outputs) gives the scanned
    prefill's keys and values to f32 rounding, and both give the full forward's logits at each prompt's last
    position (window 4: the sliding layers of a Mistral config mask keys 4 or more positions back)."""
    import jax.numpy as jnp

    from jaxrl_llm.models import forward
    from jaxrl_llm.sampling.decoder import prefill_cache, prefill_layers, unstack_layers

    extra = {} if window is None else dict(model_type="mistral", sliding_window=window, tie_word_embeddings=False)
    config, params = _tiny(**extra)
    lengths = np.array([5, 2, 7], np.int32)
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=(3, 8)).astype(np.int32)
    tokens = np.where(np.arange(8) < lengths[:, None], tokens, 0)
    logits, keys, values = jax.jit(prefill_cache, static_argnums=1)(params, config, jnp.asarray(tokens),
                                                                   jnp.asarray(lengths))
    per_layer = jax.jit(lambda p, t, n: prefill_layers(p, unstack_layers(p), config, t, n))
    logits_l, keys_l, values_l = per_layer(params, jnp.asarray(tokens), jnp.asarray(lengths))
    assert len(keys_l) == len(values_l) == config.num_layers
    # A loop over layers and a scan over them are different programs: equal to f32 rounding, not bitwise.
    for i in range(config.num_layers):
        # slots >= a prompt's length hold padding that is never attended: compare the prompt slots
        for row, n in enumerate(lengths):
            np.testing.assert_allclose(np.asarray(keys_l[i])[row, ..., :n], np.asarray(keys[i])[row, ..., :n],
                                       rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(np.asarray(values_l[i])[row, :, :n], np.asarray(values[i])[row, :, :n],
                                       rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(logits_l), np.asarray(logits), rtol=1e-6, atol=1e-6)
    reference = np.asarray(forward(params, config, jnp.asarray(tokens), jnp.arange(8)[None]))
    np.testing.assert_allclose(np.asarray(logits_l), reference[np.arange(3), lengths - 1], atol=1e-5, rtol=0)


MESH_SCRIPT = """
import json
import jax
import numpy as np
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.models.sharding import make_mesh
from jaxrl_llm.sampling import generate

assert jax.device_count() == 8, jax.devices()
config = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, tie_word_embeddings=False, max_position_embeddings=256)
params = init_params(config, jax.random.key(0))
params["embed"] = params["embed"] * 3.0
params["lm_head"] = params["lm_head"] * 3.0
mesh = make_mesh("data=2,fsdp=2,tensor=2")
prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13]]
kwargs = dict(num_samples=[3, 0, 5, 2], max_new_tokens=12, stop_ids=(5,), rng=jax.random.key(3), temperature=0.8,
              top_k=8, top_p=0.9)
single = generate(params, config, prompts, **kwargs)
multi = generate(params, config, prompts, mesh=mesh, engine="continuous", max_slots=3, **kwargs)
print("RESULT", json.dumps(dict(
    tokens_equal=bool(np.array_equal(single.tokens, multi.tokens)),
    lengths=single.lengths.tolist(), lengths_equal=bool(np.array_equal(single.lengths, multi.lengths)),
    finish_equal=bool(np.array_equal(single.finish_reason, multi.finish_reason)),
    logprob_diff=float(np.abs(single.logprobs - multi.logprobs).max()))))
"""


def test_mesh_continuous_equals_single_device_static():
    """On a simulated 8-device mesh (data=2, fsdp=2, tensor=2: 4 slots, split over data x fsdp)."""
    from simulated_mesh import run_on_devices

    result = run_on_devices(["-c", MESH_SCRIPT])
    # Log-probs to rounding; tokens exactly, as in assert_same_rollout (32 tokens, top-k 8, ~120 draws).
    assert result["tokens_equal"] and result["lengths_equal"] and result["finish_equal"], result
    assert result["logprob_diff"] < 1e-5 and min(result["lengths"]) < 12, result


def test_slot_loop_updates_the_prompt_cache_in_place(tiny, monkeypatch):
    """The compiled slot loop copies no prompt-cache buffer: prefill writes the cache before the step's attention
    reads it. (In the other order XLA copied every layer's cache twice per iteration; 1.9 GB at 64 slots of
    SmolLM2-135M.) Checked on the compiled program's text, which names each copy with its shape."""
    import re

    import jaxrl_llm.sampling.continuous as continuous

    config, params = tiny
    calls = []
    real = continuous.decode_slots

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(continuous, "decode_slots", spy)
    generate(params, config, PROMPTS, num_samples=COUNTS, max_new_tokens=6, rng=jax.random.key(0), engine="continuous",
             max_slots=3)
    (args, kwargs), = calls
    keys, values = args[3].keys[0], args[3].values[0]
    assert keys.shape != values.shape  # [E, KV, d, P] and [E, KV, P, d]: each found by its own shape
    args = (args[0], args[1], args[2], continuous.empty_prompt_cache(config, keys.shape[0], keys.shape[-1])) + args[4:]
    text = real.lower(*args, **kwargs).compile().as_text()
    shapes = {"f32[" + ",".join(map(str, a.shape)) + "]" for a in (keys, values)}
    copies, computation = [], None
    for line in text.splitlines():  # a computation opens at column 0; fused ones are one kernel's body, not copies
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            computation = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
        found = re.search(r"= (\w+\[[\d,]*\])\{[\d,]*\} copy\(", line)
        if found and found.group(1) in shapes and not computation.startswith("fused"):
            copies.append((computation, found.group(1)))
    assert re.search(r"while\(", text) and copies == []


def test_default_slots_are_one_per_sample_bucketed():
    from jaxrl_llm.sampling.continuous import default_slots

    # None or 0: the samples rounded up to the row bucket (powers of two from 4 on); else the given count
    assert [default_slots(n, None) for n in (1, 3, 5, 9, 16, 17, 64, 100)] == [1, 4, 8, 16, 16, 32, 64, 128]
    assert default_slots(100, 0) == 128 and default_slots(100, 7) == 7


MOE_MESH_SCRIPT = """
import importlib.util
import json
import pathlib

import jax
import numpy as np

from jaxrl_llm.models.sharding import make_mesh, shard_params
from jaxrl_llm.sampling import continuous, generate
from jaxrl_llm.train.rollouts import ScoredRollouts

assert jax.device_count() == 8, jax.devices()
spec = importlib.util.spec_from_file_location("sampler_gap", pathlib.Path("benchmarks/sampler_gap.py"))
gap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gap)
(config, params), _ = gap.tiny_moe()
prompts = gap.MOE_PROMPTS[:3]  # tests/test_routing_replay.py's continuous call: 12 samples of 3 prompts, 10 tokens
kwargs = dict(num_samples=4, max_new_tokens=10, temperature=1.0, rng=jax.random.key(1), engine="continuous",
              max_slots=5)
specs, decode_slots = [], continuous.decode_slots


def spy(*args, **kw):  # the final state's layout: where the routes lived in the loop
    state = decode_slots(*args, **kw)
    specs.append([str(getattr(x.sharding, "spec", None)) for x in (state.routes, state.prompt_routes)])
    return state


continuous.decode_slots = spy
single = generate(params, config, prompts, **kwargs)
results = {}
for name in ("data=2,fsdp=4", "data=2,fsdp=2,expert=2"):
    mesh = make_mesh(name)
    multi = generate(shard_params(params, mesh), config, prompts, mesh=mesh, **kwargs)
    rows = len(multi.lengths)
    scored = ScoredRollouts(records=[{"prompt_ids": p, "answer": ""} for p in prompts], prompt_index=multi.prompt_index,
                            tokens=multi.tokens, mask=multi.mask, logprobs=multi.logprobs, lengths=multi.lengths,
                            rewards=np.zeros(rows, np.float32), correct=np.zeros(rows, bool), routes=multi.routes,
                            prompt_routes=multi.prompt_routes)
    trainer = gap.trainer_gap(params, config, scored, "none")  # the trainer's own top k on the mesh's rollout
    results[name] = dict(
        tokens_equal=bool(np.array_equal(single.tokens, multi.tokens)),
        routes_equal=bool(np.array_equal(single.routes, multi.routes)),
        prompt_routes_equal=bool(np.array_equal(single.prompt_routes, multi.prompt_routes)),
        recorded=int((multi.routes[..., 0] >= 0).sum() + (multi.prompt_routes[..., 0] >= 0).sum()),
        fed=int(np.maximum(multi.lengths - 1, 0).sum()), prompt_tokens=int(sum(len(p) for p in prompts)) * 4,
        logprob_diff=float(np.abs(single.logprobs - multi.logprobs).max()),
        routes_own_changed=trainer["routes_own_changed"], routes_recorded=trainer["routes_recorded"],
        specs=specs[-1])
print("RESULT", json.dumps(results))
"""


def test_mesh_continuous_routes_equal_single_device_and_the_trainers():
    """A mixture of experts on simulated 8-device meshes (data x fsdp, and one with an expert axis: experts split
    over it): the continuous engine's tokens and recorded routes (prompt and fed tokens) are the single device's,
    the trainer's own top k on the sampled sequences chooses every recorded route again, and the routes lived split
    over the row axes (sample rows, queue prompts) rather than whole on every device."""
    from simulated_mesh import run_on_devices

    results = run_on_devices(["-c", MOE_MESH_SCRIPT])
    for name, r in results.items():
        rows = "('data', 'fsdp')" if "expert" not in name else "('data', 'fsdp', 'expert')"
        assert r["specs"] == [f"P({rows},)", f"P({rows},)"], (name, r)
        assert r["tokens_equal"] and r["routes_equal"] and r["prompt_routes_equal"], (name, r)
        # one route per (token, layer) of 2 sparse layers: every fed token and every prompt token of the 12 samples
        assert r["recorded"] == 2 * (r["fed"] + r["prompt_tokens"]) and r["fed"] > 0, (name, r)
        assert r["routes_own_changed"] == 0 and r["routes_recorded"] > 0, (name, r)
        assert r["logprob_diff"] < 5e-5, (name, r)
