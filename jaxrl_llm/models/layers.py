"""Building blocks of the decoder: RMSNorm, rotary embeddings, grouped-query attention, gated MLPs.

Each follows the `transformers` PyTorch implementation of Llama / Qwen2 / Qwen3 / Mistral / Gemma 2 /
Gemma 3 (modeling_llama.py, modeling_gemma2.py, modeling_rope_utils.py) so logits match it to float32
rounding.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
import numpy as np

from jaxrl_llm.models.config import ModelConfig


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, unit_offset: bool = False,
             float32_product: bool = False) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019): y = w * x / sqrt(mean(x^2) + eps), statistics in float32.

    As in transformers' LlamaRMSNorm, the normalised value is cast back to x's dtype before the
    weight multiplies it. With `unit_offset` (Gemma) the scale is (1 + w) and, as in GemmaRMSNorm,
    the product is taken in float32 and cast afterwards; `float32_product` (gpt-oss) takes w's product in
    float32 too.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    if float32_product:
        return (normed * weight.astype(jnp.float32)).astype(x.dtype)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def rope_inv_freq(config: ModelConfig, local: bool = False) -> np.ndarray:
    """Rotary inverse frequencies inv_freq_i = theta^(-2i/d), i < d/2 (RoFormer, Su et al. 2021).

    `local=True` gives those of the sliding-window layers: with `config.rope_local_theta` set (Gemma 3),
    theta is that base and no scaling applies; otherwise they are the full layers'.
    With linear scaling (rope_type "linear") every inv_freq is divided by `factor`.

    With Llama-3 scaling (rope_type "llama3", as transformers' `_compute_llama3_parameters`):
    wavelengths 2*pi/inv_freq longer than L/low_freq_factor are divided by `factor`, shorter than
    L/high_freq_factor are kept, and those in between are interpolated with
    s = (L/wavelen - low) / (high - low): (1 - s) * inv_freq/factor + s * inv_freq,
    where L = original_max_position_embeddings. Computed in float32 like the reference.

    With YaRN (rope_type "yarn", Peng et al. 2023, as transformers' `_compute_yarn_parameters`): frequency i is
    inv_freq_i / factor (interpolated) or inv_freq_i (extrapolated), blended by a ramp over the dimensions between
    the ones that turn beta_fast and beta_slow times over the original length L: inv_freq_i ((1 - r_i) / factor +
    r_i), r_i = 1 - clip((i - low) / (high - low), 0, 1); `rope_attention_factor` scales cos and sin.
    """
    dim = config.head_dim
    local = local and config.rope_local_theta is not None
    theta = config.rope_local_theta if local else config.rope_theta
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    scaling = {} if local else config.rope_scaling_dict()
    if scaling.get("rope_type", "default") == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if scaling.get("rope_type", "default") == "yarn":
        return _yarn_inv_freq(inv_freq, scaling, dim, float(theta), config.max_position_embeddings)
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


def _yarn_inv_freq(inv_freq: np.ndarray, scaling: dict, dim: int, theta: float, max_positions: int) -> np.ndarray:
    factor = scaling.get("factor")
    old_len = float(scaling["original_max_position_embeddings"])
    factor = float(max_positions / old_len if factor is None else factor)
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations):  # the dimension that turns `rotations` times over the original length
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # as the reference: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolate = (1 - ramp).astype(np.float32)
    interpolated = (np.float32(1.0) / (np.float32(factor) / inv_freq)).astype(np.float32)
    return (interpolated * (1 - extrapolate) + inv_freq * extrapolate).astype(np.float32)


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor on RoPE's cos and sin (YaRN's attention temperature; 1 otherwise): `attention_factor` when the
    scaling names it, else 0.1 ln(factor) + 1 (mscale / mscale_all_dim: their ratio of that form), 1 at factor <= 1."""
    scaling = config.rope_scaling_dict()
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling.get("factor")
    factor = float(config.max_position_embeddings / scaling["original_max_position_embeddings"]
                   if factor is None else factor)

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]))
    return mscale(factor)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray | jax.Array, scale: float = 1.0) -> jax.Array:
    """Rotate x [B, T, heads, d] by angle positions * inv_freq, rotate-half layout as in HF:
    x * cos + concat(-x2, x1) * sin, where x1, x2 are the two halves of the head dimension; cos and sin times
    `scale` (YaRN's `rope_attention_factor`)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, d/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float | None = None,
              softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention softmax(cap(scale q k^T) + mask) v (Ainslie et al. 2023).

    q [B, T, H, d]; k, v [B, S, KV, d] with H a multiple of KV; query head h reads KV head
    h // (H / KV), as transformers' repeat_kv. mask [B, T, S] bool (True = may attend).
    scale defaults to 1/sqrt(d); cap(s) = softcap tanh(s / softcap) with `softcap` set (Gemma 2), else s.
    `sinks` [H] (gpt-oss's attention sinks; Xiao et al. 2024): head h's softmax gains one more logit, sinks[h],
    in its denominator only: p_j = e^{s_j} / (sum_j' e^{s_j'} + e^{sinks[h]}). A query that keeps no key then
    gets 0. Scores and softmax run in float32. Returns [B, T, H * d].
    """
    batch, length, num_heads, head_dim = q.shape
    num_kv, keys = k.shape[2], k.shape[1]
    group = num_heads // num_kv
    scale = head_dim ** -0.5 if scale is None else scale
    # Heads first, a KV head's query group and positions merged into one axis: both products become
    # plain batched matmuls [B*KV] x [G*T, d] x [d, S] (faster on CPU than a 5-D dot_general), and the
    # scale goes on q, which is d/S times smaller than the scores.
    q = (q * jnp.asarray(scale, q.dtype)).reshape(batch, length, num_kv, group, head_dim)
    q = q.transpose(0, 2, 3, 1, 4).reshape(batch, num_kv, group * length, head_dim)
    scores = jnp.einsum("bkqd,bksd->bkqs", q, k.transpose(0, 2, 1, 3), preferred_element_type=jnp.float32)
    scores = soft_cap(scores.reshape(batch, num_kv, group, length, keys), softcap)
    # A finite floor keeps fully-masked rows (padding queries) NaN-free.
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = sink_softmax(scores, sinks, num_kv).astype(v.dtype).reshape(batch, num_kv, group * length, keys)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, v.transpose(0, 2, 1, 3)).reshape(batch, num_kv, group, length,
                                                                                 head_dim)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, num_heads * head_dim)


