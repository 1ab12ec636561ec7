"""Compile targets: a TPU slice or GPU hosts as users name them (`v5litepod-64`, `v4-32`, `h200-8`), and their devices
for compiling without the hardware (`jax.experimental.topologies`; libtpu or the CUDA plugin installed)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re

from jaxrl_llm.capacity.chips import CHIPS, Chip
from jaxrl_llm.capacity.gpu_targets import Gpu, gpu_devices, parse_gpu_topology


class LibtpuMissing(RuntimeError):
    """Compiling for a TPU needs libtpu, an optional dependency."""


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str  # as the user wrote it
    chip: Chip | Gpu
    topology_name: str  # get_topology_desc's form, e.g. "v5e:4x4" (GPU: "1x<hosts>x<gpus per host>")
    chips: int
    host_bounds: tuple[int, int, int]
    platform: str = "tpu"  # or "cuda"


def _grid(chips: int, dims: int) -> tuple[int, ...]:
    """The chip grid of a slice of `chips` chips as Google Cloud shapes them: 2-D (v5e, v6e: 2x2, 2x4, 4x4, 4x8,
    8x8, ...) or 3-D (v4, v5p: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...)."""
    if chips < 1 or chips & (chips - 1):
        raise ValueError(f"a TPU slice has a power-of-two number of chips, got {chips}")
    sides = [1] * dims
    first, then = ([0, 1], [1, 0]) if dims == 2 else ([0, 1, 2], [2, 1, 0])  # then the last side first, cyclically
    for i in range(int(math.log2(chips))):
        sides[first[i] if i < dims else then[(i - dims) % dims]] *= 2
    return tuple(sides)


def parse_topology(name: str) -> Topology:
    """A slice as users name it: `v4-8`, `v4-32`, `v5litepod-8`, `v5litepod-64`, `v5p-8`, `v6e-8`, ... (the
    number counts TensorCores: two per v4 / v5p chip, one per v5e / v6e chip), or get_topology_desc's
    `v5e:4x4` / `v4:2x2x2` form; or GPU hosts, `h200-8`, `h100-8x2` (`gpu_targets.parse_gpu_topology`)."""
    gpu = parse_gpu_topology(name)
    if gpu is not None:
        return gpu
    match = re.fullmatch(r"(v4|v5litepod|v5e|v5p|v6e)-(\d+)", name.strip())
    if match:
        chip = CHIPS[match.group(1)]
        cores = int(match.group(2))
        if cores % chip.cores_per_chip:
            raise ValueError(f"topology {name!r}: {chip.generation} slices count {chip.cores_per_chip} cores per chip")
        chips = cores // chip.cores_per_chip
        dims = 3 if chip.generation in ("v4", "v5p") else 2
        grid = _grid(chips, dims)
    else:
        match = re.fullmatch(r"(v4|v5e|v5p|v6e):(\d+(?:x\d+)+)", name.strip())
        if not match:
            raise ValueError(f"unknown TPU topology {name!r}: expected e.g. v4-32, v5litepod-64, v5p-8, v6e-8 "
                             "or v5e:4x4, or GPU hosts: h100-8, h200-1, a100-8, h100-8x2")
        chip = CHIPS[match.group(1)]
        grid = tuple(int(x) for x in match.group(2).split("x"))
        chips = math.prod(grid)
    per_host = tuple(min(g, b) for g, b in zip(grid + (1,) * (3 - len(grid)), chip.host_bounds))
    if chip.generation in ("v5e", "v6e") and chips == 8:  # one host of 8 chips (v5litepod-8, v6e-8)
        per_host = (2, 4, 1)
    topology_name = f"{chip.generation}:{'x'.join(str(g) for g in grid)}"
    return Topology(name, chip, topology_name, chips, per_host)


def topology_devices(topology: Topology) -> list:
    """The slice's devices (no TPU needed; libtpu must be installed), or the GPU hosts' (the CUDA plugin)."""
    if topology.platform == "cuda":
        return gpu_devices(topology)
    if importlib.util.find_spec("libtpu") is None:  # an optional extra: looked up, never imported here
        raise LibtpuMissing("compiling for a TPU needs libtpu: pip install 'jaxrl_llm[tpu]' (or bash scripts/setup.sh "
                           "tpu), which installs jax[tpu] at this JAX version")
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(platform="tpu", topology_name=topology.topology_name,
                                        chip_config_name=topology.chip.chip_config,
                                        chips_per_host_bounds=topology.host_bounds, num_slices=1,
                                        wrap=(False, False, False))
    return list(desc.devices)
