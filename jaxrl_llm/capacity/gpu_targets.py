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

import dataclasses
import importlib.util
import re

from jaxrl_llm.capacity.memory import GIB

INSTALL_HINT = ("compiling for an NVIDIA GPU needs the CUDA plugin: pip install 'jaxrl_llm[gpu-compile]' (or bash "
                "scripts/setup.sh gpu-compile), which installs jax-cuda12-plugin, jax-cuda12-pjrt, nvidia-cudnn-cu12, "
                "nvidia-cuda-nvcc-cu12 and nvidia-cuda-runtime-cu12 at the versions this project tested")

# XLA's GPU compiler rematerializes a program toward 0.95 x (0.8 x device memory - its arguments) and never refuses
# one over it (it logs "Can't reduce memory use below ..."; measured with jaxlib 0.10.2 at three memory sizes). A
# program with no arguments may thus use 0.76 of the card's memory; jax's runtime takes 0.75 by default
# (XLA_PYTHON_CLIENT_MEM_FRACTION), about the same.
COMPILER_MEMORY_FRACTION = 0.8 * 0.95


class CudaPluginMissing(RuntimeError):
    """Compiling for a GPU needs jax-cuda12-plugin and jax-cuda12-pjrt at jax's version (the gpu-compile extra)."""


@dataclasses.dataclass(frozen=True)
class Gpu:
    generation: str  # as users name it: h100, h200, a100
    device_kind: str  # what jax's device reports
    hbm_bytes: int  # the card's memory as CUDA reports it (the proto's device_memory_size)
    target_config: str  # GpuTargetConfig text proto
    usable_bytes: int  # what the compiler lets a program use: COMPILER_MEMORY_FRACTION of hbm_bytes
    gpus_per_host: int = 8
    matmul_flops_s: float = 0.0  # the bf16 matmul ceiling `predict_seconds` uses (see CEILINGS)
    bandwidth_bytes_s: float = 0.0  # the memory ceiling it uses


def _target(*, sms: int, fpus: int, major: int, l2_bytes: int, clock_ghz: float, bandwidth: float, memory: int,
            shared_per_core: int, shared_optin: int, name: str) -> str:
    """A GpuTargetConfig text proto (the fields XLA's GPU compiler reads for code generation and its cost model)."""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 threads_per_core_limit: 2048
  shared_memory_per_block: 49152 shared_memory_per_block_optin: {shared_optin} shared_memory_per_core: {shared_per_core}
  core_count: {sms} fpus_per_core: {fpus} registers_per_core_limit: 65536 registers_per_block_limit: 65536
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  l2_cache_size: {l2_bytes} clock_rate_ghz: {clock_ghz} memory_bandwidth: {int(bandwidth)} device_memory_size: {memory}
  cuda_compute_capability {{ major: {major} }}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
device_description_str: "{name}"
"""


# The ceilings of the per-kernel roofline (`predict_seconds`), bf16 matmul FLOP/s and memory bytes/s. H200: measured
# on one (benchmarks/gpu.py's ceilings, results/gpu_h200.json: 8192^3 bf16 products, a 1 GiB elementwise pass).
# H100 SXM: the same die and clocks (the H200's matmul figure), its bandwidth scaled by the datasheets' 3.35 / 4.8.
# A100: both scaled by the datasheets (312 / 989 dense bf16 TFLOP/s, 2.0 / 4.8 TB/s): not measured.
CEILINGS = {"h200": (508e12, 2.79e12), "h100": (508e12, 2.79e12 * 3.35 / 4.8),
            "a100": (508e12 * 312 / 989, 2.79e12 * 2.0 / 4.8)}
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


def _gpu(generation: str, name: str, memory: int, **card) -> Gpu:
    return Gpu(generation, name, memory, _target(memory=memory, name=name, **card),
               int(COMPILER_MEMORY_FRACTION * memory), matmul_flops_s=CEILINGS[generation][0],
               bandwidth_bytes_s=CEILINGS[generation][1])


# Hopper (sm_90): 132 SMs of 128 FP32 lanes at 1.98 GHz boost, 50 MiB L2, 228 KiB shared memory per SM (227 KiB
# opt-in per block). H100 SXM 80 GB: 3.35 TB/s, 84,929,347,584 bytes as CUDA reports the card (jax#28376's target).
# H200 141 GB HBM3e: 4.8 TB/s, 150,754,820,096 bytes as CUDA reports it. Ampere A100 SXM 80 GB (sm_80): 108 SMs of
# 64 FP32 lanes at 1.41 GHz, 40 MiB L2, 2.0 TB/s, 164 KiB shared per SM (163 KiB opt-in), 80 GiB.
_HOPPER = dict(sms=132, fpus=128, major=9, l2_bytes=50 * 2 ** 20, clock_ghz=1.98, shared_per_core=233472,
               shared_optin=232448)
GPUS = {
    "h100": _gpu("h100", "NVIDIA H100 80GB HBM3", 84929347584, bandwidth=3.35e12, **_HOPPER),
    "h200": _gpu("h200", "NVIDIA H200", 150754820096, bandwidth=4.8e12, **_HOPPER),
    "a100": _gpu("a100", "NVIDIA A100-SXM4-80GB", 80 * GIB, sms=108, fpus=64, major=8, l2_bytes=40 * 2 ** 20,
                 clock_ghz=1.41, bandwidth=2.0e12, shared_per_core=167936, shared_optin=166912),
}


def parse_gpu_topology(name: str):
    """`h100-8`, `h200-1`, `a100-8`: N GPUs of one host (N <= 8); `h100-8x2`: two such hosts. Returns the
    `aot.Topology`, its `topology_name` get_topology_desc's "1x<hosts>x<gpus per host>" (one slice); None when
    `name` is not a GPU name."""
    from jaxrl_llm.capacity.aot import Topology

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
