"""Host-side stages of an RL iteration: sample and score rollouts, keep groups, build the train batches.

Each function is one named stage of `train/loop.py`; arrays are NumPy here (the device work lives in
`jaxrl_llm.sampling.generate` and the jitted train step).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import NamedTuple, Sequence

import jax
import numpy as np

from jaxrl_llm import objectives
from jaxrl_llm.run.config import AlgorithmSection, ConfigError, RunConfig, SamplingSection, ToolsSection
from jaxrl_llm.sampling import SlotStats, generate
from jaxrl_llm.train.packing import TrainBatch, bucket, micro_batch_order, pack_groups, round_up

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ScoredRollouts:
    """Samples of a set of prompts with their rewards; group g = prompt g of `records`."""

    records: list[dict]  # one per prompt, with "prompt_ids" and "answer"
    prompt_index: np.ndarray  # [R] int32
    tokens: np.ndarray  # [R, N] int32 response tokens
    mask: np.ndarray  # [R, N] float32
    logprobs: np.ndarray  # [R, N] float32 sampler log-probs (temperature 1)
    lengths: np.ndarray  # [R] int32
    rewards: np.ndarray  # [R] float32
    correct: np.ndarray  # [R] bool: the verifier accepted the final answer
    # the continuous engine's slot use in the sampler call that drew these rows (None: the static engine);
    # read it where the rows are drawn (`count_slot_use`): select_groups and concat leave it out
    slot_stats: SlotStats | None = None
    # tool use of these rows' conversations (`MultiTurnRollout.summary` sums; None: single-turn), read like
    # slot_stats where the rows are drawn (`count_tool_use`)
    tool_stats: dict | None = None
    # a mixture of experts' sampled routes (`sampling.Rollout`'s or `MultiTurnRollout`'s; None: a dense model):
    # routes [R, N, L_sparse, k] of the response tokens, prompt_routes [R, P, L_sparse, k] of each row's prompt
    routes: np.ndarray | None = None
    prompt_routes: np.ndarray | None = None

    @property
    def num_samples(self) -> int:
        return int(self.prompt_index.shape[0])

    def select_groups(self, keep: np.ndarray) -> "ScoredRollouts":
        """Only the prompts where keep[g]; prompt indices are renumbered 0..kept-1."""
        new_index = np.cumsum(keep) - 1
        rows = keep[self.prompt_index]
        return ScoredRollouts(
            records=[r for r, k in zip(self.records, keep) if k], prompt_index=new_index[self.prompt_index[rows]],
            tokens=self.tokens[rows], mask=self.mask[rows], logprobs=self.logprobs[rows], lengths=self.lengths[rows],
            rewards=self.rewards[rows], correct=self.correct[rows],
            routes=None if self.routes is None else self.routes[rows],
            prompt_routes=None if self.prompt_routes is None else self.prompt_routes[rows])

    @staticmethod
    def concat(parts: Sequence["ScoredRollouts"]) -> "ScoredRollouts":
        offsets = np.cumsum([0] + [len(p.records) for p in parts[:-1]])
        return ScoredRollouts(
            records=[r for p in parts for r in p.records],
            prompt_index=np.concatenate([p.prompt_index + o for p, o in zip(parts, offsets)]),
            **{f: np.concatenate([getattr(p, f) for p in parts])
               for f in ("tokens", "mask", "logprobs", "lengths", "rewards", "correct")}, **concat_routes(parts))


def concat_routes(parts: Sequence["ScoredRollouts"]) -> dict:
    """The parts' routes and prompt routes joined (prompt widths padded with -1), or none where a part lacks them."""
    if any(p.routes is None for p in parts):
        return {}
    width = max(p.prompt_routes.shape[1] for p in parts)
    pad = lambda x: np.pad(x, ((0, 0), (0, width - x.shape[1]), (0, 0), (0, 0)), constant_values=-1)  # noqa: E731
    return {"routes": np.concatenate([p.routes for p in parts]),
            "prompt_routes": np.concatenate([pad(p.prompt_routes) for p in parts])}


def engine_options(sampling: SamplingSection) -> dict:
    """`generate`'s engine keywords for `sampling.engine`: none for the static engine (its default)."""
    if sampling.engine == "static":
        return {}
    return {"engine": sampling.engine, "max_slots": sampling.max_slots or None,
            "max_prompt_entries": sampling.max_prompt_entries}


@dataclasses.dataclass(frozen=True)
class ToolUse:
    """A run's tool environment (`tools.env`) and its limits (the `tools` config section)."""

    env: object
    section: ToolsSection


