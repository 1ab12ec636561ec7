"""benchmarks/partial_sim.py: the partial-rollout schedule against hand-computed events (2 slots, fixed lengths), the
queue's window holding admissions back, the continuous sampler's iteration cost by hand, and
results/partial_sim.json against what the script gives."""

import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


sim = _load("partial_sim", ROOT / "benchmarks" / "partial_sim.py")
costs = sim.costs
LENGTHS = [3, 1, 2, 2] + [1] * 20


def _sampler(slots=2, window=100, lengths=LENGTHS):
    return sim.Sampler(lambda k: lengths[k], slots=slots, group_size=1, window=window,
                       iteration_s=lambda busy, tokens: 1.0, prefill_s=0.0)


@pytest.mark.parametrize("shared", [False, True])
def test_two_slots_by_hand(shared):
    # 1-sample groups, 2 slots, 1 s an iteration, segments of 2 iterations, B = 1, lag 1, bound 1, updates of 2.5 s.
    # Segment 0 (v0): samples 0 (3 tokens) and 1 (1) in, 2 (2) takes 1's slot; hands over [1] at 2 s: batch 0.
    # Segment 1 (v0): 0 and 2 end, 3 (2) and 4 (1) in; hands over [0, 2, 4] at 4 s (shared: 6.5 s, after update 0):
    #   0 is batch 1 (staleness 1); 2 and 4, written from version 0, would join step 2: 2 > 1, dropped.
    # Segment 2 (v1, published at 4.5 s): 3 and 5 end, 6 and 7 in; hands over [3, 5, 6, 7]: 3 (v0) dropped, 5 (v1)
    #   is batch 2.
    sampler = _sampler()
    events = sim.simulate_partial(sampler, lambda prompts: 2.5, steps=3, batch_groups=1, lag=1, max_staleness=1,
                                  segment_iterations=2, shared=shared)
    got = [(e.step, e.ready_s, e.train_start_s, e.train_end_s, e.publish_s, e.staleness_max, e.dropped)
           for e in events]
    if shared:  # the updates hold the devices: the sampler resumes after each
        assert got == [(0, 2, 2, 4.5, 4.5, 0, 0), (1, 6.5, 6.5, 9, 9, 1, 0), (2, 11, 11, 13.5, 13.5, 1, 3)]
    else:
        assert got == [(0, 2, 2, 4.5, 4.5, 0, 0), (1, 4, 4.5, 7, 7, 1, 0), (2, 6.5, 7, 9.5, 9.5, 1, 3)]
    assert sampler.iterations == 6 and sampler.busy_iterations == 12  # both slots busy throughout
    summary = sim.summarize(events, sampler, warmup=1)  # steps 1-2: (train_end(2) - train_end(0)) / 2
    assert summary == {"seconds_per_step": 4.5 if shared else 2.5, "slot_occupancy": 1.0, "staleness_max": 1,
                       "dropped_groups": 3, "trainer_wait_s": 2.0 if shared else 0.0}  # ready - last publish
    assert sampler.front == 8 and sampler.next_sample == 8


def test_transfer_and_lag_by_hand():
    # Lag 0: every segment waits for the newest version. Batch 0 at 2 s, update 2..4.5, publish at 5 (X = 0.5);
    # segment 1 (v1) starts at 5: 0 and 2 end at 6, batch 1 = [0] ready at 7; 2 and 4 join step 2 at staleness
    # 2 - 0 > 1 and are dropped.
    events = sim.simulate_partial(_sampler(), lambda prompts: 2.5, steps=2, batch_groups=1, lag=0, max_staleness=1,
                                  segment_iterations=2, transfer_s=0.5)
    assert [(e.ready_s, e.train_start_s, e.publish_s) for e in events] == [(2, 2, 5), (7, 7, 10)]


def test_the_window_holds_admissions_back():
    # Window of 2 prompts: sample 0 (5 tokens) keeps the queue's front, so sample 2 waits for it though slots are free.
    sampler = _sampler(slots=4, window=2, lengths=[5] + [1] * 20)
    for _ in range(4):
        assert sampler.segment(0, 1) in ([1], [])
    assert sampler.next_sample == 2 and sampler.front == 0 and sampler.busy_iterations == 5  # 2 + 1 + 1 + 1
    assert sampler.segment(0, 1) == [0] and sampler.front == 2
    sampler.segment(0, 1)
    assert sampler.next_sample == 4  # 2 and 3 admitted once the front moved


