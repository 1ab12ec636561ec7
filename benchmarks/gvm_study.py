"""Uniform sampling against GVM allocation at the same number of samples drawn.

    python benchmarks/gvm_study.py [--algorithms raftpp,grpo] [--seeds 0,1,2] [--sample-budget 4096]
        [--eval-every-samples 512] [--target 0.5] [--model bundled] [--out runs/gvm_study]
        [--set optim.lr=2e-5 --set data.train=... ...]

For each algorithm A and seed, trains the preset configs/A.yaml (uniform, `samples_per_prompt` per prompt)
and configs/gvm_A.yaml (GVM: N' stage-1 samples plus a stage-2 budget of N'' per prompt) from the same
policy, each for as many steps as the sample budget allows (stage-1 samples count, so a GVM step costs
P x (N' + N'') samples and a uniform step P x N''). Held-out avg@k is measured at about every
`--eval-every-samples` samples drawn. Writes OUT/results.json (every run's curve of accuracy against samples
drawn, steps and training wall time; the samples, steps and seconds each run needed to first reach
`--target`) and OUT/accuracy_vs_samples.png.

The budget caps each run: a GVM step whose allocation is all zero (no prompt solved in stage 1) draws
only its stage-1 samples and skips the update, so such a run ends below the budget (`samples_drawn` is
reported per run). The issue's preferred setting (a small model first fine-tuned until its per-prompt
success is mixed, on prompts of graded difficulty) is chosen with `--model` and `--set data.train=...`.

`--model tiny` trains a tiny random decoder over the bundled tokenizer: a smoke test of the script only.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_policy(model: str):
    from jaxrl_llm.run.setup import load_policy as load

    if model != "tiny":
        return load(model)
    import jax

    from jaxrl_llm import models
    from jaxrl_llm.models.bundled import bundled_gguf_path
    from jaxrl_llm.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(bundled_gguf_path())
    config = models.ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    return config, models.init_params(config, jax.random.PRNGKey(0)), tokenizer


def toy_overrides(toy: str | None) -> list[str]:
    """Config overrides for the setting written by benchmarks/gvm_toy_setting.py into directory `toy`."""
    if not toy:
        return []
    folder = pathlib.Path(toy)
    missing = [name for name in ("train.jsonl", "eval.jsonl", "model") if not (folder / name).exists()]
    if missing:
        raise SystemExit(f"--toy {folder}: missing {missing}; run benchmarks/gvm_toy_setting.py --out {folder} first")
    return [f"data.train={{kind: jsonl, path: {folder / 'train.jsonl'}}}",
            f"data.eval={{kind: jsonl, path: {folder / 'eval.jsonl'}}}", "data.prompt=bare",
            "sampling.max_new_tokens=10", "train.eval_problems=200"]


# Arms of the study: (GVM preset or not, extra overrides). `--allocations` picks among them.
ARMS = {
    "uniform": (False, []),
    "gvm": (True, []),  # the authors' form: token-mean over every sample
    "gvm_mstep": (True, ["algorithm.agg=prompt-mean-unbiased"]),  # the paper's M-step (Lemma 1)
    "uniform_drop_unsolved": (True, ["sampling.gvm_weighting=solved"]),  # GVM's filter, no weighting
    # The update-count control: the authors' verl scripts give the GVM arm about 8x the optimizer updates of
    # the uniform n = 8 arm; this arm gives uniform sampling 8 updates per step.
    "uniform_updates": (False, ["optim.mini_batches=8"]),
    # The step-size control: one update per step at 8x the learning rate moves the weights about as far as 8
    # updates at the base rate (AdamW steps are ~lr each), without the extra updates.
    "uniform_lr8x": (False, ["optim.lr=1.6e-4"]),
    "gvm_mstep_lr8x": (True, ["algorithm.agg=prompt-mean-unbiased", "optim.lr=1.6e-4"]),
    # GVM with n_i capped at 32 (4x the mean budget), the excess spread over the other prompts.
    "gvm_capped": (True, ["sampling.gvm_max_samples=32"]),
    # p_i, G_i from the prompt's earlier visits: stage 1 only for unseen prompts and probes of unsolved ones.
    "gvm_history": (True, ["sampling.gvm_estimates=history"]),
    "gvm_mstep_history": (True, ["sampling.gvm_estimates=history", "algorithm.agg=prompt-mean-unbiased"]),
    "gvm_history_updates": (True, ["sampling.gvm_estimates=history", "optim.mini_batches=8"]),
    # Half the samples per step, 8 updates each: far above the gradient noise scale a step needs fewer.
    "uniform_updates_n4": (False, ["optim.mini_batches=8", "sampling.samples_per_prompt=4"]),
    "gvm_history_updates_n4": (True, ["sampling.gvm_estimates=history", "optim.mini_batches=8",
                                      "sampling.gvm_samples_per_prompt=4"]),
    # ... and a new prompt's N' = 4 stage-1 samples reused in its stage-2 group: stage 1 costs only the
    # samples of prompts that get n_i = 0.
    "gvm_history_reuse_updates_n4": (True, ["sampling.gvm_estimates=history", "optim.mini_batches=8",
                                            "sampling.gvm_samples_per_prompt=4", "sampling.gvm_stage1_samples=4",
                                            "sampling.gvm_reuse_stage1=true"]),
    **{f"uniform_updates_n{n}": (False, ["optim.mini_batches=8", f"sampling.samples_per_prompt={n}"]) for n in (1, 2)},
    # Stage 2's budget only for the prompts with an accepted sample in their history (`gvm_budget: solvable`):
    # the samples uniform sampling spends on never-solved prompts, which RAFT++ rejects, are not drawn; an
    # unsolved prompt is probed at its first two visits only. GVM's weights, or even ones (`_even`).
    **{f"gvm_history_solvable{even}_n{n}": (True, [
        "sampling.gvm_estimates=history", "optim.mini_batches=8", f"sampling.gvm_samples_per_prompt={n}",
        f"sampling.gvm_stage1_samples={n}", "sampling.gvm_reuse_stage1=true", "sampling.gvm_budget=solvable",
        "sampling.gvm_history_probe_visits=2", *(["sampling.gvm_weighting=solved"] if even else [])])
       for even in ("", "_even") for n in (1, 2, 4)},
}


def run_config(algorithm: str, arm: str | bool, seed: int, args, out_dir: pathlib.Path):
    """The preset with the study's budget: steps and eval interval from the samples one step draws. `arm` is
    a key of ARMS (True / False: "gvm" / "uniform")."""
    from jaxrl_llm.train import load_config
    arm = {True: "gvm", False: "uniform"}.get(arm, arm)
    gvm, extra = ARMS[arm]
    preset = ROOT / "configs" / (f"gvm_{algorithm}.yaml" if gvm else f"{algorithm}.yaml")
    overrides = [*toy_overrides(args.toy), *args.set, *extra]
    base = load_config(preset, overrides)
    s = base.sampling
    # A history arm's step draws its stage 1 only where the history is missing: its steps are counted at the
    # stage-2 budget, so it draws somewhat more than the budget; results compare at equal samples drawn.
    stage1 = s.gvm_stage1_samples if s.gvm_estimates == "stage1" else 0
    per_step = s.prompts_per_step * ((stage1 + s.gvm_samples_per_prompt) if gvm else s.samples_per_prompt)
    if gvm and s.gvm_budget == "solvable":  # steps counted as if 60% of the prompts were solvable (the hard
        per_step *= 0.6                     # mix: 50-65%), so the run draws about the budget; compare at samples
    steps = max(1, args.sample_budget // per_step)
    eval_every = max(1, round(args.eval_every_samples / per_step))
    return load_config(preset, [*overrides, f"train.steps={steps}", f"train.eval_every={eval_every}",
                                f"train.seed={seed}", f"data.seed={seed}", f"train.out_dir={out_dir}",
                                "train.save_every=0"])


def train_once(config, policy) -> dict:
    """Train, then read the run's curve: (samples drawn, step, training seconds, held-out accuracy) points."""
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.run.metrics import read_metrics
    from jaxrl_llm.train.loop import train

    model_config, params, tokenizer = policy
    params = jax.tree_util.tree_map(jnp.copy, params)  # the train step donates its state
    started = time.perf_counter()
    summary = train(config, policy=(model_config, params, tokenizer), log=lambda *a: None)
    total_s = time.perf_counter() - started
    if summary.get("status") == "preempted":  # SIGTERM: the run saved a checkpoint; a partial curve is no result
        raise SystemExit(f"{config.train.out_dir}: interrupted by SIGTERM; the runs finished before it are in "
                         "results.json")
    rows = read_metrics(config.train.out_dir)
    curve = [{"samples": 0, "step": 0, "train_s": 0.0, "accuracy": summary["eval_before"]["accuracy"]}]
    train_s, samples = 0.0, 0
    for row in rows:  # step rows carry time and samples; evaluation rows carry only the step and accuracy
        train_s += row.get("time_wall_s", 0.0)
        samples = row.get("samples_drawn", samples)
        if "eval_accuracy" in row and row["step"] > 0:
            curve.append({"samples": samples, "step": row["step"], "train_s": train_s,
                          "accuracy": row["eval_accuracy"]})
    if curve[-1]["step"] != config.train.steps:
        curve.append({"samples": summary["samples_drawn"], "step": config.train.steps, "train_s": train_s,
                      "accuracy": summary["eval_after"]["accuracy"]})
    gvm_rows = [r for r in rows if "gvm_n" in r]
    return {"curve": curve, "total_s": total_s, "samples_drawn": summary["samples_drawn"],
            "steps": config.train.steps, "final_accuracy": summary["eval_after"]["accuracy"],
            "gvm_skipped_steps": sum(r["gvm_skipped"] for r in gvm_rows),
            "gvm_zero_fraction": float(np.mean([r["gvm_zero_fraction"] for r in gvm_rows])) if gvm_rows else None}


