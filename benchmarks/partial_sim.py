"""Partial rollouts, predicted (issue 59, part 4): an event simulation of `rollouts.mode: partial`
(jaxrl_llm/train/partial_rollouts.py) at the paper's shape, beside benchmarks/async_sim.py's sync and async k = 1.

The sampler, a continuous engine with `slots` decode slots over a queue of Q = max(2B, 2 ceil(slots / n)) prompts:

    segment s: wait for version w(s) = max(0, r(s) - L) -> for I iterations: admit the stream's next samples into the
               free slots (a prompt of the queue only; a prompt's prefill when its first sample enters), decode one
               token of every busy slot -> hand over the groups whose n samples all ended, in prompt order
    a group whose oldest token (its prefill's version) is more than max_staleness versions older than the step it
    would join is dropped; every B groups kept make step r's batch; the queue's front moves past handed-over prompts.
    trainer:   train_start(r) = max(batch r ready, trainer free); publish(r + 1) = train_end(r) + X

A decode iteration costs what benchmarks/async_costs.py's static model says for its busy slots (per device
b = ceil(busy / devices), each slot reading its context: the tokens so far + half a tile on the GPU, every tile on a
TPU). `shared` (the implemented layout: partial refuses `rollouts.sampler_devices` today): the sampler and the trainer
take turns on all devices, an update runs as soon as its batch is ready and the sampler resumes after it; otherwise
the sampler has its own devices (the split, predicted for when partial allows it). A step's scoring runs in the
trainer's thread (the implementation's limit), so it is added to the update.

    python benchmarks/partial_sim.py [--json benchmarks/results/partial_sim.json]
    python benchmarks/partial_sim.py --replay RUN_DIR [--about TEXT] [--json OUT]

`--replay` checks the schedule against a partial run (its segments.jsonl and metrics.jsonl): the simulator's sampler
and trainer driven by the run's sample lengths and measured durations (every segment's, every step's scoring and
update, every hand-over of the weights), its events compared with the run's; results/partial_sim.json's
"validation" is results/partial_sim_validation.json, the replay of a CPU run on 8 fake devices.

Pure Python: no JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import pathlib
import random
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import async_costs as costs  # noqa: E402
import async_sim  # noqa: E402

COMMAND = "python benchmarks/partial_sim.py --json benchmarks/results/partial_sim.json"
SCHEDULE = {"partial_lag": 1, "max_staleness": 4, "segment_iterations": 16}  # configs/partial_demo.yaml's keys
LENGTHS = ("async_costs.Workload's draw, the same lengths as benchmarks/async_sim.py's sync and async rows: a "
           "response reaches the 3072-token cap with probability 0.02, else lognormal with median 600 tokens "
           "(assumed: no Qwen2.5-Math rollout was measured here) and log-sd 0.60 (measured: the uncapped lengths of "
           "800 rollouts of the bundled model, benchmarks/results/rollouts_64.json)")


@dataclasses.dataclass(frozen=True)
class PartialStep:
    step: int
    ready_s: float  # the B-th group of the batch handed over
    train_start_s: float
    train_end_s: float
    publish_s: float  # version step + 1 ready for the sampler
    staleness_max: int  # step - the oldest version among the batch's tokens
    dropped: int  # groups dropped over max_staleness since the step before


class Sampler:
    """The continuous engine's slots over the prompt stream (module docstring). `length(k)`: sample k's tokens."""

    def __init__(self, length, *, slots: int, group_size: int, window: int, iteration_s, prefill_s: float,
                 chunk: int = 1, entries: int = 0):
        self.length, self.slots, self.n, self.window, self.chunk = length, slots, group_size, window, chunk
        self.entries = entries  # prompt cache entries (0: enough); a prompt holds one until its samples all end
        self.iteration_s, self.prefill_s = iteration_s, prefill_s
        self.now, self.iteration, self.next_sample, self.front, self.prefilled = 0.0, 0, 0, 0, 0
        self.ends: list = []  # (iteration it ends, sample, iteration it started)
        self.start_sum = 0  # of the busy samples
        self.ended, self.oldest, self.handed = {}, {}, set()
        self.busy_iterations = self.iterations = 0

    def _admit(self, version: int) -> None:
        while len(self.ends) < self.slots and self.next_sample // self.n < self.front + self.window:
            k, prompt = self.next_sample, self.next_sample // self.n
            if prompt == self.prefilled:  # the engine prefills `chunk` prompts of the queue at once
                live = sum(self.ended[p] < self.n for p in range(self.front, self.prefilled))
                if self.entries and self.entries - live < self.chunk:
                    break  # no chunk of free entries: the free slots wait for a prompt's last sample to end
                upto = min(prompt + self.chunk, self.front + self.window)
                self.now += self.prefill_s * (upto - prompt)
                self.oldest.update(dict.fromkeys(range(prompt, upto), version))
                self.ended.update(dict.fromkeys(range(prompt, upto), 0))
                self.prefilled = upto
            heapq.heappush(self.ends, (self.iteration + self.length(k), k, self.iteration))
            self.start_sum += self.iteration
            self.next_sample += 1

    def segment(self, version: int, iterations: int) -> list[int]:
        """Decode `iterations` iterations with `version`; the prompts whose groups ended, in prompt order."""
        for _ in range(iterations):
            self._admit(version)
            busy = len(self.ends)
            if not busy:
                break
            self.now += self.iteration_s(busy, busy * self.iteration - self.start_sum)
            self.iteration += 1
            self.iterations, self.busy_iterations = self.iterations + 1, self.busy_iterations + busy
            while self.ends and self.ends[0][0] <= self.iteration:
                _, k, started = heapq.heappop(self.ends)
                self.start_sum -= started
                self.ended[k // self.n] += 1
        done = [p for p in range(self.front, -(-self.next_sample // self.n))
                if p not in self.handed and self.ended.get(p) == self.n]
        self.handed.update(done)
        while self.front in self.handed:
            self.front += 1
        return done


def simulate_partial(sampler: Sampler, train_s, *, steps: int, batch_groups: int, lag: int, max_staleness: int,
                     segment_iterations: int, transfer_s=0.0, shared: bool = False,
                     start_s: float = 0.0) -> list[PartialStep]:
    """The schedule's steps (module docstring). train_s(prompts) -> seconds of the update on those groups;
    transfer_s: X, or X(step) for a replay; start_s: when version 0 is published."""
    hand_off = transfer_s if callable(transfer_s) else lambda step: transfer_s
    publish, trainer_free, pending, dropped, events = {0: start_s}, start_s, [], 0, []
    sampler.now = max(sampler.now, start_s)
    while len(events) < steps:
        r = len(events)
        sampler.now = max(sampler.now, publish[max(0, r - lag)])
        for prompt in sampler.segment(max(0, r - lag), segment_iterations):
            r = len(events)
            if r == steps:
                break
            if r - sampler.oldest[prompt] > max_staleness:
                dropped += 1
                continue
            pending.append(prompt)
            if len(pending) < batch_groups:
                continue
            start = max(sampler.now, trainer_free)
            end = start + train_s(pending)
            publish[r + 1] = trainer_free = end + hand_off(r)
            events.append(PartialStep(r, sampler.now, start, end, publish[r + 1],
                                      r - min(sampler.oldest[p] for p in pending), dropped))
            pending, dropped = [], 0
        if shared:
            sampler.now = max(sampler.now, trainer_free)  # the devices ran the updates, the sampler waited
    return events


def summarize(events: list[PartialStep], sampler: Sampler, *, warmup: int) -> dict:
    window = events[-1].train_end_s - events[warmup - 1].train_end_s
    return {"seconds_per_step": window / (len(events) - warmup),
            "slot_occupancy": sampler.busy_iterations / max(1, sampler.iterations * sampler.slots),
            "staleness_max": max(e.staleness_max for e in events),
            "dropped_groups": sum(e.dropped for e in events),
            "trainer_wait_s": async_sim._mean(max(0.0, e.ready_s - p.publish_s)
                                              for p, e in zip(events[warmup - 1:], events[warmup:]))}


# ---- replay of a run ----------------------------------------------------------------------------------------------

class MeasuredSampler(Sampler):
    """`Sampler` on a run's measured segment durations (its decode and prefill costs replaced by them); records
    each segment's (start, end, version, iterations, prompts handed over)."""

    def __init__(self, length, durations: list[float], **shape):
        super().__init__(length, iteration_s=lambda busy, tokens: 0.0, prefill_s=0.0, **shape)
        self.durations, self.events = durations, []

    def segment(self, version: int, iterations: int) -> list[int]:
        start, before, s = self.now, self.iterations, len(self.events)
        if s == len(self.durations):
            raise ValueError(f"the schedule needs more segments than the run's {s}: it handed over fewer groups")
        done = super().segment(version, iterations)
        self.now = start + self.durations[s]
        self.events.append((start, self.now, version, self.iterations - before, done))
        return done


