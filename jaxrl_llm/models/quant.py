"""Frozen base weights stored as int8 or 4-bit integers and dequantized on the fly (LoRA's frozen base).

Symmetric per-output-channel quantization of a projection W [in, out]: with q = 127 (int8) or 7 (int4),
scale[o] = max_i |W[i, o]| / q and C = round(W / scale) clipped to [-q, q], so W ~ C * scale with an error
of at most scale[o] / 2 per element (Jacob et al. 2018; int4 is a uniform grid, not QLoRA's NF4 levels).
A quantized layer dict holds "{p}" as int8 [L, in, out] (int8) or as uint8 [L, in / 2, out] with two 4-bit
codes per byte (code + 8; input row 2k in the low nibble, 2k + 1 in the high one), and "{p}_scale" float32
[L, 1, out]. A mixture of experts' expert matrices (expert_gate / expert_up [L, E, D, F], expert_down
[L, E, F, D]) are quantized the same way per expert and output channel: scales [L, E, 1, out]. `models.model`
reads every projection through `layer_weight`, inside the layer, so a layer's full-precision weight exists only
while that layer runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Params = dict
KINDS = ("int8", "int4")
_Q_MAX = {"int8": 127, "int4": 7}
SCALE_SUFFIX = "_scale"
EXPERT_MATRICES = ("expert_gate", "expert_up", "expert_down")  # a sparse layer's experts (models.moe)


def quantize_matrix(w: jax.Array, kind: str) -> tuple[jax.Array, jax.Array]:
    """(codes, scale [..., 1, out]) of w [..., in, out], per-output-channel symmetric, `kind` "int8" | "int4"
    (int4 needs an even `in`)."""
    if kind not in _Q_MAX:
        raise ValueError(f"quantization kind must be one of {KINDS}, got {kind!r}")
    if kind == "int4" and w.shape[-2] % 2:
        raise ValueError(f"int4 packs two input rows per byte: the input width must be even, got shape {w.shape}")
    q_max = _Q_MAX[kind]
    w = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=-2, keepdims=True) / q_max
    scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero column: any scale codes it exactly
    codes = jnp.clip(jnp.round(w / scale), -q_max, q_max).astype(jnp.int8)
    if kind == "int4":
        biased = (codes + 8).astype(jnp.uint8)
        codes = biased[..., 0::2, :] | (biased[..., 1::2, :] << 4)
    return codes, scale


def dequantize(codes: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """W ~ codes * scale in `dtype` (uint8 codes are unpacked from two 4-bit codes per byte)."""
    if codes.dtype == jnp.uint8:
        low = (codes & 0xF).astype(jnp.int8) - 8
        high = (codes >> 4).astype(jnp.int8) - 8
        codes = jnp.stack([low, high], axis=-2).reshape(*codes.shape[:-2], 2 * codes.shape[-2], codes.shape[-1])
    return codes.astype(dtype) * scale.astype(dtype)


def quantize_base(params: Params, kind: str, targets: tuple[str, ...] | None = None) -> Params:
    """`params` with the projections in `targets` (default: every "*_proj" weight and the experts' matrices)
    quantized to `kind` ("int8" | "int4") as described above; embeddings, norms, biases and the router stay as
    they are. Pure: jit it (`kind` and `targets` static) to quantize on the accelerator."""
    layers = dict(params["layers"])
    if targets is None:
        targets = tuple(k for k in layers if k.endswith("_proj") or k in EXPERT_MATRICES)
    for name in targets:
        if name not in layers:
            raise ValueError(f"cannot quantize {name!r}: the parameter tree has no layers/{name}")
        layers[name], layers[name + SCALE_SUFFIX] = quantize_matrix(layers[name], kind)
    return {**params, "layers": layers}


def layer_weight(lp: Params, name: str, dtype) -> jax.Array:
    """Projection `name` of one layer's dict in `dtype`, dequantized when the dict holds it quantized."""
    if name + SCALE_SUFFIX in lp:
        return dequantize(lp[name], lp[name + SCALE_SUFFIX], dtype)
    return lp[name].astype(dtype)


def dequantize_base(params: Params, dtype=jnp.float32) -> Params:
    """`params` with every quantized projection replaced by its dequantized weight in `dtype` (the same tree
    when nothing is quantized)."""
    layers = params["layers"]
    quantized = [k[:-len(SCALE_SUFFIX)] for k in layers if k.endswith(SCALE_SUFFIX)]
    if not quantized:
        return params
    out = {k: v for k, v in layers.items() if not k.endswith(SCALE_SUFFIX)}
    for name in quantized:
        out[name] = dequantize(layers[name], layers[name + SCALE_SUFFIX], dtype)
    return {**params, "layers": out}
