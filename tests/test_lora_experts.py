"""LoRA on a mixture's experts (models/lora.py targets "experts", models/moe.adapted_weight): per-expert adapters
A [L, E, in, r], B [L, E, r, out]; the sparse block computes with W_e + s A_e B_e, so the attached adapters give
the merged model's logits (prefill and decode too), their gradients are the merged weights' gradients restricted
to A and B, a train step moves only the adapters, and the PEFT export refuses them by name (final/ holds the
merged model). One tiny Qwen3-MoE-style model with a dense layer between sparse ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.models import lora
from jaxrl_llm.models.peft_io import save_peft

SPEC = lora.LoraSpec(rank=3, alpha=6.0, targets=lora.resolve_targets("q,experts"))
forward = jax.jit(models.forward, static_argnums=1)


@pytest.fixture(scope="module")
def tiny():
    config = models.ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=3, num_heads=2,
                                num_kv_heads=1, head_dim=8, model_type="qwen3_moe", qk_norm=True, num_experts=5,
                                num_experts_per_tok=2, moe_intermediate_size=12, mlp_only_layers=(1,))
    params = models.init_params(config, jax.random.PRNGKey(0))
    shapes = lora.adapter_shapes(config, SPEC)["layers"]
    keys = jax.random.split(jax.random.PRNGKey(1), len(shapes))
    adapters = {"layers": {name: 0.3 * jax.random.normal(key, shape)
                           for key, (name, shape) in zip(keys, shapes.items())}}
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 7)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))
    return config, params, adapters, tokens, positions


def test_targets_and_shapes_of_expert_adapters(tiny):
    config, _, adapters, _, _ = tiny
    assert SPEC.targets == ("q_proj", "expert_gate", "expert_up", "expert_down")
    assert lora.resolve_targets("all") == lora.PROJECTIONS  # "all" stays the dense projections
    assert lora.resolve_targets("attention,expert_down") == (*lora.PROJECTIONS[:4], "expert_down")
    shapes = {k: v.shape for k, v in adapters["layers"].items()}
    assert shapes["expert_gate_lora_a"] == (3, 5, 16, 3) and shapes["expert_gate_lora_b"] == (3, 5, 3, 12)
    assert shapes["expert_down_lora_a"] == (3, 5, 12, 3) and shapes["expert_down_lora_b"] == (3, 5, 3, 16)
    new = lora.init_adapters(config, SPEC, jax.random.PRNGKey(2))["layers"]
    bound = 16 ** -0.5  # A ~ U(-1/sqrt(in), 1/sqrt(in)) with in = D for expert_gate
    assert 0.5 * bound < float(jnp.abs(new["expert_gate_lora_a"]).max()) <= bound
    assert not np.asarray(new["expert_down_lora_b"]).any()
    dense = models.ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                               num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="expert_gate.*no experts"):
        lora.adapter_shapes(dense, SPEC)


def test_merged_expert_weight_is_w_plus_s_a_b(tiny):
    """lora.merge on the expert axis, against NumPy: W'[l, e] = W[l, e] + s A[l, e] B[l, e]."""
    _, params, adapters, _, _ = tiny
    merged = lora.merge(params, adapters, SPEC.scale)["layers"]
    a = np.asarray(adapters["layers"]["expert_up_lora_a"], np.float64)
    b = np.asarray(adapters["layers"]["expert_up_lora_b"], np.float64)
    want = np.asarray(params["layers"]["expert_up"], np.float64) + SPEC.scale * np.einsum("leir,lero->leio", a, b)
    np.testing.assert_allclose(np.asarray(merged["expert_up"]), want, rtol=1e-5, atol=1e-6)


def test_attached_expert_adapters_compute_the_merged_model(tiny):
    config, params, adapters, tokens, positions = tiny
    attached = lora.attach(params, adapters, SPEC.scale)
    got = forward(attached, config, tokens, positions)
    merged = forward(lora.merge(params, adapters, SPEC.scale), config, tokens, positions)
    base = forward(params, config, tokens, positions)
    assert float(jnp.abs(got - merged).max()) < 1e-5
    assert float(jnp.abs(got - base).max()) > 0.05  # the adapters move the logits
    cache = models.init_cache(config, tokens.shape[0], 16)  # the sampler's path: prefill, then one token at a time
    logits, cache = models.forward_cached(attached, config, tokens[:, :4], positions[:, :4], cache)
    steps = [logits]
    for t in range(4, tokens.shape[1]):
        out, cache = models.forward_cached(attached, config, tokens[:, t:t + 1], positions[:, t:t + 1], cache)
        steps.append(out)
    assert float(jnp.abs(jnp.concatenate(steps, axis=1) - got).max()) < 1e-5