def make_tool_use(section: ToolsSection, tokenizer=None, *, model: str = "") -> ToolUse | None:
    """The environment `tools.env` names with its limits, or None for single-turn text; `tools.format` chat
    builds it on `tokenizer`'s chat template (a ConfigError naming `model` when that has no tool role)."""
    if not section.env:
        return None
    from jaxrl_llm.tools import env as environments

    limits = {}
    if section.env == "python":
        from jaxrl_llm.tools import resolve_isolation

        # at start, not at the first call: a machine without a sandbox fails here, naming what is missing
        mechanism = resolve_isolation(section.isolation)
        logger.info("tools: python runs under %s isolation", mechanism)
        limits = dict(timeout_s=section.timeout_s, memory_mb=section.memory_mb, isolation=section.isolation)
    if section.format == "chat":
        from jaxrl_llm.tools.chat_env import ChatTemplateError, chat_tool_env

        try:
            env = chat_tool_env(tokenizer, section.env, max_output_chars=section.max_output_chars,
                                max_observation_tokens=section.max_observation_tokens, **limits)
        except ChatTemplateError as err:
            raise ConfigError(f"config key 'tools.format'='chat' needs the model's chat template to have a tool "
                              f"role; the tokenizer of model {model!r}: {err} (tools.format=markdown works with "
                              "any model)") from None
        logger.info("tools: chat format, calls written %s ... %s", env.format.call_open, env.format.call_close)
    else:
        env = environments.ENVIRONMENTS[section.env](max_output_chars=section.max_output_chars, **limits)
    return ToolUse(env, section)


def run_prompt_template(cfg: RunConfig):
    """`data.prompt`, with the tools' schemas for the chat template to render when `tools.format` is chat."""
    if not cfg.tools.env or cfg.tools.format != "chat":
        return cfg.data.prompt
    from jaxrl_llm.data import prompt_template
    from jaxrl_llm.tools.chat_env import tool_schemas

    template = prompt_template(cfg.data.prompt, tools=tool_schemas(cfg.tools.env))
    if not template.chat:
        raise ConfigError(f"config key 'tools.format'='chat' renders the tools through the chat template, but "
                          f"data.prompt={cfg.data.prompt!r} is a raw-text prompt")
    return template


def sample_and_score(params, model_config, tokenizer, records: list[dict], counts, sampling: SamplingSection,
                     scorer: "RewardScorer", rng: jax.Array, *, mesh=None, tools: ToolUse | None = None) -> ScoredRollouts:
    """Draw counts[i] (or `counts` each) samples of every prompt and score them; at most
    `sampling.max_rows_per_call` rows are decoded per sampler call (0: all in one), by `sampling.engine`.
    With `tools`, each sample is a conversation with the tool (`sampling.multiturn.generate_multiturn`), scored
    on the model's own tokens, `tools.malformed_penalty` off the reward of one that ends inside a call."""
    if tools is not None:
        return _sample_and_score_tools(params, model_config, tokenizer, records, counts, sampling, scorer, rng,
                                       mesh=mesh, tools=tools)
    rollout, stats = generate(params, model_config, [r["prompt_ids"] for r in records], num_samples=counts,
                              max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                              top_p=sampling.top_p, top_k=sampling.top_k, stop_ids=tokenizer.stop_ids, rng=rng,
                              pad_id=tokenizer.pad_token_id, mesh=mesh, max_rows_per_call=sampling.max_rows_per_call,
                              return_stats=True, **engine_options(sampling))
    prompt_index = np.asarray(rollout.prompt_index, np.int32)
    lengths = np.asarray(rollout.lengths, np.int32)
    texts = [tokenizer.decode(list(row[:n]), skip_special_tokens=True) for row, n in zip(rollout.tokens, lengths)]
    golds = [records[i]["answer"] for i in prompt_index]
    correct, rewards = scorer(texts, golds, lengths)
    return ScoredRollouts(records=list(records), prompt_index=prompt_index, tokens=np.asarray(rollout.tokens),
                          mask=np.asarray(rollout.mask, np.float32), logprobs=np.asarray(rollout.logprobs),
                          lengths=lengths, rewards=rewards, correct=correct,
                          slot_stats=stats if sampling.engine == "continuous" else None,
                          routes=rollout.routes, prompt_routes=rollout.prompt_routes)


