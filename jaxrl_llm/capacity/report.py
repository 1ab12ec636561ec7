"""A compiled program's report: XLA's memory and cost analyses, what its optimized HLO executes (`capacity.hlo_stats`),
the run's arrays resident beside it and the estimate of what it holds (`capacity.memory.program_memory`), and the
table `jaxrl-llm compile` prints."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from jaxrl_llm.capacity.chips import GIB
from jaxrl_llm.capacity.hlo_stats import kernel_costs, program_stats
from jaxrl_llm.capacity.topology import parse_topology


@dataclasses.dataclass
class ProgramReport:
    name: str
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int  # arguments + outputs - aliased (donated) + temporaries: what XLA allots the program
    flops: float | None
    fits: bool  # resident + the compiler's peak (else the allotment) <= the chip's usable HBM
    hlo_has_splash: bool
    error: str = ""
    resident_bytes: int = 0  # the run's arrays held beside the program, not among its arguments (estimate_memory)
    estimate_bytes: int = 0  # estimate_memory's terms for what the program holds
    # XLA's own peak of the program's buffers, arguments included (`memory_analysis().peak_memory_in_bytes`): on
    # TPU below peak_bytes, and the figure its out-of-HBM check holds the program to (0: not recorded)
    compiler_peak_bytes: int = 0
    # What the program executes, from its optimized HLO (`hlo_stats.program_stats`; results saved before these were
    # recorded read the defaults): the attention kernel ("cudnn", "splash", "xla"), kernels launched per run and
    # conditionals (while-loop trip counts multiplied in), matmul FLOPs per device, the largest array
    attention_kernel: str = ""
    kernels: int = 0
    conditionals: int = 0
    matmul_flops: float = 0.0
    largest_buffer: str = ""
    # the model's matmul FLOPs for the program's work per device (`hlo_stats.model_flops`; 0 where not defined)
    model_flops: float = 0.0
    # compiled for a GPU: seconds per run predicted by `gpu_targets.predict_seconds` (a per-kernel roofline plus a
    # launch cost fitted on one measurement; 0: not a GPU target)
    predicted_s: float = 0.0

    @property
    def need_bytes(self) -> int:
        """What the program needs on a chip: the compiler's peak where recorded, else the allotment."""
        return self.compiler_peak_bytes or self.peak_bytes


def program_report(name: str, lowered, usable_bytes: int, needed_flops: float = 0.0) -> ProgramReport:
    """`lowered` compiled and reported: XLA's memory and cost analyses and what its HLO executes (`needed_flops`: the
    model's FLOPs for it); a program the compiler refuses (over HBM) is reported with its error and not fitting."""
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as err:  # XLA refuses a program over HBM at compile time
        text = str(err).strip().splitlines()[0][:300]
        return ProgramReport(name, time.perf_counter() - start, 0, 0, 0, 0, 0, None, False, False, text)
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    compiler_peak = int(getattr(mem, "peak_memory_in_bytes", 0) or 0)
    flops = (cost or {}).get("flops")
    text = compiled.as_text()
    stats = program_stats(text)
    report = ProgramReport(name, seconds, mem.argument_size_in_bytes, mem.output_size_in_bytes,
                           mem.alias_size_in_bytes, mem.temp_size_in_bytes, peak, flops, False,
                           "tpu_custom_call" in text, compiler_peak_bytes=compiler_peak,
                           attention_kernel=stats.attention_kernel, kernels=stats.kernels,
                           conditionals=stats.conditionals, matmul_flops=stats.matmul_flops,
                           largest_buffer=stats.largest_buffer, model_flops=needed_flops)
    report.fits = report.need_bytes <= usable_bytes
    report.kernel_costs = kernel_costs(text)  # not a field: read by compile_run for a GPU's prediction
    return report


def usable_bytes(result: dict[str, Any]) -> int:
    """The HBM a program of a `compile_run` result may use: recorded, or (results saved before it was) the
    usable figure of the topology's chip."""
    return result.get("usable_bytes") or parse_topology(result["topology"]).chip.usable_bytes


