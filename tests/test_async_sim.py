"""benchmarks/async_sim.py: the asynchronous-rollout schedule against hand-computed events, its replay of a run's
metrics.jsonl, and the stage-time model of benchmarks/async_costs.py against hand counts and the measured H200 points;
results/async_sim.json and README's tables are what the script gives today."""

import importlib.util
import json
import math
import pathlib
import random
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


sim = _load("async_sim", ROOT / "benchmarks" / "async_sim.py")
costs = sim.costs
packing = _load("packing_for_async_sim", ROOT / "jaxrl_llm" / "train" / "packing.py")  # numpy only, no JAX


def _times(events, key):
    return [getattr(e, key) for e in events]


# ---- the schedule ---------------------------------------------------------------------------------------------------

def test_sync_is_sample_plus_train_per_step():
    events = sim.simulate([3.0] * 5, 2.0, max_staleness=0)
    assert _times(events, "train_end_s") == [5.0, 10.0, 15.0, 20.0, 25.0]
    assert _times(events, "sample_start_s") == [0.0, 5.0, 10.0, 15.0, 20.0]
    assert [(e.policy_version, e.staleness) for e in events] == [(t, 0) for t in range(5)]


def test_k0_on_any_stage_times_is_the_sum_of_the_stages():
    rng = random.Random(1)
    sample = [rng.lognormvariate(0, 1) for _ in range(20)]
    train = [rng.uniform(0.5, 2) for _ in range(20)]
    for blocks in (True, False):
        events = sim.simulate(sample, train, max_staleness=0, transfer_blocks_trainer=blocks)
        assert _times(events, "train_end_s") == pytest.approx(
            [sum(sample[:t + 1]) + sum(train[:t + 1]) for t in range(20)], rel=1e-12)


def test_k1_events_by_hand():
    # S = 3, T = 2, X = 0.5: the sampler is the bottleneck, max(S, T + X) = 3 s per step.
    events = sim.simulate([3.0] * 4, 2.0, max_staleness=1, transfer_s=0.5)
    assert [(e.sample_start_s, e.sample_end_s, e.train_start_s, e.train_end_s) for e in events] == [
        (0, 3, 3, 5), (3, 6, 6, 8), (6, 9, 9, 11), (9, 12, 12, 14)]
    assert [e.policy_version for e in events] == [0, 0, 1, 2]
    # S = 1, T = 2, X = 0.5: the trainer and its transfer are: T + X = 2.5 s per step, the sampler waits for weights.
    events = sim.simulate([1.0] * 4, 2.0, max_staleness=1, transfer_s=0.5)
    assert [(e.sample_start_s, e.train_start_s, e.train_end_s) for e in events] == [
        (0, 1, 3), (1, 3.5, 5.5), (3.5, 6, 8), (6, 8.5, 10.5)]


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("blocks", [True, False])
def test_steady_state_of_constant_stages(k, blocks):
    # The cycle sample(t) -> train(t) -> publish(t+1) -> sample(t+k+1) spans k+1 steps.
    rng = random.Random(k)
    for _ in range(20):
        s, t, x = rng.uniform(0.1, 3), rng.uniform(0.1, 3), rng.uniform(0, 1)
        events = sim.simulate([s] * 400, t, max_staleness=k, transfer_s=x, transfer_blocks_trainer=blocks)
        period = (events[-1].train_end_s - events[-121].train_end_s) / 120
        expected = max(s, t + x if blocks else t, (s + t + x) / (k + 1))
        assert period == pytest.approx(expected, rel=1e-9)


def test_k2_absorbs_alternating_sampling_times_that_k1_cannot():
    # S alternates 1, 5 (mean 3) and T = 3: by hand, k = 1 settles at 8 s per two steps, k = 2 at 6; sync at 12.
    sample = [1.0, 5.0] * 20
    ends = {k: _times(sim.simulate(sample, 3.0, max_staleness=k), "train_end_s") for k in (0, 1, 2)}
    assert ends[1][:6] == [4, 9, 12, 17, 20, 25]
    assert ends[2][:8] == [4, 9, 12, 15, 18, 21, 24, 27]
    assert [ends[k][-1] - ends[k][-3] for k in (0, 1, 2)] == [12, 8, 6]


