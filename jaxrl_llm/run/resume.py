"""A run's books and checkpoints: what a checkpoint holds (the train states, the data position, the counters,
GVM's history), how a run resumes from one (with a clear error when the saved state was laid out by other
settings), and the multi-process and preemption helpers the loop's checkpointing needs."""

from __future__ import annotations

import contextlib
import signal

import jax
import numpy as np

from jaxrl_llm.run.config import uses_critic
from jaxrl_llm.run.setup import Run, release_free_host_memory
from jaxrl_llm.train.async_rollouts import load_in_flight, prune_in_flight, save_in_flight
from jaxrl_llm.train.gvm_history import GvmHistory


def new_books() -> dict:
    return {"counters": {"samples_drawn": 0, "prompts_drawn": 0, "prompts_filtered": 0}, "summary": {}}


def save(run: Run, step: int, books: dict, eval_accuracy: float | None, in_flight: dict | None = None) -> None:
    """Checkpoint `step`; `in_flight`: the rollouts of later steps drawn and not yet trained (asynchronous
    rollouts, `async_rollouts.AsyncRollouts.quiesce`), saved beside it, the data position being the one after them."""
    in_flight = in_flight or {}
    extra = {"step": step, "data": run.data.get_state(), "counters": books["counters"],
             "summary": books["summary"], "config": run.config.to_dict(), "in_flight_steps": len(in_flight)}
    if "gvm_history" in books:
        extra["gvm_history"] = books["gvm_history"].to_json()
    if in_flight and jax.process_index() == 0:  # first: a checkpoint never points at a file not yet written
        save_in_flight(run.out_dir, step, in_flight)
    run.checkpointer.save(step, train_states(run), extra, eval_accuracy=eval_accuracy)
    if jax.process_index() == 0:
        prune_in_flight(run.out_dir, run.checkpointer.all_steps())
    release_free_host_memory()  # the write's encoded chunks (CPU backend: 1.4 GB of freed heap otherwise stays)


def train_states(run: Run):
    """What a checkpoint's state holds: the policy's train state, and with a critic {"policy", "critic"}."""
    return run.state if run.critic is None else {"policy": run.state, "critic": run.critic.state}


def restore(run: Run) -> tuple[int, dict, dict]:
    """Continue from the latest checkpoint: state, data position, counters and the rollouts drawn for later steps
    and not yet trained (asynchronous rollouts; {} otherwise); a fresh start if there is no checkpoint."""
    if run.checkpointer.latest_step() is None:
        return 0, new_books(), {}
    saved_config = run.checkpointer.read_extra().get("config", {})
    check_state_layout(run.config, saved_config, run.checkpointer.directory)
    check_rollout_schedule(run.config, saved_config, run.checkpointer.directory)
    step, states, extra = run.checkpointer.restore(train_states(run))
    if run.mesh is None:  # the leaves one at a time: the restored state is not held twice
        leaves, treedef = jax.tree_util.tree_flatten(states)
        del states
        states = jax.tree_util.tree_unflatten(treedef, placed_by_default(leaves))
    if run.critic is None:
        run.state = states
    else:
        run.state, run.critic.state = states["policy"], states["critic"]
    run.data.set_state(extra["data"])
    books = {"counters": extra["counters"], "summary": extra["summary"]}
    if "gvm_history" in extra:
        books["gvm_history"] = GvmHistory.from_json(extra["gvm_history"])
    return step, books, load_in_flight(run.out_dir, step, extra.get("in_flight_steps", 0))


def placed_by_default(leaves: list) -> list:
    """`leaves` (arrays), replaced in place, placed as a fresh one-device run places its state: on the default
    device, uncommitted. orbax restores them committed to that device, and a program called with committed
    arguments is another program (its parameters carry a device assignment): a resumed run would compile its
    train step and log-prob pass again instead of reading them back from a persistent compilation cache."""
    for i in range(len(leaves)):
        leaves[i] = jax.device_put(np.asarray(leaves[i]))
    return leaves


# Keys that shape the saved train state: a resumed run must hold the same ones.
STATE_LAYOUT_KEYS = (("lora", "rank"), ("lora", "targets"))


def check_state_layout(config, saved: dict, directory) -> None:
    """A clear error when the checkpoint's train state was laid out by other settings (LoRA on or off, its
    rank or targets; a critic or none) than this run's, instead of orbax's tree mismatch."""
    current = config.to_dict()
    changed = [f"{section}.{key}: checkpoint {saved[section][key]!r}, this run {current[section][key]!r}"
               for section, key in STATE_LAYOUT_KEYS
               if section in saved and key in saved[section] and saved[section][key] != current[section][key]]
    saved_advantage = saved.get("algorithm", {}).get("advantage")
    if saved_advantage is not None and (saved_advantage == "gae") != uses_critic(config):
        changed.append(f"algorithm.advantage: checkpoint {saved_advantage!r}, this run "
                       f"{current['algorithm']['advantage']!r} (gae trains a critic, saved with the policy)")
    if changed:
        raise ValueError(f"cannot resume from {directory}: its train state was saved with other settings ("
                         + "; ".join(changed) + "); resume with the checkpoint's values or use a new train.out_dir")


def rollout_schedule(section: dict) -> tuple:
    """What a checkpoint's rollouts in flight depend on, from a config's `rollouts` section: ("partial",) for the
    sampler that never stops decoding (its engine's state is saved), else ("k", k) with k = `max_staleness` under
    `mode: async` and 0 under `sync` (async with k = 0 draws what sync draws)."""
    if section["mode"] == "partial":
        return ("partial",)
    return ("k", section["max_staleness"] if section["mode"] == "async" else 0)


def check_rollout_schedule(config, saved: dict, directory) -> None:
    """A resumed run keeps its schedule of rollouts (`rollout_schedule`): an asynchronous run's rollouts saved in
    flight were drawn for steps t .. t + k - 1 with the versions `rollouts.max_staleness` = k gave them, a partial
    run's sampler continues its unfinished samples, and a run of another schedule would read neither."""
    before = saved.get("rollouts", {"mode": "sync", "max_staleness": 0})
    now = config.to_dict()["rollouts"]
    if rollout_schedule(before) != rollout_schedule(now):
        raise ValueError(f"cannot resume from {directory} with another schedule of rollouts: it was saved with "
                         f"rollouts.mode={before['mode']!r}, max_staleness={before['max_staleness']}, this run has "
                         f"mode={now['mode']!r}, max_staleness={now['max_staleness']}; resume with the checkpoint's "
                         f"values or use a new train.out_dir")


def any_process(flag: bool) -> bool:
    """True when `flag` is true on any process (a collective when there are several)."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).any())


def host_values(tree):
    """NumPy copies of a tree of (possibly multi-process) arrays; with several processes every process
    must call this, since gathering another host's shards is a collective."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


@contextlib.contextmanager
def preemption_guard():
    """Turn SIGTERM (a preempted TPU VM) into a flag the loop checks after each step."""
    hit = {"flag": False}

    def handler(signum, frame):
        hit["flag"] = True

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield lambda: hit["flag"]
    finally:
        signal.signal(signal.SIGTERM, previous)
