"""LoRA adapters in and out in PEFT's format: adapter_config.json + adapter_model.safetensors.

PEFT stores, per adapted projection of layer i, "base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight"
[r, in] and "...lora_B.weight" [out, r] (torch's [out, in] layout) and scales by lora_alpha / r, so
`peft.PeftModel.from_pretrained(hf_model, path)` computes what `lora.attach` does here. Only numpy and
`safetensors` are used.
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.hf_io import _LAYER_NAMES
from jaxrl_llm.models.lora import EXPERT_PROJECTIONS, PROJECTIONS, LoraSpec, adapter_shapes
from jaxrl_llm.models.model import Params

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model.model.layers"


def _module(name: str) -> str:
    """"q_proj" -> "self_attn.q_proj" (the HF module path inside a layer)."""
    return _LAYER_NAMES[name][0].removesuffix(".weight")


def adapters_to_peft(adapters: Params) -> dict[str, np.ndarray]:
    """PEFT-named float32 tensors [r, in] (lora_A) and [out, r] (lora_B) of every layer."""
    out = {}
    for key, stacked in adapters["layers"].items():
        name, part = key.rsplit("_lora_", 1)
        array = np.asarray(stacked, np.float32)
        for i in range(array.shape[0]):
            out[f"{_PREFIX}.{i}.{_module(name)}.lora_{part.upper()}.weight"] = np.ascontiguousarray(array[i].T)
    return out


def save_peft(path, spec: LoraSpec, adapters: Params, *, base_model: str = "") -> pathlib.Path:
    """Write `adapters` (of `spec`) as a PEFT LoRA adapter folder; `base_model` is recorded as
    base_model_name_or_path. Returns the directory."""
    experts = [name for name in spec.targets if name in EXPERT_PROJECTIONS]
    if experts:
        raise ValueError(f"adapters on a mixture's experts ({', '.join(experts)}) have no PEFT module layout here: "
                         "export the merged model (models.save_hf of lora.merge) instead")
    directory = pathlib.Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": spec.rank, "lora_alpha": spec.alpha, "target_modules": list(spec.targets), "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": None, "inference_mode": True,
    }
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file(adapters_to_peft(adapters), str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return directory


def read_peft_spec(path) -> LoraSpec:
    """The LoraSpec of a PEFT adapter folder (r, lora_alpha, target_modules); errors name the file and key."""
    config_path = pathlib.Path(path) / ADAPTER_CONFIG
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: missing; a PEFT adapter folder needs {ADAPTER_CONFIG}")
    raw = json.loads(config_path.read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{config_path}: peft_type {raw.get('peft_type')!r} is not LORA")
    for key, unsupported in (("use_rslora", True), ("use_dora", True), ("fan_in_fan_out", True)):
        if raw.get(key) == unsupported:
            raise ValueError(f"{config_path}: {key}={unsupported} is not supported")
    targets = raw.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    names = tuple(p for p in PROJECTIONS if any(t == p or t.endswith("." + p) for t in targets))
    unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in PROJECTIONS]
    if unknown or not names:
        raise ValueError(f"{config_path}: target_modules {targets!r} must name projections among {PROJECTIONS}")
    return LoraSpec(rank=int(raw["r"]), alpha=float(raw.get("lora_alpha", raw["r"])), targets=names)


def load_peft(path, config: ModelConfig) -> tuple[LoraSpec, Params]:
    """(LoraSpec, float32 adapters) from a PEFT adapter folder written for a model of `config`.
    Raises ValueError naming a missing or mis-shaped tensor."""
    directory = pathlib.Path(path)
    spec = read_peft_spec(directory)
    tensors = load_file(str(directory / ADAPTER_WEIGHTS))
    # PEFT may save keys with the adapter name ("lora_A.default.weight"); both spellings are read.
    tensors = {k.replace(".default.weight", ".weight"): v for k, v in tensors.items()}
    layers = {}
    for key, shape in adapter_shapes(config, spec)["layers"].items():
        name, part = key.rsplit("_lora_", 1)
        parts = []
        for i in range(config.num_layers):
            hf_name = f"{_PREFIX}.{i}.{_module(name)}.lora_{part.upper()}.weight"
            if hf_name not in tensors:
                raise ValueError(f"{directory / ADAPTER_WEIGHTS}: missing tensor {hf_name!r}")
            array = np.asarray(tensors[hf_name], np.float32).T
            if array.shape != shape[1:]:
                raise ValueError(f"{directory / ADAPTER_WEIGHTS}: tensor {hf_name!r} has shape "
                                 f"{tuple(reversed(array.shape))}, expected {tuple(reversed(shape[1:]))}")
            parts.append(array)
        layers[key] = jnp.asarray(np.stack(parts))
    return spec, {"layers": layers}
