"""Ahead-of-time compilation of a run's programs for a TPU slice, on any machine with libtpu installed (no TPU
needed): `jax.experimental.topologies.get_topology_desc` gives the slice's devices, the run's mesh is laid over
them, and each program is lowered from shapes alone (no parameters are loaded or allocated) and compiled for
that target. XLA then reports each program's per-device arguments, outputs and temporaries, and refuses a
program that does not fit the chip's HBM.

Programs compiled (the ones a run's step spends its memory in, built by the same functions `run.setup` uses):
  train_step      the policy update on one mini-batch of packed rows (LoRA: adapters over the frozen, possibly
                  quantized base)
  logprob_pass    the old/reference log-prob pass over the same rows
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
import importlib.util
import math
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_llm.capacity.chips import CHIPS, USABLE_GIB_BY_LIBTPU, Chip, libtpu_release  # noqa: F401
from jaxrl_llm.capacity.gpu_targets import (CudaPluginMissing, Gpu, gpu_devices, parse_gpu_topology,  # noqa: F401
                                            predict_seconds)
from jaxrl_llm.capacity.hlo_stats import kernel_costs, model_flops, program_stats
from jaxrl_llm.capacity.memory import GIB, estimate_memory, model_config_for
from jaxrl_llm.models import lora, quant
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.model import init_params
from jaxrl_llm.models.sharding import make_mesh, param_shardings
from jaxrl_llm.run.config import RunConfig, uses_critic
from jaxrl_llm.run.layout import batch_shardings, check_mesh_fits, split_devices
from jaxrl_llm.run.setup import runtime_model_config, sampler_weights
from jaxrl_llm.run.shapes import StepShapes, step_shapes
from jaxrl_llm.run.state import init_state, make_optimizer, state_shardings
from jaxrl_llm.train.packing import TrainBatch
from jaxrl_llm.train.step import make_logprob_fn, make_train_step


class LibtpuMissing(RuntimeError):
    """Compiling for a TPU needs libtpu, an optional dependency."""


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str  # as the user wrote it
    chip: Chip | Gpu
    topology_name: str  # get_topology_desc's form, e.g. "v5e:4x4" (GPU: "1x<hosts>x<gpus per host>")
    chips: int
    host_bounds: tuple[int, int, int]
    platform: str = "tpu"  # or "cuda"


def _grid(chips: int, dims: int) -> tuple[int, ...]:
    """The chip grid of a slice of `chips` chips as Google Cloud shapes them: 2-D (v5e, v6e: 2x2, 2x4, 4x4, 4x8,
    8x8, ...) or 3-D (v4, v5p: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...)."""
    if chips < 1 or chips & (chips - 1):
        raise ValueError(f"a TPU slice has a power-of-two number of chips, got {chips}")
    sides = [1] * dims
    first, then = ([0, 1], [1, 0]) if dims == 2 else ([0, 1, 2], [2, 1, 0])  # then the last side first, cyclically
    for i in range(int(math.log2(chips))):
        sides[first[i] if i < dims else then[(i - dims) % dims]] *= 2
    return tuple(sides)


def parse_topology(name: str) -> Topology:
    """A slice as users name it: `v4-8`, `v4-32`, `v5litepod-8`, `v5litepod-64`, `v5p-8`, `v6e-8`, ... (the
    number counts TensorCores: two per v4 / v5p chip, one per v5e / v6e chip), or get_topology_desc's
    `v5e:4x4` / `v4:2x2x2` form; or GPU hosts, `h200-8`, `h100-8x2` (`gpu_targets.parse_gpu_topology`)."""
    gpu = parse_gpu_topology(name)
    if gpu is not None:
        return gpu
    match = re.fullmatch(r"(v4|v5litepod|v5e|v5p|v6e)-(\d+)", name.strip())
    if match:
        chip = CHIPS[match.group(1)]
        cores = int(match.group(2))
        if cores % chip.cores_per_chip:
            raise ValueError(f"topology {name!r}: {chip.generation} slices count {chip.cores_per_chip} cores per chip")
        chips = cores // chip.cores_per_chip
        dims = 3 if chip.generation in ("v4", "v5p") else 2
        grid = _grid(chips, dims)
    else:
        match = re.fullmatch(r"(v4|v5e|v5p|v6e):(\d+(?:x\d+)+)", name.strip())
        if not match:
            raise ValueError(f"unknown TPU topology {name!r}: expected e.g. v4-32, v5litepod-64, v5p-8, v6e-8 "
                             "or v5e:4x4, or GPU hosts: h100-8, h200-1, a100-8, h100-8x2")
        chip = CHIPS[match.group(1)]
        grid = tuple(int(x) for x in match.group(2).split("x"))
        chips = math.prod(grid)
    per_host = tuple(min(g, b) for g, b in zip(grid + (1,) * (3 - len(grid)), chip.host_bounds))
    if chip.generation in ("v5e", "v6e") and chips == 8:  # one host of 8 chips (v5litepod-8, v6e-8)
        per_host = (2, 4, 1)
    topology_name = f"{chip.generation}:{'x'.join(str(g) for g in grid)}"
    return Topology(name, chip, topology_name, chips, per_host)


def topology_devices(topology: Topology) -> list:
    """The slice's devices (no TPU needed; libtpu must be installed), or the GPU hosts' (the CUDA plugin)."""
    if topology.platform == "cuda":
        return gpu_devices(topology)
    if importlib.util.find_spec("libtpu") is None:  # an optional extra: looked up, never imported here
        raise LibtpuMissing("compiling for a TPU needs libtpu: pip install 'jaxrl_llm[tpu]' (or bash scripts/setup.sh "
                           "tpu), which installs jax[tpu] at this JAX version")
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(platform="tpu", topology_name=topology.topology_name,
                                        chip_config_name=topology.chip.chip_config,
                                        chips_per_host_bounds=topology.host_bounds, num_slices=1,
                                        wrap=(False, False, False))
    return list(desc.devices)


def _abstract(tree, shardings):
    return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def batch_shapes(cfg: RunConfig, shapes: StepShapes) -> TrainBatch:
    """ShapeDtypeStructs of a train-step mini-batch of `shapes.mini_batch_rows` packed rows of `shapes.row_length`
    tokens, each a prompt and its responses in `shapes.responses_per_row` slots of max_new_tokens."""
    rows = shapes.mini_batch_rows
    per_row = (rows, shapes.row_length)
    per_slot = (rows, shapes.responses_per_row, cfg.sampling.max_new_tokens)
    i32, f32 = jnp.int32, jnp.float32
    return TrainBatch(tokens=jax.ShapeDtypeStruct(per_row, i32), positions=jax.ShapeDtypeStruct(per_row, i32),
                      segments=jax.ShapeDtypeStruct(per_row, i32), pred_index=jax.ShapeDtypeStruct(per_slot, i32),
                      response_tokens=jax.ShapeDtypeStruct(per_slot, i32),
                      **{name: jax.ShapeDtypeStruct(per_slot, f32) for name in TrainBatch._fields[5:]})


@dataclasses.dataclass
class ProgramReport:
    name: str
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int  # arguments + outputs - aliased (donated) + temporaries: what XLA allots the program
    flops: float | None
    fits: bool  # resident + the compiler's peak (else the allotment) <= the chip's usable HBM
    hlo_has_splash: bool
    error: str = ""
    resident_bytes: int = 0  # the run's arrays held beside the program, not among its arguments (estimate_memory)
    estimate_bytes: int = 0  # estimate_memory's terms for what the program holds
    # XLA's own peak of the program's buffers, arguments included (`memory_analysis().peak_memory_in_bytes`): on
    # TPU below peak_bytes, and the figure its out-of-HBM check holds the program to (0: not recorded)
    compiler_peak_bytes: int = 0
    # What the program executes, from its optimized HLO (`hlo_stats.program_stats`; results saved before these were
    # recorded read the defaults): the attention kernel ("cudnn", "splash", "xla"), kernels launched per run and
    # conditionals (while-loop trip counts multiplied in), matmul FLOPs per device, the largest array
    attention_kernel: str = ""
    kernels: int = 0
    conditionals: int = 0
    matmul_flops: float = 0.0
    largest_buffer: str = ""
    # the model's matmul FLOPs for the program's work per device (`hlo_stats.model_flops`; 0 where not defined)
    model_flops: float = 0.0
    # compiled for a GPU: seconds per run predicted by `gpu_targets.predict_seconds` (a per-kernel roofline plus a
    # launch cost fitted on one measurement; 0: not a GPU target)
    predicted_s: float = 0.0

    @property
    def need_bytes(self) -> int:
        """What the program needs on a chip: the compiler's peak where recorded, else the allotment."""
        return self.compiler_peak_bytes or self.peak_bytes


