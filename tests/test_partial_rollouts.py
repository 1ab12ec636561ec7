"""Partial rollouts (`rollouts.mode: partial`, train/partial_rollouts.py): the endless queue draws what one continuous
call draws, a scripted policy whose versions show in its tokens checks the version of every token against the
schedule, staleness stays within its bound (dropped or redrawn beyond), the schedule is the same whatever the
threads' timing, and a run saved at a checkpoint and restored continues exactly."""

import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiny_models import tiny_sampler_model

from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.run.config import ConfigError
from jaxrl_llm.sampling import generate
from jaxrl_llm.sampling import continuous
from jaxrl_llm.train import load_config
from jaxrl_llm.train.async_rollouts import PartialRollouts, load_in_flight, save_in_flight
from jaxrl_llm.train.partial_rollouts import Group, PartialSampler, SegmentLog, batch_info

BASE = 40  # version v of the scripted policy writes token BASE + v


def _prompt_stream(lengths=(3, 5, 2, 4, 6, 1, 7, 3), first: int = 0):
    """Records with prompts of varied lengths, one batch of 3 per call (the stream never ends), from record
    `first` on (a multiple of 3: the data position a checkpoint saves)."""
    calls = [first // 3]

    def next_records():
        start = calls[0] * 3
        calls[0] += 1
        return [{"prompt_ids": [1 + (start + i) % 20] * lengths[(start + i) % len(lengths)],
                 "answer": str(start + i)} for i in range(3)]

    return next_records


def _sampler(config, *, key=3, **overrides):
    kwargs = dict(next_records=_prompt_stream(), group_size=2, batch_groups=2, prompt_bucket=8, max_new_tokens=10,
                  segment_iterations=3, temperature=1.0, top_p=1.0, top_k=0, stop_ids=(), pad_id=0,
                  key=jax.random.key(key), slots=4)
    return PartialSampler(config, **{**kwargs, **overrides})


# ---- the engine ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return tiny_sampler_model(24)


def test_endless_queue_draws_what_one_continuous_call_draws(tiny):
    """One version throughout: the groups the sampler hands over are the samples `generate` draws for the same
    prompts with the same key (sample k's numbers follow it as the queue shifts), tokens exactly."""
    config, params = tiny
    sampler = _sampler(config, stop_ids=(5,))
    groups = []
    while len(groups) < 9:
        groups += sampler.segment(params, 0)
    groups.sort(key=lambda g: g.index)
    groups = groups[:9]
    assert [g.index for g in groups] == list(range(9))  # every prompt of the stream, none lost by the shifts
    prompts = [g.record["prompt_ids"] for g in groups]
    want = generate(params, config, prompts, num_samples=2, max_new_tokens=10, temperature=1.0, stop_ids=(5,),
                    rng=jax.random.key(3), engine="continuous", max_slots=4)
    lengths = np.concatenate([g.lengths for g in groups])
    np.testing.assert_array_equal(lengths, want.lengths)
    assert lengths.min() < 10 <= lengths.max()  # samples end at different times
    tokens = np.concatenate([g.tokens for g in groups])
    np.testing.assert_array_equal(tokens * want.mask, want.tokens * want.mask)
    np.testing.assert_allclose(np.concatenate([g.logprobs for g in groups]), want.logprobs, atol=1e-5, rtol=0)
    assert sampler.admitted - len(sampler.records) >= 4  # the queue shifted: its front is past the first prompts


def test_the_segment_log_holds_every_segment_and_the_groups_it_handed_over(tiny, tmp_path):
    """SegmentLog: a header, then per segment its version, times, iterations (3: the endless queue keeps 4 slots
    busy) and the groups handed over with their lengths, the same as the groups `segment` returned."""
    config, params = tiny
    sampler = _sampler(config, stop_ids=(5,))
    log = SegmentLog(tmp_path / "segments.jsonl", {"start": 0, "schedule": {}})
    sampler.log = log.write
    returned = [[(g.index, *map(int, g.lengths)) for g in sampler.segment(params, v)] for v in (0, 0, 1, 1, 2)]
    lines = [json.loads(x) for x in (tmp_path / "segments.jsonl").read_text().splitlines()]
    assert lines[0] == {"start": 0, "schedule": {}} and len(lines) == 6
    segments = lines[1:]
    assert [x["segment"] for x in segments] == [0, 1, 2, 3, 4] and [x["version"] for x in segments] == [0, 0, 1, 1, 2]
    assert [x["iterations"] for x in segments] == [3] * 5
    assert [[tuple(g) for g in x["groups"]] for x in segments] == returned and any(returned)
    assert all(a["start"] < a["end"] <= b["start"] for a, b in zip(segments, segments[1:]))


def test_refresh_with_the_same_weights_recomputes_the_same_caches(tiny):
    """`refresh_slots` recomputes the prompt entries and the busy slots' next logits: with unchanged weights, what
    the decode loop had computed (to f32 rounding: the prefill and the decode step are different programs)."""
    config, params = tiny
    sampler = _sampler(config, stop_ids=(5,))
    for _ in range(3):
        sampler.segment(params, 0)
    state = sampler.state
    keep = {name: np.array(getattr(state, name)) for name in ("logits", "slot_sample", "entry_left")}
    keep["last_logits"] = np.array(state.prompts.last_logits)
    keep["keys"] = np.array(state.prompts.keys[0])
    refreshed = continuous.refresh_slots(params, config, None, state, sampler._queue(sampler.records),
                                         sampler.arguments[0], prefill_chunk=sampler.chunk)
    busy, live = keep["slot_sample"] >= 0, keep["entry_left"] > 0
    assert busy.any() and live.any()
    np.testing.assert_allclose(np.array(refreshed.logits)[busy], keep["logits"][busy], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.array(refreshed.prompts.last_logits)[live], keep["last_logits"][live], atol=1e-4,
                               rtol=0)
    np.testing.assert_allclose(np.array(refreshed.prompts.keys[0])[live], keep["keys"][live], atol=1e-4, rtol=0)


def test_shift_slots_moves_rows_entries_and_numbers():
    config = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=4)
    cache = continuous.empty_prompt_cache(config, 4, 16)
    queue = continuous.PromptQueue(jnp.zeros((6, 16), jnp.int32), jnp.ones(6, jnp.int32), jnp.full(6, 2, jnp.int32),
                                   jnp.arange(0, 14, 2, dtype=jnp.int32), jnp.int32(4))
    state = continuous.start_slots(config, cache, queue, jnp.repeat(jnp.arange(4), 2), jnp.int32(9), slots=2,
                                   new_token_bucket=16)
    tokens = np.arange(8 * 16, dtype=np.int32).reshape(8, 16)
    state = state.__class__(**{**{f: getattr(state, f) for f in state.__dataclass_fields__},
                               "tokens": jnp.asarray(tokens), "lengths": jnp.arange(8, dtype=jnp.int32),
                               "slot_sample": jnp.array([5, -1], jnp.int32), "next_sample": jnp.int32(6),
                               "entry_of": jnp.array([0, 1, 2, 3, 4, 4], jnp.int32), "prefilled": jnp.int32(4)})
    out = continuous.shift_slots(state, jnp.int32(1), jnp.int32(2), jnp.int32(9))
    np.testing.assert_array_equal(out.tokens[:6], tokens[2:])
    np.testing.assert_array_equal(out.tokens[6:], np.full((2, 16), 9))
    np.testing.assert_array_equal(out.lengths, [2, 3, 4, 5, 6, 7, 0, 0])
    np.testing.assert_array_equal(out.slot_sample, [3, -1])
    np.testing.assert_array_equal(out.entry_of, [1, 2, 3, 4, 4, 4])
    assert (int(out.next_sample), int(out.prefilled), int(out.first_row)) == (4, 3, 2)


