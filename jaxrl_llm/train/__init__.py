"""The RL trainer: config, train state, the sharded train step, the outer loop, checkpoints, metrics."""

from jaxrl_llm.train.config import ConfigError, RunConfig, load_config

__all__ = ["ConfigError", "RunConfig", "load_config"]
