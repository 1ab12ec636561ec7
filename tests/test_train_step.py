import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from compile_count import counted_compiles
from packed_groups import random_groups

from jaxrl_llm import models
from jaxrl_llm.objectives import aggregate_denominator
from jaxrl_llm.run.config import AlgorithmSection, OptimSection
from jaxrl_llm.run.state import init_state, make_optimizer
from jaxrl_llm.train.logprobs import response_logprobs, row_logprobs
from jaxrl_llm.train.packing import bucket, length_bucket, pack_groups, unpack
from jaxrl_llm.train.step import make_logprob_fn, make_train_step

TINY = models.ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, tie_word_embeddings=True)


def _samples(groups=4, per_group=3, resp=6, seed=0):
    """`packed_groups.random_groups` with a per-sequence advantage in {-1, 0.5, 1} on each response's tokens."""
    prompts, members, responses, lengths, mask, rng = random_groups(TINY.vocab_size, groups=groups,
                                                                    per_group=per_group, resp=resp, seed=seed)
    adv = np.repeat(rng.choice([-1.0, 0.5, 1.0], size=len(lengths))[:, None], resp, 1).astype(np.float32)
    return prompts, members, responses, lengths, adv * mask, mask


def _unpacked_logprobs(params, prompts, members, responses, lengths):
    """One row per sample (prompt then response, right-padded to the longest), scored in one compiled call."""
    owner = {int(i): prompt for prompt, group in zip(prompts, members) for i in group}
    tokens = np.zeros((len(owner), max(map(len, prompts)) + responses.shape[1]), np.int32)
    for row, i in enumerate(owner):
        tokens[row, :len(owner[i]) + responses.shape[1]] = owner[i] + responses[i].tolist()
    samples = np.array(list(owner))
    logp = np.asarray(_row_logprobs(params, TINY, tokens, np.array([len(owner[i]) for i in samples], np.int32),
                                    responses[samples]))
    out = np.zeros(responses.shape, np.float32)
    for row, i in enumerate(samples):
        out[i, :lengths[i]] = logp[row, :lengths[i]]
    return out


_row_logprobs = jax.jit(row_logprobs, static_argnums=1)


def test_packed_logprobs_equal_one_row_per_sample():
    params = models.init_params(TINY, jax.random.PRNGKey(0))
    prompts, members, responses, lengths, _, mask = _samples()
    members[1] = members[1][:1]  # groups of different sizes
    batch = pack_groups(prompts, members, responses, lengths, row_multiple=4, seq_multiple=8)
    assert batch.tokens.shape[0] == 4 and batch.pred_index.shape[1] == bucket(3)
    got = unpack(np.asarray(response_logprobs(params, TINY, batch, chunk=16)), members, responses.shape[0]) * mask
    want = _unpacked_logprobs(params, prompts, members, responses, lengths)
    np.testing.assert_allclose(got, want, atol=2e-5)
    # Direct check of one row against a full-sequence forward pass.
    tokens = np.array([prompts[0] + responses[0].tolist()], np.int32)
    full = jax.nn.log_softmax(models.forward(params, TINY, tokens, np.arange(tokens.shape[1])[None]), -1)
    p = len(prompts[0])
    direct = [float(full[0, p - 1 + r, responses[0, r]]) for r in range(lengths[0])]
    np.testing.assert_allclose(got[0, :lengths[0]], direct, atol=2e-5)


