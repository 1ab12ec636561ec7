"""What a compiled program executes, read from its optimized HLO text (`compiled.as_text()`), and what the model
needs: `program_stats` and `model_flops`. Pure text analysis, no jax.

`program_stats(text)` walks the computations a step executes from ENTRY, with each while loop's body counted
`known_trip_count` times (XLA writes it in the loop's backend_config; a loop without one counts once and is listed
in `unknown_trip_loops`):
  attention_kernel  "cudnn" where the program calls cuDNN's fused attention (`__cudnn$fmha...`), "splash" where it
                    runs a TPU Mosaic splash-attention kernel (a `tpu_custom_call` naming splash), else "xla"
  kernels           instructions that launch device work at the top level of every computation executed (fusions,
                    custom calls, copies, collectives, ops left unfused), i.e. GPU kernel launches per step
  conditionals      conditionals executed
  matmul_flops      2 * M * N * K of every dot (inside fusions too), cuBLAS GEMM custom call (`__cublas$gemm`,
                    `__cublas$lt$matmul`) and convolution (TPU's form of some dots), batch dimensions included in
                    the output's M * N; cuDNN fused attention counts its two forward products, 4 * B * H * T * S * d
                    (the backward call 2.5 times that), halved under a causal mask
  largest_buffer    the array shape with the most elements among the results of executed computations
Limits: the HLO text format is not a stable interface (checked on jaxlib 0.10.2, CPU/GPU/TPU); a conditional counts
its most expensive branch, so kernels and FLOPs inside conditionals are upper bounds; a dynamic trip count is not
known; elementwise and reduction FLOPs are not counted; a Mosaic kernel's own FLOPs are not either (TPU splash
attention: a tiny model's train step read 0.73 of the model's FLOPs on a v5e).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

_DTYPES = {"pred", "s2", "s4", "s8", "s16", "s32", "s64", "u2", "u4", "u8", "u16", "u32", "u64", "f16", "bf16", "f32",
           "f64", "c64", "c128", "f8e4m3fn", "f8e5m2", "f8e4m3fnuz", "f8e5m2fnuz", "f8e4m3", "f8e3m4", "f4e2m1fn"}
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*")
# ops that launch nothing on the device: bookkeeping, control flow (its bodies are walked), ends of async pairs
_NO_LAUNCH = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
              "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id", "domain", "async-done",
              "copy-done", "send-done", "recv-done", "all-gather-done", "all-reduce-done", "collective-permute-done",
              "fusion-done", "get-dimension-size"}
_ALIASES = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call"}


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    op: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of the result, a tuple's elements in order
    operands: tuple[str, ...]
    attrs: str  # everything after the operand list
    root: bool = False  # its computation's ROOT
    parameter: int = -1  # a parameter's number


@dataclasses.dataclass
class ProgramStats:
    attention_kernel: str = "xla"
    kernels: int = 0
    conditionals: int = 0
    matmul_flops: float = 0.0
    largest_buffer: str = ""
    unknown_trip_loops: tuple[str, ...] = ()


def _shapes(text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
                 for m in _SHAPE.finditer(text) if m.group(1) in _DTYPES)


def _closing(text: str, start: int) -> int:
    """Index of the parenthesis closing the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