def _report(name: str, lowered, usable_bytes: int, needed_flops: float = 0.0) -> ProgramReport:
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as err:  # XLA refuses a program over HBM at compile time
        text = str(err).strip().splitlines()[0][:300]
        return ProgramReport(name, time.perf_counter() - start, 0, 0, 0, 0, 0, None, False, False, text)
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    compiler_peak = int(getattr(mem, "peak_memory_in_bytes", 0) or 0)
    flops = (cost or {}).get("flops")
    text = compiled.as_text()
    stats = program_stats(text)
    report = ProgramReport(name, seconds, mem.argument_size_in_bytes, mem.output_size_in_bytes,
                           mem.alias_size_in_bytes, mem.temp_size_in_bytes, peak, flops, False,
                           "tpu_custom_call" in text, compiler_peak_bytes=compiler_peak,
                           attention_kernel=stats.attention_kernel, kernels=stats.kernels,
                           conditionals=stats.conditionals, matmul_flops=stats.matmul_flops,
                           largest_buffer=stats.largest_buffer, model_flops=needed_flops)
    report.fits = report.need_bytes <= usable_bytes
    report.kernel_costs = kernel_costs(text)  # not a field: read by compile_run for a GPU's prediction
    return report


PROGRAMS = ("train_step", "logprob_pass", "critic_step", "gvm_grad_norms", "sampler_prefill", "sampler_decode",
            "sampler_continuous")


