"""GVM dynamic sample allocation in the trainer (Yao et al. 2025, "Optimizing Chain-of-Thought Reasoners
via Gradient Variance Minimization in Rejection Sampling and RL"; reference code RLHFlow/GVM).

One GVM iteration over P prompts:

  stage 1   draw N' samples per prompt and score them: p_i = accepted_i / N'
  norms     G_i = mean over prompt i's accepted samples y of || d/dW ( -sum_t log pi(y_t | x, y_<t) ) ||_2,
            W a configurable parameter subset (default the token-embedding matrix); G_i = 0 if none accepted
  allocate  n_i = gvm_allocate(p, G, budget = P x N''), optionally capped at `gvm_max_samples`
            (`gvm_budget: solvable`: budget = N'' x the prompts with p_i > 0)
  stage 2   draw n_i fresh samples of prompt i (or reuse up to N' stage-1 samples) -> one group per prompt

The prompts with n_i = 0 are dropped from the update. When every n_i is 0 (no prompt has an accepted
sample, or the filters removed every prompt) nothing is drawn in stage 2 and the step's update is
skipped; the stage-1 rollouts are returned for the step's metrics and the reason is logged.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Sequence

import jax
import jax.experimental.multihost_utils
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.models.sharding import BATCH_AXES, BATCH_SPEC, batch_devices
from jaxrl_llm.objectives import gvm_allocate
from jaxrl_llm.run.config import SamplingSection
from jaxrl_llm.train.gvm_history import GvmHistory
from jaxrl_llm.train.logprobs import row_logprobs
from jaxrl_llm.train.rollouts import (ScoredRollouts, ToolUse, all_rows_batch, concat_routes, count_slot_use,
                                      count_tool_use, sample_and_score)
from jaxrl_llm.train.step import mesh_context


# ---- per-sample gradient norms ----------------------------------------------------------------------------

def parse_param_subset(spec: str | Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """"embed,layers/q_proj" (or a list of such names) -> (("embed",), ("layers", "q_proj"))."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    paths = tuple(tuple(part for part in name.strip().replace(".", "/").split("/") if part)
                  for name in names if name.strip())
    if not paths:
        raise ValueError(f"GVM parameter subset {spec!r} names no parameter; use e.g. 'embed' or 'embed,layers/q_proj'")
    return paths


def _get(params, path: tuple[str, ...]):
    node = params
    for depth, key in enumerate(path):
        if not isinstance(node, dict) or key not in node:
            have = sorted(node) if isinstance(node, dict) else []
            raise KeyError(f"GVM parameter subset: no parameter '{'/'.join(path)}' ('{key}' not found under "
                           f"'{'/'.join(path[:depth]) or '<root>'}'; available: {have})")
        node = node[key]
    return node


def _replace(params, path: tuple[str, ...], value):
    """A shallow copy of the nested dict `params` with the entry at `path` set to `value`."""
    if not path:
        return value
    out = dict(params)
    out[path[0]] = _replace(params[path[0]], path[1:], value)
    return out


@functools.partial(jax.jit, static_argnames=("model_config", "paths", "rows_per_chunk", "chunk_sharding"))
def _grad_norms(params, model_config, paths, rows_per_chunk, tokens, prompt_lens, response_tokens, mask,
                chunk_sharding=None):
    def row_nll(subset, token_row, prompt_len, response_row, mask_row):
        full = params
        for path, value in zip(paths, subset):
            full = _replace(full, path, value)
        logp = row_logprobs(full, model_config, token_row[None], prompt_len[None], response_row[None])[0]
        return -jnp.sum(logp * mask_row)

    subset = [_get(params, path) for path in paths]
    row_grad = jax.grad(row_nll)

    def row_norm(row):
        grads = row_grad(subset, *row)
        return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree_util.tree_leaves(grads)))

    def constrain(x):
        return x if chunk_sharding is None else jax.lax.with_sharding_constraint(x, chunk_sharding)

    # Chunks of `rows_per_chunk` rows (whole chunks: the caller pads), vmapped one chunk at a time, so the
    # per-row gradients of one chunk are the only ones alive at once; on a mesh each chunk's rows are split
    # over the batch axes, so every device differentiates rows_per_chunk / (data x fsdp x expert) rows of a chunk.
    # Traced under the mesh (`train.step.mesh_context`): a fused attention kernel (splash on TPU) runs in a
    # shard_map there, and vmap's spmd_axis_name splits its batched rows over the batch axes as the chunk is split.
    with mesh_context(chunk_sharding):
        chunks = tuple(constrain(x.reshape(-1, rows_per_chunk, *x.shape[1:]))
                       for x in (tokens, prompt_lens, response_tokens, mask))
        rows = jax.vmap(row_norm, spmd_axis_name=None if chunk_sharding is None else chunk_sharding.spec[1])
        return constrain(jax.lax.map(rows, chunks)).reshape(-1)


