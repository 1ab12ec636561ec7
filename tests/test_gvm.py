"""GVM in the trainer: per-sample gradient norms, allocation with cap, the two-stage sampling, the loop."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.run.config import ConfigError, SamplingSection, load_config
from jaxrl_llm.train.gvm import (
    allocate_samples,
    stage2_budget,
    cap_counts,
    gvm_rollouts,
    mean_norms,
    parse_param_subset,
    per_sample_grad_norms,
    prompt_grad_norms,
    rank_within_prompt,
    reuse_stage1,
)
from jaxrl_llm.train.rollouts import ScoredRollouts

TINY = models.ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def params():
    return models.init_params(TINY, jax.random.PRNGKey(0))


def _rows(rows=7, prompt=5, resp=6, seed=0):
    """Right-padded (prompt + response) rows; row 3 has an empty response (mask all 0)."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(2, prompt + 1, size=rows)
    resp_lens = rng.integers(1, resp + 1, size=rows)
    resp_lens[3] = 0
    tokens = np.zeros((rows, prompt + resp), np.int32)
    response = rng.integers(1, TINY.vocab_size, size=(rows, resp)).astype(np.int32)
    for i in range(rows):
        tokens[i, :prompt_lens[i]] = rng.integers(1, TINY.vocab_size, size=prompt_lens[i])
        tokens[i, prompt_lens[i]:prompt_lens[i] + resp_lens[i]] = response[i, :resp_lens[i]]
    mask = (np.arange(resp)[None] < resp_lens[:, None]).astype(np.float32)
    return tokens, prompt_lens.astype(np.int32), response, mask, resp_lens


@functools.partial(jax.jit, static_argnums=(1, 2))
def _reference_norm(params, config, paths, tokens, prompt_len, resp_len):
    """|| grad of -sum log pi(response) || for one row alone, from the full-vocabulary forward pass.
    tokens [T] is prompt + response + padding; causal attention keeps the padding out of the sum."""

    def nll(p):
        logits = models.forward(p, config, tokens[None], jnp.arange(tokens.shape[0])[None])[0]
        logp = jax.nn.log_softmax(logits, -1)[:-1]
        picked = jnp.take_along_axis(logp, tokens[1:, None], axis=1)[:, 0]  # log pi(token t+1 | tokens <= t)
        t = jnp.arange(tokens.shape[0] - 1)
        in_response = (t >= prompt_len - 1) & (t < prompt_len - 1 + resp_len)
        return -jnp.sum(jnp.where(in_response, picked, 0.0))

    grads = jax.grad(nll)(params)
    total = 0.0
    for path in paths:
        g = grads
        for key in path:
            g = g[key]
        total += jnp.sum(g.astype(jnp.float32) ** 2)
    return jnp.sqrt(total)


@pytest.mark.parametrize("subset, tied", [("embed", True), (["embed", " lm_head", "layers.q_proj"], False)])
def test_per_sample_grad_norms_equal_single_row_grad(params, subset, tied):
    config = TINY if tied else dataclasses.replace(TINY, tie_word_embeddings=False)
    p = params if tied else models.init_params(config, jax.random.PRNGKey(3))
    tokens, prompt_lens, response, mask, resp_lens = _rows()
    # 7 rows in chunks of 3: two vmapped chunks and a remainder.
    got = per_sample_grad_norms(p, config, tokens, prompt_lens, response, mask, param_subset=subset, rows_per_chunk=3)
    paths = parse_param_subset(subset)
    want = [_reference_norm(p, config, paths, tokens[i], prompt_lens[i], resp_lens[i]) for i in range(len(tokens))]
    assert got.shape == (7,) and got[3] == 0.0 and np.all(got[np.arange(7) != 3] > 0)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)


def test_chunk_size_does_not_change_the_norms(params):
    """Rows per chunk only bounds memory: 1, 2, 4 and 7 rows at a time give the same per-sample norms."""
    tokens, prompt_lens, response, mask, _ = _rows()
    norms = [per_sample_grad_norms(params, TINY, tokens, prompt_lens, response, mask, rows_per_chunk=k)
             for k in (1, 2, 4, 7)]
    assert norms[0][0] > 0
    for other in norms[1:]:
        np.testing.assert_allclose(other, norms[0], rtol=1e-5, atol=0)


