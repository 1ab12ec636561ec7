"""Algorithms as data: `algorithm.advantage` names an estimator of `objectives.ADVANTAGE_ESTIMATORS`; the rest
of an algorithm (loss kind, clipping, KL, filters, reward shape) is config. A new algorithm is one entry
here and a preset in configs/, never a branch in the loop.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxrl_llm import objectives
from jaxrl_llm.train.config import AlgorithmSection

def sequence_advantages(algo: AlgorithmSection, rewards: np.ndarray, group_ids: np.ndarray,
                        num_groups: int) -> np.ndarray:
    """Per-sample advantages [R] from the configured estimator."""
    if rewards.size == 0:
        return np.zeros(0, np.float32)
    fn = objectives.ADVANTAGE_ESTIMATORS[algo.advantage]
    return np.asarray(fn(jnp.asarray(rewards, jnp.float32), jnp.asarray(group_ids, jnp.int32),
                         num_groups=num_groups), np.float32)


def mixed_groups(rewards: np.ndarray, group_ids: np.ndarray, num_groups: int) -> np.ndarray:
    """Boolean [num_groups]: the group holds at least two different rewards (DAPO / Reinforce-Rej filter)."""
    if rewards.size == 0:
        return np.zeros(num_groups, bool)
    return np.asarray(objectives.mixed_groups(jnp.asarray(rewards, jnp.float32), jnp.asarray(group_ids, jnp.int32),
                                              num_groups=num_groups), bool)


def token_advantages(algo: AlgorithmSection, seq_adv: np.ndarray, old_logp: np.ndarray, ref_logp: np.ndarray,
                     mask: np.ndarray) -> np.ndarray:
    """[R, T] advantages: the sequence advantage on every token, or PRL's per-token shaping when prl_eta is set."""
    if algo.prl_eta is None:
        return np.broadcast_to(seq_adv[:, None], mask.shape).astype(np.float32) * (mask > 0)
    return np.asarray(objectives.prl_advantages(jnp.asarray(seq_adv), jnp.asarray(old_logp), jnp.asarray(ref_logp),
                                                jnp.asarray(mask), eta=algo.prl_eta, step_len=algo.prl_step_len),
                      np.float32)


def needs_reference(algo: AlgorithmSection) -> bool:
    """A frozen reference policy is kept only for the KL term or PRL shaping."""
    return algo.kl_coef > 0 or algo.prl_eta is not None
