"""Shared pytest fixtures. tests/ is on sys.path, so helpers import as `from tiny_models import ...`."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def full_precision_float32_matmuls():
    """On a GPU, XLA computes float32 matmuls in TF32 by default (relative error ~1e-3): the tests' float32
    tolerances against NumPy and transformers assume float32 products, so they are asked for there. CPUs
    compute float32 products in float32 anyway; nothing changes on them."""
    import jax

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
