"""`jaxrl-llm plot RUN_DIR [RUN_DIR ...]`: one PNG of what the runs' metrics.jsonl say.

`plan_panels` decides what to draw (pure, on the rows): one panel per distinct series, series equal to another
drawn once and named together, series constant over every run summarised in a line of text, steps without an
update listed. `plot_run` draws that plan: held-out accuracy with its sampling sd, per-step series as raw points
with a centred moving mean, the seconds of each step by stage, every run in its own colour.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any, Mapping, NamedTuple, Sequence

from jaxrl_llm.run.metrics import read_metrics

# Panels of per-step series come in this order; other numeric keys follow, sorted.
SERIES_ORDER = ("reward", "accuracy", "acceptance_rate", "response_length", "entropy", "kl", "clip_fraction", "loss",
                "policy_loss", "grad_norm", "value_loss", "value_clip_fraction", "value_grad_norm",
                "explained_variance", "value_mean", "return_mean", "lr", "groups_kept", "samples_per_step",
                "sampling_rounds", "prompts_filtered", "sampling_slot_occupancy")
# The stages of a step's wall time (`loop.step_metrics`); the rest of time_wall_s is drawn as "other".
TIME_STAGES = ("time_sample_s", "time_score_s", "time_train_s")
# Evaluation-row keys drawn as diamonds on the panel of their training-step counterpart.
EVAL_OVERLAYS = {"eval_slot_occupancy": "sampling_slot_occupancy"}
# Keys that are the x-axis, the gap markers, or drawn in the evaluation / time panels.
# The schedule's clock (`loop.schedule_metrics`): event times and the policy version, for replaying a run's schedule.
SCHEDULE = ("policy_version", "time_wait_s", "sample_start_s", "sample_end_s", "train_start_s", "train_end_s",
            "publish_s")
NOT_SERIES = {"step", "samples_drawn", "updates", "skipped_update", "time_wall_s", "tokens_per_s",
              "eval_accuracy", "eval_sampling_sd", *TIME_STAGES, *EVAL_OVERLAYS, *SCHEDULE}
NO_UPDATE, NON_FINITE = "no update (updates = 0)", "update skipped: non-finite loss or gradient"


class Panel(NamedTuple):
    title: str  # the keys drawn, equal series joined by " = "
    keys: tuple[str, ...]  # the first is drawn; the others hold the same values in every run
    kind: str  # "eval" | "series" | "time"


class Plan(NamedTuple):
    panels: tuple[Panel, ...]
    constant: tuple[tuple[tuple[str, ...], float], ...]  # (keys, value): series constant over every row of every run
    gaps: tuple[tuple[tuple[int, str], ...], ...]  # per run, (step, NO_UPDATE | NON_FINITE)
    window: int  # the centred moving mean's width, in steps

    def summary(self) -> str:
        """One line per part: the panels drawn, the constants, the gaps."""
        lines = ["panels: " + "; ".join(p.title for p in self.panels)]
        if self.constant:
            lines.append("constant: " + constant_text(self.constant))
        for run, gaps in enumerate(self.gaps):
            if gaps:
                lines.append(f"run {run + 1} gaps: " + ", ".join(f"step {s}: {why}" for s, why in gaps))
        return "\n".join(lines)


class Drawn(NamedTuple):
    path: pathlib.Path
    plan: Plan


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def split_rows(rows: Sequence[Mapping]) -> tuple[list[dict], list[dict]]:
    """(step rows, evaluation rows), each sorted by step with the last row of a step kept (a resumed run
    repeats the steps after its checkpoint). Step rows gain samples_per_step, the difference of samples_drawn."""
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for row in rows:
        if "eval_accuracy" in row:
            evals[row["step"]] = dict(row)
        if any(k != "step" and not k.startswith("eval_") for k in row):
            steps[row["step"]] = {k: v for k, v in row.items() if not k.startswith("eval_")}
    out, previous = [], {0: 0.0}
    for step in sorted(steps):
        row = steps[step]
        drawn = _number(row.get("samples_drawn"))
        if drawn is not None and step - 1 in previous:
            row["samples_per_step"] = drawn - previous[step - 1]
        if drawn is not None:
            previous[step] = drawn
        out.append(row)
    return out, [evals[s] for s in sorted(evals)]


def _series(rows: Sequence[Mapping], key: str) -> list[tuple[int, float]]:
    return [(r["step"], v) for r in rows if (v := _number(r.get(key))) is not None]


def _same(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    return len(a) == len(b) and all(sa == sb and math.isclose(va, vb, rel_tol=1e-9, abs_tol=1e-12)
                                    for (sa, va), (sb, vb) in zip(a, b))


def plan_panels(runs: Sequence[Sequence[Mapping]]) -> Plan:
    """What `plot_run` draws for these runs (each a list of metrics.jsonl rows): the held-out accuracy panel if
    any run evaluated; one panel per per-step series, after merging series equal in every run and setting aside
    series constant over all runs; the time panel if the runs log stage times; tokens_per_s last."""
    tables = [split_rows(rows) for rows in runs]
    keys = {k for steps, _ in tables for row in steps for k in row
            if k not in NOT_SERIES and _number(row[k]) is not None}
    order = [k for k in SERIES_ORDER if k in keys] + sorted(keys - set(SERIES_ORDER))
    values = {k: [_series(steps, k) for steps, _ in tables] for k in order}
    constant: dict[float, list[str]] = {}
    series: list[list[str]] = []
    for key in order:
        seen = {round(v, 12) for run in values[key] for _, v in run}
        if len(seen) == 1:
            constant.setdefault(seen.pop(), []).append(key)
            continue
        for group in series:
            if all(_same(a, b) for a, b in zip(values[group[0]], values[key])):
                group.append(key)
                break
        else:
            series.append([key])
    panels = []
    if any(evals for _, evals in tables):
        panels.append(Panel("held-out accuracy (eval_accuracy)", ("eval_accuracy",), "eval"))
    panels += [Panel(" = ".join(g), tuple(g), "series") for g in series]
    if any(_series(steps, TIME_STAGES[0]) for steps, _ in tables):
        panels.append(Panel("seconds per step", (*TIME_STAGES, "time_wall_s"), "time"))
    if any(_series(steps, "tokens_per_s") for steps, _ in tables):
        panels.append(Panel("tokens_per_s", ("tokens_per_s",), "series"))
    gaps = tuple(tuple((r["step"], NON_FINITE if r.get("skipped_update") else NO_UPDATE) for r in steps
                       if r.get("skipped_update") or r.get("updates") == 0) for steps, _ in tables)
    longest = max((len(steps) for steps, _ in tables), default=0)
    window = max(3, min(51, longest // 4)) | 1
    return Plan(tuple(panels), tuple((tuple(ks), v) for v, ks in constant.items()), gaps, window)


def constant_text(constant: Sequence[tuple[Sequence[str], float]]) -> str:
    """`kl = clip_fraction = 0, lr = 0.0002`: keys with one value, grouped by it."""
    return ", ".join(" = ".join(keys) + f" = {value:g}" for keys, value in constant)


def centred_mean(values: Sequence[float], window: int) -> list[float]:
    """y_i = mean(values[i - h : i + h + 1]) with h = window // 2, truncated at the ends."""
    h = window // 2
    return [sum(values[max(0, i - h):i + h + 1]) / len(values[max(0, i - h):i + h + 1]) for i in range(len(values))]


