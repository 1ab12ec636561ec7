"""The CPU run that benchmarks/partial_sim.py is checked against (results/partial_sim_validation.json): the loop with
`rollouts.mode: partial` on the tests' tiny random policy (tests/loop_runner.py: 2 layers, the bundled vocabulary and
verifier) whose end-of-text embedding row is scaled by 80, so that responses end at long-tailed lengths (2-32
tokens, about 12% at the cap of 32) instead of all at the cap; on 8 fake CPU devices (train.mesh fsdp=8).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/partial_validation_run.py RUN_DIR [key=value ...]
    python benchmarks/partial_sim.py --replay RUN_DIR --json benchmarks/results/partial_sim_validation.json
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from loop_runner import TINY_RUN, tiny_policy  # noqa: E402

from jaxrl_llm.train import load_config  # noqa: E402
from jaxrl_llm.train.loop import train  # noqa: E402

STOP_SCALE = 80.0  # the end-of-text row's logit grows with it: P(stop) rises with the context's alignment to it
RUN = ["rollouts.mode=partial", "rollouts.max_staleness=2", "rollouts.segment_iterations=4", "train.steps=10",
       "sampling.prompts_per_step=4", "sampling.samples_per_prompt=4", "sampling.max_new_tokens=32",
       "sampling.engine=continuous", "sampling.max_slots=8",
       "optim.micro_batch_size=16", "train.mesh=fsdp=8", "train.eval_problems=0",
       "train.save_every=0"]


def long_tailed_policy():
    config, params, tokenizer = tiny_policy()
    stop = tokenizer.stop_ids[0]  # <|endoftext|>, id 2
    params = {**params, "embed": params["embed"].at[stop].multiply(STOP_SCALE)}
    return config, params, tokenizer


if __name__ == "__main__":
    out_dir, overrides = sys.argv[1], sys.argv[2:]
    summary = train(load_config(None, TINY_RUN + RUN + [f"train.out_dir={out_dir}", *overrides]),
                    policy=long_tailed_policy())
    print("STATUS", summary["status"], flush=True)
