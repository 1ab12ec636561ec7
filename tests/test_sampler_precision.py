"""sampling.dtype: the sampler's own precision (a bf16 or int8 copy of the policy) while the trainer keeps its own.

The values: "" is today's sampler on today's program (the same tree, bitwise the same rollouts); bfloat16 moves
the sampler's log-probs of its own tokens off the trainer's f32 ones by a nonzero amount within bf16's rounding;
int8 by per-channel rounding of the projections; under LoRA with an int8 base and B = 0 the int8 sampler is the
trainer's own base (a gap of f32 rounding only)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import quant
from jaxrl_llm.ondevice.fused import check_fused_config
from jaxrl_llm.run.config import ConfigError
from jaxrl_llm.run.setup import sampler_weights, setup_run
from jaxrl_llm.train import load_config
from jaxrl_llm.train.loop import token_logprobs
from jaxrl_llm.train.rollouts import sample_and_score

SMALL = ["train.eval_problems=0", "sampling.prompts_per_step=2", "sampling.samples_per_prompt=4",
         "sampling.max_new_tokens=6", "optim.micro_batch_size=2"]


def _scored_stub(self, texts, golds, lengths):  # the verifier does not matter here
    return np.zeros(len(texts), bool), np.zeros(len(texts), np.float32)


@pytest.fixture
def make_run(tmp_path, monkeypatch):
    from loop_runner import tiny_policy
    from jaxrl_llm.train import rollouts
    monkeypatch.setattr(rollouts.RewardScorer, "__call__", _scored_stub)
    runs = []

    def make(*overrides):
        run = setup_run(load_config(None, SMALL + [f"train.out_dir={tmp_path / str(len(runs))}", *overrides]),
                        policy=tiny_policy())
        run.first_prompts = next(run.data)[:2]  # every draw of a test samples the same prompts
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.close()


def _draw(run, params=None, config=None):
    """One rollout batch of the run's first two training prompts, sampled as collect_rollouts does, and the
    trainer's f32 teacher-forced log-probs of its tokens."""
    records = run.first_prompts
    params = run.sampler_params() if params is None else params
    scored = sample_and_score(params, config or run.sampler_model_config, run.tokenizer, records, 4,
                              run.config.sampling, run.scorer, jax.random.PRNGKey(3))
    return scored, token_logprobs(run, run.policy_params(), scored)


def test_config_key_and_its_errors():
    assert load_config(None, []).sampling.dtype == ""  # the trainer's precision by default
    for value in ("bfloat16", "int8"):
        assert load_config(None, [f"sampling.dtype={value}"]).sampling.dtype == value
    with pytest.raises(ConfigError, match=r"config key 'sampling.dtype' must be one of \['', 'bfloat16', 'int8'\], "
                                          r"got 'float16'"):
        load_config(None, ["sampling.dtype=float16"])
    with pytest.raises(ConfigError, match=r"'sampling.dtype'='int8' .* one device only"):
        load_config(None, ["sampling.dtype=int8", "train.mesh=data=1,fsdp=1,tensor=1"])
    load_config(None, ["sampling.dtype=bfloat16", "train.mesh=data=1,fsdp=1,tensor=1"])  # bf16 is fine on a mesh
    with pytest.raises(ValueError, match=r"sampling\.dtype"):  # the fused loop samples from the trainer's params
        check_fused_config(load_config(None, ["sampling.dtype=bfloat16"]))


def test_sampler_weights_by_hand():
    policy = {"embed": jnp.array([[0.1, -0.3]], jnp.float32),
              "layers": {"q_proj": jnp.array([[[1.0, -0.5], [0.25, 2.0]]], jnp.float32),
                         "input_norm": jnp.array([[1.0, 1.0 + 2 ** -10]], jnp.float32)}}
    assert sampler_weights(policy, "") is policy
    bf16 = sampler_weights(policy, "bfloat16")
    assert {x.dtype for x in jax.tree_util.tree_leaves(bf16)} == {jnp.dtype(jnp.bfloat16)}
    assert float(bf16["layers"]["input_norm"][0, 1]) == 1.0  # 1 + 2^-10 rounds to 1 on bf16's 8-bit significand
    int8 = sampler_weights(policy, "int8")
    # per output column: scale = max |W| / 127 = (1 / 127, 2 / 127); codes = round(W / scale)
    np.testing.assert_array_equal(np.asarray(int8["layers"]["q_proj"]), [[[127, -32], [32, 127]]])
    np.testing.assert_allclose(np.asarray(int8["layers"]["q_proj_scale"]), [[[1 / 127, 2 / 127]]], rtol=1e-7)
    assert int8["embed"] is policy["embed"] or np.array_equal(int8["embed"], policy["embed"])  # embeddings kept
    assert int8["layers"]["input_norm"].dtype == jnp.float32
    with pytest.raises(ValueError, match="sampling.dtype"):
        sampler_weights(policy, "float16")


def test_default_is_todays_sampler_bitwise(make_run):
    run = make_run()
    assert run.sampler_params() is run.state.params and run.sampler_model_config is run.model_config
    today, _ = _draw(run, run.policy_params(), run.model_config)
    now, _ = _draw(run)
    np.testing.assert_array_equal(now.tokens, today.tokens)
    np.testing.assert_array_equal(now.logprobs, today.logprobs)


