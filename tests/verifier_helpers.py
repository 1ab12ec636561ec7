"""Item reward functions for the verifier-pool tests (module level, so workers can unpickle them)."""

import os
import signal
import time


def slow_one(completion, gold):
    """1.0 after sleeping ``completion`` seconds (a float)."""
    time.sleep(float(completion))
    return 1.0


def sleep_ignoring_alarm(completion, gold):
    """Hangs with SIGALRM blocked, like a C-level loop: only a SIGKILL from the parent ends it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
    time.sleep(3600)
    return 1.0


def crash(completion, gold):
    """Ends the worker process at once, as a segfault would."""
    os._exit(3)


def allocate_gigabytes(completion, gold):
    """Tries to hold ``completion`` GiB; under the pool's RLIMIT_AS this raises MemoryError."""
    block = bytearray(int(float(completion) * 2**30))
    return float(len(block) > 0)


def worker_pid(completion, gold):
    """The worker's process id (to check which worker ran an item)."""
    return float(os.getpid())
