"""Build everything a run needs from its config: policy and tokenizer, reference policy, optimizer and
jitted steps, data stream, evaluation set, verifier, checkpointer and metrics writer.

Several hosts run this same program after `jax.distributed.initialize()`. Every host keeps the same
host-side view of the run, and only device work and verification are divided:
- prompts: every host draws the same global batch of `sampling.prompts_per_step` prompts (the stream
  is a pure function of seed and position; prompt sets are small enough for every host to hold), so
  the run is the same on any number of hosts and its data position is one number;
- sampling: one `generate` over the global mesh; rows are split over data x fsdp, so each host's
  devices decode their own share of the samples, which are then gathered to every host;
- rewards: each host verifies a contiguous 1/P share of the samples and the verdicts are all-gathered
  (`ProcessShareScorer`);
- update: every host packs the same train batch, and `place` makes it one global array with each
  host filling only its own devices' shards (`jax.make_array_from_callback`);
- checkpoints: every host takes part in orbax's save and restore (each writes its own shards, host 0
  the JSON record); metrics, TensorBoard, log lines and the exported model come from host 0 only.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxrl_llm import data as data_lib
from jaxrl_llm import models
from jaxrl_llm.models import lora, quant
from jaxrl_llm.models.moe import route_dtype, route_shape
from jaxrl_llm.models.peft_io import load_peft
from jaxrl_llm.models.sharding import BATCH_SPEC, make_mesh, param_shardings
from jaxrl_llm.run.checkpoint import Checkpointer
from jaxrl_llm.run.config import ConfigError, RunConfig, uses_critic
from jaxrl_llm.run.layout import batch_shardings, check_mesh_fits, place, sharding_of, split_devices
from jaxrl_llm.run.metrics import MetricsWriter
from jaxrl_llm.run.shapes import StepShapes, step_shapes
from jaxrl_llm.run.shapes import lora_spec as config_lora_spec
from jaxrl_llm.run.state import TrainState, init_state, make_optimizer, state_shardings
from jaxrl_llm.sampling.engine import records_routes
from jaxrl_llm.train.algorithms import needs_reference
from jaxrl_llm.train.critic import Critic, critic_trunk, setup_critic
from jaxrl_llm.train.distill import SkippedVerifier, Teacher, make_teacher
from jaxrl_llm.train.packing import TrainBatch
from jaxrl_llm.train.rollouts import RewardScorer, ToolUse, make_tool_use, run_prompt_template
from jaxrl_llm.train.step import make_logprob_fn, make_train_step

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Run:
    config: RunConfig
    model_config: models.ModelConfig
    tokenizer: Any
    state: TrainState
    ref_params: Any  # None when neither KL nor PRL needs a reference policy
    optimizer: Any
    train_step: Any
    logprob_fn: Any
    data: data_lib.RecordBatches
    eval_records: list[dict]
    scorer: RewardScorer
    checkpointer: Checkpointer
    metrics: MetricsWriter
    out_dir: pathlib.Path
    mesh: Any = None
    state_sharding: Any = None  # TrainState of NamedShardings (None: one device)
    batch_sharding: Any = None  # TrainBatch of NamedShardings
    base_params: Any = None  # LoRA: the frozen base (state.params are then the adapters); None: full training
    lora_spec: Any = None  # LoRA: the adapters' models.lora.LoraSpec
    merge_fn: Any = None  # LoRA: jitted (base, adapters) -> base + s A B, on the base's shardings
    critic: Critic | None = None  # PPO with a critic (algorithm.advantage gae): the value model
    tools: ToolUse | None = None  # tool-integrated rollouts (tools.env): the environment and its limits
    split_mesh: Any = None  # rollouts.sampler_devices > 0: the sampler's own mesh (None: it samples on `mesh`)
    teacher: Teacher | None = None  # on-policy distillation (distill.teacher): the frozen teacher and its pass
    shapes: StepShapes | None = None  # the step's shapes on these meshes (`run.shapes.step_shapes`)

    @property
    def sampler_mesh(self):
        """The mesh the sampler decodes on: its own devices' (rollouts.sampler_devices), else the trainer's."""
        return self.mesh if self.split_mesh is None else self.split_mesh

    def policy_params(self):
        """The policy's full parameter tree: the state's params, or under LoRA the base with the adapters
        merged into its weights (W + s A B, computed once per call; what sampling and evaluation read)."""
        if self.base_params is None:
            return self.state.params
        return self.merge_fn(self.base_params, self.state.params)

    def sampler_params(self, policy=None):
        """The weights the sampler reads: `policy` (default `policy_params()`) in `sampling.dtype`
        (`sampler_weights`); the same tree, not a copy, when that key is empty."""
        policy = self.policy_params() if policy is None else policy
        dtype = self.config.sampling.dtype
        return policy if not dtype else _sampler_weights(policy, dtype)

    @property
    def sampler_model_config(self) -> models.ModelConfig:
        """`model_config` as the sampler computes it: bf16 activations and KV cache with sampling.dtype
        bfloat16, else the trainer's."""
        if self.config.sampling.dtype == "bfloat16":
            return self.model_config.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
        return self.model_config

    def place_batch(self, batch: TrainBatch) -> TrainBatch:
        """A host-side packed batch (the same on every process) as arrays on the run's batch sharding. On a mesh the
        sampler's routes travel where its shardings expect them (-1, none recorded, for a batch without)."""
        if self.batch_sharding is not None and (self.batch_sharding.routes is None) != (batch.routes is None):
            batch = batch._replace(routes=None if batch.routes is not None else no_routes(self.model_config,
                                                                                          batch.tokens.shape))
        return place(batch, sharding_of(batch, self.batch_sharding))

    def close(self) -> None:
        self.scorer.close()
        self.metrics.close()
        self.checkpointer.close()


