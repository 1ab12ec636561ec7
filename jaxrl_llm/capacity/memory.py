"""Per-device memory estimate of a training run, from its config alone (no devices, no arrays).

Every term counts what jaxrl_llm itself allocates, per device of a `data x fsdp x tensor` mesh
(c = bytes of model.compute_dtype, p = bytes of model.param_dtype):

  params      sum over parameter leaves of size / (mesh axes the sharding rules split it over) x p
              (`models.sharding.partition_rules`; an axis that does not divide a dimension replicates it)
  optimizer   AdamW first and second moments, kept by optax in the parameters' dtype: 2 x params
  reference   a frozen copy of params when the KL term or PRL shaping needs a reference policy
  train step  gradients: the f32 accumulator of the micro-batch scan + one micro-batch gradient in p, and after
              the backward passes XLA's update temporaries, two more f32 copies (AdamW's new moments before they
              replace the old);
              activations of one micro-batch of packed rows (one prompt + n responses per row, n = samples
              per prompt, N'' under GVM, rounded up to a power of two; the row length L = prompt + n R on the
              packer's grid `train.packing.length_bucket`, at most 25% above it; with optim.max_row_tokens
              each row holds the responses that fit, at least one, and the length is at most that bound):
                per layer and token  (4 D + 2 q + 3 kv + 4 F) x c   (norm inputs/outputs, q/k/v before and
                                     after RoPE, attention output, residuals, gate/up/silu/product; q, kv
                                     and F per device: split over tensor where it divides their heads and
                                     width, D whole)
                fused attention (`models.attention`: splash where the run is on a TPU with
                                     model.attention_impl auto or splash, or a forced cudnn/splash): no scores
                                     kept; one layer's kernel works on the S regrouped rows of W = prompt +
                                     max_new_tokens tokens (on splash's grid of 128) per packed row, over the
                                     device's KV heads and their query heads (every head where tensor does
                                     not divide the KV heads): rows x S W x (head_dim x (3 H_a + 2 KV_a)
                                     x c + 512)  (q, its output and output gradient, k and v, all in c:
                                     splash's backward kernels give dq, dk, dv in the inputs' dtype; the
                                     int32 segment ids laid over 128 lanes)
                full attention (model.attention_block_size null, or L < model.attention_block_min_length),
                                     per layer: rows x H_t x L^2 x (4 + c)
                                     (f32 scores, probabilities in c), and in the backward pass one
                                     layer's f32 score gradient rows x H_t x L^2 x 4 + the bool mask rows x L^2
                blockwise attention (block b, L_b = L rounded up to b): no scores are kept per layer (the
                                     tiles are rematerialised); the backward pass of one query block keeps
                                     the running max, sum and output of every key block,
                                     rows x H_t x L_b x (head_dim + 2) x 4, plus one tile's f32 scores,
                                     probabilities and their gradient with the probabilities in c and the mask:
                                     rows x H_t x b^2 x (12 + c) + rows x b^2
                without remat every layer keeps its per-token terms (and full attention's scores); with remat
                (jax.checkpoint per layer) only the layer input rows x L x D x c is kept per layer and one
                layer is recomputed at a time; (remat policy "dots" also keeps the projection outputs:
                (q + 2 kv + 2 D + 2 F) x c per token; "qkv_attn_mlp" q, k, v, the attention output, gate
                and up: (2 q + 2 kv + 2 F) x c per token, and the layer being differentiated recomputes only
                (2 D + 2 F) x c per token)
              and, while one layer's backward pass runs, the gradients of its input, output, q, k, v, gate
                and up: rows x L x (2 D + q + 2 kv + 2 F) x c; and the hidden states' f32 gradient where the
                embedding is differentiated, twice (resharded for its gradient): rows x L x D x 8
              log-prob residuals: the custom VJP of `train.logprobs.chunked_logprobs` keeps, for the backward
                pass, the gathered hidden states in c, the int32 targets and two f32 statistics per token
                (log Z, E_p[logit]), and every vocabulary chunk's f32 logits, for K = min(L, n R_max) scored
                positions per row (n slots of max_new_tokens, or the row's L positions when fewer:
                `train.logprobs.scored_positions`):
                rows x K x (V x 4 + D x c + 12), plus the pieces of the output matrix's gradient
                (V x D x c, sharded as its parameter); with model.remat_logits the logits are recomputed
                chunk by chunk in the backward pass instead: rows x K x (min(V, 8192) x 4 + D x c + 12);
                with c != 4 also one chunk's logits in c as the product gives them, rows x K x min(V, 8192) x c;
                plus the output matrix cast to c when c != p (V x D, sharded as its parameter)
              The step holds these in phases (the compiled train steps' buffer assignments): the log-prob pass's
              backward runs first and its residuals are gone when the layers' backward makes its working set, and
              the embedding's gradient comes after both, so
                train step = max(accumulator + micro-batch gradient + kept + max(one layer's working set
                             (recomputed activations, attention working set, layer gradients), the embedding's
                             f32 gradients, log-prob residuals),  accumulator + the update's two copies)
              where kept is what the forward pass keeps (every layer's terms, or with remat each layer's input);
              `activations` reports kept + the larger of the two layer-backward phases.
  sampling    KV cache of the rows of one sampler call: all of a step's rows, or `sampling.max_rows_per_call`
              of them (the row bucket of `sampling.plan.plan_calls`), rows split over data x fsdp:
              layers x (rows / g x P_bucket + rows x R_bucket) x kv_heads x head_dim x 2 x c, where g rows
              share one prompt entry (`sampling.plan.plan_calls`' prompt group: samples_per_prompt when it divides
              a device's rows; 1 with GVM's varying counts) and a sliding-window layer (Mistral, Gemma) keeps
              min(R_bucket, window) response slots, the kv_heads split over tensor where it divides them
              (`sampling.engine.cache_sharding`); where tensor > 1 does not divide them, the decode loop
              holds the cache twice (XLA's temporaries on a TPU: Qwen2.5-1.5B's 2 KV heads on tensor=4 held
              5.58 GiB beside a 5.47 GiB cache per chip, `jaxrl-llm compile`); plus two [rows, V] f32 logits
              buffers, and the policy cast to c where the sampler reads p != c weights (no sampling.dtype copy:
              XLA hoists the casts out of the loop). The term is the larger of its two phases:
                prefill  + the keys and values of one prefill chunk of the call's prompts (min(call prompts,
                         floor_pow2(4096 / P_bucket)), rounded up to data x fsdp) in every layer, gathered on
                         every device by the merge into rows: chunk x P_bucket x layers x kv_heads_t x head_dim
                         x 2 x c (split over tensor by prompts where tensor does not divide the KV heads)
                decode   + the cache copy above; with a tiled response cache (`buckets.response_tile_size`) the
                         written tile of every full-attention layer, rows x tile x kv_heads_t x head_dim x 2 x c;
                         the logits are the larger of the two row buffers and the call's rows x V / tensor f32
                         (the output layer's product gives every row's logits with the vocabulary split); on a
                         TPU without the cast copy, the stacked layer weights sliced per layer in c (XLA hoists
                         the slices out of the loop)
              With sampling.engine=continuous: layers x (C x P_bucket + S x R_bucket) x
              kv_heads x head_dim x 2 x c for S decode slots (`sampling.buckets.slot_count`) and
              C = `sampling.buckets.prompt_entries` prompt-cache entries (one per prompt of the step, at
              most S + one prefill chunk of floor_pow2(4096 / P_bucket) prompts, or
              `sampling.max_prompt_entries` where lower; with tools.env, one per prompt of the step rounded up
              to the chunk: tool conversations keep their prompt's entry across turns), plus one layer's prompt
              keys/values gathered for the slots (S x P_bucket x kv_heads x head_dim x 2 x c) and (C + 2 S) x V
              f32 logits; the S slots are split over data x fsdp as rows are, every device holds the C entries
  gvm norms   (GVM only) per-sample gradients of the subset (default the embedding) for
              `sampling.gvm_rows_per_chunk` (0: `optim.micro_batch_size`) unpacked rows at a time, in p
              (a tied embedding in the subset also gets the output layer's, rows x V x D in c, made first), with
              those rows' activations and log-prob residuals (a row is the prompt and all max_new_tokens columns,
              every one scored, whatever `response_fill`) in phases as the train step's: the layers' backward
              beside the kept activations, then the lookup's per-sample gradient with the hidden states' f32
              gradient twice; plus the policy cast to c where p != c, and under LoRA the merged copy it reads; a
              chunk's rows are split over data x fsdp (ceil(chunk / (data x fsdp)) rows per device)

  critic      (PPO with a critic, algorithm.advantage gae) the value model, counted as the policy's trunk (its
              parameters without lm_head, sharded alike) plus the f32 head: critic = its parameters and AdamW
              moments, 3 x trunk x p; critic step = its gradients (the f32 accumulator + one in p) and the
              activations of one micro-batch, as the policy's (no log-prob residuals: a scalar per token)

  peak = params + optimizer + reference + critic + max(train step, critic step, sampling, gvm norms)

The sampler's own copy of the policy (`sampling.dtype`, `rollouts`): with sampling.dtype bfloat16 the sampler
reads a bf16 copy (local x 2; its KV cache and logits in bf16 too), with int8 a copy whose projections are int8
codes plus f32 scales (as a quantized base), counted in sampling (sampler copy). With rollouts.mode async the
sampler keeps its own copies of the policy versions it may still read, at most max_staleness + 1 of them (each
local x p, or the sampler copy's size with sampling.dtype): sampler copies. rollouts.sampler_devices = 0: they
stay beside the trainer's state (added to the resident terms; the sampler's and the trainer's programs take
turns on a device). rollouts.sampler_devices = n > 0: they and the KV cache live on the sampler's n devices, on
`rollouts.sampler_mesh` (sampler peak = copies + sampling there, without the merged or cast copy, which is
made on the trainer's devices before the transfer); the trainer's devices hold the rest (their sampling term is
only that merged or cast copy); peak = the larger of the two groups'.

With LoRA (`lora.rank` > 0) the base is frozen and only adapters train (a = the adapters' elements per
device, sharded by the same rules, float32): params = base in p + a x 4; optimizer = 2 a x 4; reference = 0
(the base is the reference policy); the gradients are the adapters' (a x 4 x 2); and sampling (and GVM's
norm pass) also holds the merged copy of the base (W + s A B) it reads, local x p. A quantized base
(`lora.base_dtype` int8 / int4) stores each projection in 1 / 0.5 bytes per element plus float32 scales [L, 1, out]; the
merged copy is still in p.

H_t = heads / tensor when tensor divides the heads, else all heads; H_a, KV_a the heads a fused kernel runs per
device (KV heads / tensor and their query heads when tensor divides the KV heads, else all). `platform` ("tpu",
"gpu", "cpu") picks the attention path as `models.attention.resolve` does (a target's platform in `TARGETS`).
The XLA-specific terms (update temporaries, the embedding's f32 gradients, the prefill's gathered chunk, the
decode's tile copies, logits and weight slices, the policy cast, the phases of the train step and of GVM's norm
pass) were read from the compiled programs' buffer assignments and live ranges (`jaxrl-llm compile` for
v5litepod-64, v4-32 and one v5e chip, 2026-11-28). Rows per device = ceil(rows / (data x fsdp)). Lengths are the
worst case: every response reaches max_new_tokens (set `response_fill` below 1 for an average fill). Against XLA's
own peak of each compiled program (`memory_analysis().peak_memory_in_bytes`, what the TPU compiler holds a program
to) over 22 preset-slices in docs/launch.md: the train step -5% to +10%, the sampler's prefill -5% to +9%, decode
-8% to +10%, GVM's norms -7% to 0%; leave ~10-15% of HBM free (the compiler lets a program use 15.75 GiB of a
v5e chip's 16, 30.75 of a v4's 32: `capacity.aot.CHIPS`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
from typing import Any

import numpy as np

from jaxrl_llm.models.attention import SPLASH_BLOCK
from jaxrl_llm.models.attention import resolve as attention_resolve
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.lora import LoraSpec, adapter_shapes, resolve_targets
from jaxrl_llm.models.model import param_shapes
from jaxrl_llm.models.sharding import MESH_AXES, partition_rules
from jaxrl_llm.run.config import RunConfig, lora_enabled, uses_critic
from jaxrl_llm.sampling.buckets import bucket_size, prefill_chunk, response_tile_size, round_up
from jaxrl_llm.sampling.decoder import response_slots
from jaxrl_llm.sampling.plan import plan_calls
from jaxrl_llm.train.algorithms import needs_reference
from jaxrl_llm.train.packing import bucket, length_bucket

GIB = 1024 ** 3
_BYTES = {"float32": 4, "bfloat16": 2}
LOGPROB_CHUNK = 8192  # vocabulary chunk of train.logprobs.chunked_logprobs
ROW_SEQ_MULTIPLE = 32  # packed rows are padded to a multiple of this (train.packing.pack_groups)


@dataclasses.dataclass(frozen=True)
class Target:
    """An accelerator slice: devices JAX sees and HBM per device."""

    name: str
    devices: int
    hbm_bytes: int
    note: str
    platform: str = "tpu"  # picks the attention path (`models.attention.resolve`)


# A v4 chip (two TensorCores as one megacore device) has 32 GiB HBM; v4-32 = 32 TensorCores = 16 chips.
# A v5e chip has 16 GiB HBM; v5litepod-64 = 64 chips. An H100 SXM has 80 GB (81,559 MiB seen by CUDA).
TARGETS = {
    "v4-32": Target("v4-32", 16, 32 * GIB, "16 chips x 32 GiB HBM, 4 hosts"),
    "v5e-64": Target("v5e-64", 64, 16 * GIB, "64 chips x 16 GiB HBM, 16 hosts"),
    "8xH100": Target("8xH100", 8, 81559 * 1024 ** 2, "8 GPUs x 80 GB HBM3, 1 node", "gpu"),
    "1x16GB": Target("1x16GB", 1, 16 * GIB, "one 16 GiB accelerator: a TPU v5e chip (a T4 has 15 GiB)"),
    "1xH100": Target("1xH100", 1, 81559 * 1024 ** 2, "one GPU x 80 GB HBM3", "gpu"),
}

# The paper models' transformers config.json values (Qwen/Qwen2.5-Math-1.5B and -7B on the HF Hub).
KNOWN_MODELS = {
    "qwen2.5-math-1.5b": ModelConfig(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
        num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=10000.0, tie_word_embeddings=True,
        attention_bias=True, max_position_embeddings=4096, rms_norm_eps=1e-6),
    "qwen2.5-math-7b": ModelConfig(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=10000.0, tie_word_embeddings=False,
        attention_bias=True, max_position_embeddings=4096, rms_norm_eps=1e-6),
}
# The config.json values of google/gemma-2-2b, google/gemma-3-1b-pt, the text model of google/gemma-3-4b-pt
# and mistralai/Mistral-7B-v0.1 (instruction-tuned versions share them).
_GEMMA3_LAYERS = lambda n: tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"  # noqa: E731
                                 for i in range(n))
KNOWN_MODELS.update({
    "gemma-2-2b": ModelConfig(
        model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_layers=26,
        num_heads=8, num_kv_heads=4, head_dim=256, rope_theta=10000.0, tie_word_embeddings=True,
        max_position_embeddings=8192, rms_norm_eps=1e-6, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, sliding_window=4096,
        layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(26))),
    "gemma-3-1b-pt": ModelConfig(
        model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_layers=26,
        num_heads=4, num_kv_heads=1, head_dim=256, rope_theta=1000000.0, rope_local_theta=10000.0, qk_norm=True,
        tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
        sliding_window=512, layer_types=_GEMMA3_LAYERS(26)),
    "gemma-3-4b-pt": ModelConfig(
        model_type="gemma3_text", vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_layers=34,
        num_heads=8, num_kv_heads=4, head_dim=256, rope_theta=1000000.0, rope_local_theta=10000.0, qk_norm=True,
        rope_scaling=(("factor", 8.0), ("rope_type", "linear")), tie_word_embeddings=True,
        max_position_embeddings=131072, rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=1024,
        layer_types=_GEMMA3_LAYERS(34)),
    "mistral-7b-v0.1": ModelConfig(
        model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=10000.0, tie_word_embeddings=False,
        max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=4096),
})
# The bundled SmolLM2-135M-Instruct (models.bundled; shapes from its GGUF header, shared/PEERS.md).
KNOWN_MODELS["smollm2-135m-instruct"] = ModelConfig(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192,
    rms_norm_eps=1e-5)
for _name, _alias in (("smollm2-135m-instruct", "bundled"), ("gemma-2-2b", "gemma-2-2b-it"), ("gemma-3-1b-pt", "gemma-3-1b-it"),
                      ("gemma-3-4b-pt", "gemma-3-4b-it"), ("mistral-7b-v0.1", "mistral-7b-instruct-v0.1")):
    KNOWN_MODELS[_alias] = KNOWN_MODELS[_name]


def model_config_for(source: str) -> ModelConfig:
    """The ModelConfig of `model.source`: its config.json when it is an HF folder, else the entry of
    KNOWN_MODELS whose name is the folder's basename (case-insensitive), e.g. ~/models/Qwen2.5-Math-1.5B."""
    path = pathlib.Path(source).expanduser()
    if (path / "config.json").is_file():
        return ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    key = path.name.lower()
    if key not in KNOWN_MODELS:
        raise ValueError(f"model.source {source!r}: no config.json there and {path.name!r} is not a known model "
                         f"({', '.join(sorted(KNOWN_MODELS))}); pass an HF folder")
    return KNOWN_MODELS[key]


