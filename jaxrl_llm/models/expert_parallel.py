"""Expert parallelism for the mixture-of-experts block (`models.moe`): the experts split over the mesh axis
`expert`, the (token, expert) pairs exchanged by all-to-all inside `jax.shard_map`.

With a mesh of `s` = expert-axis devices, expert shard r holds the E / s experts r E / s .. (r + 1) E / s - 1
(`models.sharding`'s rules split the expert weights [L, E, ...] on E). The tokens entering the block are split
over every data-parallel axis (data x fsdp x expert, `sharding.BATCH_AXES`: outside the sparse block `expert` is
one more data axis); each device, with its n tokens routed to k experts each:
  1. sorts its n k pairs by expert, so the pairs bound for shard r are one contiguous run, and writes run r into
     slot r of a send buffer [s, C, D] (rows past the run are padding, marked by local expert id E / s);
  2. all-to-all over `expert`: slot r goes to shard r, which receives [s, C, D], one block per source shard;
  3. runs its E / s local experts over the received rows with the same grouped matmul as the single-device block
     (`moe.expert_mlp`'s impls; the padding rows, sorted after every group, belong to no group and are skipped);
  4. sends each output back by the reverse all-to-all, to the row it came from;
  5. sums each token's k outputs weighted by its routing weights in float32, in the order of its choices.
Each pair is computed by the same expert on the same row as on one device, so the block equals the single-device
block (up to the grouped matmul's row blocking) and so do its gradients.

Dropless and exact: the buffer is sized for the worst case. A token's k experts are distinct (top-k), so at most
min(k, E / s) of its pairs go to one shard, and C = n min(k, E / s) rows per destination never drop a pair
(every local pair may go to one shard). The receive buffer is then s C rows per device, s min(k, E / s) / k times
the n k pairs a balanced routing brings: the price of a static shape. `jax.lax.ragged_all_to_all`, which would
send only the used rows, does not lower on XLA:CPU in jax 0.10 ("HLO opcode ragged-all-to-all is not supported by
XLA:CPU ThunkEmitter"), so the dense `jax.lax.all_to_all` with the worst-case buffer is used on every platform:
one program, tested here on the CPU's fake devices.

The weights enter the shard_map split on E only: each device gathers its local experts' full matrices (as FSDP
gathers a layer's weights before use), and their gradients are reduced over the other axes by shard_map's
transpose. A token count that the data-parallel devices do not divide (a sampler's decode rows) is padded with
zero tokens of weight 0, removed after.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl_llm.models.sharding import BATCH_AXES

AXIS = "expert"
_WEIGHTS = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")


def expert_shards(mesh=None) -> int:
    """Expert-parallel shards of `mesh` (default: the abstract mesh being traced under, `jax.set_mesh` or
    `jax.sharding.use_abstract_mesh` as the train step sets it): the size of its `expert` axis, or 1 without a mesh,
    without the axis, or inside a shard_map that already made the axis manual."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty or AXIS not in mesh.axis_names:
        return 1
    if AXIS in getattr(mesh, "manual_axes", ()):
        return 1
    return int(dict(mesh.shape)[AXIS])


def pairs_per_destination(tokens: int, top_k: int, local_experts: int) -> int:
    """Rows C of each destination's slot of the send buffer: tokens x min(top_k, local experts), the most pairs of
    `tokens` tokens with distinct experts that one shard's `local_experts` experts can receive."""
    return tokens * min(top_k, local_experts)


