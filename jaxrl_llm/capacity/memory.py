"""Per-device memory estimate of a training run, from its config alone (no devices, no arrays).

Every term counts what jaxrl_llm itself allocates, per device of a `data x fsdp x tensor` mesh
(c = bytes of model.compute_dtype, p = bytes of model.param_dtype):

  params      sum over parameter leaves of size / (mesh axes the sharding rules split it over) x p
              (`models.sharding.partition_rules`; an axis that does not divide a dimension replicates it)
  optimizer   AdamW first and second moments, kept by optax in the parameters' dtype: 2 x params
  reference   a frozen copy of params when the KL term or PRL shaping needs a reference policy
  teacher     on-policy distillation's frozen teacher (distill.teacher): its elements per device (the policy's
              shape unless estimate_memory is given the teacher's config) x 4 (float32; "policy": p), 2 (bfloat16),
              or int8's codes and scales; 0 when it is a LoRA run's base itself (teacher policy, no adapter, float32)
  teacher pass  the teacher's packed pass (distill.teacher) beyond its weights, on one micro-batch of the teacher's
              model (its D, V, heads; c_T = 2 with teacher_dtype bfloat16, else c): the decoder's output
              rows x L x D_T x c_T, beside the larger of its two phases (XLA frees the layers' buffers before the
              vocabulary sweep): one layer's full-attention scores rows x H_t x L^2 x (4 + c_T) (the xla path
              without tiles; 0 otherwise), and the sweep over K scored positions per row: mode sampled, the log-prob
              pass's forward, which keeps every vocabulary chunk's f32 logits as the custom VJP's residuals
              (rows x K x (D_T x c_T + 12 + V x 4); one chunk's with model.remat_logits), mode topk one chunk's f32
              logits and their top_k copy, the hidden state and the running and merged top-K values and ids
              (rows x K x (D_T x c_T + 2 min(V, 8192) x 4 + 4 top_k x 8)); plus the pass's output for the step's
              rows (optim.mini_batches x the mini-batch's), replicated on every device: rows x S x R x 4 (log-probs)
              or x top_k x 8 (ids and log-probs). XLA's (CPU) temporaries and outputs of a tiny teacher's pass
              (D 64, one row of 320 tokens, 240 scored) over this: 1.06 (V 32768, sampled), 0.99 (V 32768, topk),
              1.05 (V 50000, topk, 2 rows) and 1.10 (V 512, sampled: the attention scores dominate); 1.15 for
              configs/distill_demo.yaml's topk teacher (8 rows of 448 tokens, V 49152). A GPU's forward holds more:
              `jaxrl-llm compile` of that config for h200-1 gives 0.67 GiB of temporaries against 0.11 (topk) and
              0.29 (sampled), and the same 0.67 for the policy's own log-prob pass (not modelled here)
  teacher top-K  (distill.mode topk) the teacher's top_k ids (int32) and log-probs (f32) of every response position
              of a train-step mini-batch, an argument of the train step: mini-batch rows / (data x fsdp x expert)
              x S x R x top_k x 8
  batch routes  (a model with experts) the sampler's routes a train-step mini-batch carries (`TrainBatch.routes`,
              the packed row's every token; a batch the sampler recorded none for carries -1s on a mesh):
              mini-batch rows / (data x fsdp x expert) x L x sparse layers x k x r, r = bytes of
              `models.moe.route_dtype` (1: int8 up to 128 experts), an argument of the train step
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
                prefill  + the keys and values of one prefill chunk of prompts (the plan's prompts per prefill,
                         which every call of the step shares: min(the step's prompts' bucket, floor_pow2(4096 /
                         P_bucket)), rounded up to data x fsdp) in every layer, gathered on every device by the
                         merge into rows: chunk x P_bucket x layers x kv_heads_t x head_dim x 2 x c (split over
                         tensor by prompts where tensor does not divide the KV heads)
                decode   + the cache copy above; with a tiled response cache (`buckets.response_tile_size`) the
                         written tile of every full-attention layer, rows x tile x kv_heads_t x head_dim x 2 x c;
                         the logits are the larger of the two row buffers and the call's rows x V / tensor f32
                         (the output layer's product gives every row's logits with the vocabulary split); on a
                         TPU without the cast copy, the stacked layer weights sliced per layer in c (XLA hoists
                         the slices out of the loop); and over an `expert` axis of s > 1 devices that splits a
                         mixture's E experts, sampler experts: every sparse layer's experts gathered over that axis,
                         all held at once, sparse layers x E x (2 D_f lanes(F_t) + F_t lanes(D_f)) x c, D_f = D /
                         fsdp and F_t = F_e / tensor where they divide, lanes(n) = n rounded up to 128 on a TPU (the
                         minor dimension of gate and up [E, D_f, F_t] and of down [E, F_t, D_f] on its 128 lanes), n
                         elsewhere. The decode is traced without the mesh, so `moe.expert_mlp` takes its ragged_dot
                         path, whose groups XLA cannot split: it all-gathers each layer's experts over the expert
                         axis inside the loop, every layer's at the top of each step. The tile copies and the logits
                         are not live then, so decode counts the larger of the two (tiles + logits, gathered
                         experts). `jaxrl-llm compile` of Qwen3-30B-A3B for v5p-64 (fsdp=4,expert=2,tensor=4): two
                         bf16 [128, 512, 192] (F_t 192 on 256 lanes: 32 MiB each) and one [128, 192, 512] (24 MiB)
                         a layer, 4.13 GiB for 48 layers; XLA's decode peak 14.65 GiB against 14.54 (11.05 without
                         them), 5.08 against 5.00 with its first 16 layers, 2.65 against 2.62 with 8; with 4 layers
                         XLA gathers one layer at a time (1.24 against 1.43)
              With sampling.engine=continuous: layers x (C x P_bucket + S x R_bucket) x
              kv_heads x head_dim x 2 x c for S decode slots (`sampling.buckets.slot_count`) and
              C = `sampling.buckets.prompt_entries` prompt-cache entries (one per prompt of the step, at
              most S + one prefill chunk of floor_pow2(4096 / P_bucket) prompts, or
              `sampling.max_prompt_entries` where lower; with tools.env, one per prompt of the step rounded up
              to the chunk: tool conversations keep their prompt's entry across turns), plus one layer's prompt
              keys/values gathered for the slots (S x P_bucket x kv_heads x head_dim x 2 x c) and (C + 2 S) x V
              f32 logits; the S slots are split over data x fsdp as rows are, every device holds the C entries
  sampler routes  (a model with experts; either engine records them whatever model.routing_replay) the experts
              each prompt and response token chose, sparse layers x k x r per token, held through the call: the
              static engine's rows / (data x fsdp x expert) x (P_bucket + R_bucket), plus in the prefill one chunk's
              prompts' chunk x P_bucket gathered on every device (as its keys and values); the continuous engine's
              every sample's and queue prompt's, split over data x fsdp x expert as its slots: (rows x R_bucket
              + (queue bucket + chunk) x P_bucket) / (data x fsdp x expert); counted in sampling
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

  peak = params + optimizer + reference + critic + teacher
         + max(train step + teacher top-K + batch routes, critic step, sampling, gvm norms, teacher pass)

Mixtures of experts (`models.moe`; E experts, k per token, expert width F_e split over tensor where it divides it,
D whole): the parameters are `models.model.param_shapes`' under the partition rules, so a sparse layer's
router [D, E], experts 3 x E x D x F_e (gate, up [E, D, F_e], down [E, F_e, D]; gpt-oss adds the router's bias [E]
and the experts' [E, F_e] x 2 and [E, D]) and gpt-oss's attention sinks [H] count in params, optimizer and the
gradients like every other leaf, E split over the mesh's `expert` axis where it has one; a model mixing dense and
sparse layers stores both blocks in every layer (the unused one zeros). In the train step a sparse layer's block
replaces the dense one's 4 F per token (`activations.feed_forward_bytes`): per token the router's f32 logits
E x 4, the chosen ids and weights k x 8, the sorted (token, expert) rows, the grouped matmuls' outputs and each
token's k outputs in f32, k D x (2 c + 4), and the hidden (gate, up, SiLU, product) 4 k F_e x c; its backward
the gradients k (D + 2 F_e) x c; on a CPU the tiled grouped matmul's padded rows and per-tile residuals instead
of the hidden. Without an `expert` axis the grouped rows are every data x fsdp device's (XLA gathers them: a
ragged_dot's groups cannot be split), M = N k x data x fsdp on each device; over an expert axis of s devices
`models.expert_parallel`'s worst-case M = s N min(k, E / s) (`activations.feed_forward_bytes`). Without remat
each layer keeps its own kind's terms (a dense layer among sparse ones its dense
block's); with remat one layer's working set is its kind's, or, where the kinds mix, the sparse block's and the
dense block's together (the layer's lax.cond holds both branches' buffers: XLA's CPU buffer assignment). The
sampler's prefill adds a sparse layer's forward buffers for the chunk's tokens on a device (chunk / (data x fsdp)
x P_bucket), its decode for the call's rows on a device (and, over an expert axis, every sparse layer's experts
gathered: sampler experts, in sampling's decode).
On a GPU (platform "gpu") where model.moe_impl resolves to ragged_dot (`models.moe.resolve`: auto does), XLA
rewrites each ragged_dot into a dense batched dot over every expert, each row masked to zero outside its own
expert, and one layer's backward pass holds these [E', M, D'] and [E', M, F'] buffers (and their [M, E', .]
transposes) besides the terms above (`_Inputs.dense_ragged_dot`, added to the layer's working set):
  dense ragged_dot  E' x M x max(3 D', 6 F' + 2 D') x c
with M the grouped rows above, and without an expert axis E' = E, D' = D / fsdp and F' = F_e / tensor where they
divide (the rewritten dots are split as the expert weights are); over an expert axis of s devices, inside
`models.expert_parallel`'s shard_map, E' = E / s, M = s N min(k, E / s) and D' = D, F' = F_e whole. The two are
the backward pass's two phases (read from XLA's buffer assignments): the masked inputs of gate and up and their
dgrad's [M, E', D'] (3 D'), and the gate, up, SiLU and down buffers over F' beside two D' ones (6 F' + 2 D').
`jaxrl-llm compile` of Qwen3-30B-A3B for h200-8 (fsdp=2,tensor=4, micro-batch 2; E 128, M 458,752, D' 1024,
F' 192): three bf16 [128, 458752, 1024] buffers of 112 GiB at once, XLA's train-step peak 415.56 GiB a GPU against
this estimate's 435.8 for the program (85.8 without the term; XLA's rematerialisation pass ran there, over its
memory limit). Tiny MoEs on h200-8 (bf16, 2 layers): XLA's peak over the estimate 0.94 to 0.98 where D' or F'
dominates (D' 1024, F' 192; D' 32, F' 192; expert=2), 1.22 to 1.25 with D' 128 and F' 24 (XLA makes four [E', M,
D'] outputs in one fusion there), and 0.63 to 0.98 on one device with D and F_e alike (64 to 128).

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
"gpu", "cpu") picks the attention path as `models.attention.resolve` does (a target's platform in
`capacity.chips.TARGETS`).
The XLA-specific terms (update temporaries, the embedding's f32 gradients, the prefill's gathered chunk, the
decode's tile copies, logits and weight slices, the policy cast, the phases of the train step and of GVM's norm
pass) were read from the compiled programs' buffer assignments and live ranges (`jaxrl-llm compile` for
v5litepod-64, v4-32 and one v5e chip, 2026-11-28; the decode's gathered experts for v5p-64, 2026-11-29). Rows
per device = ceil(rows / (data x fsdp)). Lengths are the worst case: every response reaches max_new_tokens (set
`response_fill` below 1 for an average fill). Against XLA's own peak of each compiled program
(`memory_analysis().peak_memory_in_bytes`, what the TPU compiler holds a program to) over 22 preset-slices in
docs/launch.md: the train step -5% to +10%, the sampler's prefill -5% to +9%, decode -8% to +10%, GVM's norms -7% to
0%; leave ~10-15% of HBM free (the compiler lets a program use 15.75 GiB of a v5e chip's 16, 30.75 of a v4's 32:
`capacity.chips.CHIPS`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxrl_llm.capacity.chips import GIB, TARGETS  # noqa: F401 (the planners' names)
from jaxrl_llm.capacity.activations import (LOGPROB_CHUNK, activation_bytes, feed_forward_bytes,
                                            logprob_residual_bytes, split_features)
from jaxrl_llm.capacity.elements import (local_elements, output_matrix_copy_bytes, output_matrix_elements,
                                         quantized_base_savings, sampler_copy_bytes, sharded_param_elements,
                                         subset_elements)
from jaxrl_llm.capacity.known_models import KNOWN_MODELS, model_config_for  # noqa: F401 (the planners' names)
from jaxrl_llm.models.attention import SPLASH_BLOCK
from jaxrl_llm.models.attention import resolve as attention_resolve
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.lora import adapter_shapes
from jaxrl_llm.models.moe import resolve as moe_resolve
from jaxrl_llm.models.moe import route_dtype, route_shape
from jaxrl_llm.run.config import RunConfig, uses_critic
from jaxrl_llm.run.shapes import ROW_SEQ_MULTIPLE, StepShapes, parse_mesh, step_shapes  # noqa: F401
from jaxrl_llm.sampling.buckets import response_tile_size, round_up
from jaxrl_llm.sampling.decoder import response_slots
from jaxrl_llm.train.algorithms import needs_reference

_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What every term reads: the run config, the traced model config, the step's shapes, bytes of the parameter
    (p) and compute (c) dtypes, whether layers are rematerialised, and the target's platform."""

    cfg: RunConfig
    mc: ModelConfig
    shapes: StepShapes
    p: int
    c: int
    remat: bool
    platform: str

    @property
    def kernel(self) -> str:
        """The attention path of the train step (`models.attention.resolve`)."""
        return attention_resolve(self.mc.replace(attention_impl=self.cfg.model.attention_impl,
                                                 compute_dtype=self.cfg.model.compute_dtype), self.platform)

    def activations(self, rows: int, length: int, slots: int, width: int) -> tuple[int, int]:
        """`activation_bytes` (kept, working) of `rows` rows of `length` tokens on the trainer's tensor axis; a fused
        kernel's regrouped rows are `slots` rows of `width` tokens each."""
        kernel, cfg = self.kernel, self.cfg
        tiles = self.mc.replace(attention_block_size=cfg.model.attention_block_size,
                                attention_block_min_length=cfg.model.attention_block_min_length)
        kept, working = activation_bytes(self.mc, rows, length, self.shapes.mesh["tensor"], self.c, self.remat,
                                         cfg.model.remat_policy, tiles.attention_block_for(length),
                                         (slots, width, kernel == "xla_rows") if kernel != "xla" else None,
                                         tiles=moe_resolve(cfg.model.moe_impl, self.platform) == "tiles",
                                         expert=self.shapes.mesh.get("expert", 1),
                                         gathered=self.shapes.mesh["data"] * self.shapes.mesh["fsdp"])
        return kept, working + self.dense_ragged_dot(rows * length)

    def dense_ragged_dot(self, tokens: int) -> int:
        """What XLA's GPU rewrite of a sparse layer's three ragged_dots into dense batched dots over every expert
        holds at once in one layer's backward pass, for `tokens` tokens of a device (module docstring, mixtures of
        experts): E' x M x max(3 D', 6 F' + 2 D') x c; 0 off a GPU, with the tiles path, or for a dense model."""
        mc, mesh = self.mc, self.shapes.mesh
        if (self.platform != "gpu" or not any(mc.sparse_layers())
                or moe_resolve(self.cfg.model.moe_impl, self.platform) != "ragged_dot"):
            return 0
        experts, k, shards = mc.num_experts, mc.num_experts_per_tok, mesh.get("expert", 1)
        d, f = mc.hidden_size, mc.expert_intermediate_size
        if shards > 1:  # inside expert_parallel's shard_map: a device's E / s experts whole, its s C received rows
            experts //= shards
            rows = shards * tokens * min(k, experts)
        else:  # every data x fsdp device's pairs (as the grouped rows), D split over fsdp and F over tensor
            rows = tokens * k * mesh["data"] * mesh["fsdp"]
            d, f = split_features(d, mesh["fsdp"]), split_features(f, mesh["tensor"])
        return experts * rows * max(3 * d, 6 * f + 2 * d) * self.c

    def sparse_block(self, tokens: int) -> int:
        """A sparse layer's forward buffers for `tokens` tokens of a device (`feed_forward_bytes`): router logits,
        sorted rows, the grouped matmul's hidden; 0 for a dense model."""
        if not any(self.mc.sparse_layers()):
            return 0
        tiles = moe_resolve(self.cfg.model.moe_impl, self.platform) == "tiles"
        mesh = self.shapes.sampler_mesh
        return feed_forward_bytes(self.mc, tokens, mesh["tensor"], self.c, True, tiles, mesh.get("expert", 1),
                                  mesh["data"] * mesh["fsdp"])[0]

    @property
    def route_bytes(self) -> int:
        """Bytes of one token's recorded routes: sparse layers x k expert ids in `moe.route_dtype`; 0 for a dense
        model."""
        return math.prod(route_shape(self.mc)) * np.dtype(route_dtype(self.mc.num_experts)).itemsize

    def logprob_residuals(self, rows: int, scored: int) -> int:
        """`logprob_residual_bytes` of `rows` rows of `scored` scored positions."""
        return logprob_residual_bytes(self.mc, rows, scored, self.c, not self.cfg.model.remat_logits,
                                      output_matrix_elements(self.mc, self.shapes.mesh))


