"""Shared pytest fixtures. tests/ is on sys.path, so helpers import as `from tiny_models import ...`.

The suite compiles with XLA's backend (LLVM) optimizations off, `JAX_DISABLE_MOST_OPTIMIZATIONS=1`, set here
before jax is imported so that every process a test starts (multi-process runs, CLI runs, kill -9 and
resume) inherits it. The tests check values on tiny models and spend most of their time compiling: on this
project's 2-core CPU, tests/test_train_step.py, test_sampling_continuous.py and test_gvm.py took 378 s
against 643 s with full optimization. The HLO passes still run, so the programs compute the same things;
speed is measured by benchmarks/, which compile as users do. Set the variable to 0 to test with full
optimization."""

import atexit
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from jaxrl_llm.platforms import quiet_absent_accelerators

os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# One persistent compilation cache for the run: many tests compile the same programs (the same tiny model's train
# step, sampler and mesh programs) in new jit objects, in pytest-xdist's other worker, or in the processes they start
# (CLI runs, kill -9 and resume); each program is compiled once per run and read back after. It lives in a
# temporary directory of this run, never the user's (a JAX_COMPILATION_CACHE_DIR of theirs is not used), made by
# the first pytest process and inherited through the environment by the workers and every process a test starts;
# it is removed when that process ends. JAXRL_TEST_COMPILATION_CACHE=0 turns it off.
if os.environ.get("JAXRL_TEST_COMPILATION_CACHE", "1") != "0" and "JAXRL_TEST_CACHE_OWNER" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="jaxrl_llm-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache_dir, True)
    os.environ.update(JAXRL_TEST_CACHE_OWNER=str(os.getpid()), JAX_COMPILATION_CACHE_DIR=_cache_dir,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

# The test extras install libtpu (and the CUDA plugin) for the ahead-of-time compile tests. Off a TPU, every JAX
# process would otherwise try to open a TPU at start (an error message each) and take libtpu's lockfile, which a
# second process (pytest-xdist's other worker, a multi-process test) then fails on. The CLI decides this at start
# (jaxrl_llm.platforms); here the same decision reaches the workers and every process a test starts: without a TPU
# or a GPU the tests run on the CPU backend (TPU and GPU topologies still compile) and libtpu may load twice.
quiet_absent_accelerators()

import jax  # noqa: E402
import pytest  # noqa: E402

# Also when jax was imported before this file (a plugin), which reads the variables only at import.
jax.config.update("jax_disable_most_optimizations", os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] != "0")
if "JAX_COMPILATION_CACHE_DIR" in os.environ and "JAXRL_TEST_CACHE_OWNER" in os.environ:
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def pytest_configure(config):
    # Programs compiled for a TPU topology without a TPU (jaxrl-llm compile) are written to the cache but cannot be
    # read back by a compile-only client: JAX warns and compiles them again, as it would without the cache.
    config.addinivalue_line("filterwarnings", "ignore:Error reading persistent compilation cache entry.*PjRtCompiler "
                                              "must be constructed with a Client:UserWarning")


@pytest.fixture(scope="session", autouse=True)
def full_precision_float32_matmuls():
    """On a GPU, XLA computes float32 matmuls in TF32 by default (relative error ~1e-3): the tests' float32
    tolerances against NumPy and transformers assume float32 products, so they are asked for there. CPUs
    compute float32 products in float32 anyway; nothing changes on them."""
    if jax.default_backend() != "cpu":
        jax.config.update("jax_default_matmul_precision", "highest")
    yield


# Every compiled CPU program keeps a few memory mappings of its machine code (about 3 per small program) for as long as
# JAX caches it. A worker that compiles the suite's programs one after another nears Linux's vm.max_map_count (65530
# by default), where the next compilation's mmap fails inside XLA and the worker dies with a segmentation fault.
MAX_MAPPINGS = 40_000


@pytest.fixture(autouse=True)
def release_compiled_programs_near_the_map_limit():
    """After a test, drop JAX's in-memory caches of compiled programs when this process holds more than
    MAX_MAPPINGS memory mappings (the programs are read back from the run's persistent cache when used again)."""
    yield
    try:
        with open("/proc/self/maps", "rb") as maps:
            count = sum(1 for _ in maps)
    except OSError:  # not Linux: no such limit to keep under
        return
    if count > MAX_MAPPINGS:
        jax.clear_caches()


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


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory):
    """`once_per_run(name, make)` -> a directory that `make(directory)` fills once in this test run, whichever
    pytest-xdist worker asks first (under a file lock; a worker asking meanwhile waits for it, and later ones
    find it made). For end-to-end runs several tests read (a reference run their own runs must equal): tests
    only read the directory. When `make` fails, the next test to ask makes it again (and fails the same way)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if "PYTEST_XDIST_WORKER" in os.environ else base  # the workers' folders share a parent

    def get(name: str, make) -> pathlib.Path:
        import fcntl  # POSIX only: imported here, so that the rest of the suite does not need it

        folder = root / f"once-{name}"
        with open(root / f"once-{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (folder / ".made").is_file():
                shutil.rmtree(folder, ignore_errors=True)  # what a failed attempt left
                folder.mkdir()
                make(folder)
                (folder / ".made").touch()
        return folder

    return get


ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_loop_run(once_per_run):
    """The uninterrupted tests/loop_runner.py run with its defaults (TINY_RUN: 4 steps, a checkpoint each step),
    made once for the tests that compare their own runs with it: (its train.out_dir, its stdout)."""

    def make(folder: pathlib.Path) -> None:
        runner = [sys.executable, str(ROOT / "tests" / "loop_runner.py"), f"train.out_dir={folder / 'run'}"]
        proc = subprocess.run(runner, capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert proc.returncode == 0, f"loop_runner failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n" \
                                     f"{proc.stderr[-3000:]}"
        (folder / "stdout.txt").write_text(proc.stdout, encoding="utf-8")

    folder = once_per_run("tiny_loop_run", make)
    return folder / "run", (folder / "stdout.txt").read_text(encoding="utf-8")