def load_policy(source: str, *, param_dtype: str = "float32", compute_dtype: str = "float32", remat: bool = False,
                remat_policy: str = "full", attention_block_size: int | None = None,
                attention_block_min_length: int = 0, remat_logits: bool = False):
    """(ModelConfig, params, Tokenizer) from "bundled", a .gguf file or an HF folder (config.json + safetensors)."""
    path = pathlib.Path(source).expanduser()
    if source == "bundled":  # not load_bundled's cached arrays: the train step donates the run's parameters
        model_config, params, tokenizer = models.load_gguf(models.bundled_gguf_path(), dtype=param_dtype)
    elif path.suffix == ".gguf":
        model_config, params, tokenizer = models.load_gguf(path, dtype=param_dtype)
    elif path.is_dir():
        model_config, params = models.load_hf(path, dtype=param_dtype)
        tokenizer = models.Tokenizer.from_pretrained(path)
    else:
        raise FileNotFoundError(f"model.source {source!r} is neither 'bundled', a .gguf file nor an HF model folder")
    model_config = model_config.replace(param_dtype=param_dtype, compute_dtype=compute_dtype, remat=remat,
                                        remat_policy=remat_policy, attention_block_size=attention_block_size,
                                        attention_block_min_length=attention_block_min_length,
                                        remat_logits=remat_logits)
    release_free_host_memory()
    return model_config, params, tokenizer


def no_routes(model_config, shape: tuple[int, int]) -> np.ndarray:
    """A packed batch's routes [G, L, L_sparse, k] with nothing recorded (-1): what a batch the sampler recorded no
    routes for carries where the train step's shardings expect them (a mixture of experts on a mesh)."""
    return np.full((*shape, *route_shape(model_config)), -1, np.dtype(route_dtype(model_config.num_experts)))


def write_bound_gb(configured_gb: float, state) -> float:
    """The checkpoint write bound: `train.save_concurrent_gb`, raised to the state's largest array if smaller
    (the writer holds at least one array at a time)."""
    largest = max((x.nbytes for x in jax.tree_util.tree_leaves(state)), default=0)
    return max(configured_gb, largest / 1e9)


