"""On-policy distillation objectives: hand values, NumPy references of values and gradients, exact
micro-batching, vocabulary chunking and bad input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.objectives import (
    AGG_MODES,
    LossTerms,
    aggregate_denominator,
    reverse_kl_advantages,
    topk_distill_loss,
    topk_distill_terms,
    topk_terms_at_ids,
)


def test_reverse_kl_advantages_hand_values_and_gradient():
    student = np.array([[-1.0, -2.0, 5.0], [-0.1, np.nan, -np.inf]], np.float32)
    teacher = np.array([[-0.5, -3.0, -np.inf], [-0.4, 1.0, 2.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
    adv = reverse_kl_advantages(student, teacher, mask)
    np.testing.assert_allclose(np.asarray(adv), [[0.5, -1.0, 0.0], [-0.3, 0.0, 0.0]], rtol=0, atol=1e-6)
    assert adv.dtype == jnp.float32
    clean_s, clean_t = np.nan_to_num(student, posinf=0, neginf=0), np.nan_to_num(teacher, posinf=0, neginf=0)
    g_student, g_teacher = jax.grad(lambda s, t: reverse_kl_advantages(s, t, mask).sum(), argnums=(0, 1))(
        clean_s, clean_t)
    np.testing.assert_array_equal(np.asarray(g_student), -mask)
    np.testing.assert_array_equal(np.asarray(g_teacher), mask)


def test_reverse_kl_advantages_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="teacher_logp must have student_logp's shape"):
        reverse_kl_advantages(np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3)))
    with pytest.raises(ValueError, match="mask must have"):
        reverse_kl_advantages(np.zeros((2, 3)), np.zeros((2, 3)), np.ones((3,)))
    with pytest.raises(ValueError, match=r"must be \[B, T\]"):
        reverse_kl_advantages(np.zeros((3,)), np.zeros((3,)), np.ones((3,)))


def test_topk_hand_value():
    # p_S = 1/3 on each of 3 ids; the teacher's top 2 (0.5, 0.25) renormalise to (2/3, 1/3):
    # loss = 2/3 (log 2/3 - log 1/3) + 1/3 (log 1/3 - log 1/3) = 2/3 log 2.
    logits = jnp.zeros((1, 1, 3))
    ids = jnp.array([[[0, 1]]])
    logp = jnp.log(jnp.array([[[0.5, 0.25]]]))
    loss, metrics = topk_distill_loss(logits, ids, logp, jnp.ones((1, 1)))
    assert math.isclose(float(loss), 2 / 3 * math.log(2), rel_tol=1e-6)
    assert math.isclose(float(metrics["topk_coverage"]), 2 / 3, rel_tol=1e-6)
    assert math.isclose(float(metrics["teacher_topk_mass"]), 0.75, rel_tol=1e-6)
    assert float(metrics["num_tokens"]) == 1.0
    # d loss / d l_v = p_S(v) - p~(v) = (1/3 - 2/3, 1/3 - 1/3, 1/3 - 0)
    grad = jax.grad(lambda x: topk_distill_loss(x, ids, logp, jnp.ones((1, 1)))[0])(logits)
    np.testing.assert_allclose(np.asarray(grad)[0, 0], [-1 / 3, 0.0, 1 / 3], rtol=0, atol=1e-6)


def numpy_topk(logits, ids, teacher, mask, mode, max_len=None):
    """float64 reference from the formula: (loss, d loss / d logits)."""
    logits, teacher = logits.astype(np.float64), teacher.astype(np.float64)
    batch, length, vocab = logits.shape
    log_p = logits - logits.max(-1, keepdims=True)
    log_p = log_p - np.log(np.exp(log_p).sum(-1, keepdims=True))
    weights = np.zeros((batch, length))  # d loss / d loss_t of the aggregation
    if mode == "token-mean":
        weights = mask / max(mask.sum(), 1)
    elif mode == "seq-mean-token-mean":
        rows = mask.sum(1) > 0
        for b in range(batch):
            if rows[b]:
                weights[b] = mask[b] / mask[b].sum() / rows.sum()
    else:
        weights = mask / batch / (max_len if mode == "seq-mean-token-sum-norm" else 1.0)
    loss, grad = 0.0, np.zeros(logits.shape)
    for b in range(batch):
        for t in range(length):
            if not mask[b, t]:
                continue
            q = np.exp(teacher[b, t]) / np.exp(teacher[b, t]).sum()
            per_token = sum(q[k] * (math.log(q[k]) - log_p[b, t, ids[b, t, k]]) for k in range(len(q)) if q[k] > 0)
            loss += weights[b, t] * per_token
            grad[b, t] = weights[b, t] * np.exp(log_p[b, t]) * q.sum()
            for k in range(len(q)):
                grad[b, t, ids[b, t, k]] -= weights[b, t] * q[k]
    return loss, grad


def random_case(seed, batch=5, length=4, vocab=11, k=3):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2.0, size=(batch, length, vocab)).astype(np.float32)
    ids = np.stack([np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(length)])
                    for _ in range(batch)]).astype(np.int32)
    teacher = np.log(rng.dirichlet(np.ones(vocab), size=(batch, length))).astype(np.float32)
    teacher = np.take_along_axis(teacher, ids, axis=-1)
    mask = (rng.random((batch, length)) < 0.7).astype(np.float32)
    mask[1] = 0.0  # an empty row
    mask[0, 0] = 1.0
    return logits, ids, teacher, mask


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("chunk", [11, 4, 64])  # one chunk, whole chunks and a shorter last one, wider than V
def test_topk_loss_and_gradient_equal_numpy_reference(mode, chunk):
    logits, ids, teacher, mask = random_case(0)
    want_loss, want_grad = numpy_topk(logits, ids, teacher, mask, mode, max_len=4)
    loss, grad = jax.value_and_grad(
        lambda x: topk_distill_loss(x, ids, teacher, mask, agg=mode, max_len=4, chunk=chunk)[0])(jnp.asarray(logits))
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_topk_micro_batches_equal_one_batch(mode):
    logits, ids, teacher, mask = random_case(1, batch=6)
    kwargs = dict(agg=mode, max_len=4, chunk=4)
    full_loss, full_grad = jax.value_and_grad(lambda x: topk_distill_loss(x, ids, teacher, mask, **kwargs)[0])(
        jnp.asarray(logits))
    bounds = [(0, 2), (2, 5), (5, 6)]
    denom = aggregate_denominator(mask, mode)
    losses, grads = [], []
    for lo, hi in bounds:
        value, grad = jax.value_and_grad(lambda x: topk_distill_loss(
            x, ids[lo:hi], teacher[lo:hi], mask[lo:hi], denom=denom, **kwargs)[0])(jnp.asarray(logits[lo:hi]))
        losses.append(float(value))
        grads.append(np.asarray(grad))
    np.testing.assert_allclose(sum(losses), float(full_loss), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.concatenate(grads), np.asarray(full_grad), rtol=1e-6, atol=1e-7)

    accumulated, total_grads = LossTerms(jnp.float32(0), jnp.float32(0)), []
    for lo, hi in bounds:
        grad, terms = jax.grad(lambda x: (lambda t: (t.total, t))(topk_distill_terms(
            x, ids[lo:hi], teacher[lo:hi], mask[lo:hi], **kwargs)[0]), has_aux=True)(jnp.asarray(logits[lo:hi]))
        accumulated = jax.tree.map(jnp.add, accumulated, terms)
        total_grads.append(np.asarray(grad))
    np.testing.assert_allclose(float(accumulated.value()), float(full_loss), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.concatenate(total_grads) / float(accumulated.denom), np.asarray(full_grad),
                               rtol=1e-6, atol=1e-7)


def test_teacher_equal_to_student_on_the_whole_vocabulary_gives_zero_loss_and_gradient():
    logits, _, _, mask = random_case(2, k=11)
    ids = np.broadcast_to(np.arange(11, dtype=np.int32), logits.shape).copy()
    teacher = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    loss, grad = jax.value_and_grad(lambda x: topk_distill_loss(x, ids, teacher, mask, chunk=4)[0])(
        jnp.asarray(logits))
    assert abs(float(loss)) < 1e-6
    np.testing.assert_allclose(np.asarray(grad), 0.0, atol=1e-7)
    _, metrics = topk_distill_loss(logits, ids, teacher, mask)
    assert math.isclose(float(metrics["topk_coverage"]), 1.0, rel_tol=1e-6)


def test_padding_and_impossible_teacher_tokens_stay_finite():
    logits, ids, teacher, mask = random_case(3)
    teacher[mask == 0] = -np.inf  # garbage at padding
    logits[1] = np.nan  # the empty row's logits are garbage too
    teacher[0, 0, 2] = -np.inf  # a top-K id the teacher gives probability 0: it carries no weight
    loss, grad = jax.value_and_grad(lambda x: topk_distill_loss(x, ids, teacher, mask)[0])(jnp.asarray(logits))
    clean = logits.copy()
    clean[1] = 0.0
    want_loss, want_grad = numpy_topk(clean, ids, np.where(np.isfinite(teacher), teacher, -1e30), mask, "token-mean")
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad)[mask > 0], want_grad[mask > 0], rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(grad)[mask == 0] == 0.0)


def test_bfloat16_logits_get_a_bfloat16_gradient_and_no_float32_vocabulary_array():
    logits, ids, teacher, mask = random_case(4, batch=3, length=4, vocab=50, k=3)
    low = jnp.asarray(logits, jnp.bfloat16)
    fn = lambda x: topk_distill_loss(x, ids, teacher, mask, chunk=8)[0]  # noqa: E731
    loss, grad = jax.value_and_grad(fn)(low)
    assert grad.dtype == jnp.bfloat16
    want_loss, want_grad = numpy_topk(np.asarray(low.astype(jnp.float32)), ids, teacher, mask, "token-mean")
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad.astype(jnp.float32)), want_grad, rtol=2e-2, atol=2e-3)
    # Forward and backward: float32 arrays hold one [tokens, 8] chunk, never the 50-id vocabulary.
    program = str(jax.make_jaxpr(jax.value_and_grad(fn))(low))
    assert "f32[12,50]" not in program and "f32[3,4,50]" not in program
    assert "f32[12,8]" in program and "bf16[12,50]" in program


def test_jit_gives_the_same_value():
    logits, ids, teacher, mask = random_case(5)
    eager = topk_distill_loss(logits, ids, teacher, mask, chunk=4)
    jitted = jax.jit(lambda *a: topk_distill_loss(*a, chunk=4))(logits, ids, teacher, mask)
    np.testing.assert_allclose(float(jitted[0]), float(eager[0]), rtol=1e-6)
    np.testing.assert_allclose(float(jitted[1]["topk_coverage"]), float(eager[1]["topk_coverage"]), rtol=1e-6)


@pytest.mark.parametrize("change, message", [
    (dict(ids=np.full((2, 3, 2), 7, np.int32)), r"teacher_ids must lie in \[0, 5\).*from 7 to 7"),
    (dict(ids=np.full((2, 3, 2), -1, np.int32)), r"must lie in \[0, 5\)"),
    (dict(ids=np.zeros((2, 3, 2), np.float32)), "must be integer token ids"),
    (dict(ids=np.zeros((2, 4, 2), np.int32)), r"teacher_ids must be \[B, T, K\]"),
    (dict(teacher=np.zeros((2, 3, 3))), "teacher_logp must have teacher_ids' shape"),
    (dict(mask=np.ones((2, 4))), r"mask must be \[B, T\]"),
    (dict(logits=np.zeros((6, 5))), r"student_logits must be \[B, T, V\]"),
    (dict(agg="mean"), "agg mode must be one of"),
    (dict(chunk=0), "chunk must be a positive int"),
])
def test_topk_bad_input_names_the_problem(change, message):
    args = dict(logits=np.zeros((2, 3, 5), np.float32), ids=np.zeros((2, 3, 2), np.int32),
                teacher=np.zeros((2, 3, 2), np.float32), mask=np.ones((2, 3), np.float32), agg="token-mean", chunk=4)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        topk_distill_loss(args["logits"], args["ids"], args["teacher"], args["mask"], agg=args["agg"],
                          chunk=args["chunk"])


def test_topk_terms_at_ids_from_the_students_log_probs_of_the_ids():
    # the loss and its gradient in the student's log-probs of the ids: d loss / d log p_S(id_k) = -w_t p~_k
    logits, ids, teacher, mask = random_case(2)
    log_p = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))
    at_ids = np.take_along_axis(log_p, ids, axis=-1)
    want_loss, _ = numpy_topk(logits, ids, teacher, mask, "token-mean")

    def loss(x):
        terms, metrics = topk_terms_at_ids(x, teacher, mask)
        return terms.total / terms.denom, metrics

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(at_ids))
    np.testing.assert_allclose(float(value), want_loss, rtol=1e-5)
    q = np.exp(teacher.astype(np.float64)) / np.exp(teacher.astype(np.float64)).sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(grad), -q * (mask / mask.sum())[..., None], rtol=1e-5, atol=1e-8)
    on = mask > 0
    assert float(metrics["topk_coverage"]) == pytest.approx(np.exp(at_ids).sum(-1)[on].mean(), rel=1e-5)
    with pytest.raises(ValueError, match=r"topk_terms_at_ids: student_logp and teacher_logp must be \[B, T, K\]"):
        topk_terms_at_ids(at_ids[..., :2], teacher, mask)
