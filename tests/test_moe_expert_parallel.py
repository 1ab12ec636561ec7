"""Expert parallelism (`models.expert_parallel`): the `expert` mesh axis, the experts' partition rules, the mesh checks
(`run.layout.check_mesh_fits`), and on a simulated 8-device CPU mesh the sharded sparse block and a train step of a
tiny random qwen3_moe against the single device's. The mesh checks run in one subprocess (this file run as a
script: the device count is fixed when JAX starts), shared by the tests that read its results."""

import json
import pathlib
import sys

import numpy as np
import pytest
from simulated_mesh import run_on_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEP_MESH = "data=2,fsdp=2,expert=2"
# (mesh, grouped matmul, token shape [B, T]): expert = 2 and 4; 15 tokens on 4 data-parallel devices are padded to 16
BLOCK_CASES = (("expert=2,fsdp=2,data=2", "tiles", (8, 6)), ("expert=4,tensor=2", "ragged_dot", (3, 5)))
HOT_EXPERT = 3  # the router bias sends most tokens here


@pytest.fixture(scope="module")
def on_mesh() -> dict:
    return run_on_devices([__file__, "all"], timeout=900)


def test_mesh_strings_keep_their_meaning_and_take_an_expert_axis():
    from jaxrl_llm.models.sharding import MESH_AXES, batch_devices
    from jaxrl_llm.run.shapes import mesh_sizes, parse_mesh

    assert MESH_AXES == ("data", "fsdp", "expert", "tensor")
    assert parse_mesh("data=2,fsdp=2,tensor=2", 8) == {"data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
    assert parse_mesh("", 8) == {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}
    assert parse_mesh("data=2,expert=2,fsdp=-1", 8) == {"data": 2, "fsdp": 2, "expert": 2, "tensor": 1}
    # a sizes dict written before the axis (the capacity tables') has expert 1
    assert mesh_sizes({"data": 1, "fsdp": 4, "tensor": 2}) == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2}
    # rows split over data x fsdp x expert: 2 x 2 x 2
    assert batch_devices({"data": 2, "fsdp": 2, "expert": 2, "tensor": 2}) == 8
    assert batch_devices({"data": 2, "fsdp": 3, "tensor": 2}) == 6


def test_expert_weights_split_on_the_expert_axis():
    import jax
    from jax.sharding import PartitionSpec as P

    from jaxrl_llm.models import ModelConfig, init_params
    from jaxrl_llm.models.sharding import param_partition_specs, partition_rules

    config = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=12, num_layers=2, num_heads=2, num_kv_heads=1,
                         head_dim=4, model_type="gpt_oss", attention_bias=True, attention_out_bias=True, num_experts=4,
                         num_experts_per_tok=2, swiglu_limit=7.0)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    specs = param_partition_specs(params, partition_rules(config))["layers"]
    assert specs["expert_gate"] == specs["expert_up"] == P(None, "expert", "fsdp", "tensor")
    assert specs["expert_down"] == P(None, "expert", "tensor", "fsdp")
    assert specs["expert_gate_bias"] == P(None, "expert", "tensor")
    assert specs["expert_down_bias"] == P(None, "expert")
    assert specs["router"] == P(None, "fsdp", None) and specs["router_bias"] == P()  # replicated over expert


def test_pairs_per_destination():
    from jaxrl_llm.models.expert_parallel import pairs_per_destination

    # 10 tokens, top-2 of 8 experts on 2 shards (4 local): all 20 pairs may go to one shard
    assert pairs_per_destination(10, 2, 4) == 20
    # top-4 of 8 experts on 4 shards (2 local): a token sends at most 2 pairs to one shard
    assert pairs_per_destination(10, 4, 2) == 20