def test_param_subset_errors(params):
    tokens, prompt_lens, response, mask, _ = _rows()
    with pytest.raises(KeyError, match=r"'layers/qproj'.*available: \['attn_norm'"):
        per_sample_grad_norms(params, TINY, tokens, prompt_lens, response, mask, param_subset="layers/qproj")
    with pytest.raises(ValueError, match="names no parameter"):
        parse_param_subset(" , ")
    assert parse_param_subset("embed,layers.q_proj") == (("embed",), ("layers", "q_proj"))


def _scored(prompt_index, correct, records=None, resp=4, seed=0):
    rng = np.random.default_rng(seed)
    n = len(prompt_index)
    records = records or [{"prompt_ids": [1, 2, 3 + i], "answer": str(i)} for i in range(max(prompt_index) + 1)]
    lengths = rng.integers(1, resp + 1, size=n).astype(np.int32)
    mask = (np.arange(resp)[None] < lengths[:, None]).astype(np.float32)
    return ScoredRollouts(records=records, prompt_index=np.asarray(prompt_index, np.int32),
                          tokens=rng.integers(1, TINY.vocab_size, size=(n, resp)).astype(np.int32) * (mask > 0),
                          mask=mask, logprobs=-mask, lengths=lengths,
                          rewards=np.asarray(correct, np.float32), correct=np.asarray(correct, bool))


def test_prompt_grad_norms_average_accepted_rows_only(params):
    scored = _scored([0, 0, 0, 1, 1, 2, 2, 2], [1, 0, 1, 0, 0, 0, 1, 0])
    got = prompt_grad_norms(params, TINY, scored, rows_per_chunk=2)
    row = []
    for i in range(scored.num_samples):
        prompt = scored.records[scored.prompt_index[i]]["prompt_ids"]
        seq = np.zeros(8, np.int32)
        seq[:len(prompt) + scored.lengths[i]] = prompt + list(scored.tokens[i, :scored.lengths[i]])
        row.append(_reference_norm(params, TINY, (("embed",),), seq, len(prompt), scored.lengths[i]))
    np.testing.assert_allclose(got, [(row[0] + row[2]) / 2, 0.0, row[6]], rtol=2e-4)
    nothing = dataclasses.replace(scored, correct=np.zeros(8, bool))
    np.testing.assert_array_equal(prompt_grad_norms(params, TINY, nothing), [0.0, 0.0, 0.0])


def test_allocation_gives_unsolved_prompts_nothing_and_sums_to_budget():
    sampling = SamplingSection(gvm_samples_per_prompt=8)
    p = np.array([0.0, 0.25, 0.5, 1.0, 0.125])
    g = np.array([0.0, 2.0, 1.0, 1.0, 3.0])
    n = allocate_samples(p, g, sampling)
    assert n.sum() == 40 and n[0] == 0
    # Hand computation: w = G / sqrt(p + 1e-3 / p).
    w = np.array([0.0, 2 / np.sqrt(0.25 + 4e-3), 1 / np.sqrt(0.5 + 2e-3), 1 / np.sqrt(1.001),
                  3 / np.sqrt(0.125 + 8e-3)])
    assert np.all(np.abs(n - w / w.sum() * 40) < 1.0)
    np.testing.assert_array_equal(allocate_samples(np.zeros(3), np.zeros(3), sampling), [0, 0, 0])
    # gvm_weighting=solved: 40 samples evenly over the 4 solved prompts, whatever their p and G.
    solved_only = SamplingSection(gvm_samples_per_prompt=8, gvm_weighting="solved")
    np.testing.assert_array_equal(allocate_samples(p, g, solved_only), [0, 10, 10, 10, 10])
    # 3 solved of 4 prompts, budget 16: 16 / 3 = 5.33 -> 5 each, the extra sample to the lowest index.
    np.testing.assert_array_equal(allocate_samples(np.array([0.5, 0.0, 0.1, 1.0]), np.ones(4),
                                                   SamplingSection(gvm_samples_per_prompt=4, gvm_weighting="solved")),
                                  [6, 0, 5, 5])


