"""The RL loop and its stages: rollouts (sample and score), GVM's allocation, advantages, packing, the
log-prob pass, the sharded train step and the critic. The run plumbing it stands on is in `jaxrl_llm.run`."""

from jaxrl_llm.run.config import ConfigError, RunConfig, load_config

__all__ = ["ConfigError", "RunConfig", "load_config"]