def compile_run(cfg: RunConfig, topology: str | Topology, *, model_config: ModelConfig | None = None,
                devices: list | None = None, only: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Compile `cfg`'s programs for `topology` with the run's mesh (`train.mesh`; empty: every device on fsdp)
    and shardings; `only` (names of PROGRAMS): only those of the run's programs, None every one. Returns
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
    check_mesh_fits(mesh, cfg)  # as the run does
    shapes = step_shapes(cfg, mesh, sampler_mesh)
    estimate = run_estimate(cfg, shapes.mesh, model_config=model_config, platform=_estimate_platform(topo))
    rows = shapes.mini_batch_rows
    batch = batch_shapes(cfg, shapes)
    batch_sharding = batch_shardings(mesh)
    batch = _abstract(batch, batch_sharding)

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
                           state_sharding=state_sharding, batch_sharding=batch_sharding, seed=cfg.train.seed,
                           **lora_kwargs)
    hbm = topo.chip.usable_bytes  # what each program is held to
    # the model's FLOPs per device (the rows split over data x fsdp, the matrices over tensor): each row's prompt and
    # its responses, not the padding slots of the bucket; full fine-tuning's count (LoRA's step needs less)
    work = dict(model_config=mc, rows=rows, prompt_tokens=cfg.data.max_prompt_tokens,
                samples=min(shapes.responses_per_row, shapes.samples_per_prompt),
                response_tokens=cfg.sampling.max_new_tokens)
    per_device = shapes.row_split * shapes.mesh["tensor"]
    programs = []
    if "train_step" in wanted:
        lowered = (step.jitted.lower(state, batch, denom, base) if lora_kwargs else step.lower(state, batch, denom))
        programs.append(_report("train_step", lowered, hbm, model_flops(**work) / per_device))
    if "logprob_pass" in wanted:
        logprob = make_logprob_fn(mc, micro_batch_size=cfg.optim.micro_batch_size, param_sharding=param_sharding,
                                  batch_sharding=batch_sharding)
        programs.append(_report("logprob_pass", logprob.lower(base, batch), hbm,
                               model_flops(**work, backward=False) / per_device))
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
    return _report("critic_step", step.lower(_abstract(shapes, state_sharding), batch, denom), hbm)