def test_prompts_prefilled_a_chunk_at_a_time_keep_the_version_of_their_prefill():
    # 1 slot, 2-token samples, prompts prefilled 2 at a time (0.5 s each): prompt 1 is prefilled with prompt 0 under
    # version 0, so its group's oldest token is version 0 though it decodes in the segment of version 1.
    sampler = sim.Sampler(lambda k: 2, slots=1, group_size=1, window=100, iteration_s=lambda busy, tokens: 1.0,
                          prefill_s=0.5, chunk=2)
    assert [sampler.segment(v, 2) for v in (0, 1, 2)] == [[0], [1], [2]]
    assert sampler.oldest == {0: 0, 1: 0, 2: 2, 3: 2} and sampler.now == 1 + 2 + 2 + 1 + 2


def test_a_chunk_waits_for_free_prompt_entries():
    # 4 slots, chunks of 2 prompts, 2 entries: prompts 0 (1 token) and 1 (3 tokens) hold both entries, so prompts 2
    # and 3 are prefilled only once 1 has ended (after iteration 3), though slots are free from iteration 1 on.
    sampler = sim.Sampler(lambda k: [1, 3, 1, 1][k], slots=4, group_size=1, window=100,
                          iteration_s=lambda busy, tokens: 1.0, prefill_s=0.0, chunk=2, entries=2)
    assert sampler.segment(0, 3) == [0, 1] and sampler.next_sample == 2 and sampler.busy_iterations == 2 + 1 + 1
    assert sampler.segment(1, 1) == [2, 3] and sampler.oldest[2] == 1


def test_iteration_cost_by_hand():
    # 1,000 parameters (2,000 B of weights), 4 B of cache and 4 attention FLOPs per context token; 8-token prompts,
    # one sample each; 2 devices, 4 busy slots with 400 tokens so far: 2 slots a device, 200 tokens + half a tile
    # (192) each on the GPU, every tile (768) on the TPU; memory-bound.
    tiny = costs.Policy(params=1000, vocab=1, hidden=1, intermediate=1, layers=1, heads=1, kv_heads=1, head_dim=1)
    work = costs.Workload(prompts=1, samples=1, prompt_tokens=8, max_new_tokens=768)
    gpu = costs.Machine("tiny", 2, 1e6, 1e3, 1.0, "-", 1.0, False, 1.0, "-")
    iteration_s, prefill_s = sim.decode_cost(gpu, 2, (1.0, 0.0), tiny, work)
    assert iteration_s(4, 400) == pytest.approx((2000 + (2 * 8 + 200 + 2 * 192) * 4) / 1e3)
    assert prefill_s == pytest.approx(2 * 1000 * 8 / (1e6 * 2))
    tpu = costs.Machine("tiny", 2, 1e6, 1e3, 1.0, "-", 1.0, True, 1.0, "-")
    iteration_s, _ = sim.decode_cost(tpu, 2, (0.5, 0.01), tiny, work)
    assert iteration_s(4, 400) == pytest.approx(0.01 + (2000 + (2 * 8 + 2 * 768) * 4) / 1e3 / 0.5)


RESULTS = ROOT / "benchmarks" / "results" / "partial_sim.json"


def test_results_are_what_the_script_gives():
    recorded = json.loads(RESULTS.read_text(encoding="utf-8"))
    assert recorded["validation"] == sim.validation()  # results/partial_sim_validation.json, its step times left out
    entry = recorded["h200x8"]
    layouts = entry["partial_layouts"]["C"]
    shared = dict(zip(layouts["columns"], layouts["rows"][0]))
    fresh = sim.run_layout(costs.h200(), 0, 0.18, steps=recorded["steps"], warmup=recorded["warmup"],
                           seed=recorded["seed"], calibration=costs.decode_calibration())
    assert sim.async_sim._rounded(fresh) == shared  # the layout run today, recomputed (2-3 s)
    for key, machine in recorded.items():
        if key not in sim.MACHINES:
            continue
        for name, s in machine["seconds_per_step"].items():
            rows = [dict(zip(machine["partial_layouts"][name]["columns"], r))
                    for r in machine["partial_layouts"][name]["rows"]]
            assert s["partial_best"] == min(r["seconds_per_step"] for r in rows)
            assert machine["partial_vs_sync"][name] == pytest.approx(s["sync"] / s["partial_best"], rel=1e-4)
            assert machine["async_vs_sync"][name] == pytest.approx(s["sync"] / s["async_k1"], rel=1e-4)
    baseline = json.loads((ROOT / "benchmarks" / "results" / "async_sim.json").read_text(encoding="utf-8"))
    for name, s in entry["seconds_per_step"].items():  # sync and async k = 1 are async_sim's, the same lengths
        assert s["sync"] == baseline["machines"]["8 x H200"]["scenarios"][name]["sync"]["seconds_per_step"]
        assert s["async_k1"] == baseline["machines"]["8 x H200"]["scenarios"][name]["best"]["1"]["seconds_per_step"]