def _policy_terms(x: _Inputs) -> dict[str, int]:
    """params, optimizer, reference; what trains (elements per device and their bytes: the policy in p, LoRA's
    adapters in f32); LoRA's merged copy of the base the sampler and GVM read; the policy's elements per device."""
    mesh, p = x.shapes.mesh, x.p
    count, local = sharded_param_elements(x.mc, mesh)
    terms = {"param_count": count, "local": local, "params": local * p, "optimizer": 2 * local * p,
             "reference": local * p if needs_reference(x.cfg.algorithm) else 0, "trained": local,
             "trained_bytes": p, "merged_copy": 0}
    if x.shapes.lora is not None:  # frozen base; f32 adapters, their moments and gradients; merged base for sampling
        trained = sum(local_elements(x.mc, mesh, adapter_shapes(x.mc, x.shapes.lora)).values())
        params = local * p + trained * 4
        if x.cfg.lora.base_dtype:  # projections as int8 / packed int4 codes + f32 per-output-channel scales
            params -= quantized_base_savings(x.mc, mesh, p, x.cfg.lora.base_dtype)
        terms.update(params=params, optimizer=2 * trained * 4, reference=0, trained=trained, trained_bytes=4,
                     merged_copy=local * p)
    return terms


def _teacher_term(x: _Inputs, teacher_config: ModelConfig | None) -> int:
    """Bytes per device of distill.teacher's weights (module docstring); 0 without a teacher."""
    d = x.cfg.distill
    if not d.teacher:
        return 0
    if d.teacher == "policy" and x.shapes.lora is not None and not d.adapter and d.teacher_dtype == "float32":
        return 0  # the base's own buffers
    mc = teacher_config or x.mc
    _, local = sharded_param_elements(mc, x.shapes.mesh)
    width = {"float32": x.p if d.teacher == "policy" else 4, "bfloat16": 2, "int8": 4}[d.teacher_dtype]
    saved = quantized_base_savings(mc, x.shapes.mesh, 4, "int8") if d.teacher_dtype == "int8" else 0
    return local * width - saved


