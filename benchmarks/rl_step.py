"""One whole GRPO step (sample, score, log-probs, update) of jaxrl_llm beside TRL's `GRPOTrainer` and google-tunix's
`GRPOLearner`, on the same model, prompts, group size, completion length and learning rate, in the same process:
per-step medians with the split into sampling / scoring / training, and the XLA compilations of each JAX step.

    python benchmarks/rl_step.py [--shape demo|long] [--steps 5] [--prompts P] [--samples N]
        [--max-new-tokens M] [--trl-micro-batch B] [--tunix-micro-batch P] [--skip-trl] [--skip-tunix]
        [--set key=value ...] [--json OUT]

The peers are not in the project's extras: TRL needs torch (the `test` extra) and `trl`; tunix is installed
without its dependencies (they pin an older transformers), with the pinned set benchmarks/README.md lists.

Shapes (any value can be changed with the flags above or `--set section.key=value`):
- demo: the embedded demo, `jaxrl-llm train`'s defaults (run/config.py): bundled SmolLM2-135M-Instruct in
  float32, GRPO without KL, 8 prompts x 8 samples x 24 new tokens of the 2-term 1-digit arithmetic task with
  the 3-shot prompt, AdamW lr 1e-5 (weight decay 0.01, clip 1.0, constant), one update per step.
- long: the same algorithm on gsm8k-100 with the `reasoning` prompt, up to 512 new tokens, at most 64 rows
  per sampler call and one packed row per micro-batch.

jaxrl_llm: the trainer's own stages, in `train.loop.train`'s order and with its timers: `setup_run`, then
per step `collect_rollouts` (sample: `generate`; score: the verifier, `RewardScorer.last_seconds`) and
`update_policy` (advantages, log-probs when needed, packing, the jitted step); "training" = `update_policy`.
Step 1 holds the compilation of the sampler and the train step; later steps compile again only for a new
packed width or prompt bucket. Compilations are counted with a `jax.monitoring` duration listener on
'/jax/core/compile/backend_compile_duration' (one event per XLA compile; cache hits record none).

TRL (`trl.GRPOTrainer`, torch CPU, no vLLM): the same weights written with `models.save_hf` (tokenizer
included) and loaded with transformers in float32; the prompts our run drew, in the same order (the
dataset holds our first `steps x prompts` records as rendered prompt text, `shuffle_dataset=False`); the same
verifier as its reward function (`correctness_reward` through our `RewardScorer`); `num_generations` =
samples, `max_completion_length` = M, temperature 1, top_k 0, top_p 1, eos ids = our stop ids, `beta=0`
(no KL, no reference model), `loss_type` left at TRL's default, one optimizer step per generation batch
(`per_device_train_batch_size` x `gradient_accumulation_steps` = prompts x samples completions, the forward and
backward in micro-batches of `--trl-micro-batch` completions), AdamW with our learning rate, weight decay
0.01, clip 1.0 and a constant schedule; TRL's defaults otherwise (activation checkpointing on, bf16 off
here since it is not an accelerator). Per-step time is between `on_step_end` callbacks; sampling = its
`_generate` (tokenisation and `model.generate`), scoring = its `_calculate_rewards`, training = the rest.

tunix (`tunix.rl.grpo.grpo_learner.GRPOLearner` 0.1.7, JAX, its "vanilla" rollout engine = its `Sampler`), run
last: our weights in its Llama 3 as `benchmarks/sampling.py` builds it, with that script's id tokenizer (text =
space-separated token ids, so tunix sees exactly our prompt ids; pad 0 = <|endoftext|>, a stop id found in no
prompt; completions decoded with our tokenizer before scoring); an `RLCluster` with every role on one 1 x 1 mesh
whose axes are `AxisType.Auto` (an explicit-axes mesh fails in its embedding gather), so actor and rollout share
one model and no weight sync runs; no reference model and `beta=0`; the prompts our run drew, in the same order,
one batch of `prompts` per step, columns as numpy arrays (its tree maps split a list of strings); `num_generations`
= samples, all of a step's rows per sampler call (or as many prompts' as our `sampling.max_rows_per_call` holds,
dividing the step's), `max_tokens_to_generate` = M, `max_prompt_length` = the longest prompt (no recompilation),
our temperature / top_p / top_k, eos tokens = our stop ids, rollout seed = `train.seed` (tunix reuses one seed for
every call); the same verifier as its reward function; `num_iterations=1`, epsilon = our `clip_low`,
`loss_agg_mode` = our `algorithm.agg` (token-mean, within each micro-batch); one optimizer update per step
(mini-batch = the step's prompts) with our `run.state.make_optimizer` (clip 1.0, then AdamW with weight decay
0.01 off norm scales, constant lr), which tunix wraps in `optax.MultiSteps` over micro-batches of
`--tunix-micro-batch` prompts (default 1: `samples` completions per forward/backward, since its Llama 3 keeps every
activation, no remat, by default). Its completions end before the stop token, so its loss never sees that token.
Per-step time is its `_run_global_step` (rollout, rewards, advantages, the updates); sampling =
`RLCluster.generate` (tokenising, prefill, decode, detokenising), scoring = `_compute_rewards`, training = the
rest. It runs after ours, so it inherits the 256 KB mmap threshold that `setup_run` sets process-wide: without it
its resident memory grows by 0.3-0.8 GB with every update (tunix alone, 2 prompts x 2 samples x 16 tokens, 2 steps:
8.4 GiB peak against 6.3 GiB for 3 steps with it). Its `MetricsLogger.close()` clears every `jax.monitoring`
listener at the end of `train`, so the compile counter tolerates finding itself gone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import shutil
import statistics
import tempfile
import time

import numpy as np

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

SHAPES = {
    "demo": [],
    "long": ["data.train=gsm8k-100", "data.prompt=reasoning", "sampling.max_new_tokens=512",
             "sampling.max_rows_per_call=64", "optim.micro_batch_size=1"],
}


class CompileCounter:
    """Counts XLA backend compilations (and their seconds) through a jax.monitoring listener."""

    def __init__(self):
        self.count, self.seconds = 0, 0.0

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1
            self.seconds += duration

    def __enter__(self):
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        import jax.monitoring

        try:
            jax.monitoring.unregister_event_duration_listener(self)
        except (AssertionError, ValueError):  # tunix's MetricsLogger.close() clears every jax.monitoring listener
            pass


def median_split(steps: list[dict], skip_first: bool = True) -> dict:
    """Median of each timed part over the steps (the first one, which compiles, left out when there are more)."""
    later = steps[1:] if skip_first and len(steps) > 1 else steps
    keys = [k for k in ("wall_s", "sample_s", "score_s", "train_s") if k in later[0]]
    return {k: statistics.median(s[k] for s in later) for k in keys}


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux


# ---- jaxrl_llm ------------------------------------------------------------------------------------------

def run_ours(config, policy) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.run.setup import setup_run
    from jaxrl_llm.train.loop import collect_rollouts, new_books, update_policy

    model_config, params, tokenizer = policy
    steps = []
    with tempfile.TemporaryDirectory() as out_dir, CompileCounter() as compiles:
        cfg = dataclasses.replace(config, train=dataclasses.replace(config.train, out_dir=out_dir, eval_problems=0,
                                                                    save_every=0))
        # the train step donates its parameters: the run gets its own copy
        run = setup_run(cfg, policy=(model_config, jax.tree_util.tree_map(jnp.array, params), tokenizer))
        try:
            books = new_books()
            for step in range(cfg.train.steps):
                count, compile_s = compiles.count, compiles.seconds
                t0 = time.perf_counter()
                scored, info = collect_rollouts(run, step, books)
                t1 = time.perf_counter()
                update = update_policy(run, scored, step)
                t2 = time.perf_counter()
                steps.append(dict(wall_s=t2 - t0, sample_s=info["sample_s"], score_s=info["score_s"], train_s=t2 - t1,
                                  compiles=compiles.count - count, compile_s=compiles.seconds - compile_s,
                                  reward=float(scored.rewards.mean()), response_length=float(scored.lengths.mean()),
                                  loss=float(update.get("loss", float("nan")))))
                print(f"jaxrl_llm step {step + 1}: " + step_line(steps[-1]), flush=True)
        finally:
            run.close()
    return steps


def step_line(s: dict) -> str:
    parts = [f"{s['wall_s']:.2f} s (sample {s['sample_s']:.2f}, score {s['score_s']:.3f}, train {s['train_s']:.2f})"]
    if "compiles" in s:
        parts.append(f"{s['compiles']} compilations ({s['compile_s']:.1f} s)")
    parts.append(f"reward {s['reward']:.3f}, mean length {s['response_length']:.1f}")
    return ", ".join(parts)


def drawn_records(config, tokenizer) -> list[dict]:
    """The prompts our run draws, step by step (the same stream as `setup_run`'s)."""
    from jaxrl_llm import data as data_lib
    from jaxrl_llm.run.setup import load_prompts

    records = load_prompts(config.data.train, tokenizer, config)
    stream = data_lib.RecordBatches(records, data_lib.LoaderConfig(
        batch_size=config.sampling.prompts_per_step, seed=config.data.seed, shard_index=0, shard_count=1))
    return [r for _ in range(config.train.steps) for r in next(stream)]


# ---- TRL ------------------------------------------------------------------------------------------------

def run_trl(config, policy, micro_batch: int) -> tuple[list[dict], dict]:
    import datasets
    import torch
    import transformers
    import trl

    from jaxrl_llm.models import save_hf
    from jaxrl_llm.train.rollouts import RewardScorer

    model_config, params, tokenizer = policy
    s, o = config.sampling, config.optim
    completions = s.prompts_per_step * s.samples_per_prompt
    micro_batch = micro_batch or completions
    if completions % micro_batch:
        raise SystemExit(f"--trl-micro-batch {micro_batch} must divide prompts x samples = {completions}")
    records = drawn_records(config, tokenizer)
    scorer = RewardScorer(config.algorithm, config.sampling, timeout=config.train.verifier_timeout, workers=0)
    timers: dict[int, dict] = {}

    def reward(completions, answer, **kwargs):
        _, rewards = scorer(list(completions), list(answer), np.zeros(len(completions), np.int32))
        return [float(r) for r in rewards]

    class TimedGRPOTrainer(trl.GRPOTrainer):
        """Adds the seconds of generation and reward computation of each optimizer step to `timers`."""

        def _timed(self, key, method, *args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                split = timers.setdefault(self.state.global_step, {"sample_s": 0.0, "score_s": 0.0})
                split[key] += time.perf_counter() - start

        def _generate(self, *args, **kwargs):
            return self._timed("sample_s", super()._generate, *args, **kwargs)

        def _calculate_rewards(self, *args, **kwargs):
            return self._timed("score_s", super()._calculate_rewards, *args, **kwargs)

    class StepClock(transformers.TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as directory:
        save_hf(directory, model_config, params, tokenizer=tokenizer)
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.generation_config.eos_token_id = list(tokenizer.stop_ids)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    check = hf_tokenizer(text=records[0]["prompt"])["input_ids"]
    same_ids = list(check) == list(records[0]["prompt_ids"])
    print(f"TRL tokenizes the rendered prompt to our prompt ids: {same_ids}", flush=True)
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in records])
    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="rl_step_trl_"), max_steps=config.train.steps,
        per_device_train_batch_size=micro_batch, gradient_accumulation_steps=completions // micro_batch,
        num_generations=s.samples_per_prompt, max_completion_length=s.max_new_tokens, temperature=s.temperature,
        top_k=s.top_k, top_p=s.top_p, beta=0.0, learning_rate=o.lr, weight_decay=o.weight_decay,
        max_grad_norm=o.grad_clip, adam_beta1=o.b1, adam_beta2=o.b2, lr_scheduler_type="constant",
        warmup_steps=0, shuffle_dataset=False, use_cpu=True, bf16=False, seed=config.train.seed, logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, use_vllm=False)
    clock = StepClock()
    trainer = TimedGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                               processing_class=hf_tokenizer, callbacks=[clock])
    try:
        trainer.train()
    finally:
        shutil.rmtree(args.output_dir, ignore_errors=True)
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    steps = []
    for k, (begin, end) in enumerate(zip(clock.ends, clock.ends[1:])):
        split = timers.get(k, {"sample_s": float("nan"), "score_s": float("nan")})
        log = logs[k] if k < len(logs) else {}
        steps.append(dict(wall_s=end - begin, sample_s=split["sample_s"], score_s=split["score_s"],
                          train_s=end - begin - split["sample_s"] - split["score_s"],
                          reward=log.get("reward", float("nan")),
                          response_length=log.get("completions/mean_length", float("nan")),
                          trl_step_time=log.get("step_time", float("nan"))))
        print(f"TRL step {k + 1}: " + step_line(steps[-1]), flush=True)
    info = dict(trl=trl.__version__, torch=torch.__version__, transformers=transformers.__version__,
                threads=torch.get_num_threads(), micro_batch=micro_batch, same_prompt_ids=same_ids,
                gradient_checkpointing=args.gradient_checkpointing, loss_type=args.loss_type)
    return steps, info


