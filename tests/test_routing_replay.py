"""Routing replay (R3, issue 57 part 4): `moe.route` with recorded experts against a NumPy reference (values and
the router's gradient), the sampler's recorded experts, the trainer's replay of them, its metrics, and the step
with routing_replay none unchanged. One tiny random Qwen3-MoE, compiled once per pass (module-scoped fixtures)."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jaxrl_llm.models.moe import route, route_dtype


def _route_reference(h, router, recorded, c, top_k, normalize):
    """(weights [N, k], d sum(weights * c) / d router [D, E]) in float64, chosen = recorded where >= 0."""
    logits = h @ router
    own = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    chosen = np.where(recorded[:, :1] >= 0, recorded, own)
    z = np.take_along_axis(logits, chosen, axis=1)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    if normalize:
        w = np.exp(z - z.max(1, keepdims=True))
        w /= w.sum(1, keepdims=True)
        d_z = w * (c - (w * c).sum(1, keepdims=True))
        d_logits = np.zeros_like(logits)
    else:
        w = np.take_along_axis(p, chosen, axis=1)
        d_z = c * w
        d_logits = -p * (c * w).sum(1, keepdims=True)
    for j in range(top_k):
        np.add.at(d_logits, (np.arange(len(h)), chosen[:, j]), d_z[:, j])
    return chosen, w, h.T @ d_logits


@pytest.mark.parametrize("normalize", [True, False])
def test_route_with_recorded_experts_equals_a_numpy_reference(normalize):
    rng = np.random.default_rng(0)
    h, router = rng.normal(size=(5, 3)), rng.normal(size=(3, 6))
    recorded = np.array([[4, 1], [0, 5], [-1, -1], [2, 3], [5, 0]])  # token 2 unrecorded: its own top 2
    c = rng.normal(size=(5, 2))
    chosen, want_w, want_grad = _route_reference(h, router, recorded, c, 2, normalize)

    def weighted(router):
        r = route(jnp.asarray(h, jnp.float32), router, top_k=2, normalize=normalize,
                  experts=jnp.asarray(recorded, jnp.int8))
        return jnp.sum(r.weights * jnp.asarray(c, jnp.float32)), r

    (_, r), grad = jax.value_and_grad(weighted, has_aux=True)(jnp.asarray(router, jnp.float32))
    np.testing.assert_array_equal(r.experts, chosen)
    np.testing.assert_array_equal(r.experts[2], np.argsort(-(h @ router)[2])[:2])
    np.testing.assert_allclose(r.weights, want_w, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
    assert np.abs(want_grad).max() > 0.05  # the router learns through the replayed weights


def test_route_dtype_is_the_smallest_that_holds_the_experts():
    assert route_dtype(8) == jnp.int8 and route_dtype(128) == jnp.int8
    assert route_dtype(129) == jnp.int16 and route_dtype(40000) == jnp.int32


# --- the sampler's routes and the trainer's replay of them, on one tiny random Qwen3-MoE ---------------------------

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import pathlib  # noqa: E402

import optax  # noqa: E402

from jaxrl_llm.models import init_params  # noqa: E402
from jaxrl_llm.run.config import AlgorithmSection  # noqa: E402
from jaxrl_llm.run.state import init_state  # noqa: E402
from jaxrl_llm.sampling import generate  # noqa: E402
from jaxrl_llm.train.routing import load_balancing_loss, load_max_over_mean, routes_changed  # noqa: E402
from jaxrl_llm.train.rollouts import ScoredRollouts, build_train_batches  # noqa: E402
from jaxrl_llm.train.step import make_train_step  # noqa: E402
from jaxrl_llm.tools.env import TurnResult  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "sampler_gap", pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "sampler_gap.py")
gap = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gap)

PROMPTS = gap.MOE_PROMPTS[:3]
SAMPLES, NEW_TOKENS = 4, 10


@pytest.fixture(scope="module")
def moe():
    (config, params), dense = gap.tiny_moe()
    return config, params, gap.scored_rollouts(params, config, PROMPTS, SAMPLES, NEW_TOKENS, seed=1), dense


def test_the_sampler_records_every_fed_token_and_prompt_token(moe):
    config, _, scored, (dense_config, dense_params) = moe
    assert scored.routes.dtype == np.int8 and scored.routes.shape == (12, NEW_TOKENS, 2, 2)
    for row in range(scored.num_samples):
        n, p = scored.lengths[row], len(PROMPTS[scored.prompt_index[row]])
        assert (scored.routes[row, :n - 1] >= 0).all() and (scored.routes[row, n - 1:] == -1).all()
        assert (scored.prompt_routes[row, :p] >= 0).all() and (scored.prompt_routes[row, p:] == -1).all()
        assert (scored.routes[row] < config.num_experts).all()
    rollout = generate(dense_params, dense_config, PROMPTS[:1], num_samples=1, max_new_tokens=2, rng=jax.random.key(0))
    assert rollout.routes is None and rollout.prompt_routes is None  # a dense model records nothing


def test_the_continuous_engine_records_the_static_engines_routes(moe):
    """The continuous engine (5 slots for 12 samples: slots turn over, prompts prefilled on demand) draws the static
    engine's rollout and records the same experts for every prompt token and fed token (-1 elsewhere)."""
    config, params, scored, _ = moe
    rollout = generate(params, config, PROMPTS, num_samples=SAMPLES, max_new_tokens=NEW_TOKENS, temperature=1.0,
                       rng=jax.random.key(1), engine="continuous", max_slots=5)
    np.testing.assert_array_equal(rollout.tokens, scored.tokens)
    assert rollout.routes.dtype == np.int8 and (rollout.routes >= 0).sum() > 0
    np.testing.assert_array_equal(rollout.routes, scored.routes)
    np.testing.assert_array_equal(rollout.prompt_routes, scored.prompt_routes)


