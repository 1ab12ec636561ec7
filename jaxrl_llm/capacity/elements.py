"""Parameter elements one device holds under the model's partition rules (`models.sharding.partition_rules`): the
figures the memory estimate's parameter, optimizer, copy and output-matrix terms are made of."""

from __future__ import annotations

import math
import re

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.model import param_shapes
from jaxrl_llm.models.sharding import partition_rules


def leaf_paths(tree, prefix=()):
    """(path "a/b/c", leaf) of every leaf of a nested dict, depth first."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from leaf_paths(value, prefix + (key,))
        else:
            yield "/".join(prefix + (key,)), value


def local_elements(model_config: ModelConfig, mesh: dict[str, int], shapes=None) -> dict[str, int]:
    """{parameter path: elements one device holds} under the model's partition rules (of the model's
    parameters, or of the tree of `shapes` given, e.g. LoRA adapters)."""
    rules = [(re.compile(pattern), spec) for pattern, spec in partition_rules(model_config)]
    local = {}
    for name, shape in leaf_paths(param_shapes(model_config) if shapes is None else shapes):
        spec = next(s for pattern, s in rules if pattern.search(name))
        per_device = 1
        for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
            names = (axes,) if isinstance(axes, str) else tuple(axes or ())
            split = math.prod(mesh.get(n, 1) for n in names)  # an axis the mesh lacks (expert) has size 1
            per_device *= dim // split if names and dim % split == 0 else dim
        local[name] = per_device
    return local


_CODE_BYTES = {"int8": 1.0, "int4": 0.5}


def quantized_base_savings(model_config: ModelConfig, mesh: dict[str, int], p: int, kind: str) -> int:
    """Bytes per device saved by storing every projection ("*_proj") as `kind` codes plus float32 scales
    [L, 1, out] instead of `p`-byte values (scales counted unsharded: they are small)."""
    shapes = param_shapes(model_config)["layers"]
    saved = 0
    for name, elements in local_elements(model_config, mesh).items():
        if re.fullmatch(r"layers/\w+_proj", name):
            layers, _, out = shapes[name.split("/")[1]]
            saved += elements * (p - _CODE_BYTES[kind]) - layers * out * 4
    return int(saved)


def sharded_param_elements(model_config: ModelConfig, mesh: dict[str, int]) -> tuple[int, int]:
    """(total parameter count, elements held by one device) under the model's partition rules."""
    total = sum(math.prod(shape) for _, shape in leaf_paths(param_shapes(model_config)))
    return total, sum(local_elements(model_config, mesh).values())


def output_matrix_elements(mc: ModelConfig, mesh: dict[str, int]) -> int:
    """Elements of the output matrix one device holds (sharded as its parameter)."""
    return local_elements(mc, mesh)["embed" if mc.tie_word_embeddings else "lm_head"]


def output_matrix_copy_bytes(mc: ModelConfig, mesh: dict[str, int], c: int, p: int) -> int:
    """The output matrix cast to the compute dtype (a new array only when c != p), sharded as its parameter."""
    return 0 if c == p else output_matrix_elements(mc, mesh) * c


def subset_elements(mc: ModelConfig, subset: str) -> int:
    """Elements of the parameters named by `sampling.gvm_param_subset` ("embed", "layers.q_proj", ...), unsharded."""
    shapes = dict(leaf_paths(param_shapes(mc)))
    total = 0
    for name in filter(None, (n.strip().replace(".", "/") for n in subset.split(","))):
        if name not in shapes:
            raise ValueError(f"sampling.gvm_param_subset names {name!r}, not a parameter ({', '.join(shapes)})")
        total += math.prod(shapes[name])
    return total


def sampler_copy_bytes(mc: ModelConfig, mesh: dict[str, int], p: int, dtype: str) -> int:
    """Bytes per device of the sampler's copy of the policy in `sampling.dtype` ("" : none, it reads the
    trainer's tree): bf16 values, or int8 projection codes with f32 scales and the rest in p."""
    if not dtype:
        return 0
    local = sharded_param_elements(mc, mesh)[1]
    if dtype == "bfloat16":
        return local * 2
    return local * p - quantized_base_savings(mc, mesh, p, dtype)
