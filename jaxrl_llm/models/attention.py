"""How a row attends: the one place that picks the attention kernel (MaxText's attention_op pattern). Every
full-sequence pass of the decoder (`models.hidden_states`) calls `self_attention`, the sampler's prefill calls
`prompt_attention`; the KV-cache decode steps keep their own single-query attention.

The choice is taken inside the traced program from the platform it is lowered for (`lax.platform_dependent`:
every platform's branch is traced, only the target's is compiled), never from `jax.default_backend()`: a program
compiled on a CPU host for a TPU slice or a GPU node is the program that runs there. `resolve` states what each
`ModelConfig.attention_impl` (the run config's `model.attention_impl`) means per platform:

  auto    (default) TPU: Pallas splash attention on regrouped rows (the prefill: XLA); GPU (cuda): cuDNN's fused
          attention (`jax.nn.dot_product_attention(implementation="cudnn")`) on regrouped rows and on the
          prefill's prompts where cuDNN takes the case (bf16/fp16, no soft-cap, its own checks of head dim and
          installation), else XLA attention on the regrouped rows, one dense causal block per row ("xla_rows");
          CPU: the packed rows' XLA attention.
  xla     `layers.attention` on a [B, T, T] keep mask, or `layers.blocked_attention` (online softmax in tiles,
          tiles no query reads skipped) with `attention_block_size`, on every platform. On a GPU the tile loop
          launches many small kernels per tile (13.85 million per paper-shape train step): asked for by name only.
  splash  splash on regrouped rows: compiled for TPU there, run in interpret mode elsewhere (tests on CPU).
  cudnn   cuDNN on regrouped rows and the prefill's prompts on a GPU (the regrouped XLA rows where cuDNN
          refuses); elsewhere the same call with implementation="xla", so the layout is testable on a CPU.

Attention sinks (gpt-oss: a learned logit per head in the softmax's denominator) are exact on the XLA paths
(`layers.attention`, `layers.blocked_attention`, the regrouped XLA rows) and in splash (its `sinks` argument).
`jax.nn.dot_product_attention` takes none: `resolve` refuses "cudnn" for such a model, and "auto" on a GPU takes the
regrouped XLA rows (the prefill XLA attention) instead.

The fused kernels take plain causal rows, not packed ones: a packed row ([prompt | response 1 | ... | response S |
padding], `train.packing`: segment 0 the prompt at the row's start, segment s + 1 response slot s, each response
restarting its positions where the prompt ends) is regrouped into S causal rows [prompt | response s | padding]
of `width` tokens, where a token's index is its position. The regrouping is a gather of q, k and v and a gather
of the outputs back (prompt outputs from the first group); under differentiation their transposes are
scatter-adds, which sum the gradients of the prompt's keys and values over the S groups. The price is the
prompt's self-attention computed S times (about 6% of the attention of a 1024-token prompt with 8 responses of
3072 tokens). Rows without segments (unpacked rows) are one group each. Padding of a regrouped row carries
splash segment 0 (real tokens 1), so no real query reads it and every padding query sees at least itself.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.config import ATTENTION_IMPLS, ModelConfig  # noqa: F401 (re-exported)
from jaxrl_llm.models.layers import attention, attention_keep_mask, blocked_attention
from jaxrl_llm.models.sharding import BATCH_AXES, batch_devices

log = logging.getLogger(__name__)

SPLASH_BLOCK = 128  # splash's tile (q and kv); the TPU lowering needs the row a multiple of 128
_NO_WINDOW = np.iinfo(np.int32).max  # `model.layer_constants`' window of a full-attention layer
_logged: set = set()


class Groups(NamedTuple):
    """Where each token of a regrouped layout comes from. source [B, S, W] int32: the packed index of regrouped
    token (group s, index w); real [B, S, W] bool: whether that token exists (else padding); back_group,
    back_index [B, T]: the (group, index) of each packed token's output; back_real [B, T] bool: the packed
    token is a prompt or response token (its output is read back)."""

    source: jax.Array
    real: jax.Array
    back_group: jax.Array
    back_index: jax.Array
    back_real: jax.Array


def regroup_layout(segment_ids: jax.Array | None, batch: int, length: int, slots: int, width: int,
                   key_mask: jax.Array | None = None) -> Groups:
    """The regrouped layout of `batch` rows of `length` tokens: with `segment_ids` [B, T] (packing's layout, at most
    `slots` responses per row) S = slots groups of `width` tokens; without, each row is one group (width =
    length) whose real tokens are those of `key_mask` (all when None)."""
    if segment_ids is None:  # one group per row, on splash's grid of 128 (its padding is not real)
        width = -(-length // SPLASH_BLOCK) * SPLASH_BLOCK
        index = jnp.arange(width, dtype=jnp.int32)
        if key_mask is None:
            real = jnp.broadcast_to(index[None, :] < length, (batch, width))
            source = jnp.broadcast_to(jnp.minimum(index, length - 1), (batch, 1, width))
            back_index = jnp.broadcast_to(index[:length], (batch, length))
            return Groups(source, real[:, None, :], jnp.zeros((batch, length), jnp.int32), back_index,
                          jnp.ones((batch, length), bool))
        # the real tokens moved to the row's front, in order (left padding, GVM's rows): every kernel then sees a
        # right-padded causal row, which is what cuDNN's sequence lengths describe
        keep = key_mask != 0
        rank = jnp.cumsum(keep, axis=1, dtype=jnp.int32) - 1  # [B, T]: a real token's index in the compacted row
        count = keep.sum(axis=1, dtype=jnp.int32)[:, None]
        order = jnp.argsort(~keep, axis=1, stable=True).astype(jnp.int32)  # the real tokens' indices first
        source = jnp.pad(order, [(0, 0), (0, width - length)])[:, None, :]
        real = (index[None, :] < count)[:, None, :]
        return Groups(source, real, jnp.zeros((batch, length), jnp.int32), jnp.clip(rank, 0, width - 1), keep)
    seg = segment_ids
    counts = jnp.stack([(seg == s).sum(axis=1) for s in range(slots + 1)], axis=1).astype(jnp.int32)  # [B, S+1]
    prompt = counts[:, :1]  # [B, 1]
    starts = prompt + jnp.cumsum(counts[:, 1:], axis=1) - counts[:, 1:]  # [B, S]: first index of each response
    w = jnp.arange(width, dtype=jnp.int32)[None, None, :]
    in_prompt = w < prompt[:, :, None]
    in_response = (w >= prompt[:, :, None]) & (w - prompt[:, :, None] < counts[:, 1:, None])
    source = jnp.where(in_prompt, w, starts[:, :, None] + w - prompt[:, :, None])
    source = jnp.clip(jnp.where(in_prompt | in_response, source, 0), 0, length - 1)
    t = jnp.arange(length, dtype=jnp.int32)[None, :]
    group = jnp.clip(seg - 1, 0, slots - 1)  # the prompt (segment 0) reads its outputs from group 0
    start = jnp.take_along_axis(starts, group, axis=1)
    index = jnp.where(seg == 0, t, prompt + t - start)
    back_real = seg <= slots
    return Groups(source, in_prompt | in_response, group, jnp.clip(jnp.where(back_real, index, 0), 0, width - 1),
                  back_real)


def _gather(x: jax.Array, groups: Groups) -> jax.Array:
    """[B, T, N, d] -> [B * S, W, N, d] regrouped rows."""
    batch, _, heads, dim = x.shape
    _, slots, width = groups.source.shape
    rows = jnp.take_along_axis(x, groups.source.reshape(batch, slots * width)[:, :, None, None], axis=1)
    return rows.reshape(batch * slots, width, heads, dim)


def _scatter_back(out: jax.Array, groups: Groups, batch: int) -> jax.Array:
    """[B * S, W, F] regrouped outputs -> [B, T, F], 0 on packed padding."""
    _, width, features = out.shape
    slots = groups.source.shape[1]
    flat = groups.back_group * width + groups.back_index  # [B, T]
    got = jnp.take_along_axis(out.reshape(batch, slots * width, features), flat[:, :, None], axis=1)
    return jnp.where(groups.back_real[:, :, None], got, 0).astype(out.dtype)


@jax.custom_vjp
def _f32_gradient(x: jax.Array) -> jax.Array:
    """x itself, whose gradient is float32 as x is. The splash kernel's backward returns the sinks' gradient in q's
    dtype whatever theirs, so float32 sinks beside bf16 q made the platforms' branches of the dispatch disagree on
    its dtype, and a bf16 policy with sinks (gpt-oss) failed to lower its train step for a CPU or GPU
    ("'stablehlo.case' op inferred type(s)")."""
    return x


_f32_gradient.defvjp(lambda x: (x, None), lambda _, g: (g.astype(jnp.float32),))


def _splash_rows(q, k, v, real, *, window: int | None, softcap: float | None, interpret: bool, sinks=None):
    """Causal splash attention on rows q [N, W, H, d], k, v [N, W, KV, d] (q already scaled), real [N, W]
    (splash segment 1 = real, 0 = padding), with attention `sinks` [H] when given: [N, W, H * d]."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    rows, width, heads, dim = q.shape
    num_kv = k.shape[2]
    group = heads // num_kv
    shape = (width, width)
    mask = splash.CausalMask(shape) if window is None else splash.LocalMask(shape, (window - 1, 0), offset=0)
    block = min(SPLASH_BLOCK, width)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    # One MQA kernel per KV head, over its query group (GQA): splash takes [heads, T, d] queries, [T, d] keys.
    kernel = splash.make_splash_mqa_single_device(splash.MultiHeadMask([mask] * group), block_sizes=sizes,
                                                  attn_logits_soft_cap=softcap, interpret=interpret)
    ids = real.astype(jnp.int32)
    qh = q.reshape(rows, width, num_kv, group, dim).transpose(0, 2, 3, 1, 4)  # [N, KV, G, W, d]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [N, KV, W, d]

    head_sinks = None if sinks is None else _f32_gradient(sinks.astype(jnp.float32)).reshape(num_kv, group)  # [KV, G]

    def one_row(qr, kr, vr, seg):
        segments = splash.SegmentIds(q=seg, kv=seg)
        if head_sinks is None:
            return jax.vmap(lambda a, b, c: kernel(a, b, c, segment_ids=segments))(qr, kr, vr)
        return jax.vmap(lambda a, b, c, s: kernel(a, b, c, segment_ids=segments, sinks=s))(qr, kr, vr, head_sinks)

    out = jax.vmap(one_row)(qh, kh, vh, ids)  # [N, KV, G, W, d]
    return out.transpose(0, 3, 1, 2, 4).reshape(rows, width, heads * dim)