def test_shift_slots_moves_the_routes_with_their_samples_and_prompts(moe):
    """`continuous.shift_slots` (an endless queue): sample rows and queue prompt rows leave the front, their routes
    with them; the freed rows at the back hold -1 (nothing recorded)."""
    from jaxrl_llm.sampling import continuous

    config = moe[0]
    cache = continuous.empty_prompt_cache(config, 4, 8)
    queue = continuous.PromptQueue(jnp.zeros((6, 8), jnp.int32), jnp.ones(6, jnp.int32), jnp.full(6, 2, jnp.int32),
                                   jnp.arange(0, 14, 2, dtype=jnp.int32), jnp.int32(4))
    state = continuous.start_slots(config, cache, queue, jnp.repeat(jnp.arange(4), 2), jnp.int32(0), slots=2,
                                   new_token_bucket=4)
    assert state.routes.shape == (8, 4, 2, 2) and state.prompt_routes.shape == (6, 8, 2, 2)
    assert (np.asarray(state.routes) == -1).all()
    rows = np.arange(8, dtype=np.int8)[:, None, None, None] * np.ones((8, 4, 2, 2), np.int8)
    prompts = np.arange(6, dtype=np.int8)[:, None, None, None] * np.ones((6, 8, 2, 2), np.int8)
    state = dataclasses.replace(state, routes=jnp.asarray(rows), prompt_routes=jnp.asarray(prompts))
    out = continuous.shift_slots(state, jnp.int32(1), jnp.int32(2), jnp.int32(0))
    np.testing.assert_array_equal(np.asarray(out.routes)[:, 0, 0, 0], [2, 3, 4, 5, 6, 7, -1, -1])
    np.testing.assert_array_equal(np.asarray(out.prompt_routes)[:, 0, 0, 0], [1, 2, 3, 4, 5, -1])


def test_f32_sampler_logprobs_and_routes_equal_the_trainers(moe):
    config, params, scored, _ = moe
    fed = int(np.maximum(scored.lengths - 1, 0).sum())
    for replay in ("none", "rollout"):
        found = gap.trainer_gap(params, config, scored, replay)
        assert found["max_abs_d"] < 1e-4  # f32 rounding of log-probs of size ~5
        assert found["routes_changed"] == 0 and found["routes_own_changed"] == 0
        # every recorded route: the prompts' tokens (once per packed row) and each response's fed tokens, 2 layers
        assert found["routes_recorded"] == 2 * (fed + sum(len(p) for p in PROMPTS))


