"""Performance at a glance: one row per headline figure of benchmarks/README.md, read from benchmarks/results/.

    python benchmarks/summary.py            # print the table
    python benchmarks/summary.py --write    # rewrite it in benchmarks/README.md and README.md, draw summary.png

Every number comes from a results file. Where and how it was measured comes from the file when the file records
it (`date`, `command`, `commit`), else from `PROVENANCE`, quoted from the notebook section that reported the run.
"ours better by" is peer / ours for seconds and bytes and ours / peer for rates, accuracy and samples saved, so
above 1x ours is better; "machine limit" is the ceiling measured on that machine and ours as a share of it.
tests/test_benchmark_summary.py fails when the README tables differ from what this script writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import re
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NOTEBOOK = ROOT / "benchmarks" / "README.md"
README = ROOT / "README.md"
FIGURE = ROOT / "benchmarks" / "summary.png"
START, END = "<!-- summary:start -->", "<!-- summary:end -->"
README_START, README_END = "<!-- how-fast:start -->", "<!-- how-fast:end -->"

_EPYC = "2-core AMD EPYC, idle"
_SHARED = "2-core CPU, shared with other jobs"
_TUNIX_ENV = "google-tunix 0.1.7, transformers 5.24.0, torch 2.13.0+cpu"

# What the older results files do not record, as the notebook section that reported each run states it.
PROVENANCE = {
    "sampling_cpu.json": {"machine": "2-core AMD EPYC, AVX-512, idle"},
    "train_step_cpu.json": {"machine": "2-core AMD EPYC, AVX-512, idle"},
    "verifier.json": {"machine": f"{_SHARED} (load 7.3-7.5)"},
    "lora_memory.json": {"machine": f"{_SHARED} (load 7-11)"},
    "demo_memory.json": {"machine": _EPYC},
    "rollouts_8_peers_groups.json": {
        "machine": _EPYC, "date": "2026-11-27", "commit": "f50af73", "peers": _TUNIX_ENV,
        "command": "/tmp/rlb/bin/python benchmarks/rollouts.py --problems 8 --rows 64 --engines static "
                   "--json benchmarks/results/rollouts_8_peers_groups.json"},
    "rollouts_8_peers_groups_2.json": {
        "machine": _EPYC, "date": "2026-11-27", "commit": "f50af73", "peers": _TUNIX_ENV,
        "command": "/tmp/rlb/bin/python benchmarks/rollouts.py --problems 8 --rows 64 --engines static "
                   "--json benchmarks/results/rollouts_8_peers_groups_2.json"},
    "rl_step_demo_groups.json": {
        "machine": _EPYC, "date": "2026-11-27", "commit": "f50af73",
        "command": "/tmp/rlb/bin/python benchmarks/rl_step.py --shape demo --steps 4 "
                   "--json benchmarks/results/rl_step_demo_groups.json"},
    "rl_step_long_compact.json": {
        "machine": _EPYC, "date": "2026-11-27", "commit": "4d4cad2",
        "command": "/tmp/rlb/bin/python benchmarks/rl_step.py --shape long --prompts 2 --samples 8 --steps 3 "
                   "--skip-tunix --set algorithm.format_reward=0.1 --json benchmarks/results/rl_step_long_compact.json"},
    "gpu_h200.json": {"machine": "1x NVIDIA H200", "commit": "before 192072d"},
    "gvm_budget.json": {
        "machine": _SHARED, "date": "2026-11-25", "recorded_in": "6fa305a",
        "command": "for seed in 0 1 2; do nice -n 5 .venv/bin/python benchmarks/gvm_study.py --toy runs/gvm_hard "
                   "--model runs/gvm_hard/model --algorithms raftpp --seeds $seed --sample-budget 12288 "
                   "--eval-every-samples 512 --target 0.6 --allocations uniform_updates_n4,uniform_updates_n2,"
                   "uniform_updates_n1,gvm_history_solvable_even_n2,gvm_history_solvable_n2,"
                   "gvm_history_solvable_even_n1,gvm_history_solvable_n1 --set optim.lr=2e-5 --set "
                   "sampling.prompts_per_step=64 --set \"data.train={kind: jsonl, path: runs/gvm_hard/train_256.jsonl}\" "
                   "--out runs/gvm_budget_s$seed; done; then --from-results over the three results.json files"},
    "gvm_study_spec.json": {
        "machine": _SHARED, "date": "2026-11-25", "recorded_in": "1763532",
        "command": "for algorithm in raftpp grpo; do nice -n 5 .venv/bin/python benchmarks/gvm_study.py --toy "
                   "runs/gvm_hard --model runs/gvm_hard/model --algorithms $algorithm --seeds 0,1,2 --sample-budget "
                   "49152 --eval-every-samples 4096 --target 0.45 --allocations uniform,uniform_drop_unsolved,gvm,"
                   "gvm_mstep,gvm_capped,uniform_updates,uniform_lr8x,gvm_mstep_lr8x --set optim.lr=2e-5 --set "
                   "sampling.prompts_per_step=256 --out runs/gvm_spec/$algorithm; done; then --from-results "
                   "runs/gvm_spec/raftpp/results.json,runs/gvm_spec/grpo/results.json"},
    "partial_sim.json": {"machine": "predicted: an event simulation on benchmarks/async_costs.py's cost models",
                         "date": "2026-11-29", "recorded_in": "0bf4233"},
}


@dataclasses.dataclass(frozen=True)
class Row:
    """One headline figure: ours against one peer (or alone), with where, when and how it was measured."""
    short: str              # its label in the figure: "CPU sampler vs tunix"
    figure: str
    ours: str
    peer: str               # the peer and its version; "" when the figure has none
    ratio: tuple            # ours better by, one value per run; () without a peer
    better: str             # what a ratio above 1 means: "faster", "less memory", ...
    worse: str              # and below 1
    limit: str              # the machine's ceiling and ours against it; "" when none applies
    of_limit: tuple         # ours / that ceiling, one value per run; () without one
    machine: str
    date: str
    commit: str
    command: str            # one command a line where the figure takes several runs
    files: tuple
    predicted: bool = False  # simulated, not measured: said in the table, hatched in the figure


@functools.lru_cache(maxsize=None)
def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def meta(name: str) -> dict:
    """date, machine, commit and command of a results file: its own fields first, then PROVENANCE's."""
    data, known = load(name), PROVENANCE.get(name, {})
    commit = data.get("commit") or known.get("commit")
    if not commit:
        commit = f"added {data.get('recorded_in') or known['recorded_in']}"
    return {"date": data.get("date") or known["date"], "machine": known.get("machine") or data["machine"],
            "commit": commit, "files": (name,),
            "command": data.get("command") or known.get("command") or next(iter(data["commands"].values()))}