# ---- the schedule, on a scripted policy -------------------------------------------------------------------------

def _scripted(version: int, config: ModelConfig):
    """Params whose every next token is BASE + version (logit 40 above the others: the others' total probability
    ~1e-16): the residual stream is the embedding (attention and MLP write zeros), every embedding row is ones."""
    params = init_params(config, jax.random.key(0))
    params["embed"] = jnp.ones_like(params["embed"])
    params["layers"]["o_proj"] = jnp.zeros_like(params["layers"]["o_proj"])
    params["layers"]["down_proj"] = jnp.zeros_like(params["layers"]["down_proj"])
    params["lm_head"] = jnp.zeros_like(params["lm_head"]).at[:, BASE + version].set(40.0 / config.hidden_size)
    return params


@pytest.fixture(scope="module")
def scripted():
    config = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=4, tie_word_embeddings=False, max_position_embeddings=64)
    return config, [_scripted(v, config) for v in range(16)]


def _schedule(scripted, *, steps=6, lag=1, max_staleness=3, redraw=False, train_seconds=0.0, save_at=None,
              in_flight=None, start=0, **sampler):
    """The loop's protocol on the scripted policy: take(t) -> 'update' (the version becomes t + 1) -> [quiesce] ->
    publish(t + 1). Returns ({step: groups}, {step: info}, the segments' (version, batch filled), quiesced)."""
    config, versions = scripted
    trainer = {"version": start}
    sampler = _sampler(config, **sampler)
    segments = []
    segment, holder = sampler.segment, []

    def logged(params, version):
        while not holder:  # the thread starts inside the constructor
            time.sleep(0.001)
        segments.append((version, holder[0].next_step))
        return segment(params, version)

    sampler.segment = logged
    rollouts = PartialRollouts(sampler, lambda groups, step, info: (groups, info),
                               lambda: versions[trainer["version"]], lambda p: p, start=start, steps=steps,
                               batch_groups=2, lag=lag, max_staleness=max_staleness, redraw=redraw,
                               in_flight=in_flight)
    holder.append(rollouts)
    batches, infos, quiesced = {}, {}, None
    try:
        for step in range(start, steps):
            batches[step], infos[step] = rollouts.take(step)
            time.sleep(train_seconds)
            trainer["version"] = step + 1
            if step + 1 == save_at:
                quiesced = rollouts.quiesce(step + 1)
            rollouts.publish(step + 1)
    finally:
        rollouts.close()
    return batches, infos, segments, quiesced


