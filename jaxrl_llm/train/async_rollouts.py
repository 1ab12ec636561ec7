"""Where a step's rollouts come from: drawn when the trainer asks (`rollouts.mode: sync`, the default), or by a
sampler thread that works up to `rollouts.max_staleness` = k updates ahead of the trainer (`async`).

    trainer:  take(t) -> update t -> [evaluate, save] -> publish(t + 1) -> take(t + 1) -> ...
    sampler:  for t = first, first + 1, ...: wait for version v(t) -> draw step t's rollouts with it -> hand over

Version v is the policy after the loop's first v steps (version 0: the initial policy). Step t's rollouts are
drawn with exactly version v(t) = max(0, t - k): the sampler of step t starts as soon as that version is
published and step t - 1's rollouts are drawn, while the trainer trains steps t - k .. t - 1. So staleness is
t - v(t) = min(t, k) on every step, by construction, and no sample is ever older than k versions (none to drop).
Everything a step draws is a function of its step index (prompts from the data stream in step order, the key
`fold_in(seed, t)`) and of v(t), so an asynchronous run is deterministic whatever the threads' timing, and k = 0
runs the synchronous loop's programs on the same values in the same order: equal to it bitwise.

The sampler thread reads the data stream and calls the scorer; the trainer thread never does. The trainer's
parameters are never read by the sampler: `publish` hands it a copy (on `rollouts.sampler_devices`, a
device-to-device transfer onto the sampler's own mesh; on shared devices a copy, since the train step donates
the state's buffers), and the sampler drops a version once no step left to draw needs it.

Checkpoints. The loop saves after update t - 1 and before publishing version t, once the sampler has drawn
every step it can with the versions it has (`quiesce`: steps up to t + k - 1). The rollouts drawn but not yet
trained (steps t .. t + k - 1) are saved beside the checkpoint (`save_in_flight`), and the data position saved
is the one after them; `--resume` hands them back to the trainer and the sampler goes on at step t + k, so a
resumed run equals the uninterrupted one.
A run that finished at step t and is resumed with more `train.steps` has no such rollouts (a finished run
draws no step past its end), and the versions t - k .. t - 1 they would have read are gone: the resumed sampler
draws steps t .. t + k - 1 with version t, its oldest (a version never precedes the step a run resumed at,
v(t) = max(start, t - k)), and goes on as above from there.

`PartialRollouts` is the sampler thread of `rollouts.mode: partial` (a sampler that never stops decoding, its
schedule and checkpoints in `train/partial_rollouts.py`), with the same protocol: take, publish, quiesce, close.
"""

from __future__ import annotations

import json
import pathlib
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.sharding import param_shardings
from jaxrl_llm.train.partial_rollouts import batch_info, pack_groups_state, unpack_groups_state
from jaxrl_llm.train.rollouts import ScoredRollouts

# ScoredRollouts' array fields, saved per in-flight step (records and round info go to JSON)
_ARRAYS = ("prompt_index", "tokens", "mask", "logprobs", "lengths", "rewards", "correct")
_ROUTES = ("routes", "prompt_routes")  # a mixture of experts' sampled routes, saved when the rollouts hold them


class SyncRollouts:
    """Today's loop: step t's rollouts are drawn when the trainer asks, with the current policy (version t)."""

    def __init__(self, draw: Callable):
        self.draw = draw  # draw(step) -> (ScoredRollouts, info), with the current policy

    def take(self, step: int) -> tuple[ScoredRollouts, dict]:
        started = time.perf_counter()
        scored, info = self.draw(step)
        info.update(policy_version=step, staleness=0, wait_s=time.perf_counter() - started,
                    sample_start=started, sample_end=time.perf_counter())
        return scored, info

    def publish(self, version: int) -> None:
        pass

    def quiesce(self, step: int) -> dict[int, tuple[ScoredRollouts, dict]]:
        return {}

    def close(self) -> None:
        pass


