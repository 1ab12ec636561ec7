"""Pure-functional decoder for the Llama / Qwen2 / Qwen3 / Mistral / Gemma 2 / Gemma 3 families and the Qwen3-MoE,
Mixtral and gpt-oss mixtures of experts (`models.moe`), with a static KV cache.

Parameters are a plain nested dict (see `init_params` for the key names). Transformer layers are
stacked on a leading `num_layers` axis and run by `jax.lax.scan`, so one layer is compiled whatever
the depth (`config.scan_layers=False` unrolls them in the training forward); `config.remat`
wraps the layer in `jax.checkpoint` (saving what `config.remat_policy` names: the forward pass tags
its projection outputs, q, k, v and the attention output with `checkpoint_name`). Every function takes
the config as a plain argument: jit with `static_argnums=1` (ModelConfig is hashable).

Layers that differ (Gemma's sliding-window layers with their own RoPE base) stay one stacked, scanned
layer: the differences are per-layer arrays (`layer_constants`) scanned alongside the parameters. A model that
mixes dense and sparse (mixture-of-experts) layers (Qwen3-MoE's `decoder_sparse_step`, `mlp_only_layers`) stacks
both blocks' parameters in every layer, the unused block's weights zeros (kept by training: no gradient reaches
them), and each layer runs its own block under a `lax.cond` on its "sparse" constant; a model whose layers are
all of one kind stores only that block.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.attention import self_attention
from jaxrl_llm.models.layers import (adapted_dense, apply_rope, attention, attention_keep_mask, einsum_f32, gated_mlp,
                                    rms_norm, rope_attention_factor, rope_inv_freq, soft_cap)
from jaxrl_llm.models.moe import LayerRoutes, empty_routes, moe_block
from jaxrl_llm.models.quant import layer_weight

Params = dict


class KVCache(NamedTuple):
    """Keys and values for every layer: k, v of shape [num_layers, B, S, num_kv_heads, head_dim].
    Slot s of a row holds the key/value of that row's token at absolute position s."""

    k: jax.Array
    v: jax.Array


