"""The train step, the log-prob pass, the RL loop, PPO with its critic and GVM's allocation (per-sample gradient norms, n_i,
the update) on a simulated 8-device CPU mesh (data=2, fsdp=2, tensor=2) give the single-device results.
The checks run in a subprocess (this file run as a script) because the device count is fixed when JAX
starts."""

import json
import pathlib
import sys
import tempfile

import numpy as np
import pytest
from simulated_mesh import run_on_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]
MESH = "data=2,fsdp=2,tensor=2"


def _child(mode: str) -> dict:
    return run_on_devices([__file__, mode])


def test_sharded_step_equals_single_device():
    r = _child("step")
    # Adam's moments after two updates pin both gradients (mu = 0.1 g1 after the first); the parameters
    # carry float noise amplified by Adam's g / sqrt(v) (a flipped sign would move one by 2 lr = 2e-2).
    assert r["adam_moment_rel_diff"] < 1e-4, r
    assert r["adam_param_diff"] < 1e-4, r
    for name in ("loss", "policy_loss", "kl", "entropy", "clip_fraction", "grad_norm"):
        assert r["metric_rel_diff"][name] < 1e-5, (name, r)
    assert r["metrics"]["clip_fraction"] > 0 and r["metrics"]["kl"] > 0, r  # every loss term is live
    assert r["logprob_diff"] < 1e-5 and r["logprob_replicated"], r
    assert r["compact"] and r["compact_logprob_diff"] < 1e-5, r  # the step's batch is scored compactly
    # Parameters and Adam moments sharded by the model's rules; counters and the step replicated.
    assert r["specs"]["params/layers/q_proj"] == "P(None, 'fsdp', 'tensor')", r
    assert r["specs"]["params/embed"] == "P('tensor', 'fsdp')", r
    assert r["specs"]["mu/layers/q_proj"] == r["specs"]["params/layers/q_proj"], r
    assert r["specs"]["nu/lm_head"] == "P('fsdp', 'tensor')", r
    assert r["specs"]["count"] == "P()" and r["specs"]["step"] == "P()", r
    assert r["donated"] and r["compiles"] == 1, r
    assert r["bad_micro_error"] and "micro_batch_size" in r["bad_micro_error"], r
    assert r["cov_live"], r  # Clip-Cov detached some tokens: its gradient differs from plain clipping
    for name, diff in r["cov_rel_diff"].items():
        assert diff < 1e-5, (name, r)


