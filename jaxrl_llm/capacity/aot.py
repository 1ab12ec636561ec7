"""Ahead-of-time compilation of a run's programs for a TPU slice, on any machine with libtpu installed (no TPU
needed): `jax.experimental.topologies.get_topology_desc` gives the slice's devices, the run's mesh is laid over
them, and each program is lowered from shapes alone (no parameters are loaded or allocated) and compiled for
that target. XLA then reports each program's per-device arguments, outputs and temporaries, and refuses a
program that does not fit the chip's HBM.

Programs compiled (the ones a run's step spends its memory in, built by the same functions `run.setup` uses):
  train_step      the policy update on one mini-batch of packed rows (LoRA: adapters over the frozen, possibly
                  quantized base)
  logprob_pass    the old/reference log-prob pass over the same rows
  teacher_pass    on-policy distillation's teacher pass over them (distill.teacher; its top-K pass with mode topk)
  sampler_prefill the static engine's prefill of one sampler call (the worst case: every prompt at
  sampler_decode  data.max_prompt_tokens, every sample to max_new_tokens) and its decode loop
  sampler_continuous  the continuous engine's decode loop (its prefill inside), instead of the two above
  critic_step     PPO's critic update on the same mini-batch (with a critic)
  gvm_grad_norms  GVM's per-sample gradient norms of stage 1's rows (sampling.allocation gvm)

libtpu is an optional dependency (`pip install 'jaxrl_llm[tpu]'`); without it `topology_devices` says how to get it.
NVIDIA GPU hosts (`h200-8`, `h100-8x2`, ...) compile the same way through the CUDA plugin (`capacity.gpu_targets`, the
`gpu-compile` extra). Each program's report also says what it executes, read from its optimized HLO
(`capacity.hlo_stats`): the attention kernel, kernels launched per step, matmul FLOPs against the model's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_llm.capacity.chips import CHIPS, USABLE_GIB_BY_LIBTPU, Chip, libtpu_release  # noqa: F401
from jaxrl_llm.capacity.gpu_targets import CudaPluginMissing, Gpu, predict_seconds  # noqa: F401
from jaxrl_llm.capacity.hlo_stats import model_flops
from jaxrl_llm.capacity.memory import estimate_memory, model_config_for
from jaxrl_llm.capacity.report import (ProgramReport, format_report, place_beside, program_report,  # noqa: F401
                                       usable_bytes)
from jaxrl_llm.capacity.topology import LibtpuMissing, Topology, parse_topology, topology_devices  # noqa: F401
from jaxrl_llm.models import lora, quant
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.model import init_params
from jaxrl_llm.models.moe import route_dtype, route_shape
from jaxrl_llm.models.sharding import BATCH_SPEC, make_mesh, param_shardings
from jaxrl_llm.run.config import RunConfig, uses_critic
from jaxrl_llm.run.layout import batch_shardings, check_mesh_fits, sharding_of, split_devices
from jaxrl_llm.run.setup import runtime_model_config, sampler_weights
from jaxrl_llm.run.shapes import StepShapes, step_shapes
from jaxrl_llm.run.state import init_state, make_optimizer, state_shardings
from jaxrl_llm.sampling.engine import records_routes
from jaxrl_llm.train.packing import TrainBatch
from jaxrl_llm.train.step import make_logprob_fn, make_train_step


def _abstract(tree, shardings):
    return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def batch_shapes(cfg: RunConfig, shapes: StepShapes, model_config: ModelConfig | None = None) -> TrainBatch:
    """ShapeDtypeStructs of a train-step mini-batch of `shapes.mini_batch_rows` packed rows of `shapes.row_length`
    tokens, each a prompt and its responses in `shapes.responses_per_row` slots of max_new_tokens (with
    `distill.mode` topk also the teacher's top_k ids and log-probs at each response position; with a mixture of
    experts for `model_config`, the sampler's routes per token and sparse layer, which a run's batch on a mesh always
    carries: `RunSetup.place_batch`)."""
    rows = shapes.mini_batch_rows
    per_row = (rows, shapes.row_length)
    per_slot = (rows, shapes.responses_per_row, cfg.sampling.max_new_tokens)
    i32, f32 = jnp.int32, jnp.float32
    extra = {}
    if cfg.distill.teacher and cfg.distill.mode == "topk":  # the teacher's top-K ids and log-probs
        per_id = (*per_slot, cfg.distill.top_k)
        extra = dict(teacher_ids=jax.ShapeDtypeStruct(per_id, i32), teacher_topk_logp=jax.ShapeDtypeStruct(per_id, f32))
    if model_config is not None and records_routes(model_config):  # [rows, L, L_sparse, k] small ints
        extra["routes"] = jax.ShapeDtypeStruct((*per_row, *route_shape(model_config)),
                                               route_dtype(model_config.num_experts))
    return TrainBatch(tokens=jax.ShapeDtypeStruct(per_row, i32), positions=jax.ShapeDtypeStruct(per_row, i32),
                      segments=jax.ShapeDtypeStruct(per_row, i32), pred_index=jax.ShapeDtypeStruct(per_slot, i32),
                      response_tokens=jax.ShapeDtypeStruct(per_slot, i32),
                      **{name: jax.ShapeDtypeStruct(per_slot, f32) for name in TrainBatch._fields[5:11]}, **extra)


PROGRAMS = ("train_step", "logprob_pass", "teacher_pass", "critic_step", "gvm_grad_norms", "sampler_prefill",
            "sampler_decode", "sampler_continuous")


def compile_run(cfg: RunConfig, topology: str | Topology, *, model_config: ModelConfig | None = None,
                devices: list | None = None, only: tuple[str, ...] | None = None,
                teacher_config: ModelConfig | None = None) -> dict[str, Any]:
    """Compile `cfg`'s programs for `topology` with the run's mesh (`train.mesh`; empty: every device on fsdp)
    and shardings; `only` (names of PROGRAMS): only those of the run's programs, None every one;
    `teacher_config`: distill.teacher's model (`teacher_config_for`; None: the policy's shape). Returns
    {"topology", "devices", "hbm_bytes", "mesh", "estimate" (`estimate_memory` on the same mesh),
    "programs": [ProgramReport]}."""
    unknown = sorted(set(only or ()) - set(PROGRAMS))
    if unknown:
        raise ValueError(f"unknown program(s) {', '.join(unknown)}: expected some of {', '.join(PROGRAMS)}")
    wanted = set(only or PROGRAMS)

    topo = parse_topology(topology) if isinstance(topology, str) else topology
    devices = topology_devices(topo) if devices is None else devices
    mc = _runtime_config(cfg, model_config)
    trainer_devices, sampler_devices = split_devices(cfg, devices)
    mesh = make_mesh(cfg.train.mesh, devices=trainer_devices or devices)
    sampler_mesh = make_mesh(cfg.rollouts.sampler_mesh, devices=sampler_devices) if sampler_devices else mesh
    check_mesh_fits(mesh, cfg, model_config)  # as the run does
    shapes = step_shapes(cfg, mesh, sampler_mesh)
    estimate = run_estimate(cfg, shapes.mesh, model_config=model_config, platform=_estimate_platform(topo),
                            teacher_config=teacher_config)
    rows = shapes.mini_batch_rows
    step_batch = batch_shapes(cfg, shapes, mc)  # distill.mode topk: the teacher's top-K fields; a mixture: routes
    # the passes' batch: the rollouts packed, no teacher fields; a mixture of experts' carries routes, as a run's
    batch_sharding = batch_shardings(mesh, routes=step_batch.routes is not None)
    step_sharding = sharding_of(step_batch, batch_sharding)
    step_batch = _abstract(step_batch, step_sharding)
    batch = step_batch._replace(teacher_ids=None, teacher_topk_logp=None)

    optimizer = make_optimizer(cfg.optim)
    params = jax.eval_shape(lambda: init_params(mc, jax.random.PRNGKey(0)))
    lora_kwargs, trained = {}, params
    spec = shapes.lora
    if spec is not None:
        trained = jax.eval_shape(lambda: lora.init_adapters(mc, spec, jax.random.PRNGKey(0)))
        if cfg.lora.base_dtype:
            params = jax.eval_shape(lambda p: quant.quantize_base(p, cfg.lora.base_dtype), params)
    param_sharding = param_shardings(params, mesh)
    base = _abstract(params, param_sharding)
    trained_sharding = param_sharding if trained is params else param_shardings(trained, mesh)
    if trained is not params:
        lora_kwargs = dict(frozen=base, frozen_sharding=param_sharding, lora_scale=spec.scale)
    state_shapes = jax.eval_shape(lambda p: init_state(p, optimizer), trained)
    state_sharding = state_shardings(state_shapes, optimizer, trained_sharding)
    state = _abstract(state_shapes, state_sharding)
    denom = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))

    step = make_train_step(mc, cfg.algorithm, optimizer, micro_batch_size=cfg.optim.micro_batch_size,
                           state_sharding=state_sharding, batch_sharding=step_sharding, seed=cfg.train.seed,
                           distill_coef=cfg.distill.coef, routing_replay=cfg.model.routing_replay,
                           router_aux_loss_coef=cfg.model.router_aux_loss_coef, **lora_kwargs)
    hbm = topo.chip.usable_bytes  # what each program is held to
    # the model's FLOPs per device (the rows split over data x fsdp, the matrices over tensor): each row's prompt and
    # its responses, not the padding slots of the bucket; full fine-tuning's count (LoRA's step needs less)
    work = dict(model_config=mc, rows=rows, prompt_tokens=cfg.data.max_prompt_tokens,
                samples=min(shapes.responses_per_row, shapes.samples_per_prompt),
                response_tokens=cfg.sampling.max_new_tokens)
    per_device = shapes.row_split * shapes.mesh["tensor"]
    programs = []
    if "train_step" in wanted:
        lowered = (step.jitted.lower(state, step_batch, denom, base) if lora_kwargs
                   else step.lower(state, step_batch, denom))
        programs.append(program_report("train_step", lowered, hbm, model_flops(**work) / per_device))
    if "logprob_pass" in wanted:
        logprob = make_logprob_fn(mc, micro_batch_size=cfg.optim.micro_batch_size, param_sharding=param_sharding,
                                  batch_sharding=batch_sharding, routing_replay=cfg.model.routing_replay)
        programs.append(program_report("logprob_pass", logprob.lower(base, batch), hbm,
                               model_flops(**work, backward=False) / per_device))
    if cfg.distill.teacher and "teacher_pass" in wanted:
        teacher_work = dict(work, model_config=_runtime_config(cfg, teacher_config)) if teacher_config else work
        programs.append(_teacher_program(cfg, mc, batch, batch_sharding, hbm,
                                         model_flops(**teacher_work, backward=False) / per_device, teacher_config))
    if uses_critic(cfg) and "critic_step" in wanted:
        programs.append(_critic_program(cfg, mc, base, batch, batch_sharding, denom, hbm))
    policy = None if lora_kwargs else base  # LoRA: the sampler and GVM read the merged copy (unquantized)
    if cfg.sampling.allocation == "gvm" and "gvm_grad_norms" in wanted:
        programs.append(_gvm_program(cfg, shapes, mc, mesh, policy, hbm))
    sampler_mc, sampler_policy = _sampler_policy(cfg, mc, mesh, sampler_mesh, policy)
    if cfg.sampling.engine == "static" and wanted & {"sampler_prefill", "sampler_decode"}:
        programs += [r for r in _sampler_programs(cfg, shapes, sampler_mc, sampler_mesh, sampler_policy, hbm)
                    if r.name in wanted]
    elif cfg.sampling.engine != "static" and "sampler_continuous" in wanted:
        programs.append(_continuous_program(cfg, shapes, sampler_mc, sampler_mesh, sampler_policy, hbm))
    place_beside(programs, estimate, hbm)
    if isinstance(topo.chip, Gpu):
        for program in programs:
            program.predicted_s = predict_seconds(getattr(program, "kernel_costs", ()), topo.chip)
    result = {"topology": topo.name, "topology_desc": topo.topology_name, "devices": len(devices),
              "hbm_bytes": topo.chip.hbm_bytes, "usable_bytes": hbm,
              "mesh": dict(shapes.mesh), "rows": rows, "row_length": shapes.row_length,
              "estimate": estimate, "programs": programs}
    if sampler_devices:
        result["sampler_mesh"] = dict(shapes.sampler_mesh)
    return result


def _sampler_policy(cfg: RunConfig, mc: ModelConfig, mesh, sampler_mesh, policy) -> tuple[ModelConfig, Any]:
    """The model config and weights the sampler's programs read, as `Run.sampler_model_config` and
    `Run.sampler_params` give them: the policy (`policy` None: LoRA's merged copy) in `sampling.dtype`, laid out
    by the model's rules on the sampler's mesh (`async_rollouts.copy_params` places a version there)."""

    if not cfg.sampling.dtype and sampler_mesh is mesh:
        return mc, policy
    tree = _merged_policy(mc, mesh, policy)
    if cfg.sampling.dtype:
        tree = jax.eval_shape(functools.partial(sampler_weights, dtype=cfg.sampling.dtype), tree)
    if cfg.sampling.dtype == "bfloat16":
        mc = mc.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    return mc, _abstract(tree, param_shardings(tree, sampler_mesh))


def _merged_policy(mc: ModelConfig, mesh, policy):
    """The policy the sampler and GVM read: `policy`, or (None: LoRA) an unquantized copy laid out like a base."""
    if policy is not None:
        return policy
    full = jax.eval_shape(lambda: init_params(mc, jax.random.PRNGKey(0)))
    return _abstract(full, param_shardings(full, mesh))


def _critic_program(cfg: RunConfig, mc: ModelConfig, trunk, batch: TrainBatch, batch_sharding, denom,
                    hbm: int) -> ProgramReport:
    """PPO's critic update on the train step's mini-batch, laid out as `train.critic.setup_critic` lays it. Its
    trunk has the policy's shape (as `estimate_memory` counts it; a `critic.source` of another size is not read)."""
    from jaxrl_llm.train.critic import critic_optimizer, make_critic_step, value_params

    mesh = denom.sharding.mesh
    optimizer = critic_optimizer(cfg.critic, cfg.optim)
    shapes = jax.eval_shape(lambda t: init_state(value_params(t, mc), optimizer), trunk)
    replicated = NamedSharding(mesh, P())
    param_sharding = {"trunk": param_shardings(shapes.params["trunk"], mesh),
                      "value_head": jax.tree_util.tree_map(lambda _: replicated, shapes.params["value_head"])}
    state_sharding = state_shardings(shapes, optimizer, param_sharding)
    step = make_critic_step(mc, cfg.critic, optimizer, micro_batch_size=cfg.optim.micro_batch_size,
                            state_sharding=state_sharding, batch_sharding=batch_sharding)
    return program_report("critic_step", step.lower(_abstract(shapes, state_sharding), batch, denom), hbm)


def _teacher_program(cfg: RunConfig, mc: ModelConfig, batch: TrainBatch, batch_sharding, hbm: int,
                     flops: float, teacher_config: ModelConfig | None = None) -> ProgramReport:
    """On-policy distillation's teacher pass over the rollouts packed as the log-prob pass reads them, as
    `train.distill.make_teacher` builds it: the log-probs of the sampled tokens (mode sampled) or the top_k ids and
    log-probs (topk), in micro-batches, with the teacher's weights in distill.teacher_dtype laid out on the
    trainer's mesh. The teacher is `teacher_config` (loaded in float32 or bfloat16 as the run loads it, with the
    run's runtime model keys; a vocabulary other than the policy's is the run's ConfigError), or without one the
    policy's shape (as `estimate_memory` counts it without a teacher_config)."""
    from jaxrl_llm.train.distill import make_topk_fn, teacher_weights

    section = cfg.distill if teacher_config is not None else dataclasses.replace(cfg.distill, teacher="policy")
    section = dataclasses.replace(section, adapter="")  # an adapter is merged in: the same shapes, no files read
    configs = []

    def load(source, dtype):
        del source
        config = teacher_config.replace(param_dtype=dtype)
        return config, init_params(config, jax.random.PRNGKey(0)), None

    def weights(params):
        config, out = teacher_weights(section, mc, params, load=load, configure=lambda c: runtime_model_config(
            c, cfg.model, cfg.data.max_prompt_tokens))
        configs.append(config)
        return out

    params = jax.eval_shape(weights, jax.eval_shape(lambda: init_params(mc, jax.random.PRNGKey(0))))
    mesh = batch_sharding.tokens.mesh
    sharding = param_shardings(params, mesh)
    passes = dict(micro_batch_size=cfg.optim.micro_batch_size, param_sharding=sharding, batch_sharding=batch_sharding)
    if cfg.distill.mode == "topk":
        fn = make_topk_fn(cfg.distill, configs[0], **passes)
    else:
        fn = make_logprob_fn(configs[0], **passes)
    return program_report("teacher_pass", fn.lower(_abstract(params, sharding), batch), hbm, flops)


def _gvm_program(cfg: RunConfig, shapes: StepShapes, mc: ModelConfig, mesh, policy, hbm: int) -> ProgramReport:
    """GVM's per-sample gradient-norm pass over stage 1's accepted rows at the worst case (every stage-1 sample
    accepted, every prompt `data.max_prompt_tokens` long), as `train.gvm.per_sample_grad_norms` runs it: the
    step's `gvm_rows` unpacked rows of `gvm_row_length` tokens in chunks of `gvm_chunk_rows`."""
    from jaxrl_llm.train.gvm import _grad_norms, parse_param_subset

    rows, length, new = shapes.gvm_rows, shapes.gvm_row_length, cfg.sampling.max_new_tokens
    on_rows = NamedSharding(mesh, BATCH_SPEC)
    i32, f32 = jnp.int32, jnp.float32
    inputs = [jax.ShapeDtypeStruct(shape, dtype, sharding=on_rows) for shape, dtype in
              (((rows, length), i32), ((rows,), i32), ((rows, new), i32), ((rows, new), f32))]
    lowered = _grad_norms.lower(_merged_policy(mc, mesh, policy), mc, parse_param_subset(cfg.sampling.gvm_param_subset),
                                shapes.gvm_chunk_rows, *inputs,
                                chunk_sharding=NamedSharding(mesh, P(None, *BATCH_SPEC)))
    return program_report("gvm_grad_norms", lowered, hbm)


def _continuous_program(cfg: RunConfig, shapes: StepShapes, mc: ModelConfig, mesh, policy,
                        hbm: int) -> ProgramReport:
    """The continuous engine's decode loop (prefill inside it) of one step's sampling at the worst case
    (`shapes.sampler_call`: every prompt `data.max_prompt_tokens` long, `shapes.sampler_samples` samples of
    `max_new_tokens` each), as `sampling.continuous.generate_slots` calls it. The prompt queue and cache are
    replicated, as the engine's uncommitted host arrays are."""
    from jaxrl_llm.sampling.continuous import decode_slots, slot_inputs

    prompts = [np.zeros(cfg.data.max_prompt_tokens, np.int32)] * cfg.sampling.prompts_per_step
    counts = np.full(cfg.sampling.prompts_per_step, shapes.sampler_samples)
    call = shapes.sampler_call
    found = {}

    def inputs():
        arrays, found["static"] = slot_inputs(mc, prompts, counts, call, pad_id=0)
        return arrays

    replicated = NamedSharding(mesh, P())
    arrays = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                                    jax.eval_shape(inputs))
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=replicated)  # noqa: E731
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    lowered = decode_slots.lower(_merged_policy(mc, mesh, policy), mc, mesh, *arrays,
                                 jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated),
                                 scalar(jnp.float32), scalar(jnp.float32), scalar(jnp.int32),
                                 jax.ShapeDtypeStruct((8,), jnp.int32, sharding=replicated), scalar(jnp.int32),
                                 **found["static"], greedy=False, top_k=0, use_top_p=False)
    return program_report("sampler_continuous", lowered, hbm)