def _sample_and_score_tools(params, model_config, tokenizer, records, counts, sampling: SamplingSection, scorer,
                            rng, *, mesh, tools: ToolUse) -> ScoredRollouts:
    from jaxrl_llm.sampling.multiturn import generate_multiturn

    section = tools.section
    rollout = generate_multiturn(params, model_config, tokenizer, records, tools.env, num_samples=counts,
                                 max_new_tokens=sampling.max_new_tokens, max_turns=section.max_turns,
                                 max_observation_tokens=section.max_observation_tokens,
                                 temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                 rng=rng, mesh=mesh, tool_workers=section.workers,
                                 segment_iterations=section.segment_iterations,
                                 max_rows_per_call=sampling.max_rows_per_call, **engine_options(sampling))
    golds = [records[i]["answer"] for i in rollout.prompt_index]
    model_lengths = rollout.mask.sum(axis=1).astype(np.int32)
    correct, rewards = scorer(rollout.model_text, golds, model_lengths)
    rewards = rewards - np.float32(section.malformed_penalty) * rollout.malformed.astype(np.float32)
    stats = rollout.sums()  # sums, so rounds and stages add up; tool_metrics divides
    return ScoredRollouts(records=list(records), prompt_index=rollout.prompt_index, tokens=rollout.tokens,
                          mask=rollout.mask, logprobs=rollout.logprobs, lengths=rollout.lengths,
                          rewards=rewards.astype(np.float32), correct=correct,
                          slot_stats=rollout.slot_stats if sampling.engine == "continuous" else None,
                          tool_stats=stats, routes=rollout.routes, prompt_routes=rollout.prompt_routes)


def count_tool_use(info: dict, stats: dict | None) -> None:
    """Add a draw's tool-use sums to a step's books (nothing for single-turn rows)."""
    if stats is not None:
        books = info.setdefault("tool_sums", {})
        for key, value in stats.items():
            books[key] = books.get(key, 0.0) + value


def tool_metrics(info: dict) -> dict:
    """Per-sample means of the tool-use sums `count_tool_use` gathered (turns, tool_calls, tool_call_rate,
    tool_errors, tool_timeouts, malformed_calls, truncated), tool_seconds and sampler_rounds summed; {} without."""
    sums = info.get("tool_sums")
    if not sums:
        return {}
    n = max(sums["samples"], 1)
    return {key: (value if key in ("tool_seconds", "sampler_rounds") else value / n)
            for key, value in sums.items() if key != "samples"}


def count_slot_use(info: dict, stats: SlotStats | None) -> None:
    """Add a sampler call's slot-steps to a step's books (nothing for None: the static engine in training)."""
    if stats is not None:
        info["useful_slot_steps"] = info.get("useful_slot_steps", 0) + stats.useful_slot_steps
        info["slot_steps"] = info.get("slot_steps", 0) + stats.slot_steps


def counting_generate(slot_use: dict):
    """`generate` that adds each call's slot-steps to `slot_use` (`count_slot_use`): an evaluation's `generate_fn`."""
    def generate_fn(*args, **kwargs):
        rollout, stats = generate(*args, return_stats=True, **kwargs)
        count_slot_use(slot_use, stats)
        return rollout

    return generate_fn


def tool_generate(tools: ToolUse, tokenizer, info: dict, **engine):
    """An evaluation's `generate_fn` for tool use: each sample a conversation (`generate_multiturn`), returned as
    a `Rollout` of the model's own tokens (observations left out: what gets scored; finish "length" for a
    conversation that ran out of budget), its tool use added to `info` (`count_tool_use`)."""
    from jaxrl_llm.sampling import FINISH_LENGTH, FINISH_STOP, Rollout
    from jaxrl_llm.sampling.multiturn import generate_multiturn

    section = tools.section

    def generate_fn(params, config, prompt_ids, *, num_samples, max_new_tokens, temperature, top_p, top_k, rng,
                    stop_ids=(), mesh=None, **kwargs):
        records = [{"prompt_ids": list(p)} for p in prompt_ids]
        out = generate_multiturn(params, config, tokenizer, records, tools.env, num_samples=num_samples,
                                 max_new_tokens=max_new_tokens, max_turns=section.max_turns,
                                 max_observation_tokens=section.max_observation_tokens, temperature=temperature,
                                 top_p=top_p, top_k=top_k, rng=rng, mesh=mesh, tool_workers=section.workers,
                                 segment_iterations=section.segment_iterations, **{**engine, **kwargs})
        count_tool_use(info, out.sums())
        tokens = np.full(out.tokens.shape, tokenizer.pad_token_id, np.int32)
        logprobs = np.zeros(out.tokens.shape, np.float32)
        for row in range(len(out.lengths)):
            own = out.mask[row] > 0
            tokens[row, :own.sum()], logprobs[row, :own.sum()] = out.tokens[row][own], out.logprobs[row][own]
        lengths = out.mask.sum(axis=1).astype(np.int32)
        mask = (np.arange(tokens.shape[1]) < lengths[:, None]).astype(np.float32)
        return Rollout(prompt_index=out.prompt_index, tokens=tokens, mask=mask, logprobs=logprobs, lengths=lengths,
                       finish_reason=np.where(out.truncated, FINISH_LENGTH, FINISH_STOP).astype(np.int32))

    return generate_fn