def test_train_loop_on_mesh_equals_single_device():
    r = _child("loop")
    single, sharded = r["single"], r["mesh"]
    assert len(single["rows"]) == len(sharded["rows"]) == 3
    for a, b in zip(single["rows"], sharded["rows"]):
        # Rewards and lengths exactly: the sharded sampler is another program, and its rounding may move a draw to a
        # neighbouring token of the random policy's ~flat distribution (see _gvm_checks), which changes no verdict
        # on random text and no length unless the new token is a stop token (a few in 49k).
        for key in ("reward", "accuracy", "response_length", "groups_kept"):
            assert a[key] == b[key], (key, a, b)
        for key in ("loss", "policy_loss", "entropy", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (key, a, b)
    _assert_same_parameters(r["final_param_diff"], 1e-3, r)  # TINY_RUN's optim.lr
    assert r["ref_on_mesh"] and r["state_on_mesh"], r
    assert r["restored_step"] == 3 and r["restored_shardings"] and r["restored_equals_export"], r


@pytest.mark.slow
def test_ppo_with_critic_on_mesh_equals_single_device():
    r = _child("ppo")
    single, sharded = r["single"], r["mesh"]
    assert len(single["rows"]) == len(sharded["rows"]) == 2
    for a, b in zip(single["rows"], sharded["rows"]):  # exactly: see test_train_loop_on_mesh_equals_single_device
        for key in ("reward", "accuracy", "response_length"):
            assert a[key] == b[key], (key, a, b)
        for key in ("loss", "policy_loss", "grad_norm", "value_loss", "value_grad_norm", "explained_variance"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (key, a, b)
    assert single["rows"][-1]["value_grad_norm"] > 0, single  # the critic trained
    # The critic's trunk is sharded by the model's rules like the policy's; its exported weights agree.
    assert r["critic_on_mesh"] and r["critic_spec"] == "P(None, 'fsdp', 'tensor')", r
    _assert_same_parameters(r["critic_param_diff"], 1e-3, r)  # critic.lr
    _assert_same_parameters(r["policy_param_diff"], 1e-3, r)  # TINY_RUN's optim.lr


@pytest.mark.slow
def test_gvm_allocation_on_mesh_equals_single_device():
    r = _child("gvm")
    single, sharded = r["single"], r["mesh"]
    # The stub verifier accepts none of a prompt's samples (by its gold answer) or those of even
    # character-code sum, so the allocation is uneven: p_i = 0 gets n_i = 0, the others split the budget.
    assert len(set(single["gvm_p"])) > 2 and 0.0 in single["gvm_p"], single
    assert len(set(single["gvm_n"])) > 1 and sum(single["gvm_n"]) == single["gvm_budget"], single
    # n_i exactly although the norms differ by rounding: a share would have to sit within ~1e-5 of a rounding step.
    assert single["gvm_p"] == sharded["gvm_p"] and single["gvm_n"] == sharded["gvm_n"], (single, sharded)
    np.testing.assert_allclose(sharded["gvm_grad_norm"], single["gvm_grad_norm"], rtol=1e-5)
    assert all(g > 0 for g, p in zip(single["gvm_grad_norm"], single["gvm_p"]) if p > 0), single
    # Per-sample norms straight from per_sample_grad_norms on sharded parameters (rows replicated, and rows
    # split over the batch axes), against one device.
    assert r["row_norm_rel_diff"] < 1e-5 and r["row_norms_differ"], r
    for key in ("loss", "policy_loss", "entropy", "grad_norm"):
        assert abs(single[key] - sharded[key]) <= 1e-4 * max(1.0, abs(single[key])), (key, single, sharded)
    assert single["updates"] >= 1 and single["groups_kept"] == sum(n > 0 for n in single["gvm_n"]), single
    assert 0 < single["accuracy"] < 1, single  # mixed rewards: the policy-gradient term is live
    assert abs(single["grad_norm"] - sharded["grad_norm"]) <= 1e-5 * single["grad_norm"], (single, sharded)
    _assert_same_parameters(r["final_param_diff"], 1e-3, r)  # TINY_RUN's optim.lr
    assert r["param_moved"] > 5e-4, r


# ---- the subprocess side ----------------------------------------------------------------------------------

def _spec_name(sharding) -> str:
    return str(sharding.spec)


def _step_checks() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from compile_count import counted_compiles
    from process_helpers import random_response_groups

    from jaxrl_llm import models
    from jaxrl_llm.models.sharding import make_mesh, param_shardings
    from jaxrl_llm.objectives import aggregate_denominator
    from jaxrl_llm.run.config import AlgorithmSection, ConfigError, OptimSection, load_config
    from jaxrl_llm.run.layout import batch_shardings, check_mesh_fits, place
    from jaxrl_llm.run.state import init_state, make_optimizer, state_shardings
    from jaxrl_llm.train.packing import pack_groups, unpack
    from jaxrl_llm.train.step import make_logprob_fn, make_train_step

    assert jax.device_count() == 8, jax.devices()
    config = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=8, tie_word_embeddings=False)
    params = models.init_params(config, jax.random.PRNGKey(0))
    mesh = make_mesh(MESH)
    p_sharding, b_sharding = param_shardings(params, mesh), batch_shardings(mesh)

    # 8 prompts with 3 responses each -> 8 packed rows = 2 micro-batches of 4 (one row per device pair).
    rng, prompts, responses, lengths, members, mask = random_response_groups()
    probe = pack_groups(prompts, members, responses, lengths, row_multiple=4)
    logp_single = np.asarray(make_logprob_fn(config)(params, probe))
    # the sharded pass in 2 micro-batches of 4 rows (as a run's, optim.micro_batch_size), the reference in one
    sharded_logprob = make_logprob_fn(config, micro_batch_size=4, param_sharding=p_sharding, batch_sharding=b_sharding)
    logp_mesh = sharded_logprob(place(params, p_sharding), place(probe, b_sharding))
    logp = unpack(logp_single, members, 24) * mask
    adv = rng.choice([-1.0, 0.5, 1.0], size=(24, 1)).astype(np.float32) * mask
    old = (logp + rng.normal(0, 0.3, logp.shape).astype(np.float32)) * mask  # ratios != 1: clipping is live
    ref = (logp + rng.normal(0, 0.3, logp.shape).astype(np.float32)) * mask
    # The step's batch: R = 12 slots per response, of which at most 6 are tokens, so the 32-token rows are
    # shorter than their 4 x 12 slots and the log-probs are scored in the compact layout (the probe above
    # used the slot layout).
    wide = lambda x: np.pad(x, ((0, 0), (0, 6)))  # noqa: E731
    batch = pack_groups(prompts, members, wide(responses), lengths, advantages=wide(adv), old_logp=wide(old),
                        ref_logp=wide(ref), row_multiple=4)
    compact = batch.tokens.shape[1] < batch.pred_index.shape[1] * batch.pred_index.shape[2]
    compact_logp = unpack(np.asarray(sharded_logprob(place(params, p_sharding), place(batch, b_sharding))),
                          members, 24)[:, :6] * mask
    algo = AlgorithmSection(loss="clip", kl_coef=0.1, entropy_coef=0.01)
    denom = np.float32(aggregate_denominator(mask, algo.agg))

    def run(optimizer, sharded: bool, steps: int = 2, algo=algo):
        state = init_state(jax.tree_util.tree_map(jnp.array, params), optimizer)  # fresh buffers: donated
        s_sharding = state_shardings(state, optimizer, p_sharding) if sharded else None
        step = make_train_step(config, algo, optimizer, micro_batch_size=4, state_sharding=s_sharding,
                               batch_sharding=b_sharding if sharded else None)
        state = place(state, s_sharding)
        placed = place(batch, b_sharding if sharded else None)
        history = []
        with counted_compiles() as compiles:
            for _ in range(steps):
                previous = state
                state, metrics = step(state, placed, denom)
                history.append({k: float(v) for k, v in metrics.items()})
        donated = all(x.is_deleted() for x in jax.tree_util.tree_leaves(previous))
        return state, history, donated, len(compiles)

    adamw = make_optimizer(OptimSection(lr=1e-2, weight_decay=0.01))
    a_single, m_single, _, _ = run(adamw, False)
    a_mesh, m_mesh, donated, compiles = run(adamw, True)
    adam_single, adam_mesh = a_single.opt_state[1][0], a_mesh.opt_state[1][0]  # ScaleByAdamState
    moment_diff = 0.0
    for a, b in zip(jax.tree_util.tree_leaves((adam_single.mu, adam_single.nu)),
                    jax.tree_util.tree_leaves((adam_mesh.mu, adam_mesh.nu))):
        a, b = np.asarray(a), np.asarray(b)
        moment_diff = max(moment_diff, float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)))
    adam_param_diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(
        jax.tree_util.tree_leaves(a_single.params), jax.tree_util.tree_leaves(a_mesh.params)))
    metric_diff = {k: max(abs(x[k] - y[k]) / max(abs(x[k]), 1e-8) for x, y in zip(m_single, m_mesh))
                   for k in m_single[0]}
    specs = {
        "params/layers/q_proj": _spec_name(a_mesh.params["layers"]["q_proj"].sharding),
        "params/embed": _spec_name(a_mesh.params["embed"].sharding),
        "mu/layers/q_proj": _spec_name(adam_mesh.mu["layers"]["q_proj"].sharding),
        "nu/lm_head": _spec_name(adam_mesh.nu["lm_head"].sharding),
        "count": _spec_name(adam_mesh.count.sharding),
        "step": _spec_name(a_mesh.step.sharding),
    }
    # Clip-Cov: the token choice is made over the whole batch, then split into micro-batches like the mask.
    cov = AlgorithmSection(loss="clip_cov", cov_fraction=0.3, cov_low=-10.0, cov_high=10.0)
    _, cov_single, _, _ = run(adamw, False, steps=1, algo=cov)
    _, cov_mesh, _, _ = run(adamw, True, steps=1, algo=cov)
    _, plain, _, _ = run(adamw, False, steps=1, algo=AlgorithmSection(loss="clip"))
    cov_diff = {k: abs(cov_single[0][k] - cov_mesh[0][k]) / max(abs(cov_single[0][k]), 1e-8)
                for k in ("loss", "grad_norm")}
    cov_live = abs(cov_single[0]["grad_norm"] - plain[0]["grad_norm"]) > 1e-3 * plain[0]["grad_norm"]
    bad_micro = None
    try:
        check_mesh_fits(mesh, load_config(None, [f"train.mesh={MESH}", "optim.micro_batch_size=2"]))
    except ConfigError as err:
        bad_micro = str(err)
    return {"adam_param_diff": adam_param_diff, "adam_moment_rel_diff": moment_diff, "metric_rel_diff": metric_diff,
            "metrics": m_single[0], "logprob_diff": float(np.abs(np.asarray(logp_mesh) - logp_single).max()),
            "logprob_replicated": bool(logp_mesh.sharding.is_fully_replicated), "specs": specs,
            "donated": donated, "compiles": compiles, "bad_micro_error": bad_micro, "cov_rel_diff": cov_diff,
            "cov_live": bool(cov_live), "compact": bool(compact),
            "compact_logprob_diff": float(np.abs(compact_logp - logp).max())}