def _cudnn_rows(q, k, v, real, *, window: int | None, implementation: str):
    """Causal `jax.nn.dot_product_attention` on right-padded rows (q unscaled: the call applies `scale`)."""
    lengths = real.sum(axis=1).astype(jnp.int32)
    local = None if window is None else (window - 1, 0)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                       key_value_seq_lengths=lengths, local_window_size=local,
                                       implementation=implementation)
    return out.reshape(*q.shape[:2], -1)


def _dense_rows(q, k, v, real, *, window, config: ModelConfig, sinks=None):
    """XLA attention on regrouped rows, one dense causal block per row (`layers.attention`): query i of a row sees
    key j <= i that is real and, with a `window` w (static or traced), i - j < w. q [N, W, H, d], k, v [N, W, KV,
    d] (q unscaled): [N, W, H * d]. The GPU path where cuDNN cannot serve the case: a handful of large kernels
    per layer, against a loop of small ones per tile in `layers.blocked_attention`."""
    index = jnp.arange(q.shape[1], dtype=jnp.int32)
    keep = (index[None, :, None] >= index[None, None, :]) & real[:, None, :]
    if window is not None:
        keep = keep & (index[None, :, None] - index[None, None, :] < window)
    return attention(q, k, v, keep, scale=config.attention_scale, softcap=config.attn_logit_softcapping, sinks=sinks)