def slot_occupancy(info: dict) -> dict:
    """{"sampling_slot_occupancy": useful slot-steps / slot-steps} over the calls `count_slot_use` counted
    (continuous engine), else {}."""
    if "slot_steps" not in info:
        return {}
    return {"sampling_slot_occupancy": info["useful_slot_steps"] / info["slot_steps"] if info["slot_steps"] else 0.0}


class RewardScorer:
    """Verifier verdicts and rewards: r = correctness ({0, 1}, or {-1, +1} when signed; with algorithm.verifier
    code the fraction of the task's tests passed, or all, from `rewards.code_reward`) + shaping terms (format
    bonus, DAPO overlong penalty) from `jaxrl_llm.rewards.build_reward_fn`."""

    def __init__(self, algo: AlgorithmSection, sampling: SamplingSection, *, timeout: float, workers: int):
        from jaxrl_llm import rewards

        self.pool = rewards.VerifierPool(workers, timeout=timeout) if workers > 0 else None
        self.timeout = timeout
        self.signed = algo.reward == "signed"
        self.code = algo.code_reward if algo.verifier == "code" else None  # code tasks: tests in the sandbox
        shaping = {}
        if algo.format_reward:
            shaping["format"] = {"weight": algo.format_reward}
        if algo.overlong_buffer > 0:
            shaping["overlong"] = {"weight": 1.0, "max_len": sampling.max_new_tokens,
                                   "buffer": algo.overlong_buffer, "factor": algo.overlong_factor}
        self.shaping = rewards.build_reward_fn(shaping) if shaping else None
        self.last_seconds = 0.0  # time spent in the latest call, for the time split in the metrics

    def __call__(self, texts: list[str], golds: list[str], lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        from jaxrl_llm import rewards

        started = time.perf_counter()
        if self.code is not None:  # the fraction of tests passed (or all), correct when all pass
            score = np.asarray(rewards.code_reward(texts, golds, mode=self.code, timeout_s=self.timeout), np.float32)
            correct = score >= 1.0
            reward = (2.0 * score - 1.0 if self.signed else score).astype(np.float32)
        else:
            verdict = rewards.correctness_reward(texts, golds, pool=self.pool, timeout=self.timeout)
            correct = np.asarray(verdict, np.float32) > 0
            reward = np.where(correct, 1.0, -1.0 if self.signed else 0.0).astype(np.float32)
        if self.shaping is not None:
            reward += np.asarray(self.shaping(texts, golds, lengths=lengths), np.float32)
        self.last_seconds = time.perf_counter() - started
        return correct, reward

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def prompt_groups(scored: ScoredRollouts) -> list[np.ndarray]:
    """Sample indices of each prompt, in prompt order."""
    return [np.flatnonzero(scored.prompt_index == g) for g in range(len(scored.records))]


def row_groups(prompt_ids: list, groups: list[np.ndarray], max_per_row: int, *, lengths: np.ndarray | None = None,
               max_tokens: int = 0) -> tuple[list, list[np.ndarray]]:
    """Split groups into rows of at most `max_per_row` responses and, with `max_tokens` > 0 (and the
    response `lengths`), of at most `max_tokens` tokens (prompt + its responses; a response that alone
    goes over gets a row of its own), each row repeating its prompt. With GVM's uneven n_i (one prompt
    with 60 samples, others with 2) one row per prompt pads every row to the longest; rows of similar
    size do not. Exact: every per-token quantity (advantages, log-probs, the aggregation denominator) is
    computed per sample before packing."""
    if max_tokens > 0 and lengths is None:
        raise ValueError("row_groups: max_tokens needs the response lengths")
    prompts, rows = [], []
    for prompt, members in zip(prompt_ids, groups):
        start, used = 0, len(prompt)
        for i, member in enumerate(members):
            size = int(lengths[member]) if max_tokens > 0 else 0
            if i > start and (i - start == max_per_row or (max_tokens > 0 and used + size > max_tokens)):
                prompts.append(prompt)
                rows.append(members[start:i])
                start, used = i, len(prompt)
            used += size
        prompts.append(prompt)  # the last row (an empty group stays one empty entry)
        rows.append(members[start:])
    return prompts, rows


def max_row_responses(scored: ScoredRollouts) -> int:
    """Responses per packed row: the power of two at or above the mean group size (uniform groups stay whole)."""
    return bucket(-(-scored.num_samples // max(1, len(scored.records))))


def _pack_prompts(scored: ScoredRollouts, prompt_indices, groups: list[np.ndarray], *, micro_batch_size: int,
                  pad_id: int, seq_multiple: int = 32, max_row_tokens: int = 0,
                  **per_token) -> tuple[TrainBatch, list[np.ndarray], np.ndarray]:
    """`groups` (sample indices of the prompts `prompt_indices`) packed into rows of at most
    `max_row_responses` responses and `max_row_tokens` tokens (0: no limit), the row count padded for micro-batches
    of `micro_batch_size` rows and the rows ordered for them (`packing.micro_batch_order`: padding rows in whole
    micro-batches, which the train step and the log-prob / value passes skip); `per_token` = advantages / old_logp /
    ref_logp arrays (else zeros). Returns the batch, each packed row's sample indices and the order (position p holds
    packed row order[p]: a pass's output `out` [G, ...] unpacks as `packing.unpack(out[np.argsort(order)], rows, n)`)."""
    prompts, rows = row_groups([scored.records[g]["prompt_ids"] for g in prompt_indices], groups,
                               max_row_responses(scored), lengths=scored.lengths, max_tokens=max_row_tokens)
    batch = pack_groups(prompts, rows, scored.tokens, scored.lengths, masks=scored.mask, pad_id=pad_id,
                        row_multiple=micro_batch_size, seq_multiple=seq_multiple, routes=scored.routes,
                        prompt_routes=scored.prompt_routes, **per_token)
    order = micro_batch_order(len(batch.tokens), micro_batch_size)
    return TrainBatch(*(None if x is None else x[order] for x in batch)), rows, order


def build_train_batches(scored: ScoredRollouts, advantages: np.ndarray, old_logp: np.ndarray, ref_logp: np.ndarray,
                        algo: AlgorithmSection, *, mini_batches: int, micro_batch_size: int, pad_id: int,
                        rng: np.random.Generator, seq_multiple: int = 32, max_row_tokens: int = 0,
                        old_values: np.ndarray | None = None, returns: np.ndarray | None = None,
                        teacher_ids: np.ndarray | None = None,
                        teacher_topk_logp: np.ndarray | None = None) -> list[tuple[TrainBatch, float, int]]:
    """Split the prompts into `mini_batches` shuffled mini-batches of packed rows (one row per prompt
    holding its responses, large groups split by `row_groups`) -> [(TrainBatch, denom, samples)].

    `denom` is the aggregation denominator of the whole mini-batch, computed before samples whose every
    advantage is 0 are dropped (they add nothing to the policy gradient when the KL and entropy terms
    are off: RAFT's rejected samples, groups that all agree), so dropping them leaves the update exact.
    With a critic (`old_values` and `returns` [R, N], PPO) every sample is kept: the value loss needs them all, and
    so with the teacher's top-K ids and log-probs [N, R, K] (`distill.mode` topk), whose loss needs every token.
    The rows are ordered for the train step's micro-batches of `micro_batch_size` rows (`packing.micro_batch_order`):
    the packer's padding rows (up to the power-of-two row count) fill whole micro-batches, which the step skips.
    """
    groups = prompt_groups(scored)
    drop_zero = algo.kl_coef == 0 and algo.entropy_coef == 0 and returns is None and teacher_ids is None
    topk = {} if teacher_ids is None else dict(teacher_ids=teacher_ids, teacher_topk_logp=teacher_topk_logp)
    mstep = algo.agg in objectives.PROMPT_MEAN_MODES
    out = []
    for part in np.array_split(rng.permutation(len(groups)), mini_batches):
        members = [groups[g] for g in part]
        samples = np.concatenate(members) if members else np.zeros(0, np.int64)
        if samples.size == 0:
            continue
        denom = float(objectives.aggregate_denominator(scored.mask[samples], "token-mean" if mstep else algo.agg))
        if mstep:
            advantages = prompt_mean_advantages(scored, advantages, part, members, denom, algo.agg)
        if drop_zero:
            members = [m[np.any(advantages[m] != 0, axis=1)] for m in members]
        kept = sum(len(m) for m in members)
        if kept == 0:
            continue
        batch, _, _ = _pack_prompts(scored, part, members, micro_batch_size=micro_batch_size, pad_id=pad_id,
                                    seq_multiple=seq_multiple, max_row_tokens=max_row_tokens,
                                    advantages=advantages, old_logp=old_logp, ref_logp=ref_logp,
                                    old_values=old_values, returns=returns, **topk)
        out.append((batch, denom, kept))
    return out


def prompt_mean_advantages(scored: ScoredRollouts, advantages: np.ndarray, part: np.ndarray,
                           members: list[np.ndarray], denom: float, mode: str) -> np.ndarray:
    """`advantages` with the rows of the mini-batch's prompts `part` (sample indices `members`) scaled by
    denom x w_b / m, so that the token-mean over `denom` tokens of the policy loss equals GVM's M-step
    (objectives.prompt_mean): the PPO and RAFT losses are positively homogeneous in A, l(c A) = c l(A) for
    c >= 0. w_b from `objectives.prompt_mean_weights` with D_i = the prompt's samples with a nonzero
    advantage (RAFT / RAFT++: the accepted ones) and, for prompt-mean-unbiased, p_i = the record's
    "gvm_accept_rate" (GVM's stage 1; a prompt without one uses its own rate |D_i| / n_i); m = len(part)."""
    samples = np.concatenate(members)
    local = np.concatenate([np.full(len(m), k, np.int32) for k, m in enumerate(members)])
    counted = np.any(advantages[samples] != 0, axis=1)
    accept_rate = None
    if mode == "prompt-mean-unbiased":
        own = [counted[local == k].mean() if len(m) else 0.0 for k, m in enumerate(members)]
        accept_rate = np.array([scored.records[g].get("gvm_accept_rate", own[k]) for k, g in enumerate(part)],
                               np.float32)
    weights = np.asarray(objectives.prompt_mean_weights(local, num_groups=len(members), counted=counted,
                                                        accept_rate=accept_rate), np.float32)
    scaled = advantages.copy()
    scaled[samples] *= (denom * weights / len(part))[:, None]
    return scaled


def packed_rollouts(scored: ScoredRollouts, micro_batch_size: int, pad_id: int,
                    max_row_tokens: int = 0) -> tuple[TrainBatch, list[np.ndarray], np.ndarray]:
    """Every sample packed by prompt (advantages and log-probs zero): the input of the old/reference log-prob and
    value passes, rows ordered for their micro-batches of `micro_batch_size`. Returns `_pack_prompts`'s batch, row
    groups and order."""
    return _pack_prompts(scored, range(len(scored.records)), prompt_groups(scored), micro_batch_size=micro_batch_size,
                         pad_id=pad_id, max_row_tokens=max_row_tokens)


class RowBatch(NamedTuple):
    """One sample per row, unpacked: what per-sample computations (GVM gradient norms) need."""

    tokens: np.ndarray  # [B, T] int32: prompt then response, right-padded
    prompt_lens: np.ndarray  # [B] int32
    response_tokens: np.ndarray  # [B, R] int32
    mask: np.ndarray  # [B, R] float32


def all_rows_batch(scored: ScoredRollouts, row_multiple: int, pad_id: int, seq_multiple: int = 32) -> RowBatch:
    """Every sample as its own row (prompt + response), rows padded to `bucket(., row_multiple)`."""
    n = scored.num_samples
    n_pad = bucket(n, row_multiple)
    prompts = [scored.records[g]["prompt_ids"] for g in scored.prompt_index]
    resp_len = scored.tokens.shape[1]
    tokens = np.full((n_pad, round_up(max(len(p) for p in prompts) + resp_len, seq_multiple)), pad_id, np.int32)
    prompt_lens = np.ones(n_pad, np.int32)
    for i, prompt in enumerate(prompts):
        tokens[i, :len(prompt)] = prompt
        tokens[i, len(prompt):len(prompt) + resp_len] = scored.tokens[i]
        prompt_lens[i] = len(prompt)
    response_tokens = np.zeros((n_pad, resp_len), np.int32)
    response_tokens[:n] = scored.tokens
    mask = np.zeros((n_pad, resp_len), np.float32)
    mask[:n] = scored.mask
    return RowBatch(tokens, prompt_lens, response_tokens, mask)