@pytest.fixture(scope="module")
def bf16_gap():
    """The bf16 sampler's gap to the f32 trainer (4 sampler calls of 6 prompts x 8 samples x 16 tokens) without and
    with replay, and that of the dense model with the MoE's active width and weights (`sampler_gap.matched_dense`):
    `sampler_gap.moe_rows`."""
    rows = gap.moe_rows(settings=("bfloat16",), models=("moe", "dense_matched"))
    return {(r["model"], r["routing_replay"]): r for r in rows}


def test_bf16_sampler_replay_brings_routes_changed_to_zero_and_kl_to_the_dense_floor(bf16_gap):
    none, replay, dense = bf16_gap["moe", "none"], bf16_gap["moe", "rollout"], bf16_gap["dense_matched", "none"]
    assert none["routes_changed"] > 0.02 and none["routes_changed"] == none["routes_own_changed"]
    assert replay["routes_changed"] == 0 and replay["routes_own_changed"] > 0  # the trainer's own top k still differ
    # measured (benchmarks/results/sampler_gap_moe.json): 0.0188 without replay, 0.0060 with, the dense model 0.0054
    assert none["mismatch_kl_f64"] > 2 * dense["mismatch_kl_f64"]
    assert replay["mismatch_kl_f64"] < 1.25 * dense["mismatch_kl_f64"]
    assert replay["max_abs_d"] < none["max_abs_d"]


def test_route_metrics_by_hand():
    own = jnp.array([[[0, 1], [2, 3]], [[1, 0], [3, 2]], [[4, 5], [6, 7]]])  # [tokens 3, layers 2, k 2]
    recorded = jnp.array([[[1, 0], [2, 4]], [[-1, -1], [-1, -1]], [[5, 4], [7, 6]]])
    changed, counted = routes_changed(own, recorded)  # token 0 layer 1 differs; token 1 not recorded
    assert (float(changed), float(counted)) == (1.0, 4.0)
    load = jnp.array([[2.0, 2.0, 2.0, 2.0], [6.0, 2.0, 0.0, 0.0]])
    assert float(load_max_over_mean(load)) == pytest.approx((1.0 + 3.0) / 2)
    probs = jnp.array([[1.0, 1.0, 1.0, 1.0], [2.0, 1.0, 0.5, 0.5]])
    # layer 0: 4 * sum(1/4 * 1/4) = 1; layer 1: 4 * (6/8 * 2/4 + 2/8 * 1/4) = 1.75
    assert float(load_balancing_loss(load, probs)) == pytest.approx((1.0 + 1.75) / 2)


@pytest.fixture(scope="module")
def train_batch(moe):
    """The f32 policy's own rollout as one packed training mini-batch (micro-batches of 2 rows), and its denominator."""
    scored = moe[2]
    advantages = np.where(scored.mask > 0, np.linspace(-1, 1, scored.num_samples)[:, None], 0).astype(np.float32)
    (batch, denom, _), = build_train_batches(scored, advantages, scored.logprobs, np.zeros_like(scored.logprobs),
                                             AlgorithmSection(), mini_batches=1, micro_batch_size=2, pad_id=0,
                                             rng=np.random.default_rng(0))
    return batch, denom


@pytest.fixture(scope="module")
def steps(moe, train_batch):
    """One optimizer update of the f32 policy on its own rollout's batch: without routes (today's step), with the
    routes and routing_replay none, and with rollout plus the load-balancing loss."""
    config, params, _, _ = moe
    batch, denom = train_batch
    algo = AlgorithmSection()
    optimizer = optax.adam(1e-3)
    out = {}
    for name, routes, kwargs in [("today", None, {}), ("none", batch.routes, {}),
                                 ("rollout", batch.routes, dict(routing_replay="rollout", router_aux_loss_coef=0.5))]:
        step = make_train_step(config, algo, optimizer, micro_batch_size=2, **kwargs)
        state = init_state(jax.tree_util.tree_map(jnp.array, params), optimizer)
        out[name] = jax.device_get(step(state, batch._replace(routes=routes), np.float32(denom)))
    return out