def _loop_checks() -> dict:
    import jax
    import numpy as np

    from loop_runner import TINY_RUN, tiny_policy

    from jaxrl_llm.run import setup as setup_lib
    from jaxrl_llm.train import load_config
    seen = {}
    original_setup = setup_lib.setup_run

    def recording_setup(config, *, policy=None):  # note where the run put its arrays
        run = original_setup(config, policy=policy)
        seen["ref"] = run.ref_params is not None and all(
            len(x.sharding.device_set) == 8 for x in jax.tree_util.tree_leaves(run.ref_params))
        seen["state"] = all(len(x.sharding.device_set) == 8 for x in jax.tree_util.tree_leaves(run.state))
        return run

    import jaxrl_llm.train.loop as loop_lib

    loop_lib.setup_run = recording_setup
    # kl_coef > 0 keeps a reference policy, so its placement is checked too
    overrides = TINY_RUN + ["algorithm.kl_coef=0.01", "train.steps=3", "train.eval_problems=0"]
    with tempfile.TemporaryDirectory() as tmp:
        out = _train_single_and_mesh(tmp, overrides, {"params": "final/model.safetensors"})
        # the last checkpoint restores onto the mesh, as the run left it
        run = original_setup(load_config(None, [*overrides, f"train.out_dir={pathlib.Path(tmp) / 'mesh'}",
                                                f"train.mesh={MESH}"]), policy=tiny_policy())
        step, state, _ = run.checkpointer.restore(run.state)
        restored_shardings = all(a.sharding == b for a, b in zip(jax.tree_util.tree_leaves(state),
                                                                 jax.tree_util.tree_leaves(run.state_sharding)))
        final = jax.device_get(state.params)
        run.close()
    exported = out["mesh"]["params"]["model.embed_tokens.weight"]
    return {"single": {"rows": out["single"]["rows"]}, "mesh": {"rows": out["mesh"]["rows"]},
            "final_param_diff": _param_diff(out, "params"), "ref_on_mesh": seen["ref"], "state_on_mesh": seen["state"],
            "restored_step": step, "restored_shardings": restored_shardings,
            "restored_equals_export": bool(np.array_equal(np.asarray(final["embed"]), exported))}