def test_mesh_check_names_a_dense_model_and_an_expert_axis_that_does_not_divide():
    from jaxrl_llm.models import ModelConfig
    from jaxrl_llm.run.config import ConfigError, load_config
    from jaxrl_llm.run.layout import check_mesh_fits

    mesh = {"data": 1, "fsdp": 2, "expert": 3, "tensor": 1}
    cfg = load_config(None, ["train.mesh=fsdp=2,expert=3", "optim.micro_batch_size=6"])
    base = dict(vocab_size=16, hidden_size=8, intermediate_size=12, num_layers=1, num_heads=2, num_kv_heads=1,
                head_dim=4)
    with pytest.raises(ConfigError, match=r"expert=3, but the policy is a dense model"):
        check_mesh_fits(mesh, cfg, ModelConfig(**base))
    with pytest.raises(ConfigError, match=r"expert=3 does not divide the model's num_experts=8"):
        check_mesh_fits(mesh, cfg, ModelConfig(**base, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2))
    moe = ModelConfig(**base, model_type="qwen3_moe", num_experts=6, num_experts_per_tok=2)
    check_mesh_fits(mesh, cfg, moe)
    gvm = load_config(None, ["train.mesh=fsdp=2,expert=3", "optim.micro_batch_size=6", "sampling.allocation=gvm"])
    with pytest.raises(ConfigError, match=r"sampling.allocation='gvm' does not run on a mesh with an expert axis"):
        check_mesh_fits(mesh, gvm, moe)
    with pytest.raises(ConfigError, match=r"micro_batch_size=4 must be a multiple of data x fsdp x expert = 6"):
        check_mesh_fits(mesh, load_config(None, ["train.mesh=fsdp=2,expert=3", "optim.micro_batch_size=4"]))


def test_sharded_sparse_block_equals_the_single_device_block(on_mesh):
    for mesh, impl, _ in BLOCK_CASES:
        r = on_mesh["block"][mesh]
        assert r["hot_fraction"] > 0.4, r  # unbalanced: expert 3 takes most pairs, its shard most rows
        assert r["all_to_all"] >= 3, r  # the exchange ran: tokens out, expert ids out, outputs back
        assert r["value_rel_diff"] < 1e-6, (mesh, impl, r)
        for name, diff in r["grad_rel_diff"].items():
            assert diff < 1e-5, (mesh, impl, name, r)


def test_train_step_on_an_expert_mesh_equals_single_device(on_mesh):
    r = on_mesh["step"]
    # the bounds of the dense mesh test (test_train_mesh): Adam's moments pin both steps' gradients
    assert r["adam_moment_rel_diff"] < 1e-4, r
    assert r["adam_param_diff"] < 1e-4, r
    for name in ("loss", "policy_loss", "kl", "entropy", "clip_fraction", "grad_norm"):
        assert r["metric_rel_diff"][name] < 1e-5, (name, r)
    assert r["metrics"]["kl"] > 0 and r["metrics"]["grad_norm"] > 0, r
    assert r["expert_parallel_traces"] >= 2, r  # the sparse block took the all-to-all path: step, log-prob pass
    assert r["logprob_diff"] < 1e-5, r  # the old / reference log-prob pass on the mesh
    # the sampler's prefill and decode on the same mesh, the experts split: greedy tokens and log-probs
    assert r["sampler"]["tokens_equal"] and r["sampler"]["logprob_diff"] < 1e-5, r
    assert r["specs"]["expert_gate"] == "P(None, 'expert', 'fsdp', 'tensor')", r
    assert r["specs"]["mu/expert_down"] == "P(None, 'expert', 'tensor', 'fsdp')", r
    assert r["expert_grad_rel_diff"] < 1e-4, r  # the experts' moments alone (a wrong shard would move them whole)


# ---- the subprocess side ----------------------------------------------------------------------------------

