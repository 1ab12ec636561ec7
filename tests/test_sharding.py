"""Sharding rules and meshes; the 8-device checks run in a subprocess with a simulated CPU mesh."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.models.sharding import make_mesh, param_partition_specs, partition_rules, shard_params

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16)


def _run_on_8_devices(code: str) -> dict:
    """Run `code` (which prints one JSON line last) in a fresh interpreter with 8 CPU devices."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_partition_specs_follow_the_rules():
    config = ModelConfig(**TINY, model_type="qwen2", attention_bias=True)
    specs = param_partition_specs(init_params(config, jax.random.key(0)), partition_rules(config))
    assert specs["embed"] == P("tensor", "fsdp")
    assert specs["lm_head"] == P("fsdp", "tensor")
    assert specs["final_norm"] == P()
    layers = specs["layers"]
    for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert layers[name] == P(None, "fsdp", "tensor"), name
    assert layers["o_proj"] == layers["down_proj"] == P(None, "tensor", "fsdp")
    assert layers["q_bias"] == layers["v_bias"] == P(None, "tensor")
    assert layers["attn_norm"] == layers["mlp_norm"] == P()


def test_unmatched_parameter_is_named():
    with pytest.raises(ValueError, match=r"no partition rule matches parameter 'layers/mystery'"):
        param_partition_specs({"layers": {"mystery": np.zeros((2, 3))}}, partition_rules())


def test_make_mesh_on_one_device():
    mesh = make_mesh("")
    assert mesh.axis_names == ("data", "fsdp", "expert", "tensor")
    assert dict(mesh.shape) == {"data": 1, "fsdp": jax.device_count(), "expert": 1, "tensor": 1}
    with pytest.raises(ValueError, match=r"do not multiply to the 1 available devices"):
        make_mesh("data=2,tensor=2", devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"expected comma-separated axis=size"):
        make_mesh("model=2")
    with pytest.raises(ValueError, match=r"size of 'fsdp' must be an integer"):
        make_mesh("fsdp=two")


def test_shard_params_on_one_device_keeps_values():
    config = ModelConfig(**TINY)
    params = init_params(config, jax.random.key(0))
    sharded = shard_params(params, make_mesh(""))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, sharded)


def test_mesh_strings_and_uneven_dimensions_on_8_devices():
    result = _run_on_8_devices("""
        import json, jax, numpy as np
        from jaxrl_llm.models.sharding import make_mesh, shard_params
        shapes = {s: dict(make_mesh(s).shape) for s in ["data=2,fsdp=2,tensor=2", "fsdp=-1,tensor=2", ""]}
        mesh = make_mesh("fsdp=4,tensor=2")
        # embed [V=6, D=8]: 6 is not divisible by tensor=2*... it is; 5 below is not
        params = shard_params({"embed": np.ones((5, 8), np.float32), "lm_head": np.ones((8, 6), np.float32)}, mesh)
        print(json.dumps({"shapes": shapes,
                          "embed_shard": params["embed"].addressable_shards[0].data.shape,
                          "head_shard": params["lm_head"].addressable_shards[0].data.shape}))
    """)
    assert result["shapes"]["data=2,fsdp=2,tensor=2"] == {"data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
    assert result["shapes"]["fsdp=-1,tensor=2"] == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2}
    assert result["shapes"][""] == {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}
    assert result["embed_shard"] == [5, 2]  # vocab 5 does not divide by tensor=2: replicated; D split by fsdp
    assert result["head_shard"] == [2, 3]


def test_forward_on_fsdp4_tensor2_mesh_equals_single_device():
    result = _run_on_8_devices("""
        import json, jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding
        from jaxrl_llm.models import ModelConfig, init_params, forward, forward_cached, init_cache
        from jaxrl_llm.models.sharding import BATCH_SPEC, cache_shardings, make_mesh, shard_params

        assert jax.device_count() == 8
        config = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                             num_heads=4, num_kv_heads=2, head_dim=16, model_type="qwen2",
                             attention_bias=True)
        params = jax.tree.map(lambda x: x * 5.0, init_params(config, jax.random.key(0)))
        tokens = np.random.RandomState(0).randint(0, 128, (4, 10)).astype(np.int32)
        positions = np.tile(np.arange(10, dtype=np.int32), (4, 1))
        fwd = jax.jit(forward, static_argnums=1)
        single = np.asarray(fwd(params, config, tokens, positions))

        mesh = make_mesh("fsdp=4,tensor=2")
        sharded = shard_params(params, mesh)
        batch = NamedSharding(mesh, BATCH_SPEC)
        logits = fwd(sharded, config, jax.device_put(tokens, batch), jax.device_put(positions, batch))
        cache = init_cache(config, 4, 16)
        cache = jax.device_put(cache, cache_shardings(cache, mesh))
        cached, cache = jax.jit(forward_cached, static_argnums=1)(
            sharded, config, jax.device_put(tokens, batch), jax.device_put(positions, batch), cache)
        print(json.dumps({
            "diff": float(np.abs(np.asarray(logits) - single).max()),
            "cached_diff": float(np.abs(np.asarray(cached) - single).max()),
            "scale": float(np.abs(single).max()),
            "q_shard": sharded["layers"]["q_proj"].addressable_shards[0].data.shape,
            "devices": len(sharded["layers"]["q_proj"].sharding.device_set),
            "cache_shard": cache.k.addressable_shards[0].data.shape,
        }))
    """)
    assert result["devices"] == 8
    assert result["q_shard"] == [2, 16, 32]  # [L, D/fsdp, (H*hd)/tensor]
    assert result["cache_shard"] == [2, 1, 16, 1, 16]  # [L, B/(data*fsdp), S, KV/tensor, hd]
    assert result["scale"] > 0.5
    # sharded matmuls sum in a different order: equal up to float32 rounding (measured 3.5e-5 at scale 17)
    assert result["diff"] <= 1e-5 * result["scale"]
    assert result["cached_diff"] <= 1e-5 * result["scale"]