# ---- the replay of a run ------------------------------------------------------------------------------------------

def _write_run(path, late: float = 0.0):
    """test_two_slots_by_hand's schedule (not shared) as a run would log it, the sampler's clock 100 s ahead of the
    loop's; updates of 0.5 s scoring + 2 s; segment 2 (v1, published at 4.5 s) starting `late` s after that."""
    path.mkdir()
    header = {"start": 0, "schedule": {"partial_lag": 1, "max_staleness": 1, "batch_groups": 1, "steps": 3},
              "sampler": {"window": 100, "group_size": 1, "slots": 2, "segment_iterations": 2, "max_new_tokens": 8}}
    segments = [(0, 2, 0, [[1, 1]]), (2, 4, 0, [[0, 3], [2, 2], [4, 1]]),
                (4.5 + late, 6.5 + late, 1, [[3, 2], [5, 1], [6, 1], [7, 1]])]
    lines = [header] + [{"segment": s, "version": v, "start": a + 100, "end": b + 100, "iterations": 2, "groups": g}
                        for s, (a, b, v, g) in enumerate(segments)]
    ready, start = [2, 4, 6.5 + late], [2, 4.5, 7]
    lines += [{"batch": t, "sample_end": ready[t] + 100} for t in range(3)]
    (path / "segments.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    rows = [{"step": t + 1, "sample_start_s": 0.0, "sample_end_s": ready[t], "train_start_s": start[t] + 0.5,
             "train_end_s": start[t] + 2.5, "publish_s": start[t] + 2.5, "time_score_s": 0.5,
             "staleness_max": [0, 1, 1][t], "dropped_stale": [0, 0, 3][t]} for t in range(3)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_replay_of_a_run_that_kept_to_the_schedule(tmp_path):
    _write_run(tmp_path / "run")
    result = sim.compare(tmp_path / "run")
    assert result["ok"] and all(result["checks"].values())
    assert result["max_abs_error_s"] == 0 and result["wall_s"] == {"measured": 9.5, "predicted": 9.5}
    assert result["step_s"]["predicted"] == [2.5, 2.5] and result["step_relative_error_max"] == 0


def test_replay_counts_a_wait_the_schedule_does_not_know(tmp_path):
    # Segment 2 started 0.25 s after version 1 was published: the replay starts it at 4.5 s, so it ends, and batch 2
    # is ready, 0.25 s earlier than measured; the update still starts at 7 s, when update 1 ends.
    _write_run(tmp_path / "run", late=0.25)
    result = sim.compare(tmp_path / "run")
    assert result["ok"]  # the same versions, groups, staleness and drops
    errors = result["mean_abs_error_s"]
    assert errors["segment_start_s"] == pytest.approx(0.25 / 3) and errors["batch_ready_s"] == pytest.approx(0.25 / 3)
    assert errors["train_end_s"] == 0 and result["max_abs_error_s"] == pytest.approx(0.25)
    assert result["max_abs_error_of_wall"] == pytest.approx(0.25 / 9.5)


RUN = ROOT / "benchmarks" / "results" / "partial_validation_run"  # its segments.jsonl and metrics.jsonl


def test_the_validation_is_the_replay_of_the_recorded_run():
    """results/partial_sim_validation.json is `--replay` of the CPU run's logs kept beside it: every check passed and
    every simulated event within 5% of the run's wall time."""
    saved = json.loads(sim.VALIDATION.read_text(encoding="utf-8"))
    fresh = sim.async_sim._rounded({"run": saved["run"], **sim.compare(RUN)})
    assert fresh == saved
    assert saved["ok"] and all(saved["checks"].values()) and saved["steps"] == 10
    assert saved["max_abs_error_of_wall"] < 0.05
