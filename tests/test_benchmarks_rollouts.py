"""The rollout and RL-step benchmarks' counting helpers, against hand counts."""

import importlib.util
import pathlib

import numpy as np
import pytest

_DIR = pathlib.Path(__file__).parent.parent / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"{name}_bench", _DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rollouts = _load("rollouts")
rl_step = _load("rl_step")


def test_useful_lengths_counts_through_the_first_stop():
    tokens = np.array([[5, 2, 7, 7],    # stop at index 1 -> 2 tokens
                       [5, 6, 7, 8],    # no stop -> the full width, 4
                       [0, 2, 2, 2],    # the first token is a stop id -> 1
                       [9, 9, 9, 2]])   # stop as the last token -> 4
    assert rollouts.useful_lengths(tokens, (2, 0)).tolist() == [2, 4, 1, 4]


def test_lengths_before_stop_adds_the_stop_token():
    # tunix cuts its output before the first stop id: 3 kept of 8 -> 4 useful; 8 kept -> no stop, 8; 7 -> 8.
    assert rollouts.lengths_before_stop([3, 8, 0, 7], 8).tolist() == [4, 8, 1, 8]


def test_batches():
    assert rollouts.batches(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert rollouts.batches(4, 8) == [(0, 4)]


def test_slot_steps_and_occupancy_hand_count():
    # call 1: 4 rows (bucket), lengths 3, 5 and two padding rows -> 4 x 5 = 20 slots;
    # call 2: 4 rows, lengths 2, 2, 1, 4 -> 4 x 4 = 16 slots. Useful 3 + 5 + 2 + 2 + 1 + 4 = 17.
    calls = [np.array([3, 5]), np.array([2, 2, 1, 4])]
    assert rollouts.slot_steps(calls, [4, 4]) == 36
    assert rollouts.occupancy(17, 36) == pytest.approx(17 / 36)
    assert rollouts.occupancy(0, 0) == 0.0


def test_slot_steps_rejects_more_lengths_than_rows():
    with pytest.raises(ValueError):
        rollouts.slot_steps([np.array([1, 2, 3])], [2])
    with pytest.raises(ValueError):
        rollouts.slot_steps([np.array([1])], [2, 2])


def test_summary_figures():
    calls = [np.array([3, 5]), np.array([2, 2])]
    result = rollouts.summary("x", np.array([3, 5, 2, 2]), calls, [2, 2], [4.0, 2.0, 3.0])
    assert result["useful_tokens"] == 12 and result["slot_steps"] == 14
    assert result["seconds"] == 3.0 and result["useful_tok_s"] == 4.0
    assert result["mean_length"] == 3.0 and result["max_length"] == 5 and result["calls"] == 2


def test_summary_takes_the_continuous_engines_slot_steps():
    # 4 rows of lengths 3, 5, 2, 2 on 2 slots for 7 iterations: 12 useful of 14 slot-steps.
    result = rollouts.summary("c", np.array([3, 5, 2, 2]), [np.array([3, 5, 2, 2])], [2], [2.0],
                              decoded_slot_steps=14)
    assert result["slot_steps"] == 14 and result["occupancy"] == pytest.approx(12 / 14)


def test_parse_engines():
    assert rollouts.parse_engines("static,continuous") == ["static", "continuous"]
    assert rollouts.parse_engines(" continuous ") == ["continuous"]
    for bad in ("", "static,static", "static,dynamic"):
        with pytest.raises(ValueError):
            rollouts.parse_engines(bad)


def test_same_tokens_ignores_what_follows_a_rows_end():
    from jaxrl_llm.sampling import Rollout

    def rollout(tokens, lengths):
        tokens, lengths = np.array(tokens), np.array(lengths)
        mask = (np.arange(tokens.shape[1])[None] < lengths[:, None]).astype(np.float32)
        return Rollout(np.zeros(len(lengths), np.int32), tokens, mask, np.zeros(tokens.shape, np.float32), lengths,
                       np.zeros(len(lengths), np.int32))

    a = rollout([[4, 2, 9], [5, 6, 7]], [2, 3])
    assert rollouts.same_tokens(a, rollout([[4, 2, 0], [5, 6, 7]], [2, 3]))
    assert not rollouts.same_tokens(a, rollout([[4, 3, 0], [5, 6, 7]], [2, 3]))
    assert not rollouts.same_tokens(a, rollout([[4, 2, 9], [5, 6, 7]], [3, 3]))
    assert rollouts.first_difference(a, rollout([[4, 2, 0], [5, 6, 7]], [2, 3])) is None
    assert rollouts.first_difference(a, rollout([[4, 2, 0], [5, 8, 7]], [2, 3])) == (1, 1)
    assert rollouts.first_difference(a, rollout([[4, 2, 9], [5, 6, 7]], [3, 3])) == (0, 2)  # row 0 goes on


def test_both_engines_on_a_toy_workload():
    """run_ours with a tiny random model: the engines draw the same tokens; the static engine's slot-steps
    counted here equal generate's SlotStats; the continuous engine's occupancy is at least the static one's."""
    import types

    import jax

    from jaxrl_llm.models import ModelConfig, init_params

    config = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, tie_word_embeddings=True, max_position_embeddings=128)
    params = init_params(config, jax.random.key(0))
    tokenizer = types.SimpleNamespace(stop_ids=(3, 5), pad_token_id=0)
    prompts = [[1, 2, 4], [6, 7], [8, 9, 10, 11], [12]]
    out = {engine: rollouts.run_ours(params, config, tokenizer, prompts, 3, 12, 4, 1, engine=engine)
           for engine in rollouts.ENGINES}
    static, continuous = out["static"], out["continuous"]
    assert rollouts.same_tokens(static["rollout"], continuous["rollout"])  # 4 slots = the static row bucket
    assert static["sampler"] == "jaxrl_llm" and continuous["sampler"] == "jaxrl_llm continuous"
    assert static["slot_steps"] == static["generate_slot_steps"] and static["calls"] == 3
    assert continuous["slot_steps"] == continuous["slots"] * continuous["iterations"] and continuous["slots"] == 4
    assert static["useful_tokens"] == continuous["useful_tokens"] == int(static["rollout"].lengths.sum())
    assert 0 < static["occupancy"] <= continuous["occupancy"] <= 1
    assert static["compiles_in_timed_runs"] == 0 and continuous["compiles_in_timed_runs"] == 0


