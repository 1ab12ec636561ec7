"""Hugging Face checkpoints in and out: config.json + safetensors (single file or sharded index).

Only numpy and `safetensors` are used (no torch). HF stores linear weights as [out, in]; the
parameter tree stores them as [in, out] (x @ W) and stacks layers on a leading axis.

Experts (Qwen3-MoE, Mixtral) are stored one tensor per expert and projection, as transformers 5 writes them
("mlp.experts.{e}.gate_proj.weight" [F, D]; Mixtral "block_sparse_moe.experts.{e}.w1.weight" for the gate, w3
the up and w2 the down projection), and are read either so or fused, as transformers holds them in memory
("mlp.experts.gate_up_proj" [E, 2F, D], the gate rows first, and "mlp.experts.down_proj" [E, D, F]). gpt-oss
stores them fused, [in, out] and with biases: "mlp.experts.gate_up_proj" [E, D, 2F] with gate and up columns
interleaved (gate the even ones), "gate_up_proj_bias" [E, 2F] likewise, "down_proj" [E, F, D], "down_proj_bias"
[E, D], the router "mlp.router.weight" [E, D] and "mlp.router.bias" [E]; its attention sinks "self_attn.sinks" [H].
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from typing import NamedTuple

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.model import _DENSE_BLOCK, Params, param_shapes

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Parameter name in params["layers"] -> (HF name inside "model.layers.{i}.", HF stores it [out, in]).
_LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", False),
    "q_proj": ("self_attn.q_proj.weight", True),
    "k_proj": ("self_attn.k_proj.weight", True),
    "v_proj": ("self_attn.v_proj.weight", True),
    "o_proj": ("self_attn.o_proj.weight", True),
    "q_bias": ("self_attn.q_proj.bias", False),
    "k_bias": ("self_attn.k_proj.bias", False),
    "v_bias": ("self_attn.v_proj.bias", False),
    "o_bias": ("self_attn.o_proj.bias", False),
    "attn_sinks": ("self_attn.sinks", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "gate_proj": ("mlp.gate_proj.weight", True),
    "up_proj": ("mlp.up_proj.weight", True),
    "down_proj": ("mlp.down_proj.weight", True),
}
# Gemma names its four norms after their place: post_attention_layernorm is the norm *on* the attention
# output there, and the norm before the MLP is pre_feedforward_layernorm.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "mlp_norm": ("pre_feedforward_layernorm.weight", False),
    "post_attn_norm": ("post_attention_layernorm.weight", False),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", False),
}
# A sparse layer's router and experts, per family: (router, gate, up, down) inside "model.layers.{i}.", "{e}" the
# expert; and the fused form transformers holds in memory (every family's "mlp."): (router, gate_up, down).
_EXPERT_NAMES = {
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                  "mlp.experts.{e}.down_proj.weight"),
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
}
_FUSED_EXPERT_NAMES = ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# gpt-oss's quantized release: each expert matrix as MXFP4 blocks and scales ("mlp.experts.gate_up_proj_blocks", ...)
_MXFP4_SUFFIXES = ("_blocks", "_scales")
# Tensors some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Image-text Gemma 3 checkpoints: the text model's tensors under this prefix (for "model."), beside the
# vision tower and projector, which the text model does not use.
_TEXT_MODEL_PREFIX = "language_model.model."


def _text_model_files(files: dict[str, pathlib.Path]) -> dict[str, tuple[pathlib.Path, str]]:
    """HF tensor name -> (file, name stored there). For an image-text checkpoint, the text model's tensors
    renamed to a text-only checkpoint's ("language_model.model.x" -> "model.x", "language_model.lm_head.weight"
    -> "lm_head.weight"), every other tensor left out."""
    if not any(name.startswith(_TEXT_MODEL_PREFIX) for name in files):
        return {name: (file, name) for name, file in files.items()}
    out = {}
    for name, file in files.items():
        if name.startswith(_TEXT_MODEL_PREFIX):
            out["model." + name[len(_TEXT_MODEL_PREFIX):]] = (file, name)
        elif name == "language_model.lm_head.weight":
            out["lm_head.weight"] = (file, name)
    return out


def _dtype_name(dtype) -> str:
    name = jnp.dtype(dtype).name
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {name}")
    return name


def _np_dtype(name: str):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.float32


class Slot(NamedTuple):
    """Where (part of) an HF tensor lives in the parameter tree: `path` ("embed",) or ("layers", name, layer[,
    expert]); `transposed`: HF stores the last two axes swapped ([out, in]); `part` (j, n): the parameter is the
    j-th of n equal blocks of the HF tensor along the parameter's last axis (a fused gate_up holds the gate
    first) or, `interleaved`, every n-th entry from the j-th (gpt-oss's gate_up); None: the whole tensor."""

    path: tuple
    transposed: bool = False
    part: tuple[int, int] | None = None
    interleaved: bool = False


def _hf_layout(config: ModelConfig, fused: bool = False) -> dict[str, tuple[Slot, ...]]:
    """HF tensor name -> the slots of the parameter tree it fills; `fused`: a sparse layer's experts as
    transformers holds them in memory (gate_up_proj, down_proj: all experts in one tensor each)."""
    shapes = param_shapes(config)
    layout = {"model.embed_tokens.weight": (Slot(("embed",)),), "model.norm.weight": (Slot(("final_norm",)),)}
    if "lm_head" in shapes:
        layout["lm_head.weight"] = (Slot(("lm_head",), True),)
    names = _GEMMA_LAYER_NAMES if config.is_gemma else _LAYER_NAMES
    sparse = config.sparse_layers()
    for i in range(config.num_layers):
        for name in shapes["layers"]:
            if name in names and not (sparse[i] and name in _DENSE_BLOCK):
                suffix, transposed = names[name]
                layout[f"model.layers.{i}.{suffix}"] = (Slot(("layers", name, i), transposed),)
        if sparse[i]:
            layout.update(_expert_layout(config, f"model.layers.{i}.", i, fused))
    return layout


def _expert_layout(config: ModelConfig, prefix: str, layer: int, fused: bool) -> dict[str, tuple[Slot, ...]]:
    """The HF tensors of sparse layer `layer`'s router and experts (`_hf_layout`)."""
    if config.model_type == "gpt_oss":
        def slot(name, *part):
            return Slot(("layers", name, layer), False, part or None, bool(part))

        return {prefix + "mlp.router.weight": (Slot(("layers", "router", layer), True),),
                prefix + "mlp.router.bias": (slot("router_bias"),),
                prefix + "mlp.experts.gate_up_proj": (slot("expert_gate", 0, 2), slot("expert_up", 1, 2)),
                prefix + "mlp.experts.gate_up_proj_bias": (slot("expert_gate_bias", 0, 2), slot("expert_up_bias", 1, 2)),
                prefix + "mlp.experts.down_proj": (slot("expert_down"),),
                prefix + "mlp.experts.down_proj_bias": (slot("expert_down_bias"),)}
    if fused:
        router, gate_up, down = _FUSED_EXPERT_NAMES
        return {prefix + router: (Slot(("layers", "router", layer), True),),
                prefix + gate_up: tuple(Slot(("layers", name, layer), True, (j, 2))
                                        for j, name in enumerate(("expert_gate", "expert_up"))),
                prefix + down: (Slot(("layers", "expert_down", layer), True),)}
    router, *experts = _EXPERT_NAMES[config.model_type]
    layout = {prefix + router: (Slot(("layers", "router", layer), True),)}
    for e in range(config.num_experts):
        for name, pattern in zip(("expert_gate", "expert_up", "expert_down"), experts):
            layout[prefix + pattern.format(e=e)] = (Slot(("layers", name, layer, e), True),)
    return layout


def _is_fused(names) -> bool:
    """Whether HF tensor `names` hold the experts fused (transformers' in-memory layout)."""
    return any(name.endswith(_FUSED_EXPERT_NAMES[1]) for name in names)


def hf_tensor_shapes(config: ModelConfig, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """The HF tensor names and shapes ([out, in] for linear weights) a checkpoint of `config` holds (`fused`:
    its experts in transformers' in-memory layout)."""
    shapes = param_shapes(config)
    out = {}
    for hf_name, slots in _hf_layout(config, fused).items():
        path, transposed, part, _ = slots[0]
        shape = list(shapes["layers"][path[1]][len(path) - 2:] if path[0] == "layers" else shapes[path[0]])
        if part is not None:
            shape[-1] *= part[1]
        if transposed:
            shape[-2:] = shape[:-3:-1]
        out[hf_name] = tuple(shape)
    return out


def _from_hf(array: np.ndarray, slot: Slot) -> np.ndarray:
    """The parameter slice `slot` takes from HF tensor `array`."""
    array = np.swapaxes(array, -1, -2) if slot.transposed else array
    if slot.part is None:
        return array
    j, n = slot.part
    if slot.interleaved:
        return array[..., j::n]
    width = array.shape[-1] // n
    return array[..., j * width:(j + 1) * width]


def _to_hf(parts: list[np.ndarray], slot: Slot) -> np.ndarray:
    """`_from_hf`'s inverse: the HF tensor of the parameter slices `parts`, one per slot, in the slots' order."""
    if slot.part is None:
        array = parts[0]
    elif slot.interleaved:
        array = np.stack(parts, axis=-1).reshape(*parts[0].shape[:-1], -1)
    else:
        array = np.concatenate(parts, axis=-1)
    return np.ascontiguousarray(np.swapaxes(array, -1, -2) if slot.transposed else array)


def _check_names(config: ModelConfig, names, where: str) -> None:
    quantized = [n for n in names if ".mlp.experts." in n and n.endswith(_MXFP4_SUFFIXES)]
    if quantized:
        raise ValueError(f"{where}: tensor {quantized[0]!r}: the experts are MXFP4-quantized (gpt-oss's release), "
                         "which load_hf does not read yet; load the bf16 checkpoint, or dequantize with transformers "
                         "(Mxfp4Config(dequantize=True)) and save_pretrained")
    expected = hf_tensor_shapes(config, _is_fused(names))
    missing = [n for n in expected if n not in names]
    if missing:
        raise ValueError(f"{where}: missing tensor {missing[0]!r} ({len(missing)} missing in all) "
                         f"for a {config.model_type} model with {config.num_layers} layers")
    unexpected = [n for n in names if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
                  and not (n == "lm_head.weight" and config.tie_word_embeddings)]
    if unexpected:
        raise ValueError(f"{where}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all); "
                         f"the weights do not match the {config.model_type} config")




def params_from_hf(config: ModelConfig, tensors: Mapping[str, np.ndarray], dtype=None) -> Params:
    """Parameter tree from HF-named tensors in HF layout ("model.layers.3.self_attn.q_proj.weight"
    [out, in], "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight").
    Weights are transposed to [in, out], layers stacked, and cast to `dtype`
    (default config.param_dtype). Raises ValueError naming a missing, unexpected or mis-shaped tensor."""
    np_dtype = _np_dtype(_dtype_name(dtype or config.param_dtype))
    _check_names(config, tensors.keys(), "tensors")
    fused = _is_fused(tensors.keys())
    expected = hf_tensor_shapes(config, fused)
    shapes = param_shapes(config)
    params: Params = {"layers": {}}
    stacked: dict[str, np.ndarray] = {}
    layout = _hf_layout(config, fused)
    remaining: dict[str, int] = {}  # slots left to fill of each stacked weight
    for slot in (slot for slots in layout.values() for slot in slots if slot.path[0] == "layers"):
        remaining[slot.path[1]] = remaining.get(slot.path[1], 0) + 1
    # One stacked weight at a time, layer by layer into its final buffer: host memory holds the parameters
    # plus one weight's stack, not a second (transposed, cast) copy of the whole model. Layers of a model mixing
    # dense and sparse ones keep zeros in the block they do not use.
    for hf_name, slots in sorted(layout.items(), key=lambda item: (item[1][0].path[0] == "layers",
                                                                    item[1][0].path[1:])):
        array = np.asarray(tensors[hf_name])
        if tuple(array.shape) != expected[hf_name]:
            raise ValueError(f"tensors: tensor {hf_name!r} has shape {tuple(array.shape)} but the config implies "
                             f"{expected[hf_name]}")
        for slot in slots:
            part, path = _from_hf(array, slot), slot.path
            if path[0] != "layers":
                params[path[0]] = jnp.asarray(part.astype(np_dtype))
                continue
            name = path[1]
            if name not in stacked:
                stacked[name] = np.zeros(shapes["layers"][name], np_dtype)
            stacked[name][path[2:]] = part
            remaining[name] -= 1
            if not remaining[name]:
                params["layers"][name] = jnp.asarray(stacked.pop(name))
    return params


def params_to_hf(config: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """Inverse of `params_from_hf`: HF-named numpy tensors in HF layout, in the params' dtype (experts one tensor
    per expert and projection, as transformers writes them)."""
    def value(path):
        return np.asarray(params["layers"][path[1]][path[2:]] if path[0] == "layers" else params[path[0]])

    return {hf_name: _to_hf([value(slot.path) for slot in slots], slots[0])
            for hf_name, slots in _hf_layout(config).items()}


def _read_config(directory: pathlib.Path, dtype) -> ModelConfig:
    config_path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such checkpoint directory")
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: missing; a Hugging Face checkpoint needs config.json")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path}: not valid JSON ({err})") from None
    overrides = {}
    if dtype is not None:
        overrides = dict(param_dtype=_dtype_name(dtype), compute_dtype=_dtype_name(dtype))
    try:
        return ModelConfig.from_hf_dict(raw, **overrides)
    except ValueError as err:
        raise ValueError(f"{config_path}: {err}") from None


def _weight_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """HF tensor name -> the safetensors file that should hold it (from the index when sharded)."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise ValueError(f"{index_path}: not a safetensors index with a weight_map ({err!r})") from None
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / WEIGHTS_FILE
    if not single.is_file():
        raise FileNotFoundError(f"{directory}: neither {WEIGHTS_FILE} nor {INDEX_FILE} found")
    with _open_safetensors(single) as f:
        return {name: single for name in f.keys()}


def _open_safetensors(path: pathlib.Path, framework: str = "np"):
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing safetensors file")
    try:
        return safe_open(str(path), framework=framework)
    except SafetensorError as err:
        raise ValueError(f"{path}: not a readable safetensors file, truncated or corrupt ({err})") from None


def _get_tensor(handle, path: pathlib.Path, name: str) -> np.ndarray:
    try:
        return handle.get_tensor(name)
    except (SafetensorError, TypeError, ValueError):
        # Older safetensors cannot build bfloat16 numpy arrays: go through JAX instead.
        with _open_safetensors(path, framework="flax") as f:
            return np.asarray(f.get_tensor(name))


def load_hf(path, dtype=None) -> tuple[ModelConfig, Params]:
    """Load a Llama / Qwen2 / Qwen3 / Mistral / Gemma 2 / Gemma 3 / Qwen3-MoE / Mixtral / gpt-oss checkpoint directory
    (of an image-text Gemma 3, its text model): config.json plus model.safetensors or
    model.safetensors.index.json with its shards. `dtype` ("float32" | "bfloat16") sets both
    param_dtype and compute_dtype (default float32). Errors name the file and tensor at fault."""
    directory = pathlib.Path(path)
    config = _read_config(directory, dtype)
    files = _text_model_files(_weight_files(directory))
    _check_names(config, files.keys(), str(directory))
    return config, params_from_hf(config, _read_tensors(files, hf_tensor_shapes(config, _is_fused(files))))


def _read_tensors(files: dict[str, tuple[pathlib.Path, str]], shapes: dict[str, tuple[int, ...]]) -> dict:
    """The tensors named in `shapes` (HF name -> expected shape), one file open at a time; errors name the
    file and the missing or mis-shaped tensor."""
    names_by_file: dict[pathlib.Path, list[str]] = {}
    for name in shapes:
        names_by_file.setdefault(files[name][0], []).append(name)
    tensors = {}
    for file, names in names_by_file.items():
        with _open_safetensors(file) as handle:
            present = set(handle.keys())
            for name in names:
                stored = files[name][1]
                if stored not in present:
                    raise ValueError(f"{file}: missing tensor {stored!r} listed in {INDEX_FILE}")
                shape = tuple(handle.get_slice(stored).get_shape())
                if shape != tuple(shapes[name]):
                    raise ValueError(f"{file}: tensor {name!r} has shape {shape} but the config implies "
                                     f"{tuple(shapes[name])}")
                tensors[name] = _get_tensor(handle, file, stored)
    return tensors


def save_hf(path, config: ModelConfig, params: Params, tokenizer=None) -> pathlib.Path:
    """Write config.json (with `architectures`, loadable by transformers' AutoModelForCausalLM) and
    model.safetensors to directory `path`, plus the tokenizer files when `tokenizer` (anything with
    `save_pretrained(dir)`) is given. Returns the directory."""
    directory = pathlib.Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    hf_config = config.to_hf_dict()
    tensors = params_to_hf(config, params)
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return directory


# ---- value models (PPO's critic) as transformers' token classifiers ------------------------------------------

VALUE_HEAD_TENSORS = ("score.weight", "score.bias")  # [1, hidden] and [1]: XForTokenClassification's head


def _value_architecture(config: ModelConfig) -> str:
    return config.architecture.replace("ForCausalLM", "ForTokenClassification")


def is_hf_value_model(path) -> bool:
    """Whether `path` is a folder written by `save_hf_value` (or any one-label XForTokenClassification)."""
    config_path = pathlib.Path(path) / CONFIG_FILE
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (any(str(a).endswith("ForTokenClassification") for a in raw.get("architectures") or [])
            and raw.get("num_labels", len(raw.get("id2label") or {0: ""})) == 1)


def save_hf_value(path, config: ModelConfig, params: Params, tokenizer=None) -> pathlib.Path:
    """Write a value model, `{"trunk": decoder parameters without lm_head, "value_head": {"kernel": [D, 1],
    "bias": [1]}}` (models.flax_modules.ValueModel's parameters), as transformers'
    `<Family>ForTokenClassification` with one label: the trunk's tensors under "model." as in `save_hf`, the
    head as "score" (weight [1, D], bias [1]). Its per-token logits are the values, so
    `AutoModelForTokenClassification.from_pretrained(path)(ids).logits[..., 0]` is V at every position
    (transformers has no Gemma 3 token classifier; `load_hf_value` reads every family)."""
    directory = pathlib.Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    trunk_config = config.replace(tie_word_embeddings=True)  # the trunk's tree: no lm_head whatever the model
    tensors = params_to_hf(trunk_config, params["trunk"])
    head = params["value_head"]
    tensors["score.weight"] = np.ascontiguousarray(np.asarray(head["kernel"], np.float32).T)
    tensors["score.bias"] = np.asarray(head["bias"], np.float32).reshape(1)
    hf_config = {**config.to_hf_dict(), "architectures": [_value_architecture(config)], "num_labels": 1,
                 "id2label": {"0": "value"}, "label2id": {"value": 0}, "classifier_dropout": 0.0}
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return directory


def load_hf_value(path, dtype=None) -> tuple[ModelConfig, Params]:
    """(ModelConfig, value parameters {"trunk", "value_head"}) from a folder of `save_hf_value` (or a one-label
    XForTokenClassification of a supported family). The head stays float32; `dtype` sets the trunk's."""
    directory = pathlib.Path(path)
    config = _read_config(directory, dtype)
    if not is_hf_value_model(directory):
        raise ValueError(f"{directory / CONFIG_FILE}: not a one-label token classifier (architectures "
                         "<Family>ForTokenClassification, num_labels 1), the form of an exported critic")
    files = _text_model_files(_weight_files(directory))
    trunk_config = config.replace(tie_word_embeddings=True)
    trunk_names = [n for n in files if n not in VALUE_HEAD_TENSORS and n != "lm_head.weight"]
    _check_names(trunk_config, trunk_names, str(directory))
    missing = [n for n in VALUE_HEAD_TENSORS if n not in files]
    if missing:
        raise ValueError(f"{directory}: missing tensor {missing[0]!r}: the value head of a token classifier")
    shapes = {**hf_tensor_shapes(trunk_config, _is_fused(trunk_names)), "score.weight": (1, config.hidden_size),
              "score.bias": (1,)}
    tensors = _read_tensors(files, shapes)
    head = {"kernel": jnp.asarray(np.asarray(tensors.pop("score.weight"), np.float32).T),
            "bias": jnp.asarray(np.asarray(tensors.pop("score.bias"), np.float32))}
    return config, {"trunk": params_from_hf(trunk_config, tensors), "value_head": head}
