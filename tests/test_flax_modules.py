"""The Flax definitions declare exactly the functional model's parameters and compute with its functions."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_llm.models import (Decoder, DecoderLayer, ModelConfig, ValueModel, forward, hidden_states, init_params,
                              logical_axis_rules)
from jaxrl_llm.models.model import param_shapes
from jaxrl_llm.models.sharding import make_mesh, param_partition_specs, param_shardings, partition_rules

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16)
CONFIGS = {
    "llama-untied": ModelConfig(**TINY),
    "qwen2-tied-bias": ModelConfig(**TINY, model_type="qwen2", tie_word_embeddings=True, attention_bias=True),
    "qwen3-qknorm-outbias": ModelConfig(**TINY, model_type="qwen3", qk_norm=True, attention_bias=True,
                                        attention_out_bias=True),
    "mistral-window": ModelConfig(**TINY, model_type="mistral", sliding_window=3),
    "gemma2-softcap-window": ModelConfig(**TINY, model_type="gemma2", tie_word_embeddings=True, sliding_window=3,
                                         layer_types=("sliding_attention", "full_attention"),
                                         query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                         final_logit_softcapping=4.0),
    "gemma3-qknorm-local-rope": ModelConfig(**TINY, model_type="gemma3_text", tie_word_embeddings=True, qk_norm=True,
                                            sliding_window=3, layer_types=("full_attention", "sliding_attention"),
                                            rope_theta=1e6, rope_local_theta=1e4),
}
forward_jit = jax.jit(forward, static_argnums=1)
hidden_jit = jax.jit(hidden_states, static_argnums=1)


def _random_params(config, seed=0):
    """Every leaf random (norms away from 1, biases away from 0), so every parameter moves the output."""
    leaves, treedef = jax.tree.flatten(init_params(config, jax.random.key(seed)))
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(treedef, [0.3 * jax.random.normal(k, x.shape, x.dtype) + (x if x.ndim else 0)
                                        for k, x in zip(keys, leaves)])


def _inputs(batch=2, length=7, seed=0):
    tokens = np.random.RandomState(seed).randint(0, TINY["vocab_size"], size=(batch, length)).astype(np.int32)
    mask = np.ones_like(tokens)
    mask[1, :3] = 0  # row 1 left-padded
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return tokens, positions, mask


def _padded(spec, rank):
    return tuple(spec) + (None,) * (rank - len(spec))


@pytest.mark.parametrize("name", CONFIGS)
def test_apply_equals_functional_forward_bitwise(name):
    config = CONFIGS[name]
    params = _random_params(config)
    tokens, positions, mask = _inputs()
    apply = jax.jit(lambda p, t, q, m: Decoder(config).apply({"params": p}, t, q, attention_mask=m))
    ours = np.asarray(apply(params, tokens, positions, mask))
    ref = np.asarray(forward_jit(params, config, tokens, positions, attention_mask=mask))
    assert ours.dtype == np.float32 and ours.shape == (2, 7, config.vocab_size)
    np.testing.assert_array_equal(ours, ref)
    # The mask reaches the computation: without it row 1's logits change.
    assert not np.array_equal(np.asarray(apply(params, tokens, positions, np.ones_like(mask)))[1], ref[1])


@pytest.mark.parametrize("name", ["llama-untied", "qwen2-tied-bias", "gemma2-softcap-window"])
def test_trunk_equals_functional_hidden_states_with_segments(name):
    config = CONFIGS[name]
    params = _random_params(config, seed=3)
    tokens, positions, _ = _inputs(seed=1)
    segments = np.array([[0, 0, 0, 1, 1, 2, 2]] * 2, np.int32)
    trunk = {k: v for k, v in params.items() if k != "lm_head"}
    # Inputs as arguments on both sides (closed-over arrays would be constants XLA may fold): one program, bitwise.
    ours = jax.jit(lambda p, t, q, s: Decoder(config, logits=False).apply({"params": p}, t, q, segment_ids=s))(
        trunk, tokens, positions, segments)
    ref = hidden_jit(params, config, tokens, positions, segment_ids=segments)
    assert ours.shape == (2, 7, config.hidden_size)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


@pytest.mark.parametrize("name,dtype", [("llama-untied", "float32"), ("qwen2-tied-bias", "bfloat16"),
                                        ("qwen3-qknorm-outbias", "float32"), ("gemma3-qknorm-local-rope", "float32")])
def test_module_init_gives_the_init_params_tree(name, dtype):
    config = CONFIGS[name].replace(param_dtype=dtype)
    tokens, positions, _ = _inputs()
    variables = Decoder(config).init(jax.random.key(0), tokens, positions)
    assert set(variables) == {"params"}
    ours = nn.unbox(variables["params"])
    ref = init_params(config, jax.random.key(0))
    assert jax.tree.structure(ours) == jax.tree.structure(ref)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), ours) == jax.tree.map(lambda x: (x.shape, x.dtype), ref)
    assert ("lm_head" in ours) == (not config.tie_word_embeddings)
    # The boxed variables apply as they are, giving forward's logits on the unboxed tree.
    # Inputs as arguments, as forward_jit takes them: the same program, so bitwise.
    boxed_logits = jax.jit(lambda v, t, q: Decoder(config).apply(v, t, q))(variables, tokens, positions)
    np.testing.assert_array_equal(np.asarray(boxed_logits), np.asarray(forward_jit(ours, config, tokens, positions)))
    # The initialisers of init_params: norms 1 (Gemma's (1 + w) norms 0), biases 0, weights N(0, 0.02^2),
    # layers drawn independently.
    layers = ours["layers"]
    unit = 0 if config.is_gemma else 1
    assert all(np.all(np.asarray(v) == unit) for k, v in layers.items() if k.endswith("norm"))
    assert all(np.all(np.asarray(v) == 0) for k, v in layers.items() if k.endswith("bias"))
    assert np.std(np.asarray(ours["embed"], np.float32)) == pytest.approx(0.02, rel=0.05)
    q = np.asarray(layers["q_proj"], np.float32)
    assert not np.array_equal(q[0], q[1])
    # A layer module on its own declares one layer's shapes.
    one = DecoderLayer(config).init(jax.random.key(0))["params"]
    assert {k: v.value.shape for k, v in one.items()} == {k: s[1:] for k, s in param_shapes(config)["layers"].items()}


def test_logical_axes_map_to_the_regex_rules_specs():
    config = CONFIGS["qwen3-qknorm-outbias"]  # every optional layer parameter
    tokens, positions, _ = _inputs()
    boxed = jax.eval_shape(Decoder(config).init, jax.random.key(0), tokens, positions)["params"]
    rules = logical_axis_rules()
    assert dict(rules) == {"vocab": "tensor", "embed": "fsdp", "heads": "tensor", "kv_heads": "tensor",
                           "mlp": "tensor", "layers": None, "norm": None, "head_dim": None, "embed_bias": None,
                           "experts": "expert", "expert_mlp": "tensor",  # a sparse layer's expert axis and widths
                           "router_logits": None}
    ours = nn.logical_to_mesh(nn.get_partition_spec(boxed), rules)
    ref = param_partition_specs(nn.unbox(boxed), partition_rules(config))
    shapes = jax.tree.map(lambda x: x.shape, nn.unbox(boxed))
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    assert jax.tree.structure(ours, is_leaf=is_spec) == jax.tree.structure(ref, is_leaf=is_spec)
    for path, spec in jax.tree_util.tree_leaves_with_path(ref, is_leaf=is_spec):
        rank = len(shapes[path[0].key] if len(path) == 1 else shapes["layers"][path[1].key])
        mine = ours[path[0].key] if len(path) == 1 else ours["layers"][path[1].key]
        assert _padded(mine, rank) == _padded(spec, rank), jax.tree_util.keystr(path)
    # The same NamedShardings as the project's placement on a mesh.
    mesh = make_mesh("")
    flax_shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
    project = param_shardings(nn.unbox(boxed), mesh)
    for a, b, x in zip(jax.tree.leaves(flax_shardings), jax.tree.leaves(project), jax.tree.leaves(nn.unbox(boxed))):
        assert _padded(a.spec, x.ndim) == _padded(b.spec, x.ndim)


def test_regex_rules_a_logical_table_cannot_express_are_refused():
    rules = [(r"^layers/q_proj$", P(None, "tensor", "fsdp")), *partition_rules()]  # q_proj's "embed" on tensor
    with pytest.raises(ValueError, match=r"logical axis 'embed' on 'fsdp' and, in \['layers'\]\['q_proj'\], on "
                                         r"'tensor'"):
        logical_axis_rules(rules)
    # A consistent change is followed: an MLP left unsplit over "tensor" maps "mlp" to no mesh axis.
    unsplit_mlp = [(r"^layers/(gate|up)_proj$", P(None, "fsdp", None)), (r"^layers/down_proj$", P(None, None, "fsdp")),
                   *partition_rules()]
    assert dict(logical_axis_rules(unsplit_mlp)) == {**dict(logical_axis_rules()), "mlp": None}


def test_value_model_trains_one_step_from_policy_weights():
    config = CONFIGS["llama-untied"]
    policy = _random_params(config, seed=5)
    tokens, positions, mask = _inputs(seed=2)
    model = ValueModel(config)
    params = model.init(jax.random.key(0), tokens, positions)["params"]
    # The trunk is named as the policy: the policy's weights (without lm_head) initialise it.
    trunk = {k: v for k, v in policy.items() if k != "lm_head"}
    assert jax.tree.structure(nn.unbox(params["trunk"])) == jax.tree.structure(trunk)
    params = {"trunk": trunk, "value_head": nn.unbox(params["value_head"])}
    values = model.apply({"params": params}, tokens, positions, attention_mask=mask)
    assert values.shape == (2, 7) and values.dtype == jnp.float32
    hidden = hidden_jit(policy, config, tokens, positions, attention_mask=mask)
    head = params["value_head"]
    np.testing.assert_allclose(np.asarray(values), np.asarray(hidden @ head["kernel"] + head["bias"])[..., 0],
                               rtol=1e-5, atol=1e-6)

    targets = jnp.asarray(np.random.RandomState(0).normal(size=(2, 7)), jnp.float32)

    def loss_fn(p):
        v = model.apply({"params": p}, tokens, positions, attention_mask=mask)
        return jnp.sum(mask * (v - targets) ** 2) / jnp.sum(mask)

    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(params)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    assert float(jax.jit(loss_fn)(new_params)) < float(loss)
    grad_norms = {jax.tree_util.keystr(path): float(jnp.linalg.norm(g.astype(jnp.float32).ravel()))
                  for path, g in jax.tree_util.tree_leaves_with_path(grads)}
    assert all(norm > 0 for norm in grad_norms.values()), grad_norms
    assert set(grad_norms) >= {"['value_head']['kernel']", "['trunk']['embed']", "['trunk']['layers']['q_proj']"}
