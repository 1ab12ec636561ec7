"""Stage times of one RL step at the paper's shape, for benchmarks/async_sim.py: sampling (with scoring), training and
the weight transfer, as functions of the devices each gets. Pure Python; every input says whether it was measured
here, read off a datasheet or assumed.

Sampling (static engine, the presets' engine): every sampler device holds the bf16 policy and decodes its share of a
call's rows; a call runs until its longest row ends, so a step's sampling time is set by the longest responses of its
calls. A decode step costs o + max(bytes read / HBM bandwidth, FLOPs / matmul peak) / e, bytes = the weights + the
prompt cache (once per 8 rows) + every row's response cache so far (a TPU decode reads every tile); e and o are fitted
to the two Qwen2.5-1.5B sampler points measured on the H200. Rows per device per call: as many as fit in 85% of HBM
beside what else the device holds, the calls of a step balanced.

Training (FSDP, one packed row = a prompt and its 8 responses per device per micro-batch): each mini-batch's rows are
padded to its longest (the packer's length grid), a device runs ceil(rows / devices) of them; then the old and the
reference log-prob passes (a forward: a third of the FLOPs) over all rows padded to the longest. Seconds = FLOPs /
(devices x peak x MFU x 0.9 when devices > 1); MFU is the scenario's.

Transfer: the bf16 weights from the trainer's FSDP shards to every sampler device over the named link.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import random

GPU_RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "gpu_h200.json"
RESPONSE_TILE = 384  # jaxrl_llm.sampling.buckets.response_tile_size(3072)


@dataclasses.dataclass(frozen=True)
class Machine:
    name: str
    devices: int
    matmul_flops: float  # bf16 FLOP/s per device
    hbm_bytes_s: float
    hbm_bytes: float
    link: str  # the interconnect the weights cross, trainer -> sampler
    link_bytes_s: float  # one direction, per device
    reads_all_tiles: bool  # a TPU decode reads every response tile (sampling/decoder.py `_attend_reached`)
    verifications_s: float  # the whole run's verifier throughput
    provenance: str


def h200() -> Machine:
    ceilings = json.loads(GPU_RESULTS.read_text(encoding="utf-8"))["ceilings"]
    return Machine("8 x H200", 8, ceilings["bf16_matmul_flops"], ceilings["bandwidth_bytes_s"], 143_771 * 2**20,
                   "NVLink 4 (NVSwitch)", 450e9, False, 8 * 331 / 2,
                   "measured: matmul 508 TFLOP/s and HBM 2.79 TB/s on one H200 (results/gpu_h200.json), 143,771 MiB "
                   "(its nvidia-smi); datasheet: NVLink 4 900 GB/s per GPU both ways (NVIDIA H100/H200 SXM), 450 GB/s "
                   "one way; measured: verifier 331 typical items/s through 2 workers on 2 cores (benchmarks/README.md "
                   "'Verifier'), assumed x 4 for the preset's 8 workers")


V5E = Machine("v5e-64", 64, 197e12, 819e9, 16 * 2**30, "ICI", 200e9, True, 16 * 8 * 331 / 2,
              "datasheet (Google Cloud TPU v5e: 197 TFLOP/s bf16, 16 GiB HBM2 at 819 GB/s, ICI 1,600 Gbps = 200 GB/s "
              "per chip); no TPU timing exists, so the decode efficiency and overhead are the H200's (assumed); "
              "verifier as on the GPU host x 16 hosts (ProcessShareScorer splits the samples over processes)")


@dataclasses.dataclass(frozen=True)
class Policy:
    """Qwen2.5-Math-1.5B (jaxrl_llm.capacity.memory.KNOWN_MODELS)."""
    params: int = 1_543_714_304
    vocab: int = 151_936
    hidden: int = 1536
    intermediate: int = 8960
    layers: int = 28
    heads: int = 12
    kv_heads: int = 2
    head_dim: int = 128

    @property
    def layer_matrix_params(self) -> int:  # q, k, v, o and the three MLP matrices of every layer
        q_o, k_v = 2 * self.hidden * self.heads * self.head_dim, 2 * self.hidden * self.kv_heads * self.head_dim
        return self.layers * (q_o + k_v + 3 * self.hidden * self.intermediate)

    @property
    def kv_bytes_per_token(self) -> int:  # bf16 keys and values of every layer
        return self.layers * self.kv_heads * self.head_dim * 2 * 2

    @property
    def weight_bytes(self) -> int:  # what a sampler device holds and the transfer moves: bf16
        return 2 * self.params


@dataclasses.dataclass(frozen=True)
class Workload:
    """configs/paper/qwen2.5-math-1.5b_grpo.yaml: 1024 prompts x 8 samples, responses up to 3072 tokens, 4 updates of
    256 prompts, old log-probs recomputed and a reference pass (KL). Assumed, since no Qwen2.5-Math rollout was
    measured here: prompts of 200 tokens; a response reaches the cap with probability `capped`, else is lognormal with
    median `median_response` and log-sd `sigma` (0.60 is the measured log-sd of the uncapped lengths of 800 rollouts
    of the bundled model, results/rollouts_64.json: another model's shape)."""
    prompts: int = 1024
    samples: int = 8
    max_new_tokens: int = 3072
    mini_batches: int = 4
    logprob_passes: int = 2
    prompt_tokens: int = 200
    median_response: float = 600.0
    sigma: float = 0.60
    capped: float = 0.02
    memory_fraction: float = 0.85  # what scripts/memory_estimate.py counts as fitting
    train_activation_bytes: float = 7.0 * 2**30  # one 28,672-token row's remat'd step (docs/launch.md memory table)
    train_efficiency: float = 0.9  # FSDP over more than one device: assumed


POLICY, WORKLOAD = Policy(), Workload()


def draw_lengths(rng: random.Random, workload: Workload = WORKLOAD) -> list[int]:
    """One step's response lengths, prompt-major (prompt i's samples in rows i*samples ...)."""
    out = []
    for _ in range(workload.prompts * workload.samples):
        length = workload.max_new_tokens if rng.random() < workload.capped else \
            rng.lognormvariate(math.log(workload.median_response), workload.sigma)
        out.append(max(1, min(workload.max_new_tokens, round(length))))
    return out


def decode_calibration() -> tuple[float, float]:
    """(e, o): decode step = o + roofline step / e through the two measured Qwen2.5-1.5B sampler points on the H200
    (1 row and 512 rows x 128 new tokens; roofline as benchmarks/gpu.py computes it)."""
    sampler = json.loads(GPU_RESULTS.read_text(encoding="utf-8"))["sampler"]
    (t1, r1), (t2, r2) = ((p["rows"] / p["ours_static_tok_s"], p["rows"] / p["roofline_tok_s"])
                          for p in (sampler["qwen2.5-1.5b 1x1x128"], sampler["qwen2.5-1.5b 64x8x128"]))
    efficiency = (r2 - r1) / (t2 - t1)
    return efficiency, t1 - r1 / efficiency


def sampler_rows_that_fit(machine: Machine, resident_bytes: float, policy: Policy = POLICY,
                          workload: Workload = WORKLOAD) -> int:
    """Sampled rows per device per call (a multiple of the samples per prompt) in 85% of HBM beside resident_bytes:
    each row's response cache, its share of the prompt cache and its f32 logits."""
    g = workload.samples
    row = (workload.prompt_tokens / g + workload.max_new_tokens) * policy.kv_bytes_per_token + 4 * policy.vocab
    return int((workload.memory_fraction * machine.hbm_bytes - resident_bytes) // row) // g * g


def sampler_seconds(lengths, devices: int, machine: Machine, *, resident_bytes: float, calibration,
                    policy: Policy = POLICY, workload: Workload = WORKLOAD) -> tuple[float, float]:
    """(device seconds, scoring seconds) of one step's sampling on `devices` (module docstring)."""
    e, o = calibration
    p, g, kv = workload.prompt_tokens, workload.samples, policy.kv_bytes_per_token
    fit = sampler_rows_that_fit(machine, resident_bytes, policy, workload)
    if fit < g:
        raise ValueError(f"{machine.name}: no {g} sampled rows fit beside {resident_bytes / 2**30:.1f} GiB")
    per_device = -(-len(lengths) // devices)
    calls = -(-per_device // fit)
    per_call = -(-per_device // calls // g) * g * devices  # the calls balanced, whole prompts
    attention = 4 * policy.layers * policy.heads * policy.head_dim  # FLOPs per row and context token: q k^T, p v
    seconds = 0.0
    for first in range(0, len(lengths), per_call):
        call = lengths[first:first + per_call]
        rows, longest = -(-len(call) // devices), max(call)
        seconds += 2 * policy.params * rows / g * p / (machine.matmul_flops * e)  # prefill, once per prompt
        for done in range(0, longest, RESPONSE_TILE):  # each response tile is read from its first step on
            context = workload.max_new_tokens if machine.reads_all_tiles else done + RESPONSE_TILE
            read = policy.weight_bytes + (rows / g * p + rows * context) * kv
            flops = 2 * policy.params * rows + attention * rows * (p + context)
            step = o + max(read / machine.hbm_bytes_s, flops / machine.matmul_flops) / e
            seconds += min(RESPONSE_TILE, longest - done) * step
    return seconds, len(lengths) / machine.verifications_s


def length_bucket(n: int, multiple: int = 32) -> int:
    """jaxrl_llm.train.packing.length_bucket: four row lengths per doubling, at most 25% padding."""
    chunks = max(1, -(-n // multiple))
    step = 1 << max(0, chunks.bit_length() - 3)
    return multiple * (-(-chunks // step) * step)


def row_flops(row_tokens: int, scored: int, pairs: int, policy: Policy = POLICY) -> float:
    """Forward + backward model FLOPs of one packed row, benchmarks/train_step.py's train_step_flops with the matrices
    over the padded row: 6 P_layers row_tokens + 6 V D scored + 12 L H d pairs."""
    return (6 * policy.layer_matrix_params * row_tokens + 6 * policy.vocab * policy.hidden * scored
            + 12 * policy.layers * policy.heads * policy.head_dim * pairs)


def packed_pairs(prompt: int, responses) -> int:
    """Attended (query, key) pairs of a packed row: the prompt causal, each response seeing the prompt and itself."""
    return prompt * (prompt + 1) // 2 + sum(n * prompt + n * (n + 1) // 2 for n in responses)


def train_work(lengths, workload: Workload = WORKLOAD, policy: Policy = POLICY) -> list[tuple[int, float]]:
    """(rows, FLOPs) of each pass of one step's training: the mini-batches' updates, then the log-prob passes over all
    rows; every row padded to its batch's longest."""
    p, g = workload.prompt_tokens, workload.samples
    rows = [(p + sum(group), sum(group), packed_pairs(p, group))
            for group in (lengths[i:i + g] for i in range(0, len(lengths), g))]
    per = len(rows) // workload.mini_batches
    passes = [(rows[i:i + per], 1.0) for i in range(0, len(rows), per)] + [(rows, workload.logprob_passes / 3)]
    out = []
    for batch, factor in passes:
        padded = length_bucket(max(r[0] for r in batch))
        out.append((len(batch), factor * math.fsum(row_flops(padded, r[1], r[2], policy) for r in batch)))
    return out


def train_fits(devices: int, machine: Machine, policy: Policy = POLICY, workload: Workload = WORKLOAD) -> bool:
    """f32 params, AdamW moments, reference and gradients (24 bytes a parameter) sharded, beside one row's step."""
    need = 24 * policy.params / devices + workload.train_activation_bytes
    return need <= workload.memory_fraction * machine.hbm_bytes


def trainer_seconds(work, devices: int, machine: Machine, mfu: float, workload: Workload = WORKLOAD) -> float:
    """One step's training (train_work) on `devices`: ceil(rows / devices) rows each per pass."""
    rate = devices * machine.matmul_flops * mfu * (1.0 if devices == 1 else workload.train_efficiency)
    return math.fsum(flops * (-(-rows // devices) * devices / rows) for rows, flops in work) / rate


def measured_train_mfu(policy: Policy = POLICY) -> float:
    """The H200 train step (results/gpu_h200.json: 2 packed rows of a 1024-token prompt and 8 x 3072 tokens, padded
    to 28,672) in row_flops' terms, against the measured matmul peak."""
    gpu = json.loads(GPU_RESULTS.read_text(encoding="utf-8"))
    train = gpu["train"]
    p, n, g = train["prompt_tokens"], train["response_tokens"], train["responses_per_row"]
    flops = train["rows"] * row_flops(train["row_tokens"], g * n, packed_pairs(p, [n] * g), policy)
    return flops / train["ours_step_s"] / gpu["ceilings"]["bf16_matmul_flops"]


def transfer_seconds(sampler_devices: int, trainer_devices: int, machine: Machine, policy: Policy = POLICY) -> float:
    """Each sampler device takes in the whole bf16 policy; each trainer device sends its shard to every sampler
    device: weight bytes x max(1, sampler / trainer devices) / link bandwidth."""
    return policy.weight_bytes * max(1.0, sampler_devices / trainer_devices) / machine.link_bytes_s
