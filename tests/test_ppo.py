"""PPO with a critic: the value pass against ValueModel, the critic's update against an autodiff reference on
unpacked rows, micro-batching, the host-side token rewards / whitening / GAE against loops, the preset, config
errors, and a bitwise resume of policy and critic."""

import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from packed_groups import random_groups

from jaxrl_llm import models
from jaxrl_llm.models.flax_modules import ValueModel
from jaxrl_llm.run.config import CriticSection
from jaxrl_llm.run.state import init_state
from jaxrl_llm.train import ConfigError, load_config
from jaxrl_llm.train.algorithms import explained_variance, gae_token_advantages, token_rewards, whiten
from jaxrl_llm.train.critic import critic_trunk, make_critic_step, response_values, value_params
from jaxrl_llm.train.packing import pack_groups, unpack

ROOT = pathlib.Path(__file__).resolve().parents[1]
UNTIED = models.ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=8, tie_word_embeddings=False)


def _samples(seed=0):
    return random_groups(UNTIED.vocab_size, seed=seed)[:5]


def _critic_params(seed=0):
    """Value parameters on a random untied policy, with a random head (so the trunk gets gradients)."""
    policy = models.init_params(UNTIED, jax.random.PRNGKey(seed))
    params = value_params(policy, UNTIED)
    assert "lm_head" in policy and "lm_head" not in params["trunk"]
    params["value_head"]["kernel"] = 0.3 * jax.random.normal(jax.random.PRNGKey(seed + 1), (UNTIED.hidden_size, 1))
    params["value_head"]["bias"] = jnp.array([0.1])
    return params


def _unpacked_rows(prompts, members, responses, lengths):
    """Every sample as its own row prompt + response, right-padded, and where the state before each of its
    response tokens sits: len(prompt) - 1 + r (gather indices [N, R], clipped into the row off the response)."""
    n, resp = responses.shape
    width = max(len(p) for p in prompts) + resp
    tokens, index = np.zeros((n, width), np.int32), np.zeros((n, resp), np.int32)
    for prompt, group in zip(prompts, members):
        for i in group:
            row = prompt + responses[i, :lengths[i]].tolist()
            tokens[i, :len(row)] = row
            index[i] = np.minimum(len(prompt) - 1 + np.arange(resp), width - 1)
    return tokens, index


def _reference_values(params, tokens, index):
    """ValueModel.apply on the unpacked rows (causal: right padding does not reach earlier positions), read at
    each response token's state."""
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    values = ValueModel(UNTIED).apply({"params": params}, tokens, positions)
    return jnp.take_along_axis(values, index, axis=1)


def test_value_pass_equals_value_model_apply_on_unpacked_rows():
    params = _critic_params()
    prompts, members, responses, lengths, mask = _samples()
    members[2] = members[2][:1]  # groups of different sizes
    mask[np.setdiff1d(np.arange(mask.shape[0]), np.concatenate(members))] = 0  # samples left out of the batch
    batch = pack_groups(prompts, members, responses, lengths, row_multiple=4, seq_multiple=8)
    got = unpack(np.asarray(response_values(params, UNTIED, batch)), members, responses.shape[0]) * mask
    want = np.asarray(_reference_values(params, *_unpacked_rows(prompts, members, responses, lengths))) * mask
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert np.abs(got).max() > 0.05  # a random head gives values far from zero


