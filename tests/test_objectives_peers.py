"""GAE, value loss, REINFORCE++, GSPO, CISPO, Clip-Cov and KL-Cov against loop-based NumPy references,
hand values, finite differences and exact micro-batch accumulation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.train.algorithms import explained_variance

from jaxrl_llm.objectives import (
    ADVANTAGE_ESTIMATORS,
    AGG_MODES,
    LossTerms,
    aggregate_denominator,
    cov_selection,
    gae_advantages,
    policy_loss,
    policy_loss_terms,
    reinforce_pp_advantages,
    token_covariance,
    value_loss,
    value_loss_terms,
)
from jaxrl_llm.run.config import ConfigError, load_config

NEW_KINDS = ("gspo", "gspo_token", "cispo", "clip_cov", "kl_cov")


# ---------------------------------------------------------------- NumPy loop references

def gae_loop(rewards, values, mask, gamma, lam):
    """Per row: the response tokens in order are the time steps; V and A are 0 after the last one."""
    adv, ret = np.zeros(rewards.shape), np.zeros(rewards.shape)
    for b in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[b, t] != 0]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(steps):
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            next_adv = delta + gamma * lam * next_adv
            next_value = values[b, t]
            adv[b, t], ret[b, t] = next_adv, next_adv + values[b, t]
    return adv, ret


def value_loss_loop(values, old, returns, mask, clip):
    """Token-mean clipped value loss and its derivative w.r.t. each value."""
    n = mask.sum()
    loss, grad = 0.0, np.zeros(values.shape)
    for b in range(values.shape[0]):
        for t in range(values.shape[1]):
            if mask[b, t] == 0:
                continue
            v, r = float(values[b, t]), float(returns[b, t])
            vc = min(max(v, old[b, t] - clip), old[b, t] + clip)
            unclipped, clipped = (v - r) ** 2, (vc - r) ** 2
            if clipped > unclipped:
                loss += 0.5 * clipped / n
                inside = old[b, t] - clip < v < old[b, t] + clip
                grad[b, t] = (vc - r) / n if inside else 0.0
            else:
                loss += 0.5 * unclipped / n
                grad[b, t] = (v - r) / n
    return loss, grad


def agg_weights(mask, mode, max_len=None):
    """d aggregate / d x_t for each token (the loops of test_objectives_losses.aggregate_loop)."""
    b_size, t_size = mask.shape
    weight = np.zeros(mask.shape)
    rows = [b for b in range(b_size) if mask[b].sum() > 0]
    for b in range(b_size):
        for t in range(t_size):
            if mode == "token-mean":
                weight[b, t] = mask[b, t] / mask.sum()
            elif mode == "seq-mean-token-mean":
                weight[b, t] = mask[b, t] / mask[b].sum() / len(rows) if b in rows else 0.0
            else:
                scale = max_len if mode == "seq-mean-token-sum-norm" else 1.0
                weight[b, t] = mask[b, t] / scale / b_size
    return weight


def gspo_loop(logp, old, adv, mask, clip_low, clip_high, mode, max_len=None):
    """GSPO's loss and d loss / d logp: one ratio s_i = exp(mean log-ratio) and one A_i per row."""
    weight = agg_weights(mask, mode, max_len)
    loss, grad = 0.0, np.zeros(logp.shape)
    for b in range(logp.shape[0]):
        tokens = [t for t in range(logp.shape[1]) if mask[b, t]]
        if not tokens:
            continue
        s = math.exp(sum(logp[b, t] - old[b, t] for t in tokens) / len(tokens))
        a = float(adv[b])
        unclipped, clipped = -a * s, -a * min(max(s, 1 - clip_low), 1 + clip_high)
        value, slope = (unclipped, -a * s) if unclipped >= clipped else (clipped, 0.0)
        row_weight = sum(weight[b, t] for t in tokens)
        loss += row_weight * value
        for t in tokens:  # d s / d logp_t = s / |y|
            grad[b, t] = row_weight * slope / len(tokens)
    return loss, grad