def test_gemma3_forward_and_sampling_on_a_data2_fsdp2_tensor2_mesh_equal_single_device():
    """Gemma 3 (sliding and full layers with their own RoPE bases, q/k norms, GeGLU, sandwich norms): the
    packed-row training forward, the KV-cache forward and greedy sampling on 8 simulated devices."""
    result = _run_on_8_devices("""
        import json, jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding
        from jaxrl_llm.models import ModelConfig, init_params, forward_cached, hidden_states, init_cache
        from jaxrl_llm.models.sharding import BATCH_SPEC, cache_shardings, make_mesh, shard_params
        from jaxrl_llm.sampling import generate

        assert jax.device_count() == 8
        config = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                             num_kv_heads=2, head_dim=16, model_type="gemma3_text", qk_norm=True,
                             tie_word_embeddings=True, query_pre_attn_scalar=24, sliding_window=3,
                             layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                             rope_theta=1e6, rope_local_theta=1e4)
        leaves, treedef = jax.tree.flatten(init_params(config, jax.random.key(0)))
        keys = jax.random.split(jax.random.key(1), len(leaves))
        params = jax.tree.unflatten(treedef, [0.3 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])
        tokens = np.random.RandomState(0).randint(0, 128, (4, 10)).astype(np.int32)
        positions = np.tile(np.arange(10, dtype=np.int32), (4, 1))
        segments = np.tile(np.array([0, 0, 0, 1, 1, 1, 2, 2, 2, 2], np.int32), (4, 1))
        hidden = jax.jit(hidden_states, static_argnums=1)
        cached_fwd = jax.jit(forward_cached, static_argnums=1)
        single = np.asarray(hidden(params, config, tokens, positions, segment_ids=segments))
        single_cached = np.asarray(cached_fwd(params, config, tokens, positions, init_cache(config, 4, 16))[0])
        prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]
        single_gen = generate(params, config, prompts, num_samples=2, max_new_tokens=12, temperature=0.0,
                              rng=jax.random.key(0))

        mesh = make_mesh("data=2,fsdp=2,tensor=2")
        sharded = shard_params(params, mesh)
        batch = NamedSharding(mesh, BATCH_SPEC)
        put = lambda x: jax.device_put(x, batch)
        multi = hidden(sharded, config, put(tokens), put(positions), segment_ids=put(segments))
        cache = init_cache(config, 4, 16)
        cache = jax.device_put(cache, cache_shardings(cache, mesh))
        multi_cached = cached_fwd(sharded, config, put(tokens), put(positions), cache)[0]
        multi_gen = generate(sharded, config, prompts, num_samples=2, max_new_tokens=12, temperature=0.0,
                             rng=jax.random.key(0), mesh=mesh)
        print(json.dumps({
            "diff": float(np.abs(np.asarray(multi) - single).max()),
            "cached_diff": float(np.abs(np.asarray(multi_cached) - single_cached).max()),
            "scale": float(np.abs(single_cached).max()),
            "devices": len(sharded["layers"]["q_proj"].sharding.device_set),
            "tokens_equal": bool(np.array_equal(single_gen.tokens, multi_gen.tokens)),
            "logprob_diff": float(np.abs(single_gen.logprobs - multi_gen.logprobs).max()),
        }))
    """)
    assert result["devices"] == 8 and result["scale"] > 0.5
    assert result["diff"] <= 1e-5 * 10  # hidden states after the (1 + w) final norm are O(1)-O(10)
    assert result["cached_diff"] <= 1e-5 * result["scale"]
    # Greedy tokens exactly despite the rounding above: the top two logits along these paths are >= 1.1 apart.
    assert result["tokens_equal"] and result["logprob_diff"] < 1e-4, result