def test_compact_scoring_equals_slot_scoring_and_unpacked_rows():
    """Responses that stop well before R: the packed row (L tokens) is shorter than its S x R slots, so
    `response_logprobs` scores the generated tokens only (compact layout). Log-probs, entropies and the
    gradient equal the slot layout's and one row per sample; slots past a response's end are 0."""
    from jaxrl_llm.train.logprobs import scored_positions

    params = models.init_params(TINY, jax.random.PRNGKey(2))
    prompts, members, responses, lengths, _, mask = _samples(groups=2, per_group=4, resp=16, seed=3)
    lengths = np.array([1, 3, 2, 16, 4, 1, 2, 5])  # one response reaches R, the others stop early
    mask = (np.arange(16)[None] < lengths[:, None]).astype(np.float32)
    batch = pack_groups(prompts, members, responses, lengths, row_multiple=2, seq_multiple=8)
    rows, slots, resp_len = batch.pred_index.shape
    assert batch.tokens.shape[1] < slots * resp_len  # 32 positions against 4 x 16 slots
    pred, targets, (index, valid) = scored_positions(batch)
    assert pred.shape == (rows, batch.tokens.shape[1])
    # Row 0 scores its 22 generated tokens first, in slot order: slot 0's one token, then slot 1's three.
    first = [int(batch.pred_index[0, 0, 0]), *(int(i) for i in batch.pred_index[0, 1, :3])]
    assert np.asarray(pred[0, :4]).tolist() == first
    assert np.asarray(targets[0, :4]).tolist() == [int(responses[0, 0]), *responses[1, :3].tolist()]
    assert int(np.asarray(valid[0]).sum()) == 22 and int(index[0, 16]) == 1  # slot 1, token 0 -> entry 1

    def both(compact):  # compiled, as a run's pass is (op by op, every primitive would compile apart)
        score = lambda p: response_logprobs(p, TINY, batch, chunk=16, with_entropy=True, compact=compact)  # noqa: E731
        return jax.jit(score)(params)

    (logp, ent), (slot_logp, slot_ent) = both(None), both(False)
    packed_mask = np.asarray(batch.mask)
    np.testing.assert_allclose(np.asarray(logp) * packed_mask, np.asarray(slot_logp) * packed_mask, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ent) * packed_mask, np.asarray(slot_ent) * packed_mask, atol=1e-6)
    assert np.all(np.asarray(logp)[packed_mask == 0] == 0) and np.all(np.asarray(ent)[packed_mask == 0] == 0)
    got = unpack(np.asarray(logp), members, len(lengths)) * mask
    want = _unpacked_logprobs(params, prompts, members, responses, lengths)
    np.testing.assert_allclose(got, want, atol=2e-5)

    weights = jnp.asarray(np.random.default_rng(4).normal(size=packed_mask.shape), jnp.float32) * packed_mask

    def objective(compact):
        def f(p):
            lp, h = response_logprobs(p, TINY, batch, chunk=16, with_entropy=True, compact=compact)
            return jnp.sum(weights * (lp + 0.1 * h))
        return jax.jit(jax.grad(f))(params)

    for got_g, want_g in zip(jax.tree_util.tree_leaves(objective(True)), jax.tree_util.tree_leaves(objective(False))):
        np.testing.assert_allclose(got_g, want_g, atol=1e-5)


def test_large_groups_split_into_rows_give_the_same_logprobs():
    from jaxrl_llm.train.rollouts import row_groups

    params = models.init_params(TINY, jax.random.PRNGKey(1))
    prompts, members, responses, lengths, _, mask = _samples(groups=3, per_group=5)
    members = [np.arange(0, 11), np.arange(11, 12), np.arange(12, 15)]  # uneven groups, like GVM's n_i
    split_prompts, split = row_groups(prompts, members, 4)
    assert [len(m) for m in split] == [4, 4, 3, 1, 3]
    assert split_prompts == [prompts[0]] * 3 + [prompts[1], prompts[2]]
    assert row_groups(prompts, [np.arange(0), members[1]], 4)[1][0].size == 0  # an empty group stays one entry
    whole = pack_groups(prompts, members, responses, lengths, row_multiple=4)
    rows = pack_groups(split_prompts, split, responses, lengths, row_multiple=4)
    assert rows.tokens.shape[1] < whole.tokens.shape[1]  # the longest row got shorter
    got = unpack(np.asarray(response_logprobs(params, TINY, rows, chunk=16)), split, 15) * mask
    want = unpack(np.asarray(response_logprobs(params, TINY, whole, chunk=16)), members, 15) * mask
    np.testing.assert_allclose(got, want, atol=2e-5)

    # A token bound as well: each row holds the prompt and the responses that fit in 12 tokens, in order
    # (a response that alone goes over still gets its row).
    limit = 12
    bounded_prompts, bounded = row_groups(prompts, members, 4, lengths=lengths, max_tokens=limit)
    expected = []
    for prompt, group in zip(prompts, members):
        row, used = [], len(prompt)
        for m in group:
            if row and (len(row) == 4 or used + lengths[m] > limit):
                expected.append(row)
                row, used = [], len(prompt)
            row.append(int(m))
            used += int(lengths[m])
        expected.append(row)
    assert [r.tolist() for r in bounded] == expected and len(expected) > len(split)
    for prompt, row in zip(bounded_prompts, bounded):
        assert len(row) == 1 or len(prompt) + lengths[row].sum() <= limit
    rows = pack_groups(bounded_prompts, bounded, responses, lengths, row_multiple=4)
    got = unpack(np.asarray(response_logprobs(params, TINY, rows, chunk=16)), bounded, 15) * mask
    np.testing.assert_allclose(got, want, atol=2e-5)
    with pytest.raises(ValueError, match="lengths"):
        row_groups(prompts, members, 4, max_tokens=limit)