def _train_single_and_mesh(tmp, overrides: list[str], exports: dict[str, str]) -> dict:
    """Train the tiny run with `overrides` on one device, then on the mesh, under tmp/single and tmp/mesh: per
    run ("single", "mesh") its step rows of metrics.jsonl and the safetensors files `exports` names (key ->
    path in the run folder)."""
    from loop_runner import tiny_policy
    from safetensors.numpy import load_file

    from jaxrl_llm.train import load_config
    from jaxrl_llm.train.loop import train

    out = {}
    for name, extra in (("single", []), ("mesh", [f"train.mesh={MESH}"])):
        run_dir = pathlib.Path(tmp) / name
        train(load_config(None, [*overrides, f"train.out_dir={run_dir}", *extra]), policy=tiny_policy(),
              log=lambda *a: None)
        rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
        out[name] = {"rows": [r for r in rows if "accuracy" in r],
                     **{key: load_file(str(run_dir / path)) for key, path in exports.items()}}
    return out


def _param_diff(out: dict, key: str) -> dict:
    """|single - mesh| over the tensors of export `key` of `_train_single_and_mesh`'s runs: the largest, and the
    fraction of elements that differ by over 1e-5."""
    import numpy as np

    diffs = np.concatenate([np.abs(out["single"][key][name].astype(np.float64) - value).ravel()
                            for name, value in out["mesh"][key].items()])
    return {"max": float(diffs.max()), "over_1e-5": float((diffs > 1e-5).mean())}


