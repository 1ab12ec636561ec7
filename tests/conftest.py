"""Shared pytest fixtures. tests/ is on sys.path, so helpers import as `from tiny_models import ...`.

The suite compiles with XLA's backend (LLVM) optimizations off, `JAX_DISABLE_MOST_OPTIMIZATIONS=1`, set here
before jax is imported so that every process a test starts (multi-process runs, CLI runs, kill -9 and
resume) inherits it. The tests check values on tiny models and spend most of their time compiling: on this
project's 2-core CPU, tests/test_train_step.py, test_sampling_continuous.py and test_gvm.py took 378 s
against 643 s with full optimization. The HLO passes still run, so the programs compute the same things;
speed is measured by benchmarks/, which compile as users do. Set the variable to 0 to test with full
optimization."""

import os

from jaxrl_llm.platforms import quiet_absent_accelerators

os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# The test extras install libtpu (and the CUDA plugin) for the ahead-of-time compile tests. Off a TPU, every JAX
# process would otherwise try to open a TPU at start (an error message each) and take libtpu's lockfile, which a
# second process (pytest-xdist's other worker, a multi-process test) then fails on. The CLI decides this at start
# (jaxrl_llm.platforms); here the same decision reaches the workers and every process a test starts: without a TPU
# or a GPU the tests run on the CPU backend (TPU and GPU topologies still compile) and libtpu may load twice.
quiet_absent_accelerators()

import jax  # noqa: E402
import pytest  # noqa: E402

# Also when jax was imported before this file (a plugin), which reads the variable only at import.
jax.config.update("jax_disable_most_optimizations", os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] != "0")


@pytest.fixture(scope="session", autouse=True)
def full_precision_float32_matmuls():
    """On a GPU, XLA computes float32 matmuls in TF32 by default (relative error ~1e-3): the tests' float32
    tolerances against NumPy and transformers assume float32 products, so they are asked for there. CPUs
    compute float32 products in float32 anyway; nothing changes on them."""
    if jax.default_backend() != "cpu":
        jax.config.update("jax_default_matmul_precision", "highest")
    yield


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """`tiny_checkpoint(family, seed=0)` -> directory of a tiny random transformers checkpoint,
    made once per session (needs torch; skips when it is missing)."""
    pytest.importorskip("torch")
    from tiny_models import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("tiny_checkpoints")
    made = {}

    def get(family: str, seed: int = 0):
        if (family, seed) not in made:
            made[family, seed] = make_tiny_hf_checkpoint(root, family, seed)
        return made[family, seed]

    return get
