"""Quantized frozen base (models/quant.py, lora.base_dtype): per-output-channel int8 / int4 codes against a
NumPy reference, the quantized forward equals the dequantized model and stays within a stated tolerance of
float32, a LoRA step on an int8 base leaves the codes bitwise unchanged, the config key and the memory estimate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.models import lora, quant
from jaxrl_llm.models.model import param_shapes


def _reference(w: np.ndarray, q_max: int):
    """NumPy loop: per output column o, scale = max |w[:, o]| / q_max (1 for an all-zero column),
    codes = clip(round(w / scale))."""
    codes, scales = np.zeros(w.shape, np.int64), np.zeros((1, w.shape[1]), np.float32)
    for o in range(w.shape[1]):
        scale = np.float32(np.abs(w[:, o]).max()) / np.float32(q_max) or np.float32(1.0)
        scales[0, o] = scale
        for i in range(w.shape[0]):
            codes[i, o] = min(q_max, max(-q_max, int(np.round(w[i, o] / scale))))
    return codes, scales


def test_int8_hand_value():
    w = jnp.array([[1.0, -2.0], [0.5, 4.0], [-1.0, 0.0]])
    codes, scale = quant.quantize_matrix(w, "int8")
    np.testing.assert_allclose(np.asarray(scale), [[1 / 127, 4 / 127]], rtol=1e-7)
    # 0.5 * 127 = 63.5 and -2 / (4 / 127) = -63.5 round half to even: 64 and -64.
    np.testing.assert_array_equal(np.asarray(codes), [[127, -64], [64, 127], [-127, 0]])
    assert codes.dtype == jnp.int8
    np.testing.assert_allclose(np.asarray(quant.dequantize(codes, scale)),
                               [[1.0, -256 / 127], [64 / 127, 4.0], [-1.0, 0.0]], rtol=1e-6)


@pytest.mark.parametrize("kind, q_max", [("int8", 127), ("int4", 7)])
def test_codes_match_the_numpy_reference_and_the_error_bound(kind, q_max):
    w = np.random.default_rng(0).normal(size=(6, 5)).astype(np.float32)
    w[:, 3] = 0.0  # an all-zero column
    codes, scale = quant.quantize_matrix(jnp.asarray(w), kind)
    want_codes, want_scale = _reference(w, q_max)
    np.testing.assert_allclose(np.asarray(scale), want_scale, rtol=1e-6)
    back = np.asarray(quant.dequantize(codes, scale))
    np.testing.assert_allclose(back, want_codes * want_scale, rtol=1e-6)
    assert np.all(np.abs(back - w) <= want_scale / 2 + 1e-6)
    if kind == "int4":
        assert codes.dtype == jnp.uint8 and codes.shape == (3, 5)  # two input rows per byte
        # Row 0 in the low nibble, row 1 in the high one, each code + 8.
        np.testing.assert_array_equal(np.asarray(codes)[0], (want_codes[0] + 8) | ((want_codes[1] + 8) << 4))


def test_int4_needs_an_even_input_width_and_kinds_are_checked():
    with pytest.raises(ValueError, match="even"):
        quant.quantize_matrix(jnp.ones((3, 2)), "int4")
    with pytest.raises(ValueError, match="int8"):
        quant.quantize_matrix(jnp.ones((2, 2)), "int3")


def _tiny():
    config = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=8, attention_bias=True)
    return config, models.init_params(config, jax.random.PRNGKey(0))


def _inputs(config, batch=2, length=9):
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (batch, length)), jnp.int32)
    return tokens, jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


@pytest.mark.parametrize("kind, tolerance", [("int8", 0.03), ("int4", 0.5)])
def test_quantized_forward_is_the_dequantized_model_and_near_float32(kind, tolerance):
    config, params = _tiny()
    quantized = quant.quantize_base(params, kind)
    assert set(quantized["layers"]) == set(params["layers"]) | {f"{p}_scale" for p in lora.PROJECTIONS}
    tokens, positions = _inputs(config)
    got = np.asarray(models.forward(quantized, config, tokens, positions))
    # Reference: the float32 model whose projections are the NumPy-reference dequantized weights.
    q_max = {"int8": 127, "int4": 7}[kind]
    layers = dict(params["layers"])
    for name in lora.PROJECTIONS:
        stacked = np.asarray(params["layers"][name])
        references = (_reference(w, q_max) for w in stacked)
        layers[name] = jnp.asarray(np.stack([codes * scale for codes, scale in references]))
    want = np.asarray(models.forward({**params, "layers": layers}, config, tokens, positions))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    exact = np.asarray(models.forward(params, config, tokens, positions))
    # Stated tolerance: the largest logit error relative to the logits' spread (std), 3% for int8, 50% for int4.
    error = np.abs(got - exact).max() / exact.std()
    assert 0 < error < tolerance, error


def test_lora_step_on_an_int8_base_leaves_the_codes_bitwise_and_matches_the_dequantized_base():
    from jaxrl_llm.run.config import AlgorithmSection, OptimSection
    from jaxrl_llm.run.state import init_state, make_optimizer
    from jaxrl_llm.train.packing import pack_groups
    from jaxrl_llm.train.step import make_logprob_fn, make_train_step

    config, params = _tiny()
    quantized = quant.quantize_base(params, "int8")
    dequantized = quant.dequantize_base(quantized)
    assert "q_proj_scale" not in dequantized["layers"] and dequantized["layers"]["q_proj"].dtype == jnp.float32
    codes_before = {k: np.asarray(v).copy() for k, v in quantized["layers"].items()}
    rng = np.random.default_rng(2)
    responses = rng.integers(1, config.vocab_size, size=(4, 5)).astype(np.int32)
    mask = np.ones((4, 5), np.float32)
    adv = np.array([[1.0], [-1.0], [1.0], [-1.0]], np.float32) * mask
    batch = pack_groups([[3, 4, 5], [6, 7]], [np.arange(2), np.arange(2, 4)], responses, np.full(4, 5),
                        advantages=adv, old_logp=-3 * mask, ref_logp=-3 * mask)
    spec = lora.LoraSpec(rank=2, alpha=4.0)
    optimizer = make_optimizer(OptimSection(lr=1e-2))
    adapters = lora.init_adapters(config, spec, jax.random.PRNGKey(3))
    outs = []
    for base in (quantized, dequantized):
        step = make_train_step(config, AlgorithmSection(), optimizer, micro_batch_size=2, frozen=base,
                               lora_scale=spec.scale)
        state, metrics = step(init_state(jax.tree_util.tree_map(jnp.copy, adapters), optimizer), batch,
                              np.float32(mask.sum()))
        outs.append((float(metrics["loss"]), state.params))
    assert outs[0][0] == pytest.approx(outs[1][0], abs=1e-6)
    # The KL reference's log-probs read the quantized base as the dequantized one.
    logprob_fn = make_logprob_fn(config)
    np.testing.assert_allclose(np.asarray(logprob_fn(quantized, batch)), np.asarray(logprob_fn(dequantized, batch)),
                               atol=1e-5)
    for name in adapters["layers"]:
        np.testing.assert_allclose(np.asarray(outs[0][1]["layers"][name]), np.asarray(outs[1][1]["layers"][name]),
                                   atol=1e-6, err_msg=name)
    assert not np.array_equal(np.asarray(outs[0][1]["layers"]["q_proj_lora_b"]), 0)  # the adapters moved
    for name, value in quantized["layers"].items():
        np.testing.assert_array_equal(np.asarray(value), codes_before[name], err_msg=name)


def test_merge_dequantizes_a_quantized_base():
    config, params = _tiny()
    quantized = quant.quantize_base(params, "int4")
    spec = lora.LoraSpec(rank=2, alpha=2.0, targets=("v_proj",))
    adapters = jax.tree_util.tree_map(lambda x: x + 0.1, lora.init_adapters(config, spec, jax.random.PRNGKey(1)))
    merged = lora.merge(quantized, adapters, spec.scale)
    assert not any(k.endswith("_scale") for k in merged["layers"])
    want = lora.merge(quant.dequantize_base(quantized), adapters, spec.scale)
    for name in merged["layers"]:
        np.testing.assert_array_equal(np.asarray(merged["layers"][name]), np.asarray(want["layers"][name]))
    q = np.asarray(quant.dequantize(quantized["layers"]["q_proj"], quantized["layers"]["q_proj_scale"]))
    np.testing.assert_array_equal(np.asarray(merged["layers"]["q_proj"]), q)


def test_base_dtype_config_key():
    from jaxrl_llm.run.config import ConfigError, load_config

    assert load_config(None, ["lora.rank=8", "lora.base_dtype=int4"]).lora.base_dtype == "int4"
    with pytest.raises(ConfigError, match="lora.base_dtype"):
        load_config(None, ["lora.rank=8", "lora.base_dtype=nf4"])
    with pytest.raises(ConfigError, match="lora.rank"):
        load_config(None, ["lora.base_dtype=int8"])
    with pytest.raises(ConfigError, match="train.mesh"):
        load_config(None, ["lora.rank=8", "lora.base_dtype=int8", "train.mesh=data=2"])


def test_memory_estimate_counts_codes_and_scales():
    from jaxrl_llm.capacity.memory import estimate_memory
    from jaxrl_llm.run.config import load_config

    config, _ = _tiny()
    mesh = {"data": 1, "fsdp": 1, "tensor": 1}
    plain = estimate_memory(load_config(None, ["lora.rank=2"]), config, mesh)
    projections = sum(int(np.prod(s)) for k, s in param_shapes(config)["layers"].items() if k.endswith("_proj"))
    scales = sum(s[0] * s[2] for k, s in param_shapes(config)["layers"].items() if k.endswith("_proj"))
    for kind, code_bytes in (("int8", 1.0), ("int4", 0.5)):
        est = estimate_memory(load_config(None, ["lora.rank=2", f"lora.base_dtype={kind}"]), config, mesh)
        assert plain["params"] - est["params"] == projections * (4 - code_bytes) - scales * 4


def test_quantized_base_has_a_partition_spec_for_every_leaf():
    """`jaxrl-llm compile` lays a quantized base out by the partition rules: the codes as their projections, the
    scales [L, 1, out] split over the axis their codes' outputs are (once, no rule matched a scale)."""
    from jax.sharding import PartitionSpec as P

    from jaxrl_llm.models.sharding import param_partition_specs

    config = models.ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=4)
    specs = param_partition_specs(quant.quantize_base(models.init_params(config, jax.random.PRNGKey(0)), "int8"))
    layers = specs["layers"]
    assert layers["q_proj"] == P(None, "fsdp", "tensor") and layers["down_proj"] == P(None, "tensor", "fsdp")
    assert all(layers[f"{n}_proj_scale"] == P(None, None, "tensor") for n in ("q", "k", "v", "gate", "up"))
    assert layers["o_proj_scale"] == layers["down_proj_scale"] == P(None, None, "fsdp")