def parse_mesh(spec: str, devices: int) -> dict[str, int]:
    """{"data", "fsdp", "tensor"} sizes from a `train.mesh` string for `devices` devices, with
    `models.sharding.make_mesh`'s rules: missing axes are 1, one axis may be -1 (the rest), "" = all fsdp."""
    sizes = {name: 1 for name in MESH_AXES}
    if not spec.strip():
        sizes["fsdp"] = -1
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in sizes or not re.fullmatch(r"-?\d+", value.strip()):
            raise ValueError(f"mesh spec {spec!r}: expected comma-separated axis=size with axes {MESH_AXES}")
        sizes[name.strip()] = int(value)
    free = [n for n, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"mesh spec {spec!r}: at most one axis may be -1")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        sizes[free[0]] = devices // fixed if devices % fixed == 0 else 0
    if any(s < 1 for s in sizes.values()) or math.prod(sizes.values()) != devices:
        raise ValueError(f"mesh spec {spec!r} gives {sizes}, which do not multiply to {devices} devices")
    return sizes


def _leaf_paths(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaf_paths(value, prefix + (key,))
        else:
            yield "/".join(prefix + (key,)), value


def _local_elements(model_config: ModelConfig, mesh: dict[str, int], shapes=None) -> dict[str, int]:
    """{parameter path: elements one device holds} under the model's partition rules (of the model's
    parameters, or of the tree of `shapes` given, e.g. LoRA adapters)."""
    rules = [(re.compile(pattern), spec) for pattern, spec in partition_rules(model_config)]
    local = {}
    for name, shape in _leaf_paths(param_shapes(model_config) if shapes is None else shapes):
        spec = next(s for pattern, s in rules if pattern.search(name))
        per_device = 1
        for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
            names = (axes,) if isinstance(axes, str) else tuple(axes or ())
            split = math.prod(mesh[n] for n in names)
            per_device *= dim // split if names and dim % split == 0 else dim
        local[name] = per_device
    return local


_CODE_BYTES = {"int8": 1.0, "int4": 0.5}


def quantized_base_savings(model_config: ModelConfig, mesh: dict[str, int], p: int, kind: str) -> int:
    """Bytes per device saved by storing every projection ("*_proj") as `kind` codes plus float32 scales
    [L, 1, out] instead of `p`-byte values (scales counted unsharded: they are small)."""
    shapes = param_shapes(model_config)["layers"]
    saved = 0
    for name, elements in _local_elements(model_config, mesh).items():
        if re.fullmatch(r"layers/\w+_proj", name):
            layers, _, out = shapes[name.split("/")[1]]
            saved += elements * (p - _CODE_BYTES[kind]) - layers * out * 4
    return int(saved)


def sharded_param_elements(model_config: ModelConfig, mesh: dict[str, int]) -> tuple[int, int]:
    """(total parameter count, elements held by one device) under the model's partition rules."""
    total = sum(math.prod(shape) for _, shape in _leaf_paths(param_shapes(model_config)))
    return total, sum(_local_elements(model_config, mesh).values())


def _split(n: int, tensor: int) -> int:
    """`n` features per device: split over tensor where it divides them (`models.sharding`), else whole."""
    return n // tensor if n % tensor == 0 else n


def _activation_bytes(mc: ModelConfig, rows: int, length: int, tensor: int, c: int, remat: bool,
                      policy: str = "full", block: int | None = None,
                      groups: tuple[int, int, bool] | None = None) -> tuple[int, int]:
    """(kept, working) for `rows` sequences of `length` tokens on a mesh whose tensor axis has `tensor` devices:
    what the forward pass keeps for the backward pass, and the largest working set of the backward pass beside
    it (one layer's recomputed activations, its attention's working set and gradients; or, at the embedding,
    the hidden states' f32 gradient twice). Remat policy "dots" also keeps each layer's projection outputs
    (q, k, v, o, gate, up, down) per token, "qkv_attn_mlp" q, k, v, the attention output, gate and up; `block`
    is model.attention_block_size (None: full attention); `groups` (S, W, dense): a fused kernel attends on S
    regrouped rows of W tokens per row (`models.attention`), or with `dense` XLA's full attention on each of
    them (a GPU where cuDNN cannot serve); None: the xla path."""
    q_heads = _split(mc.num_heads, tensor)
    q, kv = q_heads * mc.head_dim, _split(mc.num_kv_heads, tensor) * mc.head_dim
    f = _split(mc.intermediate_size, tensor)
    d = mc.hidden_size
    per_layer_tokens = rows * length * (4 * d + 2 * q + 3 * kv + 4 * f) * c
    # While one layer's backward pass runs: the gradients of its input, output, q, k, v, gate and up.
    layer_grads = rows * length * (2 * d + q + 2 * kv + 2 * f) * c
    # The hidden states' f32 gradient where the embedding is differentiated, twice (resharded for its gradient).
    embed_grads = rows * length * d * 4 * 2
    if groups is not None:
        # the kernel runs per device on its KV heads' query groups, all heads where tensor cannot split the KV
        # heads: q, its output and output gradient, k and v, all in c (splash's backward kernels give dq, dk,
        # dv in the inputs' dtype), and the int32 segment ids laid over 128 lanes (512 B a token)
        slots, width, dense = groups
        kv_heads = _split(mc.num_kv_heads, tensor)
        heads = kv_heads * (mc.num_heads // mc.num_kv_heads)
        tokens = rows * slots * width
        attention = 0
        working = tokens * (mc.head_dim * (heads * 3 * c + kv_heads * 2 * c) + 512)
        if dense:  # each regrouped row's scores and probabilities, as the xla path's full attention per row
            attention = rows * slots * heads * width * width * (4 + c)
            working += rows * slots * (heads * width * width * 4 + width * width)
    elif block is None:
        attention = rows * q_heads * length * length * (4 + c)
        working = rows * q_heads * length * length * 4 + rows * length * length  # f32 score gradient + bool mask
    else:
        tile = min(block, length)
        attention = 0
        working = (rows * q_heads * round_up(length, tile) * (mc.head_dim + 2) * 4  # per key block: max, sum, out
                   + rows * q_heads * tile * tile * (12 + c) + rows * tile * tile)  # one tile, its gradient, mask
    if remat:
        kept = d
        if policy == "dots":
            kept += q + 2 * kv + 2 * d + 2 * f
        elif policy == "qkv_attn_mlp":
            kept += 2 * q + 2 * kv + 2 * f
            # the layer being differentiated recomputes only its two norm outputs and SiLU(gate) x up
            per_layer_tokens = rows * length * (2 * d + 2 * f) * c
        return (mc.num_layers * rows * length * kept * c,
                max(per_layer_tokens + attention + working + layer_grads, embed_grads))
    return mc.num_layers * (per_layer_tokens + attention), max(working + layer_grads, embed_grads)


def _logprob_residual_bytes(mc: ModelConfig, rows: int, response_tokens: int, c: int, keep_logits: bool,
                            head_elements: int) -> int:
    """What the custom VJP of `chunked_logprobs` needs per token: the hidden state in c, the int32 target,
    log Z and E_p[logit] in f32, and either every vocabulary chunk's f32 logits (kept) or, recomputing them,
    one chunk's f32 logits at a time. Kept logits: plus the backward pass's pieces of d head
    (`head_elements` x c, concatenated at the end)."""
    # plus one chunk's logits in c as the matmul gives them, before the f32 cast
    per_token = mc.hidden_size * c + 12 + (min(mc.vocab_size, LOGPROB_CHUNK) * c if c != 4 else 0)
    if keep_logits:
        return rows * response_tokens * (per_token + mc.vocab_size * 4) + head_elements * c
    return rows * response_tokens * (per_token + min(mc.vocab_size, LOGPROB_CHUNK) * 4)


def _whole_row_responses(cfg: RunConfig) -> int:
    """Response slots of a packed row without optim.max_row_tokens (train.rollouts.max_row_responses): the
    mean group size, N'' under GVM (larger groups are split over rows), rounded up to a power of two."""
    gvm = cfg.sampling.allocation == "gvm"
    return bucket(cfg.sampling.gvm_samples_per_prompt if gvm else cfg.sampling.samples_per_prompt)


def _output_matrix_elements(mc: ModelConfig, mesh: dict[str, int]) -> int:
    """Elements of the output matrix one device holds (sharded as its parameter)."""
    return _local_elements(mc, mesh)["embed" if mc.tie_word_embeddings else "lm_head"]


def _output_matrix_copy_bytes(mc: ModelConfig, mesh: dict[str, int], c: int, p: int) -> int:
    """The output matrix cast to the compute dtype (a new array only when c != p), sharded as its parameter."""
    return 0 if c == p else _output_matrix_elements(mc, mesh) * c


def _subset_elements(mc: ModelConfig, subset: str) -> int:
    shapes = dict(_leaf_paths(param_shapes(mc)))
    total = 0
    for name in filter(None, (n.strip().replace(".", "/") for n in subset.split(","))):
        if name not in shapes:
            raise ValueError(f"sampling.gvm_param_subset names {name!r}, not a parameter ({', '.join(shapes)})")
        total += math.prod(shapes[name])
    return total


def _sampler_copy_bytes(mc: ModelConfig, mesh: dict[str, int], p: int, dtype: str) -> int:
    """Bytes per device of the sampler's copy of the policy in `sampling.dtype` ("" : none, it reads the
    trainer's tree): bf16 values, or int8 projection codes with f32 scales and the rest in p."""
    if not dtype:
        return 0
    local = sharded_param_elements(mc, mesh)[1]
    if dtype == "bfloat16":
        return local * 2
    return local * p - quantized_base_savings(mc, mesh, p, dtype)


def _sampling_bytes(cfg: RunConfig, mc: ModelConfig, mesh: dict[str, int], c: int, gvm: bool,
                    weights_cast: int = 0, layer_copy: int = 0) -> tuple[int, int, int, int, int]:
    """(rows of one sampler call, KV cache bytes per device, the sampling term without the policy copies, and its
    prefill and decode phases (the term is the larger)) of `cfg`'s sampler on `mesh` with keys, values and logits of
    the cache in `c` bytes; `weights_cast`: the policy cast to the compute dtype, which XLA hoists out of the loops;
    `layer_copy`: the stacked layer weights in c, which a decode loop holds sliced per layer where there is no cast
    (XLA hoists the slices out of the loop: the 1.5B LoRA preset's merged bf16 copy on one v5e chip, 2.3 GiB of
    [8960, 1536]-sized slices)."""
    loop_weights = max(weights_cast, layer_copy)
    batch_split = mesh["data"] * mesh["fsdp"]
    samples = max(cfg.sampling.gvm_stage1_samples, cfg.sampling.gvm_samples_per_prompt) if gvm \
        else cfg.sampling.samples_per_prompt
    # the sampler's first call at the worst case (every prompt max_prompt_tokens long), as `sampling.plan` plans it
    call = plan_calls(np.full(cfg.sampling.prompts_per_step, cfg.data.max_prompt_tokens),
                      np.full(cfg.sampling.prompts_per_step, samples), cfg.sampling.max_new_tokens,
                      engine=cfg.sampling.engine, row_multiple=batch_split,
                      max_rows_per_call=cfg.sampling.max_rows_per_call, max_slots=cfg.sampling.max_slots,
                      max_prompt_entries=cfg.sampling.max_prompt_entries,
                      every_prompt=bool(cfg.tools.env))[0]  # with tools.env the prompts keep their entries
    sample_rows = call.shapes.row_bucket
    local_rows = sample_rows // batch_split
    prompt_bucket = call.shapes.prompt_bucket
    response_bucket = call.shapes.new_token_bucket
    kv_bytes = mc.num_kv_heads * mc.head_dim * 2 * c  # one token's keys and values in one layer
    if cfg.sampling.engine == "continuous":
        local_slots = call.slots // batch_split
        local_prompts = call.prompt_entries
        kv_cache = sum((local_prompts * prompt_bucket + local_slots * slots) * kv_bytes
                       for slots in response_slots(mc, response_bucket))
        sampling = (kv_cache + local_slots * prompt_bucket * kv_bytes
                    + (local_prompts + 2 * local_slots) * mc.vocab_size * 4 + loop_weights)
        return sample_rows, kv_cache, sampling, sampling, sampling
    # One prompt entry per group of rows that continue the same prompt (`sampling.buckets.prompt_group_size`);
    # GVM's counts change from step to step, so it is counted at one entry per row, the most it can take.
    group = 1 if gvm else call.shapes.prompt_group
    # KV heads split over tensor where it divides them (`sampling.engine.cache_sharding`)
    head_split = mesh["tensor"] if mc.num_kv_heads % mesh["tensor"] == 0 else 1
    slots = response_slots(mc, response_bucket)
    kv_cache = sum((local_rows // group * prompt_bucket + local_rows * n) * kv_bytes for n in slots) // head_split
    logits = 2 * local_rows * mc.vocab_size * 4
    # Prefill: every device gathers the keys and values of the whole chunk of prompts before taking its rows'
    # (`engine.prefill_rows`' merge: a prompt's rows may sit on any device); a chunk of the call's prompts, split
    # over tensor by its KV heads or, where tensor cannot split them, by its prompts (XLA; `jaxrl-llm compile`,
    # Gemma 3 1B at tensor=4: [4, 1, 1024, 256] per layer of a 16-prompt chunk).
    chunk = prefill_chunk(prompt_bucket, max(1, sample_rows // samples), batch_split)
    gather_split = head_split if head_split > 1 or chunk % mesh["tensor"] else mesh["tensor"]
    prefill = kv_cache + chunk * prompt_bucket * len(slots) * kv_bytes // gather_split + logits + weights_cast
    # Decode: a tensor axis that cannot split the KV heads makes the loop copy the cache (XLA on TPU); a tiled
    # response cache (`buckets.response_tile_size`) copies the tile being written, in every full-attention layer;
    # the output layer's f32 logits come out for the call's rows with the vocabulary split over tensor.
    decode_copy = kv_cache if mesh["tensor"] > 1 and head_split == 1 else 0
    tile = response_tile_size(response_bucket)
    tiles = sum(1 for n in slots if n == response_bucket) * local_rows * tile * kv_bytes // head_split if tile else 0
    vocab_split = mesh["tensor"] if mc.vocab_size % mesh["tensor"] == 0 else 1
    decode = (kv_cache + decode_copy + tiles + max(logits, sample_rows * mc.vocab_size // vocab_split * 4)
              + loop_weights)
    return sample_rows, kv_cache, max(prefill, decode), prefill, decode


def estimate_memory(config: RunConfig, model_config: ModelConfig, mesh: dict[str, int] | str = "", *,
                    devices: int | None = None, remat: bool | None = None,
                    response_fill: float = 1.0, platform: str = "tpu") -> dict[str, Any]:
    """Bytes per device of `config` on a mesh (a {"data", "fsdp", "tensor"} dict, or a `train.mesh`
    string resolved for `devices`); see the module docstring for each term.

    `remat` overrides model.remat; `response_fill` scales the response length (1.0: every response
    reaches sampling.max_new_tokens). Returns a dict of byte counts (params, optimizer, reference, gradients,
    activations, logprob_residuals, train_step, kv_cache, sampling, gvm_norms, critic, critic_step, sampler_copy,
    sampler_version (one policy version an async sampler holds, 0 in sync), sampler_copies, sampler_peak (the
    sampler's own devices, 0 when it shares the trainer's), peak) plus param_count, row_length (packed training
    row), sample_rows (rows of one sampler call's state) and gvm_chunk_rows.
    """
    if isinstance(mesh, str):
        if devices is None:
            raise ValueError("estimate_memory: a mesh string needs `devices`")
        mesh = parse_mesh(mesh, devices)
    if set(mesh) != set(MESH_AXES) or any(int(v) < 1 for v in mesh.values()):
        raise ValueError(f"mesh must give a size >= 1 for each of {MESH_AXES}, got {mesh}")
    if not 0 < response_fill <= 1:
        raise ValueError(f"response_fill must be in (0, 1], got {response_fill}")
    mc, cfg = model_config, config
    p, c = _BYTES[cfg.model.param_dtype], _BYTES[cfg.model.compute_dtype]
    remat = cfg.model.remat if remat is None else remat
    policy = cfg.model.remat_policy
    batch_split = mesh["data"] * mesh["fsdp"]
    tensor = mesh["tensor"]
    kernel = attention_resolve(mc.replace(attention_impl=cfg.model.attention_impl,
                                          compute_dtype=cfg.model.compute_dtype), platform)
    fused = kernel != "xla"  # regrouped rows: a fused kernel's, or (xla_rows) XLA's dense causal block per row
    dense_rows = kernel == "xla_rows"

    count, local = sharded_param_elements(mc, mesh)
    params = local * p
    optimizer = 2 * local * p
    reference = params if needs_reference(cfg.algorithm) else 0
    trained, trained_bytes, merged_copy = local, p, 0
    if lora_enabled(cfg):  # frozen base; f32 adapters, their moments and gradients; merged base for sampling
        spec = LoraSpec(rank=max(cfg.lora.rank, 1), alpha=cfg.lora.alpha, targets=resolve_targets(cfg.lora.targets))
        trained, trained_bytes = sum(_local_elements(mc, mesh, adapter_shapes(mc, spec)).values()), 4
        params, optimizer, reference, merged_copy = params + trained * 4, 2 * trained * 4, 0, local * p
        if cfg.lora.base_dtype:  # projections as int8 / packed int4 codes + f32 per-output-channel scales
            params -= quantized_base_savings(mc, mesh, p, cfg.lora.base_dtype)

    gvm = cfg.sampling.allocation == "gvm"
    tiles = mc.replace(attention_block_size=cfg.model.attention_block_size,
                       attention_block_min_length=cfg.model.attention_block_min_length)
    responses_per_row = _whole_row_responses(cfg)
    response_len = max(1, int(math.ceil(cfg.sampling.max_new_tokens * response_fill)))
    prompt_len = cfg.data.max_prompt_tokens
    if cfg.optim.max_row_tokens > 0:  # rows of at most that many tokens, at least one response each
        fit = max(1, (cfg.optim.max_row_tokens - prompt_len) // response_len)
        responses_per_row = bucket(min(responses_per_row, fit))
        row_length = length_bucket(min(prompt_len + responses_per_row * response_len,
                                       max(cfg.optim.max_row_tokens, prompt_len + response_len)), ROW_SEQ_MULTIPLE)
    else:
        row_length = length_bucket(prompt_len + responses_per_row * response_len, ROW_SEQ_MULTIPLE)
    rows = -(-cfg.optim.micro_batch_size // batch_split)
    # the f32 accumulator and one micro-batch's gradient while the backward passes run; after them, XLA's update
    # temporaries: two more f32 copies (AdamW's new moments before they replace the old ones)
    accumulate, update = trained * 4 + trained * trained_bytes, 2 * trained * 4
    gradients = accumulate + update
    width = min(row_length, round_up(prompt_len + cfg.sampling.max_new_tokens, SPLASH_BLOCK))
    kept, working = _activation_bytes(mc, rows, row_length, tensor, c, remat, policy,
                                      tiles.attention_block_for(row_length),
                                      (responses_per_row, width, dense_rows) if fused else None)
    activations = kept + working
    output_copy = _output_matrix_copy_bytes(mc, mesh, c, p)
    keep_logits = not cfg.model.remat_logits
    head_elements = _output_matrix_elements(mc, mesh)
    # Scored positions: every slot (n x max_new_tokens), or the compact layout's L when that is shorter.
    scored = min(row_length, responses_per_row * cfg.sampling.max_new_tokens)
    logprob = _logprob_residual_bytes(mc, rows, scored, c, keep_logits, head_elements) + output_copy
    # The log-prob pass's backward runs before the layers': its residuals and a vocabulary chunk's logits are
    # gone when a layer's working set is made (the compiled train steps' buffer assignments)
    train_step = max(accumulate + kept + max(working, logprob), trained * 4 + update)

    dtype = cfg.sampling.dtype
    split_devices = cfg.rollouts.mode == "async" and cfg.rollouts.sampler_devices > 0
    sampler_mesh = (parse_mesh(cfg.rollouts.sampler_mesh, cfg.rollouts.sampler_devices) if split_devices
                    else mesh)
    sampler_copy = _sampler_copy_bytes(mc, mesh, p, dtype)  # made where the trainer's weights are
    # the trainer's weights cast to the compute dtype when the sampler reads them (no sampling.dtype copy) in
    # another: XLA hoists the casts out of the decode loop, a cast copy of the policy
    weights_cast = sharded_param_elements(mc, sampler_mesh)[1] * c if not dtype and p != c else 0
    # without a cast, a TPU decode loop's per-layer slices of the stacked layer weights (XLA hoists them too)
    layer_copy = sum(n for name, n in _local_elements(mc, sampler_mesh).items()
                     if name.startswith("layers/")) * c if not dtype and platform == "tpu" else 0
    sample_rows, kv_cache, sampling, sampling_prefill, sampling_decode = _sampling_bytes(
        cfg, mc, sampler_mesh, 2 if dtype == "bfloat16" else c, gvm, weights_cast, layer_copy)
    sampler_version = sampler_copies = sampler_peak = 0
    if cfg.rollouts.mode == "async":
        sampler_version = (_sampler_copy_bytes(mc, sampler_mesh, p, dtype)
                           or sharded_param_elements(mc, sampler_mesh)[1] * p)
        sampler_copies = (cfg.rollouts.max_staleness + 1) * sampler_version
    if split_devices:
        sampler_peak = sampler_copies + sampling
        sampling = merged_copy + sampler_copy  # the trainer's devices merge / cast before the transfer
    else:
        sampling += merged_copy + sampler_copy
        sampling_prefill += merged_copy + sampler_copy
        sampling_decode += merged_copy + sampler_copy

    gvm_norms = 0
    if gvm:
        # A chunk's rows are split over data x fsdp (train.gvm.per_sample_grad_norms rounds the chunk up to it).
        chunk_rows = -(-(cfg.sampling.gvm_rows_per_chunk or cfg.optim.micro_batch_size) // batch_split)
        # Unpacked rows hold every max_new_tokens column whatever the fill (train.rollouts.all_rows_batch), and
        # `train.logprobs.row_logprobs` scores all of them.
        full_len = cfg.sampling.max_new_tokens
        unpacked = round_up(cfg.data.max_prompt_tokens + full_len, ROW_SEQ_MULTIPLE)
        # Each device differentiates its own rows: the subset's per-sample gradient is whole (unsharded). A tied
        # embedding in the subset gets two before they are summed: the output layer's, made first (at the log-prob
        # pass's backward) in c, and the lookup's, made last, in p. The pass reads the policy cast to c (LoRA: the
        # merged copy, in p). Its phases as the train step's: the layers' backward beside the kept activations,
        # then the lookup's gradient with the embedding's f32 gradients, the activations gone (`jaxrl-llm
        # compile`: the 7B's peak is its f32 [152064, 3584] per-sample gradient; the tied 1.5B's a bf16
        # [rows, 151936, 1536] and an f32 [151936, 1536] one).
        names = {n.strip().replace(".", "/") for n in cfg.sampling.gvm_param_subset.split(",")}
        tied_subset = mc.tie_word_embeddings and "embed" in names
        head = chunk_rows * mc.vocab_size * mc.hidden_size * c if tied_subset else 0
        subset = chunk_rows * _subset_elements(mc, cfg.sampling.gvm_param_subset) * p
        lookup = chunk_rows * _subset_elements(mc, "embed") * p if "embed" in names else 0
        cast = local * c if c != p else 0
        gvm_kept, gvm_working = _activation_bytes(mc, chunk_rows, unpacked, tensor, c, remat, policy,
                                                  tiles.attention_block_for(unpacked),
                                                  (1, round_up(unpacked, SPLASH_BLOCK), dense_rows) if fused
                                                  else None)
        layers = gvm_kept + max(gvm_working, _logprob_residual_bytes(mc, chunk_rows, full_len, c, keep_logits,
                                                                     head_elements))
        gvm_norms = (merged_copy + head + cast + subset - lookup
                     + max(layers, lookup + chunk_rows * unpacked * mc.hidden_size * 4 * 2))

    critic = critic_step = 0
    if uses_critic(cfg):
        trunk = local - (_local_elements(mc, mesh)["lm_head"] if not mc.tie_word_embeddings else 0)
        head = (mc.hidden_size + 1) * 4
        critic = 3 * (trunk * p + head)
        critic_step = max(trunk * (4 + p) + 2 * head + activations, 3 * trunk * 4 + 2 * head)  # phases as above

    resident = params + optimizer + reference + critic + (0 if split_devices else sampler_copies)
    trainer_peak = resident + max(train_step, critic_step, sampling, gvm_norms)
    return {
        "mesh": dict(mesh), "micro_batch_size": cfg.optim.micro_batch_size,
        "param_count": count, "row_length": row_length, "sample_rows": sample_rows,
        "gvm_chunk_rows": (cfg.sampling.gvm_rows_per_chunk or cfg.optim.micro_batch_size) if gvm else 0,
        "params": params, "optimizer": optimizer, "reference": reference,
        "gradients": gradients, "activations": activations, "logprob_residuals": logprob, "train_step": train_step,
        "kv_cache": kv_cache, "sampling": sampling, "sampling_prefill": sampling_prefill,
        "sampling_decode": sampling_decode, "gvm_norms": gvm_norms, "critic": critic,
        "critic_step": critic_step, "sampler_copy": sampler_copy, "sampler_version": sampler_version,
        "sampler_copies": sampler_copies,
        "sampler_peak": sampler_peak, "peak": max(trainer_peak, sampler_peak),
    }


def _with_rows_per_call(config: RunConfig, rows: int) -> RunConfig:
    return dataclasses.replace(config, sampling=dataclasses.replace(config.sampling, max_rows_per_call=rows))


def fit_rows_per_call(config: RunConfig, model_config: ModelConfig, mesh: dict[str, int],
                      budget_bytes: int, platform: str = "tpu") -> tuple[dict[str, Any], int]:
    """The estimate and `sampling.max_rows_per_call` when the sampler's KV cache is what pushes the peak over
    `budget_bytes`: the configured value (0 = all rows) if it fits, else the largest power of two below it
    that fits, or, if none does, the one of least peak (one row per device at the least)."""
    est = estimate_memory(config, model_config, mesh, platform=platform)
    rows = config.sampling.max_rows_per_call
    if config.sampling.engine == "continuous":  # bounded by sampling.max_slots, not by rows per call
        return est, rows
    split = mesh["data"] * mesh["fsdp"]
    while est["peak"] > budget_bytes and est["sample_rows"] > split \
            and est["sampling"] > max(est["train_step"], est["critic_step"], est["gvm_norms"]):
        halved = bucket_size(est["sample_rows"]) // 2  # halves the rows of one call
        smaller = estimate_memory(_with_rows_per_call(config, halved), model_config, mesh, platform=platform)
        if smaller["sample_rows"] >= est["sample_rows"]:  # the row bucket's floor: no fewer rows per call
            break
        est, rows = smaller, halved
    return est, rows


def suggest_layout(config: RunConfig, model_config: ModelConfig, devices: int,
                   budget_bytes: int | None = None, platform: str = "tpu") -> tuple[dict[str, Any], dict[str, Any]]:
    """The `fsdp x tensor` layout (tensor a power of two dividing the devices, at most 8, and dividing the
    heads) with one packed row per device and micro-batch (micro_batch_size = fsdp) of least estimated peak.
    With `budget_bytes`, each layout first gets the `sampling.max_rows_per_call` of `fit_rows_per_call`, and
    when no layout fits and `optim.max_row_tokens` is unset, packed rows of half, a quarter, ... of a prompt's
    responses are tried (`optim.max_row_tokens` = prompt + that many full responses; the first that fits).
    Returns (estimate, {"train.mesh": ..., "optim.micro_batch_size": ...[, "sampling.max_rows_per_call": ...]
    [, "optim.max_row_tokens": ...]} overrides; the last two only where they differ from the config's)."""
    best = _least_peak_layout(config, model_config, devices, budget_bytes, platform)
    if budget_bytes is None or best[0]["peak"] <= budget_bytes or config.optim.max_row_tokens > 0:
        return best
    per_row = _whole_row_responses(config) // 2
    while per_row >= 1:
        tokens = config.data.max_prompt_tokens + per_row * config.sampling.max_new_tokens
        split = dataclasses.replace(config, optim=dataclasses.replace(config.optim, max_row_tokens=tokens))
        est, overrides = _least_peak_layout(split, model_config, devices, budget_bytes, platform)
        if est["peak"] <= budget_bytes:
            return est, {**overrides, "optim.max_row_tokens": tokens}
        per_row //= 2
    return best


def _least_peak_layout(config: RunConfig, model_config: ModelConfig, devices: int,
                       budget_bytes: int | None, platform: str) -> tuple[dict[str, Any], dict[str, Any]]:
    best = None
    tensor = 1
    while tensor <= min(8, devices):
        if devices % tensor == 0 and model_config.num_heads % tensor == 0:
            fsdp = devices // tensor
            cfg = dataclasses.replace(config, optim=dataclasses.replace(config.optim, micro_batch_size=fsdp))
            mesh = {"data": 1, "fsdp": fsdp, "tensor": tensor}
            if budget_bytes is None:
                est = estimate_memory(cfg, model_config, mesh, platform=platform)
                rows = config.sampling.max_rows_per_call
            else:
                est, rows = fit_rows_per_call(cfg, model_config, mesh, budget_bytes, platform)
            if best is None or est["peak"] < best[0]["peak"]:
                overrides = {"train.mesh": f"fsdp={fsdp}" + (f",tensor={tensor}" if tensor > 1 else ""),
                             "optim.micro_batch_size": fsdp}
                if rows != config.sampling.max_rows_per_call:
                    overrides["sampling.max_rows_per_call"] = rows
                best = (est, overrides)
        tensor *= 2
    return best
