"""jaxrl_llm on one GPU, beside torch `transformers` on the same GPU in the same process, against the
card's own ceilings measured in the same run.

    python benchmarks/gpu.py --out DIR [--parts ceilings,train,memory,sampler,attention] [--small]

Parts (each writes its figures to DIR/gpu.json as soon as it ends, so a run cut short keeps what it did):
- ceilings: the bf16 matmul peak (8192^3 products of random data, jitted with JAX) and the memory bandwidth
  of a 1 GiB f32 elementwise pass (bytes read + written); the rooflines below use these, not datasheets.
- sampler: `jaxrl_llm.sampling.generate` (static engine, and the continuous engine at large batch) against
  transformers `generate` (torch, same GPU), bf16 weights and compute, random weights of SmolLM2-135M's shape
  and of Qwen2.5-1.5B's shape (nothing to download; speed does not depend on the weights since every row
  decodes all its tokens: no stop ids, `min_new_tokens`). Random
  64-token prompts, temperature 1, top_k 0. Tokens/s = rows x new tokens / the whole call (prefill included,
  median of 2 after a warm-up for ours, one timed call after a warm-up for transformers). Rooflines: batch 1,
  weight bytes per token over the bandwidth; large batch, the larger of (weights + the mean KV cache read per
  step) / bandwidth and 2 x params x rows / matmul peak.
- attention: `jax.nn.dot_product_attention` with implementation "xla" against "cudnn" (the fused kernel) on
  a training row (1 x 4096 tokens, causal) and on decode (64 rows, 1 query against 2048 keys), Qwen2.5-1.5B's
  12 query / 2 KV heads of 128, bf16, forward and forward + backward.
- train: the trainer's jitted step (`train.step.make_train_step`: log-probs, PPO-clip token-mean loss,
  backward, clip, AdamW) on the Qwen2.5-1.5B shape with the paper preset's memory settings (f32 weights and
  moments, bf16 compute, full remat, attention blocks of 512, log-prob chunks recomputed), on packed rows of
  the paper's shape (one 1024-token prompt + 8 responses of 3072 tokens = 25,600 tokens, one row per
  micro-batch). MFU = model FLOPs (`benchmarks/train_step.py`'s count, remat recomputation not counted) /
  step time / the measured bf16 peak. Beside it torch `transformers` on the same samples as unpacked rows of
  4096 tokens (the prompt repeated for each response, as TRL does), f32 weights, bf16 autocast, activation
  checkpointing, log-softmax over the response positions, the same loss, clip and fused AdamW.
- memory: XLA's measured peak of the train step (`memory_stats()["peak_bytes_in_use"]`) against
  `capacity.memory.estimate_memory` for the same settings, and the largest response length that fits one 80 GB
  GPU by the estimate.

`--small` shrinks every shape (2 layers, short rows) to check the script on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # benchmarks/train_step.py's helpers
from train_step import attended_pairs, median_time, train_step_flops  # noqa: E402

PROMPT = 64


def smollm2_shape():
    from jaxrl_llm.models import ModelConfig

    return ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                       num_kv_heads=3, head_dim=64, rope_theta=1e5, tie_word_embeddings=True,
                       max_position_embeddings=8192, rms_norm_eps=1e-5)


def qwen_shape():
    from jaxrl_llm.capacity.memory import KNOWN_MODELS

    return KNOWN_MODELS["qwen2.5-math-1.5b"].replace(max_position_embeddings=32768)


def shrink(config, small: bool):
    return config.replace(num_layers=2) if small else config


def ceilings(small: bool) -> dict:
    import jax
    import jax.numpy as jnp

    n = 1024 if small else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    matmul = jax.jit(lambda x, y: x @ y)
    t = median_time(lambda: matmul(a, b).block_until_ready(), 10, 3)
    x = jax.random.normal(jax.random.key(2), ((1 << 20) if small else (1 << 28),), jnp.float32)
    add = jax.jit(lambda v: v + 1.0)
    tb = median_time(lambda: add(x).block_until_ready(), 10, 3)
    return {"bf16_matmul_flops": 2 * n ** 3 / t, "matmul_n": n, "bandwidth_bytes_s": 2 * x.nbytes / tb,
            "copy_bytes": 2 * x.nbytes}


def random_params(config, dtype: str):
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.models import init_params

    params = init_params(config, jax.random.key(0))
    return jax.tree_util.tree_map(lambda x: x.astype(jnp.dtype(dtype)), params)


def hf_model(config, dtype: str, device: str):
    import torch
    import transformers

    hf = dict(config.to_hf_dict())
    model_type = hf.pop("model_type")
    hf.pop("architectures", None)
    hf_config = transformers.AutoConfig.for_model(model_type, **hf)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, dtype))
    return model


def sampler(small: bool, ceil: dict) -> dict:
    import jax
    import torch

    from jaxrl_llm.sampling import generate

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(1, 1, 16 if small else 128), (4 if small else 64, 8, 16 if small else 128)]
    out = {}
    for name, base in (("smollm2-135m", smollm2_shape()), ("qwen2.5-1.5b", qwen_shape())):
        config = shrink(base, small).replace(param_dtype="bfloat16", compute_dtype="bfloat16")
        params = random_params(config, "bfloat16")
        count = sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
        weight_bytes = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(params))
        model = hf_model(config, "bfloat16", device).eval()
        rng = np.random.default_rng(0)
        for prompts_n, samples, new in shapes:
            rows = prompts_n * samples
            prompts = rng.integers(1, config.vocab_size, size=(prompts_n, PROMPT)).tolist()
            key = f"{name} {prompts_n}x{samples}x{new}"
            row = {"rows": rows, "new_tokens": new, "params": count, "weight_bytes": weight_bytes}
            engines = ("static", "continuous") if rows > 1 and name.startswith("qwen") else ("static",)
            for engine in engines:
                seed = [0]

                def ours():
                    seed[0] += 1
                    r = generate(params, config, prompts, num_samples=samples, max_new_tokens=new,
                                 temperature=1.0, rng=jax.random.key(seed[0]), engine=engine)
                    assert int(np.asarray(r.lengths).min()) == new

                row[f"ours_{engine}_tok_s"] = rows * new / median_time(ours, 2)
            ids = torch.tensor(np.repeat(np.asarray(prompts), samples, axis=0), dtype=torch.long, device=device)

            def theirs():
                with torch.no_grad():
                    o = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                                       top_p=1.0, temperature=1.0, max_new_tokens=new, min_new_tokens=new,
                                       pad_token_id=0, use_cache=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                assert o.shape[1] == PROMPT + new

            row["transformers_tok_s"] = rows * new / median_time(theirs, 1)  # eager: the warm-up only loads kernels
            kv_per_token = config.num_layers * config.num_kv_heads * config.head_dim * 2 * 2  # k and v, bf16
            mean_context = PROMPT + new / 2
            step_bytes = weight_bytes + rows * mean_context * kv_per_token
            step_time = max(step_bytes / ceil["bandwidth_bytes_s"], 2 * count * rows / ceil["bf16_matmul_flops"])
            row["roofline_tok_s"] = rows / step_time
            row["ours_static_vs_transformers"] = row["ours_static_tok_s"] / row["transformers_tok_s"]
            row["ours_static_vs_roofline"] = row["ours_static_tok_s"] / row["roofline_tok_s"]
            out[key] = row
            print(f"  sampler {key}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
        del model, params
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def attention(small: bool) -> dict:
    import jax
    import jax.numpy as jnp

    heads, kv, hd = 12, 2, 128
    cases = {"train 1x4096 causal": (1, 256 if small else 4096, 256 if small else 4096, True),
             "decode 64x1 over 2048": (64, 1, 128 if small else 2048, False)}
    out = {}
    for name, (b, tq, tk, causal) in cases.items():
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (b, tq, heads, hd), jnp.bfloat16)
        k = jax.random.normal(keys[1], (b, tk, kv, hd), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, tk, kv, hd), jnp.bfloat16)
        row, ref = {}, None
        for impl in ("xla", "cudnn"):
            def f(q, k, v, impl=impl):
                return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)

            fwd = jax.jit(f)
            grad = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
            try:
                value = np.asarray(fwd(q, k, v), np.float32)
                ref = value if ref is None else ref
                row[f"{impl}_fwd_ms"] = 1e3 * median_time(lambda: fwd(q, k, v).block_until_ready(), 10, 2)
                row[f"{impl}_rel_err_vs_xla"] = float(np.linalg.norm(value - ref) / np.linalg.norm(ref))
                if tq > 1:
                    row[f"{impl}_fwd_bwd_ms"] = 1e3 * median_time(lambda: jax.block_until_ready(grad(q, k, v)), 10, 2)
            except Exception as error:  # noqa: BLE001 - cuDNN is absent on CPU and limited in shapes
                row[f"{impl}_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        out[name] = row
        print(f"  attention {name}: {row}", flush=True)
    return out


def paper_batch(config, rows: int, prompt_len: int, resp_len: int, samples: int, seed: int = 0):
    """`rows` packed rows, each one prompt + `samples` responses, random tokens and +-1 advantages."""
    from jaxrl_llm.train.packing import pack_groups

    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, config.vocab_size, size=(rows, prompt_len)).tolist()
    responses = rng.integers(1, config.vocab_size, size=(rows * samples, resp_len)).astype(np.int32)
    lengths = np.full(rows * samples, resp_len)
    groups = [np.arange(i * samples, (i + 1) * samples) for i in range(rows)]
    adv = rng.choice([-1.0, 1.0], size=rows * samples).astype(np.float32)
    per_token = np.repeat(adv[:, None], resp_len, 1)
    return prompts, responses, lengths, groups, adv, per_token


def train_config(small: bool, block: int | None, prompt_len: int, layers: int | None = None):
    """The train part's model: the Qwen2.5-1.5B shape with the paper preset's memory settings (f32 weights, bf16
    compute, full remat, attention tiles of `block` for the xla path, log-prob chunks recomputed), `layers` of them
    (None: all). max_prompt_tokens (the data's prompt bound, set by a run from data.max_prompt_tokens) sizes the
    regrouped rows of the fused paths: prompt + one response, not the whole packed row."""
    config = shrink(qwen_shape(), small).replace(param_dtype="float32", compute_dtype="bfloat16", remat=True,
                                                 remat_policy="full", attention_block_size=block or None,
                                                 remat_logits=True, max_prompt_tokens=prompt_len)
    return config.replace(num_layers=layers) if layers else config


def train(small: bool, ceil: dict, torch_side: bool = True, layers: int | None = None, rows: int = 2,
          samples: int = 8, resp_len: int | None = None, block: int | None = 512,
          impls: tuple[str, ...] = ("auto", "xla")) -> dict:
    """The train step with each of `impls` (`model.attention_impl`; the first is the default path, whose figures
    are the part's top-level `ours_*`; the others under their own names, timed once after the first call), the
    attention kernel and kernel count read from each compiled program, then torch on the same samples."""
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.objectives import aggregate_denominator
    from jaxrl_llm.run.config import AlgorithmSection, OptimSection
    from jaxrl_llm.run.state import init_state, make_optimizer
    from jaxrl_llm.train.packing import pack_groups
    from jaxrl_llm.train.step import make_logprob_fn, make_train_step

    prompt_len = 64 if small else 1024
    resp_len = resp_len or (96 if small else 3072)
    base = train_config(small, 64 if small else block, prompt_len, layers)
    prompts, responses, lengths, groups, adv, per_token = paper_batch(base, rows, prompt_len, resp_len, samples)
    params = random_params(base, "float32")
    probe = pack_groups(prompts, groups, responses, lengths)
    old = np.asarray(make_logprob_fn(base)(params, jax.tree_util.tree_map(jnp.asarray, probe)))
    flat_old = np.concatenate([old[g, :samples] for g in range(rows)])  # [rows * samples, R]
    batch = pack_groups(prompts, groups, responses, lengths, advantages=per_token, old_logp=flat_old)
    out = {"layers": base.num_layers, "attention_block_size": base.attention_block_size, "rows": rows,
           "row_tokens": int(batch.tokens.shape[1]), "responses_per_row": samples,
           "prompt_tokens": prompt_len, "response_tokens": resp_len}
    tokens = int(np.asarray(batch.mask).sum()) + rows * prompt_len
    scored = int(np.asarray(batch.mask).sum())
    pairs = attended_pairs(np.asarray(batch.positions), np.asarray(batch.segments))
    flops = train_step_flops(base, tokens, scored, pairs)
    out["model_flops"] = flops
    algo = AlgorithmSection()
    optimizer = make_optimizer(OptimSection())
    batch = jax.tree_util.tree_map(jnp.asarray, batch)
    denom = aggregate_denominator(batch.mask.reshape(-1, batch.mask.shape[-1]), algo.agg)
    for index, impl in enumerate(impls):
        config = base.replace(attention_impl=impl)
        path = out if index == 0 else out.setdefault(impl, {})
        path["attention_impl"] = impl
        try:
            step = make_train_step(config, algo, optimizer, micro_batch_size=1)
            # a copy each: the step donates its state, and the next path starts from the same weights
            holder = {"state": init_state(jax.tree_util.tree_map(jnp.copy, params), optimizer)}
            start = time.perf_counter()
            compiled = step.lower(holder["state"], batch, denom).compile()
            path["compile_s"] = time.perf_counter() - start
            path.update(program_stats(compiled.as_text()))

            def one_step():
                holder["state"], metrics = compiled(holder["state"], batch, denom)
                jax.block_until_ready((holder["state"], metrics))
                holder["metrics"] = metrics

            start = time.perf_counter()
            one_step()
            path["first_s"] = time.perf_counter() - start
            path["first_loss"] = float(holder["metrics"]["loss"])
            path["first_grad_norm"] = float(holder["metrics"]["grad_norm"])
            path["ours_step_s"] = median_time(one_step, 3 if index == 0 else 1, 0)
            path["ours_mfu"] = flops / path["ours_step_s"] / ceil["bf16_matmul_flops"]
            stats = jax.devices()[0].memory_stats() or {}
            path["xla_peak_bytes"] = int(stats.get("peak_bytes_in_use", 0))  # the process's peak so far
        except Exception as error:  # noqa: BLE001 - report, keep the other paths
            traceback.print_exc()
            path["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        print(f"  train ours ({impl}): {path if index else {k: v for k, v in out.items() if k not in impls}}",
              flush=True)
        holder = step = compiled = None
    del params
    if torch_side:
        try:
            out.update(torch_train(base, prompts, responses, adv, flat_old, samples, small))
            for impl in impls:
                path = out if impl == impls[0] else out.get(impl, {})
                if path.get("ours_step_s"):
                    path["ours_vs_torch"] = out["torch_step_s"] / path["ours_step_s"]
        except Exception as error:  # noqa: BLE001 - report, keep the other parts
            out["torch_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    return out


def program_stats(hlo_text: str) -> dict:
    """The compiled program's attention kernel, kernels launched per call and matmul FLOPs
    (`jaxrl_llm.capacity.hlo_stats`), as a JSON-ready dict."""
    import dataclasses

    from jaxrl_llm.capacity.hlo_stats import program_stats as stats

    return {k: v for k, v in dataclasses.asdict(stats(hlo_text)).items() if isinstance(v, (int, float, str))}


def torch_train(config, prompts, responses, adv, old_logp, samples: int, small: bool) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = hf_model(config.replace(compute_dtype="float32"), "float32", device)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.config.use_cache = False
    model.train()
    decay = [p for n, p in model.named_parameters() if "norm" not in n and "bias" not in n]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n or "bias" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-5, fused=device == "cuda")
    prompt_len = len(prompts[0])
    ids = torch.tensor(np.concatenate([np.repeat(np.asarray(prompts), samples, axis=0), responses], 1),
                       dtype=torch.long, device=device)
    targets = ids[:, prompt_len:]
    advantages = torch.tensor(adv, device=device)[:, None]
    old = torch.tensor(old_logp, device=device)
    micro = 2
    total_tokens = targets.numel()

    def one_step():
        for lo in range(0, ids.shape[0], micro):
            with torch.autocast(device, dtype=torch.bfloat16):
                hidden = model.model(input_ids=ids[lo:lo + micro]).last_hidden_state[:, prompt_len - 1:-1]
                logits = model.lm_head(hidden).float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[lo:lo + micro, :, None])[..., 0]
            ratio = torch.exp(torch.clamp(logp - old[lo:lo + micro], -20.0, 20.0))
            a = advantages[lo:lo + micro]
            loss = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.2)).sum() / total_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out = {"torch_step_s": median_time(one_step, 3, 1), "torch_rows": int(ids.shape[0]),
           "torch_row_tokens": int(ids.shape[1]), "torch_micro_batch": micro}
    if device == "cuda":
        out["torch_peak_bytes"] = int(torch.cuda.max_memory_allocated())
    print(f"  train torch: {out}", flush=True)
    del model, optimizer
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def memory(small: bool, measured: dict) -> dict:
    from jaxrl_llm.capacity.memory import GIB, estimate_memory
    from jaxrl_llm.train import load_config

    root = pathlib.Path(__file__).resolve().parents[1]
    prompt_len = measured.get("prompt_tokens", 1024)
    resp_len = measured.get("response_tokens", 3072)
    overrides = ["algorithm.kl_coef=0.0", "optim.micro_batch_size=1", f"data.max_prompt_tokens={prompt_len}",
                 f"sampling.max_new_tokens={resp_len}", "train.mesh=fsdp=1"]
    if small:
        overrides += ["model.attention_block_size=64"]
    config = load_config(root / "configs/paper/qwen2.5-math-1.5b_raftpp.yaml", overrides)
    model_config = shrink(qwen_shape(), small)
    est = estimate_memory(config, model_config, {"data": 1, "fsdp": 1, "tensor": 1}, platform="gpu")
    train_peak = est["params"] + est["optimizer"] + est["train_step"]
    out = {"estimate_train_peak_bytes": train_peak, "estimate_terms_gib": {
        k: est[k] / GIB for k in ("params", "optimizer", "gradients", "activations", "logprob_residuals")},
        "estimate_row_length": est["row_length"]}
    if measured.get("xla_peak_bytes"):
        out["measured_over_estimate"] = measured["xla_peak_bytes"] / train_peak
    fits = None
    for length in range(1024, 65537, 1024):
        c = load_config(root / "configs/paper/qwen2.5-math-1.5b_raftpp.yaml",
                        overrides[:3] + [f"sampling.max_new_tokens={length}", "train.mesh=fsdp=1"])
        e = estimate_memory(c, model_config, {"data": 1, "fsdp": 1, "tensor": 1}, platform="gpu")
        if e["params"] + e["optimizer"] + e["train_step"] > 0.9 * 80e9:
            break
        fits = length
    out["largest_response_fitting_80GB_train_step"] = fits
    print(f"  memory: {out}", flush=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--parts", default="ceilings,train,memory,sampler,attention")  # train first: it answers
    # the GPU issue; a run cut short by gpu.sh's timeout keeps what it did
    parser.add_argument("--small", action="store_true", help="tiny shapes, to check the script on a CPU")
    parser.add_argument("--layers", type=int, default=None, help="train: keep only the first N layers")
    parser.add_argument("--rows", type=int, default=2, help="train: packed rows (one micro-batch each)")
    parser.add_argument("--samples", type=int, default=8, help="train: responses per packed row")
    parser.add_argument("--response-tokens", type=int, default=None, help="train: tokens per response (3072)")
    parser.add_argument("--block", type=int, default=512, help="train: attention block size (0: full attention)")
    parser.add_argument("--impls", default="auto,xla",
                        help="train: model.attention_impl values, the first the default path (auto: cuDNN on a GPU; "
                             "xla: the packed rows in tiles, the path measured 14x slower than torch)")
    parser.add_argument("--skip-torch", action="store_true")
    args = parser.parse_args()
    import jax

    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"device": str(jax.devices()[0]), "device_kind": jax.devices()[0].device_kind,
               "jax": jax.__version__, "small": args.small}
    try:
        import torch
        import transformers

        results.update(torch=torch.__version__, transformers=transformers.__version__)
    except ImportError:
        pass
    print(json.dumps(results), flush=True)
    parts = args.parts.split(",")
    ceil = results["ceilings"] = ceilings(args.small)
    print(f"  ceilings: {ceil}", flush=True)
    for part in parts:
        if part == "ceilings":
            continue
        start = time.perf_counter()
        try:
            if part == "sampler":
                results[part] = sampler(args.small, ceil)
            elif part == "attention":
                results[part] = attention(args.small)
            elif part == "train":
                results[part] = train(args.small, ceil, not args.skip_torch, args.layers, args.rows, args.samples,
                                      args.response_tokens, args.block, tuple(args.impls.split(",")))
            elif part == "memory":
                results[part] = memory(args.small, results.get("train", {}))
            else:
                raise ValueError(f"unknown part {part!r}")
        except Exception as error:  # noqa: BLE001 - one part failing leaves the others' figures
            traceback.print_exc()
            results[part] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        results.setdefault("seconds", {})[part] = time.perf_counter() - start
        (out_dir / "gpu.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
        print(f"[{part} done in {results['seconds'][part]:.1f} s]", flush=True)
    (out_dir / "gpu.json").write_text(json.dumps(results, indent=1, default=float) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    main()