def test_staleness_never_exceeds_k_and_no_event_breaks_the_schedule():
    rng = random.Random(7)
    for trial in range(30):
        k, blocks = trial % 5, trial % 2 == 0
        sample = [rng.lognormvariate(0, 1.2) for _ in range(30)]  # a long tail
        train = [rng.uniform(0.2, 3) for _ in range(30)]
        x = [rng.uniform(0, 0.5) for _ in range(30)]
        events = sim.simulate(sample, train, max_staleness=k, transfer_s=x, transfer_blocks_trainer=blocks)
        for t, e in enumerate(events):
            assert e.staleness == t - e.policy_version == min(t, k) <= k
            publish = 0.0 if e.policy_version == 0 else events[e.policy_version - 1].publish_s
            assert e.sample_start_s >= publish and e.train_start_s >= e.sample_end_s
            if t:
                assert e.sample_start_s >= events[t - 1].sample_end_s
                assert e.train_start_s >= (events[t - 1].publish_s if blocks else events[t - 1].train_end_s)
        looser = sim.simulate(sample, train, max_staleness=k + 1, transfer_s=x, transfer_blocks_trainer=blocks)
        assert all(a.train_end_s <= b.train_end_s + 1e-12 for a, b in zip(looser, events))  # more k is never slower


def test_summarize_by_hand():
    sync = sim.summarize(sim.simulate([3.0] * 10, 2.0, max_staleness=0), warmup=2, sampler_busy_s=[2.0] * 10,
                         shared_devices=True)  # 1 s of each 3 s of sampling is scoring on the host
    assert sync["seconds_per_step"] == 5.0 and sync["device_idle"] == pytest.approx(0.2)
    events = sim.simulate([3.0] * 10, 2.0, max_staleness=1, transfer_s=0.5)
    out = sim.summarize(events, warmup=2, trainer_busy_s=[2.5] * 10, sampler_devices=1, trainer_devices=3)
    assert out["seconds_per_step"] == 3.0 and out["staleness"] == {0: 1, 1: 9}
    assert out["sampler_idle"] == 0.0 and out["trainer_idle"] == pytest.approx(1 / 6)
    assert out["device_idle"] == pytest.approx(3 / 4 / 6) and out["sampler_waited_for_weights"] == 0.0
    waits = sim.summarize(sim.simulate([1.0] * 10, 2.0, max_staleness=1, transfer_s=0.5), warmup=2)
    assert waits["seconds_per_step"] == 2.5 and waits["sampler_waited_for_weights"] == 1.0


# ---- replay of a run's metrics.jsonl --------------------------------------------------------------------------------

def _run_rows(k, *, steps=12, handoff_s=0.0, eval_pause_s=0.0, publish=False, seed=3):
    """metrics.jsonl rows as the loop writes them (step = t + 1, evaluation rows without events), from the schedule,
    with `handoff_s` between the moment the trainer may start and the moment it does, and an evaluation of
    `eval_pause_s` after step 5's update, before its weights go to the sampler. publish: the rows carry publish_s
    (version t + 1 handed over) instead of transfer_s (the copy alone)."""
    rng = random.Random(seed)
    sample = [rng.lognormvariate(0, 0.8) for _ in range(steps)]
    train = [rng.uniform(0.5, 2) for _ in range(steps)]
    x = [rng.uniform(0, 0.2) for _ in range(steps)]
    gaps = [xt + (eval_pause_s if t == 4 else 0.0) for t, xt in enumerate(x)]
    events = sim.simulate(sample, [t + handoff_s for t in train], max_staleness=k, transfer_s=gaps, start_s=4.0)
    rows = [{"step": 0, "eval_accuracy": 0.5}]
    for e, xt in zip(events, x):
        rows.append({"step": e.step + 1, "reward": 0.1, "policy_version": e.policy_version, "staleness": e.staleness,
                     "sample_start_s": e.sample_start_s, "sample_end_s": e.sample_end_s,
                     "train_start_s": e.train_start_s + handoff_s, "train_end_s": e.train_end_s,
                     **({"publish_s": e.publish_s} if publish else {"transfer_s": xt})})
        if e.step == 4:
            rows.append({"step": 5, "eval_accuracy": 0.6})
    return rows


def _write(tmp_path, rows):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return sim.read_step_rows(tmp_path)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_replay_of_a_synthetic_run_reproduces_its_events(tmp_path, k):
    rows = _write(tmp_path, _run_rows(k))
    assert [r["step"] for r in rows] == list(range(1, 13))
    result = sim.compare(rows, max_staleness=k)
    assert result["ok"] and all(result["checks"].values()) and result["first_version_mismatch"] is None
    assert result["replayed"]["max_abs_error_s"] < 1e-9 and abs(result["replayed"]["wall_relative_error"]) < 1e-12
    assert all(abs(v) < 1e-9 for lag in result["lags_s"].values() for v in lag.values())
    assert sim.main(["replay", str(tmp_path), "--max-staleness", str(k)]) == 0