def _layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer parameter shapes (without the stacked layer axis); matrices are [in, out]. A sparse layer's
    experts are [E, in, out] ("expert_gate", "expert_up", "expert_down") with the router [D, E]."""
    d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    shapes = {
        "attn_norm": (d,),
        "q_proj": (d, q_out),
        "k_proj": (d, kv_out),
        "v_proj": (d, kv_out),
        "o_proj": (q_out, d),
        "mlp_norm": (d,),
    }
    sparse = config.sparse_layers()
    if not all(sparse):
        shapes.update(gate_proj=(d, f), up_proj=(d, f), down_proj=(f, d))
    if any(sparse):
        e, fe = config.num_experts, config.expert_intermediate_size
        shapes.update(router=(d, e), expert_gate=(e, d, fe), expert_up=(e, d, fe), expert_down=(e, fe, d))
        if config.expert_biases:  # gpt-oss
            shapes.update(router_bias=(e,), expert_gate_bias=(e, fe), expert_up_bias=(e, fe), expert_down_bias=(e, d))
    if config.attention_bias:
        shapes.update(q_bias=(q_out,), k_bias=(kv_out,), v_bias=(kv_out,))
    if config.attention_out_bias:
        shapes["o_bias"] = (d,)
    if config.qk_norm:
        shapes.update(q_norm=(hd,), k_norm=(hd,))
    if config.is_gemma:  # sandwich norms: on the attention output and on the MLP output
        shapes.update(post_attn_norm=(d,), post_mlp_norm=(d,))
    if config.attention_sinks:  # gpt-oss: one logit per query head in its softmax's denominator
        shapes["attn_sinks"] = (config.num_heads,)
    return shapes


def param_shapes(config: ModelConfig) -> Params:
    """The parameter tree of `init_params` as shapes: {"embed": [V, D], "layers": {name: [L, ...]},
    "final_norm": [D], "lm_head": [D, V] (only when the output embedding is not tied)}."""
    shapes = {
        "embed": (config.vocab_size, config.hidden_size),
        "layers": {k: (config.num_layers, *s) for k, s in _layer_shapes(config).items()},
        "final_norm": (config.hidden_size,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.hidden_size, config.vocab_size)
    return shapes


def init_params(config: ModelConfig, rng: jax.Array) -> Params:
    """Random parameters as transformers initialises these models: weights ~ N(0, 0.02^2),
    norm weights 1 (0 for Gemma, whose norms scale by 1 + w), biases 0; stored in `config.param_dtype`. Where dense
    and sparse layers mix, each layer's unused block (the dense MLP of a sparse layer, the experts and router of a
    dense one) is zeros."""
    return _init_params_jit(config, rng)


@functools.partial(jax.jit, static_argnums=0)
def _init_params_jit(config: ModelConfig, rng: jax.Array) -> Params:
    dtype = jnp.dtype(config.param_dtype)
    shapes = param_shapes(config)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    sizes = [math.prod(shape) for _, shape in flat]
    # One draw sliced into pieces: a single RNG kernel compiles much faster than one per leaf.
    noise = 0.02 * jax.random.normal(rng, (sum(sizes),), jnp.float32)
    leaves, offset = [], 0
    for (path, shape), size in zip(flat, sizes):
        name = path[-1].key
        if name.endswith("norm"):
            leaves.append((jnp.zeros if config.is_gemma else jnp.ones)(shape, dtype))
        elif name.endswith("bias"):
            leaves.append(jnp.zeros(shape, dtype))
        else:
            leaves.append(noise[offset:offset + size].reshape(shape).astype(dtype))
        offset += size
    params = jax.tree_util.tree_unflatten(treedef, leaves)
    sparse = np.array(config.sparse_layers())
    if len(set(sparse)) > 1:  # dense and sparse layers mixed: each layer's unused block is zeros
        layers = params["layers"]
        for names, used in ((_DENSE_BLOCK, ~sparse), (_SPARSE_BLOCK, sparse)):
            for name in (n for n in names if n in layers):
                layers[name] = layers[name] * jnp.asarray(used, dtype).reshape(-1, *(1,) * (layers[name].ndim - 1))
    return params


_DENSE_BLOCK = ("gate_proj", "up_proj", "down_proj")
_SPARSE_BLOCK = ("router", "router_bias", "expert_gate", "expert_up", "expert_down", "expert_gate_bias",
                 "expert_up_bias", "expert_down_bias")


_NO_WINDOW = np.iinfo(np.int32).max  # the window of a full-attention layer among sliding ones


def layer_constants(config: ModelConfig, layer: int | None = None) -> dict:
    """What distinguishes the layers besides their parameters. With `layer`, that layer's static values:
    {"window": sliding window or None, "inv_freq": its RoPE inverse frequencies, "sparse": whether its
    feed-forward block is the mixture of experts}. Without, the arrays to scan with the stacked layers: "window"
    int32 [L] (a full layer's is int32 max) when some layer slides, "inv_freq" [L, head_dim/2] when the sliding
    layers have their own RoPE base, "sparse" bool [L] when dense and sparse layers mix; absent keys mean the
    config's defaults (no window, `rope_inv_freq(config)`, every layer's block the same)."""
    sliding = config.sliding_layers()
    if layer is not None:
        return {"window": config.sliding_window if sliding[layer] else None,
                "inv_freq": rope_inv_freq(config, local=sliding[layer]), "sparse": config.sparse_layers()[layer]}
    out = {}
    if len(set(config.sparse_layers())) > 1:
        out["sparse"] = np.array(config.sparse_layers())
    if any(sliding):
        out["window"] = np.array([config.sliding_window if s else _NO_WINDOW for s in sliding], np.int32)
        if config.rope_local_theta is not None:
            out["inv_freq"] = np.stack([rope_inv_freq(config, local=s) for s in sliding])
    return out


def norm(x: jax.Array, weight: jax.Array, config: ModelConfig) -> jax.Array:
    """The family's RMSNorm: w * x / rms(x), or (1 + w) * x / rms(x) for Gemma (`layers.rms_norm`; gpt-oss and
    Gemma take the weight's product in float32)."""
    return rms_norm(x, weight, config.rms_norm_eps, unit_offset=config.is_gemma,
                    float32_product=config.model_type == "gpt_oss")


