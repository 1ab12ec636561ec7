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

    def __init__(self, length, *, slots: int, group_size: int, window: int, iteration_s, prefill_s: float):
        self.length, self.slots, self.n, self.window = length, slots, group_size, window
        self.iteration_s, self.prefill_s = iteration_s, prefill_s
        self.now, self.iteration, self.next_sample, self.front = 0.0, 0, 0, 0
        self.ends: list = []  # (iteration it ends, sample, iteration it started)
        self.start_sum = 0  # of the busy samples
        self.ended, self.oldest, self.handed = {}, {}, set()
        self.busy_iterations = self.iterations = 0

    def _admit(self, version: int) -> None:
        while len(self.ends) < self.slots and self.next_sample // self.n < self.front + self.window:
            k, prompt = self.next_sample, self.next_sample // self.n
            if k % self.n == 0:
                self.now += self.prefill_s
                self.oldest[prompt], self.ended[prompt] = version, 0
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
                     segment_iterations: int, transfer_s: float = 0.0, shared: bool = False) -> list[PartialStep]:
    """The schedule's steps (module docstring). train_s(prompts) -> seconds of the update on those groups."""
    publish, trainer_free, pending, dropped, events = {0: 0.0}, 0.0, [], 0, []
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
            publish[r + 1] = trainer_free = end + transfer_s
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
VALIDATION_NOT_RUN = ("not run: no CPU run of the partial schedule on 8 fake devices "
                      "(XLA_FLAGS=--xla_force_host_platform_device_count=8) has been replayed against this simulator "
                      "yet, and partial rollouts record no per-segment events to replay")


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
        **out, "validation": None, "validation_not_run": VALIDATION_NOT_RUN, "predicted": True,
        "schedule": SCHEDULE, "lengths": LENGTHS, "steps": steps, "warmup": warmup, "seed": seed,
        "layouts": "partial_shared: sampler and trainer take turns on every device (what rollouts.mode partial runs "
                   "today); a split [sampler, trainer devices] is predicted for when partial allows "
                   "rollouts.sampler_devices; partial_vs_sync takes the best of both",
        "command": COMMAND})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here (benchmarks/results/partial_sim.json)")
    args = parser.parse_args(argv)
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