def test_length_bucket_grid_by_hand():
    # four sizes per doubling of the chunk count: 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, ...
    assert [length_bucket(n, 32) for n in (1, 32, 33, 96, 97, 256, 257, 300, 513, 545)] == \
        [32, 32, 64, 96, 128, 256, 320, 320, 640, 640]
    assert length_bucket(0, 8) == 8
    # a packed row's length is bucketed: prompt 3 tokens + responses 5 + 4 tokens = 12 -> 2 chunks of 8 = 16;
    prompts, responses, lengths = [[1, 2, 3]], np.ones((2, 6), np.int32), np.array([5, 4])
    assert pack_groups(prompts, [np.array([0, 1])], responses, lengths, seq_multiple=8).tokens.shape == (1, 16)
    # 9 chunks of 2 (18 tokens) round up to 10 chunks (20 tokens)
    assert pack_groups([[1] * 9], [np.array([0, 1])], responses, lengths, seq_multiple=2).tokens.shape == (1, 20)


def _batch(params, seed=0):
    prompts, members, responses, lengths, adv, mask = _samples(seed=seed)
    probe = pack_groups(prompts, members, responses, lengths, row_multiple=4)
    old = unpack(np.asarray(make_logprob_fn(TINY)(params, probe)), members, responses.shape[0])
    batch = pack_groups(prompts, members, responses, lengths, advantages=adv, old_logp=old, ref_logp=old,
                        row_multiple=4)
    return jax.tree_util.tree_map(jnp.asarray, batch), mask


