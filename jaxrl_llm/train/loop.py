"""The RL outer loop, read top to bottom:

    evaluate -> for each step: take prompts -> sample -> score -> keep groups -> advantages -> update
             -> log -> evaluate every k -> checkpoint every k -> evaluate -> export

With `sampling.allocation: gvm` the sampling stage is GVM's two stages (`train/gvm.py`): N' samples per
prompt, acceptance rates and gradient norms, n_i per prompt, then n_i samples per prompt.

Every stage is a named function defined in `rollouts`, `algorithms` and `step`; this module only
orders them and keeps the books (samples drawn, prompts filtered, time per stage).
"""

from __future__ import annotations

import math
import pathlib
import time
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxrl_llm import models
from jaxrl_llm.eval import evaluate
from jaxrl_llm.models import moe
from jaxrl_llm.models.lora import EXPERT_PROJECTIONS
from jaxrl_llm.models.peft_io import save_peft
from jaxrl_llm.run.config import RunConfig
from jaxrl_llm.run.resume import any_process, host_values, new_books, preemption_guard, restore, save
from jaxrl_llm.run.setup import Run, release_free_host_memory, setup_run
from jaxrl_llm.run.state import learning_rate
from jaxrl_llm.train.algorithms import (explained_variance, gae_token_advantages, mixed_group_flags, needs_reference,
                                        rollout_weights, sequence_advantages, token_advantages)
from jaxrl_llm.train.async_rollouts import AsyncRollouts, SyncRollouts, copy_params
from jaxrl_llm.train.distill import distill_advantages
from jaxrl_llm.train.gvm import gvm_rollouts
from jaxrl_llm.train.gvm_history import GvmHistory
from jaxrl_llm.train.packing import unpack
from jaxrl_llm.train.partial_rollouts import make_partial_rollouts
from jaxrl_llm.train.rollouts import (ScoredRollouts, build_train_batches, count_slot_use, count_tool_use,
                                      counting_generate, engine_options, packed_rollouts, sample_and_score,
                                      run_prompt_template, slot_occupancy, tool_generate, tool_metrics)


class NonFiniteError(RuntimeError):
    """Raised after `train.max_bad_steps` consecutive updates with a non-finite loss or gradient."""


def train(config: RunConfig, *, resume: bool = False, policy=None, log=print) -> dict[str, Any]:
    """Run RL training as configured; returns the summary (evaluations before/after, counters, status)."""
    checkpoints = pathlib.Path(config.train.out_dir) / "checkpoints"
    if not resume and checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir()):
        raise FileExistsError(f"{config.train.out_dir} already holds checkpoints of a run: pass --resume to continue "
                              f"it, or set train.out_dir to a new directory")
    if jax.process_index() != 0:  # every process runs the loop; one speaks for the run
        log = _quiet
    run = setup_run(config, policy=policy)
    try:
        return _train(run, resume, log)
    finally:
        run.close()


def _quiet(*args, **kwargs) -> None:
    pass


