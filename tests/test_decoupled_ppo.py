"""The decoupled PPO objective (`objectives.decoupled_ppo_loss`, issue 43 part 4): against a NumPy transcription of
its formula, its gradient by hand, and the trainer's way of running it (rollout_correction token / mask folded into
the advantages, the old log-probs being the proximal policy's)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives
from jaxrl_llm.run.config import AlgorithmSection
from jaxrl_llm.train.algorithms import rollout_weights


def _batch(seed=0, b=4, t=7):
    rng = np.random.default_rng(seed)
    proximal = np.log(rng.uniform(0.05, 0.95, (b, t))).astype(np.float32)
    behavior = (proximal + rng.normal(0.0, 0.6, (b, t))).astype(np.float32)  # a stale policy: ratios 0.2 .. 5
    logp = (proximal + rng.normal(0.0, 0.3, (b, t))).astype(np.float32)  # the policy being trained
    advantages = rng.normal(0.0, 1.0, b).astype(np.float32)
    mask = (np.arange(t)[None, :] < rng.integers(2, t + 1, b)[:, None]).astype(np.float32)
    return logp, proximal, behavior, advantages, mask


def _reference(logp, proximal, behavior, advantages, mask, eps_low=0.2, eps_high=0.28, cap=None):
    """The formula written out in NumPy (float64): tokens whose behaviour weight exceeds the cap are dropped from
    the numerator, never from the token count."""
    logp, proximal, behavior = (x.astype(np.float64) for x in (logp, proximal, behavior))
    a = np.broadcast_to(advantages[:, None].astype(np.float64), logp.shape)
    w = np.exp(proximal - behavior)
    keep = mask.astype(bool) & (w <= (np.inf if cap is None else cap))
    w = np.where(keep, w, 0.0)
    u = np.exp(logp - proximal)
    unclipped, clipped = -a * u, -a * np.clip(u, 1 - eps_low, 1 + eps_high)
    per_token = w * np.maximum(unclipped, clipped)
    loss = (per_token * mask).sum() / mask.sum()
    # d l_t / d logp_t = w_t (-A_t u_t) where the unclipped term is the larger (or the ratio is inside the band)
    inside = (u >= 1 - eps_low) & (u <= 1 + eps_high)
    grad = np.where(inside | (unclipped > clipped), w * unclipped, 0.0) * mask / mask.sum()
    return loss, grad


@pytest.mark.parametrize("cap", [None, 1.5, 3.0])
def test_loss_and_gradient_equal_the_formula(cap):
    logp, proximal, behavior, advantages, mask = _batch()
    loss_fn = lambda lp: objectives.decoupled_ppo_loss(lp, proximal, behavior, advantages, mask, clip_low=0.2,  # noqa: E731
                                                       clip_high=0.28, weight_cap=cap)[0]
    want_loss, want_grad = _reference(logp, proximal, behavior, advantages, mask, cap=cap)
    np.testing.assert_allclose(float(loss_fn(jnp.asarray(logp))), want_loss, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(loss_fn)(jnp.asarray(logp))), want_grad, rtol=2e-5, atol=1e-7)
    _, metrics = objectives.decoupled_ppo_loss(logp, proximal, behavior, advantages, mask, weight_cap=cap)
    w = np.exp(proximal.astype(np.float64) - behavior)[mask != 0]
    capped = 0.0 if cap is None else float((w > cap).mean())
    assert float(metrics["capped_fraction"]) == pytest.approx(capped)
    assert float(metrics["behavior_kl"]) == pytest.approx(float(np.mean(w - np.log(w) - 1)), rel=1e-4)  # k3 of exp(d) - d - 1


def test_a_behaviour_equal_to_the_proximal_policy_is_plain_ppo():
    logp, proximal, _, advantages, mask = _batch(seed=1)
    got, _ = objectives.decoupled_ppo_loss(logp, proximal, proximal, advantages, mask, weight_cap=2.0)
    want, _ = objectives.policy_loss(logp, proximal, advantages, mask, kind="clip")
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)


def test_the_trainers_folded_weights_give_the_same_loss_and_gradient():
    """The loop runs it as rollout_correction token / mask / high = cap, weights folded into the advantages."""
    logp, proximal, behavior, advantages, mask = _batch(seed=2)
    algo = AlgorithmSection(rollout_correction="token", rollout_correction_mode="mask", rollout_correction_high=2.5)
    weights, metrics = rollout_weights(algo, proximal, behavior, mask)
    token_advantages = np.broadcast_to(advantages[:, None], logp.shape) * weights

    def folded(lp):
        return objectives.policy_loss(lp, proximal, token_advantages, mask, kind="clip", clip_low=0.2,
                                      clip_high=0.2)[0]

    def direct(lp):
        return objectives.decoupled_ppo_loss(lp, proximal, behavior, advantages, mask, weight_cap=2.5)[0]

    x = jnp.asarray(logp)
    np.testing.assert_allclose(float(folded(x)), float(direct(x)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(folded)(x)), np.asarray(jax.grad(direct)(x)), rtol=1e-5, atol=1e-8)
    assert metrics["rollout_corrected_fraction"] > 0  # the cap left some tokens out


def test_a_cap_below_one_is_refused():
    logp, proximal, behavior, advantages, mask = _batch()
    with pytest.raises(ValueError, match="weight_cap must be >= 1"):
        objectives.decoupled_ppo_loss(logp, proximal, behavior, advantages, mask, weight_cap=0.5)
