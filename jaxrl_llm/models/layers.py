"""Building blocks of the decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Each follows the `transformers` PyTorch implementation of Llama / Qwen2 / Qwen3 (modeling_llama.py,
modeling_rope_utils.py) so logits match it to float32 rounding.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.config import ModelConfig


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019): y = w * x / sqrt(mean(x^2) + eps), statistics in float32.

    As in transformers' LlamaRMSNorm, the normalised value is cast back to x's dtype before the
    weight multiplies it.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Rotary inverse frequencies inv_freq_i = theta^(-2i/d), i < d/2 (RoFormer, Su et al. 2021).

    With Llama-3 scaling (rope_type "llama3", as transformers' `_compute_llama3_parameters`):
    wavelengths 2*pi/inv_freq longer than L/low_freq_factor are divided by `factor`, shorter than
    L/high_freq_factor are kept, and those in between are interpolated with
    s = (L/wavelen - low) / (high - low): (1 - s) * inv_freq/factor + s * inv_freq,
    where L = original_max_position_embeddings. Computed in float32 like the reference.
    """
    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    scaling = config.rope_scaling_dict()
    if scaling.get("rope_type", "default") != "llama3":
        return inv_freq
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", config.max_position_embeddings))
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate x [B, T, heads, d] by angle positions * inv_freq, rotate-half layout as in HF:
    x * cos + concat(-x2, x1) * sin, where x1, x2 are the two halves of the head dimension."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, d/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention softmax(q k^T / sqrt(d) + mask) v (Ainslie et al. 2023).

    q [B, T, H, d]; k, v [B, S, KV, d] with H a multiple of KV; query head h reads KV head
    h // (H / KV), as transformers' repeat_kv. mask [B, T, S] bool (True = may attend).
    Scores and softmax run in float32. Returns [B, T, H * d].
    """
    batch, length, num_heads, head_dim = q.shape
    num_kv, keys = k.shape[2], k.shape[1]
    group = num_heads // num_kv
    # Heads first, a KV head's query group and positions merged into one axis: both products become
    # plain batched matmuls [B*KV] x [G*T, d] x [d, S] (faster on CPU than a 5-D dot_general), and the
    # scale goes on q, which is d/S times smaller than the scores.
    q = (q * jnp.asarray(head_dim ** -0.5, q.dtype)).reshape(batch, length, num_kv, group, head_dim)
    q = q.transpose(0, 2, 3, 1, 4).reshape(batch, num_kv, group * length, head_dim)
    scores = jnp.einsum("bkqd,bksd->bkqs", q, k.transpose(0, 2, 1, 3), preferred_element_type=jnp.float32)
    scores = scores.reshape(batch, num_kv, group, length, keys)
    # A finite floor keeps fully-masked rows (padding queries) NaN-free.
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(batch, num_kv, group * length, keys)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, v.transpose(0, 2, 1, 3)).reshape(batch, num_kv, group, length,
                                                                                 head_dim)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, num_heads * head_dim)


def swiglu_mlp(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """SwiGLU feed-forward (Shazeer 2020): (silu(x W_gate) * (x W_up)) W_down."""
    dtype = x.dtype
    hidden = jax.nn.silu(x @ gate.astype(dtype)) * (x @ up.astype(dtype))
    return hidden @ down.astype(dtype)