def test_routing_replay_none_is_bitwise_todays_step(steps):
    (today, today_metrics), (none, none_metrics) = steps["today"], steps["none"]
    for a, b in zip(jax.tree_util.tree_leaves(today.params), jax.tree_util.tree_leaves(none.params)):
        np.testing.assert_array_equal(a, b)
    for key, value in today_metrics.items():
        np.testing.assert_array_equal(value, none_metrics[key])
    assert none_metrics["routes_changed"] == 0 and none_metrics["expert_load_max_over_mean"] >= 1


def test_rollout_replay_step_with_the_load_balancing_loss(steps):
    (_, none), (state, replay) = steps["none"], steps["rollout"]
    assert replay["routes_changed"] == 0 and replay["finite"] == 1
    # the f32 sampler routed as the trainer: replay changes nothing but adds 0.5 x the balancing loss (>= 1)
    assert replay["router_aux_loss"] >= 1
    np.testing.assert_allclose(replay["loss"], none["loss"] + 0.5 * replay["router_aux_loss"], rtol=1e-5)
    np.testing.assert_allclose(replay["policy_loss"], none["policy_loss"], rtol=1e-5)


def _moved(routes, num_experts: int):
    """Recorded routes with every expert moved on by one, (e + 1) mod E (-1 kept): never a token's own top k."""
    return np.where(routes >= 0, (routes.astype(np.int32) + 1) % num_experts, -1).astype(routes.dtype)


def test_rollout_correction_weighs_the_replayed_logprobs(moe, bf16_gap):
    """TIS and MIS (algorithm.rollout_correction, `train.algorithms.rollout_weights`) on the trainer's replayed
    log-probs, as the loop computes them: with the sampler's own routes (f32 sampler) every weight is 1 to f32
    rounding and nothing is corrected; replaying experts the sampler did not use moves the trainer's log-probs,
    and the correction sees it (routes_changed stays 0: the trainer took the recorded experts)."""
    from jaxrl_llm.train.algorithms import rollout_weights

    config, params, scored, _ = moe
    mask, sampler = scored.mask, scored.logprobs * scored.mask
    tis = AlgorithmSection(rollout_correction="token")
    mis = AlgorithmSection(rollout_correction="sequence", rollout_correction_mode="mask", rollout_correction_low=0.5)
    train, _, _ = gap.trainer_logprobs(params, config, scored, "rollout")
    for algo in (tis, mis):
        weights, found = rollout_weights(algo, train, sampler, mask)
        np.testing.assert_allclose(weights[mask > 0], 1.0, atol=2e-4)
        assert found["rollout_corrected_fraction"] == 0
    moved = dataclasses.replace(scored, routes=_moved(scored.routes, config.num_experts),
                                prompt_routes=_moved(scored.prompt_routes, config.num_experts))
    train, ((changed, recorded), (own, _), _), _ = gap.trainer_logprobs(params, config, moved, "rollout")
    assert float(changed) == 0 and float(own) > 0.9 * float(recorded)  # own top k: of the replayed hidden states
    for algo in (tis, mis):
        weights, found = rollout_weights(algo, train, sampler, mask)
        assert found["rollout_corrected_fraction"] > 0.05
        assert np.all(weights[mask > 0] <= 2.0) and np.all(weights >= 0)
    # the bf16 sampler: replay leaves TIS (token, truncate at 2) fewer tokens to cap (measured 0.0059 -> 0.0016)
    none, replay = bf16_gap["moe", "none"], bf16_gap["moe", "rollout"]
    assert replay["tis_corrected_fraction"] < none["tis_corrected_fraction"] / 2