def test_experts_are_quantized_per_expert_and_output_channel():
    """A mixture's expert matrices [L, E, in, out] take codes and scales [L, E, 1, out] (the router stays float):
    each expert's matrix equals the NumPy reference on its own, and the int8 model stays near float32."""
    config = models.ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2,
                                num_kv_heads=1, head_dim=8, model_type="qwen3_moe", num_experts=3,
                                num_experts_per_tok=2, moe_intermediate_size=8)
    params = models.init_params(config, jax.random.PRNGKey(0))
    quantized = quant.quantize_base(params, "int8")
    experts = {"expert_gate", "expert_up", "expert_down"}
    assert {k for k in quantized["layers"] if k.endswith("_scale")} == \
        {f"{p}_scale" for p in ("q_proj", "k_proj", "v_proj", "o_proj", *experts)}
    assert quantized["layers"]["router"] is params["layers"]["router"]
    assert quantized["layers"]["expert_down_scale"].shape == (2, 3, 1, 16)
    for layer, expert in ((0, 0), (1, 2)):
        w = np.asarray(params["layers"]["expert_up"][layer, expert])
        codes, scale = _reference(w, 127)
        np.testing.assert_array_equal(np.asarray(quantized["layers"]["expert_up"][layer, expert]), codes)
        np.testing.assert_allclose(np.asarray(quantized["layers"]["expert_up_scale"][layer, expert]), scale,
                                   rtol=1e-6)
    tokens, positions = _inputs(config)
    got = np.asarray(models.forward(quantized, config, tokens, positions))
    exact = np.asarray(models.forward(params, config, tokens, positions))
    error = np.abs(got - exact).max() / exact.std()
    assert 0 < error < 0.03, error  # int8's stated tolerance above