def test_solvable_budget_spends_only_on_prompts_with_an_accepted_sample():
    p = np.array([0.0, 0.25, 0.5, 0.0, 0.125])
    g = np.array([0.0, 2.0, 1.0, 0.0, 3.0])
    # 3 prompts with p > 0, N'' = 8: a budget of 24 instead of 40, split by the same GVM weights.
    assert stage2_budget(p, SamplingSection(gvm_samples_per_prompt=8, gvm_budget="solvable")) == 24
    assert stage2_budget(p, SamplingSection(gvm_samples_per_prompt=8)) == 40
    n = allocate_samples(p, g, SamplingSection(gvm_samples_per_prompt=8, gvm_budget="solvable"))
    w = np.array([0.0, 2 / np.sqrt(0.25 + 4e-3), 1 / np.sqrt(0.5 + 2e-3), 0.0, 3 / np.sqrt(0.125 + 8e-3)])
    assert n.sum() == 24 and n[0] == n[3] == 0 and np.all(np.abs(n - w / w.sum() * 24) < 1.0)
    # With even weights it is uniform sampling of the solvable prompts: 8 each.
    even = allocate_samples(p, g, SamplingSection(gvm_samples_per_prompt=8, gvm_budget="solvable",
                                                  gvm_weighting="solved"))
    np.testing.assert_array_equal(even, [0, 8, 8, 0, 8])
    assert allocate_samples(np.zeros(3), np.zeros(3), SamplingSection(gvm_budget="solvable")).sum() == 0


def test_cap_redistributes_the_excess():
    # Shares 12, 3, 3, 2 (budget 20) under a cap of 6: 6 removed from prompt 0, handed one at a time to
    # the prompt furthest below its share: ends at 6, 5, 5, 4.
    weights = np.array([12.0, 3.0, 3.0, 2.0])
    np.testing.assert_array_equal(cap_counts([12, 3, 3, 2], weights, 6), [6, 5, 5, 4])
    # Prompts of weight 0 never receive samples; with no room left the sum falls below budget.
    np.testing.assert_array_equal(cap_counts([12, 3, 0], np.array([4.0, 1.0, 0.0]), 5), [5, 5, 0])
    np.testing.assert_array_equal(cap_counts([7, 1], np.array([7.0, 1.0]), 0), [7, 1])
    capped = allocate_samples(np.array([0.05, 0.9, 0.9, 0.9]), np.ones(4), SamplingSection(
        gvm_samples_per_prompt=4, gvm_max_samples=6))
    assert capped.sum() == 16 and capped.max() <= 6 and capped[0] == 6


def test_rank_within_prompt_counts_earlier_rows_of_the_same_prompt():
    np.testing.assert_array_equal(rank_within_prompt(np.array([3, 1, 3, 3, 0, 1])), [0, 0, 1, 2, 0, 1])
    index = np.random.default_rng(0).integers(0, 5, size=40)
    loop = [sum(index[j] == index[k] for j in range(k)) for k in range(index.size)]
    np.testing.assert_array_equal(rank_within_prompt(index), loop)
    assert rank_within_prompt(np.array([], np.int64)).size == 0


def test_mean_norms_is_zero_where_nothing_was_measured():
    np.testing.assert_allclose(mean_norms(np.array([3.0, 0.0, 5.0]), np.array([2, 0, 4])), [1.5, 0.0, 1.25])


