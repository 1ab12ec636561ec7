"""On-policy distillation in the trainer (the `distill` config section, docs/distillation.md).

The student samples as usual; a teacher scores every sampled token with one more packed, jitted log-prob pass on
the trainer's mesh (like the KL reference's), and each token's advantage becomes coef x (log pi_T - log pi_S)
(`objectives.reverse_kl_advantages`, with the sampler's log-probs as pi_S), alone or added to the algorithm's.
The teacher is frozen and rebuilt from the config, so checkpoints and `--resume` hold nothing of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import objectives
from jaxrl_llm.models import lora, quant
from jaxrl_llm.models.peft_io import load_peft
from jaxrl_llm.models.sharding import param_shardings
from jaxrl_llm.run.config import ConfigError, DistillSection
from jaxrl_llm.run.layout import place
from jaxrl_llm.train.logprobs import response_topk
from jaxrl_llm.train.step import jit_packed_pass, make_logprob_fn


@dataclasses.dataclass
class Teacher:
    """A frozen teacher: its weights (placed on the trainer's mesh), model config and jitted packed log-prob pass."""

    params: Any
    model_config: Any
    logprob_fn: Callable  # (params, packed TrainBatch) -> log-probs [G, S, R] of the batch's response tokens
    # distill.mode topk: (params, packed TrainBatch) -> (ids, log-probs) [G, S, R, top_k] (logprobs.response_topk)
    topk_fn: Callable | None = None


def teacher_weights(section: DistillSection, policy_config, policy_params, *, load: Callable,
                    configure: Callable = lambda c: c) -> tuple[Any, Any]:
    """(model config, params) of `distill.teacher`: "policy" takes `policy_params` (the student's starting weights,
    the LoRA base) as they are, anything else `load(source, param_dtype) -> (config, params, tokenizer)`, then
    `configure` (the run's runtime model keys). A `distill.adapter` is merged in (W + s A B); `teacher_dtype`
    bfloat16 computes the teacher in bf16, int8 quantizes its projections per output channel
    (`models.quant.quantize_base`). A vocabulary other than the policy's is a ConfigError naming both sizes."""
    if section.teacher == "policy":
        config, params = policy_config, policy_params
    else:
        load_dtype = "bfloat16" if section.teacher_dtype == "bfloat16" else "float32"
        config, params, _ = load(section.teacher, load_dtype)
        config = configure(config)
        if config.vocab_size != policy_config.vocab_size:
            raise ConfigError(f"config key 'distill.teacher'={section.teacher!r}: the teacher's vocabulary has "
                              f"{config.vocab_size} tokens and the policy's {policy_config.vocab_size}; a teacher "
                              f"must share the policy's tokenizer and vocabulary")
    if section.adapter:
        try:
            spec, adapters = load_peft(section.adapter, config)
        except (OSError, ValueError) as err:
            raise ConfigError(f"config key 'distill.adapter': {err}") from None
        params = jax.jit(lora.merge, static_argnums=2)(params, adapters, spec.scale)
    if section.teacher_dtype == "bfloat16":
        config = config.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
        params = jax.tree_util.tree_map(
            lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    elif section.teacher_dtype == "int8":
        params = jax.jit(quant.quantize_base, static_argnums=1)(quant.dequantize_base(params), "int8")
    return config, params


def make_teacher(section: DistillSection, policy_config, policy_params, *, load: Callable,
                 configure: Callable = lambda c: c, mesh=None, batch_sharding=None,
                 micro_batch_size: int | None = None, copy: bool = False) -> Teacher | None:
    """The run's teacher (None without `distill.teacher`), placed on `mesh` like a policy, with its packed log-prob
    pass in micro-batches of `micro_batch_size` rows. `copy`: "policy" takes an independent copy of
    `policy_params` (the full-training state's buffers are donated by the train step)."""
    if not section.teacher:
        return None
    config, params = teacher_weights(section, policy_config, policy_params, load=load, configure=configure)
    if copy and params is policy_params:
        params = jax.tree_util.tree_map(jnp.copy, params)
    sharding = None
    if mesh is not None:
        sharding = param_shardings(params, mesh)
        params = place(params, sharding)
    fn = make_logprob_fn(config, micro_batch_size=micro_batch_size, param_sharding=sharding,
                         batch_sharding=batch_sharding)
    topk_fn = None
    if section.mode == "topk":
        topk_fn = make_topk_fn(section, config, micro_batch_size=micro_batch_size, param_sharding=sharding,
                               batch_sharding=batch_sharding)
    return Teacher(params=params, model_config=config, logprob_fn=fn, topk_fn=topk_fn)


def make_topk_fn(section: DistillSection, config, *, micro_batch_size: int | None = None, param_sharding=None,
                 batch_sharding=None) -> Callable:
    """The teacher's jitted packed top-K pass `(params, batch) -> (ids, log-probs)` [G, S, R, top_k], in
    micro-batches like its log-prob pass. A top_k above the vocabulary is a ConfigError naming both."""
    if section.top_k > config.vocab_size:
        raise ConfigError(f"config key 'distill.top_k'={section.top_k} must be at most the vocabulary's "
                          f"{config.vocab_size} tokens")
    return jit_packed_pass(lambda params, batch: response_topk(params, config, batch, section.top_k),
                           micro_batch_size=micro_batch_size, param_sharding=param_sharding,
                           batch_sharding=batch_sharding)


def distill_advantages(section: DistillSection, advantages: np.ndarray, sampler_logp: np.ndarray,
                       teacher_logp: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
    """([R, N] advantages, metrics) of a rollout batch: coef x (teacher_logp - sampler_logp) on each response
    token (mode sampled; 0 with topk, whose signal is a loss), plus the algorithm's `advantages` with `reward: add`
    (alone with `none`). Metrics over the response tokens: distill_reverse_kl, the mean of log pi_S - log pi_T (a
    one-sample estimate of KL(pi_S || pi_T) per token), and teacher_logp, the mean of log pi_T."""
    term = np.asarray(objectives.reverse_kl_advantages(sampler_logp, teacher_logp, mask), np.float32)
    on = mask != 0
    tokens = max(int(on.sum()), 1)
    out = np.float32(section.coef if section.mode == "sampled" else 0.0) * term
    if section.reward == "add":
        out = out + np.asarray(advantages, np.float32)
    metrics = {"distill_reverse_kl": float(-term[on].sum() / tokens),
               "teacher_logp": float(np.where(on, teacher_logp, 0.0).sum() / tokens)}
    return out * on, metrics


class SkippedVerifier:
    """The scorer of `distill.reward: none`: every sample gets reward 0 and is not verified (no verifier runs)."""

    last_seconds = 0.0

    def __call__(self, texts: list[str], golds: list[str], lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        del golds, lengths
        return np.zeros(len(texts), np.bool_), np.zeros(len(texts), np.float32)

    def close(self) -> None:
        pass