def test_replay_slots_hand_counts():
    """Counted by hand. Five samples of 5 tokens on 2 slots: rounds of 5 iterations, 15 in all (the engine's
    own hand count in test_sampling_continuous). Prompt A's samples of 4 and 1 tokens, then B's two of 1, on
    2 slots, one prompt per prefill: with 2 entries B is prefilled when A's short sample ends (iteration 1)
    and its samples run beside A's long one (4 iterations); with 1 entry B waits for A's last sample (4)
    and runs at iteration 5."""
    assert rollouts.replay_slots([5] * 5, [3, 2], slots=2, prefill_chunk=2, entries=2) == 15
    assert rollouts.replay_slots([4, 1, 1, 1], [2, 2], slots=2, prefill_chunk=1, entries=2) == 4
    assert rollouts.replay_slots([4, 1, 1, 1], [2, 2], slots=2, prefill_chunk=1, entries=1) == 5
    assert rollouts.replay_slots([1, 3, 2], [3], slots=2, prefill_chunk=1, entries=1) == 3
    with pytest.raises(ValueError, match="positive lengths"):
        rollouts.replay_slots([1, 2], [3], slots=2, prefill_chunk=1, entries=1)
    with pytest.raises(ValueError, match="multiple of the prefill chunk"):
        rollouts.replay_slots([1, 2], [2], slots=2, prefill_chunk=2, entries=3)