def covariance_loop(logp, adv, mask):
    tokens = [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    mean_logp = sum(logp[b, t] for b, t in tokens) / len(tokens)
    mean_adv = sum(adv[b] for b, _ in tokens) / len(tokens)
    cov = np.zeros(mask.shape)
    for b, t in tokens:
        cov[b, t] = (logp[b, t] - mean_logp) * (adv[b] - mean_adv)
    return cov, tokens


# ---------------------------------------------------------------- GAE

# Row 0 right-padded, row 1 left-padded (the same response as row 0), row 2 with a hole, row 3 empty.
GAE_REWARDS = np.array([[0.1, -0.2, 1.0, 9.0, 9.0],
                        [9.0, 9.0, 0.1, -0.2, 1.0],
                        [0.0, 0.5, 7.0, 0.0, 2.0],
                        [3.0, 3.0, 3.0, 3.0, 3.0]], np.float32)
GAE_VALUES = np.array([[0.4, 0.3, 0.6, 5.0, 5.0],
                       [5.0, 5.0, 0.4, 0.3, 0.6],
                       [0.2, -0.1, 4.0, 0.7, 0.9],
                       [1.0, 1.0, 1.0, 1.0, 1.0]], np.float32)
GAE_MASK = np.array([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 0, 1, 1], [0, 0, 0, 0, 0]], np.float32)


@pytest.mark.parametrize("gamma", [1.0, 0.95])
@pytest.mark.parametrize("lam", [1.0, 0.95])
def test_gae_matches_loop_reference_on_ragged_masks(gamma, lam):
    adv, ret = gae_advantages(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=gamma, lam=lam)
    ref_adv, ref_ret = gae_loop(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ret), ref_ret, rtol=1e-5, atol=1e-6)
    # Left and right padding of the same response give the same advantages.
    np.testing.assert_allclose(np.asarray(adv)[1, 2:], np.asarray(adv)[0, :3], rtol=1e-6)
    assert np.all(np.asarray(adv)[GAE_MASK == 0] == 0) and np.all(np.asarray(ret)[GAE_MASK == 0] == 0)


def test_gae_hand_values():
    # gamma = lam = 1: A_t = sum_{s >= t} r_s - V_t. Row 0: returns 0.9, 0.8, 1.0.
    adv, ret = gae_advantages(GAE_REWARDS[:1], GAE_VALUES[:1], GAE_MASK[:1])
    np.testing.assert_allclose(np.asarray(adv)[0, :3], [0.9 - 0.4, 0.8 - 0.3, 1.0 - 0.6], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ret)[0, :3], [0.9, 0.8, 1.0], rtol=1e-6)
    # gamma = 0.5, lam = 0: one-step TD errors delta_t = r_t + 0.5 V_{t+1} - V_t, V after the end 0.
    adv, _ = gae_advantages(GAE_REWARDS[:1], GAE_VALUES[:1], GAE_MASK[:1], gamma=0.5, lam=0.0)
    np.testing.assert_allclose(np.asarray(adv)[0, :3], [0.1 + 0.15 - 0.4, -0.2 + 0.3 - 0.3, 1.0 - 0.6], rtol=1e-5)


def test_gae_jits_and_rejects_bad_arguments():
    fn = jax.jit(lambda r, v, m: gae_advantages(r, v, m, gamma=0.95, lam=0.95))
    ref, _ = gae_loop(GAE_REWARDS, GAE_VALUES, GAE_MASK, 0.95, 0.95)
    np.testing.assert_allclose(np.asarray(fn(GAE_REWARDS, GAE_VALUES, GAE_MASK)[0]), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="gamma must be in"):
        gae_advantages(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=1.5)
    with pytest.raises(ValueError, match="mask must have values' shape"):
        gae_advantages(GAE_REWARDS, GAE_VALUES, GAE_MASK[:, :2])


# ---------------------------------------------------------------- value loss

def value_batch(seed):
    rng = np.random.default_rng(seed)
    old = rng.normal(size=(6, 5)).astype(np.float32)
    values = (old + rng.normal(0, 0.4, size=(6, 5))).astype(np.float32)
    returns = rng.normal(size=(6, 5)).astype(np.float32)
    mask = (rng.random((6, 5)) < 0.8).astype(np.float32)
    mask[2] = 0.0
    return values, old, returns, mask