def test_value_pass_reads_generated_tokens_only_when_rows_are_shorter_than_their_slots():
    """Responses that stop well before R: the packed row is shorter than its S x R slots, so the value pass reads
    the generated tokens' states only (the policy's compact layout). Values and gradients equal the slot
    layout's and ValueModel's on unpacked rows; slots past a response's end hold 0."""
    params = _critic_params(seed=5)
    prompts, members, responses, _, _, _ = random_groups(UNTIED.vocab_size, groups=2, per_group=4, resp=16, seed=7)
    lengths = np.array([1, 3, 2, 16, 4, 1, 2, 5])  # one response reaches R, the others stop early
    mask = (np.arange(16)[None] < lengths[:, None]).astype(np.float32)
    batch = pack_groups(prompts, members, responses, lengths, row_multiple=2, seq_multiple=8)
    rows, slots, resp_len = batch.pred_index.shape
    assert batch.tokens.shape[1] < slots * resp_len
    packed_mask = np.asarray(batch.mask)
    # Compiled, as a run's pass is (op by op, every primitive would compile apart).
    compact = np.asarray(jax.jit(lambda p: response_values(p, UNTIED, batch))(params))
    slot = np.asarray(jax.jit(lambda p: response_values(p, UNTIED, batch, compact=False))(params))
    np.testing.assert_allclose(compact * packed_mask, slot * packed_mask, atol=1e-6)
    assert np.all(compact[packed_mask == 0] == 0) and np.abs(slot[packed_mask == 0]).max() > 0.05
    got = unpack(compact, members, len(lengths)) * mask
    want = np.asarray(_reference_values(params, *_unpacked_rows(prompts, members, responses, lengths))) * mask
    np.testing.assert_allclose(got, want, atol=2e-5)

    weights = jnp.asarray(np.random.default_rng(8).normal(size=packed_mask.shape), jnp.float32) * packed_mask

    def grads(layout):
        return jax.jit(jax.grad(lambda p: jnp.sum(weights * response_values(p, UNTIED, batch, compact=layout))))(params)

    for got_g, want_g in zip(jax.tree_util.tree_leaves(grads(True)), jax.tree_util.tree_leaves(grads(False))):
        np.testing.assert_allclose(got_g, want_g, atol=1e-5)


def _critic_batch(params, seed=0):
    prompts, members, responses, lengths, mask = _samples(seed)
    rng = np.random.default_rng(seed + 10)
    probe = pack_groups(prompts, members, responses, lengths, row_multiple=4)
    values = unpack(np.asarray(response_values(params, UNTIED, probe)), members, responses.shape[0])
    # Old values off the current ones by up to +-0.4, so the 0.2 clip binds on some tokens and not on others.
    old_values = (values + rng.uniform(-0.4, 0.4, values.shape)).astype(np.float32) * mask
    returns = rng.choice([0.0, 1.0], size=values.shape).astype(np.float32) * mask
    batch = pack_groups(prompts, members, responses, lengths, old_values=old_values, returns=returns,
                        row_multiple=4)
    return jax.tree_util.tree_map(jnp.asarray, batch), (prompts, members, responses, lengths, mask, old_values,
                                                        returns)


def _reference_loss(params, tokens, index, mask, old_values, returns, clip):
    """The clipped value loss written out per token over unpacked rows, / the number of response tokens."""
    v = _reference_values(params, tokens, index)
    clipped = old_values + jnp.clip(v - old_values, -clip, clip)
    per_token = 0.5 * jnp.maximum((v - returns) ** 2, (clipped - returns) ** 2)
    return jnp.sum(jnp.where(mask > 0, per_token, 0.0)) / mask.sum()


def test_critic_update_equals_an_autodiff_reference_and_micro_batches_agree():
    params = _critic_params(seed=3)
    batch, host = _critic_batch(params)
    mask, old_values = host[4], host[5]
    clip, lr = 0.2, 0.5
    denom = jnp.float32(mask.sum())
    prompts, members, responses, lengths, _, _, returns = host
    tokens, index = _unpacked_rows(prompts, members, responses, lengths)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(_reference_loss))(params, tokens, index, mask, old_values,
                                                                      returns, clip)
    want = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, ref_grads)
    results = []
    for micro in (1, 4):  # 4 micro-batches of a row (a scan), one of 4 rows; plain SGD: the change is the gradient
        step = make_critic_step(UNTIED, CriticSection(value_clip=clip), optax.sgd(lr), micro_batch_size=micro)
        state, metrics = step(init_state(jax.tree_util.tree_map(jnp.copy, params), optax.sgd(lr)), batch, denom)
        np.testing.assert_allclose(float(metrics["value_loss"]), float(ref_loss), rtol=1e-5)
        assert float(metrics["value_finite"]) == 1.0 and int(state.step) == 1
        results.append((state, metrics))
        for path, got in jax.tree_util.tree_leaves_with_path(state.params):
            ref = dict(jax.tree_util.tree_leaves_with_path(want))[path]
            np.testing.assert_allclose(got, ref, atol=2e-6, err_msg=jax.tree_util.keystr(path))
    # The clip binds on some tokens only: the fraction is strictly between 0 and 1, the same for every split.
    values = unpack(np.asarray(response_values(params, UNTIED, batch)), host[1], mask.shape[0])
    moved = (np.abs(values - old_values) > clip) & (mask > 0)
    assert 0 < moved.sum() < mask.sum()
    fractions = [float(m["value_clip_fraction"]) for _, m in results]
    np.testing.assert_allclose(fractions, fractions[0], rtol=1e-6)
    assert 0 < fractions[0] < 1
    # The head and the trunk both moved.
    for key in ("value_head", "trunk"):
        delta = jax.tree_util.tree_map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(),
                                       results[0][0].params[key], params[key])
        assert max(jax.tree_util.tree_leaves(delta)) > 0, key