def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _block_layer(num_experts: int, width: int, hidden: int, seed: int = 0) -> dict:
    """A gpt-oss-style sparse layer (biases, clamped SwiGLU) whose router bias favours HOT_EXPERT."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    shapes = {"router": (width, num_experts), "expert_gate": (num_experts, width, hidden),
              "expert_up": (num_experts, width, hidden), "expert_down": (num_experts, hidden, width),
              "expert_gate_bias": (num_experts, hidden), "expert_up_bias": (num_experts, hidden),
              "expert_down_bias": (num_experts, width)}
    lp = {name: jnp.asarray(0.3 * rng.normal(size=shape), jnp.float32) for name, shape in shapes.items()}
    lp["router_bias"] = jnp.zeros((num_experts,), jnp.float32).at[HOT_EXPERT].set(3.0)
    return lp


def _block_checks() -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxrl_llm.models import ModelConfig
    from jaxrl_llm.models.moe import moe_block, route
    from jaxrl_llm.models.sharding import BATCH_SPEC, batch_devices, make_mesh

    width, num_experts = 16, 8
    lp = _block_layer(num_experts, width, 12)
    results = {}
    for mesh_spec, impl, shape in BLOCK_CASES:
        config = ModelConfig(vocab_size=16, hidden_size=width, intermediate_size=12, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=8, model_type="gpt_oss", num_experts=num_experts,
                             num_experts_per_tok=2, swiglu_limit=7.0, moe_impl=impl)
        rng = np.random.default_rng(1)
        h = jnp.asarray(rng.normal(size=(*shape, width)), jnp.float32)
        probe = jnp.asarray(rng.normal(size=(*shape, width)), jnp.float32)

        def loss(lp, h):
            out = moe_block(lp, config, h)
            return jnp.sum(out * probe), out

        grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        (_, ref_out), ref_grads = grad_fn(lp, h)
        mesh = make_mesh(mesh_spec)
        on_mesh = {name: jax.device_put(x, NamedSharding(mesh, P("expert") if name.startswith("expert") else P()))
                   for name, x in lp.items()}
        rows = BATCH_SPEC if shape[0] % batch_devices(mesh) == 0 else P()  # 3 rows: placed whole
        h_mesh = jax.device_put(h, NamedSharding(mesh, rows))
        with jax.set_mesh(mesh):
            compiled = grad_fn.lower(on_mesh, h_mesh).compile()
            (_, out), grads = compiled(on_mesh, h_mesh)
        chosen = np.asarray(route(h.reshape(-1, width), lp["router"], lp["router_bias"], top_k=2,
                                  normalize=True).experts)
        flat_grads = {**{f"lp/{k}": v for k, v in grads[0].items()}, "h": grads[1]}
        flat_ref = {**{f"lp/{k}": v for k, v in ref_grads[0].items()}, "h": ref_grads[1]}
        results[mesh_spec] = {
            "hot_fraction": float((chosen == HOT_EXPERT).mean()),
            "all_to_all": compiled.as_text().count("all-to-all("),
            "value_rel_diff": _rel(out, ref_out),
            "grad_rel_diff": {k: _rel(flat_grads[k], flat_ref[k]) for k in flat_ref},
        }
    return results


def _step_checks() -> dict:
    import jax
    import jax.numpy as jnp

    from jaxrl_llm import models
    from jaxrl_llm.models import moe
    from jaxrl_llm.models.sharding import make_mesh, param_shardings
    from jaxrl_llm.objectives import aggregate_denominator
    from jaxrl_llm.run.config import AlgorithmSection, OptimSection
    from jaxrl_llm.run.layout import batch_shardings, place
    from jaxrl_llm.run.state import init_state, make_optimizer, state_shardings
    from jaxrl_llm.train.packing import pack_groups
    from jaxrl_llm.train.step import make_logprob_fn, make_train_step
    from process_helpers import random_response_groups

    traces = []
    parallel = moe.expert_parallel_mlp
    moe.expert_parallel_mlp = lambda *a, **k: traces.append(1) or parallel(*a, **k)
    # qwen3_moe with a dense first layer (mlp_only_layers): the scan's cond runs the exchange in its sparse branch
    config = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=8, model_type="qwen3_moe", qk_norm=True, num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(0,),
                                tie_word_embeddings=False)
    params = models.init_params(config, jax.random.PRNGKey(0))
    mesh = make_mesh(STEP_MESH)
    p_sharding, b_sharding = param_shardings(params, mesh), batch_shardings(mesh)
    rng, prompts, responses, lengths, members, mask = random_response_groups()
    adv = rng.choice([-1.0, 0.5, 1.0], size=(24, 1)).astype(np.float32) * mask
    old = rng.normal(-4.0, 0.3, size=(24, 6)).astype(np.float32) * mask
    ref = rng.normal(-4.0, 0.3, size=(24, 6)).astype(np.float32) * mask
    batch = pack_groups(prompts, members, responses, lengths, advantages=adv, old_logp=old, ref_logp=ref,
                        row_multiple=8)
    algo = AlgorithmSection(loss="clip", kl_coef=0.1, entropy_coef=0.01)
    denom = np.float32(aggregate_denominator(mask, algo.agg))
    adamw = make_optimizer(OptimSection(lr=1e-2, weight_decay=0.01))

    def run(sharded: bool, steps: int = 2):
        state = init_state(jax.tree_util.tree_map(jnp.array, params), adamw)
        s_sharding = state_shardings(state, adamw, p_sharding) if sharded else None
        step = make_train_step(config, algo, adamw, micro_batch_size=8, state_sharding=s_sharding,
                               batch_sharding=b_sharding if sharded else None)
        state, placed = place(state, s_sharding), place(batch, b_sharding if sharded else None)
        history = []
        for _ in range(steps):
            state, metrics = step(state, placed, denom)
            history.append({k: float(v) for k, v in metrics.items()})
        return state, history

    single, m_single = run(False)
    logp_single = np.asarray(make_logprob_fn(config)(params, batch))
    traced_single = len(traces)
    sharded, m_mesh = run(True)
    logp_mesh = make_logprob_fn(config, micro_batch_size=8, param_sharding=p_sharding, batch_sharding=b_sharding)(
        place(params, p_sharding), place(batch, b_sharding))
    adam_single, adam_mesh = single.opt_state[1][0], sharded.opt_state[1][0]
    moments = [_rel(b, a) for a, b in zip(jax.tree_util.tree_leaves((adam_single.mu, adam_single.nu)),
                                          jax.tree_util.tree_leaves((adam_mesh.mu, adam_mesh.nu)))]
    expert_moments = [_rel(adam_mesh.mu["layers"][n], adam_single.mu["layers"][n]) for n in moe.EXPERT_WEIGHTS]
    return {
        "adam_moment_rel_diff": max(moments), "expert_grad_rel_diff": max(expert_moments),
        "adam_param_diff": max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(
            jax.tree_util.tree_leaves(single.params), jax.tree_util.tree_leaves(sharded.params))),
        "metric_rel_diff": {k: max(abs(x[k] - y[k]) / max(abs(x[k]), 1e-8) for x, y in zip(m_single, m_mesh))
                            for k in m_single[0]},
        "metrics": m_single[0], "expert_parallel_traces": len(traces) - traced_single,
        "logprob_diff": float(np.abs(np.asarray(logp_mesh) - logp_single).max()),
        "sampler": _sampler_checks(config, params, mesh),
        "specs": {"expert_gate": str(sharded.params["layers"]["expert_gate"].sharding.spec),
                  "mu/expert_down": str(adam_mesh.mu["layers"]["expert_down"].sharding.spec)},
    }


def _sampler_checks(config, params, mesh) -> dict:
    """Greedy generate with the experts split over `expert` (the sampler runs the single-device block, the compiler
    gathering the experts it needs) against one device: tokens and log-probs."""
    import jax

    from jaxrl_llm.models.sharding import shard_params
    from jaxrl_llm.sampling import generate

    prompts, counts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13]], [3, 1, 2, 2]
    runs = [generate(p, config, prompts, num_samples=counts, max_new_tokens=8, temperature=0.0, rng=jax.random.key(3),
                     mesh=m) for p, m in ((params, None), (shard_params(params, mesh), mesh))]
    return {"tokens_equal": bool(np.array_equal(runs[0].tokens, runs[1].tokens)),
            "logprob_diff": float(np.abs(runs[0].logprobs - runs[1].logprobs).max())}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    import jax

    assert jax.device_count() == 8, jax.devices()
    print("RESULT " + json.dumps({"block": _block_checks(), "step": _step_checks()}))