def _gvm_program(cfg: RunConfig, shapes: StepShapes, mc: ModelConfig, mesh, policy, hbm: int) -> ProgramReport:
    """GVM's per-sample gradient-norm pass over stage 1's accepted rows at the worst case (every stage-1 sample
    accepted, every prompt `data.max_prompt_tokens` long), as `train.gvm.per_sample_grad_norms` runs it: the
    step's `gvm_rows` unpacked rows of `gvm_row_length` tokens in chunks of `gvm_chunk_rows`."""
    from jaxrl_llm.train.gvm import _grad_norms, parse_param_subset

    rows, length, new = shapes.gvm_rows, shapes.gvm_row_length, cfg.sampling.max_new_tokens
    on_rows = NamedSharding(mesh, P(("data", "fsdp")))
    i32, f32 = jnp.int32, jnp.float32
    inputs = [jax.ShapeDtypeStruct(shape, dtype, sharding=on_rows) for shape, dtype in
              (((rows, length), i32), ((rows,), i32), ((rows, new), i32), ((rows, new), f32))]
    lowered = _grad_norms.lower(_merged_policy(mc, mesh, policy), mc, parse_param_subset(cfg.sampling.gvm_param_subset),
                                shapes.gvm_chunk_rows, *inputs,
                                chunk_sharding=NamedSharding(mesh, P(None, ("data", "fsdp"))))
    return _report("gvm_grad_norms", lowered, hbm)


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
    return _report("sampler_continuous", lowered, hbm)


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
    return [_report("sampler_prefill", prefill, hbm), _report("sampler_decode", decode, hbm)]


def _runtime_config(cfg: RunConfig, model_config: ModelConfig | None = None) -> ModelConfig:
    """The model config the run's programs are traced with (`run.setup.runtime_model_config`)."""

    mc = model_config or model_config_for(cfg.model.source)
    return runtime_model_config(mc.replace(param_dtype=cfg.model.param_dtype), cfg.model, cfg.data.max_prompt_tokens)


def run_estimate(cfg: RunConfig, mesh: dict[str, int], *, model_config: ModelConfig | None = None,
                 platform: str = "tpu") -> dict[str, Any]:
    """`estimate_memory` of `cfg` on mesh sizes {"data", "fsdp", "tensor"} as `compile_run` compares it with XLA's
    programs: the traced model config, the target's attention path ("tpu" or "gpu")."""
    return estimate_memory(cfg, _runtime_config(cfg, model_config), mesh, platform=platform)


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


def usable_bytes(result: dict[str, Any]) -> int:
    """The HBM a program of a `compile_run` result may use: recorded, or (results saved before it was) the
    usable figure of the topology's chip."""
    return result.get("usable_bytes") or parse_topology(result["topology"]).chip.usable_bytes