def attend(q: jax.Array, k: jax.Array, v: jax.Array, keep: jax.Array, config: ModelConfig,
           sinks: jax.Array | None = None) -> jax.Array:
    """`layers.attention` with the family's score scale and soft-cap, and a layer's attention `sinks` [H]."""
    return attention(q, k, v, keep, scale=config.attention_scale, softcap=config.attn_logit_softcapping, sinks=sinks)


def _project_qkv(lp: Params, config: ModelConfig, h: jax.Array, positions: jax.Array, inv_freq=None):
    """q [B,T,H,hd], k, v [B,T,KV,hd] for one layer, with biases, q/k norm and RoPE (`inv_freq`,
    default the full layers' `rope_inv_freq(config)`) applied."""
    batch, length, _ = h.shape
    dtype = h.dtype
    q, k, v = (checkpoint_name(_project(lp, f"{n}_proj", h), f"{n}_proj") for n in "qkv")
    if config.attention_bias:
        q, k, v = q + lp["q_bias"].astype(dtype), k + lp["k_bias"].astype(dtype), v + lp["v_bias"].astype(dtype)
    q = q.reshape(batch, length, config.num_heads, config.head_dim)
    k = k.reshape(batch, length, config.num_kv_heads, config.head_dim)
    v = v.reshape(batch, length, config.num_kv_heads, config.head_dim)
    if config.qk_norm:  # Qwen3, Gemma 3: RMSNorm over head_dim before the rotation
        q = norm(q, lp["q_norm"], config)
        k = norm(k, lp["k_norm"], config)
    inv_freq = rope_inv_freq(config) if inv_freq is None else inv_freq
    scale = rope_attention_factor(config)
    return apply_rope(q, positions, inv_freq, scale), apply_rope(k, positions, inv_freq, scale), v


def _finish_layer(lp: Params, config: ModelConfig, x: jax.Array, attn: jax.Array, sparse=None, moe=None):
    """Output projection + residual, then the pre-norm feed-forward block + residual (`feed_forward`; for Gemma
    each block's output is normalised again before its residual). With `moe` (`feed_forward`'s routing
    options) returns (x, `LayerRoutes`)."""
    out = checkpoint_name(_project(lp, "o_proj", attn.astype(x.dtype)), "o_proj")
    if config.attention_out_bias:
        out = out + lp["o_bias"].astype(x.dtype)
    if config.is_gemma:
        out = norm(out, lp["post_attn_norm"], config)
    x = x + out
    mlp = feed_forward(lp, config, norm(x, lp["mlp_norm"], config), sparse, moe)
    routes = None
    if moe is not None:
        mlp, routes = mlp
    if config.is_gemma:
        mlp = norm(mlp, lp["post_mlp_norm"], config)
    return x + mlp if moe is None else (x + mlp, routes)


def _dense_mlp(lp: Params, config: ModelConfig, h: jax.Array) -> jax.Array:
    """The gated MLP (SwiGLU; GeGLU for Gemma), with the layer's LoRA adapters."""
    adapters = {n: _adapter(lp, f"{n}_proj") for n in ("gate", "up", "down")}
    gate, up, down = (layer_weight(lp, f"{n}_proj", h.dtype) for n in ("gate", "up", "down"))
    return gated_mlp(h, gate, up, down, adapters, activation="gelu_tanh" if config.is_gemma else "silu")


