"""Tool-using rollouts per second: `generate_multiturn` with the sandboxed python tool against single-turn
`generate` on the same prompts, with and without paired stops (docs/tool_use.md).

    .venv/bin/python benchmarks/tool_rollouts.py [--prompts 8] [--samples 8] [--max-new-tokens 64] [--repeats 2]
                                                 [--slow-every 8] [--slow-s 3] [--only SUBSTRING]
                                                 [--out benchmarks/results/tool_rollouts.json]

The bundled SmolLM2-135M-Instruct (f32) on held-out 2-3 digit products with the `python-tool-3shot` prompt, as
configs/tool_demo.yaml samples them. Each setting runs `repeats` times with the same key; the first run compiles
the sampler's shapes and is reported apart, the others are timed. Reported per setting: conversations per second,
the model's tokens per second (observations not counted), sampler rounds, tool calls, seconds in tools, and the
accuracy of the final answers (math verifier on the model's own text). "Prompt prefill shared": every round
prefills each prompt once and feeds each conversation's tokens so far as forced tokens (`generate`'s
`forced_prefixes`); "re-prefilled": every round after the first prefills each conversation's whole context.
"Continuous engine, slots turn over": the conversations on the continuous engine's slots, their tools run while
the others decode (`continuous.run_slots`; a continued conversation fed its tokens so far on its prompt's cached
prefill). "A slow tool": every `slow_every`-th tool call (in the order the calls start) waits `slow_s` seconds
more, as a tool with a long tail does; rounds wait for it, slots do not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import subprocess
import threading
import time

import jax
import numpy as np

from jaxrl_llm.data import build_prompts
from jaxrl_llm.data.arithmetic import ArithmeticTask
from jaxrl_llm.models.bundled import load_bundled
from jaxrl_llm.rewards import correctness_reward
from jaxrl_llm.sampling import generate
from jaxrl_llm.sampling.multiturn import generate_multiturn
from jaxrl_llm.tools import resolve_isolation
from jaxrl_llm.tools.env import python_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class SlowEvery:
    """`env` with every `every`-th tool call (counted as calls start) waiting `seconds` more: a tool's long tail."""

    def __init__(self, env, every: int, seconds: float):
        self.env, self.every, self.seconds = env, every, seconds
        self.stop_strings, self.paired_stops = env.stop_strings, env.paired_stops
        self.calls, self.lock = 0, threading.Lock()

    def step(self, record, text, *, ended, calls_left=1):
        result = self.env.step(record, text, ended=ended, calls_left=calls_left)
        if result.tool_call:
            with self.lock:
                self.calls += 1
                slow = self.calls % self.every == 0
            if slow:
                time.sleep(self.seconds)
                result = dataclasses.replace(result, seconds=result.seconds + self.seconds)
        return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--slow-every", type=int, default=8, help="every n-th call of the slow-tool rows is slow")
    parser.add_argument("--slow-s", type=float, default=3.0, help="seconds a slow call waits more")
    parser.add_argument("--only", default="", help="run only the settings whose name holds this")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/tool_rollouts.json"))
    args = parser.parse_args(argv)

    config, params, tokenizer = load_bundled()
    task = ArithmeticTask(min_digits=2, max_digits=3, operators=("*",))
    records, _ = build_prompts(task.heldout_records()[: args.prompts], tokenizer, "python-tool-3shot")
    golds = [r["answer"] for r in records for _ in range(args.samples)]
    rng = jax.random.PRNGKey(0)
    isolation = resolve_isolation("auto")
    rows = []

    def single_turn(engine: str = "static"):
        out = generate(params, config, [r["prompt_ids"] for r in records], num_samples=args.samples,
                       max_new_tokens=args.max_new_tokens, stop_ids=tokenizer.stop_ids, rng=rng,
                       pad_id=tokenizer.pad_token_id, engine=engine)
        texts = [tokenizer.decode(list(t[:n]), skip_special_tokens=True) for t, n in zip(out.tokens, out.lengths)]
        return {"model_tokens": int(out.lengths.sum()), "texts": texts, "rounds": 1, "tool_calls": 0.0,
                "tool_seconds": 0.0}

    def multi_turn(paired: bool, reuse: bool = True, engine: str = "static", slow: bool = False):
        env = dataclasses.replace(python_env(), paired_stops=paired)
        if slow:
            env = SlowEvery(env, args.slow_every, args.slow_s)
        out = generate_multiturn(params, config, tokenizer, records, env, num_samples=args.samples,
                                 max_new_tokens=args.max_new_tokens, max_turns=2, max_observation_tokens=32, rng=rng,
                                 reuse_prompt_prefill=reuse, engine=engine)
        summary = out.summary()
        return {"model_tokens": int(out.mask.sum()), "texts": out.model_text, "rounds": out.rounds,
                "tool_calls": summary["tool_calls"], "tool_seconds": summary["tool_seconds"]}

    settings = (("single-turn, no tool", single_turn),
                ("python tool: paired stops, prompt prefill shared", lambda: multi_turn(True)),
                ("python tool: paired stops, every round re-prefilled", lambda: multi_turn(True, reuse=False)),
                ("python tool: unpaired stops, prompt prefill shared", lambda: multi_turn(False)),
                ("single-turn, no tool, continuous engine", lambda: single_turn("continuous")),
                ("python tool: paired stops, continuous engine, slots turn over",
                 lambda: multi_turn(True, engine="continuous")),
                ("python tool: paired stops, continuous engine, every round re-prefilled",
                 lambda: multi_turn(True, reuse=False, engine="continuous")),
                (f"a slow tool (every {args.slow_every}th call +{args.slow_s:g} s): static engine, rounds",
                 lambda: multi_turn(True, slow=True)),
                (f"a slow tool (every {args.slow_every}th call +{args.slow_s:g} s): continuous engine, slots turn over",
                 lambda: multi_turn(True, engine="continuous", slow=True)))
    for name, run in [(n, r) for n, r in settings if args.only in n]:
        times = []
        for repeat in range(args.repeats):
            start = time.perf_counter()
            result = run()
            times.append(time.perf_counter() - start)
            print(f"{name}: run {repeat} {times[-1]:.1f} s, rounds {result['rounds']}", flush=True)
        timed = float(np.median(times[1:])) if len(times) > 1 else times[0]
        accuracy = float(np.mean(correctness_reward(result["texts"], golds)))
        conversations = len(golds)
        rows.append({"setting": name, "first_run_s": round(times[0], 2), "timed_s": round(timed, 2),
                     "conversations_per_s": round(conversations / timed, 3),
                     "model_tokens_per_s": round(result["model_tokens"] / timed, 1), "rounds": result["rounds"],
                     "tool_calls_per_sample": round(result["tool_calls"], 3),
                     "tool_seconds": round(result["tool_seconds"], 2), "accuracy": round(accuracy, 3)})
        print(json.dumps(rows[-1]), flush=True)
    report = {"benchmark": "tool_rollouts", "date": time.strftime("%Y-%m-%d"), "commit": _commit(),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", "isolation": isolation,
              "command": "python benchmarks/tool_rollouts.py " + " ".join(argv or []),
              "shape": {"prompts": args.prompts, "samples": args.samples, "max_new_tokens": args.max_new_tokens,
                        "repeats": args.repeats}, "rows": rows}
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
