"""The shapes of one training step, decided once from the run config and its mesh.

`step_shapes(config, mesh)` is the one place that derives them; `run.setup` builds the run from it, and the memory
estimate (`capacity.memory`) and the compiler (`capacity.aot`, `jaxrl-llm compile`) count and compile the same
shapes. It holds:
- where the sampler runs: on the trainer's devices, or (asynchronous rollouts with `rollouts.sampler_devices` = n)
  on the last n devices laid out as `rollouts.sampler_mesh`; and what its programs read ("policy": the trainer's
  policy, under LoRA the merged copy; "copy": a copy of its own beside the trainer's state, an asynchronous version
  or `sampling.dtype`'s; "own": a version on its own devices);
- samples per prompt: those of a step that trains (`samples_per_prompt`, GVM's later-step count
  `gvm_samples_per_prompt`) and the most one sampler call draws (GVM: the larger of its stage-1 and later counts,
  which vary from prompt to prompt, so no rows share a prompt entry of the static engine's cache);
- the sampler's worst-case call (`sampling.plan.plan_calls` on every prompt at `data.max_prompt_tokens` and every
  prompt at the most samples; with tools.env every prompt keeps its cache entry);
- the train step's packed rows: responses per row (the mean group, a power of two, or what fits
  `optim.max_row_tokens`), the row length on the packer's grid, rows per device of a micro-batch, rows of a
  mini-batch;
- GVM's per-sample gradient-norm pass: rows per chunk (rounded up to the data x fsdp devices), its rows (stage 1's,
  every sample accepted, whole chunks) and their length (the prompt and every max_new_tokens column);
- the LoRA adapters' spec from the config.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from jaxrl_llm.models.lora import LoraSpec, resolve_targets
from jaxrl_llm.models.sharding import MESH_AXES, batch_devices
from jaxrl_llm.run.config import RunConfig, lora_enabled
from jaxrl_llm.sampling.buckets import round_up
from jaxrl_llm.sampling.plan import CallPlan, plan_calls
from jaxrl_llm.train.packing import bucket, length_bucket

ROW_SEQ_MULTIPLE = 32  # packed rows are padded to a multiple of this (train.packing.pack_groups)


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: the call plan holds arrays
class StepShapes:
    """One training step's shapes on a mesh (see the module docstring); sizes per step unless named per device."""

    mesh: dict[str, int]  # the trainer's mesh sizes {"data", "fsdp", "expert", "tensor"}
    sampler_mesh: dict[str, int]  # the sampler's: its own devices' with sampler_devices > 0, else `mesh`
    sampler_devices: int  # devices of the sampler's own (asynchronous rollouts); 0: it shares the trainer's
    sampler_reads: str  # "policy", "copy" or "own" (see the module docstring)
    samples_per_prompt: int  # samples per prompt of a step that trains (GVM: gvm_samples_per_prompt)
    sampler_samples: int  # the most samples per prompt one sampler call draws (GVM: max of its two stages)
    varying_counts: bool  # GVM: counts vary from prompt to prompt; one prompt entry per row
    sampler_call: CallPlan  # the sampler's first call at the worst case
    responses_per_row: int  # response slots of a packed row
    response_tokens: int  # tokens of a response as counted (max_new_tokens x the fill)
    row_length: int  # tokens of a packed row
    rows_per_device: int  # rows of a micro-batch each data x fsdp device holds
    mini_batch_rows: int  # rows of one train-step mini-batch (at least a micro-batch)
    gvm_chunk: int  # rows per chunk of GVM's norm pass as configured (0: no GVM)
    gvm_chunk_rows: int  # the chunk rounded up to the data x fsdp devices (0: no GVM)
    gvm_rows: int  # the norm pass's rows: stage 1's samples in whole chunks (0: no GVM)
    gvm_row_length: int  # an unpacked row: the prompt and every max_new_tokens column (0: no GVM)
    lora: LoraSpec | None  # the adapters' spec from the config (None: full fine-tuning)

    @property
    def row_split(self) -> int:
        """Devices a batch's rows are split over on the trainer's mesh (data x fsdp x expert)."""
        return batch_devices(self.mesh)

    @property
    def sampler_row_split(self) -> int:
        """Devices a sampler call's rows are split over (data x fsdp x expert of the sampler's mesh)."""
        return batch_devices(self.sampler_mesh)

    @property
    def prompt_group(self) -> int:
        """Rows per prompt entry of the static engine's cache in the worst case: the call's, 1 with varying counts."""
        return 1 if self.varying_counts else self.sampler_call.shapes.prompt_group

    @property
    def mini_batch_rows_per_device(self) -> int:
        """Rows of one train-step mini-batch each data x fsdp x expert device holds (the last device's share may be
        padding: rounded up)."""
        return -(-self.mini_batch_rows // self.row_split)

    @property
    def gvm_chunk_rows_per_device(self) -> int:
        """Rows of one chunk of GVM's norm pass each data x fsdp device differentiates."""
        return self.gvm_chunk_rows // self.row_split


def parse_mesh(spec: str, devices: int) -> dict[str, int]:
    """{"data", "fsdp", "expert", "tensor"} sizes from a `train.mesh` string for `devices` devices, with
    `models.sharding.make_mesh`'s rules: missing axes are 1, one axis may be -1 (the rest), "" = all fsdp."""
    sizes = {name: 1 for name in MESH_AXES}
    if not spec.strip():
        sizes["fsdp"] = -1
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in sizes or not re.fullmatch(r"-?\d+", value.strip()):
            raise ValueError(f"mesh spec {spec!r}: expected comma-separated axis=size with axes {MESH_AXES}")
        sizes[name.strip()] = int(value)
    free = [n for n, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"mesh spec {spec!r}: at most one axis may be -1")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        sizes[free[0]] = devices // fixed if devices % fixed == 0 else 0
    if any(s < 1 for s in sizes.values()) or math.prod(sizes.values()) != devices:
        raise ValueError(f"mesh spec {spec!r} gives {sizes}, which do not multiply to {devices} devices")
    return sizes


def mesh_sizes(mesh) -> dict[str, int]:
    """{"data", "fsdp", "expert", "tensor"} sizes of `mesh`: a `jax.sharding.Mesh`, a dict of sizes, or None (one
    device). A dict without "expert" (written before that axis) has expert 1."""
    sizes = {name: 1 for name in MESH_AXES} if mesh is None else {"expert": 1, **{k: int(v) for k, v in dict(
        mesh.shape if hasattr(mesh, "shape") else mesh).items()}}
    if set(sizes) != set(MESH_AXES) or any(v < 1 for v in sizes.values()):
        raise ValueError(f"mesh must give a size >= 1 for each of {MESH_AXES}, got {sizes}")
    return {name: sizes[name] for name in MESH_AXES}  # in the mesh's order


def lora_spec(config: RunConfig) -> LoraSpec | None:
    """The adapters' spec from the config's lora section (None without LoRA). A run continuing from `lora.adapter`
    with lora.rank 0 reads its rank from the adapter; the config alone then counts rank 1."""
    if not lora_enabled(config):
        return None
    section = config.lora
    return LoraSpec(rank=max(section.rank, 1), alpha=section.alpha, targets=resolve_targets(section.targets))


def sampler_reads(config: RunConfig) -> str:
    """What the sampler's programs read and where: "own" (rollouts.sampler_devices: its own copies on its own
    devices), "copy" (its own copy beside the trainer's state: an async version, or sampling.dtype's), "policy"
    (the trainer's policy itself, under LoRA the merged copy)."""
    if config.rollouts.mode == "async" and config.rollouts.sampler_devices > 0:
        return "own"
    return "copy" if config.rollouts.mode == "async" or config.sampling.dtype else "policy"


def _row_shape(config: RunConfig, responses: int, response_tokens: int) -> tuple[int, int]:
    """(responses per packed row, row length) with `responses` per prompt of `response_tokens` each: the group whole,
    or with optim.max_row_tokens the responses that fit (at least one) and a length within that bound."""
    prompt = config.data.max_prompt_tokens
    if config.optim.max_row_tokens > 0:
        fit = max(1, (config.optim.max_row_tokens - prompt) // response_tokens)
        responses = bucket(min(responses, fit))
        return responses, length_bucket(min(prompt + responses * response_tokens,
                                            max(config.optim.max_row_tokens, prompt + response_tokens)),
                                        ROW_SEQ_MULTIPLE)
    return responses, length_bucket(prompt + responses * response_tokens, ROW_SEQ_MULTIPLE)


def whole_row_responses(config: RunConfig) -> int:
    """Response slots of a packed row without optim.max_row_tokens (train.rollouts.max_row_responses): the
    mean group size, N'' under GVM (larger groups are split over rows), rounded up to a power of two."""
    s = config.sampling
    return bucket(s.gvm_samples_per_prompt if s.allocation == "gvm" else s.samples_per_prompt)


def worst_case_call(config: RunConfig, samples: int, row_multiple: int) -> CallPlan:
    """The sampler's first call with every prompt `data.max_prompt_tokens` long and `samples` samples each, as
    `sampling.plan.plan_calls` plans it for the run's engine (with tools.env every prompt keeps its entry)."""
    s = config.sampling
    return plan_calls(np.full(s.prompts_per_step, config.data.max_prompt_tokens), np.full(s.prompts_per_step, samples),
                      s.max_new_tokens, engine=s.engine, row_multiple=row_multiple,
                      max_rows_per_call=s.max_rows_per_call, max_slots=s.max_slots,
                      max_prompt_entries=s.max_prompt_entries, every_prompt=bool(config.tools.env))[0]


def step_shapes(config: RunConfig, mesh=None, sampler_mesh=None, *, response_fill: float = 1.0) -> StepShapes:
    """The step's shapes of `config` on `mesh` (a `jax.sharding.Mesh`, a dict of sizes, or None: one device);
    `sampler_mesh`: the sampler's own mesh (default: `rollouts.sampler_mesh` over `rollouts.sampler_devices` with
    asynchronous rollouts, else `mesh`); `response_fill` scales the response length (1.0: every response reaches
    max_new_tokens)."""
    if not 0 < response_fill <= 1:
        raise ValueError(f"response_fill must be in (0, 1], got {response_fill}")
    cfg, s = config, config.sampling
    sizes = mesh_sizes(mesh)
    own = cfg.rollouts.sampler_devices if cfg.rollouts.mode == "async" else 0
    if own and sampler_mesh is None:
        sampler_sizes = parse_mesh(cfg.rollouts.sampler_mesh, own)
    else:
        sampler_sizes = sizes if sampler_mesh is None else mesh_sizes(sampler_mesh)
    gvm = s.allocation == "gvm"
    sampler_samples = max(s.gvm_stage1_samples, s.gvm_samples_per_prompt) if gvm else s.samples_per_prompt
    split = batch_devices(sizes)
    response_tokens = max(1, int(math.ceil(s.max_new_tokens * response_fill)))
    per_row, row_length = _row_shape(cfg, whole_row_responses(cfg), response_tokens)
    gvm_chunk = (s.gvm_rows_per_chunk or cfg.optim.micro_batch_size) if gvm else 0
    gvm_chunk_rows = -(-gvm_chunk // split) * split  # as train.gvm.per_sample_grad_norms rounds it
    return StepShapes(
        mesh=sizes, sampler_mesh=sampler_sizes, sampler_devices=own, sampler_reads=sampler_reads(cfg),
        samples_per_prompt=s.gvm_samples_per_prompt if gvm else s.samples_per_prompt,
        sampler_samples=sampler_samples, varying_counts=gvm,
        sampler_call=worst_case_call(cfg, sampler_samples, batch_devices(sampler_sizes)),
        responses_per_row=per_row, response_tokens=response_tokens, row_length=row_length,
        rows_per_device=-(-cfg.optim.micro_batch_size // split),
        mini_batch_rows=bucket(-(-s.prompts_per_step // cfg.optim.mini_batches),
                               max(cfg.optim.micro_batch_size, split)),
        gvm_chunk=gvm_chunk, gvm_chunk_rows=gvm_chunk_rows,
        gvm_rows=round_up(s.prompts_per_step * s.gvm_stage1_samples, gvm_chunk_rows) if gvm else 0,
        gvm_row_length=round_up(cfg.data.max_prompt_tokens + s.max_new_tokens, ROW_SEQ_MULTIPLE) if gvm else 0,
        lora=lora_spec(cfg))
