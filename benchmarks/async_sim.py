"""Asynchronous rollouts, predicted: a discrete-event simulation of the synchronous loop against a sampler on its own
devices with a staleness bound k (issue 43, part 5), and a replay of a run's metrics.jsonl against the same schedule.

The schedule (the loop's `rollouts: {mode, max_staleness: k, sampler_devices}`), steps t = 0, 1, ..., version v = the
params after v updates, S_t / T_t / X_t the step's sampling, training and weight-transfer seconds:

    version(t)      = max(0, t - k)                                   samples of step t are drawn with it
    publish(0)      = start;  publish(v) = train_end(v-1) + X_(v-1)   the weights reach the sampler's devices
    sample_start(t) = max(publish(version(t)), sample_end(t-1))
    sample_end(t)   = sample_start(t) + S_t
    train_start(t)  = max(sample_end(t), train_end(t-1) [+ X_(t-1) when the transfer holds the trainer])
    train_end(t)    = train_start(t) + T_t

k = 0 with X = 0 is today's synchronous loop (S_t + T_t per step); with constant stage times and the transfer on the
trainer's time, k >= 1 settles at max(S, T + X) seconds per step (the cycle sample(t) -> train(t) -> publish(t+1) ->
sample(t+k+1) spans k+1 steps, so in general max(S, T + X, (S + T + X) / (k + 1))).

    python benchmarks/async_sim.py predict [--json benchmarks/results/async_sim.json]
    python benchmarks/async_sim.py replay RUN_DIR --max-staleness K [--transfer-overlaps] [--json OUT]

`predict` takes S, T and X at the paper's shape from benchmarks/async_costs.py (its inputs say which are measured and
which assumed), sweeps the device splits and k and prints README's tables; `replay` checks a real run's metrics.jsonl
against the schedule (`compare`). Pure Python: no JAX. The partial schedule (`rollouts.mode: partial`) is
benchmarks/partial_sim.py's, on the same costs and lengths.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import pathlib
import random
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # benchmarks/async_costs.py beside it
import async_costs as costs  # noqa: E402

EVENT_KEYS = ("sample_start_s", "sample_end_s", "train_start_s", "train_end_s")


# ---- the schedule -----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StepEvents:
    step: int  # t, from 0
    policy_version: int
    staleness: int  # t - policy_version: updates between the sampler's weights and the trainer's
    sample_start_s: float
    sample_end_s: float
    train_start_s: float
    train_end_s: float
    publish_s: float  # version t + 1 on the sampler's devices


def simulate(sample_s, train_s, *, max_staleness: int, transfer_s=0.0, transfer_blocks_trainer: bool = True,
             start_s: float = 0.0) -> list[StepEvents]:
    """Events of every step under the schedule above. sample_s: per-step seconds (its length is the step count);
    train_s, transfer_s: per-step seconds or one number for every step."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    steps = len(sample_s)
    train_s, transfer_s = (_per_step(x, steps) for x in (train_s, transfer_s))
    publish, events = [start_s], []
    sampler_free = trainer_free = start_s
    for t in range(steps):
        version = max(0, t - max_staleness)
        sample_start = max(publish[version], sampler_free)
        sampler_free = sample_end = sample_start + sample_s[t]
        train_start = max(sample_end, trainer_free)
        train_end = train_start + train_s[t]
        publish.append(train_end + transfer_s[t])
        trainer_free = publish[-1] if transfer_blocks_trainer else train_end
        events.append(StepEvents(t, version, t - version, sample_start, sample_end, train_start, train_end,
                                 publish[-1]))
    return events


def _per_step(x, steps: int) -> list[float]:
    values = [float(x)] * steps if isinstance(x, (int, float)) else [float(v) for v in x]
    if len(values) != steps:
        raise ValueError(f"{len(values)} per-step values for {steps} steps")
    return values


