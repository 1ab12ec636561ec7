"""`sample_tokens`: the sampler as one traceable function of fixed-shape arrays, callable inside an
outer `jax.jit` (the fully jitted RL iteration of `jaxrl_llm.ondevice.fused`).

`generate` plans buckets and loops over prefill chunks on the host. Here every prompt batch has one
shape [P, L] and every prompt gets the same number of samples, so the plan is static: the three
compiled stages of `engine` (init_state, prefill_rows, decode_rows) run once each. A jitted function
called under a trace is inlined into the caller's program (its buffer donation is then ignored).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.sampling.buckets import bucket_size, response_tile_size
from jaxrl_llm.sampling.engine import decode_rows, init_state, prefill_rows
from jaxrl_llm.sampling.plan import stop_array
from jaxrl_llm.sampling.token_selection import selection_settings


class SampledTokens(NamedTuple):
    """Samples ordered by prompt then sample (row r continues prompt r // samples_per_prompt).

    tokens int32 [R, N] (pad_id after a row ended; a stop token is kept), logprobs f32 [R, N]
    (log_softmax of the raw logits, 0 after the end), lengths int32 [R], stopped bool [R].
    """

    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    stopped: jax.Array


def sample_tokens(params, config: ModelConfig, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
                  rng: jax.Array, *, samples_per_prompt: int, max_new_tokens: int, temperature: float = 1.0,
                  top_p: float = 1.0, top_k: int = 0, stop_ids: Sequence[int] = (),
                  pad_id: int = 0) -> SampledTokens:
    """Draw `samples_per_prompt` continuations of each right-padded prompt tokens [P, L] (lengths [P]).

    Traceable: shapes depend only on (P, L, samples_per_prompt, max_new_tokens); the keyword arguments
    are static. Each prompt is prefilled once into one cache entry its samples' rows share; the decode is
    `generate`'s `lax.while_loop` with the same token selection and per-row random numbers
    fold_in(fold_in(rng, row), t). So with L equal to `generate`'s prompt bucket and P * S a power of
    two, the result equals `generate(..., num_samples=S, rng=rng)` token for token.
    """
    if samples_per_prompt < 1 or max_new_tokens < 1:
        raise ValueError(f"samples_per_prompt and max_new_tokens must be >= 1, got {samples_per_prompt}, "
                         f"{max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if prompt_tokens.ndim != 2 or prompt_lengths.shape != prompt_tokens.shape[:1]:
        raise ValueError(f"prompt_tokens must be [P, L] and prompt_lengths [P], got {prompt_tokens.shape} and "
                         f"{prompt_lengths.shape}")
    num_prompts, prompt_len = prompt_tokens.shape
    if prompt_len + max_new_tokens > config.max_position_embeddings:
        raise ValueError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} exceeds "
                         f"max_position_embeddings ({config.max_position_embeddings})")
    rows = num_prompts * samples_per_prompt
    row_prompt = jnp.repeat(jnp.arange(num_prompts, dtype=jnp.int32), samples_per_prompt)
    prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
    new_token_bucket = bucket_size(max_new_tokens, minimum=16)
    state, first_logits = init_state(config, None, prompt_lengths[row_prompt], jnp.ones((rows,), bool),
                                     prompt_bucket=prompt_len, new_token_bucket=new_token_bucket,
                                     response_tile=response_tile_size(new_token_bucket),
                                     prompt_group=samples_per_prompt)
    state, first_logits = prefill_rows(params, config, None, jnp.asarray(prompt_tokens, jnp.int32), prompt_lengths,
                                       row_prompt, state, first_logits)
    temperature, top_p, selection = selection_settings(temperature, top_p, top_k)
    state = decode_rows(params, config, None, state, first_logits, rng, temperature, top_p,
                        jnp.int32(max_new_tokens), jnp.asarray(stop_array(stop_ids, config.vocab_size)),
                        jnp.int32(pad_id), **selection)
    return SampledTokens(tokens=state.tokens[:, :max_new_tokens], logprobs=state.logprobs[:, :max_new_tokens],
                         lengths=state.lengths, stopped=state.stopped)
