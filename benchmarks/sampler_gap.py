"""The sampler/trainer gap: how far the sampler's log-probs of its own tokens are from the trainer's, per
`sampling.dtype`, on the bundled model and README's demo prompts.

    .venv/bin/python benchmarks/sampler_gap.py [--setups lora_demo,lora_demo_trained,full] [--settings ,bfloat16,int8]
        [--batches 2] [--adapter DIR] [--json benchmarks/results/sampler_gap.json]
    .venv/bin/python benchmarks/sampler_gap.py --runs LABEL=RUN_DIR,... --json OUT   # summarize training runs

Setups (each a `setup_run` of a config, as `jaxrl-llm train` builds it):
- lora_demo: configs/lora_demo.yaml, README's demo: LoRA adapters (rank 16, every projection) on the int8 base,
  at step 0 (B = 0: the merged policy is the dequantized int8 base itself);
- lora_demo_trained: the same with the adapters of `--adapter DIR` (a PEFT folder: a demo run's final_adapter/);
- full: the defaults (`jaxrl-llm train`): every weight trained, f32.

For each setup and each sampler setting (`sampling.dtype`: "" = the trainer's f32, the control; bfloat16; int8)
the script samples `--batches` of the demo's prompt batches (8 prompts x 8 samples, max 24 new tokens,
temperature 1, the loop's keys of steps 0, 1, ...) with `Run.sampler_params()` and `Run.sampler_model_config`, as
`train.loop.collect_rollouts` does, and computes the trainer's log-probs of the same tokens with the loop's
teacher-forced pass (`train.loop.token_logprobs` of `Run.policy_params()`, f32: the recomputed old log-probs).
With d_t = train_logp_t - sampler_logp_t over the response tokens it reports:
- mismatch_kl: the token mean of k3 = exp(d) - d - 1 (`objectives.rollout_correction`'s metric, the loop's
  rollout_mismatch_kl), and mismatch_kl_f64, the same in float64 (in float32 the floor's k3 rounds to 0);
- max_abs_d, mean_abs_d: max and mean |d_t|;
- outside_half_two: the fraction of tokens whose ratio exp(d_t) leaves [0.5, 2];
- tis_corrected_fraction: the fraction of tokens the default TIS (token level, truncate at 2) caps;
- seq_abs_log_ratio_mean / _max: |sum_t d_t| per response (the sequence-level log-ratio);
- accuracy (the verifier's, of the sampled responses), tokens, sample_s (the sampler's wall time, first batch's
  compile included);
- adapter_update_kept (LoRA setups): the share of the adapters' update W' - W the sampler's weights carry,
  <S - W, W' - W> / |W' - W|^2 over the projections (1 for the f32 merge; None with B = 0).
The f32 control is the floor: the sampler's incremental decode and the trainer's packed teacher-forced pass of
one f32 policy. Results go to `--json`.

    .venv/bin/python benchmarks/sampler_gap.py --moe [--moe-floor] [--json benchmarks/results/sampler_gap_moe.json]

`--moe` (issue 57, routing replay): a tiny random Qwen3-MoE (`tiny_moe`: 2 sparse layers of 8 experts, top 2), its
dense counterpart (the same attention, embeddings and output; one dense MLP of width 48 per layer) and the dense
model with its active width and own weights (`matched_dense`), sampled by `generate` with an f32 (control), bf16
and int8 (every projection and expert matrix quantized per output channel) copy, scored by the f32 trainer's packed
log-prob pass (`train.logprobs.response_logprobs`) with model.routing_replay none and rollout: the numbers above
plus routes_changed (recorded (token, layer) routes whose experts in the trainer's pass differ from the sampler's)
and routes_own_changed (the trainer's own top k against the sampler's). `--moe-floor` adds `floor_rows`: where the
bf16 sampler's replayed gap comes from, teacher-forced on four random models.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxrl_llm.models import quant  # noqa: E402
from jaxrl_llm.objectives import rollout_correction  # noqa: E402
from jaxrl_llm.run.setup import setup_run  # noqa: E402
from jaxrl_llm.train import load_config  # noqa: E402
from jaxrl_llm.train.loop import token_logprobs  # noqa: E402
from jaxrl_llm.train.rollouts import sample_and_score  # noqa: E402

SETUPS = {"lora_demo": "configs/lora_demo.yaml", "lora_demo_trained": "configs/lora_demo.yaml", "full": None}


def gap_metrics(train_logp: np.ndarray, sampler_logp: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """The gap's numbers over the masked tokens of one or more rollout batches (see the module docstring)."""
    on = mask != 0
    d = np.where(on, train_logp.astype(np.float64) - sampler_logp.astype(np.float64), 0.0)
    _, found = rollout_correction(jnp.asarray(train_logp), jnp.asarray(sampler_logp), jnp.asarray(mask))
    seq = np.abs(d.sum(axis=1))[on.any(axis=1)]
    ratio = np.exp(d[on])
    return {"mismatch_kl": float(found["mismatch_kl"]),
            "mismatch_kl_f64": float(np.mean(np.expm1(d[on]) - d[on])),  # the floor's k3 rounds to 0 in f32
            "max_abs_d": float(np.abs(d[on]).max()),
            "mean_abs_d": float(np.abs(d[on]).mean()),
            "outside_half_two": float(np.mean((ratio < 0.5) | (ratio > 2.0))),
            "tis_corrected_fraction": float(found["corrected_fraction"]),
            "seq_abs_log_ratio_mean": float(seq.mean()), "seq_abs_log_ratio_max": float(seq.max()),
            "tokens": int(on.sum())}