def sink_softmax(scores: jax.Array, sinks: jax.Array | None, num_kv: int) -> jax.Array:
    """softmax over the last axis of scores [B, KV, G, T, S], with head (k, g)'s sink logit sinks[k G + g] in the
    denominator when `sinks` [H] is given (`attention`), float32."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    sink = sinks.astype(jnp.float32).reshape(1, num_kv, -1, 1, 1)
    top = jax.lax.stop_gradient(jnp.maximum(scores.max(axis=-1, keepdims=True), sink))
    weights = jnp.exp(scores - top)
    return weights / (weights.sum(axis=-1, keepdims=True) + jnp.exp(sink - top))


def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """jnp.einsum(spec, a, b) with float32 results whatever the operands' dtype (bf16 products summed in f32).

    XLA's CPU runtime has no bf16 x bf16 -> f32 product where it fuses the product with its operands'
    transposes or its consumers ("Unsupported element type for DotThunk::Execute"), which a bf16 train
    step on a CPU hits; there the operands are cast to f32 first, which gives the same products and sums.
    Every other platform gets the mixed-precision product itself (only the taken branch is compiled)."""
    def mixed(a, b):
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)

    if a.dtype == jnp.float32 and b.dtype == jnp.float32:
        return mixed(a, b)
    return jax.lax.platform_dependent(
        a, b, cpu=lambda a, b: jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32)), default=mixed)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's logit soft-capping), or x itself when cap is None."""
    if cap is None:
        return x
    return jnp.tanh(x / cap) * cap


