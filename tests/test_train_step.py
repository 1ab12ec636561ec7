import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import models
from jaxrl_llm.objectives import aggregate_denominator
from jaxrl_llm.train.config import AlgorithmSection, OptimSection
from jaxrl_llm.train.logprobs import response_logprobs
from jaxrl_llm.train.state import init_state, make_optimizer
from jaxrl_llm.train.step import TrainBatch, make_logprob_fn, make_train_step

TINY = models.ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, tie_word_embeddings=True)


def _batch(rows=8, prompt=5, resp=6, seed=0):
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(2, prompt + 1, size=rows)
    resp_lens = rng.integers(1, resp + 1, size=rows)
    tokens = np.zeros((rows, prompt + resp), np.int32)
    response = rng.integers(1, TINY.vocab_size, size=(rows, resp)).astype(np.int32)
    mask = (np.arange(resp)[None] < resp_lens[:, None]).astype(np.float32)
    for i in range(rows):
        tokens[i, :prompt_lens[i]] = rng.integers(1, TINY.vocab_size, size=prompt_lens[i])
        tokens[i, prompt_lens[i]:prompt_lens[i] + resp_lens[i]] = response[i, :resp_lens[i]]
    adv = np.repeat(rng.choice([-1.0, 0.5, 1.0], size=rows)[:, None], resp, 1).astype(np.float32)
    zeros = np.zeros((rows, resp), np.float32)
    return TrainBatch(jnp.asarray(tokens), jnp.asarray(prompt_lens, jnp.int32), jnp.asarray(response),
                      jnp.asarray(mask), jnp.asarray(adv), jnp.asarray(zeros), jnp.asarray(zeros))


def _with_old_logp(params, batch):
    old = make_logprob_fn(TINY)(params, batch.tokens, batch.prompt_lens, batch.response_tokens)
    return batch._replace(old_logp=old, ref_logp=old)


def test_response_logprobs_equal_full_forward():
    params = models.init_params(TINY, jax.random.PRNGKey(0))
    b = _batch()
    logp = response_logprobs(params, TINY, b.tokens, b.prompt_lens, b.response_tokens, chunk=16)
    positions = jnp.broadcast_to(jnp.arange(b.tokens.shape[1]), b.tokens.shape)
    full = jax.nn.log_softmax(models.forward(params, TINY, b.tokens, positions), -1)
    for i in range(b.tokens.shape[0]):
        p = int(b.prompt_lens[i])
        for r in range(b.response_tokens.shape[1]):
            want = full[i, p - 1 + r, b.response_tokens[i, r]]
            if p - 1 + r < b.tokens.shape[1]:
                np.testing.assert_allclose(logp[i, r], want, atol=1e-5)


@pytest.mark.parametrize("algo", [
    AlgorithmSection(loss="clip"),
    AlgorithmSection(loss="vanilla", agg="seq-mean-token-sum"),
    AlgorithmSection(loss="clip", clip_high=0.28, agg="seq-mean-token-sum-norm", agg_max_len=6),
    AlgorithmSection(loss="clip", kl_coef=0.1, entropy_coef=0.01, agg="seq-mean-token-mean"),
])
def test_micro_batches_equal_one_batch_and_loss_decreases(algo):
    params = models.init_params(TINY, jax.random.PRNGKey(1))
    batch = _with_old_logp(params, _batch())
    denom = aggregate_denominator(batch.mask, algo.agg)
    # Plain SGD, so the parameter change is the gradient itself (Adam's first step is sign(g), which
    # magnifies float-rounding differences of near-zero gradients).
    opt = optax.sgd(1.0)
    results = []
    for micro in (8, 2):
        state = init_state(jax.tree_util.tree_map(jnp.copy, params), opt)
        step = make_train_step(TINY, algo, opt, micro_batch_size=micro)
        state, metrics = step(state, batch, denom)
        results.append((state, metrics))
    (s1, m1), (s4, m4) = results
    np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(m1["grad_norm"], m4["grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(s1.params), jax.tree_util.tree_leaves(s4.params)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # A second step on the same batch sees a lower loss: the update followed the gradient.
    adamw = make_optimizer(OptimSection(lr=1e-2, weight_decay=0.0))
    step = make_train_step(TINY, algo, adamw, micro_batch_size=8)
    s1, m1 = step(init_state(params, adamw), batch, denom)
    assert int(s1.step) == 1 and float(m1["finite"]) == 1.0
    _, again = step(s1, batch, denom)
    assert float(again["loss"]) < float(m1["loss"])


def test_non_finite_update_is_skipped_and_step_compiles_once():
    params = models.init_params(TINY, jax.random.PRNGKey(2))
    algo = AlgorithmSection()
    opt = make_optimizer(OptimSection(lr=1e-2))
    step = make_train_step(TINY, algo, opt, micro_batch_size=4)
    batch = _with_old_logp(params, _batch())
    denom = aggregate_denominator(batch.mask, algo.agg)
    state = init_state(params, opt)
    before = jax.tree_util.tree_map(np.asarray, state.params)
    bad = batch._replace(advantages=batch.advantages.at[0, 0].set(jnp.nan))
    state, metrics = step(state, bad, denom)
    assert float(metrics["finite"]) == 0.0 and int(state.step) == 0
    for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(state.params)):
        np.testing.assert_array_equal(a, b)
    for seed in range(3):
        state, metrics = step(state, _with_old_logp(state.params, _batch(seed=seed)), denom)
    assert int(state.step) == 3
    assert step._cache_size() == 1