def _train(run: Run, resume: bool, log) -> dict[str, Any]:
    cfg = run.config
    caveat = moe.gpu_caveat(run.model_config, jax.default_backend())
    if caveat:
        log(caveat)
    start, books, in_flight = restore(run) if resume else (0, new_books(), {})
    if start:
        log(f"resumed from step {start} in {run.checkpointer.directory}")
    if "eval_before" not in books["summary"] and cfg.train.eval_problems:
        books["summary"]["eval_before"] = evaluate_policy(run, "before training", log)
        run.metrics.write(0, eval_metrics(books["summary"]["eval_before"]))
    bad_streak = 0
    rollouts = make_rollouts(run, start, in_flight, books)
    clock = time.perf_counter()  # the origin of the step's event times (sample_start_s, ...)
    with preemption_guard() as signalled, tqdm(total=cfg.train.steps, initial=start, desc="RL steps",
                                                dynamic_ncols=True, disable=jax.process_index() != 0) as bar:
        try:
            for step in range(start, cfg.train.steps):
                t0 = time.perf_counter()
                scored, round_info = rollouts.take(step)
                count_samples(books, round_info)
                t1 = time.perf_counter()
                if round_info.get("skip_update"):
                    log(f"step {step + 1}: {round_info['skip_reason']}")
                    update_info = {"finite": True, "updates": 0}
                else:
                    update_info = update_policy(run, scored, step)
                t2 = time.perf_counter()
                bad_streak = 0 if update_info["finite"] else bad_streak + 1
                metrics = step_metrics(run, scored, round_info, update_info, books, step,
                                       sample_s=round_info["sample_s"], score_s=round_info["score_s"],
                                       wall_s=t2 - t0, train_s=t2 - t1)
                metrics.update(schedule_metrics(round_info, clock, t1, t2))
                done = step + 1
                preempted = any_process(signalled())  # all processes take part in a save, or none
                eval_acc = None
                if cfg.train.eval_every and done % cfg.train.eval_every == 0 and done < cfg.train.steps:
                    evaluation = evaluate_policy(run, f"step {done}", log)
                    eval_acc = evaluation["accuracy"]
                    metrics.update(eval_metrics(evaluation))
                if bad_streak:
                    log(f"step {done}: non-finite loss or gradient, update skipped ({bad_streak} in a row)")
                    if bad_streak >= cfg.train.max_bad_steps:
                        run.metrics.write(done, metrics)
                        save(run, done, books, eval_acc, rollouts.quiesce(done))
                        raise NonFiniteError(f"{bad_streak} consecutive non-finite updates (train.max_bad_steps="
                                             f"{cfg.train.max_bad_steps}); last good state saved at step {done}")
                if preempted or (cfg.train.save_every and done % cfg.train.save_every == 0) or eval_acc is not None:
                    save(run, done, books, eval_acc, rollouts.quiesce(done))
                if not preempted:  # version `done` to the sampler, after the save (which holds the steps before it)
                    rollouts.publish(done)
                    metrics["publish_s"] = time.perf_counter() - clock
                run.metrics.write(done, metrics)
                bar.update(1)
                bar.set_postfix(acc=f"{metrics['accuracy']:.2f}", reward=f"{metrics['reward']:.2f}",
                                len=f"{metrics['response_length']:.1f}", kept=metrics["groups_kept"])
                if preempted:
                    log(f"SIGTERM: saved step {done} to {run.checkpointer.directory}; resume with --resume")
                    books["summary"]["status"] = "preempted"
                    return books["summary"]
        finally:
            rollouts.close()
    summary = books["summary"]
    if cfg.train.eval_problems:
        summary["eval_after"] = evaluate_policy(run, "after training", log)
        run.metrics.write(cfg.train.steps, eval_metrics(summary["eval_after"]))
    save(run, cfg.train.steps, books, summary.get("eval_after", {}).get("accuracy"), {})
    export_dir = run.out_dir / "final"
    params = host_values(run.policy_params())  # a collective: every process takes part
    adapters = host_values(run.state.params) if run.lora_spec is not None else None
    critic = host_values(run.critic.state.params) if run.critic is not None else None
    if jax.process_index() == 0:
        models.save_hf(export_dir, run.model_config, params, tokenizer=run.tokenizer)
        if critic is not None:  # a token classifier with one label; critic.source takes it to continue
            models.save_hf_value(run.out_dir / "final_critic", run.critic.model_config, critic)
            summary["critic_dir"] = str(run.out_dir / "final_critic")
        experts = adapters is not None and set(run.lora_spec.targets) & set(EXPERT_PROJECTIONS)
        if experts:
            log("final_adapter/ not written: PEFT has no layout here for adapters on experts; final/ holds the "
                "merged model")
        elif adapters is not None:  # beside, not inside, final/: transformers would apply an adapter it finds there
            save_peft(run.out_dir / "final_adapter", run.lora_spec, adapters, base_model=cfg.model.source)
            summary["adapter_dir"] = str(run.out_dir / "final_adapter")
    summary.update(status="done", export_dir=str(export_dir), **books["counters"])
    report(summary, log)
    return summary


