"""JAX sampling loop: prefill each prompt once, then a `lax.while_loop` decode over a static KV cache.

`generate(params, config, prompts, *, num_samples, max_new_tokens, ...) -> Rollout` is the entry
point; `prefill`, `decode` and `collect` are its stages (used by the benchmark to time them apart);
`sample_tokens` is the same sampler as one traceable function of fixed shapes, for use inside `jit`.
`generate(..., engine="continuous", max_slots=S)` decodes on S slots refilled as samples end, with one
prompt cache per prompt (`sampling.continuous`), and returns the same rollout. Every call is checked by
`prepare_call` and shaped by `plan_calls` (`sampling.plan`), the one planner of a sampler call.
"""

from jaxrl_llm.sampling.buckets import SamplingPlan, bucket_size, make_plan
from jaxrl_llm.sampling.continuous import SlotStats, generate_slots
from jaxrl_llm.sampling.engine import SamplingState
from jaxrl_llm.sampling.generate import (
    ENGINES,
    FINISH_LENGTH,
    FINISH_REASON_NAMES,
    FINISH_STOP,
    Rollout,
    collect,
    decode,
    generate,
    prefill,
)
from jaxrl_llm.sampling.plan import CallPlan, CallSetup, plan_calls, prepare_call
from jaxrl_llm.sampling.token_selection import inverse_cdf_sample, nucleus_mask, select_tokens
from jaxrl_llm.sampling.traceable import SampledTokens, sample_tokens

__all__ = [
    "generate", "Rollout", "FINISH_STOP", "FINISH_LENGTH", "FINISH_REASON_NAMES",
    "prefill", "decode", "collect", "SamplingState", "SamplingPlan", "make_plan", "bucket_size",
    "select_tokens", "inverse_cdf_sample", "nucleus_mask", "sample_tokens", "SampledTokens",
    "ENGINES", "generate_slots", "SlotStats", "prepare_call", "plan_calls", "CallSetup", "CallPlan",
]
