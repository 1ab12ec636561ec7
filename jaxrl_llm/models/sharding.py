"""Sharding rules beside the model: regex over parameter paths -> PartitionSpec over the mesh axes
("data", "fsdp", "expert", "tensor"), in the style of EasyLM's `get_partition_rules`.

Parameters are replicated over `data`, split over `fsdp` on their model dimension (ZeRO-3 style),
and split over `tensor` Megatron-style: column-parallel q/k/v/gate/up (output dim), row-parallel
o/down (input dim), vocabulary-parallel embedding and output head. A mixture of experts' expert
weights [L, E, ...] are also split over `expert` on E (expert parallelism, `models.moe`); every other
parameter is replicated over `expert`, and outside the sparse blocks `expert` is one more data-parallel
axis: a batch's rows are split over data x fsdp x expert (`BATCH_AXES`), as MaxText does. With
expert = 1 (every mesh string without it) the meshes and shardings are those of the dense layout.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_llm.models.config import ModelConfig

try:  # JAX >= 0.5 types mesh axes; sharding here is propagated by the compiler ("Auto")
    from jax.sharding import AxisType

    _AUTO_AXES = {"axis_types": (AxisType.Auto,) * 4}
except ImportError:
    _AUTO_AXES = {}

# "expert" sits between fsdp and tensor: its all-to-all wants the nearer devices, after tensor's all-reduces.
MESH_AXES = ("data", "fsdp", "expert", "tensor")
# The data-parallel axes: a batch's rows (and the tokens entering a sparse block) are split over their product.
BATCH_AXES = ("data", "fsdp", "expert")
# Batch dimension of activations: split over every data-parallel axis.
BATCH_SPEC = P(BATCH_AXES)
# KVCache k / v [layers, batch, slots, kv_heads, head_dim]: rows like the batch, heads like attention.
KV_CACHE_SPEC = P(None, BATCH_AXES, None, "tensor", None)


def axis_size(mesh, name: str) -> int:
    """Size of mesh axis `name` of `mesh` (a Mesh, an AbstractMesh or a dict of sizes); 1 where the mesh lacks
    it (a mesh made before the `expert` axis, a sampler's own mesh) or there is no mesh (None)."""
    if mesh is None:
        return 1
    shape = dict(mesh.shape) if hasattr(mesh, "shape") else dict(mesh)
    return int(shape.get(name, 1))


def batch_devices(mesh) -> int:
    """Devices a batch's rows are split over: data x fsdp x expert of `mesh` (see `axis_size`)."""
    return math.prod(axis_size(mesh, name) for name in BATCH_AXES)


def make_mesh(spec: str = "", devices=None) -> Mesh:
    """Mesh with axes ("data", "fsdp", "expert", "tensor") from a string such as "data=2,fsdp=2,tensor=2"
    or "data=2,expert=2,fsdp=2".

    Axes left out have size 1; one axis may be -1 to take the remaining devices; an empty string
    puts every device on "fsdp". The product must equal the number of devices (default: all).
    Axes are of the "Auto" type: jit propagates the parameter shardings through the model.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = {name: 1 for name in MESH_AXES}
    if spec.strip():
        for part in spec.split(","):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in sizes:
                raise ValueError(f"mesh spec {spec!r}: expected comma-separated axis=size with axes {MESH_AXES}")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise ValueError(f"mesh spec {spec!r}: size of {name!r} must be an integer") from None
    else:
        sizes["fsdp"] = -1
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"mesh spec {spec!r}: at most one axis may be -1")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        sizes[free[0]] = len(devices) // fixed if fixed and len(devices) % fixed == 0 else 0
    if any(size < 1 for size in sizes.values()) or math.prod(sizes.values()) != len(devices):
        raise ValueError(f"mesh spec {spec!r} gives sizes {sizes}, which do not multiply to the "
                         f"{len(devices)} available devices")
    shape = tuple(sizes[name] for name in MESH_AXES)
    if len(devices) == jax.device_count():
        return jax.make_mesh(shape, MESH_AXES, devices=devices, **_AUTO_AXES)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, **_AUTO_AXES)


def partition_rules(config: ModelConfig | None = None) -> list[tuple[str, P]]:
    """(regex, PartitionSpec) pairs matched with re.search against "/"-joined parameter paths
    ("embed", "layers/q_proj", ...); the first match wins. Layer tensors carry a leading layer axis
    that is never split. The rules are the same for every supported family (`config` is accepted
    so that family-specific rules can be added without changing callers)."""
    del config
    return [
        (r"^embed$", P("tensor", "fsdp")),                              # [V, D]
        (r"^lm_head$", P("fsdp", "tensor")),                            # [D, V]
        (r"^layers/(q|k|v|gate|up)_proj$", P(None, "fsdp", "tensor")),  # [L, D, out]
        (r"^layers/(o|down)_proj$", P(None, "tensor", "fsdp")),         # [L, in, D]
        (r"^layers/(q|k|v)_bias$", P(None, "tensor")),                  # [L, out]
        (r"^layers/attn_sinks$", P(None, "tensor")),                    # [L, H]: with the heads
        # experts (models/moe.py): E over "expert" (expert parallelism), the rest as the dense MLP's matrices;
        # the router replicated over "expert", its input dimension split as a projection's
        (r"^layers/expert_(gate|up)$", P(None, "expert", "fsdp", "tensor")),  # [L, E, D, F]
        (r"^layers/expert_down$", P(None, "expert", "tensor", "fsdp")),       # [L, E, F, D]
        (r"^layers/expert_(gate|up)_bias$", P(None, "expert", "tensor")),     # [L, E, F]
        (r"^layers/expert_down_bias$", P(None, "expert")),                    # [L, E, D]
        (r"^layers/router$", P(None, "fsdp", None)),                          # [L, D, E]
        # LoRA adapters (models/lora.py): A [L, in, r] and B [L, r, out] split like their weight's in / out
        # dimension, the rank replicated, so x A and (x A) B need no more communication than x W.
        (r"^layers/(q|k|v|gate|up)_proj_lora_a$", P(None, "fsdp", None)),
        (r"^layers/(q|k|v|gate|up)_proj_lora_b$", P(None, None, "tensor")),
        (r"^layers/(o|down)_proj_lora_a$", P(None, "tensor", None)),
        (r"^layers/(o|down)_proj_lora_b$", P(None, None, "fsdp")),
        # experts' adapters A [L, E, in, r], B [L, E, r, out]: E and in / out split as their expert matrix's
        (r"^layers/expert_(gate|up)_lora_a$", P(None, "expert", "fsdp", None)),
        (r"^layers/expert_(gate|up)_lora_b$", P(None, "expert", None, "tensor")),
        (r"^layers/expert_down_lora_a$", P(None, "expert", "tensor", None)),
        (r"^layers/expert_down_lora_b$", P(None, "expert", None, "fsdp")),
        # a quantized base's per-output-channel scales [L, 1, out] (models/quant.py), split as their codes' outputs
        (r"^layers/(q|k|v|gate|up)_proj_scale$", P(None, None, "tensor")),
        (r"^layers/(o|down)_proj_scale$", P(None, None, "fsdp")),
        (r"^layers/expert_(gate|up)_scale$", P(None, "expert", None, "tensor")),  # [L, E, 1, F]
        (r"^layers/expert_down_scale$", P(None, "expert", None, "fsdp")),         # [L, E, 1, D]
        (r"(norm|o_bias|router_bias)$", P()),                           # small vectors: replicate
    ]


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def param_partition_specs(params, rules: list[tuple[str, P]] | None = None):
    """A tree like `params` holding the PartitionSpec of the first rule whose regex matches each
    leaf's path. Raises ValueError naming a parameter no rule matches."""
    rules = partition_rules() if rules is None else rules
    compiled = [(re.compile(pattern), spec) for pattern, spec in rules]

    def spec_for(path, _leaf):
        name = _path_name(path)
        for pattern, spec in compiled:
            if pattern.search(name):
                return spec
        raise ValueError(f"no partition rule matches parameter {name!r}")

    return jax.tree_util.tree_map_with_path(spec_for, params)


def _fit_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """Drop mesh axes from dimensions they do not divide evenly (those dimensions replicate)."""
    fitted = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        size = math.prod(mesh.shape[n] for n in names)
        fitted.append(axes if names and dim % size == 0 else None)
    return P(*fitted)


def param_shardings(params, mesh: Mesh, rules: list[tuple[str, P]] | None = None):
    """NamedShardings for `params` on `mesh` (usable as jit in/out shardings)."""
    specs, _ = jax.tree_util.tree_flatten(param_partition_specs(params, rules),
                                          is_leaf=lambda x: isinstance(x, P))
    leaves, treedef = jax.tree_util.tree_flatten(params)
    shardings = [NamedSharding(mesh, _fit_spec(spec, np.shape(leaf), mesh)) for leaf, spec in zip(leaves, specs)]
    return jax.tree_util.tree_unflatten(treedef, shardings)


def shard_params(params, mesh: Mesh, rules: list[tuple[str, P]] | None = None):
    """Place `params` on `mesh` following `rules` (default `partition_rules()`). A dimension that a
    rule's mesh axes do not divide evenly is replicated instead."""
    return jax.device_put(params, param_shardings(params, mesh, rules))


def cache_shardings(cache, mesh: Mesh):
    """NamedShardings for a KVCache (`KV_CACHE_SPEC`, replicating dimensions it does not divide)."""
    return type(cache)(*(NamedSharding(mesh, _fit_spec(KV_CACHE_SPEC, np.shape(c), mesh)) for c in cache))