def test_replay_measures_a_handoff_overhead(tmp_path):
    rows = _write(tmp_path, _run_rows(1, handoff_s=0.25))
    result = sim.compare(rows, max_staleness=1)
    assert result["ok"]  # late is allowed; early is not
    assert result["lags_s"]["train_start"]["min"] == pytest.approx(0.25)
    assert result["lags_s"]["train_start"]["max"] == pytest.approx(0.25)
    assert result["replayed"]["wall_relative_error"] < 0  # the schedule alone finishes earlier


def test_replay_takes_the_hand_over_time_when_the_rows_carry_it(tmp_path):
    # A 3 s evaluation between step 5's update and its weights' hand-over: with publish_s the replay knows it ...
    rows = _write(tmp_path, _run_rows(1, eval_pause_s=3.0, publish=True))
    result = sim.compare(rows, max_staleness=1)
    assert result["ok"] and result["replayed"]["max_abs_error_s"] < 1e-9
    assert sim.handoff_seconds(rows)[4] == rows[4]["publish_s"] - rows[4]["train_end_s"] > 3.0
    # ... with the copy's seconds alone it shows as step 6's lag, and the free-running replay runs ahead.
    rows = _write(tmp_path, _run_rows(1, eval_pause_s=3.0))
    result = sim.compare(rows, max_staleness=1)
    assert result["ok"] and 0 < result["lags_s"]["train_start"]["max"] <= 3.0 + 1e-9
    assert result["replayed"]["wall_relative_error"] < 0


def test_replay_flags_what_breaks_the_schedule(tmp_path):
    rows = _write(tmp_path, _run_rows(1))
    assert not sim.compare(rows, max_staleness=0)["checks"]["no_event_before_the_schedule_allows"]  # k=1 as k=0
    bad = [dict(r) for r in rows]
    bad[3]["policy_version"] += 1
    result = sim.compare(bad, max_staleness=1)
    assert not result["ok"] and result["first_version_mismatch"] == 3
    assert not result["checks"]["versions_as_scheduled"] and not result["checks"]["staleness_as_recorded"]
    swapped = [dict(r) for r in rows]
    for key in ("train_start_s", "train_end_s"):
        swapped[5][key], swapped[6][key] = swapped[6][key], swapped[5][key]
    assert not sim.compare(swapped, max_staleness=1)["checks"]["trained_in_order"]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _run_rows(1)[:4] +
                                                    _run_rows(1)[5:]), encoding="utf-8")
    with pytest.raises(ValueError, match="not 1, 2, ..., N"):
        sim.read_step_rows(tmp_path)


# ---- the stage-time model -------------------------------------------------------------------------------------------

def test_policy_shape_by_hand():
    p = costs.POLICY
    per_layer = 1536 * (1536 + 256 + 256 + 1536) + 3 * 1536 * 8960  # q, k, v, o; gate, up, down
    assert p.layer_matrix_params == 28 * per_layer == 1_310_195_712
    biases_norms = 1536 + 256 + 256 + 2 * 1536  # q/k/v biases, two RMSNorms a layer
    assert 151_936 * 1536 + 28 * (per_layer + biases_norms) + 1536 == p.params  # tied embedding, final norm
    gpu = json.loads(costs.GPU_RESULTS.read_text(encoding="utf-8"))
    assert gpu["sampler"]["qwen2.5-1.5b 64x8x128"]["params"] == p.params
    assert p.kv_bytes_per_token == 28_672 and p.weight_bytes == 3_087_428_608


def test_length_bucket_is_the_packers():
    assert [costs.length_bucket(n) for n in range(1, 5001)] == [packing.length_bucket(n, 32) for n in range(1, 5001)]


def test_decode_calibration_goes_through_the_measured_points():
    e, o = costs.decode_calibration()
    t1, r1 = 1 / 386.3727333079468, 1 / 902.2094763430434  # results/gpu_h200.json, qwen2.5-1.5b 1x1x128
    t2, r2 = 512 / 80655.34302415949, 512 / 164459.19179273976  # 64x8x128
    assert e == pytest.approx(0.533233, rel=1e-5) and o == pytest.approx(0.50957e-3, rel=1e-4)
    assert o + r1 / e == pytest.approx(t1, rel=1e-12) and o + r2 / e == pytest.approx(t2, rel=1e-12)


TINY = costs.Policy(params=1000, vocab=1, hidden=1, intermediate=1, layers=1, heads=1, kv_heads=1, head_dim=1)