def test_expert_adapters_with_replay(moe, train_batch):
    """LoRA on the experts (lora.targets experts) with routing replay: the attached adapters' replayed log-probs are
    the merged weights' (replaying experts the trainer would not choose), and a LoRA train step with replay routes
    as recorded and moves every adapter."""
    from jaxrl_llm.models import lora

    config, params, scored, _ = moe
    spec = lora.LoraSpec(rank=2, alpha=4.0, targets=lora.resolve_targets("experts"))
    shapes = lora.adapter_shapes(config, spec)["layers"]
    keys = jax.random.split(jax.random.key(7), len(shapes))
    adapters = {"layers": {name: 0.2 * jax.random.normal(key, shape)
                           for key, (name, shape) in zip(keys, shapes.items())}}
    moved = dataclasses.replace(scored, routes=_moved(scored.routes, config.num_experts),
                                prompt_routes=_moved(scored.prompt_routes, config.num_experts))
    attached, ((changed, recorded), (own, _), _), _ = gap.trainer_logprobs(lora.attach(params, adapters, spec.scale),
                                                                           config, moved, "rollout")
    merged, _, _ = gap.trainer_logprobs(lora.merge(params, adapters, spec.scale), config, moved, "rollout")
    base, _, _ = gap.trainer_logprobs(params, config, moved, "rollout")
    np.testing.assert_allclose(attached, merged, atol=2e-5)
    assert np.abs(attached - base).max() > 0.05  # the adapters move the replayed log-probs
    assert float(changed) == 0 and float(own) > 0.9 * float(recorded)

    batch, denom = train_batch
    optimizer = optax.adam(1e-2)
    step = make_train_step(config, AlgorithmSection(), optimizer, micro_batch_size=2, frozen=params,
                           lora_scale=spec.scale, routing_replay="rollout")
    state, metrics = jax.device_get(step(init_state(jax.tree_util.tree_map(jnp.array, adapters), optimizer),
                                         batch._replace(routes=_moved(batch.routes, config.num_experts)),
                                         np.float32(denom)))
    assert metrics["finite"] == 1 and metrics["routes_changed"] == 0 and metrics["routes_own_changed"] > 0.9
    for name, value in adapters["layers"].items():
        assert np.abs(state.params["layers"][name] - np.asarray(value)).max() > 1e-3, name


def test_async_in_flight_rollouts_keep_their_routes(moe, tmp_path):
    from jaxrl_llm.train.async_rollouts import load_in_flight, save_in_flight

    scored = moe[2]
    save_in_flight(tmp_path, 3, {4: (scored, {})})
    back, _ = load_in_flight(tmp_path, 3, expected=1)[4]
    np.testing.assert_array_equal(back.routes, scored.routes)
    np.testing.assert_array_equal(back.prompt_routes, scored.prompt_routes)
    np.testing.assert_array_equal(back.logprobs, scored.logprobs)


def test_partial_rollouts_hand_over_routes_that_replay_exactly(moe, tmp_path):
    """Partial rollouts (`PartialSampler`: 5 slots, segments of 3 iterations, the queue shifting) hand over the
    static engine's rollout with its routes, prompt and fed tokens alike; as the trainer's batch, routing replay
    changes none of them and the log-probs agree (f32). Saved beside a checkpoint (groups and engine state) and
    restored, the sampler hands over the same routes next."""
    from jaxrl_llm.train.async_rollouts import load_in_flight, save_in_flight
    from jaxrl_llm.train.partial_rollouts import PartialSampler, score_groups

    config, params, scored, _ = moe

    def sampler():
        stream = iter(range(10 ** 6))
        return PartialSampler(config, next_records=lambda: [{"prompt_ids": PROMPTS[next(stream) % 3], "answer": ""}],
                              group_size=SAMPLES, batch_groups=2, prompt_bucket=8, max_new_tokens=NEW_TOKENS,
                              segment_iterations=3, temperature=1.0, top_p=1.0, top_k=0, stop_ids=(), pad_id=0,
                              key=jax.random.key(1), slots=5)

    first, groups = sampler(), []
    while len(groups) < 3:
        groups += first.segment(params, 0)
    groups = sorted(groups, key=lambda g: g.index)[:3]
    assert [g.index for g in groups] == [0, 1, 2]
    partial = score_groups(groups, _Words(), lambda texts, golds, lengths: (np.zeros(len(texts), bool),
                                                                            np.zeros(len(texts), np.float32)))
    np.testing.assert_array_equal(partial.tokens, scored.tokens)
    np.testing.assert_array_equal(partial.routes, scored.routes)
    width = scored.prompt_routes.shape[1]  # the static call's prompt bucket (8); the partial sampler's is 16
    np.testing.assert_array_equal(partial.prompt_routes[:, :width], scored.prompt_routes)
    assert (partial.prompt_routes[:, width:] == -1).all()
    found = gap.trainer_gap(params, config, partial, "rollout")
    assert found["routes_changed"] == 0 and found["routes_own_changed"] == 0 and found["max_abs_d"] < 1e-4
    assert found["routes_recorded"] == 2 * (int(np.maximum(scored.lengths - 1, 0).sum()) + sum(map(len, PROMPTS)))

    arrays, books = first.state_dict()
    save_in_flight(tmp_path, 1, {1: (groups[:2], {}), "sampler": {
        "arrays": arrays, "books": books, "next_step": 2, "pending": groups[2:], "dropped": 0, "drawn": 0,
        "schedule": {}}})
    restored = load_in_flight(tmp_path, 1, expected=2)
    back = restored[1][0] + restored["sampler"]["pending"]
    for a, b in zip(groups, back):
        np.testing.assert_array_equal(a.routes, b.routes)
        np.testing.assert_array_equal(a.prompt_routes, b.prompt_routes)
    second = sampler()
    second.load_state_dict(restored["sampler"]["arrays"], restored["sampler"]["books"])
    ahead = {}
    for one in (first, second):
        while one not in ahead:
            handed = one.segment(params, 0)
            if handed:
                ahead[one] = handed
    for a, b in zip(ahead[first], ahead[second]):
        assert a.index == b.index and (a.routes >= 0).any()
        np.testing.assert_array_equal(a.routes, b.routes)
        np.testing.assert_array_equal(a.prompt_routes, b.prompt_routes)