def feed_forward(lp: Params, config: ModelConfig, h: jax.Array, sparse=None, moe: dict | None = None):
    """A layer's feed-forward block on h [B, T, D]: the dense gated MLP or, on a sparse layer, the mixture of
    experts (`moe.moe_block`). `sparse` is the layer's "sparse" constant (`layer_constants`), a bool or, in a
    scan over a model that mixes the two kinds, a traced one (both blocks are compiled, a `lax.cond` runs the
    layer's); unneeded (None) when every layer is of one kind.

    `moe` (routing replay and its metrics): a dict of `moe.moe_block`'s `replay` and `token_weight` ([B, T, k]
    and [B, T], either None); given, returns (out, `moe.LayerRoutes`), a dense layer's `moe.empty_routes`."""
    if moe is not None:
        return _feed_forward_routes(lp, config, h, sparse, moe)
    kinds = set(config.sparse_layers())
    if len(kinds) == 1:
        sparse = kinds.pop()
    elif sparse is None:
        raise ValueError("this model mixes dense and sparse layers: pass the layer's `sparse` constant "
                         "(layer_constants) to decoder_layer")
    if isinstance(sparse, (bool, np.bool_)):
        return moe_block(lp, config, h) if sparse else _dense_mlp(lp, config, h)
    return jax.lax.cond(sparse, lambda h: moe_block(lp, config, h), lambda h: _dense_mlp(lp, config, h), h)


def _feed_forward_routes(lp: Params, config: ModelConfig, h: jax.Array, sparse, moe: dict):
    """`feed_forward` with `moe`'s routing options: (out, `LayerRoutes`)."""
    kinds = set(config.sparse_layers())
    sparse = kinds.pop() if len(kinds) == 1 else sparse

    def sparse_block(h):
        return moe_block(lp, config, h, moe.get("replay"), token_weight=moe.get("token_weight"), with_routes=True)

    def dense_block(h):
        return _dense_mlp(lp, config, h), empty_routes(config, h.shape[:-1])

    if isinstance(sparse, (bool, np.bool_)):
        return sparse_block(h) if sparse else dense_block(h)
    return jax.lax.cond(sparse, sparse_block, dense_block, h)


def _adapter(lp: Params, name: str) -> tuple[jax.Array, jax.Array] | None:
    """The LoRA pair (A [in, r], B [r, out]) the layer dict carries for projection `name`, if any
    (keys "{name}_lora_a" / "{name}_lora_b", put there by `models.lora.attach`)."""
    if f"{name}_lora_a" not in lp:
        return None
    return lp[f"{name}_lora_a"], lp[f"{name}_lora_b"]


def _project(lp: Params, name: str, h: jax.Array) -> jax.Array:
    """h W_name (+ the adapter's (h A) B when the layer carries one), in h's dtype; a quantized W
    (`models.quant`) is dequantized here, one layer at a time."""
    return adapted_dense(h, layer_weight(lp, name, h.dtype), _adapter(lp, name))