def test_sampler_seconds_by_hand():
    # 8 rows, no prompt: weights 2,000 B, 4 B of cache per token, 4 FLOPs per context token, 2,000 FLOPs per row.
    work = costs.Workload(prompts=1, prompt_tokens=0, max_new_tokens=768)
    gpu = costs.Machine("tiny", 1, 1e6, 1e3, 8.5 * (768 * 4 + 4) / 0.85, "-", 1.0, False, 4.0, "-")
    assert costs.sampler_rows_that_fit(gpu, 0.0, TINY, work) == 8
    lengths = [384] * 7 + [500]  # the longest row sets the call: 384 steps on one tile, 116 on two
    first, second = 2000 + 8 * 384 * 4, 2000 + 8 * 768 * 4  # bytes a step reads: memory-bound (FLOPs ~ 0.03 s)
    device, scoring = costs.sampler_seconds(lengths, 1, gpu, resident_bytes=0.0, calibration=(1.0, 0.0),
                                            policy=TINY, workload=work)
    assert device == pytest.approx(384 * first / 1e3 + 116 * second / 1e3) and scoring == 8 / 4.0
    tpu = costs.Machine("tiny", 1, 1e6, 1e3, gpu.hbm_bytes, "-", 1.0, True, 4.0, "-")  # reads every tile
    device, _ = costs.sampler_seconds(lengths, 1, tpu, resident_bytes=0.0, calibration=(0.5, 0.01), policy=TINY,
                                      workload=work)
    assert device == pytest.approx(500 * (0.01 + second / 1e3 / 0.5))
    with pytest.raises(ValueError, match="no 8 sampled rows fit"):
        costs.sampler_seconds(lengths, 1, gpu, resident_bytes=2000.0, calibration=(1.0, 0.0), policy=TINY,
                              workload=work)


def test_trainer_seconds_by_hand():
    # One mini-batch of two single-response rows of 32 and 64 tokens, padded to 64; no log-prob pass.
    tiny = costs.Policy(params=1, vocab=1, hidden=1, intermediate=1, layers=1, heads=1, kv_heads=1, head_dim=1)
    work = costs.train_work([32, 64], costs.Workload(prompts=2, samples=1, mini_batches=1, logprob_passes=0,
                                                    prompt_tokens=0), tiny)
    # 6 x 7 matrix params x 64 + 6 x scored + 12 x pairs: 2688 + 192 + 6336 and 2688 + 384 + 24960.
    assert work == [(2, 37248.0), (2, 0.0)]
    machine = costs.Machine("tiny", 3, 1000.0, 1.0, 1.0, "-", 1.0, False, 1.0, "-")
    assert costs.trainer_seconds(work, 2, machine, 0.5) == pytest.approx(37248 / (2 * 1000 * 0.5 * 0.9))
    assert costs.trainer_seconds(work, 3, machine, 0.5) == pytest.approx(37248 / 900)  # still one row a device
    assert costs.trainer_seconds(work, 1, machine, 0.5) == pytest.approx(37248 / 500)


def test_measured_train_mfu_and_transfer_by_hand():
    pairs = 1024 * 1025 // 2 + 8 * (3072 * 1024 + 3072 * 3073 // 2)
    flops = 2 * (6 * 1_310_195_712 * 28_672 + 6 * 151_936 * 1536 * 8 * 3072 + 12 * 28 * 12 * 128 * pairs)
    assert costs.measured_train_mfu() == pytest.approx(flops / 33.714942058999995 / 507756013589463.5, rel=1e-12)
    assert costs.measured_train_mfu() == pytest.approx(0.0342, abs=1e-4)
    h200 = costs.h200()
    assert costs.transfer_seconds(4, 4, h200) == pytest.approx(3_087_428_608 / 450e9)  # 6.9 ms over NVLink
    assert costs.transfer_seconds(6, 2, h200) == pytest.approx(3 * 3_087_428_608 / 450e9)
    assert not costs.train_fits(5, costs.V5E) and costs.train_fits(6, costs.V5E) and costs.train_fits(1, h200)


# ---- the recorded prediction ----------------------------------------------------------------------------------------

RESULTS = ROOT / "benchmarks" / "results" / "async_sim.json"


def test_results_and_readme_are_what_the_script_gives():
    recorded = json.loads(RESULTS.read_text(encoding="utf-8"))
    fresh = json.loads(json.dumps(sim.record()))
    assert fresh == recorded, "benchmarks/results/async_sim.json is stale: rerun its command"
    text = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    block = text.split("<!-- async-sim:start -->")[1].split("<!-- async-sim:end -->")[0].strip()
    assert block == sim.markdown(recorded)
    for name, entry in recorded["machines"].items():
        for scenario in entry["scenarios"].values():
            assert all(r["staleness"] == {str(s): 1 for s in range(r["max_staleness"])} |
                       {str(r["max_staleness"]): recorded["steps"] - r["max_staleness"]}
                       for r in sim.async_rows(scenario))
            assert math.isclose(scenario["best"]["1"]["speedup"], max(
                r["speedup"] for r in sim.async_rows(scenario) if r["max_staleness"] == 1))