class _Words:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_gvm_stage_rows_keep_their_routes():
    from jaxrl_llm.train.gvm import reuse_stage1

    def rollouts(prompt_index, first_id, prompt_width):
        n = len(prompt_index)
        ids = np.arange(first_id, first_id + n, dtype=np.int8)
        return ScoredRollouts(records=[{}, {}], prompt_index=np.array(prompt_index), tokens=np.zeros((n, 3), np.int32),
                              mask=np.ones((n, 3), np.float32), logprobs=np.zeros((n, 3), np.float32),
                              lengths=np.full(n, 3), rewards=np.zeros(n, np.float32), correct=np.zeros(n, bool),
                              routes=np.broadcast_to(ids[:, None, None, None], (n, 3, 1, 2)).copy(),
                              prompt_routes=np.broadcast_to(ids[:, None, None, None], (n, prompt_width, 1, 2)).copy())

    # prompt 0 keeps its 2 stage-1 rows and gains 1 fresh one, prompt 1 keeps 1 of its 2
    stage2 = reuse_stage1(rollouts([0, 0, 1, 1], 0, 4), rollouts([0], 10, 3), np.array([3, 1]))
    np.testing.assert_array_equal(stage2.routes[:, 0, 0, 0], [0, 1, 10, 2])
    np.testing.assert_array_equal(stage2.prompt_routes[:, :, 0, 0], [[0] * 4, [1] * 4, [10, 10, 10, -1], [2] * 4])


def test_rollout_replay_is_accepted_wherever_the_sampler_records_routes():
    """Either engine records routes on single-turn rollouts, whole or partial, and on tool rollouts: routing_replay
    rollout loads with each of them."""
    from jaxrl_llm.run.config import load_config

    for other in (["sampling.engine=static"], ["sampling.engine=continuous"], ["rollouts.mode=partial"],
                  ["tools.env=python"], ["tools.env=calculator", "sampling.engine=continuous"]):
        config = load_config(None, ["model.routing_replay=rollout", *other])
        assert config.model.routing_replay == "rollout"