def _token_versions(groups: list[Group]) -> tuple[np.ndarray, np.ndarray]:
    on = np.concatenate([g.versions for g in groups]) >= 0
    return np.concatenate([g.tokens for g in groups])[on], np.concatenate([g.versions for g in groups])[on]


@pytest.mark.parametrize("lag,recompute", [(0, False), (1, False), (2, False), (1, True)])
def test_every_token_records_the_version_that_wrote_it(scripted, lag, recompute):
    batches, infos, segments, _ = _schedule(scripted, lag=lag, max_staleness=6, recompute=recompute)
    # the schedule: segment s decodes with version max(0, r(s) - lag), r(s) the batch it fills
    assert all(version == max(0, filling - lag) for version, filling in segments)
    versions_used = {v for v, _ in segments}
    for step, groups in batches.items():
        tokens, versions = _token_versions(groups)
        np.testing.assert_array_equal(tokens, BASE + versions)  # the scripted policy wrote each token's version
        assert set(versions) <= versions_used
        assert versions.max() <= max(0, step - lag)  # no token newer than the schedule allows
        info = infos[step]
        assert info["staleness_max"] == step - versions.min() <= 6
        assert info["staleness_mean"] == pytest.approx(np.mean(step - versions))
        assert sum(info["tokens_per_version"].values()) == versions.size == sum(g.lengths.sum() for g in groups)
    # samples continued under new weights: some sample holds tokens of two versions
    assert any(len(set(g.versions[r][g.versions[r] >= 0])) > 1 for gs in batches.values() for g in gs
               for r in range(len(g.lengths)))


@pytest.mark.parametrize("redraw", [False, True])
def test_staleness_never_exceeds_the_bound(scripted, redraw):
    # 8 slots, 2 groups a batch: groups decoded together end together, and the second batch they make is stale
    batches, infos, _, _ = _schedule(scripted, lag=1, max_staleness=1, redraw=redraw, slots=8)
    for step, groups in batches.items():
        _, versions = _token_versions(groups)
        assert step - versions.min() <= 1
        assert len(groups) == 2
    dropped = sum(info["dropped_stale"] for info in infos.values())
    assert dropped > 0  # the bound was met by dropping groups, not by luck
    drawn = sum(info["drawn"] for info in infos.values())
    assert drawn == 2 * (2 * len(batches) + dropped)
    if redraw:  # a dropped prompt comes back and is drawn again
        taken = [g.record["answer"] for gs in batches.values() for g in gs]
        indices = [g.index for gs in batches.values() for g in gs]
        assert len(taken) == len(set(taken)) and max(indices) >= len(set(taken))