def _sampler_programs(cfg: RunConfig, shapes: StepShapes, mc: ModelConfig, mesh, policy,
                      hbm: int) -> list[ProgramReport]:
    """The static engine's prefill and decode of one sampler call at the run's worst case (`shapes.sampler_call`:
    every prompt `data.max_prompt_tokens` long, `shapes.sampler_samples` samples of `max_new_tokens`; GVM's counts
    vary, so no rows share a prompt entry: `shapes.prompt_group`), rows split over data x fsdp as
    `sampling.generate` splits them. The sampler reads the policy in `model.param_dtype` (LoRA: the merged copy,
    `policy` None: laid out like an unquantized base)."""
    from jaxrl_llm.sampling.engine import cache_sharding, decode_rows, init_state, prefill_rows, row_sharding

    policy = _merged_policy(mc, mesh, policy)
    run = dataclasses.replace(shapes.sampler_call.shapes, prompt_group=shapes.prompt_group)
    rows = row_sharding(mesh, 1)

    def sds(shape, dtype, sharding=rows):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def on_rows(tree):  # every leaf split over rows on its first axis, scalars replicated
        return jax.tree_util.tree_map(
            lambda x: sds(x.shape, x.dtype, rows if x.ndim else NamedSharding(mesh, P())), tree)

    def placed(state):  # as `engine.init_state` places it: the cache by `engine.cache_sharding`
        cache = jax.tree_util.tree_map(lambda x: sds(x.shape, x.dtype, cache_sharding(x.shape, mesh)), state.cache)
        return dataclasses.replace(on_rows(dataclasses.replace(state, cache=None)), cache=cache)

    make = functools.partial(init_state, mc, mesh, prompt_bucket=run.prompt_bucket,
                             new_token_bucket=run.new_token_bucket, response_tile=run.response_tile,
                             prompt_group=run.prompt_group)
    state, first_logits = jax.eval_shape(make, sds((run.row_bucket,), jnp.int32), sds((run.row_bucket,), jnp.bool_))
    state, first_logits = placed(state), on_rows(first_logits)
    chunk = run.prompts_per_prefill
    prefill = prefill_rows.lower(policy, mc, mesh, sds((chunk, run.prompt_bucket), jnp.int32),
                                 sds((chunk,), jnp.int32), sds((run.row_bucket,), jnp.int32), state, first_logits)
    scalar = NamedSharding(mesh, P())
    f32, i32 = (sds((), t, scalar) for t in (jnp.float32, jnp.int32))
    decode = decode_rows.lower(policy, mc, mesh, state, first_logits,
                               jax.eval_shape(lambda: jax.random.PRNGKey(0)), f32, f32, i32,
                               sds((8,), jnp.int32, scalar), i32, i32, greedy=False, top_k=0, use_top_p=False)
    return [program_report("sampler_prefill", prefill, hbm), program_report("sampler_decode", decode, hbm)]