def _parse_instruction(line: str) -> Instruction | None:
    head = _INSTR.match(line)
    if not head:
        return None
    rest = line[head.end():]
    if rest.startswith("("):  # a tuple-shaped result
        end = _closing(rest, 0) + 1
    else:
        end = rest.find(" ")
    shape_text, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-$.]+)\(", rest)
    if not op:
        return None
    close = _closing(rest, op.end() - 1)
    operands = tuple(re.findall(r"%([^\s,()]+)", rest[op.end():close]))
    number = re.fullmatch(r"\s*(\d+)\s*", rest[op.end():close]) if op.group(1) == "parameter" else None
    return Instruction(head.group(2), op.group(1), _shapes(shape_text), operands, rest[close + 1:],
                       bool(head.group(1)), int(number.group(1)) if number else -1)


def parse_module(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """{computation name: its instructions} and the ENTRY computation's name."""
    computations, entry, current = {}, "", None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header and line.rstrip().endswith("{") and "->" in line:
                current = computations.setdefault(header.group(2), [])
                entry = header.group(2) if header.group(1) else entry
        elif line.strip() == "}":
            current = None
        else:
            instruction = _parse_instruction(line)
            if instruction:
                current.append(instruction)
    return computations, entry


def _called(instruction: Instruction, *keys: str) -> list[str]:
    names = []
    for key in keys:
        for match in re.finditer(rf"\b{key}=(\{{[^}}]*\}}|%?[^\s,}}]+)", instruction.attrs):
            names += re.findall(r"%?([^\s,{}%]+)", match.group(1))
    return names


def _trip_count(instruction: Instruction) -> int | None:
    match = re.search(r'"known_trip_count":\s*\{\s*"n":\s*"(\d+)"', instruction.attrs)
    return int(match.group(1)) if match else None


def _contracted(attrs: str, key: str) -> list[int]:
    match = re.search(rf"{key}=\{{([0-9,]*)\}}", attrs)  # dot: lhs_contracting_dims={1}
    if not match:  # GEMM custom call's backend_config: "lhs_contracting_dimensions":["1"]
        match = re.search(rf'"{key}":\s*\[([^\]]*)\]', attrs)
    return [int(d.strip('" ')) for d in match.group(1).split(",") if d.strip('" ')] if match else []


class _Walker:
    def __init__(self, text: str):
        self.computations, self.entry = parse_module(text)
        self.shape_of = {i.name: i.shapes[0][1] for c in self.computations.values() for i in c if i.shapes}
        self.shapes_of = {i.name: i.shapes for c in self.computations.values() for i in c}
        self.unknown_trip: list[str] = []

    def _dims(self, operand_index: int, instruction: Instruction) -> tuple[int, ...]:
        if operand_index >= len(instruction.operands):
            return ()
        return self.shape_of.get(instruction.operands[operand_index], ())

    def own_flops(self, instruction: Instruction) -> float:
        """Matmul FLOPs of one instruction itself (not of computations it calls)."""
        out = instruction.shapes[0][1] if instruction.shapes else ()
        if instruction.op == "dot":
            lhs = self._dims(0, instruction)
            contracted = _contracted(instruction.attrs, "lhs_contracting_dims")
            return 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracted if d < len(lhs))
        if instruction.op == "convolution":  # every kernel dimension but the output feature is contracted
            labels = re.search(r"dim_labels=[^_]+_([^-]+)->", instruction.attrs)
            kernel = self._dims(1, instruction)
            if not labels or len(labels.group(1)) != len(kernel):
                return 0.0
            return 2.0 * math.prod(out) * math.prod(n for n, label in zip(kernel, labels.group(1)) if label != "o")
        if instruction.op != "custom-call":
            return 0.0
        target = re.search(r'custom_call_target="([^"]*)"', instruction.attrs)
        target = target.group(1) if target else ""
        if target.startswith("__cublas$"):
            lhs = self._dims(0, instruction)
            contracted = _contracted(instruction.attrs, "lhs_contracting_dimensions")
            return 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracted if d < len(lhs))
        if target.startswith("__cudnn$fmha"):  # q [B, T, H, d] or [B, H, T, d]; k's sequence the longer middle dim
            q, k = self._dims(0, instruction), self._dims(1, instruction)
            if len(q) < 3 or len(k) < 3:
                return 0.0
            forward = 4.0 * math.prod(q) * max(k[1:-1])
            causal = re.search(r'"mask_type":\s*"(PADDING_)?CAUSAL"', instruction.attrs) is not None
            return forward * (2.5 if "Backward" in target else 1.0) * (0.5 if causal else 1.0)
        return 0.0

    @functools.lru_cache(maxsize=None)  # noqa: B019 (one walker per program text)
    def fused_flops(self, name: str) -> float:
        """Matmul FLOPs of one run of a fused computation (dots of nested fusions included)."""
        total = 0.0
        for instruction in self.computations.get(name, []):
            total += self.own_flops(instruction)
            for callee in _called(instruction, "calls"):
                total += self.fused_flops(callee)
        return total

    @functools.lru_cache(maxsize=None)  # noqa: B019
    def run(self, name: str) -> tuple[float, float, float]:
        """(kernels, conditionals, matmul FLOPs) of one execution of a computation that launches its own kernels."""
        kernels = conditionals = flops = 0.0
        for instruction in self.computations.get(name, []):
            kernels += instruction.op not in _NO_LAUNCH
            flops += self.own_flops(instruction)
            if instruction.op == "while":
                trips = _trip_count(instruction)
                if trips is None:
                    self.unknown_trip.append(instruction.name)
                    trips = 1
                for callee, times in ((_called(instruction, "body"), trips), (_called(instruction, "condition"),
                                                                             trips + 1)):
                    k, c, f = self.run(callee[0]) if callee else (0, 0, 0)
                    kernels, conditionals, flops = kernels + times * k, conditionals + times * c, flops + times * f
            elif instruction.op == "conditional":  # the most expensive branch: an upper bound
                branches = [self.run(b) for b in _called(instruction, "branch_computations", "true_computation",
                                                         "false_computation")]
                conditionals += 1
                if branches:
                    kernels += max(b[0] for b in branches)
                    conditionals += max(b[1] for b in branches)
                    flops += max(b[2] for b in branches)
            elif instruction.op == "call":
                for callee in _called(instruction, "to_apply", "calls"):
                    k, c, f = self.run(callee)
                    kernels, conditionals, flops = kernels + k, conditionals + c, flops + f
            elif instruction.op in ("fusion", "fusion-start", "async-start", "custom-call"):
                flops += sum(self.fused_flops(callee) for callee in _called(instruction, "calls"))
        return kernels, conditionals, flops

    def bytes_of(self, instruction: Instruction) -> float:
        """Bytes a launched instruction reads and writes: its operands' and its results' arrays, except that in a
        fusion an operand it only slices (dynamic-slice, slice, gather: a scanned layer's weights) counts its
        slices, and an operand it updates in place (dynamic-update-slice: a cache or a stacked gradient) counts
        only the update written."""
        fused = _called(instruction, "calls") if instruction.op == "fusion" else []
        body = self.computations.get(fused[0], []) if fused else []
        if not body:
            return float(sum(_nbytes(x) for x in instruction.shapes) +
                         sum(_nbytes(x) for operand in instruction.operands for x in self.shapes_of.get(operand, ())))
        by_name = {i.name: i for i in body}
        users: dict[str, list[Instruction]] = {}
        for i in body:
            for operand in i.operands:
                users.setdefault(operand, []).append(i)
        total = 0.0
        for param in (i for i in body if i.op == "parameter"):
            used = users.get(param.name, [])
            if used and all(u.op in ("dynamic-slice", "slice", "gather") and u.operands[0] == param.name for u in used):
                total += sum(_nbytes(x) for u in used for x in u.shapes)
            elif not (used and all(u.op == "dynamic-update-slice" and u.operands[0] == param.name for u in used)):
                total += sum(_nbytes(x) for x in param.shapes)
        root = next((i for i in body if i.root), None)
        outputs = [by_name.get(o) for o in root.operands] if root is not None and root.op == "tuple" else [root]
        for out in outputs:
            if out is not None and out.op == "dynamic-update-slice" and len(out.operands) > 1:
                total += sum(_nbytes(x) for x in self.shapes_of.get(out.operands[1], ()))
            elif out is not None:
                total += sum(_nbytes(x) for x in out.shapes)
        return total

    @functools.lru_cache(maxsize=None)  # noqa: B019
    def launches(self, name: str, taken: tuple[tuple[str, float], ...] = ()) -> tuple[tuple[float, float, float], ...]:
        """(times, matmul FLOPs, bytes) of each kernel one execution of a computation launches, as `run` counts
        them (loop trip counts multiplied in), a conditional whose op_name holds a name of `taken` running its most
        expensive branch that fraction of the time and its cheapest the rest (every other conditional: its most
        expensive branch, `run`'s upper bound)."""
        out: list[tuple[float, float, float]] = []
        for instruction in self.computations.get(name, []):
            if instruction.op == "while":
                trips = _trip_count(instruction) or 1
                for callee, times in ((_called(instruction, "body"), trips),
                                      (_called(instruction, "condition"), trips + 1)):
                    out += [(t * times, f, b) for t, f, b in (self.launches(callee[0], taken) if callee else ())]
            elif instruction.op == "conditional":
                branches = sorted((self.launches(b, taken) for b in _called(
                    instruction, "branch_computations", "true_computation", "false_computation")),
                    key=lambda b: (sum(t for t, _, _ in b), sum(t * f for t, f, _ in b)))
                op_name = re.search(r'op_name="([^"]*)"', instruction.attrs)
                share = next((fraction for scope, fraction in taken if op_name and scope in op_name.group(1)), 1.0)
                if branches:
                    out += [(t * share, f, b) for t, f, b in branches[-1]]
                    out += [(t * (1 - share), f, b) for t, f, b in branches[0]] if share < 1 else []
            elif instruction.op == "call":
                for callee in _called(instruction, "to_apply", "calls"):
                    out += self.launches(callee, taken)
            elif instruction.op not in _NO_LAUNCH:
                flops = self.own_flops(instruction)
                if instruction.op in ("fusion", "fusion-start", "async-start", "custom-call"):
                    flops += sum(self.fused_flops(callee) for callee in _called(instruction, "calls"))
                out.append((1.0, flops, self.bytes_of(instruction)))
        return tuple(out)

    def executed(self) -> set[str]:
        """Computations that launch their own kernels: ENTRY and what its control flow runs (not fused bodies)."""
        seen, todo = set(), [self.entry]
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            for instruction in self.computations.get(name, []):
                if instruction.op in ("while", "conditional", "call"):
                    todo += _called(instruction, "body", "condition", "branch_computations", "true_computation",
                                    "false_computation", "to_apply", "calls")
        return seen


