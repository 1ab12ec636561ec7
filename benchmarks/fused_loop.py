"""Host RL loop vs the fully jitted loop on the demo setting: seconds per iteration, speed-up, compile time.

    .venv/bin/python benchmarks/fused_loop.py [--iterations 6] [--skip-host] [--json results.json]

Both run the embedded demo (`jaxrl-llm train` defaults): bundled SmolLM2-135M-Instruct in float32,
GRPO without KL, 8 prompts x 8 samples x 24 new tokens of the 2-term 1-digit arithmetic task with the
3-shot prompt, AdamW lr 1e-5, one update per iteration, the same prompt stream (data seed 0).

- host: `jaxrl_llm.train.loop.train` for N steps (evaluation off); per-step wall time from its
  metrics.jsonl (sample + score + update). Step 1 includes compilation; later steps can include
  recompiling the train step for a new packed width (the host packs to the rollouts' lengths).
- fused: `jaxrl_llm.ondevice.fused`: one `lax.scan` over N iterations of sample -> on-device reward ->
  GRPO advantages -> update, prompts pre-drawn on the host. Compiled once (timed apart), then run.

Also printed: the fused run's reward per iteration (does it learn), and how often the on-device reward
agrees with the host verifier on the fused run's own rollouts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import data as data_lib
from jaxrl_llm import rewards
from jaxrl_llm.ondevice.device_reward import token_bytes
from jaxrl_llm.ondevice.fused import PromptBatch, check_fused_config, make_fused_iteration, make_fused_loop, prompt_batches
from jaxrl_llm.run.metrics import read_metrics
from jaxrl_llm.run.setup import load_policy, load_prompts, runtime_model_config
from jaxrl_llm.run.state import init_state, make_optimizer
from jaxrl_llm.train import load_config


def copy_params(params):
    # each run donates its train state: give each its own buffers
    return jax.tree_util.tree_map(jnp.array, params)


def run_host(config, policy, iterations: int) -> dict:
    from jaxrl_llm.train.loop import train

    model_config, params, tokenizer = policy
    with tempfile.TemporaryDirectory() as out_dir:
        cfg = dataclasses.replace(config, train=dataclasses.replace(
            config.train, out_dir=out_dir, steps=iterations, eval_problems=0, save_every=0))
        started = time.perf_counter()
        train(cfg, policy=(model_config, copy_params(params), tokenizer), log=lambda *_: None)
        total = time.perf_counter() - started
        steps = [m for m in read_metrics(out_dir) if "time_wall_s" in m]
    wall = [m["time_wall_s"] for m in steps]
    later = wall[1:] or wall
    return {"first_iteration_s": wall[0], "median_s": statistics.median(later), "mean_s": statistics.mean(later),
            "per_step_s": wall, "sample_s": [m["time_sample_s"] for m in steps],
            "score_s": [m["time_score_s"] for m in steps], "train_s": [m["time_train_s"] for m in steps],
            "reward": [m["reward"] for m in steps], "process_s": total}


def run_fused(config, policy, iterations: int) -> dict:
    model_config, params, tokenizer = policy
    check_fused_config(config)
    records = load_prompts(config.data.train, tokenizer, config)
    stream = data_lib.RecordBatches(records, data_lib.LoaderConfig(batch_size=config.sampling.prompts_per_step,
                                                                   seed=config.data.seed))
    batches = [next(stream) for _ in range(iterations)]  # the prompts the host loop sees, in order
    prompts = prompt_batches(batches, pad_id=tokenizer.pad_token_id)
    table = token_bytes(tokenizer, model_config.vocab_size)
    optimizer = make_optimizer(config.optim)
    iteration = make_fused_iteration(model_config, config.algorithm, optimizer, sampling=config.sampling,
                                     token_table=table, micro_batch_size=config.optim.micro_batch_size,
                                     stop_ids=tokenizer.stop_ids, pad_id=tokenizer.pad_token_id, keep_rollouts=True)
    loop = make_fused_loop(iteration)
    state = init_state(copy_params(params), optimizer)
    rng = jax.random.PRNGKey(config.train.seed)
    stacked = PromptBatch(*(jnp.asarray(x) for x in prompts))
    started = time.perf_counter()
    compiled = loop.lower(state, rng, stacked).compile()
    compile_s = time.perf_counter() - started
    started = time.perf_counter()
    state, metrics = compiled(state, rng, stacked)
    jax.block_until_ready(state)
    run_s = time.perf_counter() - started
    metrics = jax.device_get(metrics)
    agreement = verifier_agreement(metrics, batches, tokenizer)
    return {"compile_s": compile_s, "run_s": run_s, "per_iteration_s": run_s / iterations,
            "reward": [float(r) for r in metrics["reward"]], "accuracy": [float(a) for a in metrics["accuracy"]],
            "response_length": [float(x) for x in metrics["response_length"]],
            "prompt_len": int(prompts.tokens.shape[-1]),
            "train_row_tokens": int(prompts.tokens.shape[-1] + config.sampling.samples_per_prompt
                                    * config.sampling.max_new_tokens),
            "finite_updates": int(np.sum(metrics["finite"])), **agreement}


def verifier_agreement(metrics: dict, batches: list[list[dict]], tokenizer) -> dict:
    """The host verifier on the fused rollouts' decoded text, against the on-device verdicts."""
    samples = metrics["tokens"].shape[1] // len(batches[0])
    texts, golds, device = [], [], []
    for k, batch in enumerate(batches):
        for row, (tokens, length) in enumerate(zip(metrics["tokens"][k], metrics["lengths"][k])):
            texts.append(tokenizer.decode(list(tokens[:length]), skip_special_tokens=True))
            golds.append(batch[row // samples]["answer"])
            device.append(float(metrics["correct"][k][row]))
    host = rewards.correctness_reward(texts, golds)
    differ = [(t, g, d, h) for t, g, d, h in zip(texts, golds, device, host) if d != h]
    return {"rollouts_checked": len(texts), "verdicts_agree": len(texts) - len(differ),
            "host_correct": int(sum(host)), "disagreements": differ[:10], "example_rollouts": texts[:3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--skip-host", action="store_true")
    parser.add_argument("--json", default=None, help="write every figure to this file")
    args = parser.parse_args()
    if args.iterations < 2:
        parser.error("--iterations must be >= 2 (the host's first step holds its compilation)")
    config = load_config(None, [])
    model_config, params, tokenizer = load_policy(config.model.source, param_dtype=config.model.param_dtype)
    # Both loops compute the policy as the run config says (dtype, remat policy), as `train` does.
    policy = (runtime_model_config(model_config, config.model), params, tokenizer)
    load_before = os.getloadavg()
    result = {"iterations": args.iterations, "load_before": load_before, "cpus": os.cpu_count(),
              "jax": jax.__version__, "device": str(jax.devices()[0])}
    result["fused"] = fused = run_fused(config, policy, args.iterations)
    print(f"fused: compile {fused['compile_s']:.1f} s, {fused['per_iteration_s']:.2f} s/iteration over "
          f"{args.iterations} (prompt width {fused['prompt_len']}, train row {fused['train_row_tokens']} tokens)")
    print(f"fused reward per iteration: {' '.join(f'{r:.3f}' for r in fused['reward'])}")
    print(f"on-device reward vs host verifier on the fused rollouts: {fused['verdicts_agree']}/"
          f"{fused['rollouts_checked']} agree ({fused['host_correct']} correct by the host verifier)")
    for text, gold, device, host in fused["disagreements"]:
        print(f"  differs: device {device} host {host} gold {gold!r}: {text!r}")
    if not args.skip_host:
        result["host"] = host = run_host(config, policy, args.iterations)
        print(f"host: first iteration {host['first_iteration_s']:.1f} s (with compile), then median "
              f"{host['median_s']:.2f} s, mean {host['mean_s']:.2f} s per iteration")
        print(f"host per step (s): {' '.join(f'{x:.1f}' for x in host['per_step_s'])}; "
              f"score {statistics.mean(host['score_s']):.3f} s/step")
        print(f"host reward per step: {' '.join(f'{r:.3f}' for r in host['reward'])}")
        result["speedup_vs_median"] = host["median_s"] / fused["per_iteration_s"]
        result["speedup_vs_mean"] = host["mean_s"] / fused["per_iteration_s"]
        print(f"speed-up of the fused loop: {result['speedup_vs_median']:.2f}x (host median), "
              f"{result['speedup_vs_mean']:.2f}x (host mean, recompiles included)")
    result["load_after"] = os.getloadavg()
    print(f"load average before {load_before[0]:.2f}, after {result['load_after'][0]:.2f} on {os.cpu_count()} cpus")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
