"""The jitted policy update: per-token log-probs, policy loss + KL + entropy, micro-batch gradient
accumulation, and one optax update that is skipped when the loss or gradient is not finite.

Loss = policy_loss(logp, old_logp, A, mask, agg)             (objectives.policy_loss)
     + kl_coef * aggregate(kl_penalty(logp, ref_logp), mask, agg)
     - entropy_coef * aggregate(entropy, mask, agg)
Every term of a micro-batch is normalised by the denominator of the whole mini-batch (computed on the
host from the real rows), so summing micro-batch gradients gives exactly the mini-batch gradient.
Clip-Cov and KL-Cov pick their tokens once over the whole mini-batch (`cov_tokens`) before the
micro-batch scan, for the same reason. A micro-batch without a response token (rows that only pad the
row count to its bucket, which `rollouts.build_train_batches` orders into whole micro-batches at the end)
adds nothing to any of these sums, so the scan skips its forward and backward passes (`has_tokens`).
With agg prompt-mean / prompt-mean-unbiased (GVM's M-step) the host scales each sample's advantages so
that this token-mean equals the M-step loss (`rollouts.prompt_mean_advantages`).
"""

from __future__ import annotations

import contextlib

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_llm import objectives
from jaxrl_llm.models import lora
from jaxrl_llm.objectives.aggregate import safe_divide
from jaxrl_llm.run.config import AlgorithmSection
from jaxrl_llm.run.state import TrainState
from jaxrl_llm.train.logprobs import response_logprobs
from jaxrl_llm.train.packing import TrainBatch
from jaxrl_llm.train.routing import load_balancing_loss, load_max_over_mean, routes_changed