@pytest.mark.parametrize("max_slots,max_entries", [(2, 0), (3, 0), (3, 1), (5, 2), (16, 0)])
def test_replay_slots_equals_the_engines_iterations(max_slots, max_entries):
    """The continuous engine itself (a tiny random model, 12 prompts with 1-4 samples, one prompt per prefill,
    rows ending at a stop id at different times) runs exactly the replayed number of loop iterations."""
    import jax

    from jaxrl_llm.models import ModelConfig, init_params
    from jaxrl_llm.sampling import generate, make_plan
    from jaxrl_llm.sampling.continuous import prompt_entries, slot_count

    config = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, tie_word_embeddings=True, max_position_embeddings=128)
    params = init_params(config, jax.random.key(0))
    params["embed"] = params["embed"] * 3.0
    prompts = [[(3 * i + j) % 20 + 1 for j in range(1 + (5 * i) % 13)] for i in range(12)]
    counts = [2, 1, 1, 3, 4, 1, 2, 2, 1, 3, 1, 2]
    rollout, stats = generate(params, config, prompts, num_samples=counts, max_new_tokens=9, temperature=1.0,
                              rng=jax.random.key(5), stop_ids=(7, 11), engine="continuous", max_slots=max_slots,
                              max_prompt_entries=max_entries, prefill_tokens_per_call=16, return_stats=True)
    assert 1 <= rollout.lengths.min() < rollout.lengths.max() == 9
    plan = make_plan(np.array([len(p) for p in prompts]), np.array(counts), 9, prefill_tokens_per_call=16)
    slots = slot_count(max_slots, plan.num_rows)
    entries = prompt_entries(len(counts), slots, plan.prompts_per_prefill, max_entries)
    assert plan.prompts_per_prefill == 1 and stats.slots == slots
    assert rollouts.replay_slots(rollout.lengths, counts, slots, 1, entries) == stats.iterations


def test_replay_occupancy_uses_the_engines_chunk_and_entries():
    """64 prompts of up to 200 tokens (bucket 256: c = 4096 / 256 = 16 prompts per prefill) x 2 samples of 4
    tokens on 64 slots. By default the cache has 64 entries (the prompts' bucket, under slots + c = 80): two
    waves of 32 prompts fill every slot, 8 iterations, occupancy 100%. Caps of 16 and 8 entries both round to
    one chunk of 16 prompts = 32 samples, so half the slots wait: four waves, 16 iterations, 50%."""
    out = rollouts.replay_occupancy([4] * 128, 2, [200] + [50] * 63, [64], [0, 16, 8])
    # the caps of 16 and 8 give the same 16 entries: one row for both
    assert [(r["slots"], r["entry_caps"], r["entries"], r["prefill_chunk"]) for r in out] == [
        (64, [0], 64, 16), (64, [16, 8], 16, 16)]
    assert [r["iterations"] for r in out] == [8, 16]
    assert [r["occupancy"] for r in out] == [1.0, 0.5]
    assert out[1]["slot_steps"] == 16 * 64
    # 128 slots on 128 samples: the engine's 128 slots; 256 is capped to the same 128, replayed once
    capped = rollouts.replay_occupancy([4] * 128, 2, [200] + [50] * 63, [64, 128, 256], [0])
    assert [(r["slots"], r["iterations"]) for r in capped] == [(64, 8), (128, 4)]


def test_parse_ints():
    assert rollouts.parse_ints("64, 128", "--x", 1) == [64, 128]
    for bad in ("", "a", "0", "4,-1"):
        with pytest.raises(ValueError, match="--x takes comma-separated ints >= 1"):
            rollouts.parse_ints(bad, "--x", 1)


def test_median_split_leaves_out_the_compiling_step():
    steps = [dict(wall_s=30.0, sample_s=20.0, score_s=1.0, train_s=9.0),
             dict(wall_s=4.0, sample_s=2.0, score_s=0.5, train_s=1.5),
             dict(wall_s=6.0, sample_s=3.0, score_s=0.5, train_s=2.5),
             dict(wall_s=5.0, sample_s=1.0, score_s=1.5, train_s=2.5)]
    assert rl_step.median_split(steps) == dict(wall_s=5.0, sample_s=2.0, score_s=0.5, train_s=2.5)
    assert rl_step.median_split(steps[:1]) == dict(wall_s=30.0, sample_s=20.0, score_s=1.0, train_s=9.0)


def test_compile_counter_counts_backend_compiles():
    import jax

    with rl_step.CompileCounter() as counter:
        f = jax.jit(lambda x: x * 3 + 1)  # host arrays in: no other program (jnp.ones would compile one)
        f(np.ones(7, np.float32)).block_until_ready()
        f(np.ones(7, np.float32)).block_until_ready()  # cached: no new compile
        first = counter.count
        f(np.ones(9, np.float32)).block_until_ready()  # a new shape compiles again
    assert first >= 1 and counter.count == first + 1
    f(np.ones(11, np.float32)).block_until_ready()  # after exit the listener is gone
    assert counter.count == first + 1


decode_step_bench = _load("decode_step")