def first_reaching(curve: list[dict], target: float) -> dict | None:
    """The first evaluation point at or above `target` (None when the run never reached it)."""
    return next((point for point in curve if point["accuracy"] >= target), None)


def crossing(curve: list[dict], target: float, field: str = "samples") -> float | None:
    """`field` where the curve first reaches `target`, linear between the evaluation before it and the first one
    at or above it (evaluations every k samples otherwise round every arm up to a multiple of k)."""
    for before, point in zip(curve, curve[1:]):
        if point["accuracy"] >= target:
            if before["accuracy"] >= target:
                return float(before[field])
            share = (target - before["accuracy"]) / (point["accuracy"] - before["accuracy"])
            return float(before[field] + share * (point[field] - before[field]))
    return float(curve[0][field]) if curve and curve[0]["accuracy"] >= target else None


def summarise(results: list[dict], target: float, budget: float = float("inf")) -> dict:
    """Per arm: runs reaching `target` and the samples / steps / seconds they took, final accuracy, and the
    accuracy of the last evaluation at or below `budget` samples drawn."""
    table = {}
    for key in sorted({(r["algorithm"], r["allocation"]) for r in results}):
        runs = [r for r in results if (r["algorithm"], r["allocation"]) == key]
        hits = [first_reaching(r["curve"], target) for r in runs]
        reached = [h for h in hits if h is not None]
        mean = lambda field: float(np.mean([h[field] for h in reached])) if reached else None  # noqa: E731
        finals = [r["final_accuracy"] for r in runs]
        at_budget = [max((p for p in r["curve"] if p["samples"] <= budget), key=lambda p: p["samples"])["accuracy"]
                     for r in runs]
        table["/".join(key)] = {
            "seeds": len(runs), "reached_target": len(reached), "samples_to_target": mean("samples"),
            "samples_to_target_interpolated": float(np.mean(
                [c for c in (crossing(r["curve"], target) for r in runs) if c is not None])) if reached else None,
            "steps_to_target": mean("step"), "train_s_to_target": mean("train_s"),
            "final_accuracy_mean": float(np.mean(finals)), "final_accuracy_std": float(np.std(finals)),
            "samples_drawn": float(np.mean([r["samples_drawn"] for r in runs])),
            "accuracy_at_budget_mean": float(np.mean(at_budget)), "accuracy_at_budget_std": float(np.std(at_budget))}
    return table