def test_value_loss_hand_values():
    # V moved from 0 to 0.5 with clip 0.2 and target 1: unclipped 0.25, clipped (0.2 - 1)^2 = 0.64 wins.
    # V moved from 0 to -0.5 with target -1: unclipped 0.25, clipped (-0.2 + 1)^2 = 0.64 wins too.
    # V moved from 0 to 0.1 with target 1: inside the clip, 0.81.
    values = np.array([[0.5, -0.5, 0.1]], np.float32)
    returns = np.array([[1.0, 1.0, 1.0]], np.float32) * np.array([[1, -1, 1]], np.float32)
    loss, metrics = value_loss(values, np.zeros_like(values), returns, np.ones_like(values), clip=0.2)
    assert float(loss) == pytest.approx(0.5 * (0.64 + 0.64 + 0.81) / 3, rel=1e-6)
    assert float(metrics["value_clip_fraction"]) == pytest.approx(2 / 3)
    grad = jax.grad(lambda v: value_loss(v, jnp.zeros_like(v), returns, jnp.ones_like(v), clip=0.2)[0])(
        jnp.asarray(values))
    np.testing.assert_allclose(np.asarray(grad), [[0.0, 0.0, (0.1 - 1.0) / 3]], atol=1e-7)
    unclipped, _ = value_loss(values, np.zeros_like(values), returns, np.ones_like(values), clip=None)
    assert float(unclipped) == pytest.approx(0.5 * (0.25 + 0.25 + 0.81) / 3, rel=1e-6)


def test_value_loss_matches_loop_reference():
    values, old, returns, mask = value_batch(0)
    loss, grad = jax.value_and_grad(lambda v: value_loss(v, old, returns, mask, clip=0.2)[0])(jnp.asarray(values))
    ref_loss, ref_grad = value_loss_loop(values, old, returns, mask, 0.2)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-7)


def test_value_loss_explained_variance():
    returns = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    mask = np.ones_like(returns)
    _, perfect = value_loss(returns, returns, returns, mask)
    _, constant = value_loss(np.full_like(returns, 2.5), returns, returns, mask, clip=None)
    _, half = value_loss(returns + np.array([[0.5, -0.5, 0.5, -0.5]], np.float32), returns, returns, mask)
    assert float(perfect["explained_variance"]) == pytest.approx(1.0)
    assert float(constant["explained_variance"]) == pytest.approx(0.0, abs=1e-6)
    assert float(half["explained_variance"]) == pytest.approx(1 - 0.25 / 1.25, rel=1e-5)
    # Returns far from 0 with a small spread (3000 + the values above): E[R^2] - E[R]^2 in float32 loses the
    # variance of 1.25 to rounding; the centred form keeps the same 0.8 as the float64 reference.
    offset = returns + 3000.0
    _, shifted = value_loss(offset + np.array([[0.5, -0.5, 0.5, -0.5]], np.float32), offset, offset, mask)
    reference = explained_variance(offset.astype(np.float64), offset + np.array([[0.5, -0.5, 0.5, -0.5]]), mask)
    assert reference == pytest.approx(0.8) and float(shifted["explained_variance"]) == pytest.approx(0.8, abs=1e-3)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_micro_batches_are_exact(mode):
    values, old, returns, mask = value_batch(1)
    full, full_grad = jax.value_and_grad(lambda v: value_loss(v, old, returns, mask, agg=mode, max_len=5)[0])(
        jnp.asarray(values))
    total, grads = LossTerms(jnp.float32(0), jnp.float32(0)), []
    for lo, hi in [(0, 2), (2, 3), (3, 6)]:
        grad, terms = jax.grad(lambda v: (lambda t: (t.total, t))(value_loss_terms(
            v, old[lo:hi], returns[lo:hi], mask[lo:hi], agg=mode, max_len=5)[0]), has_aux=True)(
            jnp.asarray(values[lo:hi]))
        total = jax.tree.map(jnp.add, total, terms)
        grads.append(np.asarray(grad))
    assert float(total.value()) == pytest.approx(float(full), rel=1e-6)
    np.testing.assert_allclose(np.concatenate(grads) / float(total.denom), np.asarray(full_grad), rtol=1e-5,
                               atol=1e-7)


