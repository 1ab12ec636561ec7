"""Pure jax.numpy objectives for RL on verifiable rewards: advantages (and GAE), policy and value
losses, KL, aggregation (with GVM's M-step, each prompt weighted equally), PRL shaping, GVM allocation, DAPO
shaping, the sampler/trainer mismatch correction and on-policy distillation.

Arrays in, arrays out: shapes are [B] per sequence and [B, T] per token, and `mask` is the
response-token mask (1.0 on generated tokens, 0.0 on prompt and padding). This package imports
only jax, jax.numpy, numpy and the standard library, so other JAX codebases can use it alone.
"""

from jaxrl_llm.objectives.advantages import (
    ADVANTAGE_ESTIMATORS,
    drgrpo_advantages,
    grpo_advantages,
    mixed_group_mask,
    mixed_groups,
    raft_advantages,
    raft_group_advantages,
    reinforce_pp_advantages,
    reinforce_pp_batch_advantages,
    reinforce_rej_advantages,
    rloo_advantages,
)
from jaxrl_llm.objectives.aggregate import AGG_MODES, LossTerms, aggregate, aggregate_denominator, aggregate_terms
from jaxrl_llm.objectives.correction import (
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTION_MODES,
    decoupled_ppo_loss,
    rollout_correction,
)
from jaxrl_llm.objectives.cov import COV_LOSS_KINDS, cov_selection, token_covariance
from jaxrl_llm.objectives.dapo import overlong_penalty
from jaxrl_llm.objectives.distill import (reverse_kl_advantages, topk_distill_loss, topk_distill_terms,
                                         topk_terms_at_ids)
from jaxrl_llm.objectives.gvm import gvm_allocate
from jaxrl_llm.objectives.kl import KL_KINDS, entropy_from_logits, kl_penalty
from jaxrl_llm.objectives.mstep import (
    PROMPT_MEAN_MODES,
    prompt_mean,
    prompt_mean_terms,
    prompt_mean_weights,
)
from jaxrl_llm.objectives.losses import (
    POLICY_LOSS_KINDS,
    POLICY_LOSSES,
    LossSettings,
    TokenInputs,
    TokenLoss,
    policy_loss,
    policy_loss_terms,
)
from jaxrl_llm.objectives.prl import prl_advantages
from jaxrl_llm.objectives.value import gae_advantages, value_loss, value_loss_terms

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "COV_LOSS_KINDS",
    "KL_KINDS",
    "POLICY_LOSSES",
    "POLICY_LOSS_KINDS",
    "PROMPT_MEAN_MODES",
    "ROLLOUT_CORRECTION_LEVELS",
    "ROLLOUT_CORRECTION_MODES",
    "LossSettings",
    "LossTerms",
    "TokenInputs",
    "TokenLoss",
    "aggregate",
    "aggregate_denominator",
    "aggregate_terms",
    "cov_selection",
    "decoupled_ppo_loss",
    "drgrpo_advantages",
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "gvm_allocate",
    "kl_penalty",
    "mixed_group_mask",
    "mixed_groups",
    "overlong_penalty",
    "policy_loss",
    "policy_loss_terms",
    "prl_advantages",
    "prompt_mean",
    "prompt_mean_terms",
    "prompt_mean_weights",
    "raft_advantages",
    "raft_group_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_batch_advantages",
    "reinforce_rej_advantages",
    "reverse_kl_advantages",
    "rloo_advantages",
    "rollout_correction",
    "token_covariance",
    "topk_distill_loss",
    "topk_distill_terms",
    "topk_terms_at_ids",
    "value_loss",
    "value_loss_terms",
]