def best_ratio(table: dict, field: str = "samples_to_target") -> dict:
    """Per algorithm: samples to target of the best GVM arm (names starting "gvm") over the best other arm
    (uniform sampling, its controls), with the arms named; None where either never reached the target. Only
    arms whose every seed reached the target compete."""
    out = {}
    for algorithm in sorted({key.split("/")[0] for key in table}):
        best = {}
        for family, is_gvm in (("gvm", True), ("uniform", False)):
            arms = [(row[field], key.split("/")[1]) for key, row in table.items()
                    if key.startswith(algorithm + "/") and key.split("/")[1].startswith("gvm") == is_gvm
                    and row[field] is not None and row["reached_target"] == row["seeds"]]
            best[family] = min(arms) if arms else None
        ratio = best["gvm"][0] / best["uniform"][0] if best["gvm"] and best["uniform"] else None
        out[algorithm] = {"best_gvm": best["gvm"] and best["gvm"][1],
                          "best_uniform": best["uniform"] and best["uniform"][1], "samples_ratio": ratio}
    return out


def plot(results: list[dict], path: pathlib.Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algorithms = sorted({r["algorithm"] for r in results})
    fig, axes = plt.subplots(2, len(algorithms), figsize=(5 * len(algorithms), 7.2), squeeze=False)
    palette = ("tab:blue", "tab:red", "tab:purple", "tab:green", "tab:orange", "tab:brown", "tab:pink", "tab:olive",
               "tab:cyan", "tab:gray", "black")
    present = [arm for arm in ARMS if any(r["allocation"] == arm for r in results)]
    colors = dict(zip(present, palette))
    for col, algorithm in enumerate(algorithms):
        for ax, x_key, x_label in ((axes[0][col], "samples", "samples drawn (both GVM stages counted)"),
                                   (axes[1][col], "step", "RL steps")):
            for allocation, color in colors.items():
                for i, r in enumerate(x for x in results
                                      if x["algorithm"] == algorithm and x["allocation"] == allocation):
                    ax.plot([p[x_key] for p in r["curve"]], [p["accuracy"] for p in r["curve"]], color=color,
                            alpha=0.7, marker="o", markersize=3, label=f"{allocation}" if i == 0 else None)
            ax.axhline(target, color="gray", linestyle=":", linewidth=1)
            ax.set_title(algorithm)
            ax.set_xlabel(x_label)
            ax.set_ylabel("held-out accuracy")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", default="raftpp,grpo", help="presets A with configs/A.yaml and gvm_A.yaml")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--allocations", default="uniform,gvm", help=f"arms to run, of {','.join(ARMS)}")
    parser.add_argument("--sample-budget", type=int, default=4096, help="samples drawn per run, both GVM stages")
    parser.add_argument("--eval-every-samples", type=int, default=512)
    parser.add_argument("--target", type=float, default=0.5, help="held-out accuracy to reach")
    parser.add_argument("--model", default="bundled", help="'bundled', an HF folder, a .gguf file, or 'tiny'")
    parser.add_argument("--toy", default=None, metavar="DIR",
                        help="the setting written by benchmarks/gvm_toy_setting.py (data, prompt and lengths)")
    parser.add_argument("--out", default="runs/gvm_study")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override applied to every run, e.g. optim.lr=2e-5 (repeatable)")
    parser.add_argument("--from-results", default=None, metavar="A.json,B.json",
                        help="no training: merge the runs of earlier results.json files (e.g. one process per "
                             "algorithm), then summarise against --target and plot into --out")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_results:
        results = [run for path in args.from_results.split(",") for run in json.loads(pathlib.Path(path).read_text())["runs"]]
        report(results, args, out)
        return
    policy = load_policy(str(pathlib.Path(args.toy) / "model") if args.toy and args.model == "bundled" else args.model)
    results = []
    for algorithm in args.algorithms.split(","):
        for seed in [int(s) for s in args.seeds.split(",")]:
            for allocation in args.allocations.split(","):
                run_dir = out / f"{algorithm}-{allocation}-seed{seed}"
                config = run_config(algorithm, allocation, seed, args, run_dir)
                result = train_once(config, policy)
                results.append({"algorithm": algorithm, "allocation": allocation, "seed": seed, **result})
                print(f"{algorithm:8s} {allocation:7s} seed {seed}: {result['steps']} steps, "
                      f"{result['samples_drawn']} samples, final accuracy {result['final_accuracy']:.3f}, "
                      f"{result['total_s']:.0f}s", flush=True)
                report(results, args, out)  # after every run: an interrupted study keeps what it measured


def report(results: list[dict], args, out: pathlib.Path) -> None:
    table = summarise(results, args.target, args.sample_budget)
    ratio = best_ratio(table)
    interpolated = best_ratio(table, "samples_to_target_interpolated")
    (out / "results.json").write_text(json.dumps({"args": vars(args), "summary": table,
                                                  "best_gvm_over_best_uniform": ratio,
                                                  "best_gvm_over_best_uniform_interpolated": interpolated,
                                                  "runs": results}, indent=1))
    plot(results, out / "accuracy_vs_samples.png", args.target)
    for key, row in table.items():
        print(f"{key:16s} reached {row['reached_target']}/{row['seeds']}: samples {row['samples_to_target']}, "
              f"steps {row['steps_to_target']}, train s {row['train_s_to_target']}; final "
              f"{row['final_accuracy_mean']:.3f} +/- {row['final_accuracy_std']:.3f}")
    for algorithm, row in ratio.items():
        print(f"{algorithm}: samples to target, best GVM arm ({row['best_gvm']}) / best uniform arm "
              f"({row['best_uniform']}) = {row['samples_ratio']}")
    print(f"wrote {out / 'results.json'} and {out / 'accuracy_vs_samples.png'}")


if __name__ == "__main__":
    main()