def decoder_layer(lp: Params, config: ModelConfig, x: jax.Array, positions: jax.Array, attend_fn,
                  inv_freq: jax.Array | None = None, sparse=None, moe: dict | None = None):
    """One decoder layer, the only place its arithmetic lives; every pass of the model (training forward,
    KV-cache forward, the sampler's prefill and decode steps) runs its layers through it.

    h = norm(x); q, k, v = RoPE(projections of h (+ biases, q/k norm)); a = attend_fn(q, k, v);
    x += o_proj(a) (Gemma: normalised first); x += MLP(norm(x)) (Gemma: normalised first), the MLP a mixture of
    experts on a sparse layer (`feed_forward`; `sparse` the layer's constant, needed where dense and sparse
    layers mix).

    lp: one layer's parameters (no stacked axis); x [B, T, D]; positions int32 [B, T] (RoPE angles);
    `inv_freq` the layer's RoPE inverse frequencies (default the full layers' `rope_inv_freq(config)`).
    `attend_fn(q [B,T,H,hd], k [B,T,KV,hd], v [B,T,KV,hd]) -> (attention [B, T, H*hd], aux)` decides
    what the queries see (a causal mask, a KV cache it writes k and v into, ...) and, for gpt-oss, applies the
    layer's attention sinks lp["attn_sinks"]; its `aux` (updated caches, keys to store) is returned beside the
    layer's output: (x [B, T, D], aux).
    The forward pass's remat policies read the `checkpoint_name` tags q, k, v and attn set here.
    With `moe` (`feed_forward`'s routing options: replayed experts, token weights) it returns
    (x, aux, `moe.LayerRoutes`)."""
    h = norm(x, lp["attn_norm"], config)
    q, k, v = (checkpoint_name(a, n) for a, n in zip(_project_qkv(lp, config, h, positions, inv_freq), "qkv"))
    attn, aux = attend_fn(q, k, v)
    out = _finish_layer(lp, config, x, checkpoint_name(attn.astype(x.dtype), "attn"), sparse, moe)
    return (out, aux) if moe is None else (out[0], aux, out[1])


_REMAT_SAVED = {
    "full": None,  # jax.checkpoint's default: save nothing inside the layer
    # keep every projection output (the `checkpoint_name` tags of `dense`'s results), redo attention
    "dots": jax.checkpoint_policies.save_only_these_names("q_proj", "k_proj", "v_proj", "o_proj", "mlp_gate",
                                                          "mlp_up", "mlp_down"),
    # keep the matmul outputs the backward pass reads (q, k, v after RoPE, the attention output, the MLP's
    # gate and up projections; `checkpoint_name` tags), redo the norms, RoPE, q k^T + softmax and SiLU
    "qkv_attn_mlp": jax.checkpoint_policies.save_only_these_names("q", "k", "v", "attn", "mlp_gate", "mlp_up"),
}


def _maybe_remat(fn, config: ModelConfig):
    if not config.remat:
        return fn
    # Inside a scan XLA cannot merge the recomputation with the forward pass; unrolled layers need the
    # barrier that prevent_cse adds, or the rematerialisation may be optimised away.
    return jax.checkpoint(fn, prevent_cse=not config.scan_layers, policy=_REMAT_SAVED[config.remat_policy])


