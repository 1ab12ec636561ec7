"""jaxrl_llm: JAX-native RL on verifiable rewards for LLM reasoning.

Subpackages are imported on demand: `import jaxrl_llm` loads nothing else (not even jax), and
`jaxrl_llm.objectives` (or `import jaxrl_llm.objectives`) imports that subpackage alone, which needs only jax
and numpy. The module `__getattr__` below does the on-demand import (PEP 562).
"""

import importlib

__version__ = "0.1.0"

_SUBPACKAGES = ("capacity", "data", "eval", "models", "objectives", "ondevice", "rewards", "run", "sampling", "tools",
                "train")
# Modules directly under the package that `jaxrl_llm.<name>` may also reach.
_MODULES = ("cli", "platforms", "plot")


def __getattr__(name: str):
    """`jaxrl_llm.objectives` and the other subpackages, imported on first access."""
    if name in _SUBPACKAGES or name in _MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module  # later accesses skip this function
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SUBPACKAGES) | set(_MODULES))
