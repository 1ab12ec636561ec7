"""Build everything a run needs from its config: policy and tokenizer, reference policy, optimizer and
jitted steps, data stream, evaluation set, verifier, checkpointer and metrics writer."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm import data as data_lib
from jaxrl_llm import models
from jaxrl_llm.models.sharding import make_mesh, shard_params
from jaxrl_llm.train.algorithms import needs_reference
from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.config import RunConfig
from jaxrl_llm.train.metrics import MetricsWriter
from jaxrl_llm.train.rollouts import RewardScorer
from jaxrl_llm.train.state import TrainState, init_state, make_optimizer
from jaxrl_llm.train.step import make_logprob_fn, make_train_step


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

    def close(self) -> None:
        self.scorer.close()
        self.metrics.close()
        self.checkpointer.close()


def load_policy(source: str, *, param_dtype: str = "float32", compute_dtype: str = "float32", remat: bool = False):
    """(ModelConfig, params, Tokenizer) from "bundled", a .gguf file or an HF folder (config.json + safetensors)."""
    path = pathlib.Path(source).expanduser()
    if source == "bundled":
        model_config, params, tokenizer = models.load_bundled(param_dtype)
    elif path.suffix == ".gguf":
        model_config, params, tokenizer = models.load_gguf(path, dtype=param_dtype)
    elif path.is_dir():
        model_config, params = models.load_hf(path, dtype=param_dtype)
        tokenizer = models.Tokenizer.from_pretrained(path)
    else:
        raise FileNotFoundError(f"model.source {source!r} is neither 'bundled', a .gguf file nor an HF model folder")
    model_config = model_config.replace(param_dtype=param_dtype, compute_dtype=compute_dtype, remat=remat)
    return model_config, params, tokenizer


def load_prompts(spec: Any, tokenizer, config: RunConfig) -> list[dict]:
    records = data_lib.load_records(spec)
    kept, _ = data_lib.build_prompts(records, tokenizer, config.data.prompt,
                                     max_prompt_tokens=config.data.max_prompt_tokens)
    return kept


def setup_run(config: RunConfig, *, policy=None) -> Run:
    """Everything for `train`; `policy` = (ModelConfig, params, tokenizer) skips loading `model.source`."""
    cfg = config
    model_config, params, tokenizer = policy or load_policy(
        cfg.model.source, param_dtype=cfg.model.param_dtype, compute_dtype=cfg.model.compute_dtype,
        remat=cfg.model.remat)
    mesh = None
    if cfg.train.mesh:
        mesh = make_mesh(cfg.train.mesh)
        params = shard_params(params, mesh)
    ref_params = jax.tree_util.tree_map(jnp.copy, params) if needs_reference(cfg.algorithm) else None
    optimizer = make_optimizer(cfg.optim)
    out_dir = pathlib.Path(cfg.train.out_dir)
    train_records = load_prompts(cfg.data.train, tokenizer, cfg)
    eval_records = load_prompts(cfg.data.eval, tokenizer, cfg)[:cfg.train.eval_problems]
    loader = data_lib.LoaderConfig(batch_size=cfg.sampling.prompts_per_step, seed=cfg.data.seed)
    return Run(
        config=cfg, model_config=model_config, tokenizer=tokenizer, state=init_state(params, optimizer),
        ref_params=ref_params, optimizer=optimizer,
        train_step=make_train_step(model_config, cfg.algorithm, optimizer, micro_batch_size=cfg.optim.micro_batch_size),
        logprob_fn=make_logprob_fn(model_config), data=data_lib.RecordBatches(train_records, loader),
        eval_records=eval_records,
        scorer=RewardScorer(cfg.algorithm, cfg.sampling, timeout=cfg.train.verifier_timeout,
                            workers=cfg.train.verifier_workers),
        checkpointer=Checkpointer(out_dir / "checkpoints", keep=cfg.train.keep_checkpoints),
        metrics=MetricsWriter(out_dir), out_dir=out_dir, mesh=mesh)
