"""Training-step throughput on the bundled SmolLM2-135M: the trainer's jitted step (log-probs, PPO-clip
loss, backward, clipped AdamW) beside a transformers PyTorch forward + backward + AdamW step on the
same weights and the same batch, and the model FLOP utilisation against the matmul peak measured with
JAX in the same run.

    .venv/bin/python benchmarks/train_step.py [--rows 8] [--seq-len 256] [--prompt-len 64]
        [--dtype f32|bf16] [--remat off|full|dots|qkv_attn_mlp] [--micro-batch 8] [--repeats 3] [--layers N]
        [--layers-as scan|unrolled] [--attention-block-size B] [--responses N] [--skip-torch] [--torch-threads N]
        [--pieces] [--slot-len R]

Batch: `rows` packed rows, each one random prompt of `prompt_len` tokens followed by one response of
`seq_len - prompt_len` tokens (a `TrainBatch` with one response slot per row, no padding), random
+-1 advantages (`--responses N`: N responses of equal length after each prompt instead, the trainer's
packed layout of a prompt's group, in which each response attends to the prompt and to itself; ours only;
`--slot-len R`: each response in a slot of R tokens, as when the sampler's max_new_tokens is R and the
responses stop before it, so the trainer scores the row's positions rather than its S x R slots when
those are fewer, `train.logprobs.scored_positions`; ours only),
old log-probs from the trainer's own log-prob function (ratio 1). Both sides score the response tokens only: the log-prob of every response token under a full-vocabulary softmax, the
clipped surrogate averaged over response tokens (token-mean) and the entropy as a metric, then the
gradient, a global-norm clip at 1.0 and AdamW (lr 1e-5, weight decay 0.01, none on norms).

Model FLOPs of one step (matmuls only; forward x 1 + backward x 2 = 6 per multiply-add pair / 2):
    6 * P_layers * tokens + 6 * V * D * scored + 12 * L * H * hd * pairs
P_layers: the decoder layers' matrix parameters; tokens: all positions of the batch; scored: the
positions whose logits are computed (response tokens); pairs: the (query, key) pairs attention
lets through (causal: T (T + 1) / 2 per row). With every position scored and attention ignored this
is the usual 6 x parameters x tokens. MFU = model FLOPs / step time / measured matmul peak, the peak
being the best of square f32 (or bf16) matmuls of a few sizes, jitted with JAX, in the same process,
measured before and after the timed steps. The same matmuls with torch.mm give the peak of the GEMM
library the transformers step runs on; each step's FLOP rate is also reported against its own library's
peak, which separates how well a step uses its matmul library from how fast that library is here.
`--layers N` keeps only the first N layers (a small config with the real shapes, for quick runs).
The steps are timed in turns (ours, transformers, ours, ...), each turn after one untimed step of its own,
and the median of `repeats` steps per side is reported with the load average of the machine.
`--pieces` also times the forward alone and forward + backward (no optimizer) of our step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

DTYPES = {"f32": "float32", "bf16": "bfloat16"}


def layer_matrix_params(config) -> int:
    """Matrix parameters of all decoder layers (q, k, v, o, gate, up, down), biases and norms excluded."""
    d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    return config.num_layers * (d * q + 2 * d * kv + q * d + 3 * d * f)


def attended_pairs(positions: np.ndarray, segments: np.ndarray | None = None) -> int:
    """Number of (query, key) pairs the decoder's mask lets through (see `models.hidden_states`):
    key j is visible to query i of the same row iff positions[j] <= positions[i] and, with segments,
    segment[j] is segment[i] or 0. positions, segments: [B, T]."""
    positions = np.asarray(positions)
    keep = positions[:, None, :] <= positions[:, :, None]
    if segments is not None:
        segments = np.asarray(segments)
        keep &= (segments[:, None, :] == segments[:, :, None]) | (segments[:, None, :] == 0)
    return int(keep.sum())


def train_step_flops(config, tokens: int, scored: int, pairs: int) -> int:
    """Model FLOPs of one forward + backward pass (matmuls; multiply-add = 2 FLOPs, backward = 2 x forward):
    6 * P_layers * tokens + 6 * V * D * scored + 12 * L * H * hd * pairs, where attention's
    q k^T and p v cost 2 * hd FLOPs each per (query, key) pair and head in the forward pass."""
    head = 6 * config.vocab_size * config.hidden_size * scored
    attention = 12 * config.num_layers * config.num_heads * config.head_dim * pairs
    return 6 * layer_matrix_params(config) * tokens + head + attention


def median_time(fn, repeats: int, warm_up: int = 1) -> float:
    """Median wall seconds of `repeats` calls of fn() (which must wait for its results), after `warm_up`
    untimed calls (compilation and caches)."""
    for _ in range(warm_up):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def square_matmul_rates(timed_product, sizes=(1024, 2048, 3072), repeats: int = 5) -> dict:
    """Best FLOP/s of square matmuls (2 n^3 FLOPs) over `sizes`: {n: FLOP/s, "peak": best}.
    `timed_product(n)` returns a function that computes one n x n product and waits for it."""
    rates = {n: 2 * n ** 3 / median_time(timed_product(n), repeats) for n in sizes}
    rates["peak"] = max(rates.values())
    return rates


def measure_matmul_peak(dtype: str) -> dict:
    """Square matmuls a @ b jitted with JAX, in `dtype` (see `square_matmul_rates`)."""
    import jax
    import jax.numpy as jnp

    matmul = jax.jit(lambda a, b: a @ b)

    def timed_product(n):
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
        return lambda: matmul(a, b).block_until_ready()

    return square_matmul_rates(timed_product)


def load_model(layers: int | None):
    """(config, f32 params) of the bundled SmolLM2-135M, optionally cut to its first `layers` layers."""
    import jax

    from jaxrl_llm.models import load_bundled

    config, params, _ = load_bundled("float32")
    if layers:
        config = config.replace(num_layers=layers)
        params = dict(params, layers=jax.tree_util.tree_map(lambda x: x[:layers], params["layers"]))
    return config, params


def make_batch(config, params, rows: int, seq_len: int, prompt_len: int, seed: int = 0, responses: int = 1,
               slot_len: int | None = None):
    """A packed TrainBatch (numpy) of `rows` rows, each a prompt and `responses` responses of equal length
    (`seq_len - prompt_len` tokens between them), old log-probs from the trainer's log-prob function; plus
    the token matrix [rows, seq_len] and advantages [rows] for the torch side (one response per row).
    `slot_len`: response slots of that many tokens (the sampler's max_new_tokens) instead of the responses'
    length, as when responses stop before the limit."""
    import jax

    from jaxrl_llm.train.packing import bucket, length_bucket, pack_groups
    from jaxrl_llm.train.step import make_logprob_fn

    if not 0 < prompt_len < seq_len:
        raise ValueError(f"--prompt-len must be in (0, --seq-len={seq_len}), got {prompt_len}")
    if length_bucket(seq_len, 1) != seq_len:
        raise ValueError(f"--seq-len {seq_len} is not a row length of the packer's grid "
                         f"(train.packing.length_bucket); the next one up is {length_bucket(seq_len, 1)}")
    if responses < 1 or (seq_len - prompt_len) % responses:
        raise ValueError(f"--responses must be >= 1 and divide --seq-len - --prompt-len = {seq_len - prompt_len}, "
                         f"got {responses}")
    rng = np.random.default_rng(seed)
    resp_len = (seq_len - prompt_len) // responses
    slot_len = slot_len or resp_len
    if slot_len < resp_len:
        raise ValueError(f"--slot-len must be at least the response length {resp_len}, got {slot_len}")
    tokens = rng.integers(1, config.vocab_size, size=(rows, seq_len)).astype(np.int32)
    prompts = [row[:prompt_len].tolist() for row in tokens]
    # Sample i = responses x row + s is the s-th response of its row's prompt.
    samples = tokens[:, prompt_len:].reshape(rows * responses, resp_len)
    lengths = np.full(rows * responses, resp_len)
    groups = [np.arange(responses) + responses * r for r in range(rows)]
    adv = rng.choice([-1.0, 1.0], size=rows * responses).astype(np.float32)
    per_token = np.repeat(adv[:, None], resp_len, 1)
    samples, per_token = (np.pad(x, ((0, 0), (0, slot_len - resp_len))) for x in (samples, per_token))
    probe = pack_groups(prompts, groups, samples, lengths, seq_multiple=1)
    logp = np.asarray(make_logprob_fn(config)(params, jax.tree_util.tree_map(jax.numpy.asarray, probe)))
    old = logp[:, :responses].reshape(rows * responses, slot_len)  # [G, S, R] -> [N, R] in the samples' order
    batch = pack_groups(prompts, groups, samples, lengths, advantages=per_token, old_logp=old, seq_multiple=1)
    assert batch.tokens.shape == (rows, seq_len) and batch.pred_index.shape[:2] == (rows, bucket(responses))
    return batch, tokens, adv, old


def build_ours(config, params, batch, *, micro_batch: int, repeats: int, pieces: bool) -> tuple[dict, object]:
    """The trainer's jitted step, compiled and run once: ({"compile_and_first": s, "first_*": metrics of the
    first step, and with `pieces` the median seconds of its forward / forward + backward}, one_step)."""
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.objectives import aggregate_denominator
    from jaxrl_llm.run.config import AlgorithmSection, OptimSection
    from jaxrl_llm.run.state import init_state, make_optimizer
    from jaxrl_llm.train.step import loss_fn, make_train_step, split_micro

    algo = AlgorithmSection()
    optimizer = make_optimizer(OptimSection())
    batch = jax.tree_util.tree_map(jnp.asarray, batch)
    denom = aggregate_denominator(batch.mask.reshape(-1, batch.mask.shape[-1]), algo.agg)
    step = make_train_step(config, algo, optimizer, micro_batch_size=micro_batch)
    # The step donates its state: keep our own copy of the weights for the other measurements.
    state = init_state(jax.tree_util.tree_map(jnp.copy, params), optimizer)
    holder = {"state": state}

    def one_step():
        holder["state"], metrics = step(holder["state"], batch, denom)
        jax.block_until_ready((holder["state"], metrics))
        holder["metrics"] = metrics

    start = time.perf_counter()
    one_step()
    out = {"compile_and_first": time.perf_counter() - start}
    out.update({f"first_{k}": float(holder["metrics"][k]) for k in ("loss", "entropy", "grad_norm")})
    if pieces:
        mb = jax.tree_util.tree_map(lambda x: x[0], split_micro(batch, batch.tokens.shape[0]))
        forward = jax.jit(lambda p, b: loss_fn(p, config, algo, b, denom)[0])
        grad = jax.jit(jax.grad(lambda p, b: loss_fn(p, config, algo, b, denom)[0]))
        out["forward"] = median_time(lambda: forward(params, mb).block_until_ready(), repeats)
        out["forward_backward"] = median_time(lambda: jax.block_until_ready(grad(params, mb)), repeats)
    return out, one_step


def build_torch(config, params, tokens, adv, old_logp, prompt_len: int, *, dtype: str) -> tuple[dict, object]:
    """A transformers LlamaForCausalLM step on the same weights and batch, run once: ({"threads", "first_*"},
    one_step). The step: hidden
    states, logits of the response positions only, log-softmax, PPO-clip token-mean loss, entropy
    (no gradient, a metric as in ours), backward, clip_grad_norm_(1.0), AdamW."""
    import torch
    import transformers

    from jaxrl_llm.models import save_hf

    with tempfile.TemporaryDirectory() as directory:
        save_hf(directory, config, params)
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.train()
    decay = [p for n, p in model.named_parameters() if "norm" not in n and "bias" not in n]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n or "bias" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-5, betas=(0.9, 0.999), eps=1e-8)
    ids = torch.tensor(tokens, dtype=torch.long)
    targets = ids[:, prompt_len:]
    advantages = torch.tensor(adv)[:, None]
    old = torch.tensor(old_logp)
    seq_len = ids.shape[1]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")

    def one_step():
        with autocast:
            hidden = model.model(input_ids=ids).last_hidden_state[:, prompt_len - 1:seq_len - 1]
            logits = model.lm_head(hidden).float()
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, targets[..., None])[..., 0]
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
        ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
        loss = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 0.8, 1.2)).mean()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        first.setdefault("loss", loss.item())
        first.setdefault("entropy", entropy.item())
        first.setdefault("grad_norm", grad_norm.item())

    first = {}
    one_step()
    return {"threads": torch.get_num_threads(), **{f"first_{k}": v for k, v in first.items()}}, one_step


def interleaved_medians(steps: dict, repeats: int) -> dict:
    """Median seconds of each named step, timed in turns (A B A B ...) so that a change in the machine's
    load during the run falls on every side alike; {name: {"step": median, "times": [...]}}. Each turn
    runs one untimed step first: the first step after the other library's step is slower (its large
    buffers are mapped afresh: 3-4x the kernel time, measured with os.times), which is a cost of sharing
    one process, not of either step."""
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            fn()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: {"step": statistics.median(t), "times": t} for name, t in times.items()}


def measure_torch_matmul_peak(dtype: str) -> dict:
    """The same square matmuls with torch.mm (the GEMM library the transformers step runs on)."""
    import torch

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    gen = torch.Generator().manual_seed(0)

    def timed_product(n):
        a = torch.randn(n, n, generator=gen).to(torch_dtype)
        b = torch.randn(n, n, generator=gen).to(torch_dtype)
        return lambda: torch.mm(a, b)

    with torch.no_grad():
        return square_matmul_rates(timed_product)


def main():
    from jaxrl_llm.models.config import REMAT_POLICIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="f32")
    parser.add_argument("--remat", choices=("off", *REMAT_POLICIES), default="qkv_attn_mlp",
                        help="remat policy of the layers (default: the trainer's, model.remat_policy)")
    parser.add_argument("--micro-batch", type=int, default=None, help="rows per micro-batch (default: all rows)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N layers (quick runs)")
    parser.add_argument("--layers-as", choices=("scan", "unrolled"), default="scan",
                        help="ModelConfig.scan_layers: the decoder layers as one lax.scan (default) or unrolled")
    parser.add_argument("--attention-block-size", type=int, default=None,
                        help="model.attention_block_size: query x key tiles with an online softmax (default: full)")
    parser.add_argument("--responses", type=int, default=1,
                        help="responses packed after each prompt, sharing its seq-len - prompt-len tokens (ours only)")
    parser.add_argument("--slot-len", type=int, default=None,
                        help="response slot length R >= the responses' length (ours only; default: their length)")
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--torch-threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    parser.add_argument("--pieces", action="store_true", help="also time forward and forward + backward alone")
    args = parser.parse_args()
    if (args.responses != 1 or args.slot_len) and not args.skip_torch:
        parser.error("--responses > 1 and --slot-len change our packed layout only, not the transformers step's: "
                     "add --skip-torch")

    import jax

    config, params = load_model(args.layers)
    remat = {} if args.remat == "off" else dict(remat=True, remat_policy=args.remat)
    config = config.replace(compute_dtype=DTYPES[args.dtype], scan_layers=args.layers_as == "scan",
                            attention_block_size=args.attention_block_size, **remat)
    micro_batch = args.micro_batch or args.rows
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))

    peaks = {name: measure_matmul_peak(dtype) for name, dtype in DTYPES.items()}
    for name, rates in peaks.items():
        sizes = ", ".join(f"{n}: {r / 1e9:.1f}" for n, r in rates.items() if n != "peak")
        print(f"measured {name} matmul GFLOP/s (n: rate) {sizes}; peak {rates['peak'] / 1e9:.1f}", flush=True)

    batch, tokens, adv, old = make_batch(config, params, args.rows, args.seq_len, args.prompt_len,
                                         responses=args.responses, slot_len=args.slot_len)
    n_tokens = int(batch.tokens.size)
    scored = int(batch.mask.sum())
    pairs = attended_pairs(batch.positions, batch.segments)
    flops = train_step_flops(config, n_tokens, scored, pairs)
    simple = 6 * num_params * n_tokens
    print(f"SmolLM2-135M, {config.num_layers} layers, {num_params / 1e6:.1f}M params, {args.dtype}, remat "
          f"{args.remat}, attention block {args.attention_block_size or 'none (full)'}, micro-batch {micro_batch}: "
          f"{args.rows} x {args.seq_len} tokens ({scored} scored, {args.responses} response(s) per row in slots "
          f"of {batch.pred_index.shape[2]}, "
          f"{pairs} attended pairs); "
          f"model FLOPs/step {flops / 1e9:.1f} G (6 x params x tokens: {simple / 1e9:.1f} G)", flush=True)

    ours, our_step = build_ours(config, params, batch, micro_batch=micro_batch, repeats=args.repeats,
                                pieces=args.pieces)
    steps = {"jaxrl_llm": our_step}
    first = lambda r: ", ".join(f"{k} {r['first_' + k]:.6f}" for k in ("loss", "entropy", "grad_norm"))  # noqa: E731
    print(f"jaxrl_llm: compile + first step {ours['compile_and_first']:.1f} s; first step {first(ours)}"
          + (f"; forward {ours['forward']:.3f} s, forward + backward {ours['forward_backward']:.3f} s"
             if args.pieces else ""), flush=True)
    torch_peak = None
    if not args.skip_torch:
        import torch

        torch.set_num_threads(args.torch_threads)
        torch_peak = measure_torch_matmul_peak(DTYPES[args.dtype])["peak"]
        theirs, steps["transformers"] = build_torch(config, params, tokens, adv, old, args.prompt_len,
                                                     dtype=args.dtype)
        # Same weights and batch: the first step's entropy and gradient norm must agree.
        print(f"transformers (torch, {theirs['threads']} threads): first step {first(theirs)}", flush=True)
    load_before = os.getloadavg()[0]
    results = interleaved_medians(steps, args.repeats)
    load_after = os.getloadavg()[0]
    for name, r in results.items():
        print(f"{name} step times (s): " + " ".join(f"{t:.3f}" for t in r["times"]), flush=True)
    print(f"load average (1 min) {load_before:.1f} before, {load_after:.1f} after the timed steps "
          f"({os.cpu_count()} cores)")
    ours = results["jaxrl_llm"]

    # The peaks again after the timed steps (the best of both measurements counts): load changes during a run.
    peak = max(peaks[args.dtype]["peak"], measure_matmul_peak(DTYPES[args.dtype])["peak"])
    own_peak = {"jaxrl_llm": peak}
    if torch_peak is not None:
        own_peak["transformers"] = max(torch_peak, measure_torch_matmul_peak(DTYPES[args.dtype])["peak"])
        theirs_peak = own_peak["transformers"]
        print(f"matmul peaks ({args.dtype}): JAX/XLA {peak / 1e9:.1f} GFLOP/s, torch {theirs_peak / 1e9:.1f} GFLOP/s "
              f"(JAX / torch = {peak / theirs_peak:.2f}x)")
    print()
    print(f"| step | tokens/s | step s | model TFLOP/s | MFU vs the JAX {args.dtype} peak ({peak / 1e9:.0f} GFLOP/s) "
          f"| vs its own library's peak | ours / this |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        achieved = flops / r["step"]
        print(f"| {name} | {n_tokens / r['step']:.0f} | {r['step']:.3f} | {achieved / 1e12:.4f} | "
              f"{achieved / peak:.1%} | {achieved / own_peak[name]:.1%} | "
              f"{r['step'] / ours['step'] if name != 'jaxrl_llm' else 1.0:.2f}x |")


if __name__ == "__main__":
    main()