def embed_tokens(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """The decoder's input x_0 = embed[tokens] in the compute dtype, [..., D]; Gemma multiplies by
    sqrt(hidden) in the embedding's dtype."""
    x = jnp.take(params["embed"], tokens, axis=0)
    if config.is_gemma:
        x = x * jnp.asarray(config.hidden_size ** 0.5, x.dtype)
    return x.astype(jnp.dtype(config.compute_dtype))


def hidden_states(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
                  *, attention_mask: jax.Array | None = None, segment_ids: jax.Array | None = None,
                  slots: int | None = None, response_len: int | None = None, replay: jax.Array | None = None,
                  token_weight: jax.Array | None = None, with_routes: bool = False):
    """Final-norm hidden states [B, T, D] of the pre-norm decoder (Llama / Qwen2 / Qwen3 / Mistral):
    x_0 = embed[tokens]; per layer x += Attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x)); out = RMSNorm(x).
    Gemma: x_0 = sqrt(D) embed[tokens]; x += RMSNorm(Attn(RMSNorm(x))); x += RMSNorm(GeGLU(RMSNorm(x))).
    A sliding layer also drops keys at positions <= query position - `config.sliding_window`.

    Attention is causal by position: query i sees key j iff positions[j] <= positions[i] and
    attention_mask[j] != 0 (when a mask is given) and, with `segment_ids`, segment[j] is segment[i] or
    0. Packing several responses after one shared prompt (segment 0), each response restarting its
    positions where the prompt ends, gives every response exactly the logits of its own unpacked row.
    tokens, positions, segment_ids: int32 [B, T].

    How attention is computed is `models.attention.self_attention`'s choice (`config.attention_impl`): on XLA,
    with `config.attention_block_size` set, in query x key tiles of that size with an online softmax
    (`layers.blocked_attention`) for rows of at least `config.attention_block_min_length` tokens, else full
    attention; the fused kernels (splash on TPU) take packed rows regrouped per response, sized by `slots`
    (responses per packed row) and `response_len` (their token slots).

    Routing replay (a mixture of experts): `replay` [B, T, L_sparse, k] sends each token with a record (entries
    >= 0) to those experts in each sparse layer (`moe.route`), -1 entries take the layer's own top k. With
    `with_routes` (or `replay`) returns (hidden, `moe.LayerRoutes` of the sparse layers: own and chosen
    [B, T, L_sparse, k], load and prob_sum [L_sparse, E] weighted by `token_weight` [B, T]).
    """
    length = tokens.shape[1]
    keep = None
    if config.attention_impl in ("auto", "xla") and config.attention_block_for(length) is None:
        # Packed rows: a token sees its own segment and segment 0 (a shared prefix such as the prompt).
        keep = attention_keep_mask(positions, positions, q_segments=segment_ids, k_segments=segment_ids,
                                   key_mask=attention_mask)  # [B, T(query), T(key)], once for every layer

    routed = (replay is not None or with_routes) and any(config.sparse_layers())

    def layer(x, layer_in):
        lp, const, *replayed = layer_in

        def attend_fn(q, k, v):
            return self_attention(q, k, v, positions, config, segment_ids=segment_ids, key_mask=attention_mask,
                                  window=const.get("window"), keep=keep, slots=slots, response_len=response_len,
                                  sinks=lp.get("attn_sinks")), None

        args = (lp, config, x, positions, attend_fn, const.get("inv_freq"), const.get("sparse"))
        if not routed:
            return decoder_layer(*args)
        x, _, routes = decoder_layer(*args, {"replay": replayed[0], "token_weight": token_weight})
        return x, routes

    layers = (params["layers"], layer_constants(config))
    if routed:
        layers = (*layers, _replay_per_layer(config, replay))
    out = _run_layers(_maybe_remat(layer, config), embed_tokens(params, config, tokens), layers,
                      config.scan_layers, collect=routed)
    if not routed:
        hidden = norm(out, params["final_norm"], config)
        return (hidden, None) if with_routes else hidden
    return norm(out[0], params["final_norm"], config), sparse_layer_routes(config, out[1])


def _replay_per_layer(config: ModelConfig, replay: jax.Array | None):
    """Recorded experts [B, T, L_sparse, k] laid out per stacked layer [L, B, T, k] (-1 on dense layers), or None."""
    if replay is None:
        return None
    per_sparse = jnp.moveaxis(replay, 2, 0)
    sparse = np.flatnonzero(config.sparse_layers())
    if len(sparse) == config.num_layers:
        return per_sparse
    return jnp.full((config.num_layers, *per_sparse.shape[1:]), -1, replay.dtype).at[sparse].set(per_sparse)


def sparse_layer_routes(config: ModelConfig, routes: LayerRoutes) -> LayerRoutes:
    """Per-layer routes stacked [L, ...] -> the sparse layers' only: experts [B, T, L_sparse, k], sums
    [L_sparse, E]."""
    sparse = np.flatnonzero(config.sparse_layers())
    pick = (lambda a: a) if len(sparse) == config.num_layers else (lambda a: a[sparse])
    return LayerRoutes(*(jnp.moveaxis(pick(a), 0, 2) for a in routes[:2]), *(pick(a) for a in routes[2:]))


def _run_layers(layer, x: jax.Array, layers, scan: bool = True, collect: bool = False):
    """x after every stacked layer in turn: a `lax.scan` (one compiled layer) or unrolled (each layer
    compiled on its own: longer compiles; on CPU about as fast at 12 layers and 10% slower at SmolLM2's 30,
    measured on the train step, benchmarks/README.md). With `collect`, (x, each layer's second output stacked)."""
    if scan:
        x, ys = jax.lax.scan(layer, x, layers)
        return (x, ys) if collect else x
    outs = []
    for i in range(jax.tree_util.tree_leaves(layers)[0].shape[0]):
        x, y = layer(x, jax.tree_util.tree_map(lambda w: w[i], layers))
        outs.append(y)
    if collect:
        return x, jax.tree_util.tree_map(lambda *ys: jnp.stack(ys), *outs)
    return x


def output_logits(params: Params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Logits hidden @ W_out in float32, W_out = embed^T when the output embedding is tied,
    else lm_head [D, V]; soft-capped to c tanh(l / c) with `config.final_logit_softcapping` c (Gemma 2).
    hidden: [..., D] -> [..., V]."""
    dtype = jnp.dtype(config.compute_dtype)
    hidden = hidden.astype(dtype)
    if config.tie_word_embeddings:
        logits = einsum_f32("...d,vd->...v", hidden, params["embed"].astype(dtype))
    else:
        logits = einsum_f32("...d,dv->...v", hidden, params["lm_head"].astype(dtype))
    return soft_cap(logits, config.final_logit_softcapping)


def forward(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
            *, attention_mask: jax.Array | None = None) -> jax.Array:
    """Logits [B, T, V] float32 = output_logits(hidden_states(...)); see `hidden_states`."""
    hidden = hidden_states(params, config, tokens, positions, attention_mask=attention_mask)
    return output_logits(params, config, hidden)


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """A zero cache for `batch` rows of up to `max_len` positions, in `dtype`
    (default: config.compute_dtype)."""
    dtype = jnp.dtype(dtype or config.compute_dtype)
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def forward_cached(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
                   cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Logits [B, T, V] float32 for a chunk of tokens, reading and updating a KV cache.

    Each token's key/value is written to cache slot = its absolute position (per row; positions
    may differ across rows; positions >= max_len are dropped), then a query at position p attends
    to slots s <= p of its row. Serves prefill (T = prompt bucket, positions = arange) and decode
    (T = 1). Right padding is safe: a pad token's slot is overwritten by the real token that later
    takes that position before any query at or beyond it reads the slot.
    """
    batch = tokens.shape[0]
    max_len = cache.k.shape[2]
    keep = jnp.arange(max_len)[None, None, :] <= positions[:, :, None]  # [B, T, S]
    rows = jnp.arange(batch)[:, None]

    def layer(x, layer_in):
        lp, const, k_cache, v_cache = layer_in

        def attend_fn(q, k, v):
            k_all = k_cache.at[rows, positions].set(k.astype(k_cache.dtype), mode="drop")
            v_all = v_cache.at[rows, positions].set(v.astype(v_cache.dtype), mode="drop")
            layer_keep = keep
            if "window" in const:
                layer_keep = keep & (positions[:, :, None] - jnp.arange(max_len)[None, None, :] < const["window"])
            return attend(q, k_all.astype(q.dtype), v_all.astype(q.dtype), layer_keep, config,
                          lp.get("attn_sinks")), (k_all, v_all)

        return decoder_layer(lp, config, x, positions, attend_fn, const.get("inv_freq"), const.get("sparse"))

    x, (k_new, v_new) = jax.lax.scan(
        _maybe_remat(layer, config), embed_tokens(params, config, tokens),
        (params["layers"], layer_constants(config), cache.k, cache.v)
    )
    hidden = norm(x, params["final_norm"], config)
    return output_logits(params, config, hidden), KVCache(k_new, v_new)