def expert_parallel_mlp(h: jax.Array, routing, experts, grouped: Callable, mesh=None) -> jax.Array:
    """`moe.expert_mlp` of tokens h [N, D] routed by `routing` (experts [N, k] int, weights [N, k] float32) on
    `experts` (`moe.Experts`, weights [E, ...]) with the experts split over the mesh's `expert` axis (see the module
    docstring). `grouped(rows, row_expert, group_sizes, experts, expected_rows)` is the local grouped matmul over
    rows sorted by expert; rows past sum(group_sizes) must come back finite (their outputs are discarded).
    Returns [N, D] in h's dtype."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    shards = expert_shards(mesh)
    num_tokens, top_k = routing.experts.shape
    num_experts = experts.gate.shape[0]
    if num_experts % shards:
        raise ValueError(f"the mesh's expert axis ({shards}) must divide the model's num_experts ({num_experts})")
    split = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    devices = math.prod(dict(mesh.shape)[a] for a in split)
    pad = -num_tokens % devices
    chosen, gate_weights = routing.experts.astype(jnp.int32), routing.weights.astype(jnp.float32)
    if pad:  # zero tokens of weight 0 routed to experts 0..k-1 (distinct, as top-k's)
        h = jnp.pad(h, ((0, pad), (0, 0)))
        chosen = jnp.concatenate([chosen, jnp.broadcast_to(jnp.arange(top_k, dtype=jnp.int32), (pad, top_k))])
        gate_weights = jnp.pad(gate_weights, ((0, pad), (0, 0)))
    weights = {name: getattr(experts, name) for name in _WEIGHTS if getattr(experts, name) is not None}

    def local(h, chosen, gate_weights, weights):
        local_experts = experts._replace(**{name: weights.get(name) for name in _WEIGHTS})
        return _exchange(h, chosen, gate_weights, local_experts, shards, grouped)

    rows = P(split)
    # check_vma=False: with it, JAX casts the replicated weights (and any traced constant) to device-varying where
    # they meet the rows, inside the tiles' per-tile conditional, and its transpose (a psum) then sits in a branch
    # that devices take differently: they wait on each other for ever (seen on the CPU's fake devices). Unchecked,
    # the cotangents of the unsplit inputs are summed at the shard_map's boundary (gradients equal one device's,
    # tests/test_moe_expert_parallel.py, with tensor = 2 too).
    out = jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, {name: P(AXIS) for name in weights}),
                        out_specs=rows, check_vma=False)(h, chosen, gate_weights, weights)
    return out[:num_tokens]


def _exchange(h, chosen, gate_weights, experts, shards: int, grouped: Callable) -> jax.Array:
    """One device's part of `expert_parallel_mlp`: its tokens h [n, D] with experts `chosen` [n, k] (global ids)
    and weights [n, k], its E / s local `experts`; steps 1-5 of the module docstring. Returns [n, D]."""
    num_tokens, top_k = chosen.shape
    width = h.shape[-1]
    local_experts = experts.gate.shape[0]
    cap = pairs_per_destination(num_tokens, top_k, local_experts)
    # 1. the pairs sorted by expert; a pair's destination shard and its row in that shard's slot
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    pair_expert = flat[order]
    dest = pair_expert // local_experts
    sent = jnp.zeros((shards,), jnp.int32).at[dest].add(1)
    slot = jnp.arange(flat.shape[0], dtype=jnp.int32) - (jnp.cumsum(sent) - sent)[dest]
    send = jnp.zeros((shards, cap, width), h.dtype).at[dest, slot].set(
        jnp.take(h, order // top_k, axis=0), unique_indices=True)
    send_expert = jnp.full((shards, cap), local_experts, jnp.int32).at[dest, slot].set(
        pair_expert - dest * local_experts, unique_indices=True)
    # 2. to the shards that hold the experts: block r of what a shard receives came from shard r
    received = jax.lax.all_to_all(send, AXIS, 0, 0).reshape(shards * cap, width)
    row_expert = jax.lax.all_to_all(send_expert, AXIS, 0, 0).reshape(shards * cap)
    # 3. the local experts over the received rows sorted by local expert, the padding (id E / s) last
    perm = jnp.argsort(row_expert, stable=True)
    group_sizes = jnp.zeros((local_experts,), jnp.int32).at[row_expert].add(1, mode="drop")
    out = grouped(jnp.take(received, perm, axis=0), row_expert[perm], group_sizes, experts, num_tokens * top_k)
    out = jnp.zeros_like(out).at[perm].set(out, unique_indices=True).reshape(shards, cap, width)
    # 4. back to the shards the rows came from; 5. each token's k outputs weighted and summed
    back = jax.lax.all_to_all(out, AXIS, 0, 0)
    per_pair = jnp.zeros((flat.shape[0], width), back.dtype).at[order].set(back[dest, slot], unique_indices=True)
    per_choice = per_pair.reshape(num_tokens, top_k, width).astype(jnp.float32)
    return jnp.einsum("nk,nkd->nd", gate_weights, per_choice).astype(h.dtype)
