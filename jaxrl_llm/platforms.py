"""Which of JAX's accelerator plugins have a device on this host, decided before jax is imported.

Installed plugins start in every JAX process whether or not their hardware is there. Off a TPU, libtpu (the `tpu`
and `test` extras) probes for one and prints "E0000 ... unexpected worker hostname 'WARNING: could not determine TPU
worker hostnames ...'"; off a GPU, the CUDA plugin (the `gpu-compile` extra) prints a traceback ending in "Unable
to load CUDA. Is it installed?". `quiet_absent_accelerators()` names only the platforms whose devices exist here in
JAX_PLATFORMS, so neither plugin opens a backend. Both stay registered: `jaxrl-llm compile` still builds TPU and GPU
programs through them. A user's own JAX_PLATFORMS is kept, and so is everything on a host where each installed
plugin finds its device.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.metadata
import importlib.util
import os
import pkgutil
import shutil
from collections.abc import Mapping, MutableMapping

# libtpu reads these when it starts. Off a TPU it has no slice to describe, and without them it prints an error
# about the placeholder hostnames it found; a compile-only topology (jaxrl-llm compile) takes its hosts from the
# topology's name, and its devices and programs are the same with or without them.
NO_TPU_ENV = {
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # libtpu's lockfile guards a TPU; without one, two compiles may run at once
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_HOST_BOUNDS": "1,1,1",
}


@dataclasses.dataclass(frozen=True)
class Host:
    """What is installed and what is attached: `libtpu` / `cuda_plugin` installed, `tpu` / `gpu` devices present,
    and `other_plugins`, JAX plugins whose devices this module cannot check (ROCm, ...)."""

    libtpu: bool
    tpu: bool
    cuda_plugin: bool
    gpu: bool
    other_plugins: tuple[str, ...] = ()


def _device_files(pattern: str) -> list[str]:
    return glob.glob(pattern)


def tpu_attached() -> bool:
    """A TPU chip is attached: the device files libtpu opens, /dev/accel* (TPU v2-v5e) or /dev/vfio/<group>
    (v5p, v6e and later). /dev/vfio/vfio alone is the VFIO driver, present on hosts without a TPU."""
    return bool(_device_files("/dev/accel*") or _device_files("/dev/vfio/[0-9]*"))


def nvidia_gpu_attached() -> bool:
    """An NVIDIA GPU may be attached: JAX's own check (/dev/nvidia0, /dev/nvidiactl, WSL's /dev/dxg), widened to
    any /dev/nvidia* and to nvidia-smi on PATH, so that a doubtful host keeps every platform."""
    return bool(_device_files("/dev/nvidia*") or _device_files("/dev/dxg") or shutil.which("nvidia-smi"))


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing or half-installed
        return False


def jax_plugin_modules() -> set[str]:
    """The plugin modules JAX imports at start: those in the `jax_plugins` namespace package and those advertised
    under the `jax_plugins` entry-point group (`xla_bridge.discover_pjrt_plugins`), found without importing them."""
    modules = {entry.value.split(":")[0] for entry in importlib.metadata.entry_points(group="jax_plugins")}
    try:
        spec = importlib.util.find_spec("jax_plugins")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        modules |= {f"jax_plugins.{m.name}" for m in pkgutil.iter_modules(spec.submodule_search_locations)}
    return modules


def this_host(environ: Mapping[str, str] = os.environ) -> Host:
    """The installed plugins (looked up, never imported) and the attached devices of this machine."""
    plugins = jax_plugin_modules()
    cuda = {m for m in plugins if m.startswith("jax_plugins.xla_cuda")}
    return Host(
        libtpu=_installed("libtpu") or bool(environ.get("TPU_LIBRARY_PATH")),
        tpu=tpu_attached(),
        cuda_plugin=bool(cuda),
        gpu=nvidia_gpu_attached(),
        other_plugins=tuple(sorted(plugins - cuda)),
    )


def quiet_env(host: Host, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment variables that keep `host`'s plugins without a device from starting; {} where the user set
    JAX_PLATFORMS (or the older JAX_PLATFORM_NAME) or where every installed plugin has its device.

    JAX_PLATFORMS lists the platforms with devices, then cpu: a GPU host with libtpu gets "cuda,cpu". It is left
    unset beside a plugin of another kind (`other_plugins`), whose device may be there; libtpu is then kept quiet
    by NO_TPU_ENV alone."""
    if "JAX_PLATFORMS" in environ or "JAX_PLATFORM_NAME" in environ:
        return {}
    idle_tpu = host.libtpu and not host.tpu
    idle_gpu = host.cuda_plugin and not host.gpu
    env = {}
    if (idle_tpu or idle_gpu) and not host.other_plugins:
        platforms = [name for name, used in (("tpu", host.libtpu and host.tpu),
                                             ("cuda", host.cuda_plugin and host.gpu)) if used]
        env["JAX_PLATFORMS"] = ",".join([*platforms, "cpu"])
    if idle_tpu:
        env.update({k: v for k, v in NO_TPU_ENV.items() if k not in environ})
    return env


def quiet_absent_accelerators(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Sets `quiet_env(this_host())` in `environ` (call before jax is imported; processes started later inherit it)
    and returns what it set."""
    env = quiet_env(this_host(environ), environ)
    environ.update(env)
    return env
