"""jaxrl_llm.sampling: token selection, bucketing, and generate() checked against independent
NumPy computations and a teacher-forced `forward` pass (tiny models, CPU, a few seconds each)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import tiny_sampler_model

from jaxrl_llm.models import forward
from jaxrl_llm.sampling import (
    FINISH_LENGTH,
    FINISH_STOP,
    bucket_size,
    generate,
    inverse_cdf_sample,
    make_plan,
    nucleus_mask,
    select_tokens,
)

VOCAB = 24


@pytest.fixture(scope="module")
def tiny():
    """A 2-layer GQA model whose logits spread over a few nats (largest next-token probability ~0.2)."""
    return tiny_sampler_model(VOCAB)


def teacher_forced_logprobs(params, config, prompts, rollout):
    """log_softmax(forward(prompt + response)) at each response token, one batched forward pass."""
    seqs = [list(prompts[p]) + list(rollout.tokens[r, : rollout.lengths[r]]) for r, p in enumerate(rollout.prompt_index)]
    width = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), width), np.int32)
    for r, s in enumerate(seqs):
        tokens[r, : len(s)] = s
    positions = np.broadcast_to(np.arange(width), tokens.shape)
    logp = np.asarray(jax.nn.log_softmax(forward(params, config, jnp.asarray(tokens), jnp.asarray(positions)), -1))
    out = np.zeros(rollout.tokens.shape, np.float32)
    for r, p in enumerate(rollout.prompt_index):
        start = len(prompts[p]) - 1
        for t in range(rollout.lengths[r]):
            out[r, t] = logp[r, start + t, rollout.tokens[r, t]]
    return out, logp


def test_bucket_size_hand_values():
    assert [bucket_size(n, minimum=16) for n in (1, 5, 16, 17, 200, 256, 257, 700)] == \
        [16, 16, 16, 32, 256, 256, 512, 768]
    assert [bucket_size(n) for n in (0, 1, 3, 5, 64, 65)] == [1, 1, 4, 8, 64, 128]


def test_make_plan_rows_and_prefill_chunks():
    plan = make_plan(np.array([3, 40, 7]), np.array([2, 0, 3]), 20, prefill_tokens_per_call=64)
    assert plan.row_prompt.tolist() == [0, 0, 2, 2, 2]
    assert plan.prefill_prompts.tolist() == [0, 2]
    assert (plan.num_rows, plan.row_bucket, plan.prompt_bucket, plan.new_token_bucket) == (5, 8, 16, 32)
    assert plan.prompts_per_prefill == 2  # 64 tokens / 16 per prompt = 4, capped by 2 active prompts
    assert make_plan(np.array([3] * 9), np.ones(9, int), 5, row_multiple=8).row_bucket == 16


def test_inverse_cdf_matches_numpy_and_skips_zero_weights():
    rng = np.random.default_rng(0)
    for n in (7, 256, 1000):  # one-level and two-level (blocked) paths
        weights = rng.random((64, n)).astype(np.float32)
        weights[:, ::3] = 0.0
        uniform = rng.random(64).astype(np.float32)
        uniform[:4] = [0.0, 0.9999999, 0.5, 1e-7]
        got = np.asarray(inverse_cdf_sample(jnp.asarray(weights), jnp.asarray(uniform)))
        cum = np.cumsum(weights.astype(np.float64), axis=1)
        want = np.array([np.searchsorted(c, u * c[-1], side="right") for c, u in zip(cum, uniform)])
        assert (weights[np.arange(64), got] > 0).all()
        # float32 cumulative sums may move a draw lying within rounding of a boundary by one token
        assert np.mean(got == want) > 0.95 and np.all(np.abs(got - want) <= 3)


def test_nucleus_mask_hand_example():
    probs = jnp.array([[0.5, 0.3, 0.1, 0.1]])
    assert np.asarray(nucleus_mask(probs, 0.7)).tolist() == [[True, True, False, False]]
    assert np.asarray(nucleus_mask(probs, 0.85)).tolist() == [[True, True, True, False]]
    assert np.asarray(nucleus_mask(probs, 0.3)).tolist() == [[True, False, False, False]]
    assert np.asarray(nucleus_mask(probs * 4, 0.85)).tolist() == [[True, True, True, False]]  # unnormalised


def test_selection_settings_from_host_values():
    from jaxrl_llm.sampling.token_selection import selection_settings

    # temperature 0: greedy, no top-k or nucleus pass, a traced temperature of 1 (never divided by 0)
    temperature, top_p, static = selection_settings(0.0, 0.9, 5)
    assert (float(temperature), float(top_p)) == (1.0, np.float32(0.9))
    assert static == {"greedy": True, "top_k": 0, "use_top_p": False}
    temperature, top_p, static = selection_settings(0.7, 0.9, 5)
    assert float(temperature) == np.float32(0.7) and temperature.dtype == jnp.float32
    assert static == {"greedy": False, "top_k": 5, "use_top_p": True}
    assert selection_settings(1.0, 1.0, 0)[2] == {"greedy": False, "top_k": 0, "use_top_p": False}  # no nucleus


def test_select_tokens_greedy_and_logprob():
    logits = jnp.array([[0.1, 2.0, -1.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
    tokens, logprobs = select_tokens(logits, jnp.zeros(2), 1.0, 1.0, greedy=True, top_k=0, use_top_p=False)
    assert np.asarray(tokens).tolist() == [1, 0]  # first index on ties
    ref = np.asarray(logits) - np.log(np.exp(np.asarray(logits, np.float64)).sum(1, keepdims=True))
    np.testing.assert_allclose(np.asarray(logprobs), ref[[0, 1], [1, 0]], atol=1e-6)


def test_select_tokens_top_k_with_temperature_logprob_is_raw():
    logits = jnp.array([[1.0, 3.0, 2.0, 0.0]])
    # u = 0.99 draws the last kept token: with top_k = 2 that is token 2, never 0 or 3
    tokens, logprobs = select_tokens(logits, jnp.array([0.99]), 0.5, 1.0, greedy=False, top_k=2, use_top_p=False)
    assert int(tokens[0]) == 2
    raw = np.array([1.0, 3.0, 2.0, 0.0])
    np.testing.assert_allclose(float(logprobs[0]), raw[2] - np.log(np.exp(raw).sum()), atol=1e-6)


def _chi_square_threshold(df: int, z: float = 3.29) -> float:
    """Upper chi-square quantile by the Wilson-Hilferty approximation (z = 3.29: p ~ 5e-4)."""
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_frequencies_match_softmax(tiny, temperature):
    config, params = tiny
    prompt = [3, 7, 1, 12]
    rows = 4000
    out = generate(params, config, [prompt], num_samples=rows, max_new_tokens=1, temperature=temperature,
                   rng=jax.random.key(42))
    logits = np.asarray(forward(params, config, jnp.asarray([prompt]), jnp.arange(4)[None]))[0, -1]
    probs = np.exp((logits - logits.max()) / temperature)
    probs /= probs.sum()
    counts = np.bincount(out.tokens[:, 0], minlength=VOCAB)
    expected = probs * rows
    assert probs.max() < 0.5 and (expected >= 5).sum() >= 8, "the test model should spread its probability"
    big = expected >= 5  # pool rare tokens into one bin, as the chi-square approximation needs
    observed, expect = counts[big], expected[big]
    if (~big).any():
        observed, expect = np.append(observed, counts[~big].sum()), np.append(expect, expected[~big].sum())
    stat = ((observed - expect) ** 2 / expect).sum()
    assert stat < _chi_square_threshold(len(observed) - 1), (stat, observed, expect)


def test_top_k_and_top_p_never_emit_excluded_tokens(tiny):
    config, params = tiny
    prompts = [[3, 7, 1], [5, 5, 9, 2, 11]]
    for top_k, top_p in [(3, 1.0), (0, 0.6), (5, 0.5)]:
        out = generate(params, config, prompts, num_samples=48, max_new_tokens=6, temperature=1.3, top_k=top_k,
                       top_p=top_p, rng=jax.random.key(top_k))
        _, logp = teacher_forced_logprobs(params, config, prompts, out)
        for r, p in enumerate(out.prompt_index):
            for t in range(out.lengths[r]):
                scaled = logp[r, len(prompts[p]) - 1 + t] / 1.3
                order = np.argsort(-scaled, kind="stable")
                rank = int(np.where(order == out.tokens[r, t])[0][0])
                if top_k:
                    assert rank < top_k
                probs = np.exp(scaled[order] - scaled.max())
                if top_k:
                    probs = probs[:top_k]
                probs /= probs.sum()
                mass_before = probs[:rank].sum()
                assert mass_before < top_p + 1e-5, (top_k, top_p, rank, mass_before)


def test_logprobs_equal_teacher_forced_forward(tiny):
    config, params = tiny
    prompts = [[1, 2, 3], list(range(4, 21)), [9], [2, 2]]  # lengths 3, 17 (second bucket), 1, 2
    out = generate(params, config, prompts, num_samples=[2, 3, 0, 1], max_new_tokens=12, temperature=1.0,
                   stop_ids=(4,), rng=jax.random.key(7))
    ref, _ = teacher_forced_logprobs(params, config, prompts, out)
    np.testing.assert_allclose(out.logprobs, ref, atol=1e-5)
    assert out.prompt_index.tolist() == [0, 0, 1, 1, 1, 3]


def test_greedy_equals_argmax_of_forward(tiny):
    config, params = tiny
    prompts = [[1, 2, 3], [8, 6, 4, 2, 0, 1]]
    out = generate(params, config, prompts, num_samples=2, max_new_tokens=10, temperature=0.0,
                   rng=jax.random.key(0))
    width = 16  # right-padded to one width: causal attention makes the padding invisible
    # The cached decode and the full forward are different programs; their argmaxes agree exactly since the top two
    # logits along these paths are >= 0.69 apart, far above f32 rounding.
    logits_at = jax.jit(lambda tokens, last: forward(params, config, tokens, jnp.arange(width)[None])[0, last])
    for r, p in enumerate(out.prompt_index):
        seq = list(prompts[p])
        for t in range(10):
            padded = jnp.asarray([seq + [0] * (width - len(seq))])
            seq.append(int(np.argmax(np.asarray(logits_at(padded, len(seq) - 1)))))
        assert out.tokens[r].tolist() == seq[len(prompts[p]):]
    assert (out.tokens[0] == out.tokens[1]).all()


def test_stop_ids_end_rows_and_mask_after(tiny):
    config, params = tiny
    prompt = [1, 2, 3]
    free = generate(params, config, [prompt], num_samples=1, max_new_tokens=10, temperature=0.0,
                    rng=jax.random.key(0))
    stop = int(free.tokens[0, 3])
    first = int(np.argmax(free.tokens[0] == stop))  # the stop token may already appear earlier
    out = generate(params, config, [prompt, [5, 6]], num_samples=[2, 1], max_new_tokens=10, temperature=0.0,
                   stop_ids=(stop, VOCAB - 1), rng=jax.random.key(0), pad_id=VOCAB - 2)
    assert out.lengths[0] == first + 1 and out.finish_reason[0] == FINISH_STOP
    assert out.finish_reason_names()[0] == "stop"
    # Other rows, other programs: greedy tokens agree exactly, here and below (top-two logit gaps >= 1.1 >> rounding).
    np.testing.assert_array_equal(out.tokens[0, : first + 1], free.tokens[0, : first + 1])
    assert (out.tokens[0, first + 1:] == VOCAB - 2).all()
    assert out.mask[0].tolist() == [1.0] * (first + 1) + [0.0] * (9 - first)
    assert (out.logprobs[0, first + 1:] == 0).all() and (out.logprobs[0, : first + 1] < 0).all()
    np.testing.assert_array_equal(out.mask.sum(1), out.lengths)
    for r in range(3):
        ended = out.finish_reason[r] == FINISH_STOP
        assert ended == (out.tokens[r, out.lengths[r] - 1] in (stop, VOCAB - 1))
        assert ended or (out.lengths[r] == 10 and out.finish_reason[r] == FINISH_LENGTH)
    # Every row ends at its first token: the loop stops after one step, and the columns it never wrote are
    # pad_id as well (not the buffer's initial zeros).
    first_token = int(free.tokens[0, 0])
    short = generate(params, config, [prompt], num_samples=2, max_new_tokens=10, temperature=0.0,
                     stop_ids=(first_token,), rng=jax.random.key(0), pad_id=VOCAB - 2)
    assert short.lengths.tolist() == [1, 1]
    assert short.tokens.tolist() == [[first_token] + [VOCAB - 2] * 9] * 2


def test_num_samples_with_zeros_and_empty(tiny):
    config, params = tiny
    prompts = [[1], [2, 3], [4], [5, 6, 7]]
    out = generate(params, config, prompts, num_samples=[0, 2, 0, 1], max_new_tokens=3, rng=jax.random.key(0))
    assert out.prompt_index.tolist() == [1, 1, 3]
    assert out.tokens.shape == (3, 3) and out.logprobs.shape == (3, 3)
    empty = generate(params, config, prompts, num_samples=0, max_new_tokens=3, rng=jax.random.key(0))
    assert empty.tokens.shape == (0, 3) and empty.prompt_index.shape == (0,)


def test_reproducible_and_independent_of_other_rows(tiny):
    config, params = tiny
    prompts = [[1, 2, 3], [4, 5]]
    a = generate(params, config, prompts, num_samples=[3, 1], max_new_tokens=8, rng=jax.random.key(5))
    b = generate(params, config, prompts, num_samples=[3, 1], max_new_tokens=8, rng=jax.random.key(5))
    c = generate(params, config, prompts + [[6]], num_samples=[3, 1, 9], max_new_tokens=8, rng=jax.random.key(5))
    d = generate(params, config, prompts, num_samples=[3, 1], max_new_tokens=8, rng=jax.random.key(6))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    # 4 rows in a bucket of 4 vs 13 rows in 16: other programs, but each row draws with the same key, so a token
    # moves only if f32 rounding puts its draw within ~1e-6 of a CDF boundary (32 draws over 24 tokens).
    np.testing.assert_array_equal(a.tokens, c.tokens[:4])
    assert not np.array_equal(a.tokens, d.tokens)


def test_new_counts_and_lengths_within_buckets_do_not_recompile(tiny):
    config, params = tiny
    compiles = []

    def on_event(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    def run(counts, lengths, seed):
        prompts = [list(range(1, n + 1)) for n in lengths]
        return generate(params, config, prompts, num_samples=counts, max_new_tokens=5, temperature=0.8,
                        stop_ids=(3,), rng=jax.random.key(seed))

    # Buckets: <= 8 rows, prompts <= 16 tokens, 3-4 prompts with samples (prefilled 4 per call).
    run([3, 1, 2], [4, 9, 2], 0)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        run([1, 2, 3], [5, 3, 16], 1)
        run([0, 4, 1, 2], [7, 7, 7, 1], 2)
        run([4, 0, 1, 1], [2, 3, 4, 11], 3)  # 4 prompts, 3 with samples: still 4 per prefill call
        assert compiles == []
        run([9, 0, 0], [2, 3, 4], 4)  # 9 rows: a new row bucket compiles
        assert compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)


def test_bad_input_raises_clear_errors(tiny):
    config, params = tiny
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="one count per prompt"):
        generate(params, config, [[1], [2]], num_samples=[1], max_new_tokens=2, rng=key)
    with pytest.raises(ValueError, match=">= 0"):
        generate(params, config, [[1]], num_samples=[-1], max_new_tokens=2, rng=key)
    with pytest.raises(ValueError, match="non-empty"):
        generate(params, config, [[]], num_samples=1, max_new_tokens=2, rng=key)
    with pytest.raises(ValueError, match="outside"):
        generate(params, config, [[VOCAB]], num_samples=1, max_new_tokens=2, rng=key)
    with pytest.raises(ValueError, match="top_p"):
        generate(params, config, [[1]], num_samples=1, max_new_tokens=2, top_p=0.0, rng=key)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(params, config, [[1] * 10], num_samples=1, max_new_tokens=510, rng=key)
    with pytest.raises(ValueError, match="stop_ids"):
        generate(params, config, [[1]], num_samples=1, max_new_tokens=2, stop_ids=(VOCAB,), rng=key)
