"""Sampler/trainer mismatch correction: every level and mode against a NumPy reference, hand values, no gradient
through the weights, empty rows, the weighted policy loss (by hand, with weights of 1, folded into the advantages as
the trainer does, over micro-batches), the config keys and one loop step that logs the metrics."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.objectives import (
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTION_MODES,
    policy_loss,
    policy_loss_terms,
    rollout_correction,
)
from jaxrl_llm.ondevice.fused import check_fused_config
from jaxrl_llm.run.config import ConfigError, load_config
from jaxrl_llm.train.algorithms import rollout_weights

LOG = math.log
# d = train - sampler per token. Row 0: ratios 1, 3, 1.5 and 0.25 (one padding slot holding -inf);
# row 1: no response token (garbage values); row 2: ratios 0.8, 1.25, 1.1, 0.5 (product 0.55, mean log-ratio
# -0.149); row 3: a summed log-ratio of 45 (the sequence ratio is clamped at exp(20)).
SAMPLER = np.array([[-1.0, -2.0, -0.5, -3.0, -np.inf],
                    [5.0, -7.0, 0.0, 1.0, 2.0],
                    [-0.7, -1.2, -2.0, -0.1, 0.0],
                    [-30.0, -30.0, -30.0, -0.2, 0.0]], np.float32)
DIFF = np.array([[0.0, LOG(3.0), LOG(1.5), LOG(0.25), 0.0],
                 [90.0, -80.0, 3.0, 0.0, 1.0],
                 [LOG(0.8), LOG(1.25), LOG(1.1), LOG(0.5), 0.0],
                 [15.0, 15.0, 15.0, 0.0, 0.0]], np.float32)
TRAIN = (SAMPLER + DIFF).astype(np.float32)
MASK = np.array([[1, 1, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], np.float32)
BAND = dict(low=0.3, high=2.0)


def numpy_weights(train, sampler, mask, level, mode, low, high):
    """Loop reference in float64: (weights, corrected) of objectives.rollout_correction."""
    weights, corrected = np.zeros(mask.shape), np.zeros(mask.shape, bool)
    for b in range(mask.shape[0]):
        on = [t for t in range(mask.shape[1]) if mask[b, t] != 0]
        d = {t: float(train[b, t]) - float(sampler[b, t]) for t in on}
        for t in on:
            if level == "token":
                log_r = d[t]
            elif level == "sequence":
                log_r = sum(d.values())
            else:
                log_r = sum(d.values()) / len(on)
            r = math.exp(min(max(log_r, -20.0), 20.0))
            inside = low <= r <= high
            if mode == "truncate":
                weights[b, t], corrected[b, t] = min(r, high), r > high
            elif mode == "mask":
                weights[b, t], corrected[b, t] = (r if inside else 0.0), not inside
            else:
                weights[b, t], corrected[b, t] = float(inside), not inside
    return weights, corrected


@pytest.mark.parametrize("mode", ROLLOUT_CORRECTION_MODES)
@pytest.mark.parametrize("level", ROLLOUT_CORRECTION_LEVELS)
def test_weights_and_metrics_equal_numpy_reference(level, mode):
    weights, metrics = rollout_correction(TRAIN, SAMPLER, MASK, level=level, mode=mode, **BAND)
    ref, corrected = numpy_weights(TRAIN, SAMPLER, MASK, level, mode, **BAND)
    np.testing.assert_allclose(np.asarray(weights), ref, rtol=1e-6, atol=0)
    assert np.all(np.asarray(weights)[MASK == 0] == 0.0)  # 0 off the mask, the empty row included
    on = MASK != 0
    np.testing.assert_allclose(float(metrics["corrected_fraction"]), corrected[on].mean(), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["weight_mean"]), ref[on].mean(), rtol=1e-6)
    assert all(np.isfinite(float(v)) for v in metrics.values())


def test_hand_values():
    # Row 0 by hand: ratios 1, 3, 1.5, 0.25 per token; the product 1.125 and its geometric mean 1.125 ** (1/4).
    row = lambda level, mode: [round(float(x), 5) for x in  # noqa: E731
                               rollout_correction(TRAIN, SAMPLER, MASK, level=level, mode=mode, **BAND)[0][0, :4]]
    assert row("token", "truncate") == [1.0, 2.0, 1.5, 0.25]
    assert row("token", "mask") == [1.0, 0.0, 1.5, 0.0]
    assert row("token", "reject") == [1.0, 0.0, 1.0, 0.0]
    assert row("sequence", "truncate") == [1.125] * 4
    assert row("geometric", "mask") == [round(1.125 ** 0.25, 5)] * 4
    # Row 3: a summed log-ratio of 45 is clamped to 20 before exp: a finite ratio above every band.
    seq = rollout_correction(TRAIN, SAMPLER, MASK, level="sequence", mode="mask", **BAND)
    assert float(seq[1]["ratio_max"]) == pytest.approx(math.exp(20.0), rel=1e-6)
    assert np.all(np.asarray(seq[0])[3] == 0.0)


def test_metrics_by_hand():
    _, metrics = rollout_correction(TRAIN, SAMPLER, MASK, level="token", mode="truncate", **BAND)
    on = MASK != 0
    d = TRAIN.astype(np.float64)[on] - SAMPLER[on]
    # k3 of the sampler against the trainer: r - 1 - log r, clamped to 10 as kl_penalty's k3 (row 3's exp(15)).
    np.testing.assert_allclose(float(metrics["mismatch_kl"]), np.minimum(np.exp(d) - d - 1, 10.0).mean(), rtol=1e-6)
    ratios = np.exp(d)
    assert float(metrics["ratio_max"]) == pytest.approx(ratios.max(), rel=1e-6)
    assert float(metrics["ratio_min"]) == pytest.approx(ratios.min(), rel=1e-6)
    assert float(metrics["corrected_fraction"]) == pytest.approx((ratios > 2.0).mean())  # 3, and row 3's exp(15)
    # No token at all: weight 0, a zero gap, ratio 1, nothing NaN.
    weights, empty = rollout_correction(TRAIN, SAMPLER, np.zeros_like(MASK), level="geometric", mode="mask")
    assert np.all(np.asarray(weights) == 0.0)
    assert {k: float(v) for k, v in empty.items()} == {"mismatch_kl": 0.0, "corrected_fraction": 0.0,
                                                      "weight_mean": 0.0, "ratio_mean": 1.0, "ratio_min": 1.0,
                                                      "ratio_max": 1.0}


@pytest.mark.parametrize("level", ROLLOUT_CORRECTION_LEVELS)
def test_no_gradient_flows_through_the_weights(level):
    def total(train, sampler):
        return jnp.sum(rollout_correction(train, sampler, MASK, level=level, mode="mask", **BAND)[0])

    grads = jax.grad(total, argnums=(0, 1))(jnp.asarray(TRAIN), jnp.asarray(SAMPLER))
    assert all(np.all(np.asarray(g) == 0.0) for g in grads)


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="level must be one of"):
        rollout_correction(TRAIN, SAMPLER, MASK, level="row")
    with pytest.raises(ValueError, match="mode must be one of"):
        rollout_correction(TRAIN, SAMPLER, MASK, mode="clip")
    with pytest.raises(ValueError, match="sampler_logp must have train_logp's shape"):
        rollout_correction(TRAIN, SAMPLER[:, :3], MASK)
    with pytest.raises(ValueError, match="0 <= low <= 1 <= high"):
        rollout_correction(TRAIN, SAMPLER, MASK, high=0.9)
    with pytest.raises(ValueError, match="weights must have logp's shape"):
        policy_loss(TRAIN, SAMPLER, np.ones(4, np.float32), MASK, weights=np.ones((4, 3), np.float32))


# ---- the weighted policy loss -------------------------------------------------------------------------------------

# The policy's current log-probs against the (trainer's) old ones, per-token advantages of both signs.
OLD = TRAIN
LOGP = (OLD + np.array([[0.1, -0.3, 0.25, 0.05, 0.0], [0.0] * 5, [-0.4, 0.02, 0.3, -0.1, 0.0],
                        [0.05, 0.1, -0.05, 0.2, 0.0]], np.float32)).astype(np.float32)
ADV = np.array([[1.0, 1.0, 1.0, 1.0, 0.0], [2.0] * 5, [-0.5, -0.5, -0.5, -0.5, 0.0], [0.7] * 5], np.float32)
HOMOGENEOUS = [("clip", {}), ("clip", {"dual_clip": 1.5}), ("vanilla", {}), ("gspo", {}), ("gspo_token", {}),
               ("cispo", {"clip_low": 1.0})]


def _clean(x):  # padding slots of the fixtures hold -inf / garbage; the losses read only the mask
    return np.where(MASK != 0, x, 0.0).astype(np.float32)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_weights_of_one_leave_the_loss_unchanged(agg):
    # Eager (op by op): multiplying by 1.0 is exact and the reduction that follows is the same op, so the values
    # are bitwise equal; under jit two different programs could round differently.
    args = (_clean(LOGP), _clean(OLD), ADV, MASK)
    plain, plain_metrics = policy_loss(*args, agg=agg)
    ones, ones_metrics = policy_loss(*args, agg=agg, weights=np.ones_like(MASK))
    assert float(ones) == float(plain)
    assert {k: float(v) for k, v in ones_metrics.items()} == {k: float(v) for k, v in plain_metrics.items()}


def test_weighted_loss_equals_hand_weighted_loss():
    weights = np.asarray(rollout_correction(TRAIN, SAMPLER, MASK, level="token", mode="truncate", **BAND)[0])
    loss, _ = policy_loss(_clean(LOGP), _clean(OLD), ADV, MASK, clip_low=0.2, clip_high=0.2, weights=weights)
    r = np.exp(_clean(LOGP).astype(np.float64) - _clean(OLD))
    per_token = np.maximum(-ADV * r, -ADV * np.clip(r, 0.8, 1.2))
    expected = (per_token * weights * MASK).sum() / MASK.sum()
    assert float(loss) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("kind,options", HOMOGENEOUS, ids=[f"{k}{'-' + '-'.join(o) if o else ''}"
                                                           for k, o in HOMOGENEOUS])
def test_weights_folded_into_advantages_equal_weighted_loss(kind, options):
    # The trainer multiplies the advantages by the weights on the host (train.algorithms.rollout_weights).
    weights = np.asarray(rollout_correction(TRAIN, SAMPLER, MASK, level="token", mode="mask", **BAND)[0])
    logp, old = jnp.asarray(_clean(LOGP)), jnp.asarray(_clean(OLD))

    def weighted(lp):
        return policy_loss(lp, old, ADV, MASK, kind=kind, weights=weights, **options)[0]

    def folded(lp):
        return policy_loss(lp, old, ADV * weights, MASK, kind=kind, **options)[0]

    np.testing.assert_allclose(float(folded(logp)), float(weighted(logp)), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(jax.grad(folded)(logp)), np.asarray(jax.grad(weighted)(logp)),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_weighted_loss_over_two_micro_batches_equals_one(agg):
    weights = np.asarray(rollout_correction(TRAIN, SAMPLER, MASK, level="sequence", mode="truncate", **BAND)[0])
    logp, old = jnp.asarray(_clean(LOGP)), jnp.asarray(_clean(OLD))

    def terms(lp, rows):
        return policy_loss_terms(lp[rows], old[rows], ADV[rows], MASK[rows], agg=agg, weights=weights[rows])[0]

    def whole(lp):
        t = terms(lp, slice(None))
        return t.total / t.denom

    def split(lp):  # rows {0, 2} and {1, 3}: the empty row in the second micro-batch
        a, b = terms(lp, np.array([0, 2])), terms(lp, np.array([1, 3]))
        return (a.total + b.total) / (a.denom + b.denom)

    np.testing.assert_allclose(float(split(logp)), float(whole(logp)), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(jax.grad(split)(logp)), np.asarray(jax.grad(whole)(logp)),
                               rtol=1e-6, atol=1e-7)


# ---- config and trainer ---------------------------------------------------------------------------------------------

def test_config_keys_and_their_errors():
    algo = load_config(None, ["algorithm.rollout_correction=sequence", "algorithm.rollout_correction_mode=mask",
                              "algorithm.rollout_correction_low=0.5", "algorithm.rollout_correction_high=4"]).algorithm
    assert (algo.rollout_correction, algo.rollout_correction_mode, algo.rollout_correction_low,
            algo.rollout_correction_high) == ("sequence", "mask", 0.5, 4.0)
    assert load_config(None, []).algorithm.rollout_correction == ""  # off by default
    bad = [(["algorithm.rollout_correction=row"], "algorithm.rollout_correction' must be one of"),
           (["algorithm.rollout_correction_mode=clip"], "rollout_correction_mode' must be one of"),
           (["algorithm.rollout_correction_low=1.5"], "rollout_correction_low' must be in"),
           (["algorithm.rollout_correction_high=0.5"], "rollout_correction_high' must be >= 1"),
           (["algorithm.rollout_correction=token", "algorithm.old_logp=sampler"], "old_logp' cannot be 'sampler'"),
           (["algorithm.rollout_correction=token", "algorithm.loss=kl_cov"], "loss' cannot be clip_cov or kl_cov")]
    for overrides, message in bad:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)
    with pytest.raises(ValueError, match=r"algorithm\.rollout_correction"):  # not on the fused path yet
        check_fused_config(load_config(None, ["algorithm.rollout_correction=token"]))


def test_rollout_weights_of_the_trainer():
    off = load_config(None, []).algorithm
    weights, metrics = rollout_weights(off, _clean(TRAIN), _clean(SAMPLER), MASK)
    assert weights is None and list(metrics) == ["rollout_mismatch_kl"]  # the gap is measured even when off
    on = load_config(None, ["algorithm.rollout_correction=geometric", "algorithm.rollout_correction_mode=reject",
                            "algorithm.rollout_correction_low=0.3"]).algorithm
    weights, metrics = rollout_weights(on, _clean(TRAIN), _clean(SAMPLER), MASK)
    ref, corrected = numpy_weights(TRAIN, SAMPLER, MASK, "geometric", "reject", low=0.3, high=2.0)
    np.testing.assert_array_equal(weights, ref.astype(np.float32))
    assert metrics["rollout_corrected_fraction"] == pytest.approx(corrected[MASK != 0].mean())
    assert set(metrics) == {"rollout_mismatch_kl", "rollout_corrected_fraction", "rollout_weight_mean",
                            "rollout_ratio_min", "rollout_ratio_max"}


def test_loop_step_logs_the_gap_and_the_correction(tmp_path, monkeypatch):
    from loop_runner import tiny_policy
    from jaxrl_llm.train import loop, rollouts
    def stub_scorer(self, texts, golds, lengths):  # mixed verdicts, so the advantages are not all 0
        correct = np.array([len(t) % 2 == 0 for t in texts], bool)
        return correct, correct.astype(np.float32)

    monkeypatch.setattr(rollouts.RewardScorer, "__call__", stub_scorer)
    config = load_config(None, [
        "train.steps=1", "train.eval_problems=0", "sampling.prompts_per_step=2", "sampling.samples_per_prompt=4",
        "sampling.max_new_tokens=6", "optim.micro_batch_size=2", f"train.out_dir={tmp_path}",
        "algorithm.rollout_correction=token", "algorithm.rollout_correction_mode=mask",
        "algorithm.rollout_correction_low=0.5"])
    summary = loop.train(config, policy=tiny_policy(), log=lambda *a: None)
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["status"] == "done" and row["updates"] == 1
    # The sampler and the trainer run the same f32 policy on one CPU: a gap of rounding only, nothing corrected.
    assert 0.0 <= row["rollout_mismatch_kl"] < 1e-6
    assert row["rollout_corrected_fraction"] == 0.0
    assert row["rollout_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert row["rollout_ratio_min"] <= 1.0 + 1e-4 and row["rollout_ratio_max"] >= 1.0 - 1e-4
