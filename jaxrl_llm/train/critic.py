"""PPO's critic on the device: the value model's parameters, its value pass over packed rollouts and its
jitted update on the clipped value loss.

The value model is `models.flax_modules.ValueModel`: the policy family's decoder trunk (parameters as the
policy's, without lm_head) and a float32 Dense(1) head on the final-norm hidden states. Its parameters are
the plain tree {"trunk": ..., "value_head": {"kernel": [D, 1], "bias": [1]}}, so
`ValueModel(config).apply({"params": params}, tokens, positions)` runs them as they are. The value of
response token r is read at the position that predicts it (the state before the token), like its log-prob.

Loss = value_loss(V, V_old, R, mask, clip=critic.value_clip, agg="token-mean")   (objectives.value_loss)
with the whole mini-batch's token count as denominator, so micro-batches accumulate exactly.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_llm import models, objectives
from jaxrl_llm.models.sharding import param_shardings
from jaxrl_llm.run.config import ConfigError, CriticSection, OptimSection
from jaxrl_llm.run.state import TrainState, init_state, make_optimizer, state_shardings
from jaxrl_llm.train.logprobs import scored_positions, to_slots
from jaxrl_llm.train.packing import TrainBatch
from jaxrl_llm.train.step import (_replicated, apply_if_finite, has_tokens, jit_packed_pass, mesh_context,
                                  micro_shardings, split_micro, summed_grads)

CRITIC_METRIC_SUMS = ("value_loss", "value_clip_fraction", "tokens")


@dataclasses.dataclass
class Critic:
    """The run's value model: its config, train state, jitted update and value pass."""

    model_config: models.ModelConfig
    state: TrainState
    optimizer: Any
    train_step: Any  # (state, batch, denom) -> (state, metrics)
    value_fn: Any  # (params, batch) -> values [G, S, R]
    state_sharding: Any = None


def value_params(trunk_params, model_config, head=None) -> dict:
    """Value-model parameters on `trunk_params` (a policy's tree; its lm_head is dropped), copied so the
    critic's update, which donates its state, leaves the source arrays alive. The head is `head` (a trained
    critic's) or zero: every value is 0 at first, and the first advantages are the returns themselves."""
    trunk = {name: jax.tree_util.tree_map(jnp.copy, value) for name, value in trunk_params.items()
             if name != "lm_head"}
    if head is None:
        head = {"kernel": jnp.zeros((model_config.hidden_size, 1), jnp.float32), "bias": jnp.zeros((1,), jnp.float32)}
    return {"trunk": trunk, "value_head": jax.tree_util.tree_map(lambda x: jnp.array(x, jnp.float32), head)}


def response_values(params, config, batch: TrainBatch, *, compact: bool | None = None) -> jax.Array:
    """The critic's value of each response token's state [G, S, R] float32: one decoder pass over the packed
    rows, the hidden state that predicts token r, then the scalar head. The positions read are the policy's
    (`train.logprobs.scored_positions`: with `compact`, or by default when the row is shorter than its
    S x R slots, only the generated tokens' states, and slots past a response's end get 0)."""
    hidden = models.hidden_states(params["trunk"], config, batch.tokens, batch.positions, segment_ids=batch.segments,
                                  slots=batch.pred_index.shape[1], response_len=batch.pred_index.shape[2])
    pred, _, back = scored_positions(batch, compact)
    hidden = jnp.take_along_axis(hidden, pred[..., None], axis=1)
    head = params["value_head"]
    values = hidden.astype(jnp.float32) @ head["kernel"] + head["bias"]
    return to_slots(values[..., 0], back, batch.pred_index.shape)


def critic_loss_fn(params, model_config, clip: float | None, micro: TrainBatch, denom: jax.Array):
    """Clipped value loss of one micro-batch over the whole mini-batch's `denom` tokens: (loss, metric sums)."""
    flat = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731
    values = flat(response_values(params, model_config, micro))
    mask = flat(micro.mask)
    loss, metrics = objectives.value_loss(values, flat(micro.old_values), flat(micro.returns), mask, clip=clip,
                                          agg="token-mean", denom=denom)
    tokens = mask.sum()
    return loss, {"value_loss": loss, "value_clip_fraction": metrics["value_clip_fraction"] * tokens, "tokens": tokens}


def make_critic_step(model_config, critic: CriticSection, optimizer: optax.GradientTransformation, *,
                     micro_batch_size: int, state_sharding: Any = None, batch_sharding: Any = None):
    """Build the jitted `step(state, batch, denom) -> (state, metrics)`: one update of the critic on a mini-batch
    of packed rows (its `old_values`, `returns` and `mask`), `denom` = the mini-batch's response tokens.

    Scanned in micro-batches of `micro_batch_size` rows with the gradients summed, skipped when the loss or the
    gradient is not finite (metrics["value_finite"] = 0), the state donated; shardings as `make_train_step`'s.
    Metrics: value_loss, value_clip_fraction (tokens where the clipped branch is larger), value_grad_norm,
    value_finite."""
    replicated = _replicated(state_sharding, batch_sharding)
    micro_sharding = micro_shardings(batch_sharding)

    def step(state: TrainState, batch: TrainBatch, denom: jax.Array):
        with mesh_context(replicated):
            return mesh_step(state, batch, denom)

    def mesh_step(state: TrainState, batch: TrainBatch, denom: jax.Array):
        micro = split_micro(batch, micro_batch_size)
        if micro_sharding is not None:
            micro = jax.lax.with_sharding_constraint(micro, micro_sharding)
        grad_fn = jax.value_and_grad(
            lambda params, mb: critic_loss_fn(params, model_config, critic.value_clip, mb, denom), has_aux=True)
        loss, msum, grads = summed_grads(grad_fn, state.params, (micro,), CRITIC_METRIC_SUMS, has_tokens(micro),
                                         None if state_sharding is None else state_sharding.params)
        new_state, grad_norm, finite = apply_if_finite(optimizer, state, grads, loss)
        metrics = {"value_loss": loss,
                   "value_clip_fraction": msum["value_clip_fraction"] / jnp.maximum(msum["tokens"], 1.0),
                   "value_grad_norm": grad_norm, "value_finite": finite.astype(jnp.float32)}
        return new_state, metrics

    if replicated is None:
        return jax.jit(step, donate_argnums=(0,))
    return jax.jit(step, donate_argnums=(0,), in_shardings=(state_sharding, batch_sharding, replicated),
                   out_shardings=(state_sharding, replicated))