def _teacher_pass_term(x: _Inputs, teacher_config: ModelConfig | None) -> int:
    """Bytes per device the teacher's packed pass holds beyond its weights (module docstring); 0 without a teacher."""
    d, sh, model = x.cfg.distill, x.shapes, x.cfg.model
    if not d.teacher:
        return 0
    mc = teacher_config or x.mc
    c = 2 if d.teacher_dtype == "bfloat16" else x.c
    rows, length = sh.rows_per_device, sh.row_length
    scored = min(length, sh.responses_per_row * x.cfg.sampling.max_new_tokens)
    tiled = mc.replace(attention_block_size=model.attention_block_size,
                       attention_block_min_length=model.attention_block_min_length).attention_block_for(length)
    heads = split_features(mc.num_heads, sh.mesh["tensor"])
    scores = rows * heads * length * length * (4 + c) if x.kernel == "xla" and tiled is None else 0
    if d.mode == "topk":
        sweep = rows * scored * (mc.hidden_size * c + 2 * min(mc.vocab_size, LOGPROB_CHUNK) * 4 + 4 * d.top_k * 8)
        per_position = d.top_k * 8
    else:  # the log-prob pass's forward keeps what its custom VJP would read back (no head gradient pieces)
        sweep = logprob_residual_bytes(mc, rows, scored, c, not model.remat_logits, 0)
        per_position = 4
    outputs = x.cfg.optim.mini_batches * sh.mini_batch_rows * sh.responses_per_row * x.cfg.sampling.max_new_tokens
    return rows * length * mc.hidden_size * c + max(scores, sweep) + outputs * per_position