class _SamplerThread:
    """What the two sampler threads share: the condition the trainer and the sampler meet on, the sampler's error
    handed to the trainer (raised from `take` / `quiesce`), and `close`. A subclass sets `mode` and `doing` (what
    the sampler was about, for the error) and defines `_run`."""

    mode = ""

    def _start_thread(self, name: str) -> None:
        self.error: BaseException | None = None
        self.stopped = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._guarded, name=name, daemon=True)

    def _wait_until(self, done: Callable[[], bool]) -> None:
        """Under `self.cond`: wait until `done()` holds, raising the sampler's error if it failed first."""
        while not done() and self.error is None:
            self.cond.wait()
        if self.error is not None:
            raise RuntimeError(f"the sampler thread failed {self.doing()} "
                               f"(rollouts.mode {self.mode})") from self.error

    def close(self) -> None:
        """Stop the sampler after the segment or step it is working on (if any) and wait for it."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.thread.join()

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as err:  # handed to the trainer, which raises it from take / quiesce
            with self.cond:
                self.error = err
                self.cond.notify_all()


class AsyncRollouts(_SamplerThread):
    """The sampler thread of `rollouts.mode: async` (see the module docstring).

    `draw(step, params) -> (ScoredRollouts, info)` draws one step's rollouts (it reads the data stream);
    `snapshot()` -> the trainer's current policy; `place(params)` -> a copy of it where the sampler reads it.
    `in_flight` holds rollouts restored from a checkpoint for steps `start`, `start + 1`, ...."""

    def __init__(self, draw: Callable, snapshot: Callable, place: Callable, *, start: int, steps: int,
                 max_staleness: int, in_flight: dict[int, tuple[ScoredRollouts, dict]] | None = None):
        self.draw, self.snapshot, self.place = draw, snapshot, place
        self.k, self.steps, self.start = max_staleness, steps, start
        self.results: dict[int, tuple[ScoredRollouts, dict]] = dict(in_flight or {})
        self.next_step = start + len(self.results)  # the next step the sampler draws
        if sorted(self.results) != list(range(start, self.next_step)):
            raise ValueError(f"in-flight rollouts must be for steps {start}, {start + 1}, ...; got {sorted(self.results)}")
        self.versions: dict[int, Any] = {}
        self._start_thread("jaxrl-sampler")
        self.publish(start)
        self.thread.start()

    mode = "async"

    def doing(self) -> str:
        return f"drawing step {self.next_step + 1}"

    def version_for(self, step: int) -> int:
        """The version step `step` is drawn with: max(start, step - k), start being the step the run (re)started at."""
        return max(self.start, step - self.k)

    # ---- the trainer's side ----------------------------------------------------------------------------------

    def publish(self, version: int) -> None:
        """The policy after `version` steps, for the sampler (only if a step left to draw needs it)."""
        if version > self.start and version + self.k >= self.steps:  # v > start is read by step v + k alone
            return
        params = self.place(self.snapshot())
        with self.cond:
            self.versions[version] = params
            self.cond.notify_all()

    def take(self, step: int) -> tuple[ScoredRollouts, dict]:
        """Step `step`'s rollouts, waiting for the sampler if it has not drawn them yet."""
        started = time.perf_counter()
        with self.cond:
            self._wait_until(lambda: step in self.results)
            scored, info = self.results.pop(step)
            self.cond.notify_all()
        info["wait_s"] = time.perf_counter() - started
        return scored, info

    def quiesce(self, step: int) -> dict[int, tuple[ScoredRollouts, dict]]:
        """Wait until the sampler has drawn every step it can before version `step` is published (steps up to
        step + k - 1), then return the rollouts drawn and not yet taken: what a checkpoint at `step` saves."""
        last = min(step + self.k, self.steps)
        with self.cond:
            self._wait_until(lambda: self.next_step >= last)
            return dict(self.results)

    # ---- the sampler's side ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self.cond:
                step = self.next_step
                version = self.version_for(step)
                while not self.stopped and step < self.steps and version not in self.versions:
                    self.cond.wait()
                if self.stopped or step >= self.steps:
                    return
                params = self.versions[version]
            started = time.perf_counter()
            scored, info = self.draw(step, params)
            info.update(policy_version=version, staleness=step - version, sample_start=started,
                        sample_end=time.perf_counter())
            with self.cond:
                self.results[step] = (scored, info)
                self.next_step = step + 1
                needed = self.version_for(self.next_step)
                for old in [v for v in self.versions if v < needed]:
                    del self.versions[old]  # no step left to draw reads it
                self.cond.notify_all()


