"""Policy loss and aggregation: hand values, loop references, analytic gradients, exact micro-batching."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.objectives import (
    AGG_MODES,
    LossTerms,
    aggregate,
    aggregate_denominator,
    aggregate_terms,
    policy_loss,
    policy_loss_terms,
)

LOG = math.log
# Row 0: A = +1, ratios 1.5 (above 1 + 0.28: clipped), 0.5 (below 1 - 0.2 but A > 0: not clipped), 1.1.
# Row 1: every token masked (its values are garbage). Row 2: A = -2, ratios 0.5 (clipped low),
# 1.3 (above the high bound but A < 0: not clipped), 4.0 (dual clip at 3 active), 1.0.
OLD_LOGP = np.full((3, 4), -1.0, np.float32)
LOGP = OLD_LOGP + np.array([[LOG(1.5), LOG(0.5), LOG(1.1), 60.0],
                            [80.0, -90.0, 3.0, 0.0],
                            [LOG(0.5), LOG(1.3), LOG(4.0), 0.0]], np.float32)
MASK = np.array([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], np.float32)
ADV = np.array([1.0, 5.0, -2.0], np.float32)
CLIP = dict(clip_low=0.2, clip_high=0.28)


def per_token_loop(logp, old, adv, mask, kind, clip_low, clip_high, dual_clip):
    """Loop reference of the per-token loss and of its derivative w.r.t. logp."""
    b_size, t_size = logp.shape
    loss, grad = np.zeros((b_size, t_size)), np.zeros((b_size, t_size))
    for b in range(b_size):
        for t in range(t_size):
            if mask[b, t] == 0:
                continue
            a = adv[b] if adv.ndim == 1 else adv[b, t]
            if kind == "vanilla":
                loss[b, t], grad[b, t] = -a * logp[b, t], -a
                continue
            r = math.exp(logp[b, t] - old[b, t])
            unclipped = -a * r
            clipped = -a * min(max(r, 1 - clip_low), 1 + clip_high)
            value, slope = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
            if dual_clip is not None and a < 0 and -a * dual_clip < value:
                value, slope = -a * dual_clip, 0.0
            loss[b, t], grad[b, t] = value, slope
    return loss, grad


def aggregate_loop(x, mask, mode, max_len=None):
    """Loop reference of the four aggregation modes; returns (value, per-token weight d value / d x)."""
    b_size, t_size = x.shape
    weight = np.zeros((b_size, t_size))
    if mode == "token-mean":
        n = sum(mask[b, t] for b in range(b_size) for t in range(t_size))
        for b in range(b_size):
            for t in range(t_size):
                weight[b, t] = mask[b, t] / n if n else 0.0
    elif mode == "seq-mean-token-mean":
        rows = [b for b in range(b_size) if sum(mask[b]) > 0]
        for b in rows:
            for t in range(t_size):
                weight[b, t] = mask[b, t] / sum(mask[b]) / len(rows)
    else:
        scale = max_len if mode == "seq-mean-token-sum-norm" else 1.0
        for b in range(b_size):
            for t in range(t_size):
                weight[b, t] = mask[b, t] / scale / b_size
    value = sum(weight[b, t] * x[b, t] for b in range(b_size) for t in range(t_size) if mask[b, t])
    return value, weight


def test_clip_loss_hand_values_and_metrics():
    loss, metrics = policy_loss(LOGP, OLD_LOGP, ADV, MASK, dual_clip=3.0, **CLIP)
    np.testing.assert_allclose(float(loss), (-1.28 - 0.5 - 1.1 + 1.6 + 2.6 + 6.0 + 2.0) / 7, rtol=1e-5)
    no_dual, _ = policy_loss(LOGP, OLD_LOGP, ADV, MASK, **CLIP)
    np.testing.assert_allclose(float(no_dual), (-1.28 - 0.5 - 1.1 + 1.6 + 2.6 + 8.0 + 2.0) / 7, rtol=1e-5)
    ratios = np.array([1.5, 0.5, 1.1, 0.5, 1.3, 4.0, 1.0])
    expected = {
        "clip_fraction_low": 1 / 7, "clip_fraction_high": 1 / 7, "clip_fraction": 2 / 7, "dual_clip_fraction": 1 / 7,
        "ratio_mean": ratios.mean(), "ratio_min": 0.5, "ratio_max": 4.0,
        "approx_kl": np.mean(ratios - 1 - np.log(ratios)), "num_tokens": 7.0,
    }
    for key, value in expected.items():
        np.testing.assert_allclose(float(metrics[key]), value, rtol=1e-5, err_msg=key)


def test_vanilla_loss_is_minus_a_logp():
    loss, metrics = policy_loss(LOGP, OLD_LOGP, ADV, MASK, kind="vanilla")
    lp = LOGP.astype(np.float64)
    expected = (-(lp[0, 0] + lp[0, 1] + lp[0, 2]) + 2 * lp[2].sum()) / 7
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    assert float(metrics["clip_fraction"]) == 0.0


def test_gradient_equals_analytic_expression():
    grad, _ = jax.grad(lambda lp: policy_loss(lp, OLD_LOGP, ADV, MASK, dual_clip=3.0, **CLIP), has_aux=True)(
        jnp.asarray(LOGP))
    # clip region and dual clip: 0; inside: -A r / N with N = 7 tokens
    expected = np.array([[0.0, -1 * 0.5, -1 * 1.1, 0.0], [0, 0, 0, 0], [0.0, 2 * 1.3, 0.0, 2 * 1.0]]) / 7
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-7)
    assert np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("kind", ["clip", "vanilla"])
@pytest.mark.parametrize("token_adv", [False, True])
def test_loss_and_gradient_match_loop_reference(mode, kind, token_adv):
    rng = np.random.default_rng(1)
    logp = rng.normal(-1.0, 0.3, size=(6, 5)).astype(np.float32)
    old = (logp + rng.normal(0, 0.4, size=(6, 5))).astype(np.float32)
    mask = (rng.random((6, 5)) < 0.7).astype(np.float32)
    mask[2] = 0.0
    adv = rng.normal(size=(6, 5) if token_adv else (6,)).astype(np.float32)
    kwargs = dict(kind=kind, clip_low=0.2, clip_high=0.28, dual_clip=2.5, agg=mode, max_len=8)
    (loss, _), grad = jax.value_and_grad(lambda lp: policy_loss(lp, old, adv, mask, **kwargs), has_aux=True)(
        jnp.asarray(logp))
    per_token, slope = per_token_loop(logp.astype(np.float64), old.astype(np.float64), adv, mask, kind,
                                      0.2, 0.28, 2.5)
    value, weight = aggregate_loop(per_token, mask, mode, max_len=8)
    np.testing.assert_allclose(float(loss), value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), weight * slope, rtol=1e-5, atol=1e-6)


def random_batch(seed, token_adv):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-1.5, 0.5, size=(8, 6)).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, size=(8, 6))).astype(np.float32)
    mask = (rng.random((8, 6)) < 0.75).astype(np.float32)
    mask[3] = 0.0  # an empty row inside a micro-batch
    adv = rng.normal(size=(8, 6) if token_adv else (8,)).astype(np.float32)
    return logp, old, adv, mask


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("token_adv", [False, True])
def test_micro_batch_accumulation_is_exact(mode, token_adv):
    logp, old, adv, mask = random_batch(2, token_adv)
    kwargs = dict(agg=mode, max_len=6, dual_clip=3.0)
    full_loss, full_grad = jax.value_and_grad(lambda lp: policy_loss(lp, old, adv, mask, **kwargs)[0])(
        jnp.asarray(logp))
    bounds = [(0, 3), (3, 5), (5, 8)]

    # 1. normalise every micro-batch by the full batch's denominator, known up front
    denom = aggregate_denominator(mask, mode)
    losses, grads = [], []
    for lo, hi in bounds:
        value, grad = jax.value_and_grad(
            lambda lp: policy_loss(lp, old[lo:hi], adv[lo:hi], mask[lo:hi], denom=denom, **kwargs)[0])(
            jnp.asarray(logp[lo:hi]))
        losses.append(float(value))
        grads.append(np.asarray(grad))
    np.testing.assert_allclose(sum(losses), float(full_loss), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.concatenate(grads), np.asarray(full_grad), rtol=1e-6, atol=1e-6)

    # 2. sum the unreduced totals and denominators, divide once at the end
    accumulated = LossTerms(jnp.float32(0), jnp.float32(0))
    total_grads = []
    for lo, hi in bounds:
        (grad, (terms, _)) = jax.grad(
            lambda lp: (lambda t, m: (t.total, (t, m)))(*policy_loss_terms(lp, old[lo:hi], adv[lo:hi],
                                                                            mask[lo:hi], **kwargs)),
            has_aux=True)(jnp.asarray(logp[lo:hi]))
        accumulated = jax.tree.map(jnp.add, accumulated, terms)
        total_grads.append(np.asarray(grad))
    np.testing.assert_allclose(float(accumulated.value()), float(full_loss), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(float(accumulated.denom), float(denom), rtol=0, atol=0)
    np.testing.assert_allclose(np.concatenate(total_grads) / float(accumulated.denom), np.asarray(full_grad),
                               rtol=1e-6, atol=1e-6)


def test_aggregate_hand_values_with_empty_row():
    x = np.array([[1.0, 2.0, 3.0], [9.0, 9.0, 9.0], [4.0, np.nan, 0.0]], np.float32)  # NaN is masked
    mask = np.array([[1, 1, 0], [0, 0, 0], [1, 0, 1]], np.float32)
    assert float(aggregate(x, mask, "token-mean")) == pytest.approx((1 + 2 + 4 + 0) / 4)
    assert float(aggregate(x, mask, "seq-mean-token-mean")) == pytest.approx((1.5 + 2.0) / 2)
    assert float(aggregate(x, mask, "seq-mean-token-sum")) == pytest.approx((3 + 0 + 4) / 3)
    assert float(aggregate(x, mask, "seq-mean-token-sum-norm", max_len=4)) == pytest.approx((3 + 4) / 4 / 3)
    terms = aggregate_terms(x, mask, "seq-mean-token-mean")
    assert (float(terms.total), float(terms.denom)) == pytest.approx((3.5, 2.0))
    assert float(aggregate(x, mask, "token-mean", denom=8.0)) == pytest.approx(7 / 8)
    for mode in AGG_MODES:  # an empty batch gives 0, not NaN
        assert float(aggregate(x, np.zeros_like(mask), mode, max_len=4)) == 0.0


def test_all_masked_batch_gives_zero_loss_and_gradient():
    zero = np.zeros_like(MASK)
    (loss, metrics), grad = jax.value_and_grad(lambda lp: policy_loss(lp, OLD_LOGP, ADV, zero), has_aux=True)(
        jnp.asarray(LOGP))
    assert float(loss) == 0.0
    assert np.all(np.asarray(grad) == 0.0)
    assert float(metrics["ratio_mean"]) == 1.0 and float(metrics["clip_fraction"]) == 0.0


def test_jit_and_vmap():
    fn = functools.partial(policy_loss, dual_clip=3.0, agg="seq-mean-token-mean", **CLIP)
    eager, _ = fn(LOGP, OLD_LOGP, ADV, MASK)
    jitted, _ = jax.jit(fn)(LOGP, OLD_LOGP, ADV, MASK)
    np.testing.assert_allclose(float(jitted), float(eager), rtol=1e-6)
    stacked = [np.stack([a, a[::-1]]) for a in (LOGP, OLD_LOGP, ADV, MASK)]
    batched, metrics = jax.jit(jax.vmap(fn))(*stacked)
    assert batched.shape == (2,) and metrics["ratio_max"].shape == (2,)
    np.testing.assert_allclose(float(batched[1]), float(fn(LOGP[::-1], OLD_LOGP[::-1], ADV[::-1], MASK[::-1])[0]),
                               rtol=1e-6)
    agg = jax.jit(functools.partial(aggregate, mode="seq-mean-token-sum-norm", max_len=4))
    np.testing.assert_allclose(float(agg(LOGP * 0 + 1.0, MASK)), 7 / 4 / 3, rtol=1e-6)
    vm = jax.vmap(functools.partial(aggregate, mode="token-mean"))(np.stack([MASK, MASK]), np.stack([MASK, MASK]))
    np.testing.assert_allclose(np.asarray(vm), [1.0, 1.0])


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="kind"):
        policy_loss(LOGP, OLD_LOGP, ADV, MASK, kind="ppo")
    with pytest.raises(ValueError, match="agg"):
        policy_loss(LOGP, OLD_LOGP, ADV, MASK, agg="mean")
    with pytest.raises(ValueError, match="max_len"):
        policy_loss(LOGP, OLD_LOGP, ADV, MASK, agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(LOGP, OLD_LOGP, ADV, MASK, dual_clip=0.5)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(LOGP, OLD_LOGP, ADV[:2], MASK)
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(LOGP, OLD_LOGP[:, :2], ADV, MASK)


def test_denominator_helper_bool_mask_and_jit():
    mask = np.array([[1, 1, 0], [0, 0, 0], [1, 0, 1]], bool)
    expected = {"token-mean": 4.0, "seq-mean-token-mean": 2.0, "seq-mean-token-sum": 3.0,
                "seq-mean-token-sum-norm": 3.0}
    for mode, value in expected.items():
        assert float(jax.jit(aggregate_denominator, static_argnames="mode")(mask, mode=mode)) == value
    x = np.arange(9, dtype=np.float32).reshape(3, 3)
    np.testing.assert_allclose(float(aggregate(x, mask, "token-mean")), (0 + 1 + 6 + 8) / 4)
    loss_bool, _ = policy_loss(LOGP, OLD_LOGP, ADV, MASK.astype(bool), dual_clip=3.0, **CLIP)
    loss_float, _ = policy_loss(LOGP, OLD_LOGP, ADV, MASK, dual_clip=3.0, **CLIP)
    assert float(loss_bool) == float(loss_float)


def test_each_kind_is_a_registered_function():
    from jaxrl_llm.objectives import POLICY_LOSS_KINDS, POLICY_LOSSES, LossSettings, TokenInputs

    assert POLICY_LOSS_KINDS == tuple(POLICY_LOSSES) == ("clip", "vanilla", "gspo", "gspo_token", "cispo", "clip_cov",
                                                          "kl_cov")
    # The clip kind on its own: ratios 1.5 (A = +1, clipped high at 1.2), 0.5 (A = -1, clipped low at 0.8).
    log_ratio = jnp.log(jnp.array([[1.5, 0.5]]))
    inputs = TokenInputs(jnp.zeros((1, 2)), log_ratio, jnp.array([[1.0, -1.0]]), jnp.ones((1, 2)),
                         jnp.zeros((1, 2), bool), False)
    out = POLICY_LOSSES["clip"](inputs, LossSettings(clip_low=0.2, clip_high=0.2))
    np.testing.assert_allclose(np.asarray(out.per_token), [[-1.2, 0.8]], rtol=1e-6)
    assert np.asarray(out.high_clipped).tolist() == [[True, False]]
    assert np.asarray(out.low_clipped).tolist() == [[False, True]]


def test_a_new_kind_is_one_function_and_a_registry_entry(monkeypatch):
    from jaxrl_llm.objectives import POLICY_LOSSES, TokenLoss

    def double_vanilla(x, s):  # l_t = -2 A logp_t
        none = jnp.zeros(x.logp.shape, bool)
        return TokenLoss(-2.0 * x.adv * jnp.where(x.mask != 0, x.logp, 0.0), x.log_ratio, none, none, none)

    monkeypatch.setitem(POLICY_LOSSES, "double_vanilla", double_vanilla)
    new, _ = policy_loss(LOGP, OLD_LOGP, ADV, MASK, kind="double_vanilla")
    vanilla, _ = policy_loss(LOGP, OLD_LOGP, ADV, MASK, kind="vanilla")
    np.testing.assert_allclose(float(new), 2 * float(vanilla), rtol=1e-6)


@pytest.mark.parametrize("agg", ["prompt-mean", "prompt-mean-unbiased"])
def test_prompt_mean_modes_are_refused_with_the_way_to_get_them(agg):
    # GVM's M-step needs each sample's prompt: the error names the function that reduces it.
    with pytest.raises(ValueError, match=f"agg '{agg}'.*prompt_mean_terms"):
        policy_loss(LOGP, OLD_LOGP, ADV, MASK, agg=agg)