class _Ids:
    """Token ids written as their decimal numbers ("33 44 55"), end of sequence 2."""

    vocab_size, pad_token_id, stop_ids = 64, 0, (2,)

    def encode(self, text, add_special_tokens=False):
        return [int(word) for word in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


class _AnswerOnce:
    """A turn stops at every token whose number holds a 1 (16 of the 64); the first stop is a tool call, answered
    by three tokens the model did not sample; the next ends the conversation (tools.max_turns 1)."""

    stop_strings = ("1",)

    def step(self, record, text, *, ended, calls_left=1):
        if ended or calls_left < 1:
            return TurnResult("end")
        return TurnResult("observe", observation="33 44 55", tool_call=True)


def _tool_rollouts(params, config, engine: str, reuse_prompt_prefill: bool = True) -> ScoredRollouts:
    """`PROMPTS` x `SAMPLES` conversations of `NEW_TOKENS` tokens with `_AnswerOnce` as the trainer gets them
    (`rollouts.sample_and_score` with tools; re-prefilled rounds: `generate_multiturn` itself)."""
    from jaxrl_llm.run.config import SamplingSection, ToolsSection
    from jaxrl_llm.sampling.multiturn import generate_multiturn
    from jaxrl_llm.train.rollouts import ToolUse, sample_and_score

    records = [{"prompt_ids": p, "answer": ""} for p in PROMPTS]
    rng = jax.random.key(1)
    if reuse_prompt_prefill:
        sampling = SamplingSection(max_new_tokens=NEW_TOKENS, engine=engine, max_slots=5)
        tools = ToolUse(_AnswerOnce(), ToolsSection(env="calculator", max_turns=1, segment_iterations=3))
        return sample_and_score(params, config, _Ids(), records, SAMPLES, sampling,
                                lambda texts, golds, lengths: (np.zeros(len(texts), bool),
                                                               np.zeros(len(texts), np.float32)), rng, tools=tools)
    out = generate_multiturn(params, config, _Ids(), records, _AnswerOnce(), num_samples=SAMPLES,
                             max_new_tokens=NEW_TOKENS, max_turns=1, rng=rng, reuse_prompt_prefill=False)
    n = len(out.lengths)
    return ScoredRollouts(records=records, prompt_index=out.prompt_index, tokens=out.tokens, mask=out.mask,
                          logprobs=out.logprobs, lengths=out.lengths, rewards=np.zeros(n, np.float32),
                          correct=np.zeros(n, bool), routes=out.routes, prompt_routes=out.prompt_routes)


@pytest.mark.parametrize("engine, reuse_prompt_prefill", [("static", True), ("continuous", True), ("static", False)])
def test_tool_rollouts_record_the_routes_of_every_token_the_trainer_sees(moe, engine, reuse_prompt_prefill):
    """Tool rollouts (`sampling.multiturn`: rounds from the prompt's shared prefill, the continuous engine's slots, or
    rounds that re-prefill each conversation) record the experts of every token the trainer's forward runs over:
    the prompt's, the model's own and the tool's answer fed between its turns (loss mask 0). The f32 trainer's own
    top k over the whole packed sequence equals them at every recorded position (-1 past the prompt and from the
    last token on, never fed), and replaying them leaves its log-probs the sampler's."""
    config, params, _, _ = moe
    scored = _tool_rollouts(params, config, engine, reuse_prompt_prefill)
    observed = (scored.mask == 0) & (np.arange(NEW_TOKENS) < scored.lengths[:, None])  # the tool's answers
    after = np.cumsum(observed, axis=1) > 0
    assert ((scored.mask > 0) & after).any(), "no model token after a tool answer: the test exercises none"
    assert scored.routes.dtype == np.int8 and scored.routes.shape == (12, NEW_TOKENS, 2, 2)
    for row in range(scored.num_samples):
        n, p = scored.lengths[row], len(PROMPTS[scored.prompt_index[row]])
        assert (scored.routes[row, :n - 1] >= 0).all() and (scored.routes[row, n - 1:] == -1).all()
        assert (scored.prompt_routes[row, :p] >= 0).all() and (scored.prompt_routes[row, p:] == -1).all()
    fed = int(np.maximum(scored.lengths - 1, 0).sum())
    for replay in ("none", "rollout"):
        found = gap.trainer_gap(params, config, scored, replay)
        assert found["routes_own_changed"] == 0 and found["routes_changed"] == 0
        assert found["routes_recorded"] == 2 * (fed + sum(len(p) for p in PROMPTS))
        assert found["max_abs_d"] < 1e-4  # on the model's tokens; f32 rounding of log-probs of size ~5


def test_bf16_tool_rollouts_replay_with_no_route_changed(moe):
    """A bf16 sampler copy's tool rollouts (on the continuous engine's slots): the f32 trainer's own top k differs
    from some recorded routes; replaying them it takes the recorded experts at every recorded position, the tool's
    answers included (routes_changed 0), and its log-probs come closer to the sampler's."""
    config, params, _, _ = moe
    scored = _tool_rollouts(*gap.sampler_copy(params, config, "bfloat16"), "continuous")
    assert ((scored.mask == 0) & (np.arange(NEW_TOKENS) < scored.lengths[:, None])).any()
    fed = int(np.maximum(scored.lengths - 1, 0).sum())
    none, replay = (gap.trainer_gap(params, config, scored, r) for r in ("none", "rollout"))
    assert replay["routes_recorded"] == 2 * (fed + sum(len(p) for p in PROMPTS))
    assert none["routes_changed"] > 0 and none["routes_changed"] == none["routes_own_changed"]
    assert replay["routes_changed"] == 0
    # measured: routes_changed 0.030 -> 0, mismatch KL 0.0052 -> 0.0036
    assert replay["mismatch_kl_f64"] < none["mismatch_kl_f64"]


def test_the_compiled_train_batch_carries_routes_as_a_runs():
    """`jaxrl-llm compile`'s train-step batch holds a mixture's routes per packed token and sparse layer, in the
    smallest id dtype, as a run's batch on a mesh does (`RunSetup.place_batch`); a dense model's has none."""
    from jaxrl_llm.capacity.aot import batch_shapes
    from jaxrl_llm.models import ModelConfig
    from jaxrl_llm.run.config import load_config
    from jaxrl_llm.run.shapes import step_shapes

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=8, model_type="qwen3_moe", qk_norm=True, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(0,))
    cfg = load_config(None, ["model.routing_replay=rollout"])
    shapes = step_shapes(cfg, {"data": 1, "fsdp": 1, "tensor": 1})
    routes = batch_shapes(cfg, shapes, config).routes
    sparse = sum(config.sparse_layers())
    assert sparse == 2  # layer 0 dense
    assert routes.shape == (shapes.mini_batch_rows, shapes.row_length, sparse, config.num_experts_per_tok)
    assert routes.dtype == route_dtype(config.num_experts)
    assert batch_shapes(cfg, shapes, config.replace(num_experts=0)).routes is None
    assert batch_shapes(cfg, shapes).routes is None  # no model given: the dense batch