# ---------------------------------------------------------------- REINFORCE++

def test_reinforce_pp_hand_values():
    rewards = np.array([1.0, 0.0, 1.0, 1.0], np.float32)
    # Batch mean 0.75, population std sqrt(0.1875) = 0.4330.
    std = math.sqrt(0.1875)
    np.testing.assert_allclose(np.asarray(reinforce_pp_advantages(rewards)),
                               np.array([0.25, -0.75, 0.25, 0.25]) / (std + 1e-6), rtol=1e-6)
    # Groups {0, 1} and {2, 3}: centred 0.5, -0.5, 0, 0; batch std sqrt(0.5 / 4); A = +-1.4142, 0, 0.
    grouped = reinforce_pp_advantages(rewards, np.array([0, 0, 1, 1]), num_groups=2)
    np.testing.assert_allclose(np.asarray(grouped), np.array([0.5, -0.5, 0.0, 0.0]) / (math.sqrt(0.125) + 1e-6),
                               rtol=1e-6)


def test_reinforce_pp_registry_and_padding_rows():
    rewards = np.array([1.0, 0.0, 1.0, 1.0, 7.0], np.float32)
    ids = np.array([0, 0, 1, 1, -1], np.int32)  # the last row is padding: in no statistic, advantage 0
    plain = np.asarray(ADVANTAGE_ESTIMATORS["reinforce_pp"](rewards, ids, num_groups=2))
    np.testing.assert_allclose(plain, np.append(np.asarray(reinforce_pp_advantages(rewards[:4])), 0.0), rtol=1e-6)
    baseline = np.asarray(jax.jit(lambda r, g: ADVANTAGE_ESTIMATORS["reinforce_pp_baseline"](r, g, num_groups=2))(
        rewards, ids))
    np.testing.assert_allclose(baseline[:4], [1.4142083, -1.4142083, 0.0, 0.0], rtol=1e-5)
    assert baseline[4] == 0.0
    with pytest.raises(ValueError, match="rewards must have shape"):
        reinforce_pp_advantages(np.ones((2, 2)))


# ---------------------------------------------------------------- GSPO

def policy_batch(seed, rows=8, steps=6):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-1.5, 0.5, size=(rows, steps)).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, size=(rows, steps))).astype(np.float32)
    mask = (rng.random((rows, steps)) < 0.75).astype(np.float32)
    if rows > 3:
        mask[3] = 0.0  # an empty row
    adv = rng.normal(size=(rows,)).astype(np.float32)
    return logp, old, adv, mask


def test_gspo_sequence_ratio_hand_value():
    # Log-ratios 0.2 and -0.1 on the two tokens of row 0: s = exp(0.05); row 1's third token is padding.
    old = np.zeros((2, 3), np.float32)
    logp = np.array([[0.2, -0.1, 50.0], [0.3, 0.1, -80.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 0]], np.float32)
    adv = np.array([1.0, -1.0], np.float32)
    loss, metrics = policy_loss(logp, old, adv, mask, kind="gspo", clip_low=0.1, clip_high=0.1,
                                agg="seq-mean-token-mean")
    # Row 0: s = exp(0.05) inside [0.9, 1.1], l = -s. Row 1: s = exp(0.2) > 1.1 but A < 0, so the
    # unclipped branch -A s is the larger: l = +s.
    assert float(loss) == pytest.approx((-math.exp(0.05) + math.exp(0.2)) / 2, rel=1e-6)
    assert float(metrics["ratio_max"]) == pytest.approx(math.exp(0.2), rel=1e-6)
    assert float(metrics["clip_fraction"]) == 0.0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gspo_loss_and_gradient_match_loop_reference(mode):
    logp, old, adv, mask = policy_batch(0)
    kwargs = dict(kind="gspo", clip_low=0.05, clip_high=0.08, agg=mode, max_len=6)
    loss, grad = jax.value_and_grad(lambda lp: policy_loss(lp, old, adv, mask, **kwargs)[0])(jnp.asarray(logp))
    ref_loss, ref_grad = gspo_loop(logp, old, adv, mask, 0.05, 0.08, mode, max_len=6)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-7)
    # Some sequences are clipped (zero gradient) and some are not, so both branches are checked.
    row_grad = np.abs(ref_grad).sum(axis=1)
    assert np.any(row_grad[mask.sum(1) > 0] == 0) and np.any(row_grad > 0)