def _runtime_config(cfg: RunConfig, model_config: ModelConfig | None = None) -> ModelConfig:
    """The model config the run's programs are traced with (`run.setup.runtime_model_config`)."""

    mc = model_config or model_config_for(cfg.model.source)
    return runtime_model_config(mc.replace(param_dtype=cfg.model.param_dtype), cfg.model, cfg.data.max_prompt_tokens)


def run_estimate(cfg: RunConfig, mesh: dict[str, int], *, model_config: ModelConfig | None = None,
                 platform: str = "tpu", teacher_config: ModelConfig | None = None) -> dict[str, Any]:
    """`estimate_memory` of `cfg` on mesh sizes {"data", "fsdp", "tensor"} as `compile_run` compares it with XLA's
    programs: the traced model config, the target's attention path ("tpu" or "gpu"), the teacher's model."""
    return estimate_memory(cfg, _runtime_config(cfg, model_config), mesh, platform=platform,
                           teacher_config=teacher_config)


def teacher_config_for(cfg: RunConfig) -> ModelConfig | None:
    """distill.teacher's ModelConfig as `jaxrl-llm compile` reads it (`model_config_for`: an HF folder's
    config.json, such as a run's final/, or a known model's name); None (the policy's shape) for "policy", no
    teacher, or a source read only by loading it (a .gguf file)."""
    source = cfg.distill.teacher
    if source in ("", "policy"):
        return None
    try:
        return model_config_for(source)
    except ValueError:
        return None


def _estimate_platform(topology: Topology) -> str:
    return "gpu" if topology.platform == "cuda" else "tpu"


def refresh_estimates(cfg: RunConfig, result: dict[str, Any], *,
                      model_config: ModelConfig | None = None) -> dict[str, Any]:
    """A saved `jaxrl-llm compile --json` result with its estimates recomputed by today's `estimate_memory` (the
    compiled numbers kept): the programs' estimate and resident bytes and whether they fit."""
    est = run_estimate(cfg, result["mesh"], model_config=model_config,
                       platform=_estimate_platform(parse_topology(result["topology"])))
    programs = [ProgramReport(**p) for p in result["programs"]]
    usable = usable_bytes(result)
    place_beside(programs, est, usable)
    return {**result, "usable_bytes": usable, "estimate": est, "programs": [dataclasses.asdict(p) for p in programs]}
