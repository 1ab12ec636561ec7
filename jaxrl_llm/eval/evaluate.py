"""Evaluate a policy on benchmark records: build prompts, sample k completions each, score, summarise."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxrl_llm.data.benchmarks import load_benchmark
from jaxrl_llm.data.prompts import PromptTemplate, build_prompts
from jaxrl_llm.eval.metrics import Verifier, compute_metrics, format_table, score_samples, write_json

logger = logging.getLogger(__name__)


def _default_generate():
    from jaxrl_llm.sampling import generate

    return generate


def evaluate(params, config, tokenizer, records: Sequence[dict], *, k: int, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             template: PromptTemplate | str = "reasoning", max_prompt_tokens: int | None = None,
             samples_per_call: int = 128, seed: int = 0, stop_ids: Sequence[int] | None = None,
             verify: Verifier | None = None, generate_fn: Callable | None = None,
             return_samples: bool = False, progress: bool = False, pad_last_call: bool = True,
             **generate_kwargs) -> dict:
    """Metrics of ``k`` samples per record (see ``jaxrl_llm.eval.metrics``), plus bookkeeping.

    Prompts come from ``build_prompts(records, tokenizer, template, max_prompt_tokens)`` (over-long ones
    are dropped and reported as ``dropped_prompts``). Completions are drawn by
    ``generate_fn(params, config, prompt_ids, num_samples=k, max_new_tokens=..., temperature=...,
    top_p=..., top_k=..., stop_ids=..., rng=...)`` (default ``jaxrl_llm.sampling.generate``),
    max(1, samples_per_call // k) prompts at a time (the KV cache grows with the rows of one call: 128
    rows of SmolLM2-135M with 256-token prompts hold ~3.5 GB), with rng = fold_in(PRNGKey(seed), call index); each
    response is decoded up to its length with ``tokenizer.decode`` and scored with ``verify``
    (default ``jaxrl_llm.rewards.math_reward``). Extra keys: dropped_prompts, truncated_rate (samples
    that hit max_new_tokens), seconds; with ``return_samples``, ``samples`` lists each problem's id,
    gold, completions and correctness. ``progress`` shows a tqdm bar over the generate calls.

    ``pad_last_call``: a last call with fewer prompts than the earlier ones is filled up to their number with
    repeats of its own prompts, whose samples are decoded and thrown away, so that it reuses the earlier calls'
    compiled sampler instead of compiling one for a new shape (a compilation of the bundled model costs 30-40 s
    on a 2-core CPU, the extra rows' decoding far less at evaluation lengths). Sample keys follow the sample
    index, so the real prompts' samples come first and are drawn with the same keys either way.
    """
    import jax

    generate_fn = generate_fn or _default_generate()
    kept, prompt_stats = build_prompts(records, tokenizer, template, max_prompt_tokens=max_prompt_tokens)
    stop_ids = tuple(stop_ids) if stop_ids is not None else tuple(getattr(tokenizer, "stop_ids", ()))
    key = jax.random.PRNGKey(seed)
    completions: list[list[str]] = [[] for _ in kept]
    lengths: list[list[int]] = [[] for _ in kept]
    truncated = 0
    prompts_per_call = max(1, samples_per_call // k)
    started = time.perf_counter()
    starts = range(0, len(kept), prompts_per_call)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=f"eval k={k}", unit="call")
    for call, start in enumerate(starts):
        chunk = kept[start:start + prompts_per_call]
        prompt_ids = [record["prompt_ids"] for record in chunk]
        if pad_last_call and start > 0:
            prompt_ids += [prompt_ids[i % len(chunk)] for i in range(prompts_per_call - len(chunk))]
        rollout = generate_fn(params, config, prompt_ids, num_samples=k,
                              max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              stop_ids=stop_ids, rng=jax.random.fold_in(key, call), **generate_kwargs)
        tokens, row_lengths = np.asarray(rollout.tokens), np.asarray(rollout.lengths)
        finish = np.asarray(rollout.finish_reason)
        for row, prompt_index in enumerate(np.asarray(rollout.prompt_index)):
            if prompt_index >= len(chunk):  # a repeat that filled the last call up
                continue
            length = int(row_lengths[row])
            completions[start + int(prompt_index)].append(
                tokenizer.decode([int(t) for t in tokens[row, :length]], skip_special_tokens=True))
            lengths[start + int(prompt_index)].append(length)
            truncated += int(finish[row] != 0)
    golds = [record["answer"] for record in kept]
    correct, answers = score_samples(completions, golds, verify)
    metrics = compute_metrics(completions, golds, k=k, lengths=lengths, scored=(correct, answers))
    metrics.update(dropped_prompts=prompt_stats.dropped, truncated_rate=truncated / max(metrics["num_samples"], 1),
                   seconds=time.perf_counter() - started)
    if return_samples:
        metrics["samples"] = [{"id": record["id"], "question": record["question"], "gold": gold,
                               "completions": texts, "answers": problem_answers, "correct": problem_correct}
                              for record, gold, texts, problem_answers, problem_correct
                              in zip(kept, golds, completions, answers, correct)]
    return metrics


def evaluate_benchmarks(params, config, tokenizer, benchmarks: Sequence[str], *, k: int, max_new_tokens: int,
                        limit: int | None = None, out_path: str | os.PathLike | None = None,
                        print_results: bool = True, **evaluate_kwargs) -> dict[str, dict]:
    """``evaluate`` on each benchmark (a registry name or a file path); prints a table, writes JSON.

    Returns {benchmark: metrics}. The JSON file holds ``{"results": ..., "settings": ...}``.
    """
    results = {}
    for name in benchmarks:
        records = load_benchmark(name, limit=limit)
        results[str(name)] = evaluate(params, config, tokenizer, records, k=k, max_new_tokens=max_new_tokens,
                                      **evaluate_kwargs)
        logger.info("%s: %s", name, {key: value for key, value in results[str(name)].items() if key != "samples"})
    if print_results:
        print(format_table(results))
    if out_path is not None:
        settings = {"k": k, "max_new_tokens": max_new_tokens, "limit": limit,
                    **{key: value for key, value in evaluate_kwargs.items()
                       if isinstance(value, (int, float, str, bool, type(None)))}}
        template = evaluate_kwargs.get("template", "reasoning")
        settings["template"] = template if isinstance(template, str) else repr(template)
        write_json(out_path, results, settings=settings)
    return results