def cudnn_refusal(config: ModelConfig, dtype, shape: tuple[int, int, int, int], num_kv: int) -> str | None:
    """Why cuDNN's fused attention cannot take rows of `shape` [N, W, H, d] in `dtype` for this model (None: it
    can): no soft-cap (Gemma 2), bf16/fp16 operands, and whatever `jax.nn.dot_product_attention`'s own checks
    refuse when traced (cuDNN missing, head dim over its limit), asked once per case on abstract shapes."""
    if config.attn_logit_softcapping is not None:
        return "an attention soft-cap"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"{jnp.dtype(dtype).name} operands (cuDNN takes bf16/fp16)"
    return _cudnn_trace_refusal(jnp.dtype(dtype).name, tuple(int(x) for x in shape), int(num_kv),
                                config.sliding_window is not None)


@functools.lru_cache(maxsize=None)
def _cudnn_trace_refusal(dtype: str, shape: tuple, num_kv: int, windowed: bool) -> str | None:
    rows, width, heads, dim = shape
    q = jax.ShapeDtypeStruct(shape, dtype)
    kv = jax.ShapeDtypeStruct((rows, width, num_kv, dim), dtype)
    lengths = jax.ShapeDtypeStruct((rows,), jnp.int32)
    try:
        jax.eval_shape(lambda q, k, v, n: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, query_seq_lengths=n, key_value_seq_lengths=n,
            local_window_size=(1, 0) if windowed else None, implementation="cudnn"), q, kv, kv, lengths)
    except Exception as err:  # noqa: BLE001 (cuDNN's checks raise RuntimeError, NotImplementedError, ValueError)
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    return None