def adapter_update_kept(base, merged, sampler) -> float | None:
    """How much of the adapters' update the sampler's weights carry: with D = merged - base and S = sampler - base
    over every projection (base dequantized), <S, D> / <D, D> (1: all of it; 0: the sampler reads the base).
    None when the adapters are zero (B = 0)."""
    base = quant.dequantize_base(base)
    sampler = quant.dequantize_base(sampler)
    num = den = 0.0
    for name, w in base["layers"].items():
        if not name.endswith("_proj"):
            continue
        w = np.asarray(w, np.float64)
        d = np.asarray(merged["layers"][name], np.float64) - w
        num += float(np.sum((np.asarray(sampler["layers"][name].astype(jnp.float32), np.float64) - w) * d))
        den += float(np.sum(d * d))
    return num / den if den > 0 else None


def measure(run, setting: str, batches: list[list[dict]]) -> dict:
    """Sample every batch with the sampler in `setting` and score its tokens with the trainer's f32 pass."""
    run.config = dataclasses.replace(run.config, sampling=dataclasses.replace(run.config.sampling, dtype=setting))
    cfg = run.config
    policy = run.policy_params()
    sampler_params, sampler_config = run.sampler_params(policy), run.sampler_model_config
    train_parts, sampler_parts, masks, correct, sample_s = [], [], [], [], 0.0
    for step, records in enumerate(batches):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(cfg.train.seed), step), 0)  # the loop's
        t0 = time.perf_counter()
        scored = sample_and_score(sampler_params, sampler_config, run.tokenizer, records,
                                  cfg.sampling.samples_per_prompt, cfg.sampling, run.scorer, key, mesh=run.mesh)
        sample_s += time.perf_counter() - t0 - run.scorer.last_seconds
        train_parts.append(token_logprobs(run, policy, scored))
        width = cfg.sampling.max_new_tokens
        pad = lambda x: np.pad(x, ((0, 0), (0, width - x.shape[1])))  # noqa: E731
        sampler_parts.append(pad(scored.logprobs * scored.mask))
        train_parts[-1] = pad(train_parts[-1])
        masks.append(pad(scored.mask))
        correct.append(scored.correct)
    out = gap_metrics(np.concatenate(train_parts), np.concatenate(sampler_parts), np.concatenate(masks))
    if run.base_params is not None:
        out["adapter_update_kept"] = adapter_update_kept(run.base_params, policy, sampler_params)
    out.update(accuracy=float(np.concatenate(correct).mean()), sample_s=round(sample_s, 2),
               sampler_compute_dtype=sampler_config.compute_dtype,
               sampler_projection_dtype=str(jax.tree_util.tree_leaves(sampler_params["layers"]["q_proj"])[0].dtype))
    return out