def summarize(events: list[StepEvents], *, warmup: int, sampler_busy_s=None, trainer_busy_s=None,
              sampler_devices: int = 1, trainer_devices: int = 1, shared_devices: bool = False) -> dict:
    """Steady state over steps warmup..N-1: seconds per step = (train_end(N-1) - train_end(warmup-1)) / (N - warmup);
    idle fraction of each side = 1 - its busy seconds (default: its stage seconds) over that window; with
    `shared_devices` (the synchronous loop) both stages run on the same devices, so their busy times add up.
    staleness: steps per staleness, all steps; sampler_waited_for_weights: share of steady steps whose sampling
    started later than the previous one ended, i.e. where the bound k held the sampler back."""
    n = len(events)
    if not 0 < warmup < n:
        raise ValueError(f"warmup must be in 1..{n - 1}, got {warmup}")
    window = events[-1].train_end_s - events[warmup - 1].train_end_s
    tail = events[warmup:]
    sampler_busy = math.fsum((sampler_busy_s or [e.sample_end_s - e.sample_start_s for e in events])[warmup:])
    trainer_busy = math.fsum((trainer_busy_s or [e.train_end_s - e.train_start_s for e in events])[warmup:])
    out = {"seconds_per_step": window / (n - warmup),
           "staleness": dict(sorted(collections.Counter(e.staleness for e in events).items())),
           "sampler_waited_for_weights": _share(e.sample_start_s > p.sample_end_s + 1e-9
                                                for p, e in zip(events[warmup - 1:], tail))}
    idle = lambda busy: max(0.0, 1.0 - busy / window)  # noqa: E731  (rounding: never below 0)
    if shared_devices:
        out["device_idle"] = idle(sampler_busy + trainer_busy)
    else:
        out.update(sampler_idle=idle(sampler_busy), trainer_idle=idle(trainer_busy))
        devices = sampler_devices + trainer_devices
        out["device_idle"] = (sampler_devices * out["sampler_idle"] + trainer_devices * out["trainer_idle"]) / devices
    return out


def _share(flags) -> float:
    flags = list(flags)
    return sum(flags) / max(len(flags), 1)


# ---- replay of a run ----------------------------------------------------------------------------------------------

def read_step_rows(path) -> list[dict]:
    """metrics.jsonl's step rows (those with the four event times), one per step in step order; `step` is the count of
    updates done (the loop writes step t as t + 1), so row i is step t = i from the run's first step."""
    path = pathlib.Path(path)
    path = path / "metrics.jsonl" if path.is_dir() else path
    by_step = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line) if line.strip() else {}
        if all(key in row for key in EVENT_KEYS):
            by_step[int(row["step"])] = row  # evaluation rows carry no events
    steps = sorted(by_step)
    if steps != list(range(1, len(steps) + 1)):
        raise ValueError(f"{path}: step rows {steps[:3]}...{steps[-3:]} are not 1, 2, ..., N (a resumed run's clock "
                         f"restarts: replay one uninterrupted stretch)")
    return [by_step[s] for s in steps]


def handoff_seconds(rows: list[dict]) -> list[float]:
    """X_t of each row: publish_s - train_end_s when the row carries `publish_s` (when version t + 1 reached the
    sampler: the transfer and whatever the trainer did between its update and the hand-over, an evaluation, a
    checkpoint), else its `transfer_s`, else 0."""
    return [float(r["publish_s"]) - float(r["train_end_s"]) if "publish_s" in r else float(r.get("transfer_s", 0.0))
            for r in rows]


def replay(rows: list[dict], *, max_staleness: int, transfer_blocks_trainer: bool = True) -> list[StepEvents]:
    """The schedule's events for the measured stage durations of `rows` (read_step_rows), from the run's first
    sample_start_s: what the run should have done, step for step, if only the schedule made anyone wait."""
    return simulate([r["sample_end_s"] - r["sample_start_s"] for r in rows],
                    [r["train_end_s"] - r["train_start_s"] for r in rows], max_staleness=max_staleness,
                    transfer_s=handoff_seconds(rows), transfer_blocks_trainer=transfer_blocks_trainer,
                    start_s=rows[0]["sample_start_s"])