def test_recomputed_caches_draw_the_next_token_with_the_new_version(scripted):
    kept, _, _, _ = _schedule(scripted, lag=1, max_staleness=6)
    recomputed, _, _, _ = _schedule(scripted, lag=1, max_staleness=6, recompute=True)
    for step in kept:  # a row's first token after a version change: the old version's, or with recompute the new
        old = [v for g in kept[step] for v in g.versions.ravel() if v >= 0]
        new = [v for g in recomputed[step] for v in g.versions.ravel() if v >= 0]
        assert len(old) == len(new) and sum(new) >= sum(old)
    assert any(sum(g.versions.sum() for g in recomputed[t]) > sum(g.versions.sum() for g in kept[t]) for t in kept)


def test_the_schedule_does_not_depend_on_the_threads_timing(scripted):
    fast, fast_infos, fast_segments, _ = _schedule(scripted, lag=1, max_staleness=4)
    slow, slow_infos, slow_segments, _ = _schedule(scripted, lag=1, max_staleness=4, train_seconds=0.05)
    assert fast_segments == slow_segments
    for step in fast:
        assert [g.index for g in fast[step]] == [g.index for g in slow[step]]
        for a, b in zip(fast[step], slow[step]):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_array_equal(a.versions, b.versions)
        assert fast_infos[step]["tokens_per_version"] == slow_infos[step]["tokens_per_version"]


def test_a_run_saved_and_restored_continues_exactly(scripted, tmp_path):
    straight, _, straight_segments, _ = _schedule(scripted, steps=7, lag=1, max_staleness=4)
    _, _, _, quiesced = _schedule(scripted, steps=7, lag=1, max_staleness=4, save_at=3)
    in_flight_steps = sorted(k for k in quiesced if k != "sampler")
    assert in_flight_steps and in_flight_steps[0] == 3  # batches formed ahead of the trainer are saved with it
    save_in_flight(tmp_path, 3, quiesced)
    restored = load_in_flight(tmp_path, 3, expected=len(quiesced))
    books = restored["sampler"]["books"]  # the stream goes on after the prompts the sampler read
    resumed, _, resumed_segments, _ = _schedule(scripted, steps=7, lag=1, max_staleness=4, start=3,
                                                in_flight=restored, next_records=_prompt_stream(
                                                    first=books["admitted"] + len(books["buffer"])))
    assert sorted(resumed) == [3, 4, 5, 6]
    for step in resumed:
        for a, b in zip(straight[step], resumed[step]):
            assert a.index == b.index and a.record == b.record
            for field in ("tokens", "logprobs", "lengths", "versions"):
                np.testing.assert_array_equal(getattr(b, field), getattr(a, field), err_msg=field)
    assert resumed_segments == straight_segments[-len(resumed_segments):]


def test_a_failing_segment_reaches_the_trainer(scripted):
    config, versions = scripted
    sampler = _sampler(config)
    sampler.segment = lambda params, version: (_ for _ in ()).throw(ValueError("bad segment"))
    rollouts = PartialRollouts(sampler, lambda g, s, i: (g, i), lambda: versions[0], lambda p: p, start=0, steps=3,
                               batch_groups=2, lag=1, max_staleness=2)
    with pytest.raises(RuntimeError, match="rollouts.mode partial") as err:
        rollouts.take(0)
    rollouts.close()
    assert isinstance(err.value.__cause__, ValueError)