def release_free_host_memory() -> None:
    """Hand freed heap pages back to the OS (glibc's `malloc_trim`). Loading dequantizes, transposes and stacks
    every weight in host memory; glibc would otherwise keep about the model's size again of freed pages resident
    for the whole run (0.8 GB for the bundled model). A no-op where the C library has no `malloc_trim`."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


MMAP_THRESHOLD_BYTES = 256 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def map_large_host_allocations() -> bool:
    """Serve every host allocation of `MMAP_THRESHOLD_BYTES` or more with a mapping of its own (glibc's
    `mallopt(M_MMAP_THRESHOLD)`), so a freed buffer's memory goes back to the OS at once. By default glibc raises
    that threshold up to 32 MB as large blocks are freed, and the KV caches, logits and batches a run allocates
    on the CPU backend then fragment a heap that stays resident: 1 GB more after each sampler call of the demo.
    Process-wide and harmless to other code; returns False where the C library has no `mallopt`."""
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


def load_prompts(spec: Any, tokenizer, config: RunConfig) -> list[dict]:
    records = data_lib.load_records(spec)
    kept, _ = data_lib.build_prompts(records, tokenizer, run_prompt_template(config),
                                     max_prompt_tokens=config.data.max_prompt_tokens)
    return kept


def runtime_model_config(model_config, section, max_prompt_tokens: int | None = None) -> Any:
    """`model_config` with the run config's runtime model keys (`model.compute_dtype`, `remat`, `remat_policy`,
    `attention_block_size`, `attention_block_min_length`, `remat_logits`, `attention_impl`, `moe_impl`): how the
    policy is computed, not what it is. `max_prompt_tokens` (the data's bound on prompts) sizes the fused attention
    kernels' regrouped rows."""
    return model_config.replace(compute_dtype=section.compute_dtype, remat=section.remat,
                                remat_policy=section.remat_policy, attention_block_size=section.attention_block_size,
                                attention_block_min_length=section.attention_block_min_length,
                                remat_logits=section.remat_logits, attention_impl=section.attention_impl,
                                moe_impl=section.moe_impl,
                                max_prompt_tokens=max_prompt_tokens)


def setup_run(config: RunConfig, *, policy=None) -> Run:
    """Everything for `train`; `policy` = (ModelConfig, params, tokenizer) skips loading `model.source`
    (the run config's runtime model keys still apply to it, as to a loaded policy)."""
    cfg = config
    map_large_host_allocations()
    model_config, params, tokenizer = policy or load_policy(cfg.model.source, param_dtype=cfg.model.param_dtype)
    model_config = runtime_model_config(model_config, cfg.model, cfg.data.max_prompt_tokens)
    optimizer = make_optimizer(cfg.optim)
    mesh = split_mesh = param_sharding = trained_sharding = state_sharding = batch_sharding = None
    trainer_devices, sampler_devices = split_devices(cfg)
    if cfg.train.mesh or sampler_devices:
        mesh = make_mesh(cfg.train.mesh, devices=trainer_devices)
        check_mesh_fits(mesh, cfg, model_config)
    if sampler_devices:
        split_mesh = make_mesh(cfg.rollouts.sampler_mesh, devices=sampler_devices)
    shapes = step_shapes(cfg, mesh, split_mesh)
    lora_spec, adapters = lora_adapters(cfg, model_config, shapes.lora) if shapes.lora else (None, None)
    if lora_spec is not None and cfg.lora.base_dtype:  # the frozen base's projections as int8 / int4 codes
        params = jax.jit(quant.quantize_base, static_argnums=1)(params, cfg.lora.base_dtype)
    if mesh is not None:
        param_sharding = param_shardings(params, mesh)
        batch_sharding = batch_shardings(mesh, routes=records_routes(model_config))
        trained_sharding = param_sharding if adapters is None else param_shardings(adapters, mesh)
    params = place(params, param_sharding)
    if lora_spec is None:
        trained = params
        # An independent copy: the train step donates (and so frees) the state's parameter buffers.
        ref_params = place(jax.tree_util.tree_map(jnp.copy, params), param_sharding) if needs_reference(
            cfg.algorithm) else None
    else:  # the base is never donated nor updated: it is the reference policy itself, not a copy
        trained = place(adapters, trained_sharding)
        ref_params = params if needs_reference(cfg.algorithm) else None
    if mesh is None:
        state = init_state(trained, optimizer)
    else:  # the optimizer state is created in place, already sharded like its parameters (one program)
        make_state = lambda p: init_state(p, optimizer)  # noqa: E731
        state_sharding = state_shardings(jax.eval_shape(make_state, trained), optimizer, trained_sharding)
        state = jax.jit(make_state, out_shardings=state_sharding)(trained)
    lora_kwargs, merge_fn = {}, None
    if lora_spec is not None:
        lora_kwargs = dict(frozen=params, frozen_sharding=param_sharding, lora_scale=lora_spec.scale)
        merge_fn = jax.jit(functools.partial(merge_policy, scale=lora_spec.scale, dtype=cfg.model.param_dtype),
                           out_shardings=param_sharding)
    critic = make_critic(cfg, model_config, params, mesh, batch_sharding) if uses_critic(cfg) else None
    out_dir = pathlib.Path(cfg.train.out_dir)
    train_records = load_prompts(cfg.data.train, tokenizer, cfg)
    eval_records = load_prompts(cfg.data.eval, tokenizer, cfg)[:cfg.train.eval_problems]
    # Every process draws the same global prompt batch (see the module docstring), not a shard of its own.
    loader = data_lib.LoaderConfig(batch_size=cfg.sampling.prompts_per_step, seed=cfg.data.seed, shard_index=0,
                                   shard_count=1)
    scorer = RewardScorer(cfg.algorithm, cfg.sampling, timeout=cfg.train.verifier_timeout,
                          workers=verifier_workers(cfg)) if cfg.distill.reward == "add" or not cfg.distill.teacher \
        else SkippedVerifier()
    teacher = make_teacher(cfg.distill, model_config, params, mesh=mesh, batch_sharding=batch_sharding,
                           micro_batch_size=cfg.optim.micro_batch_size, copy=lora_spec is None,
                           load=lambda source, dtype: load_policy(source, param_dtype=dtype),
                           configure=lambda c: runtime_model_config(c, cfg.model, cfg.data.max_prompt_tokens))
    return Run(
        config=cfg, model_config=model_config, tokenizer=tokenizer, state=state, ref_params=ref_params,
        optimizer=optimizer,
        train_step=make_train_step(model_config, cfg.algorithm, optimizer, micro_batch_size=cfg.optim.micro_batch_size,
                                   state_sharding=state_sharding, seed=cfg.train.seed, distill_coef=cfg.distill.coef,
                                   batch_sharding=batch_sharding if mesh is None or cfg.distill.mode != "topk"
                                   else batch_shardings(mesh, topk=True, routes=records_routes(model_config)),
                                   routing_replay=cfg.model.routing_replay,
                                   router_aux_loss_coef=cfg.model.router_aux_loss_coef, **lora_kwargs),
        logprob_fn=make_logprob_fn(model_config, micro_batch_size=cfg.optim.micro_batch_size,
                                   param_sharding=param_sharding, batch_sharding=batch_sharding,
                                   routing_replay=cfg.model.routing_replay),
        data=data_lib.RecordBatches(train_records, loader), eval_records=eval_records,
        scorer=ProcessShareScorer(scorer) if jax.process_count() > 1 else scorer,
        checkpointer=Checkpointer(out_dir / "checkpoints", keep=cfg.train.keep_checkpoints,
                                  save_concurrent_gb=write_bound_gb(cfg.train.save_concurrent_gb,
                                                                     (state, None if critic is None else critic.state))),
        metrics=MetricsWriter(out_dir), out_dir=out_dir, mesh=mesh, state_sharding=state_sharding,
        batch_sharding=batch_sharding, base_params=None if lora_spec is None else params, lora_spec=lora_spec,
        merge_fn=merge_fn, critic=critic, tools=make_tool_use(cfg.tools, tokenizer, model=cfg.model.source),
        split_mesh=split_mesh, teacher=teacher, shapes=shapes)


def verifier_workers(cfg: RunConfig) -> int:
    """`train.verifier_workers`, or 1 where 0 would verify without a wall-clock limit: asynchronous rollouts score
    in the sampler thread, and the in-process limit (SIGALRM) holds in the main thread only."""
    if cfg.train.verifier_workers == 0 and cfg.rollouts.mode == "async":
        logger.info("rollouts.mode async: the verifier runs in a pool of 1 process (train.verifier_workers=0 would "
                    "score in the sampler thread without a time limit)")
        return 1
    return cfg.train.verifier_workers


def make_critic(cfg: RunConfig, model_config, policy_params, mesh, batch_sharding) -> Critic:
    """The value model of PPO with a critic: its trunk from the policy's parameters (under LoRA the base's) or
    from `critic.source`, placed like a policy on the run's mesh."""
    critic_config, trunk, head = critic_trunk(
        cfg.critic, model_config, policy_params, param_dtype=cfg.model.param_dtype,
        load=lambda source: load_policy(source, param_dtype=cfg.model.param_dtype))
    if trunk is not policy_params and mesh is not None:
        trunk = place(trunk, param_shardings(trunk, mesh))
    return setup_critic(cfg.critic, cfg.optim, critic_config, trunk, mesh=mesh, batch_sharding=batch_sharding,
                        head=head)


def sampler_weights(policy, dtype: str):
    """The sampler's copy of the policy's parameter tree in `sampling.dtype`: "bfloat16" casts every floating
    leaf to bf16; "int8" quantizes every projection (`models.quant.quantize_base`: per output channel,
    scale_o = max_i |W_io| / 127) and keeps embeddings and norms; "" returns `policy` itself."""
    if dtype == "bfloat16":
        return jax.tree_util.tree_map(
            lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, policy)
    if dtype == "int8":
        return quant.quantize_base(policy, "int8")
    if dtype:
        raise ValueError(f"sampling.dtype must be '', 'bfloat16' or 'int8', got {dtype!r}")
    return policy


_sampler_weights = jax.jit(sampler_weights, static_argnums=1)


def merge_policy(base, adapters, scale: float, dtype: str):
    """The policy a LoRA run samples from: W + s A B for every adapted W, with a quantized base's projections
    dequantized to `dtype` (model.param_dtype) first, so the tree is the one an unquantized base gives."""
    return lora.merge(quant.dequantize_base(base, jnp.dtype(dtype)), adapters, scale)


def lora_adapters(cfg: RunConfig, model_config, spec: lora.LoraSpec | None = None) -> tuple[lora.LoraSpec, Any]:
    """(LoraSpec, adapters) of a LoRA run: read from the PEFT folder `lora.adapter`, else new ones of `spec`
    (default: the config's, `run.shapes.lora_spec`: `lora.rank`, `lora.alpha`, `lora.targets`; A random from
    `lora.seed`, B = 0)."""
    section = cfg.lora
    if not section.adapter:
        spec = spec or config_lora_spec(cfg)
        return spec, lora.init_adapters(model_config, spec, jax.random.PRNGKey(section.seed))
    try:
        spec, adapters = load_peft(section.adapter, model_config)
    except (OSError, ValueError) as err:
        raise ConfigError(f"config key 'lora.adapter': {err}") from None
    if section.rank not in (0, spec.rank):
        raise ConfigError(f"config key 'lora.rank'={section.rank} differs from the rank r={spec.rank} of the adapter "
                          f"in lora.adapter={section.adapter!r}; set lora.rank=0 or {spec.rank}")
    return spec, adapters


class ProcessShareScorer:
    """A RewardScorer split over processes: process p verifies samples [p * s, (p + 1) * s) with
    s = ceil(N / P), and the verdicts and rewards are all-gathered, so every process returns all N.
    The result equals the wrapped scorer on all N (each verdict depends on its own sample only)."""

    def __init__(self, scorer: RewardScorer):
        self.scorer = scorer
        self.last_seconds = 0.0

    def __call__(self, texts: list[str], golds: list[str], lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        from jax.experimental import multihost_utils

        if not texts:
            return self.scorer(texts, golds, lengths)
        started = time.perf_counter()
        n, count, index = len(texts), jax.process_count(), jax.process_index()
        share = -(-n // count)
        lo, hi = min(index * share, n), min((index + 1) * share, n)
        correct, rewards = np.zeros(share, np.bool_), np.zeros(share, np.float32)
        if hi > lo:
            correct[:hi - lo], rewards[:hi - lo] = self.scorer(texts[lo:hi], golds[lo:hi], np.asarray(lengths)[lo:hi])
        correct, rewards = multihost_utils.process_allgather((correct, rewards), tiled=True)
        self.last_seconds = time.perf_counter() - started
        return np.asarray(correct)[:n], np.asarray(rewards, np.float32)[:n]

    def close(self) -> None:
        self.scorer.close()
