"""GGUF checkpoints (llama.cpp's file format) -> HF-named tensors, ModelConfig, params and Tokenizer.

A GGUF file holds key/value metadata (hyper-parameters, the tokenizer vocabulary, merges and chat
template) and tensors named in llama.cpp's scheme ("blk.3.attn_q.weight"), possibly block-quantized
(Q4_1, Q8_0, ...). `gguf_to_hf` parses the header, dequantizes every tensor to float32 with
`gguf.quants.dequantize` (the `gguf` package: llama.cpp's own block decoders), renames it to the
Hugging Face name and layout ([out, in]) and writes the matching transformers config.json dict. The result feeds
`params_from_hf`, so GGUF and safetensors checkpoints share one loading path.

llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel) reorders the rows of Llama's q and k
projections per head from HF's "rotate half" RoPE layout to the interleaved one; `unpermute_qk`
undoes it. Qwen2 and Qwen3 files are written without that permutation.

Gemma 2 and Gemma 3 files (text models) store every norm weight as 1 + w, the scale llama.cpp multiplies
by, where HF stores w: 1 is subtracted back. They name the four norms of a layer attn_norm,
post_attention_norm, ffn_norm (before the MLP) and post_ffw_norm, and record no query_pre_attn_scalar: as
llama.cpp does, the attention scale is head_dim^-1/2, except for the 27B models (Gemma 2: 46 layers,
Gemma 3: 62) whose scale is (hidden / heads)^-1/2. Without `attention.sliding_window_pattern`, Gemma 2
alternates sliding and full layers from layer 0 and Gemma 3 makes every sixth layer full, with a local RoPE
base of 10^4 (`rope.freq_base_swa` when present).
"""

from __future__ import annotations

import pathlib
import re
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
_MAGIC = b"GGUF"
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                     "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_MODEL_TYPES = {"gemma3": "gemma3_text"}  # GGUF architecture -> HF model_type, where they differ
_GEMMA = ("gemma2", "gemma3")
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

# llama.cpp tensor name -> HF name; per-layer names follow "blk.{layer}." / "model.layers.{layer}.".
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
_GEMMA_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
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


# GGUF metadata value types (gguf.GGUFValueType): numeric ones as little-endian numpy dtypes.
_STRING, _ARRAY = 8, 9
_NUMERIC = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
            12: "<f8"}