def read_run(run) -> tuple[dict, list[dict], dict[int, float], list[dict]]:
    """(header, segment lines, {step: sample_end in the sampler's clock}, metrics.jsonl's step rows) of a partial run's
    one uninterrupted stretch (RUN/segments.jsonl, `partial_rollouts.SegmentLog`)."""
    run = pathlib.Path(run)
    lines = [json.loads(x) for x in (run / "segments.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]
    headers = [x for x in lines if "schedule" in x]
    if len(headers) != 1 or headers[0]["start"] != 0:
        raise ValueError(f"{run}: {len(headers)} stretches in segments.jsonl: replay a run that was not resumed")
    batches = {x["batch"]: x["sample_end"] for x in lines if "batch" in x}
    return headers[0], [x for x in lines if "segment" in x], batches, async_sim.read_step_rows(run)


def replay(header: dict, segments: list[dict], rows: list[dict], offset: float) -> tuple[MeasuredSampler, list]:
    """The schedule on a run's measured durations: each segment's, each step's scoring + update, and each
    publish_s - train_end_s (an evaluation, a checkpoint, the copy); sample lengths as drawn. offset: metrics.jsonl's
    clock minus the sampler's. The sampler runs beside the trainer (on a CPU both threads share the cores; their
    contention is in the measured durations)."""
    lengths = {}
    for line in segments:
        for index, *drawn in line["groups"]:
            lengths.update({index * len(drawn) + j: n for j, n in enumerate(drawn)})
    shape, schedule = header["sampler"], header["schedule"]
    cap = shape["max_new_tokens"]  # a sample still decoding when the run ended: to the cap, past the replay
    sampler = MeasuredSampler(lambda k: lengths.get(k, cap), [x["end"] - x["start"] for x in segments],
                              slots=shape["slots"], group_size=shape["group_size"], window=shape["window"],
                              chunk=shape.get("prefill_chunk", 1), entries=shape.get("prompt_entries", 0))
    updates = iter([r["time_score_s"] + r["train_end_s"] - r["train_start_s"] for r in rows])
    events = simulate_partial(sampler, lambda prompts: next(updates), steps=len(rows),
                              batch_groups=schedule["batch_groups"], lag=schedule["partial_lag"],
                              max_staleness=schedule["max_staleness"], segment_iterations=shape["segment_iterations"],
                              transfer_s=lambda step: rows[step]["publish_s"] - rows[step]["train_end_s"],
                              start_s=segments[0]["start"] + offset)
    return sampler, events


def compare(run) -> dict:
    """A partial run's events against the schedule replayed on its measured durations (free-running from its first
    segment: each error accumulates every wait the schedule does not know). Checks: the segments' versions, the
    groups each handed over, each step's staleness_max and dropped groups as the schedule gives them."""
    header, segments, batches, rows = read_run(run)
    offsets = [rows[t]["sample_end_s"] - batches[t] for t in range(len(rows)) if t in batches]
    offset = offsets[0]
    sampler, events = replay(header, segments, rows, offset)
    simulated = sampler.events
    measured = segments[:len(simulated)]
    errors = {"segment_start_s": [e[0] - (m["start"] + offset) for e, m in zip(simulated, measured)],
              "segment_end_s": [e[1] - (m["end"] + offset) for e, m in zip(simulated, measured)],
              "batch_ready_s": [e.ready_s - r["sample_end_s"] for e, r in zip(events, rows)],
              "train_start_s": [e.train_start_s + r["time_score_s"] - r["train_start_s"] for e, r in zip(events, rows)],
              "train_end_s": [e.train_end_s - r["train_end_s"] for e, r in zip(events, rows)],
              "publish_s": [e.publish_s - r["publish_s"] for e, r in zip(events, rows)]}
    start = segments[0]["start"] + offset
    wall = {"measured": rows[-1]["train_end_s"] - start, "predicted": events[-1].train_end_s - start}
    handed = [sorted(g[0] for g in m["groups"]) == e[4] for e, m in zip(simulated, measured)]
    checks = {
        "clocks_tied": max(offsets) - min(offsets) < 1e-6,
        "segment_versions_as_scheduled": [e[2] for e in simulated] == [m["version"] for m in measured],
        "segment_iterations_as_simulated": [e[3] for e in simulated] == [m["iterations"] for m in measured],
        "groups_handed_over_as_simulated": all(handed),
        "staleness_max_as_simulated": [e.staleness_max for e in events] == [r["staleness_max"] for r in rows],
        "dropped_as_simulated": [e.dropped for e in events] == [r.get("dropped_stale", 0) for r in rows]}
    worst = max(abs(x) for v in errors.values() for x in v)
    steps = {"measured": _steps([r["train_end_s"] for r in rows]), "predicted": _steps([e.train_end_s for e in events])}
    return {"ok": all(checks.values()), "checks": checks, "steps": len(rows), "segments": len(simulated),
            "header": header, "mean_abs_error_s": {k: math.fsum(map(abs, v)) / len(v) for k, v in errors.items()},
            "max_abs_error_s": worst, "max_abs_error_of_wall": worst / wall["measured"], "wall_s": wall,
            "wall_relative_error": wall["predicted"] / wall["measured"] - 1.0,
            "step_relative_error_max": max((abs(p / m - 1.0) for p, m in zip(steps["predicted"], steps["measured"])),
                                           default=0.0),
            "step_s": steps}


def _steps(ends: list[float]) -> list[float]:
    return [b - a for a, b in zip(ends, ends[1:])]


# ---- the paper's shape --------------------------------------------------------------------------------------------

def decode_cost(machine, devices: int, calibration, policy=costs.POLICY, workload=costs.WORKLOAD):
    """(iteration_s(busy, tokens so far), prefill seconds per prompt) of a continuous sampler on `devices`."""
    e, o = calibration
    p, g, kv = workload.prompt_tokens, workload.samples, policy.kv_bytes_per_token
    attention = 4 * policy.layers * policy.heads * policy.head_dim
    extra = workload.max_new_tokens if machine.reads_all_tiles else costs.RESPONSE_TILE / 2

    def iteration_s(busy: int, tokens: int) -> float:
        b = -(-busy // devices)
        context = (workload.max_new_tokens * b if machine.reads_all_tiles else tokens / busy * b + extra * b)
        read = policy.weight_bytes + (b / g * p + context) * kv
        flops = 2 * policy.params * b + attention * (b * p + context)
        return o + max(read / machine.hbm_bytes_s, flops / machine.matmul_flops) / e

    return iteration_s, 2 * policy.params * p / (machine.matmul_flops * e * devices)


def run_layout(machine, sampler_devices: int, mfu: float, *, steps: int, warmup: int, seed: int,
               calibration, workload=costs.WORKLOAD, policy=costs.POLICY) -> dict:
    """The partial schedule with the sampler on `sampler_devices` (0: shared with the trainer on every device)."""
    n, g, b = machine.devices, workload.samples, workload.prompts
    shared = sampler_devices == 0
    devices, trainers = (n, n) if shared else (sampler_devices, n - sampler_devices)
    resident = 16 * policy.params / n + policy.weight_bytes if shared else 2 * policy.weight_bytes
    slots = min(costs.sampler_rows_that_fit(machine, resident, policy, workload) * devices, b * g)
    rng, drawn = random.Random(seed), []

    def length(k: int) -> int:
        while k >= len(drawn):
            drawn.extend(costs.draw_lengths(rng, workload))
        return drawn[k]

    def train_s(prompts: list[int]) -> float:
        lengths = [length(p * g + j) for p in prompts for j in range(g)]
        work = costs.train_work(lengths, workload, policy)
        return costs.trainer_seconds(work, trainers, machine, mfu, workload) + len(lengths) / machine.verifications_s

    iteration_s, prefill_s = decode_cost(machine, devices, calibration, policy, workload)
    sampler = Sampler(length, slots=slots, group_size=g, window=max(2 * b, 2 * -(-slots // g)),
                      iteration_s=iteration_s, prefill_s=prefill_s)
    events = simulate_partial(sampler, train_s, steps=steps, batch_groups=b, lag=SCHEDULE["partial_lag"],
                              max_staleness=SCHEDULE["max_staleness"],
                              segment_iterations=SCHEDULE["segment_iterations"], shared=shared,
                              transfer_s=0.0 if shared else costs.transfer_seconds(devices, trainers, machine, policy))
    return {"sampler_devices": sampler_devices, "trainer_devices": trainers, "slots": slots,
            **summarize(events, sampler, warmup=warmup)}


MACHINES = {"h200x8": (costs.h200, range(1, 8)), "v5e-64": (lambda: costs.V5E, range(8, 64, 8))}
VALIDATION = pathlib.Path(__file__).resolve().parent / "results" / "partial_sim_validation.json"


def validation(path=VALIDATION) -> dict | None:
    """The replay of a CPU run on 8 fake devices (`--replay RUN --json results/partial_sim_validation.json`), its
    step times left out."""
    path = pathlib.Path(path)
    if not path.is_file():
        return None
    return {k: v for k, v in json.loads(path.read_text(encoding="utf-8")).items() if k != "step_s"}


def machine_entry(machine, splits, *, steps: int, warmup: int, seed: int) -> dict:
    """sync and async k = 1 (async_sim.predict, their best split) and partial, shared and on each split, per MFU
    scenario of async_sim."""
    baseline = async_sim.predict((machine,), ks=(1,), steps=steps, warmup=warmup, seed=seed)
    calibration = costs.decode_calibration()
    out = {key: {} for key in ("partial_vs_sync", "partial_shared_vs_sync", "async_vs_sync", "seconds_per_step",
                               "partial_layouts")}
    for name, scenario in baseline["machines"][machine.name]["scenarios"].items():
        mfu, sync, best = scenario["train_mfu"], scenario["sync"]["seconds_per_step"], scenario["best"]["1"]
        rows = [run_layout(machine, a, mfu, steps=steps, warmup=warmup, seed=seed, calibration=calibration)
                for a in [0, *(a for a in splits if costs.train_fits(machine.devices - a, machine))]]
        top = min(rows, key=lambda r: r["seconds_per_step"])
        out["partial_vs_sync"][name] = sync / top["seconds_per_step"]
        out["partial_shared_vs_sync"][name] = sync / rows[0]["seconds_per_step"]
        out["async_vs_sync"][name] = best["speedup"]
        out["seconds_per_step"][name] = {
            "train_mfu": mfu, "sync": sync, "async_k1": best["seconds_per_step"],
            "async_k1_split": [best["sampler_devices"], best["trainer_devices"]],
            "partial_shared": rows[0]["seconds_per_step"], "partial_best": top["seconds_per_step"],
            "partial_best_split": [top["sampler_devices"], top["trainer_devices"]]}
        columns = list(rows[0])
        out["partial_layouts"][name] = {"columns": columns, "rows": [[r[c] for c in columns] for r in rows]}
    return out


def record(*, steps: int = 40, warmup: int = 8, seed: int = 0, machines=None) -> dict:
    """results/partial_sim.json (floats to 5 significant digits)."""
    out = {key: machine_entry(make(), splits, steps=steps, warmup=warmup, seed=seed)
           for key, (make, splits) in (machines or MACHINES).items()}
    return async_sim._rounded({
        **out, "validation": validation(), "predicted": True,
        "schedule": SCHEDULE, "lengths": LENGTHS, "steps": steps, "warmup": warmup, "seed": seed,
        "layouts": "partial_shared: sampler and trainer take turns on every device (what rollouts.mode partial runs "
                   "today); a split [sampler, trainer devices] is predicted for when partial allows "
                   "rollouts.sampler_devices; partial_vs_sync takes the best of both",
        "command": COMMAND})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here (benchmarks/results/partial_sim.json)")
    parser.add_argument("--replay", metavar="RUN_DIR", help="compare a partial run's events with the schedule instead")
    parser.add_argument("--about", default="", help="with --replay: what the run was (its command, the machine)")
    args = parser.parse_args(argv)
    if args.replay:
        result = {"run": args.about, **compare(args.replay)}
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(async_sim._rounded(result), indent=1) + "\n",
                                               encoding="utf-8")
        print(json.dumps({k: v for k, v in result.items() if k != "step_s"}, indent=1))
        return 0 if result["ok"] else 1
    results = record()
    text = async_sim.to_json(results)
    if args.json:
        pathlib.Path(args.json).write_text(text, encoding="utf-8")
    for key in MACHINES:
        print(key, json.dumps(results[key]["seconds_per_step"]))
        print(key, "partial/sync", results[key]["partial_vs_sync"], "async/sync", results[key]["async_vs_sync"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