# ---- stages -----------------------------------------------------------------------------------------------

def make_rollouts(run: Run, start: int, in_flight: dict, books: dict) -> SyncRollouts | AsyncRollouts:
    """Where the loop's steps take their rollouts (`rollouts.mode`): drawn when asked, by a sampler thread up
    to `rollouts.max_staleness` updates ahead (`train/async_rollouts.py`), with the policy copied to the sampler's
    devices (`rollouts.sampler_devices`) or kept beside the trainer's, or by a sampler that never stops decoding
    (`train/partial_rollouts.py`)."""
    section = run.config.rollouts  # a resumed run's schedule is the checkpoint's (resume.check_rollout_schedule)
    if section.mode == "sync":
        return SyncRollouts(lambda step: collect_rollouts(run, step, books))
    if section.mode == "partial":
        return make_partial_rollouts(run, start, in_flight, filter_groups=lambda scored: filter_mixed(run, scored))
    return AsyncRollouts(lambda step, policy: collect_rollouts(run, step, policy=policy), run.sampler_params,
                         lambda params: copy_params(params, run.split_mesh), start=start,
                         steps=run.config.train.steps, max_staleness=section.max_staleness, in_flight=in_flight)


def collect_rollouts(run: Run, step: int, books: dict | None = None, *, policy=None) -> tuple[ScoredRollouts, dict]:
    """Sample `samples_per_prompt` per prompt and score; with the `mixed` filter keep only groups whose
    rewards differ, and with dynamic sampling (DAPO) draw new prompts until enough groups are kept or
    `max_sampling_rounds` is reached. With GVM allocation, every `gvm_refresh_every`-th step runs the
    two GVM stages and the steps between sample `gvm_samples_per_prompt` per prompt. `policy`: the sampler's
    weights (default: the current policy in `sampling.dtype`); `books`: GVM's history lives there. The samples
    are counted (`count_samples`) where the loop takes them."""
    cfg, algo = run.config, run.config.algorithm
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.train.seed), step)
    gvm = cfg.sampling.allocation == "gvm"
    if gvm and step % cfg.sampling.gvm_refresh_every == 0:
        return collect_gvm_rollouts(run, key, books or {}, step)
    per_prompt = run.shapes.samples_per_prompt  # GVM's later-step count under GVM (run.shapes)
    kept_parts, info = [], {"rounds": 0, "drawn": 0, "prompts": 0, "filtered": 0, "sample_s": 0.0, "score_s": 0.0}
    need = cfg.sampling.prompts_per_step
    if policy is None:  # under LoRA: the adapters merged once for all rounds; in sampling.dtype
        policy = run.sampler_params()
    while True:
        records = next(run.data)
        t0 = time.perf_counter()
        scored = sample_and_score(policy, run.sampler_model_config, run.tokenizer, records,
                                  per_prompt, cfg.sampling, run.scorer,
                                  jax.random.fold_in(key, info["rounds"]), mesh=run.sampler_mesh, tools=run.tools)
        info["sample_s"] += time.perf_counter() - t0  # scoring time is measured inside the scorer
        info["score_s"] += run.scorer.last_seconds
        info["sample_s"] -= run.scorer.last_seconds
        info["rounds"] += 1
        info["drawn"] += scored.num_samples
        count_slot_use(info, scored.slot_stats)
        count_tool_use(info, scored.tool_stats)
        info["prompts"] += len(records)
        if algo.group_filter == "mixed" or algo.dynamic_sampling:
            keep = mixed_group_flags(scored.rewards, scored.prompt_index, num_groups=len(records))
            info["filtered"] += int((~keep).sum())
            scored = scored.select_groups(keep)
        kept_parts.append(scored)
        kept = sum(len(p.records) for p in kept_parts)
        if not algo.dynamic_sampling or kept >= need or info["rounds"] >= algo.max_sampling_rounds:
            break
    scored = ScoredRollouts.concat(kept_parts)
    if algo.dynamic_sampling and len(scored.records) > need:
        keep = np.arange(len(scored.records)) < need
        info["filtered"] += int((~keep).sum())
        scored = scored.select_groups(keep)
    return scored, info