def plot_run(run_dirs: str | pathlib.Path | Sequence[str | pathlib.Path], out: str | pathlib.Path | None = None,
             *, x: str = "steps") -> Drawn:
    """Draw `plan_panels` of one run or several into one PNG (default: RUN_DIR/curves.png for one run, the runs'
    common parent's curves_<names>.png for several); x is "steps" or "samples" (cumulative samples_drawn)."""
    one = isinstance(run_dirs, (str, pathlib.Path))
    dirs = [pathlib.Path(d) for d in ([run_dirs] if one else run_dirs)]
    if not dirs:
        raise ValueError("plot needs at least one run directory")
    if x not in ("steps", "samples"):
        raise ValueError(f"x must be 'steps' or 'samples', not {x!r}")
    runs = [read_metrics(d) for d in dirs]
    plan = plan_panels(runs)
    if not plan.panels:
        raise ValueError(f"{', '.join(map(str, dirs))}: metrics.jsonl holds no numeric series to plot")
    out = pathlib.Path(out) if out else default_out(dirs)
    draw(plan, [split_rows(rows) for rows in runs], [str(d).rstrip("/") for d in dirs], x, out)
    return Drawn(out, plan)


def default_out(dirs: Sequence[pathlib.Path]) -> pathlib.Path:
    """RUN_DIR/curves.png for one run; for several, curves_A_vs_B.png in the folder that holds them all."""
    if len(dirs) == 1:
        return dirs[0] / "curves.png"
    parents = {d.resolve().parent for d in dirs}
    if len(parents) != 1:
        raise ValueError("the runs are in different folders: name the PNG with --out")
    return parents.pop() / ("curves_" + "_vs_".join(d.resolve().name for d in dirs) + ".png")


