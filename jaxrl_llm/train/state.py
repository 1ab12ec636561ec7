"""Train state and optimizer: AdamW with linear warmup, decoupled weight decay and global-norm clipping."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm.train.config import OptimSection


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