def test_batch_info_counts_versions():
    versions = np.array([[3, 3, 4, -1], [4, 5, -1, -1]], np.int32)
    group = Group(record={}, index=0, tokens=np.zeros((2, 4), np.int32), logprobs=np.zeros((2, 4), np.float32),
                  lengths=np.array([3, 2]), stopped=np.zeros(2, bool), versions=versions)
    info = batch_info([group], 6)
    assert info["tokens_per_version"] == {"3": 2, "4": 2, "5": 1}
    assert (info["policy_version"], info["staleness"], info["staleness_max"]) == (5, 3, 3)
    assert info["staleness_mean"] == pytest.approx((3 + 3 + 2 + 2 + 1) / 5)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="rollouts.partial_lag"):
        load_config(None, ["rollouts.mode=partial", "rollouts.max_staleness=1", "rollouts.partial_lag=2"])
    with pytest.raises(ConfigError, match="rollouts.segment_iterations"):
        load_config(None, ["rollouts.mode=partial", "rollouts.segment_iterations=0"])
    with pytest.raises(ConfigError, match="rollouts.stale"):
        load_config(None, ["rollouts.mode=partial", "rollouts.stale=keep"])
    with pytest.raises(ConfigError, match="rollouts.mode.*dynamic_sampling"):
        load_config(None, ["rollouts.mode=partial", "algorithm.dynamic_sampling=true"])
    with pytest.raises(ConfigError, match="rollouts.recompute_cache.*applies to rollouts.mode=partial"):
        load_config(None, ["rollouts.mode=async", "rollouts.recompute_cache=true"])
    assert load_config(None, ["rollouts.mode=partial"]).rollouts.partial_lag == 1


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def test_score_groups_lays_out_a_steps_batch():
    from jaxrl_llm.train.partial_rollouts import score_groups

    groups = [Group(record={"answer": str(a)}, index=a, tokens=np.array([[7, 8, 0], [9, 0, 0]], np.int32) + a,
                    logprobs=np.array([[-0.5, -1.0, 0.0], [-2.0, 0.0, 0.0]], np.float32),
                    lengths=np.array([2, 1]), stopped=np.ones(2, bool), versions=np.zeros((2, 3), np.int32))
              for a in (0, 1)]
    seen = []

    def scorer(texts, golds, lengths):
        seen.append((texts, golds, list(lengths)))
        return np.array([t.startswith("7") for t in texts]), np.array([float(len(t)) for t in texts], np.float32)

    scored = score_groups(groups, _Tokenizer(), scorer)
    assert seen == [(["7 8", "9", "8 9", "10"], ["0", "0", "1", "1"], [2, 1, 2, 1])]
    np.testing.assert_array_equal(scored.prompt_index, [0, 0, 1, 1])
    np.testing.assert_array_equal(scored.mask, [[1, 1, 0], [1, 0, 0]] * 2)
    np.testing.assert_array_equal(scored.rewards, [3, 1, 3, 2])
    np.testing.assert_array_equal(scored.correct, [True, False, False, False])
    assert scored.records == [{"answer": "0"}, {"answer": "1"}] and scored.logprobs[1, 0] == -2.0


def test_mixed_filter_keeps_groups_whose_rewards_differ():
    from types import SimpleNamespace

    from jaxrl_llm.train.loop import filter_mixed
    from jaxrl_llm.train.rollouts import ScoredRollouts

    scored = ScoredRollouts(records=[{"a": 0}, {"a": 1}, {"a": 2}], prompt_index=np.repeat(np.arange(3), 2),
                            tokens=np.zeros((6, 2), np.int32), mask=np.ones((6, 2), np.float32),
                            logprobs=np.zeros((6, 2), np.float32), lengths=np.full(6, 2),
                            rewards=np.array([1, 1, 0, 1, 0, 0], np.float32), correct=np.zeros(6, bool))
    run = SimpleNamespace(config=SimpleNamespace(algorithm=SimpleNamespace(group_filter="mixed")))
    kept, filtered = filter_mixed(run, scored)
    assert filtered == 2 and kept.records == [{"a": 1}]
    np.testing.assert_array_equal(kept.rewards, [0, 1])
    run.config.algorithm.group_filter = "none"
    assert filter_mixed(run, scored) == (scored, 0)


def test_prompts_that_do_not_fit_are_refused(scripted):
    config, versions = scripted
    with pytest.raises(ValueError, match="prompt of 17 tokens does not fit.*prompt bucket of 16"):
        _sampler(config, next_records=lambda: [{"prompt_ids": [1] * 17}] * 3, prompt_bucket=16).segment(versions[0], 0)
    too_long = "prompt of 9 tokens \\+ max_new_tokens \\(60\\) exceeds max_position_embeddings"
    with pytest.raises(ValueError, match=too_long):
        _sampler(config, next_records=lambda: [{"prompt_ids": [1] * 9}] * 3, max_new_tokens=60).segment(versions[0], 0)