class PartialRollouts(_SamplerThread):
    """The sampler thread of `rollouts.mode: partial` (train/partial_rollouts.py): segment after segment of a
    `PartialSampler`, each with version max(0, r - lag) for the batch r it fills, every `batch_groups` groups
    handed over (those older than `max_staleness` versions dropped, or redrawn) making one step's batch.

    `make_batch(groups, step, info) -> (ScoredRollouts, info)` scores a step's groups in the trainer's thread;
    `snapshot()` / `place(params)` as `AsyncRollouts`'; `in_flight`: what `quiesce` returned for a checkpoint at
    `start` (the steps' groups and "sampler": the engine and its books), restored from `load_in_flight`."""

    def __init__(self, sampler, make_batch: Callable, snapshot: Callable, place: Callable, *, start: int, steps: int,
                 batch_groups: int, lag: int, max_staleness: int, redraw: bool = False, in_flight: dict | None = None):
        self.sampler, self.make_batch, self.snapshot, self.place = sampler, make_batch, snapshot, place
        self.steps, self.batch_groups, self.lag, self.max_staleness, self.redraw = (steps, batch_groups, lag,
                                                                                    max_staleness, redraw)
        in_flight = dict(in_flight or {})
        saved = in_flight.pop("sampler", None)
        self.results: dict[int, tuple[list, dict]] = in_flight
        self.next_step, self.pending, self.dropped, self.drawn = start, [], 0, 0  # drawn: samples since the last batch
        schedule = {"partial_lag": lag, "max_staleness": max_staleness, "redraw": redraw}
        if saved is not None:
            if saved.get("schedule", schedule) != schedule:
                raise ValueError(f"cannot resume the partial sampler saved with {saved['schedule']} under "
                                 f"{schedule}: resume with the checkpoint's rollouts settings")
            sampler.load_state_dict(saved["arrays"], saved["books"])
            self.next_step, self.pending = saved["next_step"], saved["pending"]
            self.dropped, self.drawn = saved["dropped"], saved["drawn"]
        if sorted(self.results) != list(range(start, self.next_step)):
            raise ValueError(f"in-flight partial rollouts must be for steps {start} .. {self.next_step - 1}; got "
                             f"{sorted(self.results)}")
        self.schedule = schedule
        self.versions: dict[int, Any] = {}
        self.waiting: int | None = None  # the version the sampler waits for (None: it is decoding)
        self.marks = (sampler.slot_steps, sampler.useful, time.perf_counter())  # at the last batch
        self._start_thread("jaxrl-partial-sampler")
        self.publish(start)
        self.thread.start()

    mode = "partial"

    def doing(self) -> str:
        return f"filling step {self.next_step + 1}'s batch"

    # ---- the trainer's side ----------------------------------------------------------------------------------

    def publish(self, version: int) -> None:
        """The policy after `version` steps, for the sampler (only if a batch left to fill reads it)."""
        if version and version + self.lag >= self.steps:
            return
        params = self.place(self.snapshot())
        with self.cond:
            self.versions[version] = params
            self.cond.notify_all()

    def take(self, step: int) -> tuple[Any, dict]:
        """Step `step`'s batch (waiting for the sampler to fill it), scored."""
        started = time.perf_counter()
        with self.cond:
            self._wait_until(lambda: step in self.results)
            groups, info = self.results.pop(step)
        waited = time.perf_counter() - started
        scored, info = self.make_batch(groups, step, dict(info))
        info["wait_s"] = waited
        return scored, info

    def quiesce(self, step: int) -> dict:
        """Wait until the sampler stops at its first segment with version `step` or later (or has filled every
        batch), then return what a checkpoint at `step` saves: the batches formed and not yet taken, and "sampler"
        (the engine's state and books, the groups handed over for the next batch)."""
        with self.cond:
            self._wait_until(lambda: self.waiting is not None
                             and (self.waiting >= step or self.next_step >= self.steps))
            arrays, books = self.sampler.state_dict()
            return {**self.results, "sampler": {"arrays": arrays, "books": books, "next_step": self.next_step,
                                                "pending": list(self.pending), "dropped": self.dropped,
                                                "drawn": self.drawn, "schedule": self.schedule}}

    # ---- the sampler's side ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self.cond:
                version = max(0, self.next_step - self.lag)
                self.waiting = version
                self.cond.notify_all()
                while not self.stopped and self.next_step < self.steps and version not in self.versions:
                    self.cond.wait()
                if self.stopped or self.next_step >= self.steps:
                    return
                self.waiting, params = None, self.versions[version]
            groups = self.sampler.segment(params, version)
            with self.cond:
                for group in groups:
                    self._hand_over(group)
                for old in [v for v in self.versions if v < max(0, self.next_step - self.lag)]:
                    del self.versions[old]  # no batch left to fill reads it
                self.cond.notify_all()

    def _hand_over(self, group) -> None:
        if self.next_step >= self.steps:
            return
        self.drawn += len(group.lengths)
        if self.next_step - group.oldest > self.max_staleness:
            self.dropped += 1
            if self.redraw:
                self.sampler.redraw(group.record)
            return
        self.pending.append(group)
        if len(self.pending) < self.batch_groups:
            return
        slot_steps, useful, since = self.marks
        now = time.perf_counter()
        info = {"dropped_stale": self.dropped, "drawn": self.drawn, "sample_s": now - since,
                "useful_slot_steps": self.sampler.useful - useful, "slot_steps": self.sampler.slot_steps - slot_steps,
                "sample_start": since, "sample_end": now, **batch_info(self.pending, self.next_step)}
        self.results[self.next_step] = (self.pending, info)
        self.next_step, self.pending, self.dropped, self.drawn = self.next_step + 1, [], 0, 0
        self.marks = (self.sampler.slot_steps, self.sampler.useful, now)