def attention_keep_mask(q_positions: jax.Array, k_positions: jax.Array, *, q_segments: jax.Array | None = None,
                        k_segments: jax.Array | None = None, key_mask: jax.Array | None = None,
                        window: jax.Array | int | None = None) -> jax.Array:
    """Which keys each query may attend to, [B, Tq, Tk] bool: key j is visible to query i iff
    k_positions[j] <= q_positions[i] (causal by position), key_mask[j] != 0 (when given), with
    segments, k_segments[j] is q_segments[i] or 0 (packed rows: segment 0 is a shared prefix) and, with
    a `window` w, q_positions[i] - k_positions[j] < w (sliding-window attention)."""
    keep = k_positions[:, None, :] <= q_positions[:, :, None]
    if window is not None:
        keep = keep & (q_positions[:, :, None] - k_positions[:, None, :] < window)
    if key_mask is not None:
        keep = keep & (key_mask[:, None, :] != 0)
    if q_segments is not None:
        same = k_segments[:, None, :] == q_segments[:, :, None]
        keep = keep & (same | (k_segments[:, None, :] == 0))
    return keep


def _blocks(x: jax.Array, num_blocks: int) -> jax.Array:
    """[B, T, ...] -> [num_blocks, B, T / num_blocks, ...] (block axis first, for lax.scan)."""
    return jnp.moveaxis(x.reshape(x.shape[0], num_blocks, x.shape[1] // num_blocks, *x.shape[2:]), 1, 0)


def _pad_time(x: jax.Array, length: int) -> jax.Array:
    return jnp.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


TILE_SCOPE = "attention_tile"  # the name scope of `blocked_attention`'s conditional per tile


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, block_size: int, *,
                      segment_ids: jax.Array | None = None, key_mask: jax.Array | None = None,
                      window: jax.Array | int | None = None, scale: float | None = None,
                      softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Self-attention equal to `attention(q, k, v, attention_keep_mask(positions, positions, ...), scale=...,
    softcap=..., sinks=...)`
    without materialising the [B, H, T, T] scores: FlashAttention's online softmax (Dao et al. 2022;
    Milakov & Gimelshein 2018) over tiles of `block_size` queries x `block_size` keys.

    Per query block, for key blocks j = 1..n with tile scores s_j (masked entries = the same finite
    floor as `attention`): m_j = max(m_{j-1}, max s_j), l_j = l_{j-1} e^(m_{j-1} - m_j) + sum e^(s_j - m_j),
    acc_j = acc_{j-1} e^(m_{j-1} - m_j) + e^(s_j - m_j) v_j; out = acc_n / l_n. The result does not
    depend on m, so m is held constant under differentiation. Attention sinks start the sums at the sink:
    m_0 = sink, l_0 = e^(sink - m_0) = 1, acc_0 = 0. Both the query-block and the key-tile
    computations are rematerialised (jax.checkpoint), so the backward pass keeps one query block's
    running sums per key block and one tile of scores at a time.

    q [B, T, H, d]; k, v [B, T, KV, d]; positions, segment_ids, key_mask [B, T]. T need not be a
    multiple of the block: queries and keys are padded and padded keys get weight exactly 0.
    Returns [B, T, H * d] in v's dtype.
    """
    batch, length, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    group = num_heads // num_kv
    block = min(block_size, length)
    num_blocks = -(-length // block)
    padded = num_blocks * block
    real_key = jnp.arange(padded) < length  # padded keys are excluded outright (-inf), not floored
    q = q * jnp.asarray(head_dim ** -0.5 if scale is None else scale, q.dtype)
    q, k, v, positions = (_pad_time(x, padded) for x in (q, k, v, positions))
    segments = None if segment_ids is None else _pad_time(segment_ids, padded)
    valid = None if key_mask is None else _pad_time(key_mask, padded)
    # Tiles in the layout of `attention`: a KV head's query group and positions merged into one axis.
    q_blocks = _blocks(q.reshape(batch, padded, num_kv, group, head_dim), num_blocks)  # [n, B, b, KV, G, d]
    q_blocks = q_blocks.transpose(0, 1, 3, 4, 2, 5).reshape(num_blocks, batch, num_kv, group * block, head_dim)
    k_blocks = _blocks(k, num_blocks).transpose(0, 1, 3, 2, 4)  # [n, B, KV, b, d]
    v_blocks = _blocks(v, num_blocks).transpose(0, 1, 3, 2, 4)
    key_inputs = (k_blocks, v_blocks, _blocks(positions, num_blocks), real_key.reshape(num_blocks, block),
                  None if segments is None else _blocks(segments, num_blocks),
                  None if valid is None else _blocks(valid, num_blocks))
    floor = jnp.finfo(jnp.float32).min

    def query_block(query_inputs):
        qb, q_pos, q_seg = query_inputs

        def tile_keep(k_pos, k_seg, k_valid):
            return attention_keep_mask(q_pos, k_pos, q_segments=q_seg, k_segments=k_seg, key_mask=k_valid,
                                       window=window)

        def sees_a_key(seen, key_in):
            _, _, k_pos, k_real, k_seg, k_valid = key_in
            visible = tile_keep(k_pos, k_seg, k_valid) & k_real
            return seen | visible.any(axis=-1), visible.any()

        # seen: which queries of the block see any key; read: whether any query reads each key tile.
        seen, read = jax.lax.scan(sees_a_key, jnp.zeros((batch, block), bool), key_inputs)
        every_tile = ~seen.all()

        def key_tile(carry, key_in):
            key_in, tile_read = key_in
            k_real = key_in[3]
            # A tile no query of the block may read (above the causal diagonal, another packed response,
            # outside the window, padding) is skipped: its weights are exp(floor - m) = 0 for every query
            # that keeps any key, so the sums are unchanged. A block holding a query that keeps no key at
            # all computes every real tile, so that query averages the real keys as `attention` does.
            needed = tile_read | (every_tile & k_real.any())
            with jax.named_scope(TILE_SCOPE):  # names the conditional in the compiled program (hlo_stats)
                return jax.lax.cond(needed, tile, lambda *_: carry, carry, key_in), None

        def tile(carry, key_in):
            m_prev, denom_prev, acc_prev = carry
            kb, vb, k_pos, k_real, k_seg, k_valid = key_in
            keep = tile_keep(k_pos, k_seg, k_valid)
            scores = jnp.einsum("bkqd,bksd->bkqs", qb, kb, preferred_element_type=jnp.float32)
            scores = soft_cap(scores.reshape(batch, num_kv, group, block, block), softcap)
            scores = jnp.where(keep[:, None, None], scores, floor)
            scores = jnp.where(k_real, scores, -jnp.inf).reshape(batch, num_kv, group * block, block)
            m = jax.lax.stop_gradient(jnp.maximum(m_prev, scores.max(axis=-1)))
            rescale = jnp.exp(m_prev - m)
            probs = jnp.exp(scores - m[..., None])
            denom = denom_prev * rescale + probs.sum(axis=-1)
            acc = acc_prev * rescale[..., None] + jnp.einsum(
                "bkqs,bksd->bkqd", probs.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
            return m, denom, acc

        rows = (batch, num_kv, group * block)
        init = (jnp.full(rows, floor), jnp.zeros(rows, jnp.float32), jnp.zeros((*rows, head_dim), jnp.float32))
        if sinks is not None:  # heads in the tiles' layout: [KV, G] repeated over the block's queries
            sink = jnp.broadcast_to(jnp.repeat(sinks.astype(jnp.float32).reshape(num_kv, group), block, axis=1),
                                    rows)
            init = (jax.lax.stop_gradient(sink), jnp.exp(sink - jax.lax.stop_gradient(sink)), init[2])
        (_, denom, acc), _ = jax.lax.scan(jax.checkpoint(key_tile, prevent_cse=False), init, (key_inputs, read))
        return (acc / denom[..., None]).astype(v.dtype)

    q_side = (q_blocks, _blocks(positions, num_blocks), None if segments is None else _blocks(segments, num_blocks))
    out = jax.lax.map(jax.checkpoint(query_block, prevent_cse=False), q_side)  # [n, B, KV, G*b, d]
    out = out.reshape(num_blocks, batch, num_kv, group, block, head_dim).transpose(1, 0, 4, 2, 3, 5)
    return out.reshape(batch, padded, num_heads * head_dim)[:, :length]


@jax.custom_vjp
def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w for x [..., K] and a matrix w [K, N], whose gradients are the textbook products
    dx = dy w^T and dw = x^T dy, the latter one dot_general that contracts x's and dy's leading axes.

    Differentiating `x @ w` directly gives the same values, but JAX writes dw as a product followed by a
    transpose; XLA:CPU then folds the transpose into one operand and fuses the elementwise backward
    of the layer (SiLU, RMSNorm) into that transposing copy, which it runs ~30x slower than the same
    elementwise work in place (the MLP weight gradients were a quarter of the train step on CPU).
    Contracting the leading axes directly lets the GEMM read both operands as stored.
    """
    return x @ w


def _dense_fwd(x, w):
    return x @ w, (x, w)


def _dense_bwd(residuals, dy):
    x, w = residuals
    lead = tuple(range(x.ndim - 1))
    # The weight gradient is rounded once, to w's dtype, from the product's f32 sums.
    if x.shape[-1] > dy.shape[-1]:
        dw = jax.lax.dot_general(dy, x, ((lead, lead), ((), ())), preferred_element_type=w.dtype).T
    else:
        dw = jax.lax.dot_general(x, dy, ((lead, lead), ((), ())), preferred_element_type=w.dtype)
    dx = jax.lax.dot_general(dy, w, (((dy.ndim - 1,), (1,)), ((), ())))
    return dx.astype(x.dtype), dw.astype(w.dtype)


dense.defvjp(_dense_fwd, _dense_bwd)


def adapted_dense(x: jax.Array, w: jax.Array, adapter: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """x W, plus the low-rank term (x A) B of a LoRA adapter (A, B) when one is given (Hu et al. 2021,
    y = x W + s (x A) B; the scale s = alpha / r is already folded into B, see `models.lora.attach`).
    Every operand is computed in x's dtype; without an adapter this is exactly `dense(x, w)`."""
    dtype = x.dtype
    y = dense(x, w.astype(dtype))
    if adapter is None:
        return y
    a, b = adapter
    return y + dense(dense(x, a.astype(dtype)), b.astype(dtype))


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def gated_mlp(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, adapters=None,
              activation: str = "silu") -> jax.Array:
    """Gated feed-forward (Shazeer 2020): (act(x W_gate) * (x W_up)) W_down, act = silu (SwiGLU) or
    "gelu_tanh", GELU's tanh approximation (GeGLU, Gemma). `adapters` maps "gate", "up", "down" to a
    LoRA pair (A, B) for the projections that carry one (see `adapted_dense`)."""
    adapters = adapters or {}
    gate_out = checkpoint_name(adapted_dense(x, gate, adapters.get("gate")), "mlp_gate")
    hidden = _ACTIVATIONS[activation](gate_out) * checkpoint_name(adapted_dense(x, up, adapters.get("up")), "mlp_up")
    return checkpoint_name(adapted_dense(hidden, down, adapters.get("down")), "mlp_down")