def _teacher_topk_term(x: _Inputs) -> int:
    """Bytes per device of the teacher's top-K ids and log-probs in a train-step mini-batch (module docstring)."""
    d, sh = x.cfg.distill, x.shapes
    if not d.teacher or d.mode != "topk":
        return 0
    return sh.mini_batch_rows_per_device * sh.responses_per_row * x.cfg.sampling.max_new_tokens * d.top_k * (4 + 4)


def _batch_routes_term(x: _Inputs) -> int:
    """Bytes per device of the sampler's routes a train-step mini-batch carries (`TrainBatch.routes`, module
    docstring); 0 for a dense model."""
    sh = x.shapes
    return sh.mini_batch_rows_per_device * sh.row_length * x.route_bytes


def _sampler_routes_term(x: _Inputs) -> dict[str, int]:
    """The sampler's recorded routes (module docstring): {"held": its state's buffers on a device, "prefill": the
    static engine's routes of one prefill chunk, gathered on every device by the merge}; 0s for a dense model."""
    call, split, per_token = x.shapes.sampler_call, x.shapes.sampler_row_split, x.route_bytes
    plan = call.shapes
    if x.cfg.sampling.engine == "continuous":  # every sample's and every queue prompt's, split as the slots are
        held = (plan.row_bucket * plan.new_token_bucket
                + (call.queue_bucket + plan.prompts_per_prefill) * plan.prompt_bucket) // split * per_token
        return {"held": held, "prefill": 0}
    held = plan.row_bucket // split * (plan.prompt_bucket + plan.new_token_bucket) * per_token
    return {"held": held, "prefill": plan.prompts_per_prefill * plan.prompt_bucket * per_token}


