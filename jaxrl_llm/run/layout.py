"""Where a run's arrays live: which devices train and which sample, and how host values become sharded
arrays on the mesh.

Meshes. With `train.mesh` (e.g. "data=2,fsdp=2,tensor=2") one `jax.sharding.Mesh` spans every device
of every process. Parameters are placed by the partition rules beside the model
(`models.sharding.param_shardings`), the optimizer state follows its parameters
(`state.state_shardings`), the reference policy sits on the same mesh, and packed train batches split
their rows over data x fsdp x expert (`models.sharding.BATCH_SPEC`); the train step and the log-prob pass are
compiled with these shardings, and the sampler and evaluation get the mesh. The `expert` axis splits a mixture of
experts' experts (expert parallelism, `models.expert_parallel`) and is a data axis everywhere else.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxrl_llm.models.sharding import BATCH_SPEC, axis_size, batch_devices
from jaxrl_llm.run.config import ConfigError, RunConfig
from jaxrl_llm.train.packing import TrainBatch


def split_devices(cfg: RunConfig, devices: list | None = None) -> tuple[list | None, list | None]:
    """(the trainer's devices, the sampler's) of `devices` (default: this run's, `jax.devices()`) with
    `rollouts.sampler_devices` = n > 0: the last n devices sample, the others train; (None, None) when both share
    every device. The devices must be one host's (`jaxrl-llm compile` splits a TPU slice's the same way)."""
    n = cfg.rollouts.sampler_devices
    if not n:
        return None, None
    devices = jax.devices() if devices is None else devices
    hosts = len({d.process_index for d in devices})
    if hosts > 1:
        raise ConfigError("config key 'rollouts.sampler_devices' runs on one host only for now (the sampler's devices "
                          f"would span hosts), and these devices are on {hosts} hosts (processes); compile for a "
                          "one-host slice: v5litepod-8, v6e-8, v4-8, v5p-8")
    if n >= len(devices):
        raise ConfigError(f"config key 'rollouts.sampler_devices'={n} leaves no device to train on: there are "
                          f"{len(devices)} ({devices[0].platform})")
    return devices[:-n], devices[-n:]


def check_mesh_fits(mesh, cfg: RunConfig, model_config=None) -> None:
    """Each micro-batch's packed rows are split over the data x fsdp x expert devices, so its size must divide.
    With the policy's `model_config`, an `expert` axis over 1 needs a mixture of experts whose num_experts it
    divides (each expert shard holds num_experts / expert of them), and no GVM allocation (not run with it yet)."""
    row_devices = batch_devices(mesh)
    if cfg.optim.micro_batch_size % row_devices:
        raise ConfigError(f"optim.micro_batch_size={cfg.optim.micro_batch_size} must be a multiple of data x fsdp x "
                          f"expert = {row_devices} of train.mesh={cfg.train.mesh!r}: each micro-batch's rows are "
                          f"split over those devices")
    experts = axis_size(mesh, "expert")
    if experts == 1 or model_config is None:
        return
    num_experts = getattr(model_config, "num_experts", 0)
    if not num_experts:
        raise ConfigError(f"train.mesh={cfg.train.mesh!r} has expert={experts}, but the policy is a dense model "
                          "(num_experts 0): the expert axis splits a mixture of experts' experts; put those "
                          "devices on data or fsdp")
    if num_experts % experts:
        raise ConfigError(f"train.mesh={cfg.train.mesh!r}: expert={experts} does not divide the model's "
                          f"num_experts={num_experts}; each expert shard holds num_experts / expert experts")
    if cfg.sampling.allocation == "gvm":  # its per-row vmap names the batch axes, which the exchange's shard_map uses
        raise ConfigError(f"sampling.allocation='gvm' does not run on a mesh with an expert axis yet (train.mesh="
                          f"{cfg.train.mesh!r} has expert={experts}): put those devices on data or fsdp")


def batch_shardings(mesh, *, topk: bool = False, routes: bool = False) -> TrainBatch:
    """NamedShardings of a packed TrainBatch on `mesh`: every field's rows split over data x fsdp x expert
    (`BATCH_SPEC`), replicated over tensor. The teacher's top-K fields are None unless `topk` (a batch of
    `distill.mode` topk's train step: `sharding_of` picks the one that matches a batch), the sampler's routes
    unless `routes` (a mixture of experts' batches carry them)."""
    rows = NamedSharding(mesh, BATCH_SPEC)
    out = TrainBatch(*[rows] * len(TrainBatch._fields))._replace(routes=rows if routes else None)
    return out if topk else out._replace(teacher_ids=None, teacher_topk_logp=None)


def sharding_of(batch: TrainBatch, shardings: TrainBatch | None) -> TrainBatch | None:
    """`shardings` (a `batch_shardings` tree, or None) with the teacher's top-K fields where `batch` has them and
    None where it does not."""
    if shardings is None:
        return None
    rows = shardings.tokens
    topk = batch.teacher_ids is not None
    return shardings._replace(teacher_ids=rows if topk else None, teacher_topk_logp=rows if topk else None)


def place(tree, shardings):
    """`tree` (host or device arrays holding the same values on every process) placed on `shardings`, a
    matching tree of NamedShardings; None returns `tree` as it is. With several processes each fills
    only its own devices' shards from its copy (`jax.make_array_from_callback`): no cross-host traffic."""
    if shardings is None:
        return tree
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def put(value, sharding):
        if isinstance(value, jax.Array) and not value.is_fully_addressable:  # already a global array
            return jax.device_put(value, sharding)
        host = np.asarray(value)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree_util.tree_map(put, tree, shardings)
