"""Batched answer checking in worker processes with a per-item timeout and a memory cap.

A verifier that hangs (sympy on a hostile answer) or dies (memory, segfault) must not stall the
trainer. Each worker is one process with its own pipe, so the parent always knows which item a
worker holds: an item that runs past ``timeout`` gets a soft SIGALRM inside the worker, and its
worker is SIGKILLed ``kill_grace`` seconds later and replaced; a worker that dies is replaced and
its item retried ``crash_retries`` times (it may have been killed from outside); items that time
out or keep crashing score ``failure_value`` (0.0). Workers start with ``forkserver`` (or ``spawn``), never
``fork``: a JAX process must not fork after its runtime has started threads. Each worker caps its
address space with ``resource.setrlimit(RLIMIT_AS)``.
"""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from jaxrl_llm.rewards.equivalence import DEFAULT_TIMEOUT, math_reward
from jaxrl_llm.rewards.parse import warm_up
from jaxrl_llm.rewards.safety import time_limit

ItemReward = Callable[[str, str], float]
# A worker that has not reported ready this long after its start is replaced.
_STARTUP_TIMEOUT = 120.0
_MAX_START_FAILURES = 5


def _worker_main(conn, memory_limit_bytes: int | None) -> None:
    """Worker loop: receive (index, reward_fn, completion, gold, timeout), send (index, value)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if memory_limit_bytes is not None:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = memory_limit_bytes if hard == resource.RLIM_INFINITY else min(memory_limit_bytes, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    warm_up()  # import sympy and the parser before reporting ready (a no-op after the preload)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if task is None:
            return
        index, reward_fn, completion, gold, timeout = task
        try:
            with time_limit(timeout):
                value = float(reward_fn(completion, gold))
        except BaseException:  # noqa: BLE001 - timeouts, MemoryError, any failure: the item scores 0
            value = None
        conn.send((index, value))


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    launched: float
    ready: bool = False
    task: int | None = None
    task_started: float = 0.0
    pid: int | None = field(default=None)


class VerifierPool:
    """Process pool that scores (completion, gold) pairs with ``reward_fn`` under a time limit.

    ``score`` returns one float per pair; an item that times out, crashes its worker or raises gets
    ``failure_value``. One call blocks at most ``ceil(n / num_workers) * (timeout + kill_grace)``
    plus worker start-up, and never past ``batch_timeout`` (+ a few ms) when that is given.
    Use as a context manager or call ``close()``.
    """

    def __init__(
        self,
        num_workers: int = 2,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        memory_limit_mb: int | None = 2048,
        reward_fn: ItemReward = math_reward,
        failure_value: float = 0.0,
        kill_grace: float = 0.25,
        crash_retries: int = 1,
        start_method: str | None = None,
    ):
        if num_workers < 1:
            raise ValueError(f"VerifierPool: num_workers must be >= 1, got {num_workers}")
        if timeout <= 0:
            raise ValueError(f"VerifierPool: timeout must be > 0 seconds, got {timeout}")
        if start_method is None:
            start_method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        if start_method == "fork":
            raise ValueError("VerifierPool: start_method 'fork' is unsafe in a JAX process; use 'forkserver' or 'spawn'")
        self.num_workers = num_workers
        self.timeout = timeout
        self.reward_fn = reward_fn
        self.failure_value = failure_value
        self.kill_grace = kill_grace
        self.crash_retries = crash_retries
        self._memory_limit = None if memory_limit_mb is None else int(memory_limit_mb) * 2**20
        self._context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # Workers fork from a server that already imported the verifier: fast replacements.
            self._context.set_forkserver_preload(["jaxrl_llm.rewards.preload"])
        self._start_failures = 0
        self._workers = [self._launch() for _ in range(num_workers)]
        self._closed = False

    # -- worker management -------------------------------------------------------------------
    def _launch(self) -> _Worker:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_worker_main, args=(child_conn, self._memory_limit), daemon=True, name="verifier-worker"
        )
        process.start()
        child_conn.close()
        return _Worker(process=process, conn=parent_conn, launched=time.monotonic())

    def _replace(self, worker: _Worker) -> _Worker:
        """Kill ``worker`` (if still running) and start a fresh one in its slot."""
        if worker.process.is_alive():
            try:
                os.kill(worker.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        worker.process.join(timeout=1.0)
        worker.conn.close()
        if not worker.ready:
            self._start_failures += 1
            if self._start_failures > _MAX_START_FAILURES:
                raise RuntimeError(f"VerifierPool: {self._start_failures} workers died before becoming ready")
        replacement = self._launch()
        self._workers[self._workers.index(worker)] = replacement
        return replacement

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (for monitoring and fault-injection tests)."""
        return [worker.process.pid for worker in self._workers]

    def wait_ready(self, timeout: float = _STARTUP_TIMEOUT) -> None:
        """Block until every worker has imported the verifier (optional: ``score`` waits anyway)."""
        deadline = time.monotonic() + timeout
        for worker in list(self._workers):
            while not worker.ready and time.monotonic() < deadline:
                if worker.conn.poll(max(0.0, deadline - time.monotonic())):
                    self._receive(worker, [self.failure_value])
            if not worker.ready:
                raise TimeoutError(f"VerifierPool: a worker was not ready after {timeout} s")

    def _receive(self, worker: _Worker, results: list[float]) -> bool:
        """Read one message from ``worker``; False when the worker is dead (caller replaces it)."""
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            return False
        if message[0] == "ready":
            worker.ready, worker.pid = True, message[1]
            self._start_failures = 0
        elif message[0] == worker.task:
            if message[1] is not None:
                results[message[0]] = message[1]
            worker.task = None
        return True

    # -- scoring -------------------------------------------------------------------------------
    def score(
        self,
        completions: Sequence[str],
        golds: Sequence[str],
        *,
        reward_fn: ItemReward | None = None,
        timeout: float | None = None,
        batch_timeout: float | None = None,
    ) -> list[float]:
        """``[reward_fn(c, g) for c, g in zip(completions, golds)]``, computed in the workers.

        ``reward_fn`` must be a module-level (picklable) function ``(completion, gold) -> float``.
        """
        if self._closed:
            raise RuntimeError("VerifierPool.score called after close()")
        if len(completions) != len(golds):
            raise ValueError(f"VerifierPool.score: {len(completions)} completions but {len(golds)} golds")
        reward_fn = self.reward_fn if reward_fn is None else reward_fn
        try:
            pickle.dumps(reward_fn)
        except Exception as error:
            raise TypeError(f"VerifierPool: reward_fn must be a picklable module-level function: {error}") from error
        timeout = self.timeout if timeout is None else timeout
        results = [self.failure_value] * len(completions)
        pending = collections.deque(range(len(completions)))
        crashes = collections.Counter()
        deadline = None if batch_timeout is None else time.monotonic() + batch_timeout
        while pending or any(worker.task is not None for worker in self._workers):
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.ready and worker.task is None and pending:
                    if not worker.process.is_alive():
                        self._replace(worker)  # died while idle: no item is lost
                        continue
                    index = pending.popleft()
                    try:
                        worker.conn.send((index, reward_fn, completions[index], golds[index], timeout))
                    except (BrokenPipeError, OSError):
                        self._replace(worker)  # died while idle; the item goes back to the queue
                        pending.appendleft(index)
                        continue
                    worker.task, worker.task_started = index, now
            wake = [worker.task_started + timeout + self.kill_grace for worker in self._workers if worker.task is not None]
            wake += [worker.launched + _STARTUP_TIMEOUT for worker in self._workers if not worker.ready]
            if deadline is not None:
                wake.append(deadline)
            wait_for = max(0.0, min(wake) - time.monotonic()) if wake else 0.05
            readable = multiprocessing.connection.wait([worker.conn for worker in self._workers], timeout=wait_for)
            for worker in list(self._workers):
                if worker.conn in readable and not self._receive(worker, results):
                    lost = worker.task
                    if lost is not None and crashes[lost] < self.crash_retries:
                        crashes[lost] += 1
                        pending.appendleft(lost)  # maybe killed from outside: one more try
                    self._replace(worker)  # else the item keeps failure_value
            now = time.monotonic()
            for worker in list(self._workers):
                overdue = worker.task is not None and now > worker.task_started + timeout + self.kill_grace
                stuck = not worker.ready and now > worker.launched + _STARTUP_TIMEOUT
                if overdue or stuck:
                    self._replace(worker)
            if deadline is not None and now >= deadline:
                for worker in list(self._workers):
                    if worker.task is not None:
                        self._replace(worker)
                break
        return results

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every worker (politely, then by SIGKILL). Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for worker in self._workers:
            worker.process.join(timeout=0.5)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=1.0)
            worker.conn.close()

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn multiprocessing down
            pass