def tiny_moe(seed: int = 0, router_scale: float = 0.3):
    """(config, params) of the tiny random Qwen3-MoE and of its dense counterpart. Weights ~ N(0, 0.15^2) (logits
    far from uniform), the router's x `router_scale` (margins between experts small enough for bf16 to flip some)."""
    from jaxrl_llm.models import ModelConfig, init_params

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2, num_kv_heads=1,
                head_dim=16, qk_norm=True, moe_impl="ragged_dot")
    config = ModelConfig(**base, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=16, norm_topk_prob=True)
    dense_config = ModelConfig(**base, model_type="qwen3")
    params = jax.tree_util.tree_map(lambda w: w * 7.5 if w.ndim > 1 else w, init_params(config, jax.random.key(seed)))
    params["layers"]["router"] = params["layers"]["router"] * router_scale
    dense = jax.tree_util.tree_map(lambda w: w * 7.5 if w.ndim > 1 else w,
                                   init_params(dense_config, jax.random.key(seed + 1)))
    # the MoE's own weights wherever the dense model has them (everything but its MLP's gate, up and down)
    dense = {**dense, "embed": params["embed"], "final_norm": params["final_norm"],
             "layers": {k: params["layers"].get(k, w) for k, w in dense["layers"].items()}}
    return (config, params), (dense_config, dense)


def matched_dense(config, params):
    """(config, params) of the dense model with the MoE's active width and its own weights: every layer's MLP is
    experts 0 and 1 side by side (gate, up [D, 2F]; down [2F, D] x 1/2), so in exact arithmetic it is the MoE with
    a constant router (every token to experts 0 and 1, weighted 1/2 each). The same attention, embeddings, output
    and hidden sizes, the same number of active parameters and the same weight scale: the MoE's own dense floor,
    without the routing."""
    from jaxrl_llm.models import ModelConfig
    from jaxrl_llm.models.model import param_shapes

    layers = params["layers"]
    pair = lambda w: jnp.concatenate([w[:, 0], w[:, 1]], axis=-1)  # noqa: E731  [L, E, in, F] -> [L, in, 2F]
    mlp = {"gate_proj": pair(layers["expert_gate"]), "up_proj": pair(layers["expert_up"]),
           "down_proj": 0.5 * jnp.concatenate([layers["expert_down"][:, 0], layers["expert_down"][:, 1]], axis=1)}
    dense_config = ModelConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                               intermediate_size=2 * config.moe_intermediate_size, num_layers=config.num_layers,
                               num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                               qk_norm=config.qk_norm, model_type="qwen3")
    names = param_shapes(dense_config)["layers"]
    return dense_config, {**params, "layers": {k: mlp.get(k, layers.get(k)) for k in names}}


def sampler_copy(params, config, setting: str):
    """The sampler's (params, config) for `setting`: "" the f32 policy, "bfloat16" every weight and activation in
    bf16, "int8" every projection and expert matrix int8 per output channel (`quant.quantize_base`)."""
    if setting == "bfloat16":
        return (jax.tree_util.tree_map(lambda w: w.astype(jnp.bfloat16), params),
                config.replace(param_dtype="bfloat16", compute_dtype="bfloat16"))
    if setting == "int8":
        targets = tuple(k for k in params["layers"] if k.endswith("_proj") or k in ("expert_gate", "expert_up",
                                                                                   "expert_down"))
        return quant.quantize_base(params, "int8", targets), config
    return params, config


def scored_rollouts(params, config, prompts, samples: int, new_tokens: int, seed: int):
    """`generate`'s rollout of `prompts` as the trainer's `ScoredRollouts` (no rewards), routes included."""
    from jaxrl_llm.sampling import generate
    from jaxrl_llm.train.rollouts import ScoredRollouts

    rollout = generate(params, config, prompts, num_samples=samples, max_new_tokens=new_tokens, temperature=1.0,
                       rng=jax.random.key(seed))
    n = len(rollout.lengths)
    return ScoredRollouts(records=[{"prompt_ids": p, "answer": ""} for p in prompts], prompt_index=rollout.prompt_index,
                          tokens=rollout.tokens, mask=rollout.mask, logprobs=rollout.logprobs, lengths=rollout.lengths,
                          rewards=np.zeros(n, np.float32), correct=np.zeros(n, bool), routes=rollout.routes,
                          prompt_routes=rollout.prompt_routes)