def test_token_rewards_by_hand():
    mask = np.array([[1, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]], np.float32)  # right, left padded, empty
    kl = np.array([[0.1, 0.2, 0.3, 9.0], [9.0, 0.5, -0.5, 9.0], [9.0, 9.0, 9.0, 9.0]], np.float32)
    rewards = np.array([1.0, 0.0, 1.0], np.float32)
    np.testing.assert_allclose(token_rewards(rewards, mask), [[0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_allclose(token_rewards(rewards, mask, kl, 0.5),
                               [[-0.05, -0.1, 1 - 0.15, 0], [0, -0.25, 0.25, 0], [0, 0, 0, 0]], rtol=1e-6)


def test_whiten_matches_a_loop():
    rng = np.random.default_rng(0)
    values = rng.normal(size=(3, 5)).astype(np.float32)
    mask = (rng.random((3, 5)) < 0.7).astype(np.float32)
    picked = [float(values[i, j]) for i in range(3) for j in range(5) if mask[i, j]]
    mean = sum(picked) / len(picked)
    var = sum((x - mean) ** 2 for x in picked) / (len(picked) - 1)
    got = whiten(values, mask)
    for i in range(3):
        for j in range(5):
            want = (values[i, j] - mean) / np.sqrt(var + 1e-8) if mask[i, j] else 0.0
            assert abs(got[i, j] - want) < 1e-5


def _gae_loop(rewards, values, mask, gamma, lam):
    adv = np.zeros(rewards.shape)
    for b in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[b, t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(steps):
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            next_adv = delta + gamma * lam * next_adv
            next_value = values[b, t]
            adv[b, t] = next_adv
    return adv, (adv + values) * mask


@pytest.mark.parametrize("gamma, lam, whitened", [(1.0, 1.0, False), (1.0, 0.95, True), (0.9, 0.5, False)])
def test_gae_token_advantages_with_a_kl_reward_match_a_loop(gamma, lam, whitened):
    rng = np.random.default_rng(1)
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 1, 1, 1, 1]], np.float32)
    values = rng.normal(size=mask.shape).astype(np.float32) * mask
    old_logp = -rng.random(mask.shape).astype(np.float32)
    ref_logp = -rng.random(mask.shape).astype(np.float32)
    rewards = np.array([1.0, 0.0, 1.0], np.float32)
    cfg = load_config(None, ["algorithm.advantage=gae", "algorithm.kl_reward_coef=0.2", "algorithm.kl_kind=k1",
                             f"algorithm.gamma={gamma}", f"algorithm.lam={lam}",
                             f"algorithm.whiten_advantages={whitened}"])
    adv, ret = gae_token_advantages(cfg.algorithm, rewards, values, mask, old_logp, ref_logp)
    token_r = np.zeros(mask.shape)
    for b in range(3):
        last = max(t for t in range(5) if mask[b, t])
        for t in range(5):
            if mask[b, t]:
                token_r[b, t] = -0.2 * (old_logp[b, t] - ref_logp[b, t]) + (rewards[b] if t == last else 0.0)
    want_adv, want_ret = _gae_loop(token_r, values, mask, gamma, lam)
    np.testing.assert_allclose(ret, want_ret, atol=1e-5)
    if whitened:
        picked = want_adv[mask > 0]
        want_adv = (want_adv - picked.mean()) / np.sqrt(picked.var(ddof=1) + 1e-8) * mask
    np.testing.assert_allclose(adv, want_adv, atol=1e-5)


def test_explained_variance_by_hand():
    returns = np.array([[1.0, 0.0, 1.0, 0.0, 7.0]], np.float32)
    mask = np.array([[1, 1, 1, 1, 0]], np.float32)  # the last token is not a response token
    assert explained_variance(returns, np.array([[1.0, 0.0, 1.0, 0.0, -3.0]]), mask) == pytest.approx(1.0)
    assert explained_variance(returns, np.full((1, 5), 0.5), mask) == pytest.approx(0.0, abs=1e-6)
    # residuals +-0.25: Var 0.0625 against Var(R) 0.25
    assert explained_variance(returns, np.array([[0.75, 0.25, 0.75, 0.25, 0.0]]), mask) == pytest.approx(0.75)
    assert explained_variance(np.ones((1, 5)), np.zeros((1, 5)), mask) == 0.0  # Var(R) = 0


def test_ppo_preset_critic_update_lowers_its_value_loss():
    cfg = load_config(ROOT / "configs" / "ppo.yaml", ["critic.lr=1e-4"])
    assert cfg.algorithm.advantage == "gae" and cfg.algorithm.gamma == 1.0 and cfg.algorithm.lam == 1.0
    from jaxrl_llm.train.critic import critic_optimizer

    params = _critic_params(seed=5)
    batch, _ = _critic_batch(params, seed=5)
    opt = critic_optimizer(cfg.critic, cfg.optim)
    step = make_critic_step(UNTIED, cfg.critic, opt, micro_batch_size=2)
    denom = jnp.float32(batch.mask.sum())
    state, first = step(init_state(params, opt), batch, denom)
    _, second = step(state, batch, denom)
    assert float(second["value_loss"]) < float(first["value_loss"])


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.kl_reward_coef=0.1"], "'algorithm.kl_reward_coef' needs algorithm.advantage=gae"),
    (["algorithm.advantage=gae", "sampling.allocation=gvm"], "'sampling.allocation' gvm cannot be combined"),
    (["algorithm.advantage=gae", "algorithm.prl_eta=0.1"], "'algorithm.prl_eta' cannot be combined"),
    (["algorithm.gamma=1.5"], "'algorithm.gamma' must be in \\[0, 1\\]"),
    (["critic.lr=0"], "'critic.lr' must be > 0"),
    (["critic.value_clip=0"], "'critic.value_clip' must be > 0"),
    (["critic.source="], "'critic.source' must be 'policy'"),
    (["critic.valueclip=0.2"], "unknown config key 'critic.valueclip'.*did you mean 'critic.value_clip'"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_critic_source_errors_name_the_key(tmp_path):
    policy = models.init_params(UNTIED, jax.random.PRNGKey(0))
    config, trunk, head = critic_trunk(CriticSection(), UNTIED, policy, param_dtype="float32")
    assert config is UNTIED and trunk is policy and head is None
    with pytest.raises(ConfigError, match="'critic.source'='nowhere.bin' is neither 'policy'"):
        critic_trunk(CriticSection(source="nowhere.bin"), UNTIED, policy, param_dtype="float32")
    other = UNTIED.replace(vocab_size=70)
    with pytest.raises(ConfigError, match="its vocabulary has 70 tokens, the policy's 61"):
        critic_trunk(CriticSection(source=str(tmp_path)), UNTIED, policy, param_dtype="float32",
                     load=lambda source: (other, None, None))
    bigger = UNTIED.replace(hidden_size=48, remat=True)
    config, params, head = critic_trunk(CriticSection(source=str(tmp_path)), UNTIED, "weights",
                                        param_dtype="bfloat16", load=lambda source: (bigger, "its weights", None))
    assert params == "its weights" and head is None and config.hidden_size == 48 and config.param_dtype == "bfloat16"
    assert config.remat == UNTIED.remat  # runtime keys follow the policy's


def test_resume_with_or_without_critic_names_the_key(tmp_path):
    from jaxrl_llm.run.resume import check_state_layout

    saved = load_config(None, ["algorithm.advantage=gae"]).to_dict()
    with pytest.raises(ValueError, match="algorithm.advantage: checkpoint 'gae', this run 'grpo'"):
        check_state_layout(load_config(None, []), saved, tmp_path)
    check_state_layout(load_config(None, ["algorithm.advantage=gae", "critic.lr=1e-3"]), saved, tmp_path)


def test_critic_export_is_a_transformers_token_classifier_and_loads_back(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    params = _critic_params(3)
    folder = models.save_hf_value(tmp_path / "critic", UNTIED, params)
    assert models.is_hf_value_model(folder) and not models.is_hf_value_model(tmp_path)
    tokens = np.array([[5, 17, 3, 40, 22, 9, 1]], np.int32)
    positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
    ours = ValueModel(UNTIED).apply({"params": params}, jnp.asarray(tokens), jnp.asarray(positions))
    reference = transformers.AutoModelForTokenClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(torch.from_numpy(tokens.astype(np.int64))).logits[..., 0].numpy()
    assert type(reference).__name__ == "LlamaForTokenClassification"
    np.testing.assert_allclose(np.asarray(ours).reshape(theirs.shape), theirs, atol=2e-5)
    config, loaded = models.load_hf_value(folder)
    for path, value in jax.tree_util.tree_leaves_with_path(params):  # bitwise round trip, head included
        np.testing.assert_array_equal(np.asarray(value), np.asarray(
            functools.reduce(lambda tree, key: tree[key.key], path, loaded)), err_msg=jax.tree_util.keystr(path))
    # critic.source = the folder: its trunk and its trained head, not a zero head.
    _, trunk, head = critic_trunk(CriticSection(source=str(folder)), UNTIED, None, param_dtype="float32")
    np.testing.assert_array_equal(np.asarray(head["kernel"]), np.asarray(params["value_head"]["kernel"]))
    assert "lm_head" not in trunk and config.tie_word_embeddings is False
    with pytest.raises(ValueError, match="not a one-label token classifier"):
        models.load_hf_value(models.save_hf(tmp_path / "policy", UNTIED, models.init_params(UNTIED, jax.random.PRNGKey(0))))


def _saved_states(out_dir, step):
    manager = ocp.CheckpointManager(pathlib.Path(out_dir).absolute() / "checkpoints")
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    manager.close()
    return restored["state"]


@pytest.mark.slow
def test_ppo_resume_is_bitwise_equal_to_uninterrupted(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from loop_runner import TINY_RUN, tiny_policy

    from jaxrl_llm.train.loop import train

    run = TINY_RUN + ["algorithm.advantage=gae", "algorithm.kl_reward_coef=0.05", "optim.mini_batches=2",
                      "optim.micro_batch_size=2", "critic.lr=1e-3", "train.eval_problems=2", "train.save_every=0"]

    def config(out, steps):
        return load_config(None, run + [f"train.out_dir={out}", f"train.steps={steps}"])

    straight, broken = tmp_path / "straight", tmp_path / "broken"
    train(config(straight, 3), policy=tiny_policy(), log=lambda *a: None)
    train(config(broken, 2), policy=tiny_policy(), log=lambda *a: None)
    train(config(broken, 3), resume=True, policy=tiny_policy(), log=lambda *a: None)
    want, got = _saved_states(straight, 3), _saved_states(broken, 3)
    assert set(want) == {"policy", "critic"}
    flat_want = jax.tree_util.tree_leaves_with_path(want)
    flat_got = dict(jax.tree_util.tree_leaves_with_path(got))
    assert len(flat_want) == len(flat_got)
    for path, value in flat_want:  # parameters, Adam moments and step counters of both models
        np.testing.assert_array_equal(flat_got[path], value, err_msg=jax.tree_util.keystr(path))
    assert int(want["critic"]["step"]) == 6  # 3 steps x 2 mini-batches
    assert np.abs(want["critic"]["params"]["value_head"]["kernel"]).max() > 0  # the critic trained
    # Every step logs the critic's explained variance, its loss and gradient norm.
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "accuracy" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert {"explained_variance", "value_loss", "value_grad_norm", "value_clip_fraction"} <= set(row)
        assert row["explained_variance"] <= 1.0
    assert rows[-1]["value_grad_norm"] > 0
    # The trained critic is exported beside the policy, and reads back equal to the last checkpoint's.
    _, exported = models.load_hf_value(straight / "final_critic")
    np.testing.assert_array_equal(np.asarray(exported["value_head"]["kernel"]),
                                  np.asarray(want["critic"]["params"]["value_head"]["kernel"]))