# ---- google-tunix ---------------------------------------------------------------------------------------

def run_tunix(config, policy, micro_prompts: int) -> tuple[list[dict], dict]:
    import jax
    import jax.numpy as jnp
    import tunix
    from jax.sharding import AxisType
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    from jaxrl_llm.run.state import make_optimizer
    from jaxrl_llm.train.rollouts import RewardScorer
    from sampling import _IdTokenizer, build_tunix

    model_config, params, tokenizer = policy
    s, a, o = config.sampling, config.algorithm, config.optim
    micro_prompts = micro_prompts or s.prompts_per_step
    if s.prompts_per_step % micro_prompts:
        raise SystemExit(f"--tunix-micro-batch {micro_prompts} must divide the prompts per step {s.prompts_per_step}")
    records = drawn_records(config, tokenizer)
    prompt_length = max(len(r["prompt_ids"]) for r in records)
    # the id tokenizer (pad 0 = <|endoftext|>, a stop id found in no prompt) gives tunix exactly our prompt ids
    batches = [{"prompts": np.array([" ".join(map(str, r["prompt_ids"])) for r in chunk]),
                "answer": np.array([r["answer"] for r in chunk])}  # numpy: its tree maps would split a list
               for chunk in (records[i:i + s.prompts_per_step] for i in range(0, len(records), s.prompts_per_step))]
    # prompts per sampler call: all of a step's, or as many as our `max_rows_per_call` allows (dividing the step's)
    rows = s.max_rows_per_call or s.prompts_per_step * s.samples_per_prompt
    rollout_prompts = math.gcd(s.prompts_per_step, max(1, rows // s.samples_per_prompt))
    scorer = RewardScorer(a, s, timeout=config.train.verifier_timeout, workers=0)
    steps: list[dict] = []

    def reward(prompts, completions, answer, **kwargs):
        ids = [[int(t) for t in c.split()] for c in completions]
        lengths = np.array([len(i) for i in ids], np.int32)
        _, rewards = scorer([tokenizer.decode(i) for i in ids], [str(x) for x in answer], lengths)
        steps[-1].update(reward=float(rewards.mean()), response_length=float(lengths.mean()))
        return [float(r) for r in rewards]

    def timed(key, method):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                steps[-1][key] += time.perf_counter() - start
        return call

    class TimedGRPOLearner(grpo_learner.GRPOLearner):
        """Times each global step (rollout, rewards, advantages and the optimizer update) with its compilations."""

        def _compute_rewards(self, *args, **kwargs):
            return timed("score_s", super()._compute_rewards)(*args, **kwargs)

        def _run_global_step(self, *args, **kwargs):
            steps.append(dict(sample_s=0.0, score_s=0.0))
            count, compile_s = compiles.count, compiles.seconds
            start = time.perf_counter()
            super()._run_global_step(*args, **kwargs)
            step = steps[-1]
            step["wall_s"] = time.perf_counter() - start
            step["train_s"] = step["wall_s"] - step["sample_s"] - step["score_s"]
            step.update(compiles=compiles.count - count, compile_s=compiles.seconds - compile_s)
            print(f"tunix step {len(steps)}: " + step_line(step), flush=True)

    # explicit mesh axes fail in its embedding gather (tunix 0.1.7); a 1 x 1 mesh with automatic axes runs
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))
    # its own copy of the weights, as ours gets: nothing it donates or updates reaches `params`
    model = build_tunix(model_config, jax.tree_util.tree_map(jnp.array, params), cache_size=8).transformer
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=s.max_new_tokens, max_prompt_length=prompt_length,
        kv_cache_size=prompt_length + s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
        top_k=s.top_k or None, eos_tokens=list(tokenizer.stop_ids), seed=config.train.seed)
    training = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=make_optimizer(o), eval_every_n_steps=config.train.steps + 1, max_steps=config.train.steps,
        mini_batch_size=s.prompts_per_step, train_micro_batch_size=micro_prompts,
        rollout_micro_batch_size=rollout_prompts, compute_logps_micro_batch_size=rollout_prompts,
        pbar_description=None)
    cluster = rl_cluster_lib.RLCluster(
        actor=model, reference=None, tokenizer=_IdTokenizer(), cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in rl_cluster_lib.Role}, rollout_engine="vanilla",
            offload_to_cpu=False, training_config=training, rollout_config=rollout))
    cluster.generate = timed("sample_s", cluster.generate)
    algo = grpo_learner.GRPOConfig(num_generations=s.samples_per_prompt, num_iterations=1, beta=0.0,
                                   epsilon=a.clip_low, loss_agg_mode=a.agg)
    learner = TimedGRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=reward)
    with CompileCounter() as compiles:
        learner.train(batches)
    info = dict(tunix=getattr(tunix, "__version__", "?"), micro_batch_prompts=micro_prompts,
                rollout_micro_batch_prompts=rollout_prompts,
                loss_agg_mode=algo.loss_agg_mode, epsilon=algo.epsilon, remat="none (its Llama 3 default)")
    return steps, info


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=tuple(SHAPES), default="demo")
    parser.add_argument("--steps", type=int, default=5, help="steps per trainer (the first one compiles)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (default: the shape's)")
    parser.add_argument("--samples", type=int, default=None, help="samples per prompt (default: the shape's)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the shape's")
    parser.add_argument("--trl-micro-batch", type=int, default=None,
                        help="TRL completions per forward/backward (default: all for demo, 8 for long when it divides)")
    parser.add_argument("--tunix-micro-batch", type=int, default=1,
                        help="tunix prompts per forward/backward (each with its samples); 0: all of a step's")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-tunix", action="store_true")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a run config override")
    parser.add_argument("--json", default=None, help="write every figure to this file")
    args = parser.parse_args()

    import jax

    from jaxrl_llm.run.setup import load_policy, runtime_model_config
    from jaxrl_llm.train import load_config

    overrides = list(SHAPES[args.shape]) + [f"train.steps={args.steps}"]
    for flag, key in ((args.prompts, "sampling.prompts_per_step"), (args.samples, "sampling.samples_per_prompt"),
                      (args.max_new_tokens, "sampling.max_new_tokens")):
        if flag is not None:
            overrides.append(f"{key}={flag}")
    config = load_config(None, overrides + args.set)
    model_config, params, tokenizer = load_policy(config.model.source, param_dtype=config.model.param_dtype)
    policy = (runtime_model_config(model_config, config.model), params, tokenizer)
    s = config.sampling
    load_before = os.getloadavg()
    print(f"{args.shape}: {config.data.train} ({config.data.prompt} prompt), {s.prompts_per_step} prompts x "
          f"{s.samples_per_prompt} samples x up to {s.max_new_tokens} new tokens, lr {config.optim.lr}, "
          f"{config.train.steps} steps; load {load_before[0]:.1f} on {os.cpu_count()} cores", flush=True)

    result = dict(shape=args.shape, overrides=overrides + args.set, cpus=os.cpu_count(), jax=jax.__version__,
                  load_before=load_before)
    result["jaxrl_llm"] = {"steps": run_ours(config, policy)}
    result["jaxrl_llm"]["peak_rss_gib"] = peak_rss_gib()
    if not args.skip_trl:
        completions = config.sampling.prompts_per_step * config.sampling.samples_per_prompt
        default_micro = math.gcd(8, completions) if args.shape == "long" else 0
        micro = args.trl_micro_batch if args.trl_micro_batch is not None else default_micro
        trl_steps, info = run_trl(config, (model_config, params, tokenizer), micro)
        result["trl"] = {"steps": trl_steps, **info, "peak_rss_gib_process": peak_rss_gib()}
    if not args.skip_tunix:
        tunix_steps, info = run_tunix(config, (model_config, params, tokenizer), args.tunix_micro_batch)
        result["tunix"] = {"steps": tunix_steps, **info, "peak_rss_gib_process": peak_rss_gib()}
    result["load_after"] = os.getloadavg()

    print()
    names = [n for n in ("jaxrl_llm", "trl", "tunix") if n in result]
    ours = median_split(result["jaxrl_llm"]["steps"])
    print("| trainer | first step s | median step s | sampling s | scoring s | training s | compilations per step | "
          "step time / jaxrl_llm's |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        steps = result[name]["steps"]
        med = result[name]["median"] = median_split(steps)
        compiles = " ".join(str(x["compiles"]) for x in steps) if "compiles" in steps[0] else ""
        print(f"| {name} | {steps[0]['wall_s']:.2f} | {med['wall_s']:.2f} | {med['sample_s']:.2f} | "
              f"{med['score_s']:.3f} | {med['train_s']:.2f} | {compiles} | {med['wall_s'] / ours['wall_s']:.2f}x |")
    print(f"(medians over steps 2-{config.train.steps} when there are more than one; peak RSS of the process "
          f"{peak_rss_gib():.1f} GiB, {result['jaxrl_llm']['peak_rss_gib']:.1f} GiB after ours; load average "
          f"{load_before[0]:.1f} before, {result['load_after'][0]:.1f} after)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
