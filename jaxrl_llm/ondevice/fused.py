"""A fully jitted RL iteration for tasks scored on device: sample -> score -> advantages -> update in
one `jax.jit`, and K iterations in one `lax.scan` (the shape of PureJaxRL's `make_train`).

    iteration = make_fused_iteration(model_config, algo, optimizer, sampling=..., token_table=..., ...)
    state, metrics = iteration(state, rng, prompts)            # prompts: PromptBatch [P, L]
    loop = make_fused_loop(iteration)
    state, metrics = loop(state, rng, prompt_batches)          # [K, P, L]; metrics [K]

The stages are the trainer's own: `sampling.sample_tokens` (each prompt prefilled once, the
`lax.while_loop` decode), `ondevice.device_reward.boxed_integer_reward` (the verifier's rule for integer
answers), the configured estimator of `objectives.ADVANTAGE_ESTIMATORS`, each prompt packed with its
samples (`pack_on_device`, a fixed-shape `TrainBatch`), and the step of `train.step.make_train_step`
(the same loss, micro-batch accumulation and skip-on-non-finite). Prompts are drawn on the host
beforehand, so nothing leaves the device between iterations.

`train.loop` can do what needs the host between sampling and the update and this cannot: the text
verifier (any answer form), group filters and dynamic sampling, a reference policy (KL, PRL), GVM
allocation, several updates per rollout batch. `check_fused_config` names the key that asks for one.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_llm import objectives
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.ondevice.device_reward import TokenBytes, boxed_integer_reward, gold_integers
from jaxrl_llm.run.config import AlgorithmSection, RunConfig, SamplingSection, lora_enabled
from jaxrl_llm.run.state import TrainState
from jaxrl_llm.sampling import SampledTokens, sample_tokens
from jaxrl_llm.train.logprobs import response_logprobs
from jaxrl_llm.train.packing import TrainBatch
from jaxrl_llm.train.step import make_train_step


class PromptBatch(NamedTuple):
    """Prompts of one iteration (or of K, with a leading [K] axis): tokens int32 [P, L] right-padded,
    lengths int32 [P], gold int32 [P] (the integer answers)."""

    tokens: Any
    lengths: Any
    gold: Any


def prompt_batches(batches: Sequence[Sequence[dict]], *, pad_id: int, prompt_len: int | None = None) -> PromptBatch:
    """K lists of P records (with "prompt_ids" and "answer") -> PromptBatch of numpy arrays [K, P, L].

    L = `prompt_len`, or the longest prompt of all K batches (one shape, one compilation).
    """
    if not batches or len({len(b) for b in batches}) != 1 or not batches[0]:
        raise ValueError(f"prompt_batches needs K >= 1 batches of the same non-zero size, got sizes "
                         f"{[len(b) for b in batches]}")
    longest = max(len(r["prompt_ids"]) for b in batches for r in b)
    width = longest if prompt_len is None else prompt_len
    if width < longest:
        raise ValueError(f"prompt_len={prompt_len} is shorter than the longest prompt ({longest} tokens)")
    tokens = np.full((len(batches), len(batches[0]), width), pad_id, np.int32)
    lengths = np.zeros(tokens.shape[:2], np.int32)
    for k, batch in enumerate(batches):
        for i, record in enumerate(batch):
            tokens[k, i, :len(record["prompt_ids"])] = record["prompt_ids"]
            lengths[k, i] = len(record["prompt_ids"])
    gold = np.stack([gold_integers([r["answer"] for r in batch]) for batch in batches])
    return PromptBatch(tokens, lengths, gold)


def check_fused_config(config: RunConfig) -> None:
    """Raise ValueError naming the config key when a run needs the host between sampling and update."""
    algo, optim = config.algorithm, config.optim
    problems = [
        ("sampling.allocation", config.sampling.allocation == "uniform",
         "must be 'uniform' (GVM allocates on the host)"),
        ("algorithm.group_filter", algo.group_filter == "none", "must be 'none' (filtering changes the batch shape)"),
        ("algorithm.dynamic_sampling", not algo.dynamic_sampling, "must be false (resampling rounds are host-driven)"),
        ("algorithm.kl_coef", algo.kl_coef == 0, "must be 0 (no reference policy is kept on the fused path)"),
        ("algorithm.prl_eta", algo.prl_eta is None, "must be null (PRL needs a reference policy)"),
        ("algorithm.format_reward", algo.format_reward == 0, "must be 0 (the format check is the host's text rule)"),
        ("algorithm.agg", algo.agg not in ("prompt-mean", "prompt-mean-unbiased"),
         "must be a token/sequence mode (the M-step weights are computed on the host)"),
        ("optim.epochs", optim.epochs == 1, "must be 1 (one update per rollout batch)"),
        ("optim.mini_batches", optim.mini_batches == 1, "must be 1 (one update per rollout batch)"),
        ("optim.micro_batch_size", config.sampling.prompts_per_step % optim.micro_batch_size == 0,
         f"must divide sampling.prompts_per_step={config.sampling.prompts_per_step}"),
        ("train.mesh", not config.train.mesh, "must be empty (the fused loop runs on one device)"),
        ("lora.rank", not lora_enabled(config), "must be 0 with no lora.adapter (the fused loop trains every weight)"),
        ("sampling.max_rows_per_call", config.sampling.max_rows_per_call == 0,
         "must be 0 (the fused loop samples every row of an iteration in one call)"),
        ("algorithm.rollout_correction", not algo.rollout_correction,
         "must be empty (the correction runs in train.loop, not on the fused path yet)"),
        ("sampling.dtype", not config.sampling.dtype,
         "must be empty (the fused loop samples from the trainer's own parameters)"),
        ("rollouts.mode", config.rollouts.mode == "sync",
         "must be sync (the fused loop samples and trains in one program, one after the other)"),
    ]
    for key, ok, reason in problems:
        if not ok:
            raise ValueError(f"fused RL loop: config key '{key}' {reason}")


def pack_on_device(prompts: PromptBatch, sampled: SampledTokens, advantages: jax.Array, old_logp: jax.Array, *,
                   samples_per_prompt: int, pad_id: int) -> TrainBatch:
    """Row g = prompt g (L slots) then its S responses in fixed slots of N tokens: [P, L + S * N].

    The `train.packing` layout with static shapes: response s of row g sits at L + s * N, positions
    restart at the prompt's length, segment ids are 0 on the prompt, s + 1 on response s and S + 1 on
    padding, so each response attends to its prompt and itself only. advantages [R], old_logp [R, N].
    """
    num_prompts, prompt_len = prompts.tokens.shape
    slots = samples_per_prompt
    steps = sampled.tokens.shape[1]
    t = jnp.arange(steps)
    lengths = sampled.lengths.reshape(num_prompts, slots)
    mask = (t < lengths[..., None]).astype(jnp.float32)  # [P, S, N]
    responses = jnp.where(mask > 0, sampled.tokens.reshape(num_prompts, slots, steps), pad_id)
    prompt_lengths = prompts.lengths[:, None, None]
    slot = jnp.arange(slots)[None, :, None]
    prompt_index = jnp.broadcast_to(jnp.arange(prompt_len), (num_prompts, prompt_len))
    prompt_segments = jnp.where(prompt_index < prompts.lengths[:, None], 0, slots + 1)
    flat = lambda x: x.reshape(num_prompts, slots * steps)  # noqa: E731
    return TrainBatch(
        tokens=jnp.concatenate([prompts.tokens, flat(responses)], axis=1),
        positions=jnp.concatenate([prompt_index, flat(jnp.broadcast_to(prompt_lengths + t, mask.shape))], axis=1),
        segments=jnp.concatenate([prompt_segments, flat(jnp.where(mask > 0, slot + 1, slots + 1))], axis=1),
        # token 0 is predicted by the prompt's last position, token t by the response's token t - 1
        pred_index=jnp.where(t == 0, prompt_lengths - 1, prompt_len + slot * steps + t - 1).astype(jnp.int32),
        response_tokens=responses.astype(jnp.int32),
        mask=mask,
        advantages=advantages.reshape(num_prompts, slots, 1) * mask,
        old_logp=old_logp.reshape(num_prompts, slots, steps) * mask,
        ref_logp=jnp.zeros(mask.shape, jnp.float32),
        old_values=jnp.zeros(mask.shape, jnp.float32),
        returns=jnp.zeros(mask.shape, jnp.float32),
    )


def make_fused_iteration(model_config: ModelConfig, algo: AlgorithmSection, optimizer: optax.GradientTransformation,
                         *, sampling: SamplingSection, token_table: TokenBytes, micro_batch_size: int,
                         stop_ids: Sequence[int], pad_id: int, keep_rollouts: bool = False):
    """Build the jitted `iteration(state, rng, prompts) -> (state, metrics)` (state donated).

    One iteration: S = sampling.samples_per_prompt samples of each prompt (rng as in `sample_tokens`),
    r = correct ? 1 : (-1 if algorithm.reward == "signed" else 0), plus DAPO's overlong penalty when
    algorithm.overlong_buffer > 0, advantages A = ADVANTAGE_ESTIMATORS[algorithm.advantage](r, prompt)
    broadcast over each response's tokens, then one `make_train_step` update with the mini-batch
    denominator `aggregate_denominator(mask, algorithm.agg)`. Old log-probs are the sampler's (equal to
    a teacher-forced pass up to float rounding) unless algorithm.old_logp == "recompute".

    metrics: reward, accuracy, response_length, stop_rate, advantage_abs_mean and the train step's
    (loss, policy_loss, kl, entropy, clip_fraction, grad_norm, finite); with `keep_rollouts` also
    tokens [R, N], lengths [R], logprobs [R, N], rewards [R] and correct [R].
    """
    if algo.kl_coef > 0 or algo.prl_eta is not None:
        raise ValueError("fused RL loop: algorithm.kl_coef must be 0 and algorithm.prl_eta null (no reference policy)")
    estimator = objectives.ADVANTAGE_ESTIMATORS[algo.advantage]
    train_step = make_train_step(model_config, algo, optimizer, micro_batch_size=micro_batch_size)
    samples = sampling.samples_per_prompt
    table = TokenBytes(jnp.asarray(token_table.bytes), jnp.asarray(token_table.lengths))

    def iteration(state: TrainState, rng: jax.Array, prompts: PromptBatch):
        num_prompts = prompts.tokens.shape[0]
        if num_prompts % micro_batch_size:
            raise ValueError(f"{num_prompts} prompts per iteration is not a multiple of micro_batch_size="
                             f"{micro_batch_size}")
        sampled = sample_tokens(state.params, model_config, prompts.tokens, prompts.lengths, rng,
                                samples_per_prompt=samples, max_new_tokens=sampling.max_new_tokens,
                                temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                stop_ids=stop_ids, pad_id=pad_id)
        group = jnp.repeat(jnp.arange(num_prompts, dtype=jnp.int32), samples)
        correct = boxed_integer_reward(sampled.tokens, sampled.lengths, prompts.gold[group], table)
        rewards = jnp.where(correct > 0, 1.0, -1.0 if algo.reward == "signed" else 0.0)
        if algo.overlong_buffer > 0:
            rewards = rewards + objectives.overlong_penalty(
                sampled.lengths, max_len=sampling.max_new_tokens, buffer=algo.overlong_buffer,
                factor=algo.overlong_factor)
        advantages = estimator(rewards, group, num_groups=num_prompts)
        batch = pack_on_device(prompts, sampled, advantages, sampled.logprobs, samples_per_prompt=samples,
                               pad_id=pad_id)
        if algo.old_logp == "recompute":
            batch = batch._replace(old_logp=jax.lax.stop_gradient(
                response_logprobs(state.params, model_config, batch)) * batch.mask)
        denom = objectives.aggregate_denominator(batch.mask.reshape(-1, batch.mask.shape[-1]), algo.agg)
        state, step_metrics = train_step(state, batch, denom)
        mask = batch.mask.reshape(-1, batch.mask.shape[-1])
        metrics = {"reward": rewards.mean(), "accuracy": correct.mean(),
                   "response_length": sampled.lengths.astype(jnp.float32).mean(),
                   "stop_rate": sampled.stopped.astype(jnp.float32).mean(),
                   "advantage_abs_mean": jnp.abs(advantages).mean(), **step_metrics}
        if keep_rollouts:
            metrics.update(tokens=sampled.tokens, lengths=sampled.lengths, logprobs=sampled.logprobs * mask,
                           rewards=rewards, correct=correct)
        return state, metrics

    return jax.jit(iteration, donate_argnums=(0,))


def make_fused_loop(iteration):
    """Jitted `loop(state, rng, prompt_batches) -> (state, metrics)`: a `lax.scan` of `iteration` over the
    leading [K] axis of a PromptBatch; iteration k draws with `jax.random.fold_in(rng, k)`, so the
    result equals K calls of `iteration` in order. metrics are stacked [K, ...]. State donated."""

    def loop(state: TrainState, rng: jax.Array, batches: PromptBatch):
        def body(state, xs):
            k, prompts = xs
            return iteration(state, jax.random.fold_in(rng, k), prompts)

        count = batches.tokens.shape[0]
        return jax.lax.scan(body, state, (jnp.arange(count), batches))

    return jax.jit(loop, donate_argnums=(0,))