def _n(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


def _span(values, digits: int = 2, unit: str = "") -> str:
    lo, hi = min(values), max(values)
    digits = 1 if digits == 2 and lo >= 10 else digits
    return f"{lo:.{digits}f}{unit}" if f"{lo:.{digits}f}" == f"{hi:.{digits}f}" else f"{lo:.{digits}f}-{hi:.{digits}f}{unit}"


def sampler_cpu() -> list[Row]:
    d, m = load("sampling_cpu.json"), meta("sampling_cpu.json")
    rows = {(r["shape"], r["sampler"]): r for r in d["rows"]}
    ours, roof = rows["8x8x64", "jaxrl_llm"], d["limits"]["roofline_large_batch_tok_s"]
    peers = (("tunix", "google-tunix 0.1.7 `Sampler`"), ("transformers", "transformers `generate`, torch CPU"))
    return [Row(f"CPU sampler vs {key}", "Sampler, 8 prompts x 8 samples x 64 tokens, total tok/s", _n(ours["total_tok_s"]),
                f"{label}: {_n(rows['8x8x64', key]['total_tok_s'])}",
                (ours["total_tok_s"] / rows["8x8x64", key]["total_tok_s"],), "faster", "slower",
                f"roofline {_n(roof, 0)} tok/s: decode ({_n(ours['decode_tok_s'])}) at "
                f"{ours['decode_tok_s'] / roof:.0%}", (ours["decode_tok_s"] / roof,), **m)
            for key, label in peers]


def rollouts_cpu() -> list[Row]:
    names = ("rollouts_8_peers_groups.json", "rollouts_8_peers_groups_2.json")
    runs = [{r["sampler"]: r for r in load(n)["results"]} for n in names]
    roofs = [load(n)["roofline"]["large_batch_tok_s"] for n in names]
    ours = [r["jaxrl_llm"]["useful_tok_s"] for r in runs]
    m = meta(names[0]) | {"files": names, "command": "\n".join(meta(n)["command"] for n in names)}
    shares = tuple(o / roof for o, roof in zip(ours, roofs))
    out = []
    for key, label in (("tunix", "google-tunix 0.1.7 `Sampler`"), ("transformers", "transformers 5.24.0 `generate`")):
        peer = [r[key]["useful_tok_s"] for r in runs]
        out.append(Row(f"CPU rollouts vs {key}", "Rollouts at the RL shape (64 rows, up to 512 tokens, 2 runs), useful tok/s",
                       _span(ours, 1), f"{label}: {_span(peer, 1)}", tuple(o / p for o, p in zip(ours, peer)),
                       "faster", "slower", f"roofline {_span(roofs, 0)} tok/s: at {_span([100 * s for s in shares], 0, '%')}",
                       shares, **m))
    return out


def rl_step_cpu() -> list[Row]:
    out = []
    demo, m = load("rl_step_demo_groups.json"), meta("rl_step_demo_groups.json")
    ours = demo["jaxrl_llm"]["median"]["wall_s"]
    for key, label in (("trl", f"TRL {demo['trl']['trl']} `GRPOTrainer`"),
                       ("tunix", f"google-tunix {demo['tunix']['tunix']} `GRPOLearner`")):
        peer = demo[key]["median"]["wall_s"]
        out.append(Row(f"CPU GRPO step, demo shape, vs {key}", "Whole GRPO step, demo shape (8 x 8 x 24 tokens), median s", _n(ours, 2),
                       f"{label}: {_n(peer, 2)}", (peer / ours,), "faster", "slower", "", (), **m))
    long, m = load("rl_step_long_compact.json"), meta("rl_step_long_compact.json")
    ours, peer = long["jaxrl_llm"]["median"]["wall_s"], long["trl"]["median"]["wall_s"]
    out.append(Row("CPU GRPO step, long shape, vs trl", "Whole GRPO step, long shape (2 x 8 x up to 512 tokens), median s", _n(ours, 2),
                   f"TRL {long['trl']['trl']} `GRPOTrainer`: {_n(peer, 2)}", (peer / ours,), "faster", "slower",
                   "", (), **m))
    return out


def train_step_cpu() -> list[Row]:
    d, m = load("train_step_cpu.json"), meta("train_step_cpu.json")
    run = d["runs"][0]
    ours, peer = run["jaxrl_llm"], run["transformers"]
    return [Row("CPU train step vs transformers", "Train step, 8 rows x 256 tokens, f32, median s", _n(ours["step_s"], 3),
                f"transformers, torch 2.13 CPU: {_n(peer['step_s'], 3)}", (peer["step_s"] / ours["step_s"],),
                "faster", "slower", f"JAX f32 matmul {ours['peak_gflop_s']} GFLOP/s: MFU {ours['mfu']:.1%}",
                (ours["mfu"],), **m)]


def gpu() -> list[Row]:
    d, m = load("gpu_h200.json"), meta("gpu_h200.json")
    peer_env = f"transformers {d['transformers']}, torch {d['torch']}"
    out = []
    for shape, label in (("smollm2-135m 64x8x128", "SmolLM2-135M"), ("qwen2.5-1.5b 64x8x128", "Qwen2.5-1.5B")):
        s = d["sampler"][shape]
        out.append(Row(f"GPU sampler, {label}, vs transformers", f"Sampler, {label}, {s['rows']} rows x {s['new_tokens']} tokens, bf16, tok/s",
                       _n(s["ours_static_tok_s"], 0), f"{peer_env} `generate`: {_n(s['transformers_tok_s'], 0)}",
                       (s["ours_static_tok_s"] / s["transformers_tok_s"],), "faster", "slower",
                       f"roofline {_n(s['roofline_tok_s'], 0)} tok/s: at {s['ours_static_vs_roofline']:.1%}",
                       (s["ours_static_vs_roofline"],), **m))
    t, peak = d["train"], d["ceilings"]["bf16_matmul_flops"]
    out.append(Row("GPU train step vs torch", f"Train step, Qwen2.5-1.5B shape, {t['rows']} packed rows of {_n(t['row_tokens'], 0)} "
                   "tokens, s", _n(t["ours_step_s"], 1), f"{peer_env}, {t['torch_rows']} unpacked rows: "
                   f"{_n(t['torch_step_s'], 2)}", (t["torch_step_s"] / t["ours_step_s"],), "faster", "slower",
                   f"bf16 matmul {peak / 1e12:.0f} TFLOP/s: MFU {t['ours_mfu']:.1%}", (t["ours_mfu"],), **m))
    hbm = float(re.search(r"(\d+) MiB", d["nvidia_smi"]).group(1)) * 2**20
    out.append(Row("GPU train step memory vs torch", "Train step memory on the GPU (same step), peak GB", _n(t["xla_peak_bytes"] / 1e9, 2),
                   f"{peer_env}: {_n(t['torch_peak_bytes'] / 1e9, 2)}", (t["torch_peak_bytes"] / t["xla_peak_bytes"],),
                   "less memory", "more memory", f"HBM {hbm / 1e9:.1f} GB ({d['nvidia_smi'].split(', ')[1]}): at {t['xla_peak_bytes'] / hbm:.0%}",
                   (t["xla_peak_bytes"] / hbm,), **m))
    return out


def verifier() -> list[Row]:
    d, m = load("verifier.json"), meta("verifier.json")
    graders = {g["grader"]: g for g in d["graders"]}
    ours, peer = graders["jaxrl_llm.rewards"], graders["math-verify 0.9.0, each case's own config"]
    label = "math-verify 0.9.0, each case's own config"
    return [Row("verifier accuracy vs math-verify", "Verifier accuracy, 306 peer test cases", f"{ours['accuracy']:.3f}",
                f"{label}: {peer['accuracy']:.3f}", (ours["accuracy"] / peer["accuracy"],), "more accurate",
                "less accurate", "", (), **m),
            Row("verifier speed vs math-verify", "Verifier speed, same cases, verifications/s", _n(ours["verifications_s"]),
                f"{label}: {_n(peer['verifications_s'])}", (ours["verifications_s"] / peer["verifications_s"],),
                "faster", "slower", "", (), **m)]


def memory() -> list[Row]:
    d, m = load("lora_memory.json"), meta("lora_memory.json")
    lora = next(r for r in d["rows"] if r["command"] == d["command"])
    out = [Row("LoRA memory vs full fine-tuning", "LoRA r16 update on an int8 base, peak RSS MB", _n(lora["lora_peak_rss_mb"], 0),
               f"full fine-tuning (ours): {_n(lora['full_peak_rss_mb'], 0)}",
               (lora["full_peak_rss_mb"] / lora["lora_peak_rss_mb"],), "less memory", "more memory", "", (), **m)]
    d, m = load("demo_memory.json"), meta("demo_memory.json")
    runs = {r["command"]: r for r in d["runs"]}
    ours, full = runs[d["command"]], runs["/usr/bin/time -v .venv/bin/jaxrl-llm train"]
    out.append(Row("demo memory vs every weight trained", "README's demo (LoRA, 20 steps + 2 evaluations), peak RSS GB and wall time",
                   f"{ours['peak_rss_kb'] * 1024 / 1e9:.2f} GB, {ours['wall']}",
                   f"the same demo training every weight: {full['peak_rss_kb'] * 1024 / 1e9:.2f} GB, {full['wall']}",
                   (full["peak_rss_kb"] / ours["peak_rss_kb"],), "less memory", "more memory", "", (), **m))
    return out


def gvm() -> list[Row]:
    out = []
    for name, short, figure in (("gvm_budget.json", "GVM (best variant) samples vs uniform", "GVM, best variant (solvable budget, n = 1), samples to held-out 0.6"),
                         ("gvm_study_spec.json", "GVM (paper's) samples vs uniform", "GVM as in the paper (M-step, 256 prompts/step), samples to 0.45")):
        d, m = load(name), meta(name)
        best = d["best_gvm_over_best_uniform_interpolated"]["raftpp"]
        arm = lambda a: d["summary"][f"raftpp/{a}"]["samples_to_target_interpolated"]
        ours, peer = arm(best["best_gvm"]), arm(best["best_uniform"])
        out.append(Row(short, figure, _n(ours, 0), f"uniform sampling (`{best['best_uniform']}`): {_n(peer, 0)}",
                       (peer / ours,), "fewer samples", "more samples", "", (), **m))
    return out


PAPER_TARGETS = (("h200x8", "8 x H200"), ("v5e-64", "v5e-64"))


def partial() -> list[Row]:
    """Partial rollouts against the synchronous loop at the paper's shape, one row per target: predicted by
    benchmarks/partial_sim.py at each training MFU scenario (no run at that shape)."""
    d, m = load("partial_sim.json"), meta("partial_sim.json")
    out = []
    for key, label in PAPER_TARGETS:
        steps = d[key]["seconds_per_step"]
        mfu = _span([100 * s["train_mfu"] for s in steps.values()], 1, "%")
        out.append(Row(f"partial rollouts vs sync, {label} (predicted)",
                       f"Partial rollouts, the paper's shape (Qwen2.5-Math-1.5B, 1024 x 8 up to 3072 tokens) on "
                       f"{label}, train MFU {mfu}, predicted s/step",
                       _span([s["partial_best"] for s in steps.values()], 0),
                       f"the synchronous loop (ours), predicted: {_span([s['sync'] for s in steps.values()], 0)}",
                       tuple(d[key]["partial_vs_sync"].values()), "faster", "slower", "", (), **m, predicted=True))
    return out


def rows() -> list[Row]:
    return [*sampler_cpu(), *rollouts_cpu(), *rl_step_cpu(), *train_step_cpu(), *gpu(), *verifier(), *memory(),
            *gvm(), *partial()]


def ratio_text(row: Row) -> str:
    if not row.ratio:
        return ""
    said = ", predicted" if row.predicted else ""
    if min(row.ratio) >= 1:
        return f"**{_span(row.ratio)}x** {row.better}{said}"
    if max(row.ratio) < 1:
        return f"{_span(row.ratio)}x: **{_span([1 / r for r in row.ratio])}x {row.worse}**{said}"
    return f"{_span(row.ratio)}x{said}"


def commands(rows_: list[Row]) -> list[str]:
    seen = []
    for row in rows_:
        if row.command not in seen:
            seen.append(row.command)
    return seen


def table() -> str:
    """The markdown between the summary markers of benchmarks/README.md."""
    rows_, lines = rows(), []
    cmds = commands(rows_)
    lines.append("| figure | ours | peer (version): its figure | ours better by | machine limit: ours against it | "
                 "machine | date | commit | results file, command |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for r in rows_:
        files = ", ".join(f"[{f}](results/{f})" for f in r.files)
        lines.append(f"| {r.figure} | {r.ours} | {r.peer} | {ratio_text(r)} | {r.limit or '-'} | {r.machine} | "
                     f"{r.date} | {r.commit} | {files}, C{cmds.index(r.command) + 1} |")
    lines.append("")
    lines.append("Commands, from the repository root (`/tmp/rlb` was a venv holding the peers beside jaxrl_llm, "
                 "installed as the notebook's first paragraph says):")
    lines.append("")
    lines += [f"- C{i}: " + ", then ".join(f"`{c}`" for c in cmd.split("\n")) for i, cmd in enumerate(cmds, 1)]
    lines.append("")
    lines.append("![ours against each peer and each machine limit, log scale](summary.png)")
    return "\n".join(lines)


def _gpu_train_line(row) -> str:
    """The train step's part of README's GPU line: measured against torch, and where the measured step is the packed
    XLA path's, what the default path (cuDNN attention) is predicted at (results/gpu_model.json) until measured."""
    ratio = row.ratio[0]
    measured = (f"the train step is {ratio:.2f}x torch's speed (MFU {row.of_limit[0]:.1%})" if ratio >= 1 else
                f"the packed train step measured {1 / ratio:.1f}x slower than torch's (MFU {row.of_limit[0]:.1%})")
    model = json.loads((RESULTS / "gpu_model.json").read_text())
    auto = model["programs"]["auto_28_layers_2_rows"]
    fitted = model["programs"]["packed_xla_28_layers_2_rows"]
    if abs(fitted["measured_s"] - float(row.ours.replace(",", ""))) > 0.1:  # a newer measurement of the default path
        return measured + "."
    return (f"{measured}; the default is now cuDNN's fused attention, {auto['kernels']:,} kernels a step instead of "
            f"{fitted['kernels_executed'] / 1e6:.1f} M, predicted at {model['auto_predicted_vs_torch']:.2f}x torch's "
            "speed from the compiled program (benchmarks/gpu_model.py), not yet measured.")


def _predicted_line() -> str:
    """README's line of predictions: partial rollouts against the synchronous loop, and how the simulator held up
    against a run (results/partial_sim.json's "validation")."""
    h200, v5e = partial()
    d = load("partial_sim.json")
    mfu = _span([100 * s["train_mfu"] for s in d["h200x8"]["seconds_per_step"].values()], 1, "%")
    check = d["validation"]
    checked = ("not yet checked against a run" if not check else
               f"whose schedule, replayed on the measured durations of a {check['wall_s']['measured']:.0f} s CPU run "
               f"on 8 fake devices, puts every event within {check['max_abs_error_s']:.1f} s "
               f"({check['max_abs_error_of_wall']:.2%}) of the run's")
    return (f"- **Predicted, not measured**: partial rollouts (`rollouts.mode: partial`) at {_span(h200.ratio)}x the "
            f"synchronous loop's speed on 8 x H200 and {_span(v5e.ratio)}x on a v5e-64 at the paper's shape (train "
            f"MFU {mfu}), from an event simulation (benchmarks/partial_sim.py) {checked}.")


def how_fast() -> str:
    """The lines between the how-fast markers of README.md: the ratios that matter most, from the same rows."""
    by = {(r.figure, r.peer.split(":")[0]): r for r in rows()}
    pick = lambda figure, peer: next(r for (f, p), r in by.items() if f.startswith(figure) and p.startswith(peer))
    x = lambda r: f"{_span(r.ratio)}x"
    demo_trl, demo_tunix = pick("Whole GRPO step, demo", "TRL"), pick("Whole GRPO step, demo", "google-tunix")
    long_trl = pick("Whole GRPO step, long", "TRL")
    roll_tunix, roll_tf = pick("Rollouts", "google-tunix"), pick("Rollouts", "transformers")
    step = pick("Train step, 8 rows", "transformers")
    gpu_s, gpu_t = pick("Sampler, Qwen2.5-1.5B", "transformers"), pick("Train step, Qwen2.5", "transformers")
    ver_a, ver_s = pick("Verifier accuracy", "math-verify"), pick("Verifier speed", "math-verify")
    demo = pick("README's demo", "the same demo")
    version = lambda r: r.peer.split(" `")[0]
    lines = [
        f"- **CPU** (2 cores): a whole GRPO step is {x(demo_trl)} faster than {version(demo_trl)}'s and {x(demo_tunix)} "
        f"faster than {version(demo_tunix)}'s on the demo's shape, {x(long_trl)} faster than TRL's with responses of "
        f"up to 512 tokens; rollouts "
        f"{x(roll_tunix)} tunix and {x(roll_tf)} transformers; the train step {x(step)} transformers' "
        f"(MFU {step.of_limit[0]:.0%}).",
        f"- **GPU** (one H200): sampling {x(gpu_s)} transformers `generate` on Qwen2.5-1.5B at 512 rows "
        f"({gpu_s.of_limit[0]:.0%} of the roofline); " + _gpu_train_line(gpu_t),
        f"- **Verifier and memory**: accuracy {ver_a.ours} against math-verify's {ver_a.peer.split(': ')[1]} at "
        f"{x(ver_s)} its speed; the demo peaks at {demo.ours.split(',')[0]} against "
        f"{demo.peer.split(': ')[1].split(',')[0]} when it trains every weight.",
        _predicted_line(),
    ]
    return "\n".join(textwrap.fill(line, 118, subsequent_indent="  ", break_on_hyphens=False) for line in lines)


def figure(path: pathlib.Path = FIGURE) -> None:
    """Bars of ours against each peer (above 1x: ours better) and of ours against each machine limit, log scale."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows_ = rows()
    bars = [(r.short, r.ratio, "predicted" if r.predicted else "peer") for r in rows_ if r.ratio]
    limits = {}  # one bar per measured ceiling: rows against two peers share theirs
    for r in rows_:
        if r.of_limit:
            name = "matmul peak (MFU)" if "MFU" in r.limit else r.limit.split(" ")[0]
            limits.setdefault(f"{r.short.split(' vs ')[0].rstrip(',')}: of {name}", r.of_limit)
    bars += [(label, values, "limit") for label, values in limits.items()]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(bars) + 1.2), dpi=80)
    ys = [i + (kind == "limit") for i, (_, _, kind) in enumerate(bars)]  # a gap between the two kinds
    for i, (label, values, kind) in zip(ys, bars):
        lo, hi = min(values), max(values)
        colour = "#9a9a9a" if kind == "limit" else ("#2a7ab9" if lo >= 1 else "#c8553d")
        ax.barh(i, hi, color=colour, height=0.7, hatch="//" if kind == "predicted" else None,
                alpha=0.5 if kind == "predicted" else 1.0)
        if hi > lo:
            ax.barh(i, lo, color="white", alpha=0.35, height=0.7)
        ax.text(hi * 1.08, i, _span([100 * v for v in values], 0, "%") if kind == "limit" else f"{_span(values)}x" +
                (" predicted" if kind == "predicted" else ""), va="center", fontsize=8)
    ax.set_yticks(ys, [b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(0.02, 40)
    ticks = (0.03, 0.1, 0.3, 1, 3, 10, 30)
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.minorticks_off()
    ax.axvline(1, color="black", linewidth=1)
    ax.set_xlabel("ours better by (blue above 1x, red below, hatched: predicted); grey: ours / measured limit")
    ax.set_title("benchmarks/results/*.json at a glance (benchmarks/summary.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_into(doc: pathlib.Path, text: str, start: str, end: str) -> None:
    """Replace the text between the `start` and `end` markers of `doc`."""
    body = doc.read_text(encoding="utf-8")
    if start not in body or end not in body:
        raise ValueError(f"{doc} has no {start} ... {end} markers")
    head, _, rest = body.partition(start)
    _, _, tail = rest.partition(end)
    doc.write_text(f"{head}{start}\n{text}\n{end}{tail}", encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true",
                        help="rewrite the tables in benchmarks/README.md and README.md and draw benchmarks/summary.png")
    args = parser.parse_args(argv)
    print(table())
    print()
    print(how_fast())
    if args.write:
        write_into(NOTEBOOK, table(), START, END)
        write_into(README, how_fast(), README_START, README_END)
        figure()
        print(f"\nwrote {NOTEBOOK.relative_to(ROOT)}, {README.relative_to(ROOT)}, {FIGURE.relative_to(ROOT)} "
              f"({FIGURE.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