def collect_gvm_rollouts(run: Run, key: jax.Array, books: dict, step: int) -> tuple[ScoredRollouts, dict]:
    """GVM's two sampling stages on one prompt batch; both stages count as samples drawn. The `mixed`
    group filter applies to the stage-2 groups. With `gvm_estimates: history` the per-prompt estimates live
    in books["gvm_history"] and are saved with every checkpoint."""
    cfg = run.config
    history = None
    if cfg.sampling.gvm_estimates == "history":
        history = books.setdefault("gvm_history", GvmHistory(decay=cfg.sampling.gvm_history_decay))
    policy = run.policy_params()
    scored, info = gvm_rollouts(policy, run.model_config, run.tokenizer, next(run.data), cfg.sampling,
                                run.scorer, key, rows_per_chunk=run.shapes.gvm_chunk, mesh=run.mesh,
                                history=history, visit=step, tools=run.tools,
                                sampler=(run.sampler_params(policy), run.sampler_model_config))
    if cfg.algorithm.group_filter == "mixed" and not info.get("skip_update"):
        keep = mixed_group_flags(scored.rewards, scored.prompt_index, num_groups=len(scored.records))
        info["filtered"] += int((~keep).sum())
        scored = scored.select_groups(keep)
    return scored, info


def filter_mixed(run: Run, scored: ScoredRollouts) -> tuple[ScoredRollouts, int]:
    """With `algorithm.group_filter: mixed`, only the groups whose rewards differ; (rollouts, groups filtered)."""
    if run.config.algorithm.group_filter != "mixed":
        return scored, 0
    keep = mixed_group_flags(scored.rewards, scored.prompt_index, num_groups=len(scored.records))
    return scored.select_groups(keep), int((~keep).sum())


def count_samples(books: dict, info: dict) -> None:
    """Add a step's draws to the run's counters (where the loop takes the step's rollouts)."""
    books["counters"]["samples_drawn"] += info["drawn"]
    books["counters"]["prompts_drawn"] += info["prompts"]
    books["counters"]["prompts_filtered"] += info["filtered"]