def compare(rows: list[dict], *, max_staleness: int, transfer_blocks_trainer: bool = True,
            tolerance_s: float = 1e-3) -> dict:
    """A run's events against the schedule. Checks (each a bool, `ok` all of them): every step trained in order, one
    at a time, sampled one at a time; policy_version = max(0, t - k) and staleness = t - version <= k; no step sampled
    before its version was published or trained before its samples and the previous update (lags >= -tolerance).
    Timing: `replayed` runs the schedule on the measured durations from the first step's start (free-running: the
    error accumulates every wait the schedule does not know); `lags` are each event's delay after the moment the
    schedule allows it given the measured earlier events (one step ahead: the overhead per hand-off)."""
    k, n = max_staleness, len(rows)
    get = {key: [float(r[key]) for r in rows] for key in EVENT_KEYS}
    transfer = handoff_seconds(rows)
    publish = [get["sample_start_s"][0]] + [get["train_end_s"][t] + transfer[t] for t in range(n)]
    trainer_free = publish[1:] if transfer_blocks_trainer else get["train_end_s"]
    versions = [r.get("policy_version") for r in rows]
    lag_sample = [get["sample_start_s"][t] - max(publish[max(0, t - k)], get["sample_end_s"][t - 1] if t else
                                                   publish[0]) for t in range(n)]
    lag_train = [get["train_start_s"][t] - max(get["sample_end_s"][t], trainer_free[t - 1] if t else publish[0])
                 for t in range(n)]
    order = sorted(range(n), key=lambda t: get["train_start_s"][t])
    checks = {
        "trained_in_order": order == list(range(n)),
        "one_update_at_a_time": all(get["train_start_s"][t] >= get["train_end_s"][t - 1] - tolerance_s
                                    for t in range(1, n)),
        "one_sampling_at_a_time": all(get["sample_start_s"][t] >= get["sample_end_s"][t - 1] - tolerance_s
                                      for t in range(1, n)),
        "versions_as_scheduled": versions == [max(0, t - k) for t in range(n)],
        "staleness_as_recorded": all(r.get("staleness") == t - v for t, (r, v) in enumerate(zip(rows, versions))
                                     if v is not None),
        "staleness_within_k": all(v is not None and 0 <= t - v <= k for t, v in enumerate(versions)),
        "no_event_before_the_schedule_allows": min(lag_sample + lag_train) >= -tolerance_s,
    }
    predicted = replay(rows, max_staleness=k, transfer_blocks_trainer=transfer_blocks_trainer)
    errors = {key: [getattr(p, key) - get[key][t] for t, p in enumerate(predicted)] for key in EVENT_KEYS}
    measured_wall = get["train_end_s"][-1] - get["sample_start_s"][0]
    return {
        "ok": all(checks.values()), "checks": checks, "steps": n, "max_staleness": k,
        "transfer_blocks_trainer": transfer_blocks_trainer,
        "first_version_mismatch": next((t for t in range(n) if versions[t] != max(0, t - k)), None),
        "replayed": {"max_abs_error_s": max(abs(e) for v in errors.values() for e in v),
                     "mean_abs_error_s": {key: math.fsum(map(abs, v)) / n for key, v in errors.items()},
                     "wall_s": {"measured": measured_wall, "predicted": predicted[-1].train_end_s - publish[0]},
                     "wall_relative_error": (predicted[-1].train_end_s - publish[0]) / measured_wall - 1.0},
        "lags_s": {name: {"min": min(lag), "mean": math.fsum(lag) / n, "max": max(lag)}
                   for name, lag in (("sample_start", lag_sample), ("train_start", lag_train))},
        "events": [dataclasses.asdict(p) for p in predicted],
    }


# ---- the paper shape's table --------------------------------------------------------------------------------------

MFU_SCENARIOS = {"measured": None, "C": 0.180, "D": 0.358}  # None: costs.measured_train_mfu()
SPLIT_SWEEP = ("8 x H200", "C", 1)  # the table of every split: machine, scenario, k
COMMAND = "python benchmarks/async_sim.py predict --json benchmarks/results/async_sim.json"


def record() -> dict:
    """results/async_sim.json: `predict()`, and the v5e-64's best splits if its sampler held one copy of the weights
    (the next version's transfer waiting for the sampler's call to end: not modelled in the schedule); floats to 5
    significant digits."""
    one_copy = predict((costs.V5E,), sampler_weight_copies=1)["machines"][costs.V5E.name]
    results = predict()
    for entry in results["machines"].values():
        for scenario in entry["scenarios"].values():  # a table: the column names once
            columns = list(scenario["async"][0])
            scenario["async"] = {"columns": columns, "rows": [[r[c] for c in columns] for r in scenario["async"]]}
    return _rounded({**results, "command": COMMAND, "v5e_sampler_one_weight_copy": {
        "sampler_rows_per_device_fit": one_copy["sampler_rows_per_device_fit"]["async"],
        "best": {name: {k: {key: best[key] for key in ("sampler_devices", "trainer_devices", "seconds_per_step",
                                                         "speedup")} for k, best in s["best"].items()}
                 for name, s in one_copy["scenarios"].items()}}})


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.5g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return [_rounded(v) for v in value] if isinstance(value, list) else value


