"""The accelerators the capacity planners know, in one table: `CHIPS` holds each chip's facts (HBM, what the compiler
lets one program use, how a slice counts and lays out its chips; for a GPU its compile target and roofline ceilings),
and `TARGETS` the slices the memory table names (devices x one chip). The memory estimate's tables
(`scripts/memory_estimate.py`), the compiler (`capacity.aot`, `capacity.gpu_targets`) and the launch tables read them.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU generation: its HBM, what the compiler lets one program use, how its slices are named and laid out."""

    generation: str  # get_topology_desc's name prefix
    hbm_bytes: int
    cores_per_chip: int  # TensorCores counted in a slice's name (v4 and v5p count both cores of a megacore chip)
    chip_config: str
    host_bounds: tuple[int, int, int]  # chips per host
    usable_bytes: int  # what the compiler lets one program's buffers peak at (its out-of-HBM check)
    platform: str = "tpu"  # the attention path's platform (`models.attention.resolve`)


def _gib(value: float) -> int:
    return int(value * GIB)


# What the compiler lets one program use on each chip, by libtpu release: the "available HBM" of its refusal of a
# program over it, to its two decimals (the check counts the program's peak, arguments included;
# tests/test_attention_dispatch.py measures the installed release's again). 0.0.50.1 holds a v5p program to 16 MiB
# less than 0.0.42.1 and a v6e program to 4 MiB less. A release holds the figures of the newest one listed at or
# before it; without libtpu, the first listed (constraints.txt's, with which benchmarks/results/compile was made).
USABLE_GIB_BY_LIBTPU = {
    "0.0.42.1": {"v4": 30.75, "v5e": 15.75, "v5p": 95.74, "v6e": 31.25},
    "0.0.50.1": {"v4": 30.75, "v5e": 15.75, "v5p": 95.73, "v6e": 31.24},
}


def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0]))


def libtpu_release(installed: str | None = None) -> str:
    """The USABLE_GIB_BY_LIBTPU release whose figures hold for libtpu `installed` (default: the installed libtpu's
    version, read from its metadata without importing it)."""
    if installed is None:
        try:
            installed = importlib.metadata.version("libtpu")
        except importlib.metadata.PackageNotFoundError:
            return next(iter(USABLE_GIB_BY_LIBTPU))
    at_or_before = [r for r in USABLE_GIB_BY_LIBTPU if _release_key(r) <= _release_key(installed)]
    return max(at_or_before, key=_release_key) if at_or_before else next(iter(USABLE_GIB_BY_LIBTPU))


_USABLE_GIB = USABLE_GIB_BY_LIBTPU[libtpu_release()]

# HBM per chip from Google Cloud's TPU pages: v4 32 GiB, v5e 16 GiB, v6e (Trillium) 32 GiB; v5p "95GB" there, but
# its compiler lets a program use 95.74 GiB, so 96 GiB here. Usable: USABLE_GIB_BY_LIBTPU's for the installed libtpu.
CHIPS = {
    "v4": Chip("v4", 32 * GIB, 2, "megacore", (2, 2, 1), _gib(_USABLE_GIB["v4"])),
    "v5litepod": Chip("v5e", 16 * GIB, 1, "default", (2, 2, 1), _gib(_USABLE_GIB["v5e"])),
    "v5e": Chip("v5e", 16 * GIB, 1, "default", (2, 2, 1), _gib(_USABLE_GIB["v5e"])),
    "v5p": Chip("v5p", 96 * GIB, 2, "megacore", (2, 2, 1), _gib(_USABLE_GIB["v5p"])),
    "v6e": Chip("v6e", 32 * GIB, 1, "default", (2, 2, 1), _gib(_USABLE_GIB["v6e"])),
}