def test_gspo_gradient_matches_finite_differences():
    logp, old, adv, mask = policy_batch(1, rows=3, steps=4)
    fn = lambda lp: policy_loss(lp, old, adv, mask, kind="gspo", clip_low=0.5, clip_high=0.5)[0]  # noqa: E731
    grad = np.asarray(jax.grad(fn)(jnp.asarray(logp)))
    eps = 1e-2
    for b in range(3):
        for t in range(4):
            up, down = logp.copy(), logp.copy()
            up[b, t] += eps
            down[b, t] -= eps
            numeric = (float(fn(jnp.asarray(up))) - float(fn(jnp.asarray(down)))) / (2 * eps)
            assert grad[b, t] == pytest.approx(numeric, rel=2e-2, abs=2e-4), (b, t)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gspo_token_equals_gspo_for_sequence_advantages(mode):
    logp, old, adv, mask = policy_batch(2)
    token_adv = np.broadcast_to(adv[:, None], mask.shape) * mask  # the trainer's per-token layout
    kwargs = dict(clip_low=0.05, clip_high=0.08, agg=mode, max_len=6)
    seq_loss, seq_grad = jax.value_and_grad(
        lambda lp: policy_loss(lp, old, adv, mask, kind="gspo", **kwargs)[0])(jnp.asarray(logp))
    tok_loss, tok_grad = jax.value_and_grad(
        lambda lp: policy_loss(lp, old, token_adv, mask, kind="gspo_token", **kwargs)[0])(jnp.asarray(logp))
    assert float(tok_loss) == pytest.approx(float(seq_loss), rel=1e-6)
    np.testing.assert_allclose(np.asarray(tok_grad), np.asarray(seq_grad), rtol=1e-5, atol=1e-7)
    # A per-token advantage that varies along the sequence is where the two differ.
    varying = token_adv * np.linspace(0.5, 1.5, mask.shape[1], dtype=np.float32)
    other = jax.grad(lambda lp: policy_loss(lp, old, varying, mask, kind="gspo_token", **kwargs)[0])(
        jnp.asarray(logp))
    assert not np.allclose(np.asarray(other), np.asarray(seq_grad), atol=1e-6)


# ---------------------------------------------------------------- CISPO

def test_cispo_keeps_the_gradient_of_clipped_tokens():
    # Ratios 1.5 (above 1 + 0.2), 0.5 (below 1 - 0.2) and 1.1; A = +1 on row 0, -2 on row 1.
    old = np.zeros((2, 3), np.float32)
    logp = np.log(np.array([[1.5, 0.5, 1.1], [1.5, 0.5, 1.1]], np.float32))
    mask = np.ones_like(old)
    adv = np.array([1.0, -2.0], np.float32)
    clip = dict(clip_low=0.2, clip_high=0.2)
    grad = np.asarray(jax.grad(lambda lp: policy_loss(lp, old, adv, mask, kind="cispo", **clip)[0])(
        jnp.asarray(logp)))
    weights = np.array([1.2, 0.8, 1.1])  # clip(r, 0.8, 1.2), detached
    np.testing.assert_allclose(grad, -adv[:, None] * weights[None, :] / 6, rtol=1e-6)
    ppo = np.asarray(jax.grad(lambda lp: policy_loss(lp, old, adv, mask, kind="clip", **clip)[0])(
        jnp.asarray(logp)))
    assert ppo[0, 0] == 0.0 and ppo[1, 1] == 0.0  # the PPO clip drops these two tokens' gradient
    assert grad[0, 0] != 0.0 and grad[1, 1] != 0.0  # CISPO keeps them
    _, metrics = policy_loss(logp, old, adv, mask, kind="cispo", **clip)
    assert float(metrics["clip_fraction"]) == pytest.approx(4 / 6)
    # clip_low = 1: no floor (weight = r); accepted only for cispo.
    free = np.asarray(jax.grad(lambda lp: policy_loss(lp, old, adv, mask, kind="cispo", clip_low=1.0,
                                                      clip_high=0.2)[0])(jnp.asarray(logp)))
    assert free[1, 1] == pytest.approx(2.0 * 0.5 / 6, rel=1e-6)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(logp, old, adv, mask, kind="clip", clip_low=1.0)


