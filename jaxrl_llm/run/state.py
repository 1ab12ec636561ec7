"""Train state and optimizer: AdamW with linear warmup, decoupled weight decay and global-norm clipping."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_llm.run.config import OptimSection


class TrainState(NamedTuple):
    params: Any
    opt_state: Any
    step: jax.Array  # optimizer updates applied so far (int32 scalar)


def make_optimizer(cfg: OptimSection) -> optax.GradientTransformation:
    """clip_by_global_norm(grad_clip) -> AdamW(lr with linear warmup from 0 over warmup_steps, then constant).

    Weight decay is skipped for 1-D parameters (norm scales, biases), as is usual for decoders.
    """
    if cfg.warmup_steps > 0:
        schedule = optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps), optax.constant_schedule(cfg.lr)],
            [cfg.warmup_steps])
    else:
        schedule = optax.constant_schedule(cfg.lr)

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: not _is_norm_or_bias(path), params)

    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask),
    )


def _is_norm_or_bias(path) -> bool:
    # Judged by name, not rank: stacked layers give a norm scale the 2-D shape [layers, hidden].
    name = jax.tree_util.keystr(path).lower()
    return "norm" in name or "bias" in name


def learning_rate(cfg: OptimSection, step: int) -> float:
    """The learning rate the schedule applies at optimizer step `step` (for logging)."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    return cfg.lr


def init_state(params, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))


def state_shardings(state: TrainState, optimizer: optax.GradientTransformation, param_sharding) -> TrainState:
    """NamedShardings of `state` (arrays or their shapes) with params placed by `param_sharding` (a
    NamedSharding tree like the params): every copy of the parameter tree inside the optimizer state
    (Adam's first and second moments) is sharded like the parameters, found from the state's structure
    with `optax.tree_utils.tree_map_params`; all other leaves (update counters, the step) are replicated."""
    leaves = jax.tree_util.tree_leaves(param_sharding, is_leaf=lambda x: isinstance(x, NamedSharding))
    if not leaves or not all(isinstance(s, NamedSharding) for s in leaves):
        raise ValueError("param_sharding must be a tree of NamedSharding like the params")
    replicated = NamedSharding(leaves[0].mesh, P())
    opt_sharding = optax.tree_utils.tree_map_params(optimizer, lambda _, sharding: sharding, state.opt_state,
                                                    param_sharding, transform_non_params=lambda _: replicated,
                                                    is_leaf=lambda x: isinstance(x, NamedSharding))
    return TrainState(params=param_sharding, opt_state=opt_sharding, step=replicated)