def _x_of(steps: Sequence[Mapping], x: str):
    """step -> position on the x-axis: the step, or the samples drawn by the end of it (0 before the first)."""
    if x == "steps":
        return float
    drawn = {0: 0.0, **{s: v for s, v in _series(steps, "samples_drawn")}}
    if len(drawn) == 1:
        raise ValueError("--x samples: a run logs no samples_drawn")
    known = sorted(drawn)
    return lambda step: drawn[max([s for s in known if s <= step], default=0)]


def draw(plan: Plan, tables: Sequence[tuple[list[dict], list[dict]]], labels: Sequence[str], x: str,
         out: pathlib.Path) -> None:
    """Render `plan` for the runs' (step rows, evaluation rows) into the PNG `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    several = len(tables) > 1
    colors = [f"C{i}" for i in range(len(tables))]
    xofs = [_x_of(steps, x) for steps, _ in tables]
    cols = min(3, len(plan.panels))
    nrows = -(-len(plan.panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.3 * cols, 2.6 * nrows + 1.0), squeeze=False)
    no_sd = False
    for ax, panel in zip(axes.flat, plan.panels):
        for run, ((steps, evals), xof, color) in enumerate(zip(tables, xofs, colors)):
            if panel.kind == "eval":
                no_sd |= _draw_eval(ax, evals, xof, color, annotate=not several)
            elif panel.kind == "time":
                _draw_time(ax, steps, xof, run, several)
            else:
                _draw_series(ax, steps, evals, panel.keys[0], xof, color, plan.window)
            if panel.kind == "series" or (panel.kind == "time" and not several):
                _draw_gaps(ax, plan.gaps[run], xof, color if several else "0.5")
        ax.set_title(panel.title, fontsize=10)
        if panel.kind == "time" and several:
            ax.set_yticks(range(len(labels)), labels, fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel("mean seconds per step", fontsize=9)
            ax.set_xlim(right=ax.get_xlim()[1] * 1.4)
            ax.legend(fontsize=8, loc="center right", frameon=False)
        else:
            ax.set_xlabel("step" if x == "steps" else "samples drawn", fontsize=9)
        ax.tick_params(labelsize=8)
        if x == "steps" and not (panel.kind == "time" and several):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(plan.panels):]:
        ax.axis("off")
    ink = "0.3" if several else colors[0]
    handles = [Patch(color=c, label=label) for c, label in zip(colors, labels)] if several else []
    if any(p.kind == "series" for p in plan.panels):
        handles += [Line2D([], [], ls="", marker="o", ms=4, alpha=0.6, color=ink, label="each step"),
                    Line2D([], [], lw=2, color=ink, label=f"centred mean of {plan.window} steps")]
    if any(p.kind == "eval" for p in plan.panels):
        handles.append(Line2D([], [], marker="o", ms=5, color=ink, label="held-out evaluation, band ± 1 sampling sd"))
    overlays = [k for k, target in EVAL_OVERLAYS.items() if any(target in p.keys for p in plan.panels)
                and any(_series(evals, k) for _, evals in tables)]
    if overlays:
        handles.append(Line2D([], [], ls="", marker="D", ms=4, color=ink,
                              label=f"at evaluations: {', '.join(overlays)}"))
    reasons = {why for gaps in plan.gaps for _, why in gaps}
    handles += [Patch(facecolor="0.5", alpha=0.25, hatch="//" if why == NON_FINITE else None, label=why)
                for why in (NO_UPDATE, NON_FINITE) if why in reasons]
    notes = []
    if plan.constant:
        notes.append(("constant in every run: " if several else "constant: ") + constant_text(plan.constant))
    if no_sd:
        notes.append("no band where a run did not log eval_sampling_sd")
    ncol = len(handles) if len(handles) <= 5 else -(-len(handles) // 2)
    height = fig.get_figheight()
    if not several:
        fig.text(0.01, 1 - 0.08 / height, labels[0], ha="left", va="top", fontsize=10, weight="bold")
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - (0 if several else 0.25) / height),
               ncol=ncol, fontsize=9, frameon=False)
    fig.text(0.5, 0.005, "\n".join(notes), ha="center", va="bottom", fontsize=9, wrap=True)
    top = 1 - ((0.1 if several else 0.35) + 0.22 * math.ceil(len(handles) / ncol)) / height
    fig.tight_layout(rect=(0, (0.2 + 0.18 * len(notes)) / height, 1, top))
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _draw_series(ax, steps, evals, key, xof, color, window) -> None:
    points = _series(steps, key)
    if points:
        xs, ys = [xof(s) for s, _ in points], [v for _, v in points]
        if len(points) < 3:
            ax.plot(xs, ys, marker="o", ms=4, color=color)
        else:
            ax.scatter(xs, ys, s=14, alpha=0.6, color=color, linewidths=0)
            ax.plot(xs, centred_mean(ys, window), lw=2, color=color)
    for eval_key, target in EVAL_OVERLAYS.items():
        if target == key and (points := _series(evals, eval_key)):
            ax.scatter([xof(s) for s, _ in points], [v for _, v in points], marker="D", s=22, color=color)


def _draw_eval(ax, evals, xof, color, annotate) -> bool:
    """Every evaluation as a point joined by a line, with a band of +/- 1 sampling sd; True if an sd is missing."""
    points = _series(evals, "eval_accuracy")
    if not points:
        return False
    xs, ys = [xof(s) for s, _ in points], [v for _, v in points]
    sds = [_number(r.get("eval_sampling_sd")) for r in evals if _number(r.get("eval_accuracy")) is not None]
    ax.plot(xs, ys, marker="o", ms=5, color=color)
    if all(sd is not None for sd in sds):
        ax.fill_between(xs, [y - sd for y, sd in zip(ys, sds)], [y + sd for y, sd in zip(ys, sds)], color=color,
                        alpha=0.2, linewidth=0)
        ax.errorbar(xs, ys, yerr=sds, fmt="none", ecolor=color, capsize=3)
    if annotate and len(points) <= 8:
        for i, (xi, yi, sd) in enumerate(zip(xs, ys, sds)):  # the last label above left, the others below right
            last = i == len(xs) - 1 and i > 0
            ax.annotate(f"{yi:.3f}" + (f" ± {sd:.3f}" if sd is not None else ""), (xi, yi), fontsize=8,
                        textcoords="offset points", xytext=(-6, 5) if last else (6, -6),
                        ha="right" if last else "left", va="bottom" if last else "top")
        ax.margins(x=0.05, y=0.2)
    return any(sd is None for sd in sds)


def _draw_time(ax, steps, xof, run, several) -> None:
    """One run: each step's seconds stacked by stage (other = the rest of time_wall_s). Several: one bar of
    the mean seconds per step per run."""
    rows = [r for r in steps if _number(r.get(TIME_STAGES[0])) is not None]
    if not rows:
        return
    parts = {k.removeprefix("time_").removesuffix("_s"): [_number(r.get(k)) or 0.0 for r in rows] for k in TIME_STAGES}
    walls = [_number(r.get("time_wall_s")) for r in rows]
    if all(w is not None for w in walls):
        parts["other"] = [max(w - sum(p[i] for p in parts.values()), 0.0) for i, w in enumerate(walls)]
    shades = {"sample": "#7b68ae", "score": "#e7298a", "train": "#b8860b", "other": "0.75"}  # not the runs' C0..C3
    if several:
        left = 0.0
        for stage, values in parts.items():
            mean = sum(values) / len(values)
            ax.barh(run, mean, left=left, color=shades[stage], edgecolor="white",
                    label=stage if run == 0 else None)
            left += mean
        return
    xs = [xof(r["step"]) for r in rows]
    width = 0.8 * (min(b - a for a, b in zip(xs, xs[1:])) if len(xs) > 1 else 1.0)
    bottom = [0.0] * len(rows)
    for stage, values in parts.items():
        mean = sum(values) / len(values)
        ax.bar(xs, values, width=width, bottom=bottom, color=shades[stage], label=f"{stage} (mean {mean:.3g} s)")
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylim(top=max(bottom) * 1.5)
    ax.legend(fontsize=7, loc="upper right", ncol=2, frameon=False)


def _draw_gaps(ax, gaps, xof, color) -> None:
    """A band over each step without an update: the step's width (steps) or the samples it drew."""
    for step, why in gaps:
        lo, hi = (step - 0.5, step + 0.5) if xof is float else (xof(step - 1), xof(step))
        ax.axvspan(lo, hi, color=color, alpha=0.25, hatch="//" if why == NON_FINITE else None, linewidth=0)