def _nbytes(shape: tuple[str, tuple[int, ...]]) -> float:
    return math.prod(shape[1]) * _bits(shape[0]) / 8


def _bits(dtype: str) -> int:
    digits = re.search(r"\d+", dtype)
    return int(digits.group()) if digits and dtype[0] in "bfsuc" else 8  # pred: a byte


def _attention_kernel(text: str) -> str:
    if "__cudnn$fmha" in text:
        return "cudnn"
    if any("tpu_custom_call" in line and "splash" in line.lower() for line in text.splitlines()):
        return "splash"
    return "xla"


def program_stats(text: str) -> ProgramStats:
    """The statistics above of one program's optimized HLO text."""
    walker = _Walker(text)
    if not walker.entry:
        return ProgramStats(attention_kernel=_attention_kernel(text))
    kernels, conditionals, flops = walker.run(walker.entry)
    largest, largest_size = "", (-1, 0)
    for name in sorted(walker.executed()):
        for instruction in walker.computations.get(name, []):
            if instruction.op in _ALIASES:
                continue
            for dtype, dims in instruction.shapes:
                size = (math.prod(dims), _bits(dtype))  # of equal element counts, the wider type
                if size > largest_size:
                    largest, largest_size = f"{dtype}[{','.join(map(str, dims))}]", size
    return ProgramStats(_attention_kernel(text), int(kernels), int(conditionals), flops, largest,
                        tuple(walker.unknown_trip))