def _assert_same_parameters(diff: dict, lr: float, r: dict) -> None:
    """Parameters trained single-device and on the mesh agree up to Adam-amplified rounding. Adam moves a
    parameter by lr * m / (sqrt(v) + eps): where a gradient is ~eps, the mesh's other summation order changes
    that step by a fraction of lr (measured: up to 0.1 lr on a few of 1.6M elements, machine-dependent), so the
    largest difference is bounded by one step, not by float noise. A sharding bug moves whole shards: the
    fraction of elements off by over 1e-5 stays tiny (measured: 2e-6)."""
    assert diff["max"] < lr and diff["over_1e-5"] < 1e-4, (diff, r)


def _ppo_checks() -> dict:
    """Two PPO steps with a critic (value pass, GAE, policy and critic updates), single-device and on the mesh."""
    import jax

    from loop_runner import TINY_RUN

    from jaxrl_llm.run import setup as setup_lib
    import jaxrl_llm.train.loop as loop_lib
    original_setup, seen = setup_lib.setup_run, {}

    def recording_setup(config, *, policy=None):
        run = original_setup(config, policy=policy)
        if run.mesh is None:
            return run
        trunk = run.critic.state.params["trunk"]
        seen["on_mesh"] = all(len(x.sharding.device_set) == 8 for x in jax.tree_util.tree_leaves(run.critic.state))
        seen["spec"] = _spec_name(trunk["layers"]["q_proj"].sharding)
        return run

    loop_lib.setup_run = recording_setup
    overrides = TINY_RUN + ["train.steps=2", "train.eval_problems=0", "algorithm.advantage=gae",
                            "algorithm.kl_reward_coef=0.05", "critic.lr=1e-3", "optim.mini_batches=2"]
    with tempfile.TemporaryDirectory() as tmp:
        out = _train_single_and_mesh(tmp, overrides, {"policy": "final/model.safetensors",
                                                      "critic": "final_critic/model.safetensors"})
    return {"single": {"rows": out["single"]["rows"]}, "mesh": {"rows": out["mesh"]["rows"]},
            "critic_on_mesh": seen["on_mesh"], "critic_spec": seen["spec"],
            "critic_param_diff": _param_diff(out, "critic"), "policy_param_diff": _param_diff(out, "policy")}


