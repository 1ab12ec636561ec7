"""The mixture-of-experts block (`models.moe`) on its own: routing and SwiGLU by hand, both grouped-matmul
implementations against the dense reference (values and gradients), the experts' config fields, parameter
layout and partition rules. Needs no torch."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_llm.models import ModelConfig, hidden_states, init_params, layer_constants
from jaxrl_llm.models.moe import Experts, expert_mlp, expert_mlp_dense, resolve, route, swiglu, tile_rows
from jaxrl_llm.models.sharding import param_partition_specs, partition_rules


def test_routing_by_hand():
    h = jnp.array([[1.0, 0.0], [0.0, 1.0]])
    router = jnp.array([[1.0, 2.0, 0.0], [0.5, -1.0, 3.0]])  # token 0's logits [1, 2, 0], token 1's [0.5, -1, 3]
    r = route(h, router, top_k=2, normalize=True)
    np.testing.assert_array_equal(r.experts, [[1, 0], [2, 0]])
    e = math.e
    np.testing.assert_allclose(r.weights, [[e / (e + 1), 1 / (e + 1)], [1 / (1 + math.exp(-2.5)),
                                                                          1 / (1 + math.exp(2.5))]], rtol=1e-6)
    np.testing.assert_allclose(r.logits, [[1.0, 2.0, 0.0], [0.5, -1.0, 3.0]])
    # Qwen3-MoE without norm_topk_prob: the softmax over all experts, read at the chosen ones
    r = route(h, router, top_k=2, normalize=False)
    z0 = e + e ** 2 + 1
    np.testing.assert_allclose(r.weights[0], [e ** 2 / z0, e / z0], rtol=1e-6)
    # a router bias moves the choice: token 0's logits [1, -1, 0]
    r = route(h[:1], router, jnp.array([0.0, -3.0, 0.0]), top_k=2, normalize=True)
    np.testing.assert_array_equal(r.experts, [[0, 2]])
    np.testing.assert_allclose(r.weights, [[e / (e + 1), 1 / (e + 1)]], rtol=1e-6)


def test_swiglu_plain_and_clamped_by_hand():
    gate, up = jnp.array([1.0, 10.0, -2.0]), jnp.array([2.0, -10.0, 3.0])
    silu = lambda x: x / (1 + math.exp(-x))  # noqa: E731
    np.testing.assert_allclose(swiglu(gate, up), [silu(1) * 2, silu(10) * -10, silu(-2) * 3], rtol=1e-6)
    # gpt-oss: gate capped at 7, up clipped to [-7, 7], (up + 1) * gate * sigmoid(1.702 gate)
    glu = lambda g: g / (1 + math.exp(-1.702 * g))  # noqa: E731
    np.testing.assert_allclose(swiglu(gate, up, 7.0), [3 * glu(1), -6 * glu(7), 4 * glu(-2)], rtol=1e-6)


def test_tile_rows():
    assert tile_rows(3, 8) == 8  # at least 8
    assert tile_rows(40, 4) == 16  # mean 10 -> 16
    assert tile_rows(4096, 4) == 128  # at most 128


def _experts(num_experts, width, hidden, *, biases=False, limit=None, seed=0):
    keys = jax.random.split(jax.random.key(seed), 6)
    shapes = ((num_experts, width, hidden), (num_experts, width, hidden), (num_experts, hidden, width))
    weights = [0.3 * jax.random.normal(k, s) for k, s in zip(keys, shapes)]
    extra = {}
    if biases:
        extra = dict(gate_bias=jax.random.normal(keys[3], (num_experts, hidden)),
                     up_bias=jax.random.normal(keys[4], (num_experts, hidden)),
                     down_bias=jax.random.normal(keys[5], (num_experts, width)))
    return Experts(*weights, **extra, limit=limit)


# (tokens, model width, expert width, experts, top-k, biases and clamp): fewer tokens than experts (experts
# left without a token), and enough for several tiles of one expert (tile 16 at 80 rows over 6 experts)
CASES = [(3, 8, 12, 8, 2, False), (40, 8, 4, 6, 2, True)]


@pytest.mark.parametrize("impl,case", [("tiles", CASES[0]), ("tiles", CASES[1]), ("ragged_dot", CASES[1])],
                         ids=["tiles-sparse", "tiles-tiled", "ragged_dot"])
def test_grouped_matmuls_equal_the_dense_reference_values_and_gradients(impl, case):
    tokens, width, hidden, num_experts, top_k, extra = case
    experts = _experts(num_experts, width, hidden, biases=extra, limit=7.0 if extra else None)
    h = jax.random.normal(jax.random.key(1), (tokens, width))
    router = jax.random.normal(jax.random.key(2), (width, num_experts))
    (_, (out, chosen)), grads = _grouped[impl](h, router, experts, top_k, not extra)
    (_, (want, _)), want_grads = _grouped["dense"](h, router, experts, top_k, not extra)
    assert np.abs(np.asarray(want)).max() > 0.5
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-5)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, ref, atol=1e-4 * max(1.0, float(np.abs(ref).max())), rtol=1e-4)
    # an expert no token chose gets no gradient (3 tokens x 2 choices leave at least 2 of 8 experts idle)
    idle = np.setdiff1d(np.arange(num_experts), np.asarray(chosen))
    assert len(idle) >= 2 or tokens > num_experts
    assert not np.asarray(grads[2].gate)[idle].any() and not np.asarray(grads[2].down)[idle].any()


def _loss_and_grads(impl):
    def loss(h, router, experts, top_k, normalize):
        routing = route(h, router, top_k=top_k, normalize=normalize)
        out = (expert_mlp_dense(h, routing, experts) if impl == "dense"
               else expert_mlp(h, routing, experts, impl=impl))
        return jnp.sum(out * jnp.cos(out)), (out, routing.experts)  # a loss whose gradient is not constant

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=(3, 4))


_grouped = {impl: _loss_and_grads(impl) for impl in ("dense", "ragged_dot", "tiles")}


def test_mixed_layers_send_no_gradient_to_a_layers_unused_block():
    # layer 0 dense, layer 1 sparse; ragged_dot compiles faster here than tiles, and the cond is the same
    config = _config(num_layers=2, decoder_sparse_step=2, moe_impl="ragged_dot")
    params = init_params(config, jax.random.key(1))
    tokens = jnp.arange(6, dtype=jnp.int32)[None] % 16
    positions = jnp.arange(6, dtype=jnp.int32)[None]
    grads = jax.jit(jax.grad(lambda p: hidden_states(p, config, tokens, positions).sum()))(params)["layers"]
    assert not np.asarray(grads["expert_gate"][0]).any() and not np.asarray(grads["router"][0]).any()
    assert not np.asarray(grads["gate_proj"][1]).any()
    assert np.asarray(grads["expert_gate"][1]).any() and np.asarray(grads["gate_proj"][0]).any()


def test_auto_is_ragged_dot_on_accelerators_and_tiles_on_cpu():
    assert resolve("auto", "tpu") == "ragged_dot" and resolve("auto", "gpu") == "ragged_dot"
    assert resolve("auto", "cpu") == "tiles" and resolve("tiles", "tpu") == "tiles"
    with pytest.raises(ValueError, match="moe_impl"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                    head_dim=8, moe_impl="megablox")


def _config(**changes):
    base = dict(vocab_size=16, hidden_size=8, intermediate_size=12, num_layers=4, num_heads=2, num_kv_heads=1,
                head_dim=4, model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=6)
    return ModelConfig(**{**base, **changes})


def test_sparse_layers_follow_qwen3_moe_rules():
    assert _config().sparse_layers() == (True,) * 4
    assert _config(decoder_sparse_step=2).sparse_layers() == (False, True, False, True)  # (i + 1) % 2 == 0
    assert _config(mlp_only_layers=(3, 0)).sparse_layers() == (False, True, True, False)
    assert _config(num_experts=0, num_experts_per_tok=0).sparse_layers() == (False,) * 4
    np.testing.assert_array_equal(layer_constants(_config(decoder_sparse_step=2))["sparse"], [0, 1, 0, 1])
    assert "sparse" not in layer_constants(_config())  # one kind: nothing to scan
    assert layer_constants(_config(decoder_sparse_step=2), 1)["sparse"] is True


def test_expert_config_is_checked():
    for bad, match in [(dict(num_experts_per_tok=5), "num_experts_per_tok"), (dict(num_experts_per_tok=0),
                       "num_experts_per_tok"), (dict(decoder_sparse_step=0), "decoder_sparse_step"),
                       (dict(mlp_only_layers=(4,)), "mlp_only_layers"), (dict(moe_intermediate_size=0),
                                                                         "moe_intermediate_size")]:
        with pytest.raises(ValueError, match=match):
            _config(**bad)
    with pytest.raises(ValueError, match="cannot be expressed for model_type 'qwen3'"):
        _config(model_type="qwen3").to_hf_dict()
    with pytest.raises(ValueError, match="mixtral"):
        _config(model_type="mixtral", qk_norm=False, moe_intermediate_size=None, norm_topk_prob=False).to_hf_dict()


def test_hf_config_round_trip_and_transformers_defaults():
    qwen = _config(decoder_sparse_step=2, mlp_only_layers=(1,), norm_topk_prob=False)
    d = qwen.to_hf_dict()
    assert (d["num_experts"], d["num_experts_per_tok"], d["moe_intermediate_size"], d["mlp_only_layers"],
            d["decoder_sparse_step"], d["architectures"]) == (4, 2, 6, [1], 2, ["Qwen3MoeForCausalLM"])
    assert ModelConfig.from_hf_dict(d) == qwen
    mixtral = _config(model_type="mixtral", qk_norm=False, moe_intermediate_size=None, sliding_window=5)
    d = mixtral.to_hf_dict()
    assert (d["num_local_experts"], d["intermediate_size"], d["sliding_window"]) == (4, 12, 5)
    assert ModelConfig.from_hf_dict(d) == mixtral
    # keys a config.json may leave out take transformers' defaults; Qwen3-30B-A3B's file names num_experts
    minimal = dict(model_type="qwen3_moe", vocab_size=16, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
                   num_attention_heads=2)
    got = ModelConfig.from_hf_dict(minimal)
    assert (got.num_experts, got.num_experts_per_tok, got.moe_intermediate_size, got.norm_topk_prob) == (128, 8, 768,
                                                                                                        False)
    got = ModelConfig.from_hf_dict({**minimal, "model_type": "mixtral"})
    assert (got.num_experts, got.num_experts_per_tok, got.expert_intermediate_size, got.norm_topk_prob) == (8, 2, 12,
                                                                                                           True)


def test_parameter_layout_and_partition_rules():
    config = _config(decoder_sparse_step=2)
    params = init_params(config, jax.random.key(0))
    layers = params["layers"]
    assert layers["router"].shape == (4, 8, 4) and layers["expert_gate"].shape == (4, 4, 8, 6)
    assert layers["expert_down"].shape == (4, 4, 6, 8) and layers["gate_proj"].shape == (4, 8, 12)
    # mixed layers: each layer's unused block is zeros
    assert not np.asarray(layers["expert_up"][0]).any() and np.asarray(layers["expert_up"][1]).any()
    assert np.asarray(layers["up_proj"][0]).any() and not np.asarray(layers["up_proj"][1]).any()
    specs = param_partition_specs(params, partition_rules(config))["layers"]
    assert specs["expert_gate"] == P(None, "expert", "fsdp", "tensor")
    assert specs["expert_down"] == P(None, "expert", "tensor", "fsdp")
    assert specs["router"] == P(None, "fsdp", None)
    from jaxrl_llm.models.flax_modules import logical_axis_rules

    assert dict(logical_axis_rules())["experts"] == "expert"


def test_lora_on_an_all_sparse_model_names_the_missing_projections():
    from jaxrl_llm.models.lora import LoraSpec, adapter_shapes

    config = _config()
    with pytest.raises(ValueError, match="gate_proj, up_proj, down_proj.*lora.targets: attention"):
        adapter_shapes(config, LoraSpec(rank=2, alpha=4.0))
    assert set(adapter_shapes(config, LoraSpec(rank=2, alpha=4.0, targets=("q_proj", "o_proj")))["layers"]) == {
        "q_proj_lora_a", "q_proj_lora_b", "o_proj_lora_a", "o_proj_lora_b"}


def test_gpt_oss_config_json_as_released_and_round_trip():
    """The keys of openai/gpt-oss-20b's config.json that differ from GptOssConfig's names (experts_per_token, an
    old-style rope_scaling), and the defaults transformers gives the absent ones (alternating layers from a sliding
    one, attention biases)."""
    released = dict(model_type="gpt_oss", vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=4,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_local_experts=4,
                    experts_per_token=2, sliding_window=128, rope_theta=150000,
                    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                      original_max_position_embeddings=4096))
    config = ModelConfig.from_hf_dict(released)
    assert (config.num_experts, config.num_experts_per_tok, config.swiglu_limit, config.norm_topk_prob) == (4, 2, 7.0,
                                                                                                          True)
    assert config.sliding_layers() == (True, False, True, False) and config.attention_bias and config.attention_out_bias
    assert config.attention_sinks and config.expert_biases
    shapes = init_params(config, jax.random.key(0))["layers"]
    assert shapes["attn_sinks"].shape == (4, 2) and shapes["expert_gate_bias"].shape == (4, 4, 8)
    assert shapes["router_bias"].shape == (4, 4) and shapes["expert_down_bias"].shape == (4, 4, 8)
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    with pytest.raises(ValueError, match="swiglu_limit"):
        config.replace(model_type="mixtral", attention_bias=False, attention_out_bias=False, sliding_window=None,
                       layer_types=None).to_hf_dict()


def test_mxfp4_experts_are_refused_by_name():
    from jaxrl_llm.models.hf_io import params_from_hf

    with pytest.raises(ValueError, match="MXFP4-quantized"):
        params_from_hf(_config(), {"model.layers.0.mlp.experts.gate_up_proj_blocks": np.zeros(1, np.uint8)})


def test_flax_declarations_give_the_init_params_tree_of_a_mixed_gpt_oss_model():
    """The Flax modules declare every expert, bias and sink parameter as `init_params` lays them out (shapes only:
    `jax.eval_shape`, nothing compiled), with their logical axes."""
    import flax.linen as nn

    from jaxrl_llm.models.flax_modules import Decoder

    config = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=12, num_layers=2, num_heads=2, num_kv_heads=1,
                         head_dim=4, model_type="gpt_oss", attention_bias=True, attention_out_bias=True, num_experts=4,
                         num_experts_per_tok=2, decoder_sparse_step=2, swiglu_limit=7.0, sliding_window=3,
                         layer_types=("sliding_attention", "full_attention"))
    tokens = jnp.zeros((1, 5), jnp.int32)
    boxed = jax.eval_shape(Decoder(config).init, jax.random.key(0), tokens, tokens)["params"]
    ours = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    assert jax.tree.map(lambda x: x.shape, nn.unbox(boxed)) == jax.tree.map(lambda x: x.shape, ours)
    axes = nn.get_partition_spec(boxed)["layers"]
    assert tuple(axes["expert_down"]) == ("layers", "experts", "expert_mlp", "embed")
    assert tuple(axes["attn_sinks"]) == ("layers", "heads")


def test_a_run_on_gpu_is_told_what_its_grouped_matmul_costs():
    """`gpu_caveat`: nothing for a dense model or off a GPU; on one, the dense lowering of ragged_dot with the
    model's expert ratio (E / k = 64 / 4 = 16), or the tiles' kernel count."""
    from jaxrl_llm.models import ModelConfig
    from jaxrl_llm.models.moe import gpu_caveat

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2, num_kv_heads=1,
                head_dim=16)
    sparse = ModelConfig(**base, model_type="qwen3_moe", num_experts=64, num_experts_per_tok=4,
                         moe_intermediate_size=16)
    assert gpu_caveat(ModelConfig(**base), "gpu") is None
    assert gpu_caveat(sparse, "tpu") is None and gpu_caveat(sparse, "cpu") is None
    for impl in ("auto", "ragged_dot"):
        said = gpu_caveat(sparse.replace(moe_impl=impl), "gpu")
        assert "dense product over all 64 experts (16x the grouped FLOPs" in said, said
    assert "one small kernel per tile" in gpu_caveat(sparse.replace(moe_impl="tiles"), "cuda")