def kernel_costs(text: str, taken: dict[str, float] | None = None) -> list[tuple[float, float, float]]:
    """(times launched per run, matmul FLOPs, bytes read and written) of each kernel of a program's optimized HLO
    text, counted as `program_stats` counts kernels (the sum of the times is its `kernels`); with `taken` {name
    scope: fraction}, a conditional under that name scope runs its most expensive branch that fraction of the time
    and its cheapest the rest (`layers.TILE_SCOPE`: XLA attention's conditional per tile, the fraction of tiles a
    layout needs). The inputs of a per-kernel roofline (`gpu_targets.predict_seconds`)."""
    walker = _Walker(text)
    return list(walker.launches(walker.entry, tuple(sorted((taken or {}).items())))) if walker.entry else []


def attended_pairs(prompt_tokens: int, samples: int, response_tokens: int) -> int:
    """(query, key) pairs causal attention needs in one packed row of a prompt and `samples` responses, each
    response reading the prompt and itself: P (P + 1) / 2 + S (P R + R (R + 1) / 2)."""
    p, r = prompt_tokens, response_tokens
    return p * (p + 1) // 2 + samples * (p * r + r * (r + 1) // 2)


def model_flops(model_config, *, rows: int, prompt_tokens: int, samples: int, response_tokens: int,
                backward: bool = True) -> float:
    """Matmul FLOPs the model needs for `rows` packed rows, each one prompt of P tokens and S responses of R tokens
    (padding excluded), forward only or forward + backward (3 x forward: the backward pass computes the gradients
    of activations and of weights, two products per forward product), as benchmarks/train_step.py counts them:
        forward = 2 * W * rows * (P + S R) + 2 * V * D * rows * S R + 4 * L * H * hd * rows * pairs
    W: the decoder layers' matrix parameters (q, k, v, o, gate, up, down; L layers); V * D: the output layer, applied
    to the scored (response) positions only; pairs: `attended_pairs` (q k^T and p v, 2 hd FLOPs each per pair and
    query head). For Qwen2.5-1.5B (28 layers) on 2 rows of the paper's packed row (P 1024, S 8, R 3072) forward +
    backward is 402.49 + 68.82 + 65.49 = 536.81 TF; the GPU compile report's 549.8 TF counted the row's 3,072
    padding tokens' attention too (76.03 M pairs per row against 63.45 M)."""
    mc = model_config
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    d = mc.hidden_size
    weights = mc.num_layers * (2 * d * q + 2 * d * kv + 3 * d * mc.intermediate_size)
    tokens = rows * (prompt_tokens + samples * response_tokens)
    scored = rows * samples * response_tokens
    pairs = rows * attended_pairs(prompt_tokens, samples, response_tokens)
    forward = 2 * weights * tokens + 2 * mc.vocab_size * mc.hidden_size * scored + \
        4 * mc.num_layers * mc.num_heads * mc.head_dim * pairs
    return float(3 * forward if backward else forward)
