"""generate on a simulated 8-device CPU mesh (data=2, fsdp=2, tensor=2) gives the single-device
results. Runs in a subprocess because the device count is fixed when JAX starts."""

import textwrap

from simulated_mesh import run_on_devices

SCRIPT = textwrap.dedent("""
    import json
    import jax
    import numpy as np
    from jaxrl_llm.models import ModelConfig, init_params
    from jaxrl_llm.models.sharding import make_mesh, shard_params
    from jaxrl_llm.sampling import generate, make_plan

    assert jax.device_count() == 8, jax.devices()
    config = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, tie_word_embeddings=False, max_position_embeddings=256)
    params = init_params(config, jax.random.key(0))
    params["embed"] = params["embed"] * 3.0
    params["lm_head"] = params["lm_head"] * 3.0
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    sharded = shard_params(params, mesh)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13]]
    results = {}
    # "grouped": 8 samples of two prompts share prompt entries, 8 rows per entry on one device and 4 (a device's
    # rows) on the mesh (`buckets.prompt_group_size`)
    for name, counts, kwargs in [("greedy", [3, 0, 5, 2], dict(temperature=0.0)),
                                 ("sampled", [3, 0, 5, 2], dict(temperature=0.8, top_k=8, top_p=0.9)),
                                 ("grouped", [8, 0, 8, 0], dict(temperature=0.8))]:
        single = generate(params, config, prompts, num_samples=counts, max_new_tokens=12, stop_ids=(5,),
                          rng=jax.random.key(3), **kwargs)
        multi = generate(params if name == "greedy" else sharded, config, prompts, num_samples=counts, max_new_tokens=12, stop_ids=(5,),
                         rng=jax.random.key(3), mesh=mesh, **kwargs)
        results[name] = dict(
            tokens_equal=bool(np.array_equal(single.tokens, multi.tokens)),
            lengths_equal=bool(np.array_equal(single.lengths, multi.lengths)),
            finish_equal=bool(np.array_equal(single.finish_reason, multi.finish_reason)),
            logprob_diff=float(np.abs(single.logprobs - multi.logprobs).max()),
            rows=int(single.tokens.shape[0]),
            prompt_entries=(make_plan(np.array([len(p) for p in prompts]), np.array(counts), 12).row_bucket
                            // make_plan(np.array([len(p) for p in prompts]), np.array(counts), 12).prompt_group),
        )
    print("RESULT", json.dumps(results))
""")


def test_mesh_results_equal_single_device():
    results = run_on_devices(["-c", SCRIPT])
    for name, r in results.items():
        assert r["rows"] == (16 if name == "grouped" else 10)
        assert r["prompt_entries"] == (2 if name == "grouped" else 16)
        # Sharded programs sum in other orders: log-probs to f32 rounding. Tokens exactly: each row draws with the
        # same key on both, and a draw (32 tokens, ~120 a run) moves only within ~1e-6 of a CDF boundary (greedy:
        # the top two logits are >= 0.02 apart).
        assert r["tokens_equal"] and r["lengths_equal"] and r["finish_equal"], (name, r)
        assert r["logprob_diff"] < 1e-5, (name, r)