def test_reuse_stage1_builds_groups_of_exactly_n():
    stage1 = _scored([0, 0, 0, 1, 1, 1], [1, 0, 1, 1, 1, 0], seed=1)
    fresh = _scored([1, 1], [0, 1], records=stage1.records, seed=2)
    merged = reuse_stage1(stage1, fresh, np.array([2, 5]))
    np.testing.assert_array_equal(merged.prompt_index, [0, 0, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(merged.tokens, np.concatenate([stage1.tokens, fresh.tokens])[[0, 1, 3, 4, 5, 6, 7]])
    np.testing.assert_array_equal(merged.correct, [1, 0, 1, 1, 0, 0, 1])


# ---- the two stages with a stub tokenizer and verifier -------------------------------------------------------

class StubTokenizer:
    pad_token_id = 0
    stop_ids = ()

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


class StubScorer:
    """Correctness from the gold: "yes" always, "no" never, "even" when the first response token is even."""

    last_seconds = 0.0

    def __call__(self, texts, golds, lengths):
        correct = np.array([g == "yes" or (g == "even" and int(t.split()[0]) % 2 == 0) for t, g in zip(texts, golds)])
        return correct, correct.astype(np.float32)


def _records(golds):
    return [{"prompt_ids": [5 + i, 7, 9 + 2 * i], "answer": gold} for i, gold in enumerate(golds)]


def _sampling(**kw):
    return SamplingSection(max_new_tokens=4, gvm_stage1_samples=4, gvm_samples_per_prompt=3, **kw)


def test_two_stages_allocate_to_solved_prompts_only(params):
    records = _records(["yes", "no", "even", "no"])
    scored, info = gvm_rollouts(params, TINY, StubTokenizer(), records, _sampling(), StubScorer(),
                                jax.random.PRNGKey(0), rows_per_chunk=4)
    log = info["gvm"]
    n = np.array(log["gvm_n"])
    assert n.sum() == log["gvm_budget"] == 12 and n[1] == 0 and n[3] == 0 and n[0] > 0
    assert log["gvm_p"][0] == 1.0 and log["gvm_p"][1] == 0.0 and log["gvm_grad_norm"][1] == 0.0
    assert info["drawn"] == 4 * 4 + 12 and not info.get("skip_update")
    # One group per prompt with n_i > 0, each exactly n_i rows, renumbered 0..kept-1.
    kept = n[n > 0]
    assert len(scored.records) == len(kept) and info["filtered"] == int((n == 0).sum())
    np.testing.assert_array_equal(np.bincount(scored.prompt_index, minlength=len(kept)), kept)
    assert scored.records[0]["answer"] == "yes" and scored.correct[scored.prompt_index == 0].all()
    # Stage 2's records carry the stage-1 rate (the unbiased M-step divides by n_i p_i); the caller's are untouched.
    assert [r["gvm_accept_rate"] for r in scored.records] == [p for p, k in zip(log["gvm_p"], n) if k > 0]
    assert "gvm_accept_rate" not in records[0]


def test_reuse_option_draws_only_the_missing_rows(params):
    records = _records(["yes", "even", "no"])
    scored, info = gvm_rollouts(params, TINY, StubTokenizer(), records, _sampling(gvm_reuse_stage1=True),
                                StubScorer(), jax.random.PRNGKey(1), rows_per_chunk=4)
    n = np.array(info["gvm"]["gvm_n"])
    assert n.sum() == 9 and n[2] == 0
    assert info["drawn"] == 3 * 4 + int(np.maximum(n - 4, 0).sum())
    np.testing.assert_array_equal(np.bincount(scored.prompt_index), n[n > 0])


def test_chunk_keys_reach_the_stages_and_change_nothing(params, monkeypatch):
    """sampling.gvm_rows_per_chunk replaces the caller's rows_per_chunk (the loop passes micro_batch_size) and
    sampling.max_rows_per_call splits both stages' sampler calls; neither changes samples or allocation."""
    import jaxrl_llm.train.gvm as gvm_module

    seen = []
    real = gvm_module.prompt_grad_norm_sums
    monkeypatch.setattr(gvm_module, "prompt_grad_norm_sums", lambda *a, **kw: seen.append(kw["rows_per_chunk"])
                        or real(*a, **kw))
    records = _records(["yes", "even", "no", "even"])
    runs = [gvm_rollouts(params, TINY, StubTokenizer(), records, sampling, StubScorer(), jax.random.PRNGKey(4),
                         rows_per_chunk=4)
            for sampling in (_sampling(), _sampling(gvm_rows_per_chunk=1, max_rows_per_call=5))]
    assert seen == [4, 1]
    (a, info_a), (b, info_b) = runs
    # Tokens and allocation exactly: each row draws with its own output-row key in both runs, so a draw (61-token
    # vocabulary) or an n_i could only move if f32 rounding put it within ~1e-6 of a boundary.
    assert info_a["gvm"]["gvm_n"] == info_b["gvm"]["gvm_n"] and info_a["drawn"] == info_b["drawn"] == 16 + 12
    np.testing.assert_array_equal(a.tokens, b.tokens)
    # Log-probs to f32 rounding: other rows per sampler call compile other programs, whose f32 matmuls may
    # round differently on another CPU (4.8e-7 apart on an AVX2-only EPYC).
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(info_a["gvm"]["gvm_grad_norm"], info_b["gvm"]["gvm_grad_norm"], rtol=1e-5)


@pytest.mark.parametrize("golds, skipped", [(["no", "no", "no"], True), (["yes", "yes", "yes"], False)])
def test_all_unsolved_or_all_solved_does_not_crash(params, golds, skipped):
    scored, info = gvm_rollouts(params, TINY, StubTokenizer(), _records(golds), _sampling(), StubScorer(),
                                jax.random.PRNGKey(2), rows_per_chunk=4)
    log = info["gvm"]
    assert bool(info.get("skip_update")) == skipped and log["gvm_skipped"] == int(skipped)
    if skipped:  # nothing drawn in stage 2; the stage-1 rollouts come back for the metrics
        assert log["gvm_n"] == [0, 0, 0] and info["drawn"] == 12 and scored.num_samples == 12
        assert "no stage-1 sample was accepted" in info["skip_reason"]
        assert log["gvm_unsolved_fraction"] == 1.0
    else:  # all solved: p = 1 everywhere, the budget is split by gradient norm
        assert sum(log["gvm_n"]) == 9 and log["gvm_solved_fraction"] == 1.0 and info["drawn"] == 21
        filtered = _sampling(gvm_filter_threshold=0.9)  # ... unless the easy-prompt filter removes them all
        _, info = gvm_rollouts(params, TINY, StubTokenizer(), _records(golds), filtered, StubScorer(),
                               jax.random.PRNGKey(2), rows_per_chunk=4)
        assert info["skip_update"] and "filters removed every prompt" in info["skip_reason"]


@pytest.mark.parametrize("override, message", [
    ("sampling.gvm_filter_threshold=0", r"'sampling.gvm_filter_threshold' must be in \(0, 1\]"),
    ("sampling.gvm_stage1_samples=0", r"'sampling.gvm_stage1_samples' must be >= 1"),
    ("sampling.gvm_param_subset=','", r"'sampling.gvm_param_subset' must name at least one"),
    ("sampling.gvm_refresh_every=0", r"'sampling.gvm_refresh_every' must be >= 1"),
    ("sampling.gvm_rows_per_chunk=-1", r"'sampling.gvm_rows_per_chunk' must be >= 0"),
])
def test_config_rejects_bad_gvm_values(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
    with pytest.raises(ConfigError, match="cannot be combined with sampling.allocation=gvm"):
        load_config(None, ["sampling.allocation=gvm", "algorithm.dynamic_sampling=true"])
    for mode in ("async", "partial"):  # the refusal names the schedule asked for
        with pytest.raises(ConfigError, match=f"'rollouts.mode' {mode} cannot be combined with sampling.allocation"):
            load_config(None, ["sampling.allocation=gvm", f"rollouts.mode={mode}"])


# ---- the RL loop with GVM allocation -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bundled_policy():
    from jaxrl_llm.models.bundled import bundled_gguf_path
    from jaxrl_llm.models.tokenizer import Tokenizer

    try:
        tokenizer = Tokenizer.from_gguf(bundled_gguf_path())
    except (FileNotFoundError, ImportError) as err:
        pytest.skip(f"bundled tokenizer unavailable: {err}")
    config = dataclasses.replace(TINY, vocab_size=tokenizer.vocab_size)
    return config, models.init_params(config, jax.random.PRNGKey(0)), tokenizer


def _train_gvm(tmp_path, policy, monkeypatch, verdict, extra=()):
    from jaxrl_llm.train import loop, rollouts
    def stub_scorer(self, texts, golds, lengths):  # a verifier whose verdict the test chooses
        correct = np.array([verdict(t) for t in texts], bool)
        return correct, correct.astype(np.float32)

    monkeypatch.setattr(rollouts.RewardScorer, "__call__", stub_scorer)
    config = load_config(None, [
        "sampling.allocation=gvm", "train.steps=2", "train.eval_problems=0", "sampling.prompts_per_step=4",
        "sampling.gvm_stage1_samples=4", "sampling.gvm_samples_per_prompt=4", "sampling.max_new_tokens=8",
        "optim.micro_batch_size=8", f"train.out_dir={tmp_path}", *extra])
    lines = []
    summary = loop.train(config, policy=policy, log=lines.append)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, rows, lines


def test_loop_all_unsolved_skips_and_logs(tmp_path, bundled_policy, monkeypatch):
    summary, rows, lines = _train_gvm(tmp_path, bundled_policy, monkeypatch, lambda text: False)
    assert summary["status"] == "done" and summary["samples_drawn"] == 2 * 4 * 4  # stage 1 only
    assert [r["gvm_skipped"] for r in rows] == [1, 1] and all(r["updates"] == 0 for r in rows)
    assert all(r["gvm_n"] == [0, 0, 0, 0] and r["gvm_p"] == [0.0] * 4 for r in rows)
    assert sum("update skipped" in line for line in lines) == 2


def test_loop_mixed_allocation_updates_and_counts_both_stages(tmp_path, bundled_policy, monkeypatch):
    # Accept a response when its text has an even number of characters: mixed per-prompt success.
    summary, rows, _ = _train_gvm(tmp_path, bundled_policy, monkeypatch, lambda text: len(text) % 2 == 0,
                                  extra=["sampling.gvm_refresh_every=2", "algorithm.advantage=grpo",
                                         "algorithm.agg=prompt-mean-unbiased"])  # the M-step with stage-1 p_i
    first, second = rows
    n, p = np.array(first["gvm_n"]), np.array(first["gvm_p"])
    assert n.sum() == first["gvm_budget"] == 16 and np.all(n[p == 0] == 0) and first["gvm_skipped"] == 0
    assert first["updates"] >= 1 and first["groups_kept"] == int((n > 0).sum())
    # Step 2 is between refreshes: 4 samples per prompt, no stage 1, no allocation logged.
    assert "gvm_n" not in second and second["groups_kept"] == 4
    assert summary["samples_drawn"] == (16 + 16) + 16 == second["samples_drawn"]


def test_loop_slot_occupancy_pools_both_stages_with_the_continuous_engine(tmp_path, bundled_policy, monkeypatch):
    """Step 1 refreshes GVM (stage 1 then stage 2: two sampler calls), step 2 samples once; each step's
    sampling_slot_occupancy = its calls' generated tokens / their slot-steps."""
    import importlib

    generate_module = importlib.import_module("jaxrl_llm.sampling.generate")
    original, stats = generate_module.generate_slots, []

    def recorded(*args, **kwargs):
        out = original(*args, **kwargs)
        assert out[5].useful_slot_steps == int(out[2].sum())  # useful slot-steps = the sampled lengths
        stats.append(out[5])
        return out

    monkeypatch.setattr(generate_module, "generate_slots", recorded)
    config, _, tokenizer = bundled_policy  # fresh weights: a training run before this one donated the fixture's
    policy = (config, models.init_params(config, jax.random.PRNGKey(0)), tokenizer)
    _, rows, _ = _train_gvm(tmp_path, policy, monkeypatch, lambda text: len(text) % 2 == 0,
                            extra=["sampling.gvm_refresh_every=2", "algorithm.advantage=grpo",
                                   "sampling.engine=continuous", "sampling.max_slots=4"])
    assert len(stats) == 3 and {s.slots for s in stats} == {4}
    first = sum(s.useful_slot_steps for s in stats[:2]) / sum(s.slot_steps for s in stats[:2])
    assert [r["sampling_slot_occupancy"] for r in rows] == pytest.approx([first, stats[2].occupancy])
    assert all(0 < r["sampling_slot_occupancy"] <= 1 for r in rows)


@pytest.mark.parametrize("preset, advantage, kl", [("gvm_raftpp", "raft", 0.0), ("gvm_grpo", "grpo", 1e-3)])
def test_gvm_presets_inherit_their_algorithm(preset, advantage, kl):
    import pathlib

    cfg = load_config(pathlib.Path(__file__).parent.parent / "configs" / f"{preset}.yaml")
    assert (cfg.sampling.allocation, cfg.sampling.gvm_stage1_samples, cfg.sampling.gvm_samples_per_prompt) == (
        "gvm", 8, 8)
    assert (cfg.algorithm.advantage, cfg.algorithm.kl_coef, cfg.optim.lr) == (advantage, kl, 1e-6)


def test_study_summary_counts_samples_to_target():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "gvm_study.py"
    spec = importlib.util.spec_from_file_location("gvm_study", path)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    curve = lambda accs: [{"samples": 100 * i, "step": 2 * i, "train_s": 10.0 * i, "accuracy": a}  # noqa: E731
                          for i, a in enumerate(accs)]
    runs = [{"algorithm": "raftpp", "allocation": "gvm", "curve": curve([0.1, 0.6, 0.7]), "final_accuracy": 0.7,
             "samples_drawn": 200}, {"algorithm": "raftpp", "allocation": "gvm", "curve": curve([0.1, 0.4, 0.5]),
                                     "final_accuracy": 0.5, "samples_drawn": 200},
            {"algorithm": "raftpp", "allocation": "uniform", "curve": curve([0.1, 0.2]), "final_accuracy": 0.2,
             "samples_drawn": 100}]
    table = study.summarise(runs, target=0.5)
    assert table["raftpp/gvm"]["reached_target"] == 2
    assert table["raftpp/gvm"]["samples_to_target"] == 150.0 and table["raftpp/gvm"]["steps_to_target"] == 3.0
    assert table["raftpp/gvm"]["final_accuracy_mean"] == pytest.approx(0.6)
    # Interpolated between evaluations: 0.1 -> 0.6 over samples 0 -> 100 crosses 0.5 at 80; 0.4 -> 0.5 at 200.
    assert table["raftpp/gvm"]["samples_to_target_interpolated"] == pytest.approx(140.0)
    assert study.crossing(curve([0.5, 0.6]), 0.5) == 0.0 and study.crossing(curve([0.1, 0.2]), 0.5) is None
    assert table["raftpp/uniform"]["reached_target"] == 0 and table["raftpp/uniform"]["samples_to_target"] is None
    assert study.best_ratio(table) == {"raftpp": {"best_gvm": "gvm", "best_uniform": None, "samples_ratio": None}}
    table["raftpp/uniform_updates"] = {**table["raftpp/gvm"], "samples_to_target": 100.0}
    assert study.best_ratio(table)["raftpp"] == {"best_gvm": "gvm", "best_uniform": "uniform_updates",
                                                 "samples_ratio": 1.5}


def test_mstep_preset_trains_the_papers_estimator():
    import pathlib

    cfg = load_config(pathlib.Path(__file__).parent.parent / "configs" / "gvm_raftpp_mstep.yaml")
    assert (cfg.algorithm.agg, cfg.algorithm.advantage, cfg.algorithm.loss) == ("prompt-mean-unbiased", "raft", "clip")
    assert cfg.sampling.allocation == "gvm" and cfg.sampling.gvm_stage1_samples == 8


def test_study_arms_are_configs(tmp_path):
    import argparse
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "gvm_study.py"
    spec = importlib.util.spec_from_file_location("gvm_study", path)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    args = argparse.Namespace(toy=None, set=["sampling.prompts_per_step=4"], sample_budget=640,
                              eval_every_samples=128)
    cfg = {arm: study.run_config("raftpp", arm, 0, args, tmp_path / arm) for arm in study.ARMS}
    # A uniform step draws 4 x 8 = 32 samples, a GVM step 4 x (8 + 8) = 64: 20 and 10 steps in 640 samples.
    assert (cfg["uniform"].train.steps, cfg["gvm"].train.steps, cfg["uniform_updates"].train.steps) == (20, 10, 20)
    assert cfg["uniform_updates"].optim.mini_batches == 8 and cfg["uniform"].optim.mini_batches == 1
    assert cfg["gvm_mstep"].algorithm.agg == "prompt-mean-unbiased" and cfg["gvm"].algorithm.agg == "token-mean"
    assert cfg["uniform_drop_unsolved"].sampling.gvm_weighting == "solved"
    assert cfg["uniform_drop_unsolved"].sampling.allocation == "gvm" and cfg["uniform"].sampling.allocation == "uniform"
    # History arms count their steps at the stage-2 budget (4 x 8 = 32): stage 1 runs only for unseen prompts.
    assert cfg["gvm_history"].train.steps == 20 and cfg["gvm_history"].sampling.gvm_estimates == "history"
    assert cfg["gvm_history_updates"].optim.mini_batches == 8
    # The n = 4 arms: 4 x 4 = 16 samples a step, 40 steps in 640.
    assert cfg["uniform_updates_n4"].train.steps == cfg["gvm_history_updates_n4"].train.steps == 40
    # Solvable-budget arms count steps at 60% of their stage-2 budget: 640 // (4 x 2 x 0.6) = 133 steps.
    even = cfg["gvm_history_solvable_even_n2"]
    assert (even.sampling.gvm_budget, even.sampling.gvm_weighting, even.train.steps) == ("solvable", "solved", 133)
    assert even.sampling.gvm_history_probe_visits == 2 and cfg["gvm_history_solvable_n2"].sampling.gvm_weighting == "gvm"
    assert cfg["uniform_lr8x"].optim.lr == 1.6e-4 and cfg["gvm_capped"].sampling.gvm_max_samples == 32


def test_study_accuracy_at_budget_takes_the_last_evaluation_within_it():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "gvm_study.py"
    spec = importlib.util.spec_from_file_location("gvm_study", path)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    curve = [{"samples": s, "step": i, "train_s": 0.0, "accuracy": a}
             for i, (s, a) in enumerate([(0, 0.1), (500, 0.3), (1000, 0.5), (1100, 0.9)])]
    runs = [{"algorithm": "raftpp", "allocation": "gvm_history", "seed": 0, "curve": curve, "final_accuracy": 0.9,
             "samples_drawn": 1100}]
    row = study.summarise(runs, target=0.4, budget=1050)["raftpp/gvm_history"]
    assert row["accuracy_at_budget_mean"] == 0.5 and row["samples_to_target"] == 1000


def test_norms_through_splash_on_a_one_device_mesh(params):
    """GVM's per-row vmap on a one-device mesh with a fused kernel (splash, interpret mode on CPU): the kernel's
    shard_map names no row axes there (naming them failed: "vmap spmd_axis_name cannot appear in shard_map
    in_specs", which stopped `jaxrl-llm compile` of the GVM LoRA preset for one v5e chip); the norms equal the
    xla path's without a mesh."""
    from jaxrl_llm.models.sharding import make_mesh

    tokens, prompt_lens, response, mask, _ = _rows()
    want = per_sample_grad_norms(params, TINY, tokens, prompt_lens, response, mask, rows_per_chunk=4)
    splash = dataclasses.replace(TINY, attention_impl="splash")
    got = per_sample_grad_norms(params, splash, tokens, prompt_lens, response, mask, rows_per_chunk=4,
                                mesh=make_mesh("fsdp=1", devices=jax.devices()[:1]))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)