def async_rows(scenario: dict) -> list[dict]:
    """A scenario's split rows, from predict() (dicts) or record() (columns and rows)."""
    table = scenario["async"]
    return table if isinstance(table, list) else [dict(zip(table["columns"], row)) for row in table["rows"]]


def to_json(results: dict) -> str:
    """record()'s JSON with each split's row, and each best split, on one line."""
    rows = {}

    def mark(value):
        flat = isinstance(value, list) and not any(isinstance(v, list) for v in value)
        if flat or isinstance(value, dict) and "sampler_devices" in value:
            rows[f"@row{len(rows)}"] = json.dumps(value)
            return f"@row{len(rows) - 1}"
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        return [mark(v) for v in value] if isinstance(value, list) else value

    text = json.dumps(mark(results), indent=1)
    for key, row in rows.items():
        text = text.replace(f'"{key}"', row, 1)
    return text + "\n"


def predict(machines=None, *, ks=(0, 1, 2), steps: int = 40, warmup: int = 8, seed: int = 0,
            sampler_weight_copies: int = 2) -> dict:
    """The synchronous loop against every feasible split and k, per machine and training-MFU scenario, all on the same
    drawn response lengths (`steps` steps; steady state after `warmup`). An async sampler holds
    `sampler_weight_copies` versions of the bf16 policy (2: the next lands while it samples)."""
    machines = machines or (costs.h200(), costs.V5E)
    rng = random.Random(seed)
    draws = [costs.draw_lengths(rng) for _ in range(steps)]
    work = [costs.train_work(d) for d in draws]
    calibration = costs.decode_calibration()
    mfus = {name: value or costs.measured_train_mfu() for name, value in MFU_SCENARIOS.items()}
    out = {"steps": steps, "warmup": warmup, "seed": seed, "workload": dataclasses.asdict(costs.WORKLOAD),
           "sampler_weight_copies": sampler_weight_copies,
           "decode_efficiency": calibration[0], "decode_step_overhead_s": calibration[1], "train_mfu": mfus,
           "mean_response_tokens": _mean([_mean(d) for d in draws]),
           "blocks_whose_longest_response_is_capped": {
               str(size): _share(max(d[i:i + size]) == costs.WORKLOAD.max_new_tokens
                                 for d in draws for i in range(0, len(d), size)) for size in (8, 64, 512, 4096)},
           "machines": {}}
    for machine in machines:
        n, weights = machine.devices, costs.POLICY.weight_bytes * sampler_weight_copies
        sync_resident = 16 * costs.POLICY.params / n + costs.POLICY.weight_bytes  # + f32 params, AdamW, reference
        sides = {n: [costs.sampler_seconds(d, n, machine, resident_bytes=sync_resident, calibration=calibration)
                     for d in draws]}
        for a in range(1, n):
            if costs.train_fits(n - a, machine):
                sides[a] = [costs.sampler_seconds(d, a, machine, resident_bytes=weights, calibration=calibration)
                            for d in draws]
        entry = {"machine": dataclasses.asdict(machine), "sampler_rows_per_device_fit": {
            "sync": costs.sampler_rows_that_fit(machine, sync_resident),
            "async": costs.sampler_rows_that_fit(machine, weights)}, "scenarios": {}}
        for name, mfu in mfus.items():
            entry["scenarios"][name] = _scenario(sides, work, machine, mfu, ks, warmup)
        out["machines"][machine.name] = entry
    return out