def update_policy(run: Run, scored: ScoredRollouts, step: int) -> dict[str, Any]:
    """Advantages -> old / reference log-probs -> `epochs` x `mini_batches` optimizer updates. With a critic
    (PPO): its values of the rollout, GAE's per-token advantages and returns, and a critic update after each
    policy update, on the same mini-batch."""
    cfg, algo = run.config, run.config.algorithm
    if scored.num_samples == 0:
        return {"finite": True, "updates": 0}
    use_sampler = not algo.rollout_correction and (algo.old_logp == "sampler" or (  # partial: the gap is logged
        algo.old_logp == "auto" and cfg.optim.epochs * cfg.optim.mini_batches == 1 and cfg.rollouts.mode != "partial"))
    old_logp = scored.logprobs if use_sampler else token_logprobs(run, run.policy_params(), scored)
    ref_logp = token_logprobs(run, run.ref_params, scored) if needs_reference(algo) else np.zeros_like(old_logp)
    old_values = returns = None
    out: dict[str, Any] = {}
    if run.critic is None:
        seq_adv = sequence_advantages(algo, scored.rewards, scored.prompt_index, len(scored.records))
        advantages = token_advantages(algo, seq_adv, old_logp, ref_logp, scored.mask)
        out["advantage_mean"] = float(seq_adv.mean())
    else:
        old_values = token_values(run, scored)
        advantages, returns = gae_token_advantages(algo, scored.rewards, old_values, scored.mask, old_logp, ref_logp)
        on = scored.mask != 0
        out.update(explained_variance=explained_variance(returns, old_values, scored.mask),
                   value_mean=float(old_values[on].mean()), return_mean=float(returns[on].mean()),
                   advantage_mean=float(advantages[on].mean()))
    if run.teacher is not None:  # on-policy distillation: the teacher's log-probs of the sampled tokens
        teacher_logp = per_sample_pass(run, run.teacher.logprob_fn, run.teacher.params, scored)
        advantages, distilled = distill_advantages(cfg.distill, advantages, scored.logprobs, teacher_logp, scored.mask)
        out.update(distilled)
    topk = {}
    if run.teacher is not None and run.teacher.topk_fn is not None:  # top-K: the teacher's ids, a loss in the step
        topk = dict(zip(("teacher_ids", "teacher_topk_logp"),
                        per_sample_pass(run, run.teacher.topk_fn, run.teacher.params, scored)))
    if not use_sampler:  # the trainer's and the sampler's log-probs of the same tokens: their gap, and its correction
        weights, correction = rollout_weights(algo, old_logp, scored.logprobs, scored.mask)
        advantages = advantages if weights is None else advantages * weights
        out.update(correction)
    rng = np.random.default_rng([cfg.train.seed, step])
    sums: dict[str, float] = {}
    updates, finite = 0, True
    for _ in range(cfg.optim.epochs):
        for batch, denom, _rows in build_train_batches(
                scored, advantages, old_logp, ref_logp, algo, mini_batches=cfg.optim.mini_batches,
                micro_batch_size=cfg.optim.micro_batch_size, pad_id=run.tokenizer.pad_token_id, rng=rng,
                max_row_tokens=cfg.optim.max_row_tokens, old_values=old_values, returns=returns, **topk):
            placed = run.place_batch(batch)
            run.state, metrics = run.train_step(run.state, placed, np.float32(denom))
            if run.critic is not None:  # the value loss is a token-mean over the mini-batch's response tokens
                run.critic.state, critic_metrics = run.critic.train_step(  # (the critic reads no teacher top K)
                    run.critic.state, placed._replace(teacher_ids=None, teacher_topk_logp=None),
                    np.float32(batch.mask.sum()))
                metrics = {**metrics, **critic_metrics}
            metrics = jax.device_get(metrics)
            finite = finite and bool(metrics["finite"]) and bool(metrics.get("value_finite", True))
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            updates += 1
    out.update({k: v / max(updates, 1) for k, v in sums.items()})
    out.update(finite=finite, updates=updates)
    return out


def token_values(run: Run, scored: ScoredRollouts) -> np.ndarray:
    """The critic's values [R, N] of the states before every sampled response token (0 off the mask)."""
    return per_sample_pass(run, run.critic.value_fn, run.critic.state.params, scored)


def token_logprobs(run: Run, params, scored: ScoredRollouts) -> np.ndarray:
    """Teacher-forced log-probs [R, N] of every sampled response under `params`."""
    return per_sample_pass(run, run.logprob_fn, params, scored)


def per_sample_pass(run: Run, pass_fn, params, scored: ScoredRollouts) -> np.ndarray:
    """`pass_fn(params, batch) -> [G, S, R, ...]` (or a tuple of them) over every sample packed by prompt, back per
    sample [N, R, ...] (0 off the mask)."""
    optim = run.config.optim
    batch, groups, order = packed_rollouts(scored, optim.micro_batch_size, run.tokenizer.pad_token_id,
                                           optim.max_row_tokens)
    out = jax.device_get(pass_fn(params, run.place_batch(batch)))
    back = np.argsort(order)

    def per_sample(x):
        x = unpack(np.asarray(x)[back], groups, scored.num_samples)
        return x * scored.mask.reshape(*scored.mask.shape, *[1] * (x.ndim - 2)).astype(x.dtype)

    return tuple(per_sample(x) for x in out) if isinstance(out, tuple) else per_sample(out)


