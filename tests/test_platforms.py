"""jaxrl_llm.platforms: the CLI restricts JAX to the platforms whose devices are here, so that libtpu and the CUDA
plugin, installed by the extras, neither probe nor print on a host without their hardware; `jaxrl-llm compile`
still builds TPU programs through libtpu."""

import fnmatch
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from jaxrl_llm import platforms
from jaxrl_llm.platforms import NO_TPU_ENV, Host, quiet_env
from tiny_gguf import expected_hf_config, write_tiny_gguf

ROOT = pathlib.Path(__file__).resolve().parents[1]
# What conftest (through quiet_absent_accelerators) sets for the suite; a user's shell has none of it.
SET_BY_THE_SUITE = ("JAX_PLATFORMS", "JAX_PLATFORM_NAME", *NO_TPU_ENV)
LIBTPU_ERROR = "unexpected worker hostname"
CUDA_TRACEBACK = "Jax plugin configuration error"


def test_a_host_without_tpu_or_gpu_runs_on_the_cpu_with_libtpu_quiet():
    host = Host(libtpu=True, tpu=False, cuda_plugin=True, gpu=False)
    assert quiet_env(host, {}) == {"JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
                                   "TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}
    assert quiet_env(Host(libtpu=False, tpu=False, cuda_plugin=True, gpu=False), {}) == {"JAX_PLATFORMS": "cpu"}


def test_hosts_with_their_devices_keep_them():
    assert quiet_env(Host(libtpu=True, tpu=True, cuda_plugin=False, gpu=False), {}) == {}
    assert quiet_env(Host(libtpu=False, tpu=False, cuda_plugin=True, gpu=True), {}) == {}
    assert quiet_env(Host(libtpu=False, tpu=False, cuda_plugin=False, gpu=False), {}) == {}
    # a GPU host with the test extra's libtpu: the GPU first, libtpu kept from probing
    assert quiet_env(Host(libtpu=True, tpu=False, cuda_plugin=True, gpu=True), {})["JAX_PLATFORMS"] == "cuda,cpu"
    # a TPU host with the CUDA plugin installed
    assert quiet_env(Host(libtpu=True, tpu=True, cuda_plugin=True, gpu=False), {}) == {"JAX_PLATFORMS": "tpu,cpu"}


def test_the_users_choice_and_unknown_plugins_are_kept():
    idle = Host(libtpu=True, tpu=False, cuda_plugin=True, gpu=False)
    assert quiet_env(idle, {"JAX_PLATFORMS": ""}) == {}
    assert quiet_env(idle, {"JAX_PLATFORM_NAME": "cpu"}) == {}
    assert quiet_env(idle, {"TPU_HOST_BOUNDS": "2,2,1"}) == {"JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
                                                             "TPU_WORKER_HOSTNAMES": "localhost"}
    # a ROCm plugin's GPU may be there: JAX_PLATFORMS stays unset, libtpu is quieted by its own variables
    rocm = Host(libtpu=True, tpu=False, cuda_plugin=False, gpu=False, other_plugins=("jax_plugins.xla_rocm7",))
    assert quiet_env(rocm, {}) == NO_TPU_ENV


def test_device_files_decide_what_is_attached(monkeypatch):
    files = []
    monkeypatch.setattr(platforms, "_device_files", lambda pattern: fnmatch.filter(files, pattern))
    monkeypatch.setattr(platforms.shutil, "which", lambda name: None)
    assert not platforms.tpu_attached() and not platforms.nvidia_gpu_attached()
    files[:] = ["/dev/vfio/vfio"]  # the VFIO driver alone, on a host without a TPU
    assert not platforms.tpu_attached()
    files[:] = ["/dev/accel0"]
    assert platforms.tpu_attached()
    files[:] = ["/dev/vfio/vfio", "/dev/vfio/0"]  # v5p, v6e
    assert platforms.tpu_attached()
    files[:] = ["/dev/nvidiactl"]
    assert platforms.nvidia_gpu_attached() and not platforms.tpu_attached()
    files[:] = ["/dev/dxg"]
    assert platforms.nvidia_gpu_attached()
    monkeypatch.setattr(platforms.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    files[:] = []
    assert platforms.nvidia_gpu_attached()


def test_the_users_jax_platforms_is_not_touched():
    env = {"JAX_PLATFORMS": "tpu"}
    assert platforms.quiet_absent_accelerators(env) == {} and env == {"JAX_PLATFORMS": "tpu"}


def _cli(*args, timeout=600) -> subprocess.CompletedProcess:
    """`jaxrl-llm ARGS` as a user's shell runs it: none of the suite's platform variables set."""
    env = {k: v for k, v in os.environ.items() if k not in SET_BY_THE_SUITE}
    script = shutil.which("jaxrl-llm", path=str(pathlib.Path(sys.executable).parent))
    command = [script] if script else [sys.executable, "-m", "jaxrl_llm.cli"]
    return subprocess.run([*command, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _needs_idle_libtpu():
    pytest.importorskip("libtpu")
    if platforms.tpu_attached():
        pytest.skip("a TPU is attached: libtpu opens it, as it should")


@pytest.mark.slow
def test_sample_with_libtpu_and_no_tpu_prints_no_probe_error(tmp_path):
    """Before platforms.py, this printed libtpu's "E0000 ... unexpected worker hostname ..." (and, with the CUDA
    plugin on a host without a GPU, its "Unable to load CUDA" traceback) before the completion."""
    _needs_idle_libtpu()
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, "llama", seed=3)
    done = _cli("sample", "--gguf", str(gguf), "--prompt", "hi", "--max-new-tokens", "2")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "--- completion ---" in done.stdout
    assert LIBTPU_ERROR not in output and "E0000" not in output, output
    if not platforms.nvidia_gpu_attached():
        assert CUDA_TRACEBACK not in output and "Unable to load CUDA" not in output, output


@pytest.mark.slow
def test_compile_still_finds_libtpu_and_prints_no_probe_error(tmp_path):
    """`jaxrl-llm compile` from a user's shell compiles for a TPU slice through libtpu, quietly, with the same
    variables the CLI sets for every command."""
    _needs_idle_libtpu()
    model = tmp_path / "tiny_llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(expected_hf_config("llama", tied=False)))
    out = tmp_path / "out.json"
    done = _cli("compile", "--config", str(ROOT / "configs" / "grpo.yaml"), "--topology", "v5e:2x2", "--json",
                str(out), f"model.source={model}", "sampling.max_new_tokens=16", "data.max_prompt_tokens=32",
                "sampling.prompts_per_step=4", "sampling.samples_per_prompt=2", "optim.micro_batch_size=4")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    programs = json.loads(out.read_text())["programs"]
    assert "train_step" in [p["name"] for p in programs] and all(p["fits"] and not p["error"] for p in programs)
    assert LIBTPU_ERROR not in output and "E0000" not in output, output
