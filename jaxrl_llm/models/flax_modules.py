"""Flax `linen` definitions of the decoder: the parameters declared with their initialisers and logical
sharding axes, the computation left to the pure functions of `models.model`.

`Decoder(config).init` gives exactly the pytree of `init_params(config, rng)` (same keys, shapes,
dtypes and stacked-layer layout), boxed in `nn.LogicallyPartitioned`; `Decoder(config).apply` runs
`hidden_states` and `output_logits` on it, so its logits are bitwise those of `forward`. With
`logits=False` the decoder is a trunk for a head of one's own (`ValueModel` is one).

The logical axis names label the dimensions of each parameter; the mesh axis each name maps to is
read off the regex rules of `models.sharding` (`logical_axis_rules`), the one table of placements.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.model import hidden_states, output_logits, param_shapes
from jaxrl_llm.models.sharding import param_partition_specs, partition_rules

# Logical names of each parameter's dimensions (without the stacked layer axis, named "layers").
LAYER_AXES = {
    "attn_norm": ("norm",),
    "q_proj": ("embed", "heads"),
    "k_proj": ("embed", "kv_heads"),
    "v_proj": ("embed", "kv_heads"),
    "o_proj": ("heads", "embed"),
    "mlp_norm": ("norm",),
    "gate_proj": ("embed", "mlp"),
    "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"),
    "q_bias": ("heads",),
    "k_bias": ("kv_heads",),
    "v_bias": ("kv_heads",),
    "o_bias": ("embed_bias",),  # the regex rules replicate it, unlike the matrices' model dimension
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "post_attn_norm": ("norm",),
    "post_mlp_norm": ("norm",),
    "attn_sinks": ("heads",),
    "router": ("embed", "router_logits"),  # the router's E replicated: named apart from the experts' split E
    "router_bias": ("router_logits",),
    "expert_gate": ("experts", "embed", "expert_mlp"),  # the experts' width: named apart from the dense MLP's
    "expert_up": ("experts", "embed", "expert_mlp"),
    "expert_down": ("experts", "expert_mlp", "embed"),
    "expert_gate_bias": ("experts", "expert_mlp"),
    "expert_up_bias": ("experts", "expert_mlp"),
    "expert_down_bias": ("experts", "embed_bias"),
}
TOP_AXES = {"embed": ("vocab", "embed"), "final_norm": ("norm",), "lm_head": ("embed", "vocab")}
LAYER_AXIS = "layers"


def _initialiser(name: str, config: ModelConfig):
    """As `init_params` (transformers' init): norm weights 1 (0 for Gemma's (1 + w) norms), biases 0,
    other weights N(0, 0.02^2)."""
    if name.endswith("norm"):
        return nn.initializers.zeros if config.is_gemma else nn.initializers.ones
    if name.endswith("bias"):
        return nn.initializers.zeros
    return nn.initializers.normal(stddev=0.02)


def _declare(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str, ...], dtype) -> jax.Array:
    init = _initialiser(name, module.config)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def param_logical_axes(config: ModelConfig) -> dict:
    """The tree of `param_shapes(config)` holding each parameter's logical axis names."""
    shapes = param_shapes(config)
    axes = {name: TOP_AXES[name] for name in shapes if name != "layers"}
    axes["layers"] = {name: (LAYER_AXIS, *LAYER_AXES[name]) for name in shapes["layers"]}
    return axes