@pytest.mark.parametrize("algo", [
    AlgorithmSection(loss="clip"),
    AlgorithmSection(loss="vanilla", agg="seq-mean-token-sum"),
    AlgorithmSection(loss="clip", clip_high=0.28, agg="seq-mean-token-sum-norm", agg_max_len=6),
    AlgorithmSection(loss="clip", kl_coef=0.1, entropy_coef=0.01, agg="seq-mean-token-mean"),
])
def test_micro_batches_equal_one_batch_and_loss_decreases(algo):
    params = models.init_params(TINY, jax.random.PRNGKey(1))
    batch, mask = _batch(params)
    denom = aggregate_denominator(jnp.asarray(mask), algo.agg)
    # Plain SGD, so the parameter change is the gradient itself (Adam's first step is sign(g), which
    # magnifies float-rounding differences of near-zero gradients).
    opt = optax.sgd(1.0)
    results = []
    for micro in (4, 1):
        state = init_state(jax.tree_util.tree_map(jnp.copy, params), opt)
        step = make_train_step(TINY, algo, opt, micro_batch_size=micro)
        results.append(step(state, batch, denom))
    (s1, m1), (s4, m4) = results
    np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(m1["grad_norm"], m4["grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(s1.params), jax.tree_util.tree_leaves(s4.params)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # A second step on the same batch sees a lower loss: the update followed the gradient.
    adamw = make_optimizer(OptimSection(lr=1e-2, weight_decay=0.0))
    step = make_train_step(TINY, algo, adamw, micro_batch_size=4)
    s1, m1 = step(init_state(params, adamw), batch, denom)
    assert int(s1.step) == 1 and float(m1["finite"]) == 1.0
    _, again = step(s1, batch, denom)
    assert float(again["loss"]) < float(m1["loss"])


def test_micro_batch_order_by_hand():
    from jaxrl_llm.train.packing import micro_batch_order
    from jaxrl_llm.train.step import split_micro

    order = micro_batch_order(8, 2)
    assert order.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    # split_micro then takes packed rows 0-1, 2-3, 4-5, 6-7 as micro-batches 0..3
    assert np.asarray(split_micro(jnp.arange(8)[order], 2)).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert micro_batch_order(4, 1).tolist() == micro_batch_order(4, 4).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="multiple of micro_batch_size=4"):
        micro_batch_order(6, 4)


def test_summed_grads_skips_inactive_micro_batches():
    """An inactive micro-batch's grad_fn does not run (its host callback never fires) and adds nothing."""
    from jaxrl_llm.train.step import summed_grads

    calls = []

    def grad_fn(params, x):
        jax.debug.callback(lambda v: calls.append(float(v)), x.sum())
        return ((params * x).sum(), {"n": x.sum()}), x  # d/dparams (params . x) = x

    xs = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    params = jnp.array([0.5, -1.0])
    summed = jax.jit(lambda p, x, on: summed_grads(grad_fn, p, (x,), ("n",), active=on))
    loss, msum, grads = summed(params, xs, jnp.array([True, False, True]))
    jax.effects_barrier()
    assert sorted(calls) == [3.0, 11.0]  # rows 0 and 2 only
    np.testing.assert_allclose(grads, [6.0, 8.0])
    np.testing.assert_allclose(float(loss), 0.5 * 6 - 8.0)
    np.testing.assert_allclose(float(msum["n"]), 14.0)


@pytest.mark.parametrize("micro", [1, 2])
def test_logprob_pass_in_micro_batches_equals_one_pass_and_skips_padding(micro):
    """The old/reference log-prob pass of a run (micro-batches of optim.micro_batch_size rows, `jit_packed_pass`)
    equals one pass over every row; the micro-batches of padding rows are skipped and give 0."""
    from jaxrl_llm.train.packing import micro_batch_order

    params = models.init_params(TINY, jax.random.PRNGKey(7))
    prompts, members, responses, lengths, _, mask = _samples(groups=5, seed=4)
    packed = pack_groups(prompts, members, responses, lengths, row_multiple=2)
    order = micro_batch_order(8, micro)
    batch = jax.tree_util.tree_map(lambda x: x[order], packed)
    whole = np.asarray(make_logprob_fn(TINY)(params, batch))
    got = np.asarray(make_logprob_fn(TINY, micro_batch_size=micro)(params, batch))
    on = np.asarray(batch.mask)
    np.testing.assert_allclose(got * on, whole * on, atol=1e-6)
    assert np.all(got[on > 0] < 0)
    # Packed rows 5-7 pad 5 rows to 8. Micro-batches of 1: each is skipped. Of 2 (rows 0-1, 2-3, 4-5, 6-7 after
    # the ordering): rows 6-7 are skipped; row 5 shares a micro-batch with row 4 and is computed.
    position = np.argsort(order)
    skipped = position[[5, 6, 7] if micro == 1 else [6, 7]]
    assert np.all(got[skipped] == 0) and np.abs(whole[skipped]).min() > 0
    want = _unpacked_logprobs(params, prompts, members, responses, lengths)
    np.testing.assert_allclose(unpack(got[np.argsort(order)], members, len(lengths)) * mask, want, atol=2e-5)


def test_micro_batches_of_padding_rows_are_skipped_and_change_nothing():
    """Five packed rows padded to 8, ordered so that the last micro-batch of 2 holds padding only: the scanned
    step marks it inactive (skipped) and its update equals one micro-batch of all 8 rows."""
    from jaxrl_llm.train.packing import micro_batch_order
    from jaxrl_llm.train.step import has_tokens, split_micro

    params = models.init_params(TINY, jax.random.PRNGKey(5))
    prompts, members, responses, lengths, adv, mask = _samples(groups=5, seed=2)
    old = -np.abs(np.random.default_rng(6).normal(size=mask.shape)).astype(np.float32) * mask
    packed = pack_groups(prompts, members, responses, lengths, advantages=adv, old_logp=old, row_multiple=2)
    assert packed.tokens.shape[0] == 8
    batch = jax.tree_util.tree_map(lambda x: jnp.asarray(x[micro_batch_order(8, 2)]), packed)
    assert np.asarray(has_tokens(split_micro(batch, 2))).tolist() == [True, True, True, False]
    algo = AlgorithmSection(loss="clip", entropy_coef=0.01)
    denom = aggregate_denominator(jnp.asarray(mask), algo.agg)
    opt = optax.sgd(1.0)

    def run(micro):
        state = init_state(jax.tree_util.tree_map(jnp.copy, params), opt)
        return make_train_step(TINY, algo, opt, micro_batch_size=micro)(state, batch, denom)

    (whole, m_whole), (scanned, m_scanned) = run(8), run(2)
    assert float(m_scanned["finite"]) == 1.0 and int(scanned.step) == 1
    np.testing.assert_allclose(m_scanned["loss"], m_whole["loss"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(m_scanned["entropy"], m_whole["entropy"], rtol=1e-6)
    moved = False
    for a, b, p in zip(jax.tree_util.tree_leaves(scanned.params), jax.tree_util.tree_leaves(whole.params),
                       jax.tree_util.tree_leaves(params)):
        np.testing.assert_allclose(a, b, atol=1e-6)
        moved = moved or bool(np.abs(np.asarray(a) - np.asarray(p)).max() > 1e-4)
    assert moved  # the update did something


@pytest.mark.parametrize("micro_batch_size", [2, 4])  # a scan over micro-batches, and one micro-batch
def test_non_finite_update_is_skipped_and_step_compiles_once(micro_batch_size):
    params = models.init_params(TINY, jax.random.PRNGKey(2))
    algo = AlgorithmSection()
    opt = make_optimizer(OptimSection(lr=1e-2))
    step = make_train_step(TINY, algo, opt, micro_batch_size=micro_batch_size)
    batch, mask = _batch(params)
    denom = aggregate_denominator(jnp.asarray(mask), algo.agg)
    state = init_state(params, opt)
    before = jax.tree_util.tree_map(np.asarray, state.params)
    bad = batch._replace(advantages=batch.advantages.at[0, 0, 0].set(jnp.nan))
    good = _batch(params, seed=0)[0]
    with counted_compiles() as compiles:
        state, metrics = step(state, bad, denom)
        assert float(metrics["finite"]) == 0.0 and int(state.step) == 0
        for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(state.params)):
            np.testing.assert_array_equal(a, b)
        for _ in range(3):
            state, metrics = step(state, good, denom)
        assert int(state.step) == 3
    assert len(compiles) == 1


@pytest.mark.parametrize("memory_settings", [{}, {"remat": True, "attention_block_size": 8, "remat_logits": True}])
def test_bf16_compute_step_runs_on_every_backend_and_follows_the_f32_step(memory_settings):
    # f32 weights with bf16 compute (the paper presets): XLA's CPU runtime rejected the step's fused
    # bf16 x bf16 -> f32 products ("Unsupported element type for DotThunk::Execute"). The bf16 step must
    # run here and give the f32 step's loss, gradient norm and update to bf16 rounding.
    params = models.init_params(TINY, jax.random.PRNGKey(1))
    batch, mask = _batch(params)
    algo = AlgorithmSection(loss="clip")
    denom = aggregate_denominator(jnp.asarray(mask), algo.agg)
    opt = optax.sgd(1.0)
    results = {}
    for dtype in ("float32", "bfloat16"):
        config = TINY.replace(compute_dtype=dtype, **memory_settings)
        step = make_train_step(config, algo, opt, micro_batch_size=2)
        results[dtype] = step(init_state(jax.tree_util.tree_map(jnp.copy, params), opt), batch, denom)
    (s32, m32), (s16, m16) = results["float32"], results["bfloat16"]
    assert float(m16["finite"]) == 1.0
    np.testing.assert_allclose(m16["loss"], m32["loss"], rtol=0.05, atol=1e-3)
    np.testing.assert_allclose(m16["grad_norm"], m32["grad_norm"], rtol=0.05)
    delta = lambda s: np.concatenate([np.ravel(a - b) for a, b in zip(jax.tree_util.tree_leaves(s.params),  # noqa: E731
                                                                      jax.tree_util.tree_leaves(params))])
    d16, d32 = delta(s16), delta(s32)
    assert np.dot(d16, d32) / (np.linalg.norm(d16) * np.linalg.norm(d32)) > 0.99