def _kernel_rows(impl: str, q, k, v, real, config: ModelConfig, window, platform: str, sinks=None):
    """Kernel `impl` on regrouped rows; `platform` the one the program is lowered for; `window` static or None
    (the dense rows also take a traced one); `sinks` [H] a layer's attention sinks."""
    scale = config.attention_scale
    if impl == "xla_rows":
        return _dense_rows(q, k, v, real, window=window, config=config, sinks=sinks)
    if impl == "splash":
        q = q * jnp.asarray(scale, q.dtype)
        return _splash_rows(q, k, v, real, window=window, softcap=config.attn_logit_softcapping,
                            interpret=platform != "tpu", sinks=sinks)
    if impl == "cudnn":
        if config.attn_logit_softcapping is not None:
            raise ValueError("attention_impl='cudnn' takes no attention soft-cap (Gemma 2): use 'xla' or 'auto'")
        if sinks is not None:
            raise ValueError(_SINK_REFUSAL)
        q = q * jnp.asarray(scale * q.shape[-1] ** 0.5, q.dtype)  # the call scales by 1/sqrt(d)
        return _cudnn_rows(q, k, v, real, window=window, implementation="cudnn" if platform == "cuda" else "xla")
    raise ValueError(f"unknown fused attention {impl!r}")


def _fused(impl: str, q, k, v, groups: Groups, config: ModelConfig, window, platform: str, sinks=None):
    """Kernel `impl` over the regrouped rows of q, k, v, back in the packed layout."""
    rows = [_gather(x, groups) for x in (q, k, v)]
    real = groups.real.reshape(-1, groups.real.shape[-1])
    out = _on_rows(impl, *rows, real, config, window, platform, sinks)
    return _scatter_back(out.astype(v.dtype), groups, q.shape[0])


def _on_rows(impl: str, q, k, v, real, config: ModelConfig, window, platform: str, sinks=None):
    """Kernel `impl` on rows q [N, W, H, d], k, v [N, W, KV, d], real [N, W]: [N, W, H * d]; `window` a layer's
    (possibly traced) window or None; `sinks` [H] its attention sinks or None. Under a mesh (`jax.set_mesh`, as the
    train step and the sampler set it) a fused kernel runs per device in a shard_map: a Mosaic kernel or a cuDNN
    call cannot be partitioned by the compiler. Rows split over data x fsdp x expert, heads over tensor when it
    divides the KV heads."""
    def kernel(q, k, v, real, *sink):
        sink = sink[0] if sink else None

        def run(q, k, v, real, window):
            return _kernel_rows(impl, q, k, v, real, config, window, platform, sink)

        if window is None or config.sliding_window is None:
            return run(q, k, v, real, None)
        if isinstance(window, (int, np.integer)):
            return run(q, k, v, real, None if window >= _NO_WINDOW else int(window))
        if impl == "xla_rows":  # a traced window is one more term of the dense mask
            return run(q, k, v, real, window)
        # a scanned layer's window: the kernels' masks are static, so both are compiled and one runs
        return jax.lax.cond(window >= _NO_WINDOW, lambda *a: run(*a, None),
                            lambda *a: run(*a, config.sliding_window), q, k, v, real)

    args = (q, k, v, real) + (() if sinks is None else (sinks,))

    mesh = jax.sharding.get_abstract_mesh()
    if impl != "xla_rows" and not mesh.empty and {"data", "fsdp", "tensor"} <= set(mesh.axis_names):
        from jax.sharding import PartitionSpec as P

        split = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
        row_devices = batch_devices(mesh)
        # nothing to split over one device; naming the axes anyway breaks GVM's per-row vmap, whose
        # spmd_axis_name is these axes ("vmap spmd_axis_name cannot appear in shard_map in_specs": GVM on one chip)
        if row_devices == 1 or q.shape[0] % row_devices:
            split = None
        heads = "tensor" if config.num_kv_heads % mesh.shape["tensor"] == 0 else None
        per_head = P(split, None, heads, None)
        specs = (per_head, per_head, per_head, P(split, None)) + (() if sinks is None else (P(heads),))
        kernel = jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=P(split, None, heads), check_vma=False)
    return kernel(*args)


