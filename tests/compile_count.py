"""Counting XLA compilations in a test: `with counted_compiles() as compiles: ...` then len(compiles). Counts the
backend-compile event, which jax records for every executable it builds or reads back from the suite's persistent
compilation cache (conftest), so a test's count does not depend on which programs other tests compiled first (a jit
function's `_cache_size()` does: an executable read back from the cache leaves it at 0)."""

from __future__ import annotations

import contextlib

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def counted_compiles():
    compiles: list[float] = []

    def on_event(event, duration, **kwargs):
        if event == BACKEND_COMPILE:
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