def evaluate_policy(run: Run, label: str, log) -> dict[str, Any]:
    """avg@k on the held-out set, with its sampling noise (see `sampling_sd`)."""
    cfg = run.config
    slot_use: dict = {}
    generate_fn = {"generate_fn": counting_generate(slot_use)} if cfg.sampling.engine == "continuous" else {}
    if run.tools is not None:
        generate_fn = {"generate_fn": tool_generate(run.tools, run.tokenizer, slot_use,
                                                    **engine_options(cfg.sampling))}
    metrics = evaluate(run.policy_params(), run.model_config, run.tokenizer, run.eval_records,
                       k=cfg.train.eval_samples, max_new_tokens=cfg.sampling.max_new_tokens,
                       temperature=cfg.train.eval_temperature, top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k,
                       template=run_prompt_template(cfg), seed=cfg.train.seed + 1000, return_samples=True,
                       mesh=run.mesh, samples_per_call=eval_rows_per_call(cfg.sampling), **code_verifier(cfg),
                       **({} if run.tools is not None else engine_options(cfg.sampling)), **generate_fn)
    correct = [s["correct"] for s in metrics.pop("samples")]
    k = cfg.train.eval_samples
    result = {"accuracy": float(metrics[f"avg@{k}"]), "sampling_sd": sampling_sd(correct),
              **{key: value for key, value in metrics.items() if isinstance(value, (int, float))},
              **slot_occupancy(slot_use), **tool_metrics(slot_use)}
    log(f"eval {label}: avg@{k} = {result['accuracy']:.3f} (sampling sd {result['sampling_sd']:.3f}) over "
        f"{len(correct)} problems, pass@{k} = {metrics[f'pass@{k}']:.3f}, format {metrics['format_rate']:.2f} "
        f"({metrics['seconds']:.0f}s)")
    release_free_host_memory()  # the KV caches and logits of its sampler calls
    return result


def code_verifier(cfg) -> dict:
    """`evaluate`'s verify for code tasks (algorithm.verifier code): correct when every test passes; {} for math."""
    if cfg.algorithm.verifier != "code":
        return {}
    from jaxrl_llm.rewards import run_tests

    def verify(completion: str, tests: str) -> float:
        passed, total = run_tests(completion, tests, timeout_s=cfg.train.verifier_timeout)
        return float(passed == total)

    return {"verify": verify}


def eval_metrics(evaluation: dict) -> dict:
    """An evaluation's metrics.jsonl entries: eval_accuracy, its sampling noise eval_sampling_sd (`sampling_sd`), and
    eval_slot_occupancy with the continuous engine."""
    out = {"eval_accuracy": evaluation["accuracy"], "eval_sampling_sd": evaluation["sampling_sd"]}
    if "sampling_slot_occupancy" in evaluation:
        out["eval_slot_occupancy"] = evaluation["sampling_slot_occupancy"]
    for key in ("tool_call_rate", "tool_calls", "tool_errors"):  # tool use (tools.env)
        if key in evaluation:
            out[f"eval_{key}"] = evaluation[key]
    return out


def eval_rows_per_call(sampling) -> int:
    """Rows an evaluation decodes per sampler call: `sampling.max_rows_per_call`, else no more than a training
    step's rows and at most 128 (the KV cache grows with the rows of a call)."""
    return sampling.max_rows_per_call or min(128, sampling.prompts_per_step * sampling.samples_per_prompt)