def _trainer_pass(params, config, batch, replay):
    from jaxrl_llm.train.logprobs import response_logprobs
    from jaxrl_llm.train.routing import routes_changed

    logp, routes = response_logprobs(params, config, batch, routing_replay=replay, with_routes=True)
    if routes is None:
        return logp, None
    return logp, (routes_changed(routes.chosen, batch.routes), routes_changed(routes.own, batch.routes), routes.own)


trainer_pass = jax.jit(_trainer_pass, static_argnums=(1, 3))


def trainer_gap(params, config, scored, replay: str) -> dict:
    """`gap_metrics` of the f32 trainer's packed pass (routing_replay `replay`) on `scored`, with routes_changed and
    routes_own_changed for a mixture of experts."""
    from jaxrl_llm.train.packing import unpack

    train, counts, (batch, groups, order) = trainer_logprobs(params, config, scored, replay)
    out = gap_metrics(train, scored.logprobs * scored.mask, scored.mask)
    if counts is not None:
        (changed, recorded), (own, _) = jax.tree_util.tree_map(float, counts[:2])
        out.update(routes_changed=changed / recorded, routes_own_changed=own / recorded, routes_recorded=int(recorded))
        # the samples none of whose recorded routes (prompt or response) the trainer's own top k changes: their gap
        # is the bf16 arithmetic's alone, the MoE's own floor
        flipped = route_flips(np.asarray(counts[2]), batch)[np.argsort(order)]
        kept = unpack(flipped[..., None], groups, scored.num_samples)[:, 0] == 0
        clean = gap_metrics(train[kept], scored.logprobs[kept] * scored.mask[kept], scored.mask[kept]) if kept.any() \
            else {"mismatch_kl_f64": 0.0}
        out.update(unflipped_samples=float(kept.mean()), mismatch_kl_f64_unflipped=clean["mismatch_kl_f64"])
    return out


def trainer_logprobs(params, config, scored, replay: str):
    """The f32 trainer's packed pass (routing_replay `replay`) on `scored`: (log-probs [R, N], 0 off the mask;
    None for a dense model, else ((changed, recorded), (own changed, recorded), own routes) of `_trainer_pass`;
    `packed_rollouts`' (batch, groups, order))."""
    from jaxrl_llm.train.packing import unpack
    from jaxrl_llm.train.rollouts import packed_rollouts

    batch, groups, order = packed_rollouts(scored, 1, 0)
    logp, counts = trainer_pass(params, config, batch, replay)
    train = unpack(np.asarray(logp)[np.argsort(order)], groups, scored.num_samples) * scored.mask
    return train, counts, (batch, groups, order)


def route_flips(own: np.ndarray, batch) -> np.ndarray:
    """[G, S] int: per packed row and response slot, how many positions of the slot's prompt or response hold a
    recorded route the trainer's own top k (`own` [G, L, L_sparse, k]) changes."""
    recorded = batch.routes
    flip = np.any(np.sort(own, -1) != np.sort(recorded, -1), axis=-1) & (recorded[..., 0] >= 0)  # [G, L, L_sparse]
    flip = flip.any(-1)
    slots = batch.pred_index.shape[1]
    prompt = (flip & (batch.segments == 0)).sum(1)
    return np.stack([prompt + (flip & (batch.segments == s + 1)).sum(1) for s in range(slots)], axis=1)


MOE_PROMPTS = [[3, 17, 5, 9, 40], [11, 2], [7, 7, 30, 12, 1, 8, 22], [50, 4, 4, 9], [1, 2, 3], [60, 33, 21, 8, 8, 2]]


MOE_MODELS = ("moe", "dense", "dense_matched")