def test_the_loop_logs_the_route_metrics_of_every_step(tmp_path):
    """A mixture of experts trained by the loop itself: each step's row of metrics.jsonl carries what the train
    step computes for its routes (with replay of an f32 sampler's routes no route changes, the trainer's own top k
    equals the sampler's, the load is at least the mean's, the balancing loss at least 1), and the update's other
    figures (advantage_mean)."""
    from jaxrl_llm import models
    from jaxrl_llm.models.bundled import bundled_gguf_path
    from jaxrl_llm.models.tokenizer import Tokenizer
    from jaxrl_llm.run.metrics import read_metrics
    from jaxrl_llm.train import load_config
    from jaxrl_llm.train.loop import train

    tokenizer = Tokenizer.from_gguf(bundled_gguf_path())
    config = models.ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=48, num_layers=2,
                                num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True, tie_word_embeddings=True,
                                model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=16, norm_topk_prob=True, moe_impl="ragged_dot")
    params = models.init_params(config, jax.random.PRNGKey(0))
    overrides = ["train.steps=2", "train.eval_problems=0", "algorithm.kl_coef=0", "sampling.prompts_per_step=2",
                 "sampling.samples_per_prompt=2", "sampling.max_new_tokens=6", "optim.micro_batch_size=4",
                 "optim.lr=1e-3", "train.save_every=0",
                 "algorithm.entropy_coef=0.1",  # the untrained policy's rewards are all 0: the entropy term updates
                 "model.routing_replay=rollout", "model.router_aux_loss_coef=0.01", f"train.out_dir={tmp_path}"]
    summary = train(load_config(None, overrides), policy=(config, params, tokenizer), log=lambda *_: None)
    assert summary["status"] == "done"
    rows = [row for row in read_metrics(tmp_path) if "loss" in row]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["routes_changed"] == 0 and row["routes_own_changed"] == 0, row
        assert row["expert_load_max_over_mean"] >= 1 and row["router_aux_loss"] >= 1, row
        assert "advantage_mean" in row and "finite" not in row and row["skipped_update"] == 0