def test_a_checkpoint_saved_before_the_routes_were_recorded(tmp_path):
    """A mixture of experts' partial checkpoint written before the sampler recorded routes (here: one saved now, its
    route arrays deleted) resumes with routing_replay none, its rollouts in flight holding -1 (nothing recorded);
    with rollout, a ValueError names the checkpoint's folder, the first missing key and what to do."""
    from types import SimpleNamespace

    from jaxrl_llm.train.partial_rollouts import make_partial_rollouts, saved_routes, score_groups

    config = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                         head_dim=4, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=8, max_position_embeddings=64)
    sampler = _sampler(config)
    arrays, books = sampler.state_dict()
    route_leaves = [f"sampler/leaf{len(arrays) - len(PartialSampler._HOST) - k}" for k in (2, 1)]  # the last two
    group = Group(record={"prompt_ids": [1, 2], "answer": "0"}, index=0, tokens=np.ones((2, 16), np.int32),
                  logprobs=np.zeros((2, 16), np.float32), lengths=np.full(2, 3, np.int32), stopped=np.zeros(2, bool),
                  versions=np.zeros((2, 16), np.int32), routes=np.zeros((2, 16, 1, 2), np.int8),
                  prompt_routes=np.zeros((16, 1, 2), np.int8))
    save_in_flight(tmp_path, 3, {3: ([group], {}), "sampler": {"arrays": arrays, "books": books, "next_step": 4,
                                                               "pending": [group], "dropped": 0, "drawn": 0,
                                                               "schedule": {}}})
    path = tmp_path / "in_flight" / "3.npz"
    with np.load(path) as data:
        assert all(key in data.files for key in route_leaves + ["3/0/routes", "pending/0/prompt_routes"])
        kept = {k: data[k] for k in data.files if k not in route_leaves and not k.endswith("routes")}
    np.savez(path, **kept)

    cfg = load_config(None, ["rollouts.mode=partial", "model.routing_replay=rollout", "sampling.samples_per_prompt=2",
                             "sampling.prompts_per_step=2", "data.max_prompt_tokens=8", "sampling.max_new_tokens=10",
                             "rollouts.segment_iterations=3", "sampling.engine=continuous", "sampling.max_slots=4",
                             "sampling.temperature=1.0"])
    run = SimpleNamespace(config=cfg, sampler_model_config=config, data=iter([]), sampler_mesh=None, out_dir=tmp_path,
                          tokenizer=SimpleNamespace(stop_ids=(), pad_token_id=0),
                          checkpointer=SimpleNamespace(directory=tmp_path / "checkpoints"))
    with pytest.raises(ValueError, match=rf"step 3 in {tmp_path / 'checkpoints'} .*lacks '{route_leaves[0]}' \(6 "
                                         r"route arrays in all\).*afresh.*model.routing_replay=none"):
        make_partial_rollouts(run, 3, load_in_flight(tmp_path, 3, expected=2))

    restored = saved_routes(load_in_flight(tmp_path, 3, expected=2), sampler, routing_replay="none", checkpoint="")
    sampler.load_state_dict(restored["sampler"]["arrays"], restored["sampler"]["books"])
    # a queue of 4 prompts x 2 samples, 16 new-token positions; 4 queue prompts and a prefill chunk of 4, 16 positions
    routes, prompt_routes = np.asarray(sampler.state.routes), np.asarray(sampler.state.prompt_routes)
    assert routes.shape == (4 * 2, 16, 1, 2) and prompt_routes.shape == (4 + 4, 16, 1, 2)
    assert (routes == -1).all() and (prompt_routes == -1).all()
    groups = restored[3][0] + restored["sampler"]["pending"]
    scored = score_groups(groups, _Tokenizer(), lambda texts, golds, lengths: (np.zeros(4, bool), np.zeros(4)))
    assert scored.routes.shape == (4, 16, 1, 2) and scored.prompt_routes.shape == (4, 16, 1, 2)
    assert (scored.routes == -1).all() and (scored.prompt_routes == -1).all()