def _train_step_terms(x: _Inputs, policy: dict[str, int]) -> dict[str, int]:
    """gradients, activations, logprob_residuals and the train step's peak of its phases (module docstring)."""
    sh, cfg = x.shapes, x.cfg
    trained = policy["trained"]
    # the f32 accumulator and one micro-batch's gradient while the backward passes run; after them, XLA's update
    # temporaries: two more f32 copies (AdamW's new moments before they replace the old ones)
    accumulate, update = trained * 4 + trained * policy["trained_bytes"], 2 * trained * 4
    width = min(sh.row_length, round_up(cfg.data.max_prompt_tokens + cfg.sampling.max_new_tokens, SPLASH_BLOCK))
    kept, working = x.activations(sh.rows_per_device, sh.row_length, sh.responses_per_row, width)
    # Scored positions: every slot (n x max_new_tokens), or the compact layout's L when that is shorter.
    scored = min(sh.row_length, sh.responses_per_row * cfg.sampling.max_new_tokens)
    logprob = x.logprob_residuals(sh.rows_per_device, scored) + output_matrix_copy_bytes(x.mc, sh.mesh, x.c, x.p)
    # The log-prob pass's backward runs before the layers': its residuals and a vocabulary chunk's logits are
    # gone when a layer's working set is made (the compiled train steps' buffer assignments)
    return {"gradients": accumulate + update, "activations": kept + working, "logprob_residuals": logprob,
            "train_step": max(accumulate + kept + max(working, logprob), trained * 4 + update)}


def _continuous_sampling(x: _Inputs, c: int, loop_weights: int) -> dict[str, int]:
    """The continuous engine's KV cache of S slots and C prompt entries, one layer's prompt keys and values gathered
    for the slots, (C + 2 S) x V f32 logits and the loop's weights (module docstring, sampling)."""
    mc, call, split = x.mc, x.shapes.sampler_call, x.shapes.sampler_row_split
    kv_bytes = mc.num_kv_heads * mc.head_dim * 2 * c  # one token's keys and values in one layer
    local_slots, prompts = call.slots // split, call.prompt_entries
    prompt_bucket = call.shapes.prompt_bucket
    kv_cache = sum((prompts * prompt_bucket + local_slots * slots) * kv_bytes
                   for slots in response_slots(mc, call.shapes.new_token_bucket))
    routes = _sampler_routes_term(x)["held"]  # the recorded experts of every sample and queue prompt
    sampling = (kv_cache + local_slots * prompt_bucket * kv_bytes + (prompts + 2 * local_slots) * mc.vocab_size * 4
                + loop_weights + x.sparse_block(local_slots) + routes)
    return {"kv_cache": kv_cache, "sampler_routes": routes, "sampler_experts": 0, "sampling": sampling,
            "sampling_prefill": sampling, "sampling_decode": sampling}


