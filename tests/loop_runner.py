"""Runs `jaxrl_llm.train.loop.train` on a tiny random policy with the bundled tokenizer (test helper).

Usage: python tests/loop_runner.py [--resume] section.key=value ...
The policy is a 2-layer random decoder with the bundled SmolLM2 vocabulary, so prompts, stop ids and the
verifier are the real ones while a step takes seconds.
"""

import sys

import jax

from jaxrl_llm import models
from jaxrl_llm.models.bundled import bundled_gguf_path
from jaxrl_llm.models.tokenizer import Tokenizer
from jaxrl_llm.train import load_config
from jaxrl_llm.train.loop import train


def tiny_policy(seed: int = 0):
    tokenizer = Tokenizer.from_gguf(bundled_gguf_path())
    config = models.ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    return config, models.init_params(config, jax.random.PRNGKey(seed)), tokenizer


TINY_RUN = ["train.steps=4", "train.eval_problems=4", "train.eval_samples=2", "sampling.prompts_per_step=2",
            "sampling.samples_per_prompt=2", "sampling.max_new_tokens=6", "optim.micro_batch_size=4",
            "optim.lr=1e-3", "algorithm.entropy_coef=0.1", "train.save_every=1"]

if __name__ == "__main__":
    args = sys.argv[1:]
    resume = "--resume" in args
    overrides = TINY_RUN + [a for a in args if a != "--resume"]
    summary = train(load_config(None, overrides), resume=resume, policy=tiny_policy())
    print("STATUS", summary["status"], flush=True)
