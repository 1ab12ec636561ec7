"""Sampling throughput on the bundled SmolLM2-135M (float32): jaxrl_llm.sampling beside
google-tunix's Sampler and transformers `generate`, on the same weights in the same run, and beside
the machine's roofline measured with JAX in this script.

    .venv/bin/python benchmarks/sampling.py [--repeats 3] [--shapes 1x1x64,8x8x64,32x8x32] [--skip-peers]

Shapes are prompts x samples x new tokens, with random 64-token prompts; every row runs all its new
tokens (no stop ids; transformers with min_new_tokens, tunix with no eos). Plain temperature-1
sampling (top_k=0 / top_p=1). Prefill time of the peers is the time of the same call with one new
token; their decode time is the rest. Figures are medians over `--repeats` timed runs (after one
warm-up run for the JAX samplers, which compile). google-tunix is only needed here: `pip install --no-deps google-tunix==0.1.7
google-metrax==0.2.4 jaxtyping wadler_lindig clu perfetto` (its full dependency set pins an older
transformers).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # loaded by path from rollouts.py too
from train_step import median_time  # noqa: E402

PROMPT_LENGTH = 64


def weight_size(params) -> tuple[int, int]:
    """(parameter count, bytes) of a parameter tree, every leaf counted at its own dtype."""
    leaves = jax.tree_util.tree_leaves(params)
    return sum(int(np.prod(x.shape)) for x in leaves), sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves)


def machine_roofline(num_params: int, weight_bytes: int) -> dict:
    """Measured f32 matmul FLOP/s and memory read bandwidth, and the decode bounds they imply."""
    n = 2048
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda x: (x @ x).sum())
    flops = 2 * n ** 3 / median_time(lambda: matmul(a).block_until_ready(), 5)
    big = jnp.ones((128 * 1024 * 1024,), jnp.float32)  # 512 MiB, beyond any cache
    read = jax.jit(lambda x: x.sum())
    bandwidth = big.nbytes / median_time(lambda: read(big).block_until_ready(), 5)
    return dict(flops=flops, bandwidth=bandwidth, batch1_tok_s=bandwidth / weight_bytes,
                large_batch_tok_s=flops / (2 * num_params))


def run_ours(params, config, prompts, samples, new_tokens, repeats):
    from jaxrl_llm.sampling import collect, decode, make_plan, prefill
    from jaxrl_llm.sampling.plan import stop_array

    arrays = [np.asarray(p, np.int32) for p in prompts]
    plan = make_plan(np.full(len(prompts), PROMPT_LENGTH), np.full(len(prompts), samples), new_tokens)
    stop = stop_array((), config.vocab_size)
    timings = {"prefill": [], "decode": []}

    def once(seed, record):
        start = time.perf_counter()
        state, first_logits = prefill(params, config, arrays, plan)
        jax.block_until_ready((state, first_logits))
        mid = time.perf_counter()
        state = decode(params, config, state, first_logits, max_new_tokens=new_tokens, temperature=1.0,
                       top_p=1.0, top_k=0, stop_ids=stop, rng=jax.random.key(seed), pad_id=0)
        rollout = collect(state, plan, new_tokens)
        end = time.perf_counter()
        assert (rollout.lengths == new_tokens).all()
        if record:
            timings["prefill"].append(mid - start)
            timings["decode"].append(end - mid)

    once(0, False)
    for r in range(repeats):
        once(r + 1, True)
    return statistics.median(timings["prefill"]), statistics.median(timings["decode"])


def run_transformers(model, prompts, samples, new_tokens, repeats):
    import torch

    ids = torch.tensor(np.repeat(np.asarray(prompts), samples, axis=0), dtype=torch.long)

    def call(n):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0,
                                 temperature=1.0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                                 use_cache=True)
        assert out.shape[1] == PROMPT_LENGTH + n

    total = median_time(lambda: call(new_tokens), repeats, warm_up=0)  # eager torch: nothing to compile
    prefill = median_time(lambda: call(1), repeats, warm_up=0)
    return prefill, max(total - prefill, 1e-9)


class _IdTokenizer:
    """Space-separated token ids <-> ids, so tunix sees exactly our token prompts."""

    def encode(self, text, **kwargs):
        return [int(t) for t in text.split()]

    def decode(self, ids, **kwargs):
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self):
        return 0  # falsy: tunix adds no BOS

    def eos_id(self):
        return -1

    def pad_id(self):
        return 0


def build_tunix(config, params, cache_size: int = PROMPT_LENGTH + 64 + 8):
    """tunix's Llama3 with our weights; its RoPE theta is patched to the config's (it hard-codes 1e6).
    `cache_size` bounds max_prompt_length + max_generation_steps of every call."""
    import functools

    from flax import nnx
    from tunix.generate import sampler as tunix_sampler
    from tunix.models.llama3 import model as tunix_llama

    original_rope = tunix_llama.apply_rope
    if not getattr(original_rope, "patched_theta", None):
        tunix_llama.apply_rope = functools.partial(original_rope, rope_theta=config.rope_theta)
        tunix_llama.apply_rope.patched_theta = config.rope_theta
    tcfg = tunix_llama.ModelConfig(
        num_layers=config.num_layers, vocab_size=config.vocab_size, embed_dim=config.hidden_size,
        hidden_dim=config.intermediate_size, num_heads=config.num_heads, head_dim=config.head_dim,
        num_kv_heads=config.num_kv_heads, rope_theta=int(config.rope_theta), norm_eps=config.rms_norm_eps,
        weight_tying=config.tie_word_embeddings)
    model = tunix_llama.Llama3(tcfg, rngs=nnx.Rngs(0))
    d, h, kv, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    model.embedder.input_embedding.value = params["embed"]
    model.final_norm.w.value = params["final_norm"]
    for i, layer in enumerate(model.layers):
        lp = {k: v[i] for k, v in params["layers"].items()}
        layer.input_layernorm.w.value = lp["attn_norm"]
        layer.post_attention_layernorm.w.value = lp["mlp_norm"]
        layer.attn.q_proj.w.value = lp["q_proj"].reshape(d, h, hd)
        layer.attn.k_proj.w.value = lp["k_proj"].reshape(d, kv, hd)
        layer.attn.v_proj.w.value = lp["v_proj"].reshape(d, kv, hd)
        layer.attn.o_proj.w.value = lp["o_proj"].reshape(h, hd, d)
        layer.mlp.gate_proj.kernel.value = lp["gate_proj"]
        layer.mlp.up_proj.kernel.value = lp["up_proj"]
        layer.mlp.down_proj.kernel.value = lp["down_proj"]
    cache = tunix_sampler.CacheConfig(cache_size=cache_size, num_layers=config.num_layers,
                                      num_kv_heads=kv, head_dim=hd)
    return tunix_sampler.Sampler(model, _IdTokenizer(), cache)


def run_tunix(sampler, prompts, samples, new_tokens, repeats):
    strings = [" ".join(map(str, p)) for p in prompts for _ in range(samples)]

    def call(n, seed=[0]):
        seed[0] += 1
        out = sampler(strings, max_generation_steps=n, max_prompt_length=PROMPT_LENGTH, temperature=1.0,
                      top_p=1.0, eos_tokens=[], seed=seed[0])
        jax.block_until_ready(out.tokens)

    total = median_time(lambda: call(new_tokens), repeats)
    prefill = median_time(lambda: call(1), repeats)
    return prefill, max(total - prefill, 1e-9)


def check_tunix_greedy(sampler, config, params, prompt) -> bool:
    """tunix and jaxrl_llm agree greedily on one prompt (guards the weight mapping and RoPE patch)."""
    from jaxrl_llm.sampling import generate

    ours = generate(params, config, [prompt], num_samples=1, max_new_tokens=8, temperature=0.0,
                    rng=jax.random.key(0)).tokens[0].tolist()
    out = sampler([" ".join(map(str, prompt))], max_generation_steps=8, max_prompt_length=PROMPT_LENGTH,
                  temperature=0.0, eos_tokens=[])
    return ours == [int(t) for t in list(out.tokens[0])[:8]]


def load_transformers(config, params):
    import tempfile

    import torch
    import transformers

    from jaxrl_llm.models import save_hf

    with tempfile.TemporaryDirectory() as directory:
        save_hf(directory, config, params)
        return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", default="1x1x64,8x8x64,32x8x32")
    parser.add_argument("--skip-peers", action="store_true")
    args = parser.parse_args()

    from jaxrl_llm.models import load_bundled

    config, params, _ = load_bundled("float32")
    num_params, weight_bytes = weight_size(params)
    roof = machine_roofline(num_params, weight_bytes)
    print(f"SmolLM2-135M f32: {num_params / 1e6:.1f}M params, {weight_bytes / 1e6:.0f} MB; measured "
          f"{roof['flops'] / 1e9:.0f} GFLOP/s f32 matmul, {roof['bandwidth'] / 1e9:.1f} GB/s read -> "
          f"roofline {roof['batch1_tok_s']:.1f} tok/s at batch 1, {roof['large_batch_tok_s']:.0f} tok/s "
          f"at large batch", flush=True)

    rng = np.random.default_rng(0)
    shapes = []
    for shape in args.shapes.split(","):
        num_prompts, samples, new_tokens = (int(x) for x in shape.split("x"))
        prompts = rng.integers(1, config.vocab_size, size=(num_prompts, PROMPT_LENGTH)).tolist()
        shapes.append((shape, num_prompts, samples, new_tokens, prompts))
    runners = {"jaxrl_llm": lambda pr, s, n: run_ours(params, config, pr, s, n, args.repeats)}
    if not args.skip_peers:
        sampler = build_tunix(config, params)
        print("tunix greedy agrees with jaxrl_llm:", check_tunix_greedy(sampler, config, params, shapes[0][4][0]),
              flush=True)
        model = load_transformers(config, params)
        runners["tunix"] = lambda pr, s, n: run_tunix(sampler, pr, s, n, args.repeats)
        runners["transformers"] = lambda pr, s, n: run_transformers(model, pr, s, n, args.repeats)
    results = {}
    for shape, num_prompts, samples, new_tokens, prompts in shapes:
        for name, runner in runners.items():
            prefill_s, decode_s = runner(prompts, samples, new_tokens)
            generated = num_prompts * samples * new_tokens
            results[shape, name] = dict(prefill=num_prompts * PROMPT_LENGTH / prefill_s,
                                        decode=generated / decode_s, total=generated / (prefill_s + decode_s))
            r = results[shape, name]
            print(f"{shape:>8} {name:<13} prefill {r['prefill']:8.1f} tok/s  decode {r['decode']:7.1f} tok/s  "
                  f"total {r['total']:7.1f} tok/s", flush=True)
    print()
    print("| prompts x samples x new | sampler | prefill tok/s | decode tok/s | total tok/s | ours / this (total) |")
    print("|---|---|---|---|---|---|")
    for shape, *_ in shapes:
        ours = results[shape, "jaxrl_llm"]["total"]
        for name in runners:
            r = results[shape, name]
            print(f"| {shape} | {name} | {r['prefill']:.1f} | {r['decode']:.1f} | {r['total']:.1f} | "
                  f"{ours / r['total']:.2f}x |")
        bound = roof["batch1_tok_s"] if shape.startswith("1x1x") else roof["large_batch_tok_s"]
        print(f"| {shape} | roofline | | {bound:.1f} | | decode {results[shape, 'jaxrl_llm']['decode'] / bound:.0%}"
              f" of it |")


if __name__ == "__main__":
    main()