def per_sample_grad_norms(params, model_config, tokens, prompt_lens, response_tokens, mask, *,
                          param_subset: str | Sequence[str] = "embed", rows_per_chunk: int = 8,
                          mesh=None) -> np.ndarray:
    """|| d/dW ( -sum_t mask_t log pi(y_t | x, y_<t) ) ||_2 for each row, W = the parameters in `param_subset`
    (the norm over all of them together). Summed, not length-normalised, NLL, as in the GVM paper.

    tokens [B, T] (prompt then response, right-padded), prompt_lens [B], response_tokens [B, R], mask [B, R]
    as in `jaxrl_llm.train.step.TrainBatch`. A jitted `jax.vmap` of `jax.grad` of a one-row loss, run over
    chunks of `rows_per_chunk` rows (`jax.lax.map(..., batch_size=rows_per_chunk)`) to bound memory.
    With a `mesh`, each chunk's rows are split over its data x fsdp x expert devices (`rows_per_chunk` is rounded
    up to a multiple of their number). Returns float32 [B] (0 for rows whose mask is all 0).
    """
    paths = parse_param_subset(param_subset)
    for path in paths:
        _get(params, path)  # a clear error for a wrong name before tracing
    if rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be >= 1, got {rows_per_chunk}")
    chunk_sharding = None
    if mesh is not None:
        split = batch_devices(mesh)
        rows_per_chunk = -(-rows_per_chunk // split) * split
        chunk_sharding = NamedSharding(mesh, P(None, tuple(a for a in BATCH_AXES if a in mesh.axis_names)))
    rows = np.shape(tokens)[0]
    pad = -rows % rows_per_chunk  # whole chunks only: lax.map would compile a second body for a remainder

    def padded(x, dtype, fill=0):
        x = np.asarray(x, dtype)
        return np.concatenate([x, np.full((pad, *x.shape[1:]), fill, dtype)]) if pad else x

    inputs = (padded(tokens, np.int32), padded(prompt_lens, np.int32, 1), padded(response_tokens, np.int32),
              padded(mask, np.float32))
    if mesh is not None:
        from jaxrl_llm.run.layout import place  # the trainer's host-to-mesh placement (multi-process aware)

        inputs = place(inputs, tuple(NamedSharding(mesh, BATCH_SPEC) for _ in inputs))
    norms = _grad_norms(params, model_config, paths, int(rows_per_chunk), *inputs, chunk_sharding=chunk_sharding)
    if mesh is not None and not norms.is_fully_addressable:  # several processes: gather every row's norm
        norms = jax.experimental.multihost_utils.process_allgather(norms, tiled=True)
    return np.asarray(norms, np.float32)[:rows]


def prompt_grad_norms(params, model_config, scored: ScoredRollouts, *, param_subset: str | Sequence[str] = "embed",
                      rows_per_chunk: int = 8, pad_id: int = 0, mesh=None) -> np.ndarray:
    """G_i [P]: the mean per-sample gradient norm over prompt i's accepted samples (0 when none is accepted).
    Only accepted rows are differentiated (on `mesh`: split over its batch axes)."""
    return mean_norms(*prompt_grad_norm_sums(params, model_config, scored, param_subset=param_subset,
                                             rows_per_chunk=rows_per_chunk, pad_id=pad_id, mesh=mesh))


def mean_norms(total: np.ndarray, count: np.ndarray) -> np.ndarray:
    """total / count where count > 0, else 0 (float32): G_i from prompt_grad_norm_sums."""
    return np.where(count > 0, total / np.maximum(count, 1), 0.0).astype(np.float32)


def rank_within_prompt(prompt_index: np.ndarray) -> np.ndarray:
    """Each row's position among the rows of its prompt, in row order: [3, 1, 3, 3] -> [0, 0, 1, 2]."""
    prompt_index = np.asarray(prompt_index)
    order = np.argsort(prompt_index, kind="stable")
    grouped = prompt_index[order]
    rank = np.empty(prompt_index.size, np.int64)
    rank[order] = np.arange(prompt_index.size) - np.searchsorted(grouped, grouped, side="left")
    return rank


def prompt_grad_norm_sums(params, model_config, scored: ScoredRollouts, *, param_subset: str | Sequence[str] = "embed",
                          rows_per_chunk: int = 8, pad_id: int = 0, mesh=None,
                          max_rows_per_prompt: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(sum, count) [P] of the per-sample gradient norms of prompt i's accepted samples: its first
    `max_rows_per_prompt` accepted samples when that is > 0, all of them otherwise."""
    num_prompts = len(scored.records)
    accepted = np.flatnonzero(scored.correct)
    if max_rows_per_prompt > 0 and accepted.size:
        accepted = accepted[rank_within_prompt(scored.prompt_index[accepted]) < max_rows_per_prompt]
    if accepted.size == 0:
        return np.zeros(num_prompts, np.float64), np.zeros(num_prompts, np.int64)
    batch = all_rows_batch(_take_rows(scored, accepted), rows_per_chunk, pad_id)
    norms = per_sample_grad_norms(params, model_config, batch.tokens, batch.prompt_lens, batch.response_tokens,
                                  batch.mask, param_subset=param_subset, rows_per_chunk=rows_per_chunk, mesh=mesh)
    index = scored.prompt_index[accepted]
    return (np.bincount(index, weights=norms[:accepted.size], minlength=num_prompts),
            np.bincount(index, minlength=num_prompts))


def _take_rows(scored: ScoredRollouts, rows: np.ndarray) -> ScoredRollouts:
    """The given rows of `scored`, records and prompt indices unchanged (a mixture of experts' routes too)."""
    return ScoredRollouts(records=scored.records, prompt_index=scored.prompt_index[rows], tokens=scored.tokens[rows],
                          mask=scored.mask[rows], logprobs=scored.logprobs[rows], lengths=scored.lengths[rows],
                          rewards=scored.rewards[rows], correct=scored.correct[rows],
                          **{f: getattr(scored, f)[rows] for f in _ROUTE_FIELDS if getattr(scored, f) is not None})


# ---- allocation -------------------------------------------------------------------------------------------

def cap_counts(counts: np.ndarray, weights: np.ndarray, cap: int) -> np.ndarray:
    """n_i <= cap, with the samples removed by the cap handed one at a time to the uncapped prompt of weight
    > 0 whose count is furthest below its share w_i * budget (ties: lower index), so the sum stays at
    budget = sum(counts). When every prompt of weight > 0 sits at the cap, the sum ends below budget.
    cap <= 0 means no cap."""
    counts = np.asarray(counts, np.int64).copy()
    if cap <= 0:
        return counts
    budget = int(counts.sum())
    weights = np.asarray(weights, np.float64)
    target = weights / weights.sum() * budget if weights.sum() > 0 else np.zeros_like(weights)
    counts = np.minimum(counts, cap)
    for _ in range(budget - int(counts.sum())):
        room = (weights > 0) & (counts < cap)
        if not room.any():
            break
        counts[int(np.argmax(np.where(room, target - counts, -np.inf)))] += 1
    return counts


def allocation_weights(accept_rate: np.ndarray, grad_norm: np.ndarray, *, alpha: float, beta: float) -> np.ndarray:
    """w_i = G_i / sqrt(p_i + alpha / p_i^(beta - 1)), 0 where G_i = 0 or p_i = 0 (before normalising)."""
    p = np.asarray(accept_rate, np.float64)
    g = np.asarray(grad_norm, np.float64)
    usable = (p > 0) & (g > 0)
    safe_p = np.where(usable, p, 1.0)
    return np.where(usable, g / np.sqrt(safe_p + alpha / safe_p ** (beta - 1.0)), 0.0)


def stage2_budget(accept_rate: np.ndarray, sampling: SamplingSection) -> int:
    """Stage 2's sample budget: gvm_samples_per_prompt x the prompts (`gvm_budget: prompts`) or x the prompts
    with p_i > 0 (`gvm_budget: solvable`)."""
    prompts = int(np.sum(np.asarray(accept_rate) > 0)) if sampling.gvm_budget == "solvable" else len(accept_rate)
    return prompts * sampling.gvm_samples_per_prompt


def allocate_samples(accept_rate: np.ndarray, grad_norm: np.ndarray, sampling: SamplingSection) -> np.ndarray:
    """n_i for stage 2: `gvm_allocate` with the budget of `stage2_budget` and the configured alpha, beta
    and filters, then the optional cap `gvm_max_samples` (see `cap_counts`). int64 [P]. With
    `gvm_weighting: solved` the budget is split evenly over the prompts with p_i > 0 instead (GVM's filter
    without its weighting; the other filters and the cap do not apply)."""
    budget = stage2_budget(accept_rate, sampling)
    if sampling.gvm_weighting == "solved":  # equal weights on the solved prompts, gvm_allocate's rounding
        solved = (np.asarray(accept_rate) > 0).astype(np.float32)
        return np.asarray(gvm_allocate(solved, solved, budget), np.int64)
    counts = np.asarray(gvm_allocate(np.asarray(accept_rate, np.float32), np.asarray(grad_norm, np.float32), budget,
                                     alpha=sampling.gvm_alpha, beta=sampling.gvm_beta,
                                     filter_threshold=sampling.gvm_filter_threshold,
                                     filter_insufficient=sampling.gvm_filter_insufficient), np.int64)
    if sampling.gvm_max_samples > 0:
        weights = np.where(counts > 0, allocation_weights(accept_rate, grad_norm, alpha=sampling.gvm_alpha,
                                                          beta=sampling.gvm_beta), 0.0)
        counts = cap_counts(counts, weights, sampling.gvm_max_samples)
    return counts


# ---- the two-stage sampling of one iteration --------------------------------------------------------------

def gvm_rollouts(params, model_config, tokenizer, records: list[dict], sampling: SamplingSection, scorer,
                 rng: jax.Array, *, rows_per_chunk: int = 8, mesh=None, history: GvmHistory | None = None,
                 visit: int = 0, tools: ToolUse | None = None,
                 sampler: tuple | None = None) -> tuple[ScoredRollouts, dict[str, Any]]:
    """Stage 1, gradient norms, allocation and stage 2 for one batch of prompts -> (scored, info).

    `scored` holds one group per prompt with n_i > 0 (prompt indices renumbered); when every n_i is 0 it
    is the stage-1 rollouts and info["skip_update"] is True. `scorer(texts, golds, lengths) ->
    (correct, rewards)` with a `last_seconds` attribute (train.rollouts.RewardScorer). info holds the
    samples drawn (both stages), sampling / scoring / gradient-norm seconds, and the allocation:
    gvm_p, gvm_grad_norm, gvm_n (lists over prompts) and their summaries. The per-sample gradient norms
    take `sampling.gvm_rows_per_chunk` rows at a time, or `rows_per_chunk` when that key is 0.
    With a `history` (`sampling.gvm_estimates: history`, train/gvm_history.py) stage 1 draws only for the
    prompts the history cannot estimate, p_i and G_i come from the history after this step's stage-1
    counts join it, and the stage-2 counts and norms join it afterwards (`visit`: the step).
    `sampler` = (params, model_config) the sampler reads instead (sampling.dtype, `Run.sampler_params`); the
    gradient norms always take `params`.
    """
    info = {"rounds": 2, "drawn": 0, "prompts": len(records), "filtered": 0, "sample_s": 0.0, "score_s": 0.0}
    chunk = sampling.gvm_rows_per_chunk or rows_per_chunk
    grad_norm_s = 0.0

    def draw(counts, key):
        t0 = time.perf_counter()
        out = sample_and_score(*(sampler or (params, model_config)), tokenizer, records, counts, sampling, scorer, key,
                               mesh=mesh, tools=tools)
        info["score_s"] += scorer.last_seconds
        info["sample_s"] += time.perf_counter() - t0 - scorer.last_seconds
        info["drawn"] += out.num_samples
        count_slot_use(info, out.slot_stats)
        count_tool_use(info, out.tool_stats)
        return out

    def norm_sums(scored, max_rows_per_prompt=0):
        nonlocal grad_norm_s
        t0 = time.perf_counter()
        out = prompt_grad_norm_sums(params, model_config, scored, param_subset=sampling.gvm_param_subset,
                                    rows_per_chunk=chunk, pad_id=tokenizer.pad_token_id, mesh=mesh,
                                    max_rows_per_prompt=max_rows_per_prompt)
        grad_norm_s += time.perf_counter() - t0
        return out

    def observe(scored, drawn, max_rows_per_prompt=0):
        accepted = np.bincount(scored.prompt_index, weights=scored.correct.astype(np.float64), minlength=len(records))
        history.observe(records, accepted, drawn, *norm_sums(scored, max_rows_per_prompt), visit=visit)

    n1 = sampling.gvm_stage1_samples
    probe = (np.full(len(records), n1, np.int64) if history is None
             else history.probe_counts(records, n1, sampling.gvm_history_probe, sampling.gvm_history_probe_visits))
    stage1 = draw(n1 if history is None else probe, jax.random.fold_in(rng, 0))
    accepted = np.bincount(stage1.prompt_index, weights=stage1.correct.astype(np.float64), minlength=len(records))
    if history is None:
        accept_rate = accepted / n1
        grad_norm = mean_norms(*norm_sums(stage1))
    else:
        observe(stage1, probe)
        _, accept_rate, grad_norm = history.estimates(records)
    counts = allocate_samples(accept_rate, grad_norm, sampling)
    info["gvm"] = {**allocation_log(accept_rate, grad_norm, counts, sampling, stage1),
                   "gvm_stage1_drawn": int(probe.sum())}
    if counts.sum() == 0:
        info["gvm"]["time_gvm_grad_norm_s"] = grad_norm_s
        info["skip_update"] = True
        info["skip_reason"] = ("GVM: every prompt got n_i = 0 (" + (
            "the filters removed every prompt" if np.sum(accept_rate) > 0 else "no stage-1 sample was accepted"
            if history is None else "no prompt has an accepted sample in its history")
            + "); nothing drawn in stage 2, update skipped")
        return stage1, info
    # Stage 2's records carry the p_i used: the unbiased M-step (agg prompt-mean-unbiased) divides by n_i p_i.
    stage2_records = [{**record, "gvm_accept_rate": float(p)} for record, p in zip(records, accept_rate)]
    fresh_counts = np.maximum(counts - probe, 0) if sampling.gvm_reuse_stage1 else counts
    fresh = draw(fresh_counts, jax.random.fold_in(rng, 1))
    if history is not None:  # the fresh stage-2 samples join the history (norms of at most N' accepted per prompt)
        observe(fresh, fresh_counts, max_rows_per_prompt=n1)
    fresh = ScoredRollouts(records=stage2_records, **{f: getattr(fresh, f) for f in _ROW_FIELDS + _ROUTE_FIELDS})
    stage2 = reuse_stage1(stage1, fresh, counts) if sampling.gvm_reuse_stage1 else fresh
    info["gvm"]["time_gvm_grad_norm_s"] = grad_norm_s
    keep = counts > 0
    info["filtered"] = int((~keep).sum())
    return stage2.select_groups(keep), info


_ROW_FIELDS = ("prompt_index", "tokens", "mask", "logprobs", "lengths", "rewards", "correct")
_ROUTE_FIELDS = ("routes", "prompt_routes")  # a mixture of experts' sampled routes (None for a dense model)


def reuse_stage1(stage1: ScoredRollouts, fresh: ScoredRollouts, counts: np.ndarray) -> ScoredRollouts:
    """Groups of exactly counts[i] rows: prompt i's first min(counts[i], m_i) stage-1 rows (m_i of them were
    drawn), then its fresh rows (`fresh` holds max(counts[i] - m_i, 0) rows of prompt i). Rows come out ordered by prompt; the records are
`fresh`'s."""
    rank = rank_within_prompt(stage1.prompt_index)
    kept = _take_rows(stage1, np.flatnonzero(rank < np.asarray(counts)[stage1.prompt_index]))
    merged = ScoredRollouts(records=fresh.records, **{f: np.concatenate([getattr(kept, f), getattr(fresh, f)])
                                                       for f in _ROW_FIELDS}, **concat_routes([kept, fresh]))
    return _take_rows(merged, np.argsort(merged.prompt_index, kind="stable"))


def allocation_log(accept_rate, grad_norm, counts, sampling: SamplingSection, stage1: ScoredRollouts) -> dict:
    """The per-step GVM metrics: n_i against p_i (lists over prompts) and summaries."""
    counts = np.asarray(counts)
    return {
        "gvm_p": [round(float(p), 6) for p in accept_rate],
        "gvm_grad_norm": [round(float(g), 6) for g in grad_norm],
        "gvm_n": [int(n) for n in counts],
        "gvm_budget": stage2_budget(accept_rate, sampling),
        "gvm_n_mean": float(counts.mean()) if counts.size else 0.0,
        "gvm_n_max": int(counts.max()) if counts.size else 0,
        "gvm_zero_fraction": float((counts == 0).mean()) if counts.size else 0.0,
        "gvm_stage1_accuracy": float(stage1.correct.mean()) if stage1.num_samples else 0.0,
        "gvm_unsolved_fraction": float((np.asarray(accept_rate) == 0).mean()) if counts.size else 0.0,
        "gvm_solved_fraction": float((np.asarray(accept_rate) == 1).mean()) if counts.size else 0.0,
        "gvm_skipped": int(counts.sum() == 0),
    }