def place_beside(programs: list[ProgramReport], est: dict[str, Any], hbm: int) -> None:
    """Each program's resident neighbours and the estimate of what it holds, from the estimate's per-program split
    (`capacity.memory.program_memory`); `fits` is resident + XLA's peak (`need_bytes`) against `hbm`, the chip's
    HBM a program may use."""
    for program in programs:
        split = est["programs"].get(program.name, {"resident": 0, "working": 0})
        program.resident_bytes, program.estimate_bytes = split["resident"], split["working"]
        program.fits = not program.error and program.resident_bytes + program.need_bytes <= hbm


def _count(n: int) -> str:
    """A count in at most 8 characters: 8053, 247.2k, 13.85M."""
    return "-" if not n else str(n) if n < 100_000 else f"{n / 1e3:.1f}k" if n < 10 ** 7 else f"{n / 1e6:.2f}M"


def format_report(result: dict[str, Any]) -> str:
    """The table `jaxrl-llm compile` prints."""
    gib = lambda b: f"{b / GIB:7.2f}"  # noqa: E731
    est, usable = result["estimate"], usable_bytes(result)
    lines = [f"{result['topology']} ({result['topology_desc']}, {result['devices']} devices, "
             f"{result['hbm_bytes'] / GIB:.2f} GiB HBM each, {usable / GIB:.2f} usable by a program), "
             f"mesh {result['mesh']}, "
             f"{result['rows']} rows x {result['row_length']} tokens per mini-batch"
             + (f"; the sampler on its own devices, mesh {result['sampler_mesh']}" if "sampler_mesh" in result else ""),
             "GiB per chip: XLA's arguments, outputs and temporaries of the program, the sum it allots (alloc = args + "
             "out - donated + temp) and its own peak of the program's buffers (peak, what its out-of-HBM check "
             "counts); resident = the run's other arrays beside it; use % = peak + resident of the usable HBM; est = "
             "estimate_memory's terms for the program; from the optimized HLO, per device: attn = the attention kernel, "
             "kernels launched per run (loop trip counts multiplied in), mm/model = matmul FLOPs over the model's",
             f"{'program':<18} {'compile s':>9} {'args':>7} {'out':>7} {'temp':>7} {'alloc':>7} {'peak':>7} "
             f"{'resident':>8} {'use %':>6} {'est':>7} {'TFLOP':>8} {'attn':>6} {'kernels':>8} {'mm/model':>8}  fits"]
    for p in result["programs"]:
        if p.error:
            lines.append(f"{p.name:<18} {p.compile_s:9.1f}  does not compile: {p.error}")
            continue
        flops = "" if p.flops is None else f"{p.flops / 1e12:8.2f}"
        share = 100 * (p.need_bytes + p.resident_bytes) / usable
        estimate = gib(p.estimate_bytes) if p.estimate_bytes else f"{'-':>7}"
        compiler = gib(p.compiler_peak_bytes) if p.compiler_peak_bytes else f"{'-':>7}"
        ratio = f"{p.matmul_flops / p.model_flops:8.2f}" if p.model_flops else f"{'-':>8}"
        lines.append(f"{p.name:<18} {p.compile_s:9.1f} {gib(p.argument_bytes)} {gib(p.output_bytes)} "
                     f"{gib(p.temp_bytes)} {gib(p.peak_bytes)} {compiler} {gib(p.resident_bytes):>8} {share:6.1f} "
                     f"{estimate} {flops:>8} {p.attention_kernel or '-':>6} {_count(p.kernels):>8} {ratio}  "
                     f"{'yes' if p.fits else 'NO'}")
    lines.append(f"estimate_memory peak (every program and the sampler): {est['peak'] / GIB:.2f} GiB per device")
    predicted = [f"{p.name} {p.predicted_s:.3g}" for p in result["programs"] if p.predicted_s]
    if predicted:
        lines.append("predicted seconds per run (a prediction: per-kernel roofline + a launch cost fitted on one "
                     "measured train step, gpu_targets.predict_seconds): " + ", ".join(predicted))
    return "\n".join(lines)