def _gathered_experts(x: _Inputs, c: int) -> int:
    """Bytes per device of every sparse layer's experts gathered over the sampler mesh's `expert` axis, which the
    static decode holds at the start of each step (module docstring, decode); 0 for a dense model, without an expert
    axis, or where it cannot split the experts (the rules then keep them whole on every device)."""
    mc, mesh = x.mc, x.shapes.sampler_mesh
    shards, sparse = mesh.get("expert", 1), sum(mc.sparse_layers())
    if shards == 1 or not sparse or mc.num_experts % shards:
        return 0
    d, f = split_features(mc.hidden_size, mesh["fsdp"]), split_features(mc.expert_intermediate_size, mesh["tensor"])

    def lanes(n: int) -> int:  # a TPU buffer's minor dimension on its tiles of 128 lanes
        return round_up(n, 128) if x.platform == "tpu" else n

    # gate and up [E, D, F] laid out with F minor for the grouped matmul, down [E, F, D]
    return sparse * mc.num_experts * (2 * d * lanes(f) + f * lanes(d)) * c


def _static_sampling(x: _Inputs, c: int, weights_cast: int, layer_copy: int) -> dict[str, int]:
    """The static engine's call: its KV cache and the larger of the prefill and decode phases (module docstring,
    sampling); `weights_cast` / `layer_copy`: the policy cast to c, or the stacked layer weights sliced per layer."""
    mc, sh, mesh = x.mc, x.shapes, x.shapes.sampler_mesh
    call, split = sh.sampler_call.shapes, sh.sampler_row_split
    local_rows = call.row_bucket // split
    kv_bytes = mc.num_kv_heads * mc.head_dim * 2 * c  # one token's keys and values in one layer
    # KV heads split over tensor where it divides them (`sampling.engine.cache_sharding`)
    head_split = mesh["tensor"] if mc.num_kv_heads % mesh["tensor"] == 0 else 1
    slots = response_slots(mc, call.new_token_bucket)
    kv_cache = sum((local_rows // sh.prompt_group * call.prompt_bucket + local_rows * n) * kv_bytes
                   for n in slots) // head_split
    logits = 2 * local_rows * mc.vocab_size * 4
    # Prefill: every device gathers the keys and values of the whole chunk of prompts before taking its rows'
    # (`engine.prefill_rows`' merge: a prompt's rows may sit on any device); a chunk of the call's prompts, split
    # over tensor by its KV heads or, where tensor cannot split them, by its prompts (XLA; `jaxrl-llm compile`,
    # Gemma 3 1B at tensor=4: [4, 1, 1024, 256] per layer of a 16-prompt chunk).
    chunk = call.prompts_per_prefill  # the plan's: every call of the step prefills as many prompts at a time
    gather_split = head_split if head_split > 1 or chunk % mesh["tensor"] else mesh["tensor"]
    # a sparse layer's routing buffers for the prefill chunk's tokens on the device, and for the decode step's rows
    routed = x.sparse_block(-(-chunk // split) * call.prompt_bucket)
    routes = _sampler_routes_term(x)  # the recorded experts: each row's, and the prefill chunk's gathered
    prefill = (kv_cache + chunk * call.prompt_bucket * len(slots) * kv_bytes // gather_split + logits + weights_cast
               + routed + routes["held"] + routes["prefill"])
    # Decode: a tensor axis that cannot split the KV heads makes the loop copy the cache (XLA on TPU); a tiled
    # response cache (`buckets.response_tile_size`) copies the tile being written, in every full-attention layer;
    # the output layer's f32 logits come out for the call's rows with the vocabulary split over tensor. Over an
    # expert axis every sparse layer's gathered experts are held at the step's start, when neither is (phases).
    decode_copy = kv_cache if mesh["tensor"] > 1 and head_split == 1 else 0
    tile = response_tile_size(call.new_token_bucket)
    tiles = sum(1 for n in slots if n == call.new_token_bucket) * local_rows * tile * kv_bytes // head_split \
        if tile else 0
    vocab_split = mesh["tensor"] if mc.vocab_size % mesh["tensor"] == 0 else 1
    logits_out = max(logits, call.row_bucket * mc.vocab_size // vocab_split * 4)
    gathered = _gathered_experts(x, c)
    decode = (kv_cache + decode_copy + max(tiles + logits_out, gathered) + max(weights_cast, layer_copy)
              + x.sparse_block(local_rows) + routes["held"])
    return {"kv_cache": kv_cache, "sampler_routes": routes["held"], "sampler_experts": gathered,
            "sampling": max(prefill, decode), "sampling_prefill": prefill, "sampling_decode": decode}


def _sampler_terms(x: _Inputs, policy: dict[str, int]) -> dict[str, int]:
    """sample_rows, kv_cache, sampling (and its prefill and decode phases) on the trainer's devices, sampler_copy,
    sampler_version, sampler_copies and sampler_peak (the sampler's own devices; 0 when it shares the trainer's)."""
    cfg, mc, sh, p, c = x.cfg, x.mc, x.shapes, x.p, x.c
    dtype, mesh = cfg.sampling.dtype, sh.sampler_mesh
    copy = sampler_copy_bytes(mc, sh.mesh, p, dtype)  # made where the trainer's weights are
    # the trainer's weights cast to the compute dtype when the sampler reads them (no sampling.dtype copy) in
    # another: XLA hoists the casts out of the decode loop, a cast copy of the policy
    weights_cast = sharded_param_elements(mc, mesh)[1] * c if not dtype and p != c else 0
    # without a cast, a TPU decode loop's per-layer slices of the stacked layer weights (XLA hoists them too)
    layer_copy = sum(n for name, n in local_elements(mc, mesh).items()
                     if name.startswith("layers/")) * c if not dtype and x.platform == "tpu" else 0
    cache_c = 2 if dtype == "bfloat16" else c
    terms = (_continuous_sampling(x, cache_c, max(weights_cast, layer_copy)) if cfg.sampling.engine == "continuous"
             else _static_sampling(x, cache_c, weights_cast, layer_copy))
    terms.update(sample_rows=sh.sampler_call.shapes.row_bucket, sampler_copy=copy, sampler_version=0,
                 sampler_copies=0, sampler_peak=0)
    if cfg.rollouts.mode == "async":
        version = sampler_copy_bytes(mc, mesh, p, dtype) or sharded_param_elements(mc, mesh)[1] * p
        terms.update(sampler_version=version, sampler_copies=(cfg.rollouts.max_staleness + 1) * version)
    made = policy["merged_copy"] + copy  # the merged or cast copy, made on the trainer's devices
    if sh.sampler_devices:  # the trainer's devices merge / cast before the transfer
        terms.update(sampler_peak=terms["sampler_copies"] + terms["sampling"], sampling=made)
    else:
        terms.update({k: terms[k] + made for k in ("sampling", "sampling_prefill", "sampling_decode")})
    return terms


def _gvm_norms(x: _Inputs, policy: dict[str, int]) -> int:
    """GVM's per-sample gradient-norm pass over one chunk of unpacked rows (0 without GVM; module docstring)."""
    if not x.shapes.gvm_chunk:
        return 0
    mc, cfg, c, p = x.mc, x.cfg, x.c, x.p
    rows, length = x.shapes.gvm_chunk_rows_per_device, x.shapes.gvm_row_length
    # Unpacked rows hold every max_new_tokens column whatever the fill (train.rollouts.all_rows_batch), and
    # `train.logprobs.row_logprobs` scores all of them. Each device differentiates its own rows: the subset's
    # per-sample gradient is whole (unsharded). A tied embedding in the subset gets two before they are summed: the
    # output layer's, made first (at the log-prob pass's backward) in c, and the lookup's, made last, in p. The pass
    # reads the policy cast to c (LoRA: the merged copy, in p). Its phases as the train step's: the layers' backward
    # beside the kept activations, then the lookup's gradient with the embedding's f32 gradients, the activations
    # gone (`jaxrl-llm compile`: the 7B's peak is its f32 [152064, 3584] per-sample gradient; the tied 1.5B's a
    # bf16 [rows, 151936, 1536] and an f32 [151936, 1536] one).
    names = {n.strip().replace(".", "/") for n in cfg.sampling.gvm_param_subset.split(",")}
    head = rows * mc.vocab_size * mc.hidden_size * c if mc.tie_word_embeddings and "embed" in names else 0
    subset = rows * subset_elements(mc, cfg.sampling.gvm_param_subset) * p
    lookup = rows * subset_elements(mc, "embed") * p if "embed" in names else 0
    cast = policy["local"] * c if c != p else 0
    kept, working = x.activations(rows, length, 1, round_up(length, SPLASH_BLOCK))
    layers = kept + max(working, x.logprob_residuals(rows, cfg.sampling.max_new_tokens))
    return (policy["merged_copy"] + head + cast + subset - lookup
            + max(layers, lookup + rows * length * mc.hidden_size * 4 * 2))


def _critic_terms(x: _Inputs, policy: dict[str, int], activations: int) -> dict[str, int]:
    """PPO's value model (the policy's trunk, its AdamW moments, the f32 head) and its step (0 without a critic)."""
    if not uses_critic(x.cfg):
        return {"critic": 0, "critic_step": 0}
    lm_head = local_elements(x.mc, x.shapes.mesh)["lm_head"] if not x.mc.tie_word_embeddings else 0
    trunk, head, p = policy["local"] - lm_head, (x.mc.hidden_size + 1) * 4, x.p
    return {"critic": 3 * (trunk * p + head),  # phases as the train step's
            "critic_step": max(trunk * (4 + p) + 2 * head + activations, 3 * trunk * 4 + 2 * head)}


def program_memory(est: dict[str, Any], shapes: StepShapes) -> dict[str, dict[str, int]]:
    """Per compiled program (`capacity.aot.PROGRAMS`), {"resident": the run's arrays held beside it that are not its
    arguments, "working": the estimate's terms for what the program itself holds, its arguments included}. The
    train step's arguments are the state (and a LoRA base), the critic step's the critic's state; the log-prob pass
    and GVM's norm pass read the policy (LoRA: the merged copy) beside the optimizer state; a reference copy (full
    fine-tuning with a KL term) and a critic stay resident throughout. The sampler (`shapes.sampler_reads`) reads the
    policy as those do ("policy"), or its own copy ("copy": one async version, the others and the trainer's state
    resident beside it; or sampling.dtype's copy, counted in the sampling terms, the trainer's state beside it), or
    one of its versions on its own devices ("own", the other versions beside it). The log-prob pass has no working
    term of its own (a forward pass, bounded by the train step's): 0; the teacher's pass (distill.teacher) holds the
    teacher's weights and its pass's buffers (`teacher pass`), the trainer's state and the other models beside it;
    the train step also reads the teacher's top-K fields of its mini-batch (`teacher top-K`) and a mixture of
    experts' recorded routes (`batch routes`)."""
    lora = shapes.lora is not None
    other = est["reference"] + est["critic"] + est.get("teacher", 0)
    reader = est["params"] + est["optimizer"] + other if lora else est["optimizer"] + other  # reads the policy
    policy = 0 if lora else est["params"]  # the policy among a reader's arguments
    version = est["sampler_version"]
    if shapes.sampler_reads == "own":
        sampler_resident, sampler_reads = est["sampler_copies"] - version, version
    elif shapes.sampler_reads == "copy":
        sampler_resident = est["params"] + est["optimizer"] + other + est["sampler_copies"] - version
        sampler_reads = version
    else:
        sampler_resident, sampler_reads = reader, policy
    resident = {"train_step": other, "logprob_pass": est["optimizer"] + other,
                "teacher_pass": est["params"] + est["optimizer"] + est["reference"] + est["critic"],
                "critic_step": est["params"] + est["optimizer"] + est["reference"] + est.get("teacher", 0),
                "gvm_grad_norms": reader,
                "sampler_prefill": sampler_resident, "sampler_decode": sampler_resident,
                "sampler_continuous": sampler_resident}
    working = {"train_step": est["params"] + est["optimizer"] + est["train_step"] + est.get("teacher_topk", 0)
               + est.get("batch_routes", 0),
               "logprob_pass": 0, "teacher_pass": est.get("teacher", 0) + est.get("teacher_pass", 0),
               "critic_step": est["critic"] + est["critic_step"], "gvm_grad_norms": policy + est["gvm_norms"],
               "sampler_prefill": sampler_reads + est["sampling_prefill"],
               "sampler_decode": sampler_reads + est["sampling_decode"],
               "sampler_continuous": sampler_reads + est["sampling"]}
    return {name: {"resident": int(resident[name]), "working": int(working[name])} for name in resident}


def estimate_memory(config: RunConfig, model_config: ModelConfig, mesh: dict[str, int] | str = "", *,
                    devices: int | None = None, remat: bool | None = None,
                    response_fill: float = 1.0, platform: str = "tpu",
                    teacher_config: ModelConfig | None = None) -> dict[str, Any]:
    """Bytes per device of `config` on a mesh (a {"data", "fsdp", "tensor"} dict, or a `train.mesh`
    string resolved for `devices`); see the module docstring for each term.

    `remat` overrides model.remat; `response_fill` scales the response length (1.0: every response
    reaches sampling.max_new_tokens); `teacher_config`: distill.teacher's model when it is not the policy's shape.
    Returns a dict of byte counts (params, optimizer, reference, teacher, teacher_pass, teacher_topk, gradients,
    activations, logprob_residuals, train_step, batch_routes, kv_cache, sampler_routes, sampler_experts (the static
    decode's gathered experts), sampling, gvm_norms, critic, critic_step, sampler_copy, sampler_version (one policy
    version an async sampler holds, 0 in sync), sampler_copies, sampler_peak (the sampler's own devices, 0 when it
    shares the trainer's), peak) plus param_count, row_length (packed training row), sample_rows (rows of one sampler
    call's state), gvm_chunk_rows and "programs" (`program_memory`: each compiled program's resident and working
    bytes)."""
    if isinstance(mesh, str):
        if devices is None:
            raise ValueError("estimate_memory: a mesh string needs `devices`")
        mesh = parse_mesh(mesh, devices)
    shapes = step_shapes(config, mesh, response_fill=response_fill)
    x = _Inputs(config, model_config, shapes, _BYTES[config.model.param_dtype], _BYTES[config.model.compute_dtype],
                config.model.remat if remat is None else remat, platform)
    policy = _policy_terms(x)
    train = _train_step_terms(x, policy)
    sampler = _sampler_terms(x, policy)
    critic = _critic_terms(x, policy, train["activations"])
    est = {"mesh": dict(shapes.mesh), "micro_batch_size": config.optim.micro_batch_size,
           "param_count": policy["param_count"], "row_length": shapes.row_length, "gvm_chunk_rows": shapes.gvm_chunk,
           **{k: policy[k] for k in ("params", "optimizer", "reference")}, **train, **sampler,
           "gvm_norms": _gvm_norms(x, policy), **critic, "teacher": _teacher_term(x, teacher_config),
           "teacher_pass": _teacher_pass_term(x, teacher_config), "teacher_topk": _teacher_topk_term(x),
           "batch_routes": _batch_routes_term(x)}
    resident = (est["params"] + est["optimizer"] + est["reference"] + est["critic"] + est["teacher"]
                + (0 if shapes.sampler_devices else est["sampler_copies"]))
    trainer_peak = resident + max(est["train_step"] + est["teacher_topk"] + est["batch_routes"], est["critic_step"],
                                  est["sampling"], est["gvm_norms"], est["teacher_pass"])
    return {**est, "peak": max(trainer_peak, est["sampler_peak"]), "programs": program_memory(est, shapes)}