def _gap(scored, train_logp):
    on = scored.mask != 0
    return np.abs(train_logp[on].astype(np.float64) - scored.logprobs[on])


def test_bfloat16_sampler_is_off_the_trainer_by_bf16_rounding(make_run):
    f32 = make_run()
    floor = _gap(*_draw(f32))
    run = make_run("sampling.dtype=bfloat16")
    config = run.sampler_model_config
    assert (config.param_dtype, config.compute_dtype) == ("bfloat16", "bfloat16")
    assert run.model_config.compute_dtype == "float32"  # the trainer's own is untouched
    assert {x.dtype for x in jax.tree_util.tree_leaves(run.sampler_params())} == {jnp.dtype(jnp.bfloat16)}
    gap = _gap(*_draw(run))
    assert floor.max() < 1e-5  # one f32 policy, two programs: rounding only
    # bf16 keeps 8 significant bits (a relative step of 2^-8): the log-probs of the tiny model (logits of size ~1)
    # move by a fraction of that per token, far above the f32 floor and far below a wrong model's O(1).
    assert gap.mean() > 100 * max(floor.mean(), 1e-9)
    assert gap.max() < 4 * 2.0 ** -8


def test_int8_sampler_is_off_by_the_projections_rounding(make_run):
    run = make_run("sampling.dtype=int8")
    params = run.sampler_params()
    assert params["layers"]["q_proj"].dtype == jnp.int8 and params["embed"].dtype == jnp.float32
    assert run.sampler_model_config is run.model_config  # f32 activations
    gap = _gap(*_draw(run))
    assert 1e-5 < gap.mean() and gap.max() < 0.1


def test_int8_sampler_of_an_int8_lora_base_is_the_trainers_own_base(make_run):
    """With B = 0 the merged policy is the dequantized int8 base: quantizing it again gives back its codes, so the
    int8 sampler reads the trainer's own weights (lora.base_dtype int8 alone makes no gap)."""
    run = make_run("sampling.dtype=int8", "lora.rank=4", "lora.base_dtype=int8")
    params = run.sampler_params()
    for name in ("q_proj", "down_proj"):
        np.testing.assert_array_equal(np.asarray(params["layers"][name]), np.asarray(run.base_params["layers"][name]))
        np.testing.assert_allclose(np.asarray(params["layers"][name + quant.SCALE_SUFFIX]),
                                   np.asarray(run.base_params["layers"][name + quant.SCALE_SUFFIX]), rtol=1e-6)
    assert _gap(*_draw(run)).max() < 1e-5


def test_the_loop_samples_with_the_sampler_copy_and_keeps_f32_elsewhere(tmp_path, monkeypatch):
    from loop_runner import tiny_policy
    from jaxrl_llm.train import loop, rollouts
    monkeypatch.setattr(rollouts.RewardScorer, "__call__", _scored_stub)
    seen = []
    real = loop.sample_and_score

    def spy(params, model_config, *args, **kwargs):
        seen.append((str(jax.tree_util.tree_leaves(params)[0].dtype), model_config.compute_dtype))
        return real(params, model_config, *args, **kwargs)

    monkeypatch.setattr(loop, "sample_and_score", spy)
    config = load_config(None, SMALL + ["train.steps=1", f"train.out_dir={tmp_path}", "sampling.dtype=bfloat16",
                                        "algorithm.old_logp=recompute"])
    summary = loop.train(config, policy=tiny_policy(), log=lambda *a: None)
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["status"] == "done" and seen == [("bfloat16", "bfloat16")]
    assert row["rollout_mismatch_kl"] > 0.0  # the trainer's f32 log-probs against the bf16 sampler's


def test_gvm_samples_with_the_sampler_copy_and_takes_gradients_of_the_policy(make_run, monkeypatch):
    from jaxrl_llm.train import gvm
    run = make_run("sampling.dtype=bfloat16", "sampling.allocation=gvm", "sampling.gvm_stage1_samples=2",
                   "sampling.gvm_samples_per_prompt=2")
    sampled, normed = [], []
    real_sample, real_norms = gvm.sample_and_score, gvm.prompt_grad_norm_sums
    monkeypatch.setattr(gvm, "sample_and_score", lambda params, mc, *a, **k: (
        sampled.append(mc.compute_dtype), real_sample(params, mc, *a, **k))[1])
    monkeypatch.setattr(gvm, "prompt_grad_norm_sums", lambda params, mc, *a, **k: (
        normed.append((str(params["embed"].dtype), mc.compute_dtype)), real_norms(params, mc, *a, **k))[1])
    policy = run.policy_params()
    gvm.gvm_rollouts(policy, run.model_config, run.tokenizer, run.first_prompts, run.config.sampling, run.scorer,
                     jax.random.PRNGKey(0), rows_per_chunk=2,
                     sampler=(run.sampler_params(policy), run.sampler_model_config))
    assert sampled and set(sampled) == {"bfloat16"}
    assert normed == [("float32", "float32")]