def test_expert_adapter_gradients_are_the_merged_weight_gradient_restricted_to_a_and_b(tiny):
    """W' = W + s A B per expert: dL/dA = s G B^T and dL/dB = s A^T G with G = dL/dW'."""
    config, params, adapters, tokens, positions = tiny
    weights = jax.random.normal(jax.random.PRNGKey(5), (*tokens.shape, config.vocab_size))

    def loss(p):
        return jnp.sum(jax.nn.log_softmax(models.forward(p, config, tokens, positions)) * weights)

    got = jax.jit(jax.grad(lambda a: loss(lora.attach(params, a, SPEC.scale))))(adapters)["layers"]
    merged_grad = jax.jit(jax.grad(loss))(lora.merge(params, adapters, SPEC.scale))["layers"]
    s = SPEC.scale
    for name in lora.EXPERT_PROJECTIONS:
        a, b, g = adapters["layers"][f"{name}_lora_a"], adapters["layers"][f"{name}_lora_b"], merged_grad[name]
        want = {f"{name}_lora_a": s * jnp.einsum("leio,lero->leir", g, b),
                f"{name}_lora_b": s * jnp.einsum("leir,leio->lero", a, g)}
        for key, value in want.items():
            assert float(jnp.abs(value).max()) > 1e-3, key
            np.testing.assert_allclose(np.asarray(got[key]), np.asarray(value), rtol=1e-4,
                                       atol=1e-4 * float(jnp.abs(value).max()), err_msg=key)


def test_train_step_moves_expert_adapters_only(tiny):
    from jaxrl_llm.run.config import AlgorithmSection, OptimSection
    from jaxrl_llm.run.state import init_state, make_optimizer
    from jaxrl_llm.train.packing import pack_groups
    from jaxrl_llm.train.step import make_train_step

    config, params, _, _, _ = tiny
    before = jax.tree.map(np.array, params)
    new = lora.init_adapters(config, SPEC, jax.random.PRNGKey(3))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, config.vocab_size, size=3).tolist() for _ in range(2)]
    responses = rng.integers(1, config.vocab_size, size=(4, 4)).astype(np.int32)
    mask = np.ones((4, 4), np.float32)
    adv = np.array([[1.0], [-1.0], [1.0], [-1.0]], np.float32) * mask
    batch = pack_groups(prompts, [np.arange(0, 2), np.arange(2, 4)], responses, np.full(4, 4), advantages=adv,
                        old_logp=-2.0 * mask, ref_logp=-2.0 * mask, row_multiple=2)
    optimizer = make_optimizer(OptimSection(lr=1e-2))
    step = make_train_step(config, AlgorithmSection(), optimizer, micro_batch_size=2, frozen=params,
                           lora_scale=SPEC.scale)
    state, metrics = step(init_state(new, optimizer), batch, np.float32(mask.sum()))
    assert metrics["finite"] == 1.0 and metrics["grad_norm"] > 0
    for name in lora.EXPERT_PROJECTIONS:
        assert float(jnp.abs(state.params["layers"][f"{name}_lora_b"]).max()) > 0, name  # B left zero
    for path, value in jax.tree_util.tree_leaves_with_path(params):
        want = before
        for key in path:
            want = want[key.key]
        np.testing.assert_array_equal(np.asarray(value), want, err_msg=jax.tree_util.keystr(path))


def test_peft_export_refuses_expert_adapters_by_name(tiny, tmp_path):
    _, _, adapters, _, _ = tiny
    with pytest.raises(ValueError, match="expert_gate, expert_up, expert_down.*merged model"):
        save_peft(tmp_path / "adapter", SPEC, adapters)
    assert not (tmp_path / "adapter").exists()


def test_expert_adapters_and_scales_split_as_their_expert_matrix(tiny):
    """Partition rules (models/sharding.py): each expert adapter and a quantized expert's scales keep E on the
    `expert` axis and split in / out as the expert matrix they belong to (rank and the scales' 1 replicated)."""
    from jax.sharding import PartitionSpec as P

    from jaxrl_llm.models import quant
    from jaxrl_llm.models.sharding import param_partition_specs

    _, params, adapters, _, _ = tiny
    specs = param_partition_specs(adapters)["layers"]
    matrix = param_partition_specs(params)["layers"]
    for name in lora.EXPERT_PROJECTIONS:
        _, e, d_in, d_out = matrix[name]
        assert (specs[f"{name}_lora_a"], specs[f"{name}_lora_b"]) == (P(None, e, d_in, None), P(None, e, None, d_out))
    scales = param_partition_specs(quant.quantize_base(params, "int8"))["layers"]
    assert scales["expert_up_scale"] == P(None, "expert", None, matrix["expert_up"][3])
    assert scales["expert_down_scale"] == P(None, "expert", None, matrix["expert_down"][3])