# What each `model.attention_impl` means where a program is lowered: platform -> (training rows, prompts' prefill).
# The kernels: "xla" the packed rows' XLA attention (`layers.blocked_attention` in tiles with
# `attention_block_size`, else dense over the row), "splash" / "cudnn" the fused kernels on regrouped rows,
# "xla_rows" XLA attention on regrouped rows, one dense causal block per row (GPUs where cuDNN cannot serve).
# On a GPU no choice loops over tiles with a conditional per tile (the 13.85 million small kernels a paper-shape
# train step compiled to with tiles of 512: docs/launch.md, "GPU hosts"), unless "xla" is asked for by name.
_CHOICES = {
    "auto": {"tpu": ("splash", "xla"), "cuda": ("cudnn", "cudnn")},
    "xla": {},
    "splash": {"tpu": ("splash", "xla"), "cpu": ("splash", "xla")},
    "cudnn": {"cuda": ("cudnn", "cudnn"), "cpu": ("cudnn", "xla")},
}
PLATFORMS = ("cpu", "cuda", "tpu")  # the lowering targets the dispatch knows ("gpu" is read as "cuda")
_SINK_REFUSAL = ("attention_impl='cudnn' takes no attention sinks (gpt-oss's learned logit per head in the softmax's "
                 "denominator: jax.nn.dot_product_attention has no such term); use 'auto', 'xla' or 'splash'")


def resolve(config: ModelConfig, platform: str, *, prefill: bool = False) -> str:
    """The kernel `config.attention_impl` means where a program is lowered for `platform` ("cpu", "cuda" or
    "gpu", "tpu"), for training rows or (`prefill`) the sampler's prompts. Before tracing, from the config alone:
    on a GPU cuDNN also needs bf16/fp16 operands, no soft-cap and no attention sinks, else the regrouped XLA rows
    ("xla_rows"; `self_attention` checks the operands once more when traced, with cuDNN's own checks). cuDNN asked
    for by name for a model with attention sinks (gpt-oss) is refused: ValueError."""
    platform = "cuda" if platform == "gpu" else platform
    choices = _CHOICES[config.attention_impl]
    kernel = choices.get(platform, choices.get("cpu", ("xla", "xla")))[1 if prefill else 0]
    if kernel == "cudnn" and config.attention_sinks:
        if config.attention_impl != "auto":
            raise ValueError(_SINK_REFUSAL)
        return "xla" if prefill else "xla_rows"
    if kernel == "cudnn" and platform == "cuda" and config.attention_impl == "auto" and (
            config.attn_logit_softcapping is not None or config.compute_dtype not in ("bfloat16", "float16")):
        return "xla" if prefill else "xla_rows"
    return kernel