def score_batch(
    completions: Sequence[str],
    golds: Sequence[str],
    *,
    reward_fn: ItemReward = math_reward,
    timeout: float = DEFAULT_TIMEOUT,
    num_workers: int = 0,
    memory_limit_mb: int | None = 2048,
) -> list[float]:
    """Score pairs with ``reward_fn`` and a per-item ``timeout``.

    ``num_workers=0``: in this process, each item under a SIGALRM time limit (main thread only; no
    memory cap, no protection from a C-level hang — fine for small, trusted batches).
    ``num_workers>0``: a temporary `VerifierPool` (start-up costs ~1 s; keep a pool for repeated use).
    """
    if len(completions) != len(golds):
        raise ValueError(f"score_batch: {len(completions)} completions but {len(golds)} golds")
    warm_up()  # imports must not run under the per-item timer (see parse.warm_up)
    if num_workers > 0:
        with VerifierPool(num_workers, timeout=timeout, memory_limit_mb=memory_limit_mb, reward_fn=reward_fn) as pool:
            return pool.score(completions, golds)
    results = []
    for completion, gold in zip(completions, golds):
        try:
            with time_limit(timeout):
                results.append(float(reward_fn(completion, gold)))
        except BaseException as error:  # noqa: BLE001
            if isinstance(error, KeyboardInterrupt):
                raise
            results.append(0.0)
    return results
