"""Layouts the memory estimate suggests for a run: the fsdp x tensor mesh of least estimated peak, and the sampler's
rows per call or the packed rows' token bound that bring it within a budget (`scripts/memory_estimate.py`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl_llm.capacity.memory import estimate_memory
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.sharding import batch_devices
from jaxrl_llm.run.config import RunConfig
from jaxrl_llm.run.shapes import whole_row_responses
from jaxrl_llm.sampling.buckets import bucket_size


def _with_rows_per_call(config: RunConfig, rows: int) -> RunConfig:
    return dataclasses.replace(config, sampling=dataclasses.replace(config.sampling, max_rows_per_call=rows))


def fit_rows_per_call(config: RunConfig, model_config: ModelConfig, mesh: dict[str, int],
                      budget_bytes: int, platform: str = "tpu") -> tuple[dict[str, Any], int]:
    """The estimate and `sampling.max_rows_per_call` when the sampler's KV cache is what pushes the peak over
    `budget_bytes`: the configured value (0 = all rows) if it fits, else the largest power of two below it
    that fits, or, if none does, the one of least peak (one row per device at the least)."""
    est = estimate_memory(config, model_config, mesh, platform=platform)
    rows = config.sampling.max_rows_per_call
    if config.sampling.engine == "continuous":  # bounded by sampling.max_slots, not by rows per call
        return est, rows
    split = batch_devices(mesh)
    while est["peak"] > budget_bytes and est["sample_rows"] > split \
            and est["sampling"] > max(est["train_step"], est["critic_step"], est["gvm_norms"]):
        halved = bucket_size(est["sample_rows"]) // 2  # halves the rows of one call
        smaller = estimate_memory(_with_rows_per_call(config, halved), model_config, mesh, platform=platform)
        if smaller["sample_rows"] >= est["sample_rows"]:  # the row bucket's floor: no fewer rows per call
            break
        est, rows = smaller, halved
    return est, rows


def suggest_layout(config: RunConfig, model_config: ModelConfig, devices: int,
                   budget_bytes: int | None = None, platform: str = "tpu") -> tuple[dict[str, Any], dict[str, Any]]:
    """The `fsdp x tensor` layout (tensor a power of two dividing the devices, at most 8, and dividing the
    heads; for a mixture of experts `fsdp x expert x tensor`, expert a power of two dividing the experts) with one
    packed row per device and micro-batch (micro_batch_size = fsdp x expert) of least estimated peak.
    With `budget_bytes`, each layout first gets the `sampling.max_rows_per_call` of `fit_rows_per_call`, and
    when no layout fits and `optim.max_row_tokens` is unset, packed rows of half, a quarter, ... of a prompt's
    responses are tried (`optim.max_row_tokens` = prompt + that many full responses; the first that fits).
    Returns (estimate, {"train.mesh": ..., "optim.micro_batch_size": ...[, "sampling.max_rows_per_call": ...]
    [, "optim.max_row_tokens": ...]} overrides; the last two only where they differ from the config's)."""
    best = _least_peak_layout(config, model_config, devices, budget_bytes, platform)
    if budget_bytes is None or best[0]["peak"] <= budget_bytes or config.optim.max_row_tokens > 0:
        return best
    per_row = whole_row_responses(config) // 2
    while per_row >= 1:
        tokens = config.data.max_prompt_tokens + per_row * config.sampling.max_new_tokens
        split = dataclasses.replace(config, optim=dataclasses.replace(config.optim, max_row_tokens=tokens))
        est, overrides = _least_peak_layout(split, model_config, devices, budget_bytes, platform)
        if est["peak"] <= budget_bytes:
            return est, {**overrides, "optim.max_row_tokens": tokens}
        per_row //= 2
    return best


def _least_peak_layout(config: RunConfig, model_config: ModelConfig, devices: int,
                       budget_bytes: int | None, platform: str) -> tuple[dict[str, Any], dict[str, Any]]:
    best = None
    for tensor, expert in _splits(model_config, devices):
        fsdp = devices // (tensor * expert)
        batch = fsdp * expert  # rows are split over data x fsdp x expert: one packed row per device
        cfg = dataclasses.replace(config, optim=dataclasses.replace(config.optim, micro_batch_size=batch))
        mesh = {"data": 1, "fsdp": fsdp, "expert": expert, "tensor": tensor}
        if budget_bytes is None:
            est = estimate_memory(cfg, model_config, mesh, platform=platform)
            rows = config.sampling.max_rows_per_call
        else:
            est, rows = fit_rows_per_call(cfg, model_config, mesh, budget_bytes, platform)
        if best is None or est["peak"] < best[0]["peak"]:
            axes = [f"fsdp={fsdp}"] + [f"{name}={n}" for name, n in (("expert", expert), ("tensor", tensor)) if n > 1]
            overrides = {"train.mesh": ",".join(axes), "optim.micro_batch_size": batch}
            if rows != config.sampling.max_rows_per_call:
                overrides["sampling.max_rows_per_call"] = rows
            best = (est, overrides)
    return best


def _splits(model_config: ModelConfig, devices: int) -> list[tuple[int, int]]:
    """(tensor, expert) sizes to try: tensor a power of two up to 8 dividing the devices and the heads; for a
    mixture of experts also expert a power of two dividing the experts and the remaining devices (1 otherwise)."""
    splits = []
    tensor = 1
    while tensor <= min(8, devices):
        if devices % tensor == 0 and model_config.num_heads % tensor == 0:
            expert = 1
            while devices % (tensor * expert) == 0 and (expert == 1 or model_config.num_experts % expert == 0):
                splits.append((tensor, expert))
                if not model_config.num_experts:
                    break
                expert *= 2
        tensor *= 2
    return splits