def split_micro(batch, micro_batch_size: int):
    """[G, ...] -> [G / micro, micro, ...] for a scan over micro-batches of packed rows.

    Row r goes to micro-batch r % (G / micro): when the rows are split over devices in contiguous
    blocks (the batch sharding), every device keeps its own rows in each micro-batch, so the split
    moves no data. The gradient sum does not depend on which rows share a micro-batch.
    """
    rows = jax.tree_util.tree_leaves(batch)[0].shape[0]
    if rows % micro_batch_size:
        raise ValueError(f"batch of {rows} rows is not a multiple of micro_batch_size={micro_batch_size}")
    return jax.tree_util.tree_map(
        lambda x: jnp.swapaxes(x.reshape(micro_batch_size, rows // micro_batch_size, *x.shape[1:]), 0, 1), batch)


def has_tokens(micro: TrainBatch) -> jax.Array:
    """[micro-batches] bool: which micro-batches of `split_micro`'s output hold a response token. One without
    (the packer's padding rows, `packing.micro_batch_order`) adds nothing to any loss, metric or gradient: every
    term is a sum over the mask."""
    return jnp.any(micro.mask.reshape(micro.mask.shape[0], -1) > 0, axis=1)


def cov_tokens(algo: AlgorithmSection, batch: TrainBatch, rng: jax.Array) -> jax.Array | None:
    """[G, S, R] bool: the tokens clip_cov / kl_cov select over the whole mini-batch (None for other losses).

    Selected from the old log-probs, the policy's own before its first update on this rollout batch (with
    one update per batch they equal the current log-probs that `objectives.cov_selection` centres).
    """
    if algo.loss not in objectives.COV_LOSS_KINDS:
        return None
    flat = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731
    selected = objectives.cov_selection(
        flat(batch.old_logp), flat(batch.old_logp), flat(batch.advantages), flat(batch.mask), kind=algo.loss,
        rng=rng, cov_fraction=algo.cov_fraction, cov_low=algo.cov_low, cov_high=algo.cov_high,
        clip_low=algo.clip_low, clip_high=algo.clip_high)
    return selected.reshape(batch.mask.shape)


def loss_fn(params, model_config, algo: AlgorithmSection, micro: TrainBatch, denom: jax.Array,
            cov_selected: jax.Array | None = None, distill_coef: float = 1.0, routing: dict | None = None):
    """Loss of one micro-batch, normalised by the whole mini-batch's `denom`; returns (loss, metrics).

    A batch with the teacher's top-K fields (`distill.mode` topk) adds distill_coef x the top-K distillation loss
    (`objectives.topk_terms_at_ids`, aggregated like the policy loss over the same `denom`), the student's
    log-probs of the teacher's ids taken from the pass's hidden states (`logprobs.ids_logprobs`).

    A batch with the sampler's routes (a mixture of experts) replays them where `routing` ({"replay",
    "aux_coef", "routed_tokens": the mini-batch's}) says "rollout", adds aux_coef x the load-balancing loss (its
    share of the mini-batch's routed tokens) and the metrics `route_sums`."""
    # Without an entropy bonus the entropy is a metric: its gradient term is skipped.
    topk = micro.teacher_ids is not None
    routed = micro.routes is not None and routing is not None
    logp, entropy, *at_ids = response_logprobs(params, model_config, micro, with_entropy=True,
                                               entropy_grad=algo.entropy_coef != 0,
                                               topk_ids=micro.teacher_ids if topk else None,
                                               **(dict(routing_replay=routing["replay"], with_routes=True)
                                                  if routed else {}))
    routes = at_ids.pop() if routed else None
    # Each response slot of a packed row is one sequence of the loss: [G, S, R] -> [G * S, R].
    flat = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731
    logp, entropy = flat(logp), flat(entropy)
    micro = micro._replace(mask=flat(micro.mask), advantages=flat(micro.advantages), old_logp=flat(micro.old_logp),
                           ref_logp=flat(micro.ref_logp))
    # GVM's M-step modes arrive as token-means: the host folded each sample's weight into its advantages.
    mode = "token-mean" if algo.agg in objectives.PROMPT_MEAN_MODES else algo.agg
    loss, pg_metrics = objectives.policy_loss(
        logp, micro.old_logp, micro.advantages, micro.mask, kind=algo.loss, clip_low=algo.clip_low,
        clip_high=algo.clip_high, dual_clip=algo.dual_clip, agg=mode, max_len=algo.agg_max_len, denom=denom,
        cov_selected=None if cov_selected is None else flat(cov_selected), kl_cov_coef=algo.kl_cov_coef)
    agg = dict(mode=mode, max_len=algo.agg_max_len, denom=denom)
    ent = objectives.aggregate(entropy, micro.mask, **agg)
    total = loss - algo.entropy_coef * ent
    kl = jnp.zeros((), jnp.float32)
    if algo.kl_coef > 0:  # static: no reference model is kept when the KL term is off
        kl = objectives.aggregate(objectives.kl_penalty(logp, micro.ref_logp, algo.kl_kind), micro.mask, **agg)
        total = total + algo.kl_coef * kl
    tokens = micro.mask.sum()
    metrics = {"policy_loss": loss, "kl": kl, "entropy": ent,
               "clip_fraction": pg_metrics["clip_fraction"] * tokens, "tokens": tokens}
    if topk:
        distill, coverage = topk_distill(at_ids[0], micro.teacher_topk_logp, micro.mask, mode, algo.agg_max_len,
                                         denom)
        total = total + distill_coef * distill
        metrics.update(distill_topk_loss=distill, topk_coverage=coverage)
    if routed:
        sums = route_sums(routes, micro.routes, routing["routed_tokens"])
        if routing["aux_coef"]:  # static: off by default
            total = total + routing["aux_coef"] * sums["router_aux_loss"]
        metrics.update(sums)
    return total, metrics


ROUTE_SUMS = ("routes_changed", "routes_own_changed", "routes_recorded", "expert_load_ratio", "routed_tokens",
              "router_aux_loss")


def route_sums(routes, recorded: jax.Array, batch_routed_tokens: jax.Array) -> dict:
    """A micro-batch's routing sums (`ROUTE_SUMS`): recorded routes whose experts in the trainer's pass differ from the
    sampler's (`routing.routes_changed`: the routes it used, and its own top k, which replay overrides), routes
    recorded, the load's max over mean (`routing.load_max_over_mean`) times the micro-batch's routed tokens, those
    tokens, and the load-balancing loss times their share of the mini-batch's `batch_routed_tokens` (summed over
    micro-batches: the token-weighted mean)."""
    changed, recorded_count = routes_changed(routes.chosen, recorded)
    own_changed, _ = routes_changed(routes.own, recorded)
    tokens = jax.lax.stop_gradient(routes.load[0].sum()) / routes.own.shape[-1]
    aux = load_balancing_loss(routes.load, routes.prob_sum) * tokens / jnp.maximum(batch_routed_tokens, 1.0)
    return {"routes_changed": changed, "routes_own_changed": own_changed, "routes_recorded": recorded_count,
            "expert_load_ratio": load_max_over_mean(routes.load) * tokens, "routed_tokens": tokens,
            "router_aux_loss": aux}


def topk_distill(student_logp, teacher_logp, mask, mode: str, max_len, denom) -> tuple[jax.Array, jax.Array]:
    """(the top-K distillation loss of a micro-batch over the mini-batch's `denom`, the sum over its response
    tokens of the student's probability mass on the teacher's top K); [G, S, R, K] log-probs, [G * S, R] mask."""
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731  [G, S, R, K] -> [G * S, R, K]
    terms, _ = objectives.topk_terms_at_ids(flat(student_logp), flat(teacher_logp), mask, agg=mode, max_len=max_len)
    mass = jnp.exp(jax.lax.stop_gradient(flat(student_logp))).sum(-1)
    return safe_divide(terms.total, denom), jnp.sum(jnp.where(mask != 0, mass, 0.0) * mask)


def micro_shardings(batch_sharding: Any) -> Any:
    """The shardings of `split_micro`'s output: the scan axis whole, each micro-batch's rows split like the
    batch's (None without a mesh)."""
    if batch_sharding is None:
        return None
    return jax.tree_util.tree_map(lambda s: NamedSharding(s.mesh, P(None, *s.spec)), batch_sharding,
                                  is_leaf=lambda x: isinstance(x, NamedSharding))


METRIC_SUMS = ("policy_loss", "kl", "entropy", "clip_fraction", "tokens")  # loss_fn's metrics, summed
TOPK_SUMS = ("distill_topk_loss", "topk_coverage")  # and with the teacher's top K


def summed_grads(grad_fn, params, micro, metric_keys, active: jax.Array, grad_sharding: Any = None):
    """(loss, metric sums, gradients) of `grad_fn(params, *xs) -> ((loss, metrics), grads)` summed over the
    micro-batches xs of `micro` (a tuple of trees with a leading micro-batch axis). Each micro-batch's loss
    already carries the whole mini-batch's 1/denom, so the sums are the mini-batch's loss and gradient.
    Gradients come back in the parameters' dtype; `grad_sharding` places the f32 accumulator like them.
    A micro-batch marked False in `active` [micro-batches] bool is skipped (a conditional: its forward and
    backward passes do not run); it must add nothing, as a micro-batch without a response token adds nothing."""
    if jax.tree_util.tree_leaves(micro)[0].shape[0] == 1:  # one micro-batch: no scan, no zero-filled accumulator
        (loss, msum), grads = grad_fn(params, *jax.tree_util.tree_map(lambda x: x[0], micro))
    else:
        def add(carry, xs):
            grads, loss_sum, metric_sum = carry
            (loss, metrics), g = grad_fn(params, *xs)
            grads = jax.tree_util.tree_map(jnp.add, grads, g)
            metric_sum = jax.tree_util.tree_map(jnp.add, metric_sum, metrics)
            return grads, loss_sum + loss, metric_sum

        def accumulate(carry, inputs):
            xs, on = inputs
            return jax.lax.cond(on, add, lambda carry, _: carry, carry, xs), None

        zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        if grad_sharding is not None:  # an f32 gradient buffer per device, split like the parameters
            zeros = jax.lax.with_sharding_constraint(zeros, grad_sharding)
        metric_zeros = {k: jnp.zeros((), jnp.float32) for k in metric_keys}
        (grads, loss, msum), _ = jax.lax.scan(accumulate, (zeros, jnp.zeros((), jnp.float32), metric_zeros),
                                              (micro, active))
    return loss, msum, jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), grads, params)


def apply_if_finite(optimizer: optax.GradientTransformation, state: TrainState, grads, loss):
    """(new state, grad norm, finite): one optimizer update, or the state unchanged when the loss or the
    gradient norm is not finite."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update(state):
        updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
        return TrainState(params=optax.apply_updates(state.params, updates), opt_state=new_opt, step=state.step + 1)

    # A conditional rather than a select over every leaf: the skipped branch reads nothing, and the
    # taken one updates the donated buffers in place (a select re-reads old and new state).
    return jax.lax.cond(finite, update, lambda state: state, state), grad_norm, finite


def make_train_step(model_config, algo: AlgorithmSection, optimizer: optax.GradientTransformation, *,
                    micro_batch_size: int, state_sharding: Any = None, batch_sharding: Any = None, seed: int = 0,
                    frozen: Any = None, frozen_sharding: Any = None, lora_scale: float = 1.0,
                    distill_coef: float = 1.0, routing_replay: str = "none", router_aux_loss_coef: float = 0.0):
    """Build `step(state, batch, denom) -> (state, metrics)`: one optimizer update on a mini-batch.

    Clip-Cov draws its tokens with `fold_in(PRNGKey(seed), state.step)`: a new draw each update.
    The batch is scanned in micro-batches of `micro_batch_size` rows; gradients are summed (each
    micro-batch already carries the 1/denom of the mini-batch). When the loss or the gradient norm is
    not finite, the parameters and optimizer state are returned unchanged and metrics["finite"] = 0.
    The state argument is donated.

    With `state_sharding` (a TrainState of NamedShardings, see `state.state_shardings`) and
    `batch_sharding` (a TrainBatch of NamedShardings splitting rows, see `run.layout.batch_shardings`) the
    step is compiled for that mesh: the state keeps its sharding across updates (so donation reuses
    its buffers), each micro-batch keeps the batch's row split, the gradient accumulator is sharded
    like the parameters, and metrics come back replicated.

    LoRA: with `frozen` (the base parameters, placed by `frozen_sharding` on a mesh) the state's params are
    adapters (`models.lora`) and the loss reads the policy `lora.attach(frozen, adapters, lora_scale)`:
    gradients, their clipping and the optimizer state cover the adapters alone, and the base is only read
    (never donated, so it can also serve as the reference policy).

    A batch with the teacher's top-K fields (and its `batch_sharding` with them, `layout.sharding_of`) adds
    `distill_coef` x the top-K distillation loss (`loss_fn`) and the metrics distill_topk_loss and topk_coverage
    (the mean over response tokens of the student's mass on the teacher's top K).

    A batch with the sampler's routes (a mixture of experts, `TrainBatch.routes`) gets the metrics routes_changed
    (the fraction of recorded (token, layer) routes whose experts in the trainer's pass differ from the sampler's:
    its own top k without replay, 0 with it), routes_own_changed (the trainer's own top k against the sampler's,
    replayed or not), expert_load_max_over_mean (mean over sparse layers, token-weighted over micro-batches) and
    router_aux_loss (Switch's load-balancing loss, added x `router_aux_loss_coef` when > 0); `routing_replay`
    "rollout" sends the recorded tokens to the sampler's experts (`logprobs.decoder_pass`). Without routes the step
    is as before.
    """
    replicated = _replicated(state_sharding, batch_sharding)
    micro_sharding = micro_shardings(batch_sharding)

    def step(state: TrainState, batch: TrainBatch, denom: jax.Array, base: Any = None):
        with mesh_context(replicated):
            return mesh_step(state, batch, denom, base)

    def mesh_step(state: TrainState, batch: TrainBatch, denom: jax.Array, base: Any = None):
        selected = cov_tokens(algo, batch, jax.random.fold_in(jax.random.PRNGKey(seed), state.step))
        micro, micro_selected = split_micro((batch, selected), micro_batch_size)
        if micro_sharding is not None:
            micro = jax.lax.with_sharding_constraint(micro, micro_sharding)
            if micro_selected is not None:  # the Clip-Cov / KL-Cov token choice is split like the mask
                micro_selected = jax.lax.with_sharding_constraint(micro_selected, micro_sharding.mask)

        routing = None
        if batch.routes is not None:  # a mixture of experts' sampled routes: replay, metrics, balancing loss
            routing = {"replay": routing_replay, "aux_coef": router_aux_loss_coef,
                       "routed_tokens": jnp.sum(batch.segments <= batch.pred_index.shape[1]).astype(jnp.float32)}

        def trained_loss(params, mb, mb_selected):  # differentiated in the state's params only (LoRA: adapters)
            policy = params if base is None else lora.attach(base, params, lora_scale)
            return loss_fn(policy, model_config, algo, mb, denom, mb_selected, distill_coef, routing)

        grad_fn = jax.value_and_grad(trained_loss, has_aux=True)
        topk = batch.teacher_ids is not None
        keys = METRIC_SUMS + (TOPK_SUMS if topk else ()) + (ROUTE_SUMS if routing else ())
        loss, msum, grads = summed_grads(grad_fn, state.params, (micro, micro_selected), keys,
                                         has_tokens(micro), None if state_sharding is None else state_sharding.params)
        new_state, grad_norm, finite = apply_if_finite(optimizer, state, grads, loss)
        tokens = jnp.maximum(msum["tokens"], 1.0)
        metrics = {"loss": loss, "policy_loss": msum["policy_loss"], "kl": msum["kl"], "entropy": msum["entropy"],
                   "clip_fraction": msum["clip_fraction"] / tokens, "grad_norm": grad_norm,
                   "finite": finite.astype(jnp.float32)}
        if topk:
            metrics.update(distill_topk_loss=msum["distill_topk_loss"], topk_coverage=msum["topk_coverage"] / tokens)
        if routing:
            routed = jnp.maximum(msum["routed_tokens"], 1.0)
            recorded = jnp.maximum(msum["routes_recorded"], 1.0)
            metrics.update(routes_changed=msum["routes_changed"] / recorded,
                           routes_own_changed=msum["routes_own_changed"] / recorded,
                           expert_load_max_over_mean=msum["expert_load_ratio"] / routed,
                           router_aux_loss=msum["router_aux_loss"])
        return new_state, metrics

    if frozen is None:
        if replicated is None:
            return jax.jit(step, donate_argnums=(0,))
        return jax.jit(step, donate_argnums=(0,), in_shardings=(state_sharding, batch_sharding, replicated),
                       out_shardings=(state_sharding, replicated))
    if replicated is None:
        jitted = jax.jit(step, donate_argnums=(0,))
    else:
        jitted = jax.jit(step, donate_argnums=(0,), in_shardings=(state_sharding, batch_sharding, replicated,
                                                                  frozen_sharding),
                         out_shardings=(state_sharding, replicated))

    def lora_step(state: TrainState, batch: TrainBatch, denom: jax.Array):
        return jitted(state, batch, denom, frozen)

    lora_step.jitted = jitted
    return lora_step


def make_logprob_fn(model_config, *, micro_batch_size: int | None = None, param_sharding: Any = None,
                    batch_sharding: Any = None, routing_replay: str = "none"):
    """Jitted `(params, batch) -> logp [G, S, R]` of a packed batch (old and reference log-probs), in micro-batches
    of `micro_batch_size` rows as the train step (`jit_packed_pass`; None: all rows at once).

    With shardings, params and batch are taken as placed and the log-probs come back replicated (every
    process can read them: they are small, and the host unpacks them). `routing_replay` "rollout": a batch's
    recorded routes are replayed (`logprobs.decoder_pass`)."""

    return jit_packed_pass(lambda params, batch: response_logprobs(params, model_config, batch,
                                                                   routing_replay=routing_replay),
                           micro_batch_size=micro_batch_size, param_sharding=param_sharding,
                           batch_sharding=batch_sharding)


def jit_packed_pass(fn, *, micro_batch_size: int | None = None, param_sharding: Any = None,
                    batch_sharding: Any = None):
    """`fn(params, batch) -> [G, ...]` (or a tuple of them) jitted. With `micro_batch_size` (smaller than the batch) it runs on
    `split_micro`'s micro-batches one after another (`lax.map`: the memory of one micro-batch's pass, as in the
    train step), a micro-batch without a response token is skipped (its rows get 0), and the rows come back in
    the batch's order. With shardings, params and batch are taken as placed and the result comes back
    replicated."""
    micro_sharding = micro_shardings(batch_sharding)
    replicated = _replicated(param_sharding, batch_sharding)

    def run(params, batch):
        with mesh_context(replicated):
            return mesh_run(params, batch)

    def mesh_run(params, batch):
        rows = batch.tokens.shape[0]
        if micro_batch_size is None or rows <= micro_batch_size:
            return fn(params, batch)
        micro = split_micro(batch, micro_batch_size)
        if micro_sharding is not None:
            micro = jax.lax.with_sharding_constraint(micro, micro_sharding)
        out_shape = jax.eval_shape(fn, params, jax.tree_util.tree_map(lambda x: x[0], micro))

        def zeros(_):
            return jax.tree_util.tree_map(lambda o: jnp.zeros(o.shape, o.dtype), out_shape)

        def each(inputs):
            mb, on = inputs
            return jax.lax.cond(on, lambda b: fn(params, b), zeros, mb)

        out = jax.lax.map(each, (micro, has_tokens(micro)))  # [micro-batches, micro_batch_size, ...]
        return jax.tree_util.tree_map(  # split_micro's inverse
            lambda x: jnp.swapaxes(x, 0, 1).reshape(rows, *x.shape[2:]), out)

    if replicated is None:
        return jax.jit(run)
    return jax.jit(run, in_shardings=(param_sharding, batch_sharding), out_shardings=replicated)


def mesh_context(sharding: NamedSharding | None):
    """The abstract mesh of `sharding` as the tracing context (`jax.sharding.use_abstract_mesh`), so that code
    which must know the mesh while traced (a Mosaic kernel wrapped in shard_map, `models.attention`) finds it;
    nothing without a mesh."""
    if sharding is None:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(sharding.mesh.abstract_mesh)


def _replicated(*shardings) -> NamedSharding | None:
    """A fully replicated NamedSharding on the mesh of the first NamedSharding found (None if none)."""
    for tree in shardings:
        for leaf in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, NamedSharding)):
            if isinstance(leaf, NamedSharding):
                return NamedSharding(leaf.mesh, P())
    return None