def moe_rows(settings=("", "bfloat16", "int8"), seeds=(1, 2, 3, 4), samples: int = 8, new_tokens: int = 16,
             models=MOE_MODELS) -> list:
    """One row per model of `models` (moe; dense, the dense counterpart of `tiny_moe`; dense_matched,
    `matched_dense`), sampler setting and routing replay (a dense model: none only): the gap over `seeds` sampler
    calls of `MOE_PROMPTS` x `samples`, `new_tokens` each (see `gap_metrics`, `trainer_gap`)."""
    rows = []
    moe, dense = tiny_moe()
    for name, (config, params) in zip(MOE_MODELS, (moe, dense, matched_dense(*moe))):
        if name not in models:
            continue
        for setting in settings:
            copy = sampler_copy(params, config, setting)
            parts = [scored_rollouts(*copy, MOE_PROMPTS, samples, new_tokens, seed) for seed in seeds]
            for replay in ("none", "rollout") if name == "moe" else ("none",):
                gaps = [trainer_gap(params, config, scored, replay) for scored in parts]
                tokens = np.array([g["tokens"] for g in gaps], np.float64)
                row = {k: float(np.average([g[k] for g in gaps], weights=tokens)) for k in gaps[0]
                       if k not in ("tokens", "routes_recorded", "max_abs_d", "seq_abs_log_ratio_max")}
                row.update(max_abs_d=max(g["max_abs_d"] for g in gaps), tokens=int(tokens.sum()))
                rows.append({"model": name, "sampling_dtype": setting or "float32", "routing_replay": replay, **row})
    return rows


def _forced_rows(params, config, seeds=(1, 2, 3, 4)):
    """tokens [R, T] (each prompt of `MOE_PROMPTS` and an f32 sample of `params`, right-padded) and mask [R, T] (1 at
    the positions that predict a response token)."""
    rows = []
    for seed in seeds:
        scored = scored_rollouts(params, config, MOE_PROMPTS, 8, 16, seed)
        for i in range(scored.num_samples):
            prompt = MOE_PROMPTS[scored.prompt_index[i]]
            rows.append((list(prompt) + list(scored.tokens[i, :scored.lengths[i]]), len(prompt)))
    width = max(len(t) for t, _ in rows)
    tokens, mask = np.zeros((len(rows), width), np.int32), np.zeros((len(rows), width), np.float32)
    for i, (t, p) in enumerate(rows):
        tokens[i, :len(t)] = t
        mask[i, p - 1:len(t) - 1] = 1
    return jnp.asarray(tokens), mask


def forced_kl(params, config, sampler, tokens, mask) -> float:
    """Token mean over `mask` of KL(p_sampler || p_trainer) over the whole vocabulary, both teacher-forced on `tokens`:
    the sampler's pass (`sampler` = (params, config), e.g. `sampler_copy`'s bf16) records its routes and the f32
    trainer's replays them. Paired (the same tokens for every variant), so small differences are not sampling noise."""
    from jaxrl_llm.models import model

    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    if config.num_experts:
        hidden, routes = model.hidden_states(*sampler, tokens, positions, with_routes=True)
        trainer, _ = model.hidden_states(params, config, tokens, positions, replay=routes.chosen, with_routes=True)
    else:
        hidden, trainer = (model.hidden_states(p, c, tokens, positions) for p, c in (sampler, (params, config)))
    log_p = jax.nn.log_softmax(model.output_logits(*sampler, hidden))
    log_q = jax.nn.log_softmax(model.output_logits(params, config, trainer))
    kl = np.asarray(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1), np.float64)
    return float((kl * mask).sum() / mask.sum())