class _GGUFFile:
    """The header of a GGUF v2/v3 file, parsed from a memory map: `metadata` (key -> Python value)
    and `tensors` (name -> (ggml type, dims innermost first, raw uint8 block data)).

    The layout follows llama.cpp's gguf.md: magic, version u32, tensor count u64, key/value count
    u64, the key/value pairs, the tensor infos (name, n_dims u32, dims u64..., type u32, offset u64),
    then the tensor data from the next multiple of `general.alignment` (default 32). It is read here
    rather than with gguf.GGUFReader, which spends seconds wrapping each of the ~100k vocabulary
    strings in its own array view; the blocks are still decoded by gguf.quants.dequantize.
    """

    def __init__(self, path):
        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        with open(self.path, "rb") as handle:
            magic = handle.read(4)
        if magic != _MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (starts with {magic!r}, expected {_MAGIC!r})")
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r").view(np.ndarray)  # plain views: fast slicing
        try:
            self._parse()
        except (struct.error, ValueError, IndexError, UnicodeDecodeError) as err:
            raise ValueError(f"{self.path}: unreadable GGUF file, truncated or corrupt ({err})") from None

    def _unpack(self, fmt: str):
        values = struct.unpack_from(fmt, self._data, self._pos)
        self._pos += struct.calcsize(fmt)
        return values[0] if len(values) == 1 else values

    def _string(self) -> str:
        size = self._unpack("<Q")
        end = self._pos + size
        if end > self._data.size:
            raise ValueError(f"string of {size} bytes runs past the end of the file")
        text = self._data[self._pos:end].tobytes().decode("utf-8")
        self._pos = end
        return text

    def _value(self, value_type: int):
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<IQ")
            if item_type == _STRING:
                return [self._string() for _ in range(count)]
            if item_type not in _NUMERIC:
                raise ValueError(f"unsupported metadata array item type {item_type}")
            items = np.frombuffer(self._data, _NUMERIC[item_type], count, self._pos)
            self._pos += items.nbytes
            return items.tolist()
        if value_type not in _NUMERIC:
            raise ValueError(f"unsupported metadata value type {value_type}")
        value = np.frombuffer(self._data, _NUMERIC[value_type], 1, self._pos)[0].item()
        self._pos += np.dtype(_NUMERIC[value_type]).itemsize
        return value

    def _parse(self) -> None:
        import gguf

        self._pos = 4
        version, tensor_count, kv_count = self._unpack("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3, little-endian)")
        self.metadata = {}
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            infos.append((name, dims, *self._unpack("<IQ")))
        alignment = self.metadata.get("general.alignment", 32)
        start = -(-self._pos // alignment) * alignment
        self.tensors = {}
        for name, dims, ggml_type, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(ggml_type)
                block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise ValueError(f"tensor {name!r} has unknown ggml type {ggml_type}") from None
            nbytes = int(np.prod(dims)) // block * block_bytes
            if start + offset + nbytes > self._data.size:
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            self.tensors[name] = (qtype, dims, self._data[start + offset:start + offset + nbytes])

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """HF-order shapes (outermost first) of every tensor."""
        return {name: tuple(reversed(dims)) for name, (_, dims, _) in self.tensors.items()}

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor `name` as a float32 array in HF order (a copy, detached from the memory map)."""
        import gguf

        qtype, dims, raw = self.tensors[name]
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        rows = raw.reshape(*reversed(dims[1:]), dims[0] // block * block_bytes)
        try:
            values = gguf.quants.dequantize(rows, qtype)
        except NotImplementedError as err:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported type {qtype.name} ({err})") from None
        return np.array(values, dtype=np.float32).reshape(tuple(reversed(dims)))


def read_gguf_metadata(path) -> dict[str, Any]:
    """All metadata key/value pairs of a GGUF file as Python values (no tensor is read)."""
    return dict(_GGUFFile(path).metadata)


# llama.cpp keeps Llama 3.1+ RoPE scaling only as the per-frequency divisors in rope_freqs.weight;
# Meta's released models all use these band settings, only the factor differs (8 for 3.1, 32 for 3.2).
_LLAMA3_BANDS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_rope_divisors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                         high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """Per-frequency divisors of Llama 3.1 RoPE scaling (Meta's llama3 reference, as in
    transformers' rope_type "llama3"): with wavelength w_i = 2 pi theta^(2i/d), L = the original
    context, the divisor is 1 for w_i < L / high_freq_factor, `factor` for w_i > L / low_freq_factor,
    and 1 / ((1 - s) / factor + s) in between, s = (L / w_i - low_freq_factor) / (high - low)."""
    wavelength = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    context = original_max_position_embeddings
    smooth = (context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    divisor = 1 / ((1 - smooth) / factor + smooth)
    divisor = np.where(wavelength < context / high_freq_factor, 1.0, divisor)
    return np.where(wavelength > context / low_freq_factor, factor, divisor)


def _llama3_scaling(file: pathlib.Path, divisors: np.ndarray, head_dim: int, theta: float) -> dict | None:
    """HF rope_scaling dict that reproduces the file's rope_freqs divisors (None when all are 1)."""
    if divisors.shape != (head_dim // 2,):
        raise ValueError(f"{file}: rope_freqs.weight has shape {divisors.shape}, expected ({head_dim // 2},)")
    if np.all(divisors == 1):
        return None
    scaling = {"rope_type": "llama3", "factor": float(divisors.max()), **_LLAMA3_BANDS}
    expected = llama3_rope_divisors(head_dim, theta, **{k: v for k, v in scaling.items() if k != "rope_type"})
    if not np.allclose(divisors, expected, rtol=1e-4):
        raise ValueError(f"{file}: rope_freqs.weight does not match Llama 3 RoPE scaling (factor "
                         f"{scaling['factor']}, low/high frequency factors 1/4, original context 8192)")
    return scaling


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

    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type != "none" and not (arch == "gemma3" and scaling_type == "linear"):
        raise ValueError(f"{file}: RoPE scaling type {scaling_type!r} is not supported")
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
        "model_type": _MODEL_TYPES.get(arch, arch),
        "vocab_size": int(tensor_shapes["token_embd.weight"][0]),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "hidden_act": "gelu_pytorch_tanh" if arch in _GEMMA else "silu",
        "max_position_embeddings": get("context_length", 2048),
        "rope_theta": float(get("rope.freq_base", 1000000.0 if arch == "gemma3" else 10000.0)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        # llama.cpp leaves output.weight out when the output projection is the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        config["use_sliding_window"] = False
    else:
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    if arch in _GEMMA:
        config.update(_gemma_config(arch, meta, config))
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{gguf_key}" in meta:
            config[hf_key] = meta[f"tokenizer.ggml.{gguf_key}"]
    return config


def _maybe(cast, value):
    return None if value is None else cast(value)


def _gemma_config(arch: str, meta: dict[str, Any], config: dict) -> dict:
    """The Gemma config.json entries llama.cpp's metadata implies (see the module docstring)."""
    def opt(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    layers = config["num_hidden_layers"]
    out = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": (config["hidden_size"] // config["num_attention_heads"]
                                  if layers == _GEMMA_27B_LAYERS[arch] else config["head_dim"]),
        "attn_logit_softcapping": _maybe(float, opt("attn_logit_softcapping")),
        "final_logit_softcapping": _maybe(float, opt("final_logit_softcapping")),
        "sliding_window": _maybe(int, opt("attention.sliding_window")),
    }
    pattern = opt("attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple, np.ndarray)):  # one flag per layer: true = sliding
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern is not None:
        out["layer_types"] = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                              for i in range(layers)]
    if arch == "gemma3":
        out["rope_local_base_freq"] = float(opt("rope.freq_base_swa", 10000.0))
        if opt("rope.scaling.type", "none") == "linear":
            out["rope_scaling"] = {"rope_type": "linear", "factor": float(opt("rope.scaling.factor"))}
    return out


def _hf_name(file: pathlib.Path, gguf_name: str, arch: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    names = _GEMMA_LAYER_TENSORS if arch in _GEMMA else _LAYER_TENSORS
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}"
    raise ValueError(f"{file}: unexpected tensor {gguf_name!r} (no Llama/Qwen2/Qwen3/Gemma equivalent)")


class _DequantizedTensors(Mapping):
    """HF name -> float32 tensor, dequantized (and for Llama q/k un-permuted) when read, so a loader
    holds one dequantized tensor at a time rather than the whole model."""

    def __init__(self, file: _GGUFFile, names: dict[str, str], heads: dict[str, int], *, norm_offset: bool = False):
        self._file, self._names, self._heads, self._norm_offset = file, names, heads, norm_offset

    def __getitem__(self, name: str) -> np.ndarray:
        gguf_name = self._names[name]
        values = self._file.dequantize(gguf_name)
        kind = gguf_name.split(".")[-2]
        if kind in self._heads:
            values = unpermute_qk(values, self._heads[kind])
        if self._norm_offset and gguf_name.endswith("norm.weight"):  # Gemma files store the scale 1 + w
            values = values - np.float32(1.0)
        return values

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _convert(file: _GGUFFile) -> tuple[dict, Mapping[str, np.ndarray]]:
    """(HF config dict, lazily dequantized HF-named tensors) of a GGUF file."""
    config = _hf_config(file.path, file.metadata, file.shapes())
    heads = {}
    if config["model_type"] == "llama":  # llama.cpp permutes the q/k rows of Llama checkpoints
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    names = {}
    arch = file.metadata.get("general.architecture")
    for gguf_name in file.tensors:
        if gguf_name == "rope_freqs.weight":  # a config value in HF checkpoints, not a weight
            if config["model_type"] != "llama":
                raise ValueError(f"{file.path}: rope_freqs.weight is only supported for llama")
            scaling = _llama3_scaling(file.path, file.dequantize(gguf_name), config["head_dim"], config["rope_theta"])
            if scaling is not None:
                config["rope_scaling"] = scaling
            continue
        names[_hf_name(file.path, gguf_name, arch)] = gguf_name
    return config, _DequantizedTensors(file, names, heads, norm_offset=arch in _GEMMA)


def gguf_to_hf(path) -> tuple[dict, dict[str, np.ndarray]]:
    """Read a Llama / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 GGUF file into (transformers config.json dict, tensors).

    Tensors are float32 numpy arrays with Hugging Face names and layout ("model.layers.0.self_attn.
    q_proj.weight" as [out, in]); quantized blocks (Q4_1, Q8_0, ...) are dequantized, F16 is widened,
    Llama q/k rows are un-permuted. A file without output.weight gets tie_word_embeddings=True;
    Llama 3.1+ rope_freqs divisors become rope_scaling {"rope_type": "llama3", ...}.
    Raises FileNotFoundError / ValueError naming the file and the problem.
    """
    config, tensors = _convert(_GGUFFile(path))
    return config, dict(tensors)


def load_gguf(path, dtype=None):
    """Load a GGUF file as (ModelConfig, params, Tokenizer).

    `dtype` ("float32" | "bfloat16") sets both param_dtype and compute_dtype (default float32), as
    in `load_hf`. The tokenizer is rebuilt from the file's vocabulary, merges and chat template.
    """
    import jax.numpy as jnp

    from jaxrl_llm.models.config import ModelConfig
    from jaxrl_llm.models.hf_io import params_from_hf
    from jaxrl_llm.models.tokenizer import Tokenizer

    file = _GGUFFile(path)
    hf_config, tensors = _convert(file)
    overrides = {}
    if dtype is not None:  # ModelConfig rejects anything but float32 / bfloat16
        overrides = dict(param_dtype=jnp.dtype(dtype).name, compute_dtype=jnp.dtype(dtype).name)
    try:
        config = ModelConfig.from_hf_dict(hf_config, **overrides)
        params = params_from_hf(config, tensors)
    except ValueError as err:
        raise ValueError(f"{file.path}: {err}") from None
    tokenizer = Tokenizer.from_gguf_metadata(file.metadata, source=str(file.path))
    return config, params, tokenizer
