"""VerifierPool: same scores as in-process, per-item timeout, killed and hung workers replaced."""

import os
import signal
import threading
import time

import pytest

import verifier_helpers
from jaxrl_llm.rewards import VerifierPool, math_reward, score_batch

TIMEOUT = 1.0
KILL_GRACE = 0.25
# Pipes, process reaping and a loaded CI machine: wide, as every bounded item would run 5-30 s (or forever)
# without the mechanism under test.
OVERHEAD = 3.0


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(2, timeout=TIMEOUT, kill_grace=KILL_GRACE, memory_limit_mb=1024) as verifier_pool:
        verifier_pool.wait_ready()
        yield verifier_pool


COMPLETIONS = [
    r"so $\boxed{\frac{\sqrt{8}}{2}}$",
    r"\boxed{(1, 2)}",
    "#### 1,000",
    r"The answer is $x = 4$.",
    r"\boxed{3}",
    "no answer here",
    r"\boxed{10^{10^{10^{10}}}}",
]
GOLDS = [r"\sqrt{2}", "(1,2)", "1000", "4", "4", "1", "1"]
EXPECTED = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_pool_matches_in_process_scores(pool):
    assert pool.score(COMPLETIONS, GOLDS) == EXPECTED
    assert score_batch(COMPLETIONS, GOLDS, timeout=TIMEOUT) == EXPECTED  # single-process path


def test_hung_items_time_out_without_blocking(pool):
    pids_before = set(pool.worker_pids())
    completions = ["a", "b", r"\boxed{5}"]
    golds = ["1", "2", "5"]
    started = time.perf_counter()
    scores = pool.score(completions[:2], golds[:2], reward_fn=verifier_helpers.sleep_ignoring_alarm)
    elapsed = time.perf_counter() - started
    assert scores == [0.0, 0.0]
    # Both hung items ran side by side on the two workers: less than two timeouts one after the other.
    assert elapsed < 2 * (TIMEOUT + KILL_GRACE), elapsed
    assert not pids_before & set(pool.worker_pids())  # both hung workers were killed and replaced
    for pid in pids_before:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert pool.score(completions[2:], golds[2:]) == [1.0]  # and the replacements work


def test_soft_timeout_keeps_the_worker(pool):
    pids_before = pool.worker_pids()
    started = time.perf_counter()
    assert pool.score(["30"], ["1"], reward_fn=verifier_helpers.slow_one) == [0.0]  # 30 s sleep, 1 s limit
    assert time.perf_counter() - started < TIMEOUT + OVERHEAD
    assert pool.worker_pids() == pids_before  # SIGALRM interrupted the item; no restart needed


def test_pool_survives_a_worker_killed_mid_batch(pool):
    victim = pool.worker_pids()[0]
    killer = threading.Timer(0.3, os.kill, args=(victim, signal.SIGKILL))
    killer.start()
    scores = pool.score(["0.2"] * 10, ["1"] * 10, reward_fn=verifier_helpers.slow_one)
    killer.join()
    assert victim not in pool.worker_pids()
    # The item that the killed worker held is retried once, so nothing is lost.
    assert scores == [1.0] * 10
    assert pool.score(COMPLETIONS, GOLDS) == EXPECTED


def test_crashing_item_scores_zero_and_others_survive(pool):
    scores = pool.score(["x", "y"], ["1", "1"], reward_fn=verifier_helpers.crash)
    assert scores == [0.0, 0.0]
    assert pool.score(COMPLETIONS[:2], GOLDS[:2]) == [1.0, 1.0]


def test_memory_cap_turns_a_huge_allocation_into_zero(pool):
    pids_before = pool.worker_pids()
    assert pool.score(["4"], ["1"], reward_fn=verifier_helpers.allocate_gigabytes) == [0.0]  # 4 GiB > 1 GiB cap
    assert pool.score(["0.01"], ["1"], reward_fn=verifier_helpers.allocate_gigabytes) == [1.0]
    assert pool.worker_pids() == pids_before  # MemoryError is caught inside the worker


def test_batch_timeout_bounds_the_whole_call(pool):
    started = time.perf_counter()
    scores = pool.score(["5"] * 6, ["1"] * 6, reward_fn=verifier_helpers.slow_one, timeout=10.0, batch_timeout=0.5)
    assert scores == [0.0] * 6
    assert time.perf_counter() - started < 0.5 + OVERHEAD


def test_items_spread_over_workers(pool):
    pool.wait_ready()
    pids = pool.score(["0.1"] * 6, ["1"] * 6, reward_fn=verifier_helpers.worker_pid)
    assert set(pids) == {float(pid) for pid in pool.worker_pids()}


def test_bad_arguments_raise_clear_errors(pool):
    with pytest.raises(ValueError, match="2 completions but 1 golds"):
        pool.score(["a", "b"], ["1"])
    with pytest.raises(TypeError, match="picklable"):
        pool.score(["a"], ["1"], reward_fn=lambda completion, gold: 1.0)
    with pytest.raises(ValueError, match="unsafe"):
        VerifierPool(1, start_method="fork")
    with pytest.raises(ValueError, match="num_workers"):
        VerifierPool(0)


def test_closed_pool_refuses_work():
    verifier_pool = VerifierPool(1, timeout=TIMEOUT)
    pids = verifier_pool.worker_pids()
    verifier_pool.close()
    verifier_pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        verifier_pool.score(["a"], ["1"])
    time.sleep(0.2)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_score_batch_with_workers_and_single_process_timeout():
    assert score_batch(COMPLETIONS[:3], GOLDS[:3], num_workers=1, timeout=TIMEOUT) == [1.0, 1.0, 1.0]
    started = time.perf_counter()
    assert score_batch(["30"], ["1"], reward_fn=verifier_helpers.slow_one, timeout=0.3) == [0.0]
    assert time.perf_counter() - started < 0.3 + OVERHEAD
    assert math_reward(r"\boxed{2}", "2") == 1.0