# ---------------------------------------------------------------- Clip-Cov and KL-Cov

def cov_batch(seed):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-1.0, 1.5, size=(6, 8)).astype(np.float32)
    old = (logp + rng.normal(0, 0.05, size=logp.shape)).astype(np.float32)
    mask = (rng.random(logp.shape) < 0.8).astype(np.float32)
    adv = rng.normal(0, 2.0, size=(6,)).astype(np.float32)
    return logp, old, adv, mask


def test_token_covariance_matches_loop():
    logp, _, adv, mask = cov_batch(0)
    ref, _ = covariance_loop(logp, adv, mask)
    np.testing.assert_allclose(np.asarray(token_covariance(logp, adv, mask)), ref, rtol=1e-5, atol=1e-6)


def test_kl_cov_selects_the_top_tokens_by_covariance():
    logp, old, adv, mask = cov_batch(1)
    cov, tokens = covariance_loop(logp, adv, mask)
    k = max(int(0.1 * len(tokens)), 1)
    ranked = sorted(tokens, key=lambda bt: -cov[bt])
    expected = np.zeros(mask.shape, bool)
    for b, t in ranked[:k]:
        expected[b, t] = True
    got = np.asarray(cov_selection(logp, old, adv, mask, kind="kl_cov", cov_fraction=0.1))
    np.testing.assert_array_equal(got, expected)
    assert got.sum() == k == 4  # floor(0.1 x 42 tokens)


def test_clip_cov_draws_in_the_window_for_a_fixed_rng():
    logp, old, adv, mask = cov_batch(2)
    rng = jax.random.PRNGKey(7)
    cov, tokens = covariance_loop(logp, adv, mask)
    lo, hi, fraction = 0.3, 4.0, 0.1
    eligible = [(b, t) for b, t in tokens if lo < cov[b, t] < hi
                and not (adv[b] > 0 and math.exp(logp[b, t] - old[b, t]) > 1.2)
                and not (adv[b] < 0 and math.exp(logp[b, t] - old[b, t]) < 0.8)]
    k = max(int(fraction * len(tokens)), 1)
    assert len(eligible) > k  # a real draw: more candidates than picks
    keys = np.asarray(jax.random.uniform(rng, mask.shape))  # the draw: the k candidates of smallest key
    expected = np.zeros(mask.shape, bool)
    for b, t in sorted(eligible, key=lambda bt: keys[bt])[:k]:
        expected[b, t] = True
    kwargs = dict(kind="clip_cov", cov_fraction=fraction, cov_low=lo, cov_high=hi)
    got = np.asarray(cov_selection(logp, old, adv, mask, rng=rng, **kwargs))
    np.testing.assert_array_equal(got, expected)
    other = np.asarray(cov_selection(logp, old, adv, mask, rng=jax.random.PRNGKey(8), **kwargs))
    assert other.sum() == k and not np.array_equal(other, got)
    with pytest.raises(ValueError, match="pass rng"):
        cov_selection(logp, old, adv, mask, kind="clip_cov")