def place_beside(programs: list[ProgramReport], est: dict[str, Any], hbm: int) -> None:
    """Each program's resident neighbours and the estimate of what it holds, from the estimate's per-program split
    (`capacity.memory.program_memory`); `fits` is resident + XLA's peak (`need_bytes`) against `hbm`, the chip's
    HBM a program may use."""
    for program in programs:
        split = est["programs"].get(program.name, {"resident": 0, "working": 0})
        program.resident_bytes, program.estimate_bytes = split["resident"], split["working"]
        program.fits = not program.error and program.resident_bytes + program.need_bytes <= hbm


def _count(n: int) -> str:
    """A count in at most 8 characters: 8053, 247.2k, 13.85M."""
    return "-" if not n else str(n) if n < 100_000 else f"{n / 1e3:.1f}k" if n < 10 ** 7 else f"{n / 1e6:.2f}M"


def format_report(result: dict[str, Any]) -> str:
    """The table `jaxrl-llm compile` prints."""
    gib = lambda b: f"{b / GIB:7.2f}"  # noqa: E731
    est, usable = result["estimate"], usable_bytes(result)
    lines = [f"{result['topology']} ({result['topology_desc']}, {result['devices']} devices, "
             f"{result['hbm_bytes'] / GIB:.2f} GiB HBM each, {usable / GIB:.2f} usable by a program), "
             f"mesh {result['mesh']}, "
             f"{result['rows']} rows x {result['row_length']} tokens per mini-batch"
             + (f"; the sampler on its own devices, mesh {result['sampler_mesh']}" if "sampler_mesh" in result else ""),
             "GiB per chip: XLA's arguments, outputs and temporaries of the program, the sum it allots (alloc = args + "
             "out - donated + temp) and its own peak of the program's buffers (peak, what its out-of-HBM check "
             "counts); resident = the run's other arrays beside it; use % = peak + resident of the usable HBM; est = "
             "estimate_memory's terms for the program; from the optimized HLO, per device: attn = the attention kernel, "
             "kernels launched per run (loop trip counts multiplied in), mm/model = matmul FLOPs over the model's",
             f"{'program':<18} {'compile s':>9} {'args':>7} {'out':>7} {'temp':>7} {'alloc':>7} {'peak':>7} "
             f"{'resident':>8} {'use %':>6} {'est':>7} {'TFLOP':>8} {'attn':>6} {'kernels':>8} {'mm/model':>8}  fits"]
    for p in result["programs"]:
        if p.error:
            lines.append(f"{p.name:<18} {p.compile_s:9.1f}  does not compile: {p.error}")
            continue
        flops = "" if p.flops is None else f"{p.flops / 1e12:8.2f}"
        share = 100 * (p.need_bytes + p.resident_bytes) / usable
        estimate = gib(p.estimate_bytes) if p.estimate_bytes else f"{'-':>7}"
        compiler = gib(p.compiler_peak_bytes) if p.compiler_peak_bytes else f"{'-':>7}"
        ratio = f"{p.matmul_flops / p.model_flops:8.2f}" if p.model_flops else f"{'-':>8}"
        lines.append(f"{p.name:<18} {p.compile_s:9.1f} {gib(p.argument_bytes)} {gib(p.output_bytes)} "
                     f"{gib(p.temp_bytes)} {gib(p.peak_bytes)} {compiler} {gib(p.resident_bytes):>8} {share:6.1f} "
                     f"{estimate} {flops:>8} {p.attention_kernel or '-':>6} {_count(p.kernels):>8} {ratio}  "
                     f"{'yes' if p.fits else 'NO'}")
    lines.append(f"estimate_memory peak (every program and the sampler): {est['peak'] / GIB:.2f} GiB per device")
    predicted = [f"{p.name} {p.predicted_s:.3g}" for p in result["programs"] if p.predicted_s]
    if predicted:
        lines.append("predicted seconds per run (a prediction: per-kernel roofline + a launch cost fitted on one "
                     "measured train step, gpu_targets.predict_seconds): " + ", ".join(predicted))
    return "\n".join(lines)
