"""The mixture-of-experts feed-forward block: dropless top-k routing, experts as grouped matmuls.

A sparse layer's block (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; Qwen3-MoE) sends each token to its k
best experts by router logit and sums their SwiGLU outputs weighted by the routing weights:

    l = h W_router (+ b_router)                          [N, E], float32
    chosen = top_k(l)                                    the k experts of each token
    w = softmax(l[chosen])  (renormalised, Mixtral; Qwen3-MoE with norm_topk_prob)
      = softmax(l)[chosen]  (Qwen3-MoE without norm_topk_prob)
    y = sum_j w_j SwiGLU_{chosen_j}(h)

Every token is computed by every expert it chose: no capacity factor and no dropped token, so a token's output
depends on that token alone, never on the batch it rides in, and the sampler and the trainer compute one function
of it. The experts run over the N k (token, expert) pairs sorted by expert, as grouped matmuls whose groups are the
experts' contiguous runs (`expert_mlp`); `moe_block` is the layer's block on a layer's parameter dict, the one
function `models.model` calls for the trainer's passes and the sampler's prefill and decode steps alike.

How the grouped matmuls run (`ModelConfig.moe_impl`, `resolve`):
  ragged_dot  `jax.lax.ragged_dot`, three calls (gate, up, down). TPU lowers it to its own grouped matmul. XLA's CPU
              lowering (and GPU's default rewrite, in jax 0.10) expands it to a masked dense product over every
              group: E times the grouped FLOPs and an [E, N k, D] operand.
  tiles       each expert's run padded to a multiple of a tile of rows, and a `lax.scan` over the tiles, each
              tile one expert's [tile, D] rows through its three matrices (a conditional skips the tiles past the
              last used one): the grouped FLOPs plus the padding, one expert's weights read per tile.
  auto        (default) ragged_dot where the program is lowered for a TPU or a GPU, tiles on a CPU.
`expert_mlp_dense`, every token through every expert, is the test reference only.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.expert_parallel import expert_parallel_mlp, expert_shards
from jaxrl_llm.models.layers import einsum_f32
from jaxrl_llm.models.quant import EXPERT_MATRICES, layer_weight

# Parameters of a sparse layer (without the stacked layer axis): router [D, E] (+ router_bias [E]), the experts'
# expert_gate / expert_up [E, D, F] and expert_down [E, F, D] (+ biases [E, F], [E, F], [E, D]).
EXPERT_WEIGHTS = EXPERT_MATRICES  # ("expert_gate", "expert_up", "expert_down")
EXPERT_BIASES = ("expert_gate_bias", "expert_up_bias", "expert_down_bias")
# What each `moe_impl` compiles to where the program is lowered (`jax.lax.platform_dependent`).
_CHOICES = {"auto": {"tpu": "ragged_dot", "cuda": "ragged_dot", "cpu": "tiles"}}
MAX_TILE = 128  # rows per tile at most (`tile_rows`)


class Routing(NamedTuple):
    """A token's chosen experts (int32 [N, k], best first), their weights (float32 [N, k]) and the router's
    logits (float32 [N, E])."""

    experts: jax.Array
    weights: jax.Array
    logits: jax.Array


def route(h: jax.Array, router: jax.Array, router_bias: jax.Array | None = None, *, top_k: int,
          normalize: bool, experts: jax.Array | None = None) -> Routing:
    """Top-k routing of tokens h [N, D] by logits l = h W_router (+ b) (products summed in float32): the k largest
    logits' experts, weighted softmax(l[chosen]) when `normalize` (= softmax(l)[chosen] / sum of those, Mixtral,
    Qwen3-MoE's norm_topk_prob), else softmax(l)[chosen] (Qwen3-MoE's default).

    With recorded `experts` [N, k] (routing replay, R3: the experts the sampler chose), a token whose row holds
    them (entries >= 0) is sent to those experts instead of its own top k, weighted by the same rule from this
    pass's logits at them, so the router still gets a gradient; a row of -1 (not recorded) takes its own top k."""
    logits = einsum_f32("nd,de->ne", h, router.astype(h.dtype))
    if router_bias is not None:
        logits = logits + router_bias.astype(jnp.float32)
    top, chosen = jax.lax.top_k(logits, top_k)
    chosen = chosen.astype(jnp.int32)
    if experts is not None:
        recorded = experts[:, :1] >= 0
        chosen = jnp.where(recorded, experts.astype(jnp.int32), chosen)
        top = jnp.where(recorded, jnp.take_along_axis(logits, chosen, axis=-1), top)
    if normalize:
        weights = jax.nn.softmax(top, axis=-1)
    else:
        weights = jnp.exp(top - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
    return Routing(chosen, weights, logits)


def route_shape(config) -> tuple[int, int]:
    """One token's recorded routes: (sparse layers, experts per token); its ids are `route_dtype`'s."""
    return sum(config.sparse_layers()), config.num_experts_per_tok


def routes_before(routes, lengths):
    """Recorded routes [R, T, L_sparse, k] (numpy) with each row's positions from `lengths` [R] on set to -1 (nothing
    recorded): a row's prompt past its length, or its response's last token (lengths - 1), which is never fed."""
    kept = np.arange(routes.shape[1])[None, :] < np.asarray(lengths)[:, None]
    return np.where(kept[..., None, None], routes, -1)


def route_dtype(num_experts: int):
    """The smallest signed integer type that holds expert ids 0..num_experts - 1 and the -1 of a token without a
    record: int8 up to 128 experts, else int16 (int32 past 32,768)."""
    for dtype in (jnp.int8, jnp.int16):
        if num_experts - 1 <= jnp.iinfo(dtype).max:
            return dtype
    return jnp.int32


def swiglu(gate: jax.Array, up: jax.Array, limit: float | None = None, alpha: float = 1.702) -> jax.Array:
    """silu(gate) * up (SwiGLU, Shazeer 2020); with `limit`, gpt-oss's clamped form: gate capped above at limit,
    up clipped to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)."""
    if limit is None:
        return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


class Experts(NamedTuple):
    """One layer's experts: gate, up [E, D, F], down [E, F, D] and optional biases [E, F], [E, F], [E, D];
    `limit` / `alpha` the clamped SwiGLU's (None: plain SwiGLU)."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array
    gate_bias: jax.Array | None = None
    up_bias: jax.Array | None = None
    down_bias: jax.Array | None = None
    limit: float | None = None
    alpha: float = 1.702


def _plus(y: jax.Array, bias: jax.Array | None, expert: jax.Array) -> jax.Array:
    """y [..., M, F] + bias[expert] ([E, F] gathered per row) when there is a bias (a padding row's id E clipped:
    its output is discarded)."""
    return y if bias is None else y + jnp.take(bias, expert, axis=0, mode="clip").astype(y.dtype)


def _ragged_mlp(rows: jax.Array, row_expert: jax.Array, group_sizes: jax.Array, ex: Experts,
                expected_rows: int | None = None) -> jax.Array:
    """The experts' SwiGLU over rows [M, D] sorted by expert (groups of `group_sizes` rows): three ragged_dots.
    Rows past sum(group_sizes) (expert parallelism's padding) are in no group: ragged_dot gives them 0."""
    del expected_rows
    dtype = rows.dtype
    gate = _plus(jax.lax.ragged_dot(rows, ex.gate.astype(dtype), group_sizes), ex.gate_bias, row_expert)
    up = _plus(jax.lax.ragged_dot(rows, ex.up.astype(dtype), group_sizes), ex.up_bias, row_expert)
    hidden = swiglu(gate, up, ex.limit, ex.alpha).astype(dtype)
    return _plus(jax.lax.ragged_dot(hidden, ex.down.astype(dtype), group_sizes), ex.down_bias, row_expert)


def tile_rows(rows: int, experts: int) -> int:
    """Rows per tile of the tiled grouped matmul: the power of two at or above the mean rows per expert, in
    [8, MAX_TILE] (a tile about one expert's share keeps the padding near half a tile per expert)."""
    mean = -(-rows // experts)
    return int(min(MAX_TILE, max(8, 1 << (mean - 1).bit_length())))


def _tiled_mlp(rows: jax.Array, row_expert: jax.Array, group_sizes: jax.Array, ex: Experts,
               expected_rows: int | None = None) -> jax.Array:
    """`_ragged_mlp` as a scan over tiles: expert e's n_e rows go to ceil(n_e / t) tiles of t rows (zeros after
    them), tile i runs through its expert's matrices, and each row's output is read back from its place. At most
    ceil(M / t) + min(E, M) tiles; those past the last used one are skipped. Rows past sum(group_sizes) (expert
    parallelism's padding, id E) get places past the tiles: never computed, read back as 0. The tile is sized for
    `expected_rows` (default M) rows."""
    count, width = rows.shape
    num_experts = ex.gate.shape[0]
    tile = tile_rows(expected_rows or count, num_experts)
    num_tiles = -(-count // tile) + min(num_experts, count)
    tiles_per_group = -(-group_sizes // tile)
    tile_end = jnp.cumsum(tiles_per_group)
    row_start = jnp.cumsum(group_sizes) - group_sizes
    index = jnp.arange(count, dtype=jnp.int32)
    expert = jnp.minimum(row_expert, num_experts - 1)
    place = (tile_end - tiles_per_group)[expert] * tile + index - row_start[expert]
    place = jnp.where(row_expert < num_experts, place, num_tiles * tile + index)  # distinct, out of range
    padded = jnp.zeros((num_tiles * tile, width), rows.dtype).at[place].set(rows, mode="drop", unique_indices=True)
    tile_expert = jnp.searchsorted(tile_end, jnp.arange(num_tiles, dtype=jnp.int32), side="right")
    dtype = rows.dtype

    def run(x, e):
        def bias(b):
            return 0 if b is None else b[e].astype(dtype)
        gate = x @ ex.gate[e].astype(dtype) + bias(ex.gate_bias)
        up = x @ ex.up[e].astype(dtype) + bias(ex.up_bias)
        return swiglu(gate, up, ex.limit, ex.alpha).astype(dtype) @ ex.down[e].astype(dtype) + bias(ex.down_bias)

    def one_tile(_, tile_in):
        x, e = tile_in
        used = e < num_experts
        out = jax.lax.cond(used, run, lambda x, e: jnp.zeros_like(x), x, jnp.minimum(e, num_experts - 1))
        return None, out

    _, out = jax.lax.scan(one_tile, None, (padded.reshape(num_tiles, tile, width), tile_expert))
    return jnp.take(out.reshape(num_tiles * tile, width), place, axis=0, mode="fill", fill_value=0)


_IMPLS = {"ragged_dot": _ragged_mlp, "tiles": _tiled_mlp}


def resolve(impl: str, platform: str) -> str:
    """The grouped matmul `impl` ("auto", "ragged_dot", "tiles") means where a program is lowered for `platform`
    ("cpu", "cuda" or "gpu", "tpu")."""
    platform = "cuda" if platform == "gpu" else platform
    return _CHOICES.get(impl, {}).get(platform, impl)


def gpu_caveat(config: ModelConfig, platform: str) -> str | None:
    """What a run of a mixture of experts on `platform` should be told before it starts, or None: on a GPU neither
    grouped matmul is efficient yet (module docstring; docs/launch.md, "The mixtures of experts")."""
    if not config.num_experts or platform not in ("cuda", "gpu"):
        return None
    if resolve(config.moe_impl, "cuda") == "ragged_dot":
        cost = (f"XLA's GPU compiler lowers ragged_dot as a dense product over all {config.num_experts} experts "
                f"({config.num_experts / config.num_experts_per_tok:g}x the grouped FLOPs and an [E, N k, D] operand "
                f"per matmul; Qwen3-30B-A3B's train step needs 415 GiB a GPU on h200-8)")
    else:
        cost = "moe_impl=tiles launches one small kernel per tile of rows (519 million a Qwen3-30B-A3B train step)"
    return (f"mixture of experts on GPU: {cost}; fine for small models, too slow or too large at scale until a GPU "
            f"grouped matmul exists (docs/launch.md, \"The mixtures of experts\")")


def grouped_mlp(rows: jax.Array, row_expert: jax.Array, group_sizes: jax.Array, experts: Experts,
                expected_rows: int | None = None, *, impl: str = "auto") -> jax.Array:
    """The experts' SwiGLU over rows [M, D] sorted by expert (`row_expert`, groups of `group_sizes` rows; rows past
    the groups, id E, come back finite and are to be discarded) by the grouped matmul `impl` (module docstring;
    "auto" decided inside the program for the platform it is lowered for)."""
    def run(kind):
        return lambda rows: _IMPLS[kind](rows, row_expert, group_sizes, experts, expected_rows)

    if impl == "auto":
        return jax.lax.platform_dependent(rows, **{p: run(resolve(impl, p)) for p in ("tpu", "cuda")},
                                          default=run(resolve(impl, "cpu")))
    if impl in _IMPLS:
        return run(impl)(rows)
    raise ValueError(f"unknown moe_impl {impl!r}; expected one of auto, {', '.join(_IMPLS)}")


def expert_mlp(h: jax.Array, routing: Routing, experts: Experts, *, impl: str = "auto") -> jax.Array:
    """sum_j w_j SwiGLU_{e_j}(h) for tokens h [N, D] routed by `routing` (experts e, weights w [N, k]): the N k
    (token, expert) pairs sorted by expert (stable: a token's pairs keep their order within an expert), the
    experts' grouped matmuls over them (`grouped_mlp` with `impl`), and each token's k outputs summed in float32
    in the order of its choices. Returns [N, D] in h's dtype.

    Traced under a mesh whose `expert` axis has more than one device (the train step's), the experts run split
    over that axis with the pairs exchanged by all-to-all (`models.expert_parallel`): the same values."""
    if impl != "auto" and impl not in _IMPLS:
        raise ValueError(f"unknown moe_impl {impl!r}; expected one of auto, {', '.join(_IMPLS)}")
    if expert_shards() > 1:
        return expert_parallel_mlp(h, routing, experts, functools.partial(grouped_mlp, impl=impl))
    num_tokens, top_k = routing.experts.shape
    num_experts = experts.gate.shape[0]
    flat = routing.experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    row_expert = flat[order]
    rows = jnp.take(h, order // top_k, axis=0)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    out = grouped_mlp(rows, row_expert, group_sizes, experts, impl=impl)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    per_choice = jnp.take(out, inverse, axis=0).reshape(num_tokens, top_k, -1).astype(jnp.float32)
    return jnp.einsum("nk,nkd->nd", routing.weights, per_choice).astype(h.dtype)


def expert_mlp_dense(h: jax.Array, routing: Routing, experts: Experts) -> jax.Array:
    """`expert_mlp` computed densely: every token through every expert (einsums over [E, N, F]), outputs weighted
    by w at the chosen experts and 0 elsewhere. E / k times the work: a test and benchmark reference only."""
    num_tokens = h.shape[0]
    num_experts = experts.gate.shape[0]
    dtype = h.dtype

    def bias(b):
        return 0 if b is None else b[:, None, :].astype(dtype)

    gate = jnp.einsum("nd,edf->enf", h, experts.gate.astype(dtype)) + bias(experts.gate_bias)
    up = jnp.einsum("nd,edf->enf", h, experts.up.astype(dtype)) + bias(experts.up_bias)
    hidden = swiglu(gate, up, experts.limit, experts.alpha).astype(dtype)
    out = jnp.einsum("enf,efd->end", hidden, experts.down.astype(dtype)) + bias(experts.down_bias)
    combine = jnp.zeros((num_tokens, num_experts), jnp.float32).at[
        jnp.arange(num_tokens)[:, None], routing.experts].add(routing.weights)
    return jnp.einsum("ne,end->nd", combine, out.astype(jnp.float32)).astype(dtype)


def adapted_weight(lp: dict, name: str, dtype) -> jax.Array:
    """Expert matrix `name` [E, in, out] of one layer's dict in `dtype` (a quantized one dequantized), plus its LoRA
    adapters when the dict holds them (`models.lora.attach`: A [E, in, r], B [E, r, out] with the scale s folded
    into B): W_e + A_e B_e, the product in float32 and the sum rounded once to `dtype`."""
    weight = layer_weight(lp, name, dtype)
    if f"{name}_lora_a" not in lp:
        return weight
    delta = einsum_f32("eir,ero->eio", lp[f"{name}_lora_a"], lp[f"{name}_lora_b"])
    return (weight.astype(jnp.float32) + delta).astype(dtype)


def layer_experts(lp: dict, config: ModelConfig, dtype) -> Experts:
    """The experts of one sparse layer's parameter dict, weights in `dtype` (a quantized one dequantized, LoRA
    adapters added: `adapted_weight`)."""
    weights = (adapted_weight(lp, name, dtype) for name in EXPERT_WEIGHTS)
    biases = (lp.get(name) for name in EXPERT_BIASES)
    return Experts(*weights, *biases, limit=config.swiglu_limit, alpha=config.swiglu_alpha)


class LayerRoutes(NamedTuple):
    """What a sparse layer's routing did, for routing replay and its metrics (`moe_block(with_routes=True)`):
    own [..., k] this pass's own top-k experts, best first, and chosen [..., k] the experts the tokens went to
    (the recorded ones where replayed, else own), both in `route_dtype`; load [E] f32 the token-weighted count of
    (token, expert) assignments per expert, sum_n w_n [e in chosen_n]; prob_sum [E] f32 the token-weighted sum of
    the router's probabilities, sum_n w_n softmax(l_n) (differentiable: the load-balancing loss's P_e)."""

    own: jax.Array
    chosen: jax.Array
    load: jax.Array
    prob_sum: jax.Array


def moe_block(lp: dict, config: ModelConfig, h: jax.Array, replay: jax.Array | None = None, *,
              token_weight: jax.Array | None = None, with_routes: bool = False):
    """A sparse layer's feed-forward block on h [..., D] (the post-attention norm's output), with the layer's
    "router" (and "router_bias") and experts: `route` then `expert_mlp` (`config.moe_impl`) over the flattened
    tokens. Returns [..., D] in h's dtype.

    `replay` [..., k] (routing replay): recorded experts per token, -1 where none (`route`'s `experts`). With
    `with_routes` it returns (out, `LayerRoutes`), the load and probability sums weighted by `token_weight` [...]
    (default 1 per token)."""
    tokens = h.reshape(-1, h.shape[-1])
    top_k = config.num_experts_per_tok
    recorded = None if replay is None else replay.reshape(-1, top_k)
    routing = route(tokens, lp["router"], lp.get("router_bias"), top_k=top_k, normalize=config.norm_topk_prob,
                    experts=recorded)
    out = expert_mlp(tokens, routing, layer_experts(lp, config, h.dtype), impl=config.moe_impl).reshape(h.shape)
    if not with_routes:
        return out
    return out, layer_routes(routing, config, h.shape[:-1], token_weight)


def layer_routes(routing: Routing, config: ModelConfig, shape: tuple[int, ...],
                 token_weight: jax.Array | None = None) -> LayerRoutes:
    """`LayerRoutes` of one layer's `routing` over tokens of `shape` (see there)."""
    num_experts, top_k = config.num_experts, config.num_experts_per_tok
    dtype = route_dtype(num_experts)
    weight = jnp.ones(routing.experts.shape[:1], jnp.float32) if token_weight is None else (
        token_weight.reshape(-1).astype(jnp.float32))
    own = jax.lax.top_k(jax.lax.stop_gradient(routing.logits), top_k)[1]
    load = jnp.zeros((num_experts,), jnp.float32).at[routing.experts].add(
        jnp.broadcast_to(weight[:, None], routing.experts.shape))
    prob_sum = jnp.einsum("n,ne->e", weight, jax.nn.softmax(routing.logits, axis=-1))
    return LayerRoutes(own.astype(dtype).reshape(*shape, top_k), routing.experts.astype(dtype).reshape(*shape, top_k),
                       load, prob_sum)


def empty_routes(config: ModelConfig, shape: tuple[int, ...]) -> LayerRoutes:
    """A dense layer's `LayerRoutes` in a model that mixes dense and sparse layers: -1 experts, zero sums."""
    dtype = route_dtype(config.num_experts)
    experts = jnp.full((*shape, config.num_experts_per_tok), -1, dtype)
    zeros = jnp.zeros((config.num_experts,), jnp.float32)
    return LayerRoutes(experts, experts, zeros, zeros)