def logical_axis_rules(rules: list[tuple[str, P]] | None = None) -> tuple[tuple[str, str | None], ...]:
    """Flax logical axis rules ((logical name, mesh axis or None), ...) read off the regex rules
    (default `sharding.partition_rules()`): every parameter's PartitionSpec is paired dimension by
    dimension with its logical names. Raises ValueError when the regex rules put one logical name on
    two different mesh axes, since no logical table could then reproduce them."""
    # Every optional parameter present (a dense and a sparse layer among them), so every name and rule is seen.
    config = ModelConfig(vocab_size=2, hidden_size=2, intermediate_size=2, num_layers=2, num_heads=1,
                         num_kv_heads=1, head_dim=2, attention_bias=True, attention_out_bias=True, qk_norm=True,
                         num_experts=2, num_experts_per_tok=1, decoder_sparse_step=2, model_type="gpt_oss")
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), param_shapes(config), is_leaf=is_axes)
    specs = param_partition_specs(shapes, partition_rules(config) if rules is None else rules)
    mesh_of = {}
    for (path, axes), spec in zip(jax.tree_util.tree_leaves_with_path(param_logical_axes(config), is_leaf=is_axes),
                                  jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        for name, mesh_axis in zip(axes, tuple(spec) + (None,) * (len(axes) - len(spec))):
            if mesh_of.setdefault(name, mesh_axis) != mesh_axis:
                raise ValueError(f"the partition rules put logical axis {name!r} on {mesh_of[name]!r} and, in "
                                 f"{jax.tree_util.keystr(path)}, on {mesh_axis!r}")
    return tuple(mesh_of.items())


class DecoderLayer(nn.Module):
    """Declares one transformer layer's parameters (`param_shapes(config)["layers"]` without the
    layer axis) and returns them as a dict; `Decoder` stacks `num_layers` of them with `nn.vmap`,
    and the layer's computation is `hidden_states`'s scanned layer."""

    config: ModelConfig

    @nn.compact
    def __call__(self) -> dict:
        dtype = jnp.dtype(self.config.param_dtype)
        return {name: _declare(self, name, shape[1:], LAYER_AXES[name], dtype)
                for name, shape in param_shapes(self.config)["layers"].items()}


class Decoder(nn.Module):
    """The decoder of `config` as a Flax module: parameters {"embed", "layers", "final_norm",
    "lm_head" (untied only)} as `init_params` lays them out, output as `forward`:

        logits = Decoder(config).apply({"params": params}, tokens, positions)  # == forward(params, config, ...)

    `logits=False` returns the final-norm hidden states [B, T, D] of `hidden_states` instead and
    declares no lm_head: a trunk for one's own head. `segment_ids` packs rows as `hidden_states` does.
    """

    config: ModelConfig
    logits: bool = True

    @nn.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array, *, attention_mask: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        config, dtype = self.config, jnp.dtype(self.config.param_dtype)
        shapes = param_shapes(config)
        stacked = nn.vmap(DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=(),
                          axis_size=config.num_layers, metadata_params={nn.PARTITION_NAME: LAYER_AXIS})
        params = {
            "embed": _declare(self, "embed", shapes["embed"], TOP_AXES["embed"], dtype),
            "layers": stacked(config, name="layers")(),
            "final_norm": _declare(self, "final_norm", shapes["final_norm"], TOP_AXES["final_norm"], dtype),
        }
        hidden = hidden_states(params, config, tokens, positions, attention_mask=attention_mask,
                               segment_ids=segment_ids)
        if not self.logits:
            return hidden
        if "lm_head" in shapes:
            params["lm_head"] = _declare(self, "lm_head", shapes["lm_head"], TOP_AXES["lm_head"], dtype)
        return output_logits(params, config, hidden)


class ValueModel(nn.Module):
    """A scalar value per token: the decoder trunk (`Decoder(config, logits=False)`, parameters under
    "trunk" named as the policy's, without lm_head) and a float32 Dense(1) head "value_head" on its
    final-norm hidden states. Returns values [B, T] float32.

    A policy's parameters initialise the trunk: params["trunk"] = policy params without "lm_head".
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array, *, attention_mask: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        hidden = Decoder(self.config, logits=False, name="trunk")(
            tokens, positions, attention_mask=attention_mask, segment_ids=segment_ids)
        head = nn.Dense(1, dtype=jnp.float32, param_dtype=jnp.float32, name="value_head",
                        kernel_init=nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02), ("embed", None)),
                        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (None,)))
        return head(hidden.astype(jnp.float32))[..., 0]
