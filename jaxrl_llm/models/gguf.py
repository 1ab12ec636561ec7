"""GGUF checkpoints (llama.cpp's file format) -> HF-named tensors, ModelConfig, params and Tokenizer.

A GGUF file holds key/value metadata (hyper-parameters, the tokenizer vocabulary, merges and chat
template) and tensors named in llama.cpp's scheme ("blk.3.attn_q.weight"), possibly block-quantized
(Q4_1, Q8_0, ...). `gguf_to_hf` reads it with the `gguf` package (llama.cpp's own Python reader),
dequantizes every tensor to float32 with `gguf.quants.dequantize`, renames it to the Hugging Face
name and layout ([out, in]) and writes the matching transformers config.json dict. The result feeds
`params_from_hf`, so GGUF and safetensors checkpoints share one loading path.

llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel) reorders the rows of Llama's q and k
projections per head from HF's "rotate half" RoPE layout to the interleaved one; `unpermute_qk`
undoes it. Qwen2 and Qwen3 files are written without that permutation.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_MAGIC = b"GGUF"
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# llama.cpp tensor name -> HF name; "{i}" is the layer index.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of a Llama q or k projection (weight or bias).

    llama.cpp writes, per head of d rows, row order (0, d/2, 1, d/2+1, ...):
    W_gguf = W.reshape(n, 2, d/2, ...).swapaxes(1, 2).reshape(W.shape). The inverse reshapes to
    (n, d/2, 2, ...) and swaps the same two axes back.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot un-permute {rows} rows into {num_heads} heads of even size")
    split = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def _field_value(field) -> Any:
    """One GGUF metadata field as a Python value (str, int, float, bool, or a list of them)."""
    import gguf

    def scalar(part, value_type):
        if value_type == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        value = part[0].item()
        return bool(value) if value_type == gguf.GGUFValueType.BOOL else value

    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [scalar(field.parts[i], field.types[-1]) for i in field.data]
    return scalar(field.parts[field.data[0]], field.types[0])


def _open_reader(path):
    """GGUFReader for `path`, with errors that name the file and what is wrong with it."""
    import gguf

    file = pathlib.Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such GGUF file")
    with open(file, "rb") as handle:
        magic = handle.read(4)
    if magic != _MAGIC:
        raise ValueError(f"{file}: not a GGUF file (starts with {magic!r}, expected {_MAGIC!r})")
    try:
        return gguf.GGUFReader(str(file))
    except Exception as err:  # the reader raises bare ValueError/IndexError on truncated files
        raise ValueError(f"{file}: unreadable GGUF file, truncated or corrupt ({err})") from None


def read_gguf_metadata(path) -> dict[str, Any]:
    """All metadata key/value pairs of a GGUF file as Python values (no tensor is read)."""
    reader = _open_reader(path)
    return {key: _field_value(field) for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _hf_config(file: pathlib.Path, meta: dict[str, Any], tensor_shapes: dict[str, tuple]) -> dict:
    """transformers config.json dict from the GGUF hyper-parameters (`{arch}.*` keys)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{file}: GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{file}: GGUF metadata key {arch}.{key!s} is missing")
        return value

    if "rope_freqs.weight" in tensor_shapes or f"{arch}.rope.scaling.type" in meta:
        raise ValueError(f"{file}: RoPE scaling stored in a GGUF (rope_freqs / rope.scaling.*) is not supported")
    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // num_heads)
    rope_dim = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"{file}: partial rotary embedding (rope.dimension_count {rope_dim} != head_dim "
                         f"{head_dim}) is not supported")
    if "token_embd.weight" not in tensor_shapes:
        raise ValueError(f"{file}: tensor token_embd.weight is missing")
    config = {
        "architectures": [_HF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(tensor_shapes["token_embd.weight"][0]),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": get("context_length", 2048),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        # llama.cpp leaves output.weight out when the output projection is the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        config["use_sliding_window"] = False
    else:
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{gguf_key}" in meta:
            config[hf_key] = meta[f"tokenizer.ggml.{gguf_key}"]
    return config


def _hf_name(file: pathlib.Path, gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    raise ValueError(f"{file}: unexpected tensor {gguf_name!r} (no Llama/Qwen2/Qwen3 equivalent)")


def _dequantize(file: pathlib.Path, tensor) -> np.ndarray:
    import gguf

    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as err:
        raise ValueError(f"{file}: tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name} "
                         f"({err})") from None
    # GGUF lists dims innermost first; HF's layout is the reverse (rows = output features).
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    return np.array(values, dtype=np.float32).reshape(shape)  # copy: detaches from the memory map


def _convert(file: pathlib.Path, reader) -> tuple[dict, dict[str, np.ndarray], dict[str, Any]]:
    meta = {key: _field_value(field) for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in reader.tensors}
    config = _hf_config(file, meta, shapes)
    permuted = config["model_type"] == "llama"
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors = {}
    for tensor in reader.tensors:
        name = _hf_name(file, tensor.name)
        values = _dequantize(file, tensor)
        kind = tensor.name.split(".")[-2]
        if permuted and kind in heads:
            values = unpermute_qk(values, heads[kind])
        tensors[name] = values
    return config, tensors, meta


def gguf_to_hf(path) -> tuple[dict, dict[str, np.ndarray]]:
    """Read a Llama / Qwen2 / Qwen3 GGUF file into (transformers config.json dict, tensors).

    Tensors are float32 numpy arrays with Hugging Face names and layout ("model.layers.0.self_attn.
    q_proj.weight" as [out, in]); quantized blocks (Q4_1, Q8_0, ...) are dequantized, F16 is widened,
    Llama q/k rows are un-permuted. A file without output.weight gets tie_word_embeddings=True.
    Raises FileNotFoundError / ValueError naming the file and the problem.
    """
    file = pathlib.Path(path)
    config, tensors, _ = _convert(file, _open_reader(file))
    return config, tensors


def load_gguf(path, dtype=None):
    """Load a GGUF file as (ModelConfig, params, Tokenizer).

    `dtype` ("float32" | "bfloat16") sets both param_dtype and compute_dtype (default float32), as
    in `load_hf`. The tokenizer is rebuilt from the file's vocabulary, merges and chat template.
    """
    from jaxrl_llm.models.config import ModelConfig
    from jaxrl_llm.models.hf_io import _dtype_name, params_from_hf
    from jaxrl_llm.models.tokenizer import Tokenizer

    file = pathlib.Path(path)
    hf_config, tensors, meta = _convert(file, _open_reader(file))
    overrides = {}
    if dtype is not None:
        overrides = dict(param_dtype=_dtype_name(dtype), compute_dtype=_dtype_name(dtype))
    try:
        config = ModelConfig.from_hf_dict(hf_config, **overrides)
        params = params_from_hf(config, tensors)
    except ValueError as err:
        raise ValueError(f"{file}: {err}") from None
    tokenizer = Tokenizer.from_gguf_metadata(meta, source=str(file))
    return config, params, tokenizer