def group_width(config: ModelConfig, length: int, response_len: int | None) -> int:
    """Tokens per regrouped row: the row itself when the prompt bound or the response length is unknown, else
    `config.max_prompt_tokens` + `response_len` (packing drops longer prompts), at most the row, on splash's
    grid of 128."""
    width = length
    if config.max_prompt_tokens is not None and response_len is not None:
        width = min(length, config.max_prompt_tokens + response_len)
    return -(-width // SPLASH_BLOCK) * SPLASH_BLOCK


def _checked(kernel: str, platform: str, config: ModelConfig, q, k, chosen: dict, fallback: str = "xla_rows") -> str:
    """`kernel`, or `fallback` where cuDNN refuses these operands on a GPU; records the choice (and why) in
    `chosen`. Never raises: every platform's branch is traced wherever the program is lowered, and only the
    target's is compiled."""
    why = cudnn_refusal(config, q.dtype, q.shape, k.shape[2]) if kernel == "cudnn" and platform == "cuda" else None
    if why is not None:
        kernel = fallback
    chosen[platform] = kernel + ("" if why is None else f" (cuDNN refused: {why})")
    return kernel


def _dispatch(config: ModelConfig, what: str, on) -> jax.Array:
    """`on(platform, chosen)`'s branch for the platform the program is lowered for (`lax.platform_dependent`), and
    one log line per distinct choice naming every platform's kernel."""
    chosen: dict = {}
    out = jax.lax.platform_dependent(tpu=on("tpu", chosen), cuda=on("cuda", chosen), default=on("cpu", chosen))
    line = ", ".join(f"{platform} {chosen[platform]}" for platform in PLATFORMS if platform in chosen)
    key = (config.attention_impl, what, line)
    if key not in _logged:
        _logged.add(key)
        log.info("attention of %s (model.attention_impl=%s), where lowered for: %s", what, config.attention_impl,
                 line)
    return out


def self_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, config: ModelConfig, *,
                   segment_ids: jax.Array | None = None, key_mask: jax.Array | None = None, window=None,
                   keep: jax.Array | None = None, slots: int | None = None, response_len: int | None = None,
                   sinks: jax.Array | None = None):
    """Attention of a full-sequence training pass, [B, T, H * d]: query i sees key j iff positions[j] <=
    positions[i], key_mask[j] != 0, segment j is segment i or 0 (with `segment_ids`) and, with a `window` w,
    positions[i] - positions[j] < w (see `layers.attention_keep_mask`).

    q [B, T, H, d]; k, v [B, T, KV, d]; `keep` the precomputed [B, T, T] mask of the xla path's full attention
    (without the window); `slots` the responses per packed row and `response_len` their token slots, which size
    the regrouped rows (without `slots`, packed rows take the xla path). The regrouped kernels assume packing's
    layout (see the module docstring) and give the same values on every prompt and response token; padding
    tokens' outputs are 0 there. The kernel is `resolve`'s for the platform the program is lowered for, taken by
    `lax.platform_dependent` inside the program (only the target's branch is compiled). `sinks` [H]: the layer's
    attention sinks (gpt-oss), None without.
    """
    length = q.shape[1]
    fusable = segment_ids is None or slots is not None

    def packed():
        return _xla(q, k, v, positions, config, segment_ids, key_mask, window, keep, sinks)

    if config.attention_impl == "xla":
        return packed()
    if segment_ids is None:
        groups = regroup_layout(None, q.shape[0], length, 1, length, key_mask)  # width: length on the grid of 128
    elif fusable:
        groups = regroup_layout(segment_ids, q.shape[0], length, slots, group_width(config, length, response_len))

    def on(platform, chosen):
        def run():
            kernel = resolve(config, platform) if fusable else "xla"
            if kernel == "xla":
                chosen[platform] = "xla" + ("" if fusable else " (packed rows without their slot count)")
                return packed()
            kernel = _checked(kernel, platform, config, q, k, chosen)
            return _fused(kernel, q, k, v, groups, config, window, platform, sinks)
        return run

    return _dispatch(config, "training rows" + (f" (regrouped rows of {groups.source.shape[-1]} tokens)"
                                               if fusable else ""), on)


def prompt_attention(q: jax.Array, k: jax.Array, v: jax.Array, keep: jax.Array, config: ModelConfig, *,
                     window=None, sinks: jax.Array | None = None) -> jax.Array:
    """Causal attention of the sampler's prefill over right-padded prompts q [C, P, H, d], k, v [C, P, KV, d]
    (positions 0..P-1); `keep` the [C, P, P] causal mask with the layer's window in it, for the XLA path. On a GPU
    where `resolve` gives cuDNN, its causal call on the prompt rows (padding keys follow every real query, so
    no lengths are needed); elsewhere `layers.attention` on `keep`. `sinks` [H]: the layer's attention sinks."""
    def on(platform, chosen):
        def run():
            kernel = _checked(resolve(config, platform, prefill=True), platform, config, q, k, chosen, "xla")
            if kernel != "cudnn":
                return attention(q, k, v, keep, scale=config.attention_scale, softcap=config.attn_logit_softcapping,
                                 sinks=sinks)
            real = jnp.ones(q.shape[:2], bool)
            return _on_rows(kernel, q, k, v, real, config, window, platform, sinks).astype(v.dtype)
        return run

    return _dispatch(config, "the prefill's prompts", on)


def _xla(q, k, v, positions, config: ModelConfig, segment_ids, key_mask, window, keep, sinks=None):
    block_size = config.attention_block_for(q.shape[1])
    if block_size is not None:
        return blocked_attention(q, k, v, positions, block_size, segment_ids=segment_ids, key_mask=key_mask,
                                 window=window, scale=config.attention_scale, softcap=config.attn_logit_softcapping,
                                 sinks=sinks)
    if keep is None:
        keep = attention_keep_mask(positions, positions, q_segments=segment_ids, k_segments=segment_ids,
                                   key_mask=key_mask)
    if window is not None:
        keep = keep & (positions[:, :, None] - positions[:, None, :] < window)
    return attention(q, k, v, keep, scale=config.attention_scale, softcap=config.attn_logit_softcapping, sinks=sinks)