def floor_rows(model_seeds=(0, 10, 20, 30)) -> list:
    """Where the bf16 sampler's replayed gap comes from, per random model (`tiny_moe(seed)`), by `forced_kl` on the
    MoE's own f32 samples: moe (replayed); moe_sparse_f32 (the bf16 pass with every sparse block computed in f32
    from its bf16 input and bf16 weights: the routing, experts and combine without bf16 arithmetic); moe_fixed_gates
    (the same MoE with every gate weight 1/k in both passes: still routed and replayed, but no gate weight depends on
    the hidden state; _own: on its own f32 samples); dense_matched_ij (`matched_dense` of experts i and j) on the
    MoE's tokens."""
    from unittest import mock

    from jaxrl_llm.models import model, moe

    def sparse_f32(lp, config, h, *args, **kwargs):
        if h.dtype != jnp.bfloat16:
            return moe.moe_block(lp, config, h, *args, **kwargs)
        lp = {k: v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v for k, v in lp.items()}
        out = moe.moe_block(lp, config, h.astype(jnp.float32), *args, **kwargs)
        return (out[0].astype(h.dtype), out[1]) if kwargs.get("with_routes") else out.astype(h.dtype)

    route = moe.route

    def fixed_gates(*args, **kwargs):
        routing = route(*args, **kwargs)
        return routing._replace(weights=jnp.full_like(routing.weights, 1 / routing.weights.shape[-1]))

    rows = []
    for seed in model_seeds:
        (config, params), _ = tiny_moe(seed)
        tokens, mask = _forced_rows(params, config)
        bf16 = sampler_copy(params, config, "bfloat16")
        row = {"model_seed": seed, "moe": forced_kl(params, config, bf16, tokens, mask)}
        with mock.patch.object(model, "moe_block", sparse_f32):
            jax.clear_caches()
            row["moe_sparse_f32"] = forced_kl(params, config, bf16, tokens, mask)
        with mock.patch.object(moe, "route", fixed_gates):
            jax.clear_caches()
            row["moe_fixed_gates"] = forced_kl(params, config, bf16, tokens, mask)
            row["moe_fixed_gates_own"] = forced_kl(params, config, bf16, *_forced_rows(params, config))
        jax.clear_caches()
        for i in range(0, config.num_experts, 2):
            order = jnp.asarray([i, i + 1] + [e for e in range(config.num_experts) if e not in (i, i + 1)])
            layers = {k: v[:, order] if k in moe.EXPERT_WEIGHTS else v for k, v in params["layers"].items()}
            dense_config, dense = matched_dense(config, {**params, "layers": layers})
            row[f"dense_matched_{i}{i + 1}"] = forced_kl(dense, dense_config,
                                                         sampler_copy(dense, dense_config, "bfloat16"), tokens, mask)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def setup(name: str, adapter: str | None):
    overrides = ["train.eval_problems=0", "train.out_dir=runs/sampler_gap"]
    if name == "lora_demo_trained":
        if not adapter:
            raise SystemExit("setup lora_demo_trained needs --adapter DIR (a PEFT folder, e.g. a run's final_adapter)")
        overrides.append(f"lora.adapter={adapter}")
    config = load_config(None if SETUPS[name] is None else ROOT / SETUPS[name], overrides)
    return setup_run(config)


