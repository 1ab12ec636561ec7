"""Low-rank adapters (LoRA, Hu et al. 2021) on the decoder's projections.

A projection W [in, out] with an adapter computes y = x W + s (x A) B with A [in, r], B [r, out] and
s = alpha / r; A starts random and B at zero, so a new adapter leaves the model unchanged.

Adapters are a small pytree beside the frozen base, stacked over layers like it:
{"layers": {"q_proj_lora_a": [L, in, r], "q_proj_lora_b": [L, r, out], ...}}. `attach` puts them into
the base's layer dicts (with s folded into B), where every pass of the model finds them: the training
forward, the log-prob pass, the KV-cache and sampler paths, under scan or unrolled, with or without remat.
`merge` folds them into the weights instead: W' = W + s A B (one matmul per projection, for sampling).

A mixture of experts' expert matrices (`models.moe`: expert_gate / expert_up [E, D, F], expert_down [E, F, D])
take adapters per expert, A [L, E, in, r] and B [L, E, r, out] (targets "experts"). A sparse block adds them to
its experts' weights in the forward pass, W_e + s A_e B_e (`models.moe.layer_experts`): exact, one [E, in, out]
product per matrix and layer, whose gradient is that layer's [E, in, out] while the backward pass runs it.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.model import Params, param_shapes
from jaxrl_llm.models.quant import EXPERT_MATRICES, dequantize_base

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_PROJECTIONS = EXPERT_MATRICES  # a sparse layer's experts (adapters per expert)
TARGETS = PROJECTIONS + EXPERT_PROJECTIONS
_GROUPS = {"all": PROJECTIONS, "attention": PROJECTIONS[:4], "mlp": PROJECTIONS[4:], "experts": EXPERT_PROJECTIONS}


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What adapters a model carries: rank r, alpha (scale s = alpha / r) and the projections adapted."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = PROJECTIONS

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive int, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha!r}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets must be a non-empty subset of {TARGETS}, got {self.targets!r}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def resolve_targets(spec: str) -> tuple[str, ...]:
    """Projection names from a comma-separated spec, in model order. Each entry is a projection name
    ("q_proj" or "q", "expert_gate"), a group ("all" = the dense projections q/k/v/o/gate/up/down, "attention" =
    q/k/v/o, "mlp" = gate/up/down, "experts" = a mixture's expert_gate/up/down) or a regex matched in full against
    the names ("(q|v)_proj"). Raises ValueError naming an entry that matches nothing."""
    chosen = set()
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        if entry in _GROUPS:
            chosen.update(_GROUPS[entry])
        elif entry in TARGETS or f"{entry}_proj" in PROJECTIONS:
            chosen.add(entry if entry in TARGETS else f"{entry}_proj")
        else:
            try:
                matched = {p for p in TARGETS if re.fullmatch(entry, p)}
            except re.error as err:
                raise ValueError(f"LoRA target {entry!r} is neither a projection name nor a valid regex ({err})") \
                    from None
            if not matched:
                raise ValueError(f"LoRA target {entry!r} matches none of {TARGETS} "
                                 f"(or use a group: {', '.join(_GROUPS)})")
            chosen.update(matched)
    if not chosen:
        raise ValueError(f"LoRA targets {spec!r} name no projection")
    return tuple(p for p in TARGETS if p in chosen)


def adapter_shapes(config: ModelConfig, spec: LoraSpec) -> Params:
    """{"layers": {"{p}_lora_a": (L, in, r), "{p}_lora_b": (L, r, out)}} for each target projection p; an expert
    matrix's adapters carry its expert axis: (L, E, in, r) and (L, E, r, out)."""
    layers = param_shapes(config)["layers"]
    missing = [name for name in spec.targets if name not in layers]
    if missing:
        hint = ("every layer's MLP is a mixture of experts: target the attention and the experts "
                "(lora.targets: attention,experts)" if "expert_gate" in layers else
                "a dense model has no experts: target its projections (lora.targets: all)")
        raise ValueError(f"LoRA targets {', '.join(missing)}: this {config.model_type} model has no such projection "
                         f"({hint})")
    shapes = {}
    for name in spec.targets:
        *lead, d_in, d_out = layers[name]
        shapes[f"{name}_lora_a"] = (*lead, d_in, spec.rank)
        shapes[f"{name}_lora_b"] = (*lead, spec.rank, d_out)
    return {"layers": shapes}


def init_adapters(config: ModelConfig, spec: LoraSpec, rng: jax.Array) -> Params:
    """New float32 adapters: A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's default, kaiming-uniform with a = sqrt(5)),
    B = 0, so base + adapters computes exactly the base."""
    shapes = adapter_shapes(config, spec)["layers"]
    keys = jax.random.split(rng, len(spec.targets))
    layers = {}
    for key, name in zip(keys, spec.targets):
        a_shape = shapes[f"{name}_lora_a"]
        bound = a_shape[-2] ** -0.5  # 1 / sqrt(in)
        layers[f"{name}_lora_a"] = jax.random.uniform(key, a_shape, jnp.float32, -bound, bound)
        layers[f"{name}_lora_b"] = jnp.zeros(shapes[f"{name}_lora_b"], jnp.float32)
    return {"layers": layers}


def attach(base: Params, adapters: Params, scale: float) -> Params:
    """The base tree with the adapters in its layer dicts, B scaled by s: the model then computes
    x W + (x A)(s B) for every adapted projection. Differentiable in `adapters` (base and adapters are
    not copied: only the small s B is a new array)."""
    layers = dict(base["layers"])
    for key, value in adapters["layers"].items():
        layers[key] = value * jnp.asarray(scale, value.dtype) if key.endswith("_lora_b") else value
    return {**base, "layers": layers}


def merge(base: Params, adapters: Params, scale: float) -> Params:
    """The base tree with every adapted weight replaced by W + s A B (f32 product, stored in W's dtype;
    a quantized W, see `models.quant`, is dequantized and every quantized projection comes out float32).
    Pure: jit it with `scale` static (and the base's shardings out, on a mesh)."""
    base = dequantize_base(base)
    layers = dict(base["layers"])
    for key in adapters["layers"]:
        if not key.endswith("_lora_a"):
            continue
        name = key[:-len("_lora_a")]
        a = adapters["layers"][key].astype(jnp.float32)
        b = adapters["layers"][f"{name}_lora_b"].astype(jnp.float32)
        delta = scale * jnp.einsum("...ir,...ro->...io", a, b, precision=jax.lax.Precision.HIGHEST)
        layers[name] = (base["layers"][name].astype(jnp.float32) + delta).astype(base["layers"][name].dtype)
    return {**base, "layers": layers}


def spec_of(adapters: Params, alpha: float) -> LoraSpec:
    """The LoraSpec an adapter tree was built with (rank and targets from its keys and shapes)."""
    targets = tuple(p for p in TARGETS if f"{p}_lora_a" in adapters["layers"])
    rank = int(adapters["layers"][f"{targets[0]}_lora_a"].shape[-1]) if targets else 0
    return LoraSpec(rank=rank, alpha=alpha, targets=targets)