def test_clip_cov_and_kl_cov_gradients_on_selected_tokens():
    logp, old, adv, mask = cov_batch(3)
    selected = np.zeros(mask.shape, bool)
    selected[np.nonzero(mask)[0][:3], np.nonzero(mask)[1][:3]] = True
    grad = lambda kind, sel: np.asarray(jax.grad(lambda lp: policy_loss(  # noqa: E731
        lp, old, adv, mask, kind=kind, cov_selected=sel, kl_cov_coef=2.0)[0])(jnp.asarray(logp)))
    none = np.zeros(mask.shape, bool)
    clip_grad = grad("clip", None)
    np.testing.assert_allclose(grad("clip_cov", none), clip_grad, rtol=1e-6)
    clip_cov = grad("clip_cov", selected)
    assert np.all(clip_cov[selected] == 0) and np.any(clip_grad[selected] != 0)
    np.testing.assert_allclose(clip_cov[~selected], clip_grad[~selected], rtol=1e-6)
    # KL-Cov: -A r everywhere (no clipping), plus coef * (logp - old) on the selected tokens; token-mean.
    ratio = np.exp(logp - old)
    expected = (-adv[:, None] * ratio + np.where(selected, 2.0 * (logp - old), 0.0)) * mask / mask.sum()
    np.testing.assert_allclose(grad("kl_cov", selected), expected, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- micro-batches

@pytest.mark.parametrize("kind", NEW_KINDS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_accumulation_is_exact_for_new_kinds(kind, mode):
    logp, old, adv, mask = policy_batch(4)
    kwargs = dict(kind=kind, agg=mode, max_len=6, clip_low=0.1, clip_high=0.15, cov_fraction=0.1, cov_low=-5.0,
                  cov_high=5.0, kl_cov_coef=0.5)
    if kind in ("clip_cov", "kl_cov"):  # the selection is made once over the full batch
        kwargs["cov_selected"] = np.asarray(cov_selection(logp, old, adv, mask, kind=kind, rng=jax.random.PRNGKey(0),
                                                          cov_fraction=0.1, cov_low=-5.0, cov_high=5.0,
                                                          clip_low=0.1, clip_high=0.15))
        assert kwargs["cov_selected"].sum() > 0
    full, full_grad = jax.value_and_grad(lambda lp: policy_loss(lp, old, adv, mask, **kwargs)[0])(jnp.asarray(logp))
    denom = aggregate_denominator(mask, mode)
    losses, grads, total = [], [], LossTerms(jnp.float32(0), jnp.float32(0))
    for lo, hi in [(0, 3), (3, 5), (5, 8)]:
        part = dict(kwargs)
        if "cov_selected" in part:
            part["cov_selected"] = kwargs["cov_selected"][lo:hi]
        value, grad = jax.value_and_grad(lambda lp: policy_loss(lp, old[lo:hi], adv[lo:hi], mask[lo:hi],
                                                                denom=denom, **part)[0])(jnp.asarray(logp[lo:hi]))
        terms, _ = policy_loss_terms(logp[lo:hi], old[lo:hi], adv[lo:hi], mask[lo:hi], **part)
        losses.append(float(value))
        grads.append(np.asarray(grad))
        total = jax.tree.map(jnp.add, total, terms)
    assert sum(losses) == pytest.approx(float(full), rel=1e-5, abs=1e-6)
    assert float(total.value()) == pytest.approx(float(full), rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(np.concatenate(grads), np.asarray(full_grad), rtol=1e-5, atol=1e-6)


def test_new_kinds_jit():
    logp, old, adv, mask = policy_batch(5)
    for kind in NEW_KINDS:
        fn = jax.jit(lambda lp, rng, kind=kind: policy_loss(lp, old, adv, mask, kind=kind, rng=rng,
                                                            cov_fraction=0.1, cov_low=-5.0)[0])
        eager = policy_loss(logp, old, adv, mask, kind=kind, rng=jax.random.PRNGKey(1), cov_fraction=0.1, cov_low=-5.0)
        assert float(fn(jnp.asarray(logp), jax.random.PRNGKey(1))) == pytest.approx(float(eager[0]), rel=1e-6)


# ---------------------------------------------------------------- configuration

def test_config_accepts_the_new_algorithms_and_rejects_bad_values():
    cfg = load_config(None, ["algorithm.loss=cispo", "algorithm.clip_low=1.0", "algorithm.advantage=reinforce_pp"])
    assert (cfg.algorithm.loss, cfg.algorithm.clip_low, cfg.algorithm.advantage) == ("cispo", 1.0, "reinforce_pp")
    with pytest.raises(ConfigError, match=r"'algorithm.clip_low' must be in \[0, 1\)"):
        load_config(None, ["algorithm.loss=gspo", "algorithm.clip_low=1.0"])
    with pytest.raises(ConfigError, match=r"'algorithm.cov_fraction' must be in \(0, 1\]"):
        load_config(None, ["algorithm.loss=clip_cov", "algorithm.cov_fraction=0"])
    with pytest.raises(ConfigError, match=r"'algorithm.cov_high' must be > algorithm.cov_low"):
        load_config(None, ["algorithm.cov_low=5", "algorithm.cov_high=1"])
    with pytest.raises(ConfigError, match=r"'algorithm.loss' must be one of"):
        load_config(None, ["algorithm.loss=ppo_critic"])


# ---------------------------------------------------------------- the train step

@pytest.mark.parametrize("kind", ["gspo", "cispo", "clip_cov", "kl_cov"])
def test_train_step_micro_batches_equal_one_batch(kind):
    """The trainer's update is the same with 4 micro-batches as with one: Clip-Cov / KL-Cov select their
    tokens over the whole mini-batch before the micro-batch scan."""
    from jaxrl_llm import models
    from jaxrl_llm.train.packing import pack_groups
    import optax

    from jaxrl_llm.run.state import init_state
    from jaxrl_llm.train.step import cov_tokens, make_train_step

    tiny = models.ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                              num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    cfg = load_config(None, [f"algorithm.loss={kind}", "algorithm.cov_fraction=0.05", "algorithm.cov_low=-10"])
    rng = np.random.default_rng(0)
    groups, per_group, resp = 4, 3, 5
    rows = groups * per_group
    prompts = [rng.integers(1, 61, size=4).tolist() for _ in range(groups)]
    responses = rng.integers(1, 61, size=(rows, resp)).astype(np.int32)
    lengths = rng.integers(2, resp + 1, size=rows)
    members = [np.arange(g * per_group, (g + 1) * per_group) for g in range(groups)]
    adv = np.repeat(rng.normal(size=(rows, 1)), resp, axis=1).astype(np.float32)
    old = rng.normal(-4.0, 1.0, size=(rows, resp)).astype(np.float32)
    batch = jax.tree_util.tree_map(jnp.asarray, pack_groups(prompts, members, responses, lengths, advantages=adv,
                                                            old_logp=old))
    selected = cov_tokens(cfg.algorithm, batch, jax.random.PRNGKey(0))
    assert kind not in ("clip_cov", "kl_cov") or int(selected.sum()) >= 1
    denom = aggregate_denominator(batch.mask.reshape(-1, resp), cfg.algorithm.agg)
    params = models.init_params(tiny, jax.random.PRNGKey(0))
    opt = optax.sgd(1.0)  # the update is the gradient itself (Adam's first step would be its sign)
    results = []
    for micro in (4, 1):
        step = make_train_step(tiny, cfg.algorithm, opt, micro_batch_size=micro)
        state, metrics = step(init_state(jax.tree_util.tree_map(jnp.copy, params), opt), batch, denom)  # donated
        results.append((state.params, metrics))
    (one, m_one), (many, m_many) = results
    assert float(m_one["loss"]) == pytest.approx(float(m_many["loss"]), rel=1e-5, abs=1e-7)
    jax.tree_util.tree_map(lambda a, b, p: np.testing.assert_allclose(np.asarray(p - a), np.asarray(p - b),
                                                                      rtol=1e-4, atol=1e-7), one, many, params)
    assert float(m_one["finite"]) == 1.0
    first_leaf = lambda tree: np.asarray(jax.tree_util.tree_leaves(tree)[0])  # noqa: E731
    assert not np.allclose(first_leaf(one), first_leaf(params))


def test_mixed_group_flags_is_the_host_form_of_mixed_groups():
    from jaxrl_llm.objectives import mixed_groups
    from jaxrl_llm.train.algorithms import mixed_group_flags

    rewards, ids = np.array([1.0, 0.0, 1.0, 1.0]), np.array([0, 0, 1, 1])
    flags = mixed_group_flags(rewards, ids, num_groups=3)  # group 0 differs, 1 agrees, 2 is empty
    assert isinstance(flags, np.ndarray) and flags.tolist() == [True, False, False]
    assert flags.tolist() == np.asarray(mixed_groups(rewards, ids, num_groups=3)).tolist()
    assert mixed_group_flags(np.zeros(0), np.zeros(0, np.int32), num_groups=2).tolist() == [False, False]