def _scenario(sides: dict, work: list, machine, mfu: float, ks, warmup: int) -> dict:
    n = machine.devices
    sample, scoring = ([s[i] for s in sides[n]] for i in (0, 1))
    train = [costs.trainer_seconds(w, n, machine, mfu) for w in work]
    sync = summarize(simulate([a + b for a, b in zip(sample, scoring)], train, max_staleness=0), warmup=warmup,
                     sampler_busy_s=sample, shared_devices=True)
    out = {"train_mfu": mfu, "sync": {**sync, "sample_s": _mean(sample) + _mean(scoring), "train_s": _mean(train)},
           "async": []}
    for a in (a for a in sides if a < n):
        sample, scoring = ([s[i] for s in sides[a]] for i in (0, 1))
        train = [costs.trainer_seconds(w, n - a, machine, mfu) for w in work]
        x = costs.transfer_seconds(a, n - a, machine)
        for k in ks:
            events = simulate([s + c for s, c in zip(sample, scoring)], train, max_staleness=k, transfer_s=x)
            result = summarize(events, warmup=warmup, sampler_busy_s=sample, trainer_busy_s=[t + x for t in train],
                               sampler_devices=a, trainer_devices=n - a)
            out["async"].append({"sampler_devices": a, "trainer_devices": n - a, "max_staleness": k,
                                 "sample_s": _mean(sample) + _mean(scoring), "train_s": _mean(train),
                                 "transfer_s": x, **result,
                                 "speedup": sync["seconds_per_step"] / result["seconds_per_step"]})
    out["best"] = {str(k): max((r for r in out["async"] if r["max_staleness"] == k), key=lambda r: r["speedup"])
                   for k in ks}
    return out


def _mean(values) -> float:
    # math.fsum, here and for every float sum of this file and async_costs.py: correctly rounded, so the same on every
    # Python (3.12's sum() compensates, 3.11's does not: results/async_sim.json differed in its 1e-16 idle fractions)
    values = list(values)
    return math.fsum(values) / len(values)


def markdown(results: dict) -> str:
    """README's two tables: per machine and training-MFU scenario the synchronous loop and each k's best split; then
    every split of SPLIT_SWEEP."""
    lines = ["| machine | train MFU | sync: sample + train = s/step | k | best split, sampler/trainer devices | "
             "sample, train + transfer s | s/step | speed-up | device idle, sync -> async |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, entry in results["machines"].items():
        for scenario, s in entry["scenarios"].items():
            sync = s["sync"]
            head = (f"| {name} | {s['train_mfu']:.1%} ({scenario}) | {sync['sample_s']:.0f} + {sync['train_s']:.0f} "
                    f"= {sync['seconds_per_step']:.0f}")
            for k, best in s["best"].items():
                lines.append(f"{head} | {k} | {best['sampler_devices']}/{best['trainer_devices']} | "
                             f"{best['sample_s']:.0f}, {best['train_s']:.0f} + {best['transfer_s']:.3f} | "
                             f"{best['seconds_per_step']:.0f} | {best['speedup']:.2f}x | "
                             f"{sync['device_idle']:.0%} -> {best['device_idle']:.0%} |")
                head = "| | |"
    machine, scenario, k = SPLIT_SWEEP
    s = results["machines"][machine]["scenarios"][scenario]
    lines += ["", f"Every split, {machine}, train MFU {s['train_mfu']:.1%} ({scenario}), k = {k} (sync "
              f"{s['sync']['seconds_per_step']:.0f} s/step):", "",
              "| sampler/trainer devices | sample s | train + transfer s | s/step | speed-up | sampler idle | "
              "trainer idle | steps whose sampler waited for the weights |", "|---|---|---|---|---|---|---|---|"]
    for r in (r for r in async_rows(s) if r["max_staleness"] == k):
        lines.append(f"| {r['sampler_devices']}/{r['trainer_devices']} | {r['sample_s']:.0f} | {r['train_s']:.0f} + "
                     f"{r['transfer_s']:.3f} | {r['seconds_per_step']:.0f} | {r['speedup']:.2f}x | "
                     f"{r['sampler_idle']:.0%} | {r['trainer_idle']:.0%} | {r['sampler_waited_for_weights']:.0%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    pred = sub.add_parser("predict", help="the paper shape's table")
    pred.add_argument("--json", help="write the results here (benchmarks/results/async_sim.json)")
    rep = sub.add_parser("replay", help="a run's metrics.jsonl against the schedule")
    rep.add_argument("run", help="run directory or metrics.jsonl")
    rep.add_argument("--max-staleness", type=int, required=True)
    rep.add_argument("--transfer-overlaps", action="store_true", help="the trainer goes on while the weights move")
    rep.add_argument("--json", help="write the comparison here")
    args = parser.parse_args(argv)
    if args.command == "predict":
        results = record()
        if args.json:
            pathlib.Path(args.json).write_text(to_json(results), encoding="utf-8")
        print(markdown(results))
        return 0
    result = compare(read_step_rows(args.run), max_staleness=args.max_staleness,
                     transfer_blocks_trainer=not args.transfer_overlaps)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "events"}, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