def sampling_sd(correct: list[list[float]]) -> float:
    """Standard deviation of avg@k between two evaluations of the same model on the same problems:
    sd^2 = (1 / N^2) sum_i p_i (1 - p_i) / k_i, with p_i(1 - p_i) estimated without bias as
    c_i (k_i - c_i) / (k_i (k_i - 1)) from c_i correct of k_i samples."""
    total = 0.0
    for row in correct:
        k, c = len(row), float(sum(row))
        if k > 1:
            total += c * (k - c) / (k * (k - 1)) / k
    return math.sqrt(total) / max(len(correct), 1)


def step_metrics(run: Run, scored: ScoredRollouts, round_info: dict, update: dict, books: dict, step: int,
                 **times) -> dict[str, Any]:
    n = max(scored.num_samples, 1)
    tokens = float(scored.mask.sum())
    return {
        "reward": float(scored.rewards.mean()) if scored.num_samples else 0.0,
        "accuracy": float(scored.correct.mean()) if scored.num_samples else 0.0,
        "acceptance_rate": float(scored.correct.sum() / n),
        "response_length": float(scored.lengths.mean()) if scored.num_samples else 0.0,
        "groups_kept": len(scored.records), "sampling_rounds": round_info["rounds"],
        "samples_drawn": books["counters"]["samples_drawn"], "prompts_filtered": books["counters"]["prompts_filtered"],
        "lr": learning_rate(run.config.optim, int(run.state.step)),
        "tokens_per_s": tokens / max(times["sample_s"], 1e-9),
        # every figure the update returns (the step's, the critic's, the correction's, distillation's, a mixture of
        # experts' routes_changed and expert load), but the finite flags, which skipped_update counts
        **{k: v for k, v in update.items() if k not in ("finite", "value_finite", "updates")},
        "updates": update["updates"], "skipped_update": 0 if update["finite"] else 1,
        **{f"time_{k}": v for k, v in times.items()},
        **slot_occupancy(round_info),  # continuous engine: useful / decoded slot-steps of the step's sampler calls
        **tool_metrics(round_info),  # tool use (tools.env): turns, tool calls, errors, timeouts per sample
        **round_info.get("gvm", {}),  # the GVM allocation (n_i against p_i) on steps that ran stage 1
    }


def schedule_metrics(round_info: dict, clock: float, train_start: float, train_end: float) -> dict[str, float]:
    """A step's place in the schedule of sampling and training: the policy version its rollouts were drawn with
    and their staleness (`rollouts.max_staleness`), the seconds the trainer waited for them, and the step's event
    times in seconds since the loop started (`benchmarks/async_sim.py` replays them)."""
    out = {"policy_version": round_info["policy_version"], "staleness": round_info["staleness"],
           "time_wait_s": round_info["wait_s"], "train_start_s": train_start - clock, "train_end_s": train_end - clock}
    for key in ("staleness_mean", "staleness_max", "tokens_per_version", "dropped_stale"):  # partial rollouts
        if key in round_info:
            out[key] = round_info[key]
    if "sample_start" in round_info:  # not for rollouts drawn before a --resume (saved in flight)
        out.update(sample_start_s=round_info["sample_start"] - clock, sample_end_s=round_info["sample_end"] - clock)
    return out


def report(summary: dict, log) -> None:
    before, after = summary.get("eval_before"), summary.get("eval_after")
    if before and after:
        gain = after["accuracy"] - before["accuracy"]
        noise = math.sqrt(before["sampling_sd"] ** 2 + after["sampling_sd"] ** 2)
        summary["improvement"] = gain
        summary["improvement_in_noise_sd"] = gain / noise if noise else float("inf")
        log(f"held-out accuracy: {before['accuracy']:.3f} -> {after['accuracy']:.3f} (change {gain:+.3f}; "
            f"the noise between two evaluations of one model is {noise:.3f} sd, so this is "
            f"{summary['improvement_in_noise_sd']:.1f} sd)")
    log(f"samples drawn: {summary.get('samples_drawn')}, prompts filtered: {summary.get('prompts_filtered')}; "
        f"policy exported to {summary.get('export_dir')}")