def test_decode_step_variants_compute_the_same_logits():
    """The data flows of benchmarks/decode_step.py (static step, static step over response tiles, both with one
    prompt entry per 2 rows, per-row steps, per-row steps reading a shared prompt cache) are the same computation:
    equal logits after 3 steps of a 2-layer GQA model (the tiled ones crossing from their second tile of 4 slots
    into the third)."""
    import jax

    from jaxrl_llm.models import ModelConfig, init_params

    config = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, tie_word_embeddings=True, max_position_embeddings=128)
    params = init_params(config, jax.random.key(0))
    inputs = decode_step_bench.make_inputs(config, rows=6, entries=2, prompt_bucket=16, new_token_bucket=16, group=2)
    (shared_k, shared_v), (own_k, own_v), (response_k, response_v), lengths, tokens, row_entry, grouped = inputs
    assert row_entry.tolist() == [0, 0, 1, 1, 0, 0]
    np.testing.assert_array_equal(own_k[1][4], shared_k[1][0])  # row 4 holds entry 0's keys
    np.testing.assert_array_equal(grouped[0][1][1], shared_k[1][1])  # the grouped cache's entry 1: rows 2 and 3
    assert grouped[0][0].shape[0] == 3 and lengths[0] == lengths[1] and lengths[2] == lengths[3]
    logits = {}
    for variant in decode_step_bench.VARIANTS:
        prompt_k, prompt_v = decode_step_bench.prompt_cache(variant, (shared_k, shared_v), (own_k, own_v), grouped)
        keys, values = response_k, response_v
        if variant.endswith("tiled"):
            keys, values = decode_step_bench.split_tiles(keys, 4, 3), decode_step_bench.split_tiles(values, 4, 2)
            assert len(keys[0]) == 4 and keys[0][1].shape[-1] == 4
        logits[variant] = np.asarray(decode_step_bench.run_steps(
            params, config, variant, prompt_k, prompt_v, keys, values, lengths, tokens, row_entry,
            jax.numpy.int32(6), steps=3))
    assert np.abs(logits["static"]).max() > 0.1 and np.isfinite(logits["static"]).all()
    np.testing.assert_allclose(logits["tiled"], logits["static"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits["per_row"], logits["static"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits["shared"], logits["static"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits["shared_tiled"], logits["static"], atol=1e-5, rtol=0)
    # The same sums, one product per group: a differently shaped program, so to f32 rounding, not bitwise
    np.testing.assert_allclose(logits["grouped"], logits["static"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(logits["grouped_tiled"], logits["static"], atol=1e-5, rtol=0)


def test_decode_step_bytes_hand_values():
    from jaxrl_llm.models import ModelConfig

    config = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8)
    # per cached token: 2 (k, v) x 2 layers x 2 KV heads x 8 dims x 4 bytes = 256 bytes
    static = decode_step_bench.step_bytes(config, 1000, rows=3, prompt_bucket=16, new_token_bucket=32,
                                          variant="static")
    assert static == dict(weights=1000, prompt=3 * 16 * 256, response=3 * 32 * 256, gather=0)
    shared = decode_step_bench.step_bytes(config, 1000, rows=3, prompt_bucket=16, new_token_bucket=32,
                                          variant="shared")
    assert shared["gather"] == 2 * 3 * 16 * 256 and shared["prompt"] == static["prompt"]
    tiled = decode_step_bench.step_bytes(config, 1000, rows=3, prompt_bucket=16, new_token_bucket=32,
                                         variant="tiled", response_slots_read=8)
    assert tiled == dict(weights=1000, prompt=3 * 16 * 256, response=3 * 8 * 256, gather=0)
    grouped = decode_step_bench.step_bytes(config, 1000, rows=4, prompt_bucket=16, new_token_bucket=32,
                                           variant="grouped_tiled", response_slots_read=8, group=2)
    assert grouped == dict(weights=1000, prompt=2 * 16 * 256, response=4 * 8 * 256, gather=0)


def test_weight_size_counts_every_leaf_at_its_dtype():
    import jax.numpy as jnp

    sampling_bench = _load("sampling")
    params = {"a": jnp.zeros((3, 4), jnp.float32), "b": [jnp.zeros(5, jnp.bfloat16), jnp.zeros((2, 2), jnp.int8)]}
    assert sampling_bench.weight_size(params) == (12 + 5 + 4, 12 * 4 + 5 * 2 + 4 * 1)