def _gvm_checks() -> dict:
    """One GVM step (stage 1, per-sample gradient norms, allocation, stage 2, update) single-device and on
    the mesh, with a stub verifier whose verdict depends on the prompt's gold answer. top_k=2: the sampler
    draws by inverse CDF, and over the random policy's ~flat 49k-token distribution the float noise of
    the tensor-sharded logits moves a draw to the neighbouring token about once in 100; between two
    tokens it would take a draw within ~1e-7 of the boundary, so both runs see the same samples."""
    import numpy as np
    from safetensors.numpy import load_file

    sys.path.insert(0, str(ROOT / "tests"))
    from loop_runner import TINY_RUN, tiny_policy

    from jaxrl_llm.models.sharding import make_mesh, param_shardings
    from jaxrl_llm.run.layout import place
    from jaxrl_llm.train import load_config, rollouts
    from jaxrl_llm.train.gvm import per_sample_grad_norms
    from jaxrl_llm.train.loop import train

    def stub_verdicts(self, texts, golds, lengths):  # none (gold a multiple of 4), or even character-code sums
        unsolved = [int(g) % 4 == 0 for g in golds]
        correct = np.array([not u and sum(map(ord, t)) % 2 == 0 for u, t in zip(unsolved, texts)], bool)
        self.last_seconds = 0.0
        return correct, correct.astype(np.float32)

    rollouts.RewardScorer.__call__ = stub_verdicts
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("single", []), ("mesh", [f"train.mesh={MESH}"])):
            run_dir = pathlib.Path(tmp) / name
            overrides = TINY_RUN + [f"train.out_dir={run_dir}", "train.steps=1", "train.eval_problems=0",
                                    "sampling.allocation=gvm", "sampling.prompts_per_step=6",
                                    "sampling.gvm_stage1_samples=4", "sampling.gvm_samples_per_prompt=4",
                                    "sampling.top_k=2", *extra]
            train(load_config(None, overrides), policy=tiny_policy(), log=lambda *a: None)
            row = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()][0]
            out[name] = row
            out[name + "_params"] = load_file(str(run_dir / "final" / "model.safetensors"))
    config, params, _ = tiny_policy()
    exported = out["single_params"]["model.embed_tokens.weight"]
    # per_sample_grad_norms itself, on parameters sharded by the model's rules, against one device.
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 200, size=(8, 12)).astype(np.int32)
    prompt_lens = rng.integers(2, 6, size=8).astype(np.int32)
    response = rng.integers(1, 200, size=(8, 6)).astype(np.int32)
    mask = (np.arange(6)[None] < rng.integers(1, 7, size=8)[:, None]).astype(np.float32)
    args = (tokens, prompt_lens, response, mask)
    single = per_sample_grad_norms(params, config, *args, param_subset="embed,layers/q_proj", rows_per_chunk=4)
    mesh = make_mesh(MESH)
    on_mesh = place(params, param_shardings(params, mesh))
    sharded = per_sample_grad_norms(on_mesh, config, *args, param_subset="embed,layers/q_proj", rows_per_chunk=4)
    # The same with each chunk's rows split over data x fsdp (3 rows a chunk: rounded up to 4, one per device).
    split = per_sample_grad_norms(on_mesh, config, *args, param_subset="embed,layers/q_proj", rows_per_chunk=3,
                                  mesh=mesh)
    return {"single": out["single"], "mesh": out["mesh"],
            "final_param_diff": _param_diff({run: {"params": out[run + "_params"]} for run in ("single", "mesh")},
                                            "params"),
            "param_moved": float(np.abs(exported - np.asarray(params["embed"])).max()),
            "row_norm_rel_diff": float(max(np.abs(sharded - single).max(), np.abs(split - single).max())
                                       / np.abs(single).max()),
            "row_norms_differ": bool(np.ptp(single) > 0)}


if __name__ == "__main__":
    result = {"step": _step_checks, "loop": _loop_checks, "gvm": _gvm_checks, "ppo": _ppo_checks}[sys.argv[1]]()
    print("RESULT", json.dumps(result), flush=True)