def make_value_fn(model_config, *, micro_batch_size: int | None = None, param_sharding: Any = None,
                  batch_sharding: Any = None):
    """Jitted `(params, batch) -> values [G, S, R]` of a packed batch (the critic's values of a rollout), in
    micro-batches of `micro_batch_size` rows (`train.step.jit_packed_pass`); with shardings the values come
    back replicated."""

    return jit_packed_pass(lambda params, batch: response_values(params, model_config, batch),
                           micro_batch_size=micro_batch_size, param_sharding=param_sharding,
                           batch_sharding=batch_sharding)


def critic_optimizer(critic: CriticSection, optim: OptimSection) -> optax.GradientTransformation:
    """The critic's AdamW: `optim`'s betas with the critic's lr, warmup, weight decay and gradient clip."""
    return make_optimizer(dataclasses.replace(optim, lr=critic.lr, warmup_steps=critic.warmup_steps,
                                              weight_decay=critic.weight_decay, grad_clip=critic.grad_clip))


def critic_trunk(critic: CriticSection, policy_config, policy_params, *, param_dtype: str, load=None):
    """(ModelConfig, trunk parameters, head or None) of the critic: the policy's own for source "policy"; a
    trained critic's trunk and head for a folder written at the end of a PPO run (`final_critic/`,
    `models.save_hf_value`); else the model at `critic.source` loaded by `load(source)` -> (ModelConfig,
    params, tokenizer) (`setup.load_policy`), with a new head. It must read the policy's tokens (the same
    vocabulary size)."""
    if critic.source == "policy":
        return policy_config, policy_params, None
    path = pathlib.Path(critic.source).expanduser()
    if critic.source != "bundled" and not (path.is_dir() or path.suffix == ".gguf"):
        raise ConfigError(f"config key 'critic.source'={critic.source!r} is neither 'policy', 'bundled', an HF "
                          f"model folder nor a .gguf file")
    head = None
    if path.is_dir() and models.is_hf_value_model(path):
        config, value = models.load_hf_value(path, dtype=param_dtype)
        params, head = value["trunk"], value["value_head"]
    else:
        config, params, _ = load(critic.source)
    if config.vocab_size != policy_config.vocab_size:
        raise ConfigError(f"config key 'critic.source'={critic.source!r}: its vocabulary has {config.vocab_size} "
                          f"tokens, the policy's {policy_config.vocab_size}; the critic reads the policy's tokens")
    config = config.replace(param_dtype=param_dtype, compute_dtype=policy_config.compute_dtype,
                            remat=policy_config.remat, remat_policy=policy_config.remat_policy,
                            attention_block_size=policy_config.attention_block_size,
                            attention_block_min_length=policy_config.attention_block_min_length)
    return config, params, head


def setup_critic(critic: CriticSection, optim: OptimSection, model_config, trunk_params, *, mesh=None,
                 batch_sharding: Any = None, head=None) -> Critic:
    """The critic of a run: value parameters on `trunk_params` (already placed on `mesh` by the model's
    partition rules; the head, `head` or zero, is replicated), its optimizer state, update and value pass."""
    optimizer = critic_optimizer(critic, optim)
    make_state = lambda trunk: init_state(value_params(trunk, model_config, head), optimizer)  # noqa: E731
    state_sharding = param_sharding = None
    if mesh is None:
        state = make_state(trunk_params)
    else:  # parameters and optimizer state created in place, already sharded (one program)
        replicated = NamedSharding(mesh, P())
        shapes = jax.eval_shape(make_state, trunk_params)
        param_sharding = {"trunk": param_shardings(shapes.params["trunk"], mesh),
                          "value_head": jax.tree_util.tree_map(lambda _: replicated, shapes.params["value_head"])}
        state_sharding = state_shardings(shapes, optimizer, param_sharding)
        state = jax.jit(make_state, out_shardings=state_sharding)(trunk_params)
    return Critic(model_config=model_config, state=state, optimizer=optimizer,
                  train_step=make_critic_step(model_config, critic, optimizer, micro_batch_size=optim.micro_batch_size,
                                              state_sharding=state_sharding, batch_sharding=batch_sharding),
                  value_fn=make_value_fn(model_config, micro_batch_size=optim.micro_batch_size,
                                         param_sharding=param_sharding, batch_sharding=batch_sharding),
                  state_sharding=state_sharding)