def summarize_run(directory: pathlib.Path) -> dict:
    """A training run's numbers from its metrics.jsonl (and train.log, the `/usr/bin/time -v` output beside it):
    held-out avg@k before / after with their sampling sd, the change in noise sd, the mismatch KL and (with the
    correction) the corrected fraction per step, the sampler's training accuracy per step, seconds per step."""
    rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_accuracy" in r]
    steps = [r for r in rows if "updates" in r]
    before, after = evals[0], evals[-1]
    noise = (before["eval_sampling_sd"] ** 2 + after["eval_sampling_sd"] ** 2) ** 0.5
    out = {"eval_before": before["eval_accuracy"], "eval_before_sd": before["eval_sampling_sd"],
           "eval_after": after["eval_accuracy"], "eval_after_sd": after["eval_sampling_sd"],
           "change_in_noise_sd": round((after["eval_accuracy"] - before["eval_accuracy"]) / noise, 2),
           "steps": len(steps), "median_step_s": round(float(np.median([r["time_wall_s"] for r in steps])), 1)}
    for key in ("rollout_mismatch_kl", "rollout_corrected_fraction", "rollout_weight_mean", "clip_fraction", "accuracy"):
        if any(key in r for r in steps):
            out[f"{key}_per_step"] = [round(r[key], 5) if key in r else None for r in steps]
    log = directory / "train.log"
    if log.is_file():
        for line in log.read_text(errors="replace").splitlines():
            if "Elapsed (wall clock)" in line:
                out["wall"] = line.split("):", 1)[1].strip()
            if "Command being timed" in line:
                out["command"] = line.split(":", 1)[1].strip().strip('"')
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setups", default="lora_demo,full", help="of " + ",".join(SETUPS))
    parser.add_argument("--settings", default=",bfloat16,int8", help="sampling.dtype values; '' is the control")
    parser.add_argument("--batches", type=int, default=2, help="prompt batches of the demo (8 prompts x 8 samples)")
    parser.add_argument("--adapter", default=None, help="lora_demo_trained: a PEFT adapter folder (final_adapter/)")
    parser.add_argument("--json", default=None, help="default benchmarks/results/sampler_gap.json "
                        "(--moe: sampler_gap_moe.json)")
    parser.add_argument("--runs", default="", help="label=RUN_DIR,...: summarize training runs instead of sampling")
    parser.add_argument("--moe", action="store_true", help="a tiny random MoE's gap without and with routing replay")
    parser.add_argument("--moe-floor", action="store_true", help="with --moe: also `floor_rows`, where the replayed "
                        "gap comes from (teacher-forced, four random models)")
    args = parser.parse_args(argv)
    if args.moe:
        return moe_main(args.json or str(ROOT / "benchmarks/results/sampler_gap_moe.json"), args.moe_floor)
    args.json = args.json or str(ROOT / "benchmarks/results/sampler_gap.json")
    if args.runs:
        runs = {label: summarize_run(pathlib.Path(d)) for label, d in (x.split("=", 1) for x in args.runs.split(","))}
        path = pathlib.Path(args.json)
        path.write_text(json.dumps({"benchmark": "training runs with the sampler's precision off the trainer's "
                                                 "(benchmarks/sampler_gap.py --runs)",
                                    "date": datetime.date.today().isoformat(), "runs": runs}, indent=1) + "\n")
        print(json.dumps(runs, indent=1))
        return 0
    results, started = [], time.perf_counter()
    for name in args.setups.split(","):
        run = setup(name, args.adapter)
        try:
            batches = [next(run.data) for _ in range(args.batches)]
            for setting in args.settings.split(","):
                row = {"setup": name, "sampling_dtype": setting or "(trainer's: float32)", **measure(run, setting,
                                                                                                     batches)}
                results.append(row)
                print(json.dumps(row), flush=True)
        finally:
            run.close()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    record = {
        "benchmark": "sampler/trainer gap per sampling.dtype (benchmarks/sampler_gap.py)",
        "date": datetime.date.today().isoformat(), "commit": commit,
        "machine": f"{platform.machine()}, {len(jax.devices())} x {jax.devices()[0].platform}, "
                   f"{__import__('os').cpu_count()} cores",
        "command": "benchmarks/sampler_gap.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "adapter": args.adapter,
        "workload": f"{args.batches} demo prompt batches x 8 prompts x 8 samples, max_new_tokens 24, temperature 1",
        "wall_s": round(time.perf_counter() - started, 1),
        "rows": results,
    }
    path = pathlib.Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0


def moe_main(json_path: str, floor: bool = False) -> int:
    started = time.perf_counter()
    rows = moe_rows()
    for row in rows:
        print(json.dumps(row), flush=True)
    floors = floor_rows() if floor else None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    record = {"benchmark": "sampler/trainer gap of a tiny random MoE, without and with routing replay "
                           "(benchmarks/sampler_gap.py --moe)",
              "date": datetime.date.today().isoformat(), "commit": commit,
              "machine": f"{platform.machine()}, {len(jax.devices())} x {jax.devices()[0].platform}",
              "command": "benchmarks/sampler_gap.py --moe" + (" --moe-floor" if floor else ""),
              "workload": f"{len(MOE_PROMPTS)} prompts x 8 samples x 16 new tokens, 4 sampler seeds, temperature 1",
              "wall_s": round(time.perf_counter() - started, 1), "rows": rows}
    if floors is not None:
        record["floor"] = {"what": "teacher-forced KL(p_bf16 || p_f32) over the vocabulary, token mean on the f32 "
                                   "samples of tiny_moe(model_seed) (sampler_gap.floor_rows)", "rows": floors}
    path = pathlib.Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