def copy_params(params, mesh=None):
    """A copy of `params` that the train step's donation cannot free: onto `mesh` (the sampler's own devices,
    placed by the model's partition rules; a device-to-device transfer) or, on the same devices, a fresh buffer
    per array."""
    if mesh is not None:
        return jax.device_put(params, param_shardings(params, mesh))
    return jax.tree_util.tree_map(jnp.copy, params)


# ---- in-flight rollouts beside a checkpoint ----------------------------------------------------------------

def in_flight_path(out_dir: pathlib.Path, step: int) -> pathlib.Path:
    return pathlib.Path(out_dir) / "in_flight" / f"{step}.npz"


def save_in_flight(out_dir: pathlib.Path, step: int, in_flight: dict) -> None:
    """Write the rollouts drawn for steps step.. but not trained yet (atomically: a temporary file renamed): per
    step its `ScoredRollouts` (async) or its groups (partial, with "sampler": the engine's state and books)."""
    path = in_flight_path(out_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    if "sampler" in in_flight:
        arrays, meta = _partial_arrays(in_flight)
    else:
        arrays, meta = {}, []
        for t, (scored, info) in sorted(in_flight.items()):
            for field in _ARRAYS + _ROUTES:
                if getattr(scored, field) is not None:
                    arrays[f"{t}/{field}"] = getattr(scored, field)
            meta.append({"step": t, "records": scored.records, "info": _json_info(info)})
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


def prune_in_flight(out_dir: pathlib.Path, kept_steps: list[int]) -> None:
    """Remove the in-flight files of checkpoints no longer kept."""
    for old in (pathlib.Path(out_dir) / "in_flight").glob("*.npz"):
        if not old.stem.isdigit() or int(old.stem) not in kept_steps:
            old.unlink()


def load_in_flight(out_dir: pathlib.Path, step: int, expected: int) -> dict[int, tuple[ScoredRollouts, dict]]:
    """The rollouts `save_in_flight` wrote for the checkpoint at `step` ({} when it wrote none)."""
    if expected == 0:
        return {}
    path = in_flight_path(out_dir, step)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the checkpoint at step {step} was saved with {expected} steps of "
                                f"rollouts drawn and not yet trained (rollouts.mode async or partial), kept in that "
                                f"file")
    with np.load(path) as data:
        meta = json.loads(bytes(data["meta"]).decode())
        out = _partial_in_flight(meta, data) if isinstance(meta, dict) else {}
        for entry in meta if isinstance(meta, list) else []:
            t = entry["step"]
            scored = ScoredRollouts(records=entry["records"], **{f: data[f"{t}/{f}"] for f in _ARRAYS + _ROUTES
                                                                 if f"{t}/{f}" in data.files})
            out[t] = (scored, entry["info"])
    if len(out) != expected:
        raise ValueError(f"{path} holds {len(out)} steps of in-flight rollouts, the checkpoint expects {expected}")
    return out


def _partial_arrays(in_flight: dict) -> tuple[dict, dict]:
    """A partial run's in-flight state as arrays and JSON meta (`PartialRollouts.quiesce`)."""
    saved = in_flight["sampler"]
    arrays = {f"sampler/{name}": value for name, value in saved["arrays"].items()}
    steps = [{"step": t, "groups": pack_groups_state(f"{t}", groups, arrays), "info": _json_info(info)}
             for t, (groups, info) in sorted((t, v) for t, v in in_flight.items() if t != "sampler")]
    meta = {"steps": steps, "pending": pack_groups_state("pending", saved["pending"], arrays),
            "books": saved["books"], **{k: saved[k] for k in ("next_step", "dropped", "drawn", "schedule")}}
    return arrays, meta


def _partial_in_flight(meta: dict, data) -> dict:
    out: dict = {entry["step"]: (unpack_groups_state(f"{entry['step']}", entry["groups"], data), entry["info"])
                 for entry in meta["steps"]}
    out["sampler"] = {"arrays": {k[len("sampler/"):]: np.array(data[k]) for k in data.files
                                 if k.startswith("sampler/")},
                      "books": meta["books"], "pending": unpack_groups_state("pending", meta["pending"], data),
                      **{k: meta[k] for k in ("next_step", "dropped", "drawn", "schedule")}}
    return out


def _json_info(info: dict) -> dict:
    """A round's info as JSON (numbers and nested dicts of numbers; the clock marks are process-local)."""
    return {k: (_json_info(v) if isinstance(v, dict) else float(v) if isinstance(v, (float, np.floating)) else
                int(v) if isinstance(v, (int, np.integer)) else v)
            for k, v in info.items() if k not in ("sample_start", "sample_end")}