# XLA's GPU compiler rematerializes a program toward 0.95 x (0.8 x device memory - its arguments) and never refuses
# one over it (it logs "Can't reduce memory use below ..."; measured with jaxlib 0.10.2 at three memory sizes). A
# program with no arguments may thus use 0.76 of the card's memory; jax's runtime takes 0.75 by default
# (XLA_PYTHON_CLIENT_MEM_FRACTION), about the same.
COMPILER_MEMORY_FRACTION = 0.8 * 0.95


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
    platform: str = "gpu"  # the attention path's platform (`models.attention.resolve`)


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
CHIPS.update({
    "h100": _gpu("h100", "NVIDIA H100 80GB HBM3", 84929347584, bandwidth=3.35e12, **_HOPPER),
    "h200": _gpu("h200", "NVIDIA H200", 150754820096, bandwidth=4.8e12, **_HOPPER),
    "a100": _gpu("a100", "NVIDIA A100-SXM4-80GB", 80 * GIB, sms=108, fpus=64, major=8, l2_bytes=40 * 2 ** 20,
                 clock_ghz=1.41, bandwidth=2.0e12, shared_per_core=167936, shared_optin=166912),
})


@dataclasses.dataclass(frozen=True)
class Target:
    """A slice the memory table names: `devices` devices of one chip of `CHIPS`."""

    name: str
    devices: int
    chip: Chip | Gpu
    note: str
    memory_bytes: int = 0  # the HBM per device the memory table counts, where it is not the chip's `hbm_bytes`

    @property
    def hbm_bytes(self) -> int:
        return self.memory_bytes or self.chip.hbm_bytes

    @property
    def platform(self) -> str:
        """Picks the attention path of the estimate (`models.attention.resolve`): "tpu" or "gpu"."""
        return self.chip.platform


# A v4 chip (two TensorCores as one megacore device) has 32 GiB HBM; v4-32 = 32 TensorCores = 16 chips.
# A v5e chip has 16 GiB HBM; v5litepod-64 = 64 chips. An H100 SXM has 80 GB: the memory table counts 81,559 MiB
# (nvidia-smi's total), 0.55 GiB more than the 84,929,347,584 bytes CUDA reports to XLA (the chip's hbm_bytes, what
# `jaxrl-llm compile` holds a program to); docs/launch.md's memory tables were made with it.
H100_TABLE_BYTES = 81559 * 1024 ** 2
TARGETS = {
    "v4-32": Target("v4-32", 16, CHIPS["v4"], "16 chips x 32 GiB HBM, 4 hosts"),
    "v5e-64": Target("v5e-64", 64, CHIPS["v5e"], "64 chips x 16 GiB HBM, 16 hosts"),
    "8xH100": Target("8xH100", 8, CHIPS["h100"], "8 GPUs x 80 GB HBM3, 1 node", H100_TABLE_BYTES),
    "1x16GB": Target("1x16GB", 1, CHIPS["v5e"], "one 16 GiB accelerator: a TPU v5e chip (a T4 has 15 GiB)"),
    "1xH100": Target("1xH100", 1, CHIPS["h100"], "one GPU x 80 GB HBM3", H100_TABLE_BYTES),
    # the mixture-of-experts presets' slices: v5p-N and v6e-N as Google Cloud names them (v5p: N TensorCores, two per
    # 96 GiB chip; v6e: N chips of 32 GiB)
    "v5p-16": Target("v5p-16", 8, CHIPS["v5p"], "8 chips x 96 GiB HBM, 2 hosts"),
    "v5p-32": Target("v5p-32", 16, CHIPS["v5p"], "16 chips x 96 GiB HBM, 4 hosts"),
    "v5p-64": Target("v5p-64", 32, CHIPS["v5p"], "32 chips x 96 GiB HBM, 8 hosts"),
    "v6e-32": Target("v6e-32", 32, CHIPS["v6e"], "32 chips x 32 GiB HBM, 8 hosts"),
    "v6e-64": Target("v6e-64", 64, CHIPS["v6e"], "64 chips x 32 GiB HBM, 16 hosts"),
}
