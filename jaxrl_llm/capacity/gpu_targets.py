"""NVIDIA GPU hosts as compile targets, on any machine (no GPU needed): `jaxrl-llm compile --topology h200-8`.

XLA's GPU compiler runs without a GPU when it is handed a description of the card, a `GpuTargetConfig` text proto
(xla/stream_executor/device_description.proto): `jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=..., topology="<slices>x<hosts>x<gpus per host>")` returns compile-only devices of that many cards.
This path is not documented by JAX (jax issues #28376, #23971); its limits are in docs/launch.md: no autotuning
(GEMMs get untuned Triton configs), cuDNN graphs are not built or validated, and the HLO text the statistics are
read from is not a stable format. Checked with jax, jaxlib, jax-cuda12-plugin and jax-cuda12-pjrt 0.10.2,
nvidia-cudnn-cu12 9.28 (tracing cuDNN attention needs it) and nvidia-cuda-nvcc-cu12 12.9 (its ptxas compiles the
kernels' PTX: without a ptxas XLA stops, "No PTX compilation provider is available"): the `gpu-compile` extra.

The CUDA plugin is an optional extra; `gpu_devices` raises `CudaPluginMissing` without it. On a host without a GPU
the plugin registers only if its check of the CUDA libraries is skipped: JAX_PLATFORMS=cpu (what `jaxrl-llm compile`
and the test suite set) skips it, and so does JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 (the compile command also sets it for
a GPU topology, before jax starts); without either, get_topology_desc says "topology not implemented for cuda".
CUDA_VISIBLE_DEVICES=-1 was not needed in either case (jaxlib 0.10.2).
"""

from __future__ import annotations

import importlib.util
import re

from jaxrl_llm.capacity.chips import CHIPS, COMPILER_MEMORY_FRACTION, Gpu  # noqa: F401

INSTALL_HINT = ("compiling for an NVIDIA GPU needs the CUDA plugin: pip install 'jaxrl_llm[gpu-compile]' (or bash "
                "scripts/setup.sh gpu-compile), which installs jax-cuda12-plugin, jax-cuda12-pjrt, nvidia-cudnn-cu12, "
                "nvidia-cuda-nvcc-cu12 and nvidia-cuda-runtime-cu12 at the versions this project tested")


class CudaPluginMissing(RuntimeError):
    """Compiling for a GPU needs jax-cuda12-plugin and jax-cuda12-pjrt at jax's version (the gpu-compile extra)."""


# Seconds each launched kernel costs beyond its roofline: fitted on the one train step measured on a GPU, the packed
# XLA path's (33.715 s on one H200: results/gpu_h200.json before the fused default, 2 rows of the 1.5B paper shape)
# by benchmarks/gpu_model.py (results/gpu_model.json); every other figure `predict_seconds` gives is a prediction.
LAUNCH_SECONDS = 1.39e-6


def predict_seconds(costs, gpu: Gpu, launch_seconds: float = LAUNCH_SECONDS) -> float:
    """A program's predicted seconds per run on `gpu`: the sum over its kernels (`hlo_stats.kernel_costs`: times,
    matmul FLOPs, bytes) of times x (max(FLOPs / matmul ceiling, bytes / bandwidth) + launch_seconds). A per-kernel
    roofline with no overlap between kernels, every matmul at the bf16 ceiling, and a conditional's most expensive
    branch taken."""
    return sum(times * (max(flops / gpu.matmul_flops_s, nbytes / gpu.bandwidth_bytes_s) + launch_seconds)
               for times, flops, nbytes in costs)


# the GPUs of the chip table (`capacity.chips.CHIPS`)
GPUS = {name: chip for name, chip in CHIPS.items() if isinstance(chip, Gpu)}


def parse_gpu_topology(name: str):
    """`h100-8`, `h200-1`, `a100-8`: N GPUs of one host (N <= 8); `h100-8x2`: two such hosts. Returns the
    `topology.Topology`, its `topology_name` get_topology_desc's "1x<hosts>x<gpus per host>" (one slice); None when
    `name` is not a GPU name."""
    from jaxrl_llm.capacity.topology import Topology

    match = re.fullmatch(r"([a-z]\d+)-(\d+)(?:x(\d+))?", name.strip().lower())
    if not match or match.group(1) not in GPUS:
        if match and re.fullmatch(r"[ah]\d+", match.group(1)):
            raise ValueError(f"unknown GPU {match.group(1)!r} in topology {name!r}: known {', '.join(sorted(GPUS))}")
        return None
    gpu, per_host, hosts = GPUS[match.group(1)], int(match.group(2)), int(match.group(3) or 1)
    if not 1 <= per_host <= gpu.gpus_per_host:
        raise ValueError(f"topology {name!r}: a {gpu.generation} host has 1 to {gpu.gpus_per_host} GPUs, "
                         f"got {per_host}")
    if hosts < 1 or (hosts > 1 and per_host != gpu.gpus_per_host):
        raise ValueError(f"topology {name!r}: several hosts are counted as full hosts of {gpu.gpus_per_host} GPUs "
                         f"({gpu.generation}-{gpu.gpus_per_host}x{max(hosts, 2)})")
    return Topology(name, gpu, f"1x{hosts}x{per_host}", per_host * hosts, (1, 1, per_host), platform="cuda")


def cuda_plugin_installed() -> bool:
    """Whether the gpu-compile extra's jax-cuda12-plugin and jax-cuda12-pjrt are installed (looked up, not imported)."""
    try:
        return importlib.util.find_spec("jax_cuda12_plugin") is not None and \
            importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


def gpu_devices(topology) -> list:
    """The hosts' compile-only GPU devices (no GPU needed; the CUDA plugin must be installed)."""
    if not cuda_plugin_installed():
        raise CudaPluginMissing(INSTALL_HINT)
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(platform="cuda", target_config=topology.chip.target_config,
                                            topology=topology.topology_name)
    except NotImplementedError as err:  # installed, but not registered with jax: its CUDA check failed
        raise CudaPluginMissing(f"the CUDA plugin is installed but jax did not load it ({err}): on a host without a "
                                "GPU, set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 (or JAX_PLATFORMS=cpu) before jax starts, "
                                "and keep jax, jaxlib and jax-cuda12-plugin at one version") from err
    return list(desc.devices)
