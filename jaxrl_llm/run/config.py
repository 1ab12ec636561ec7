"""Run configuration: nested frozen dataclasses, YAML presets, `key=value` overrides, validation.

Every algorithm is a combination of values here (advantage estimator, loss kind, clipping, KL, filters),
never a branch in the trainer. `load_config("configs/grpo.yaml", ["optim.lr=1e-5"])` gives a checked
`RunConfig`; an unknown key fails with the closest valid key, a bad value fails with the reason.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import pathlib
from dataclasses import dataclass, field
from typing import Any

import yaml

from jaxrl_llm import objectives
from jaxrl_llm.models.config import ATTENTION_IMPLS, MOE_IMPLS, REMAT_POLICIES
from jaxrl_llm.models.lora import resolve_targets
from jaxrl_llm.models.quant import KINDS as QUANT_KINDS
from jaxrl_llm.sampling import ENGINES
from jaxrl_llm.tools.env import ENVIRONMENTS
from jaxrl_llm.tools.sandbox import ISOLATIONS


# The defaults are the embedded demo (`jaxrl-llm train` with no arguments): GRPO without KL on the
# bundled SmolLM2-135M-Instruct, 2-term 1-digit +/- problems with a 3-shot chat prompt, 20 steps of
# 8 prompts x 8 samples, avg@4 on 100 held-out problems before and after. The presets in configs/
# carry the papers' hyper-parameters instead.
#
# Documentation convention: a section's docstring and each field's comment (the `#` lines directly above
# it plus its trailing `#` comment) are its documentation; scripts/gen_config_reference.py turns them into
# docs/config_reference.md, and tests/test_docs.py fails when a field has none or the file is stale.


@dataclass(frozen=True)
class ModelSection:
    """The policy: where its weights come from and the dtypes it is stored and computed in."""

    source: str = "bundled"  # "bundled", an HF folder path, or a .gguf file path
    param_dtype: str = "float32"  # dtype of the stored parameters: float32 or bfloat16
    compute_dtype: str = "float32"  # dtype of activations and matmuls in the forward pass
    # Rematerialise each layer in the backward pass (jax.checkpoint), keeping only what remat_policy names.
    remat: bool = True
    # What a rematerialised layer keeps: "full" (only the layer input: least memory, the layer's forward again),
    # "qkv_attn_mlp" (q, k, v, the attention output and the MLP's gate and up projections; recomputes norms, RoPE,
    # softmax and SiLU: on CPU the fastest step, 4.6 KB per token per layer kept in f32) or "dots" (every projection
    # output). The demo takes "full": with one micro-batch it halves the train step's temporary memory.
    remat_policy: str = "full"
    # Attention over training rows in tiles of this many query x key tokens with an online softmax, so no
    # [rows, heads, L, L] scores are held and the tiles no query reads (another packed response, above the
    # diagonal) are skipped; null: one full score matrix per layer. Applies to rows of at least
    # attention_block_min_length tokens; shorter rows take full attention. Measured on a 2-core CPU with the
    # bundled model (benchmarks/README.md, "Train step"): a 3072-token row of a prompt and 8 responses trains
    # 1.73x faster with tiles of 256 (512: 1.50x, 128: 1.66x) and 1024-token rows 1.14x, while 320-token rows
    # take 1.34x longer in tiles.
    attention_block_size: int | None = 256
    # Rows shorter than this many tokens take full attention even with attention_block_size set (0: every row
    # in tiles). The default leaves the demo's rows of 256-320 tokens on full attention.
    attention_block_min_length: int = 1024
    # Recompute the output logits of each vocabulary chunk in the log-prob backward pass instead of keeping
    # them: saves rows x response tokens x vocabulary x 4 bytes per micro-batch for one more output matmul.
    remat_logits: bool = False
    # How training rows attend (jaxrl_llm/models/attention.py), decided by the platform the program is compiled
    # for: "auto" takes Pallas splash attention on a TPU and cuDNN's fused attention on a GPU (each packed response
    # regrouped with its prompt into one causal row; on a GPU where cuDNN cannot serve the model, e.g. f32 or a
    # soft-cap, XLA attention on those rows) and XLA's packed attention on a CPU; "xla" (on a GPU a loop of small
    # kernels per tile with attention_block_size), "splash" (interpret mode off a TPU: slow, for tests) or
    # "cudnn" (GPU, bf16/fp16; XLA's attention elsewhere) force one.
    attention_impl: str = "auto"
    # How a mixture-of-experts model's experts compute their grouped matmuls (jaxrl_llm/models/moe.py): "auto"
    # takes jax.lax.ragged_dot where the program is compiled for a TPU or a GPU and the per-expert tiles on a CPU
    # (whose ragged_dot is a masked product over every expert); "ragged_dot" or "tiles" force one. Dense models
    # ignore it.
    moe_impl: str = "auto"
    # Mixtures of experts (issue 57): "rollout" replays the sampler's routes (R3): the trainer's log-prob pass and
    # train step send every token the sampler routed to the experts it chose (their gate weights recomputed from the
    # trainer's router logits, so the router still learns); "none" routes by the trainer's own top k. Either way a
    # step logs routes_changed and expert_load_max_over_mean when the sampler recorded routes. Either engine records
    # them on single-turn rollouts, whole or partial, and on tool rollouts (the tool's answers as the model fed them).
    routing_replay: str = "none"
    # Switch's load-balancing loss, E sum_e f_e P_e per sparse layer, added x this coefficient (0: off).
    router_aux_loss_coef: float = 0.0


@dataclass(frozen=True)
class LoraSection:
    """Low-rank adapters (LoRA, Hu et al. 2021): each adapted projection computes x W + (alpha / rank) (x A) B and
    only A [in, rank] and B [rank, out] are trained; the base stays frozen (stored in model.param_dtype, or
    quantized: lora.base_dtype), the reference policy of the KL term is the base itself, and checkpoints hold
    the adapters and their optimizer state only. `lora.rank=16` turns it on. The run exports the merged model (final/) and the adapters in
    PEFT's format (final_adapter/)."""

    rank: int = 0  # adapter rank; 0: no adapters, every parameter is trained
    alpha: float = 16.0  # adapter scale numerator: the low-rank term is multiplied by alpha / rank
    # Projections that get adapters, comma-separated: names (q_proj or q, k, v, o, gate, up, down, and a mixture's
    # expert_gate, expert_up, expert_down), groups (all = the dense q/k/v/o/gate/up/down, attention = q/k/v/o,
    # mlp = gate/up/down, experts = a mixture of experts' per-expert matrices) or regexes matched against the names.
    # A mixture of experts whose every layer is sparse takes attention,experts.
    targets: str = "all"
    seed: int = 0  # seed of the adapters' random A (B starts at zero, so training starts from the base)
    # A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to continue training from; its r,
    # lora_alpha and target_modules are used (lora.rank must then be 0 or equal to its r). Empty: new adapters.
    adapter: str = ""
    # Storage of the frozen base's projections: "" (model.param_dtype), "int8" or "int4" (per-output-channel
    # symmetric scales, dequantized layer by layer inside the model; embeddings and norms keep model.param_dtype).
    base_dtype: str = ""


@dataclass(frozen=True)
class DataSection:
    """Training prompts, held-out evaluation problems and the prompt template."""

    # A `jaxrl_llm.data.load_records` spec: a task or benchmark name, a file path, or a mapping such as
    # {kind: jsonl, path: train.jsonl, question: problem, answer: solution}.
    train: Any = "arithmetic"
    eval: Any = "arithmetic-heldout"  # the held-out set, in the same forms as `train`
    prompt: str = "arithmetic-3shot"  # a jaxrl_llm.data.PROMPT_PRESETS name
    max_prompt_tokens: int = 256  # longer prompts are dropped and counted, never truncated
    seed: int = 0  # shuffling seed of the training prompts


@dataclass(frozen=True)
class SamplingSection:
    """How rollouts are drawn each step: batch shape, decoding, and the sample allocation (uniform or GVM)."""

    prompts_per_step: int = 8  # prompts (groups) drawn per training step
    samples_per_prompt: int = 8  # responses per prompt with uniform allocation (the group size)
    max_new_tokens: int = 24  # generation budget per response, in tokens
    temperature: float = 1.0  # sampling temperature; 0 is greedy
    top_p: float = 1.0  # nucleus sampling mass; 1.0 disables it
    top_k: int = 0  # keep only the k most likely tokens; 0 disables it
    allocation: str = "uniform"  # "uniform" or "gvm" (GVM dynamic allocation, jaxrl_llm/train/gvm.py)
    # Sampled rows (prompts x samples) decoded per sampler call; a step's rows go in several calls of at most
    # this many, with the same tokens as one call (bounds the KV cache). 0: all of a step's rows in one call.
    max_rows_per_call: int = 0
    # "static": each call's rows decode in lockstep until the longest ends, the samples of a prompt reading one
    # shared prompt entry (`sampling.buckets.prompt_group_size`); "continuous": max_slots decode slots
    # take the next pending sample as soon as theirs ends, one prompt cache per prompt (the same rollouts when the
    # slots match the static call's rows, up to f32 rounding at buckets >= 256; other slot counts round f32
    # differently); its steps
    # and evaluations log sampling_slot_occupancy / eval_slot_occupancy (generated tokens / decoded slot-steps).
    # At new-token buckets >= 256 both read only the response tiles generated so far: the static engine up to its
    # step, the continuous one up to its deepest slot's (in steady state nearly all; benchmarks/README).
    engine: str = "static"
    max_slots: int = 0  # decode slots of the continuous engine; 0: one per sample of the call
    # Entries of the continuous engine's prompt cache (one per prompt being decoded); 0: slots + one prefill
    # chunk, so a slot never waits for one. Lower bounds the cache further; slots then wait for a free entry.
    max_prompt_entries: int = 0
    # The precision the sampler computes the policy in (docs/rollout_correction.md; benchmarks/README.md,
    # "Sampler/trainer gap"): "" (the trainer's: model.param_dtype and model.compute_dtype); "bfloat16" (a bf16 copy
    # of the weights, bf16 activations and KV cache); "int8" (a copy of the weights with every projection
    # re-quantized to int8 per output channel, dequantized layer by layer, activations in model.compute_dtype:
    # weight-only int8 serving; under LoRA the merged W + s A B quantized, not lora.base_dtype's base, which alone
    # makes no gap).
    # Only sampling changes: the update, recomputed old log-probs and evaluation keep the trainer's precision
    # (algorithm.old_logp auto with one update per batch takes the sampler's log-probs as PPO's old ones).
    # algorithm.rollout_correction weighs the gap; an int8 copy of a LoRA-trained policy drops nearly all of the
    # adapters' update and needs it (measured on the demo: 0.560 -> 0.417 without, 0.828 with TIS).
    dtype: str = ""
    # GVM: stage 1 draws N' samples per prompt to estimate p_i and G_i; stage 2 spends prompts x N''.
    gvm_stage1_samples: int = 8  # N': stage-1 samples per prompt
    gvm_samples_per_prompt: int = 8  # N'': stage-2 budget per prompt (samples_per_prompt is unused with gvm)
    gvm_alpha: float = 1e-3  # alpha in w_i = G_i / sqrt(p_i + alpha / p_i^(beta - 1))
    gvm_beta: float = 2.0  # beta in the same rule
    gvm_filter_threshold: float = 1.0  # zero weight where p_i > threshold; 1.0 keeps every prompt
    gvm_filter_insufficient: float = 0.0  # zero weight where p_i w_i budget < this; 0 keeps every prompt
    gvm_max_samples: int = 0  # cap on n_i, the excess goes to uncapped prompts; 0: no cap
    gvm_param_subset: str = "embed"  # comma-separated parameter paths ("embed", "layers/q_proj") for G_i
    gvm_refresh_every: int = 1  # stage 1 + allocation every k steps; other steps sample N'' uniformly
    gvm_reuse_stage1: bool = False  # stage-2 groups take their first min(n_i, N') rows from stage 1
    gvm_rows_per_chunk: int = 0  # stage-1 rows whose per-sample gradients are taken at once; 0: optim.micro_batch_size
    # "gvm": n_i by G_i / sqrt(p_i + alpha / p_i^(beta - 1)); "solved": the budget split evenly over the prompts
    # solved in stage 1 (GVM's filter without its weighting, a control for the weighting's effect).
    gvm_weighting: str = "gvm"
    # Where p_i and G_i come from: "stage1", N' fresh samples of every prompt each GVM step (the paper);
    # "history", the prompt's earlier rollouts, stage 1 only for prompts never seen (train/gvm_history.py).
    gvm_estimates: str = "stage1"
    gvm_history_decay: float = 0.5  # weight of a prompt's older visits against its newest one (history)
    gvm_history_probe: int = 2  # stage-1 samples for a prompt unsolved at every visit so far (history); 0: none
    gvm_history_probe_visits: int = 0  # no more probes once a prompt was drawn at this many visits, never solved; 0: no limit
    # Stage 2's budget: "prompts", N'' x the step's prompts (the paper); "solvable", N'' x the prompts with
    # p_i > 0, so the samples a uniform step would spend on prompts never solved are not drawn at all.
    gvm_budget: str = "prompts"


@dataclass(frozen=True)
class AlgorithmSection:
    """The RL algorithm as data: advantage estimator, policy loss, clipping, KL, filters and reward shaping."""

    name: str = "grpo"  # a label for logs and run summaries; behaviour comes from the keys below
    # raft | grpo | drgrpo | rloo | reinforce_rej | reinforce_pp | reinforce_pp_baseline
    # (objectives.ADVANTAGE_ESTIMATORS), or gae: PPO with a critic (the `critic` section), per-token advantages
    # from objectives.gae_advantages over the critic's values
    advantage: str = "grpo"
    # clip (PPO / RAFT++ surrogate) | vanilla (-A log pi, plain RAFT) | gspo | gspo_token (GSPO's sequence
    # ratio) | cispo (clipped, detached importance weight) | clip_cov | kl_cov (covariance-selected tokens)
    # (objectives.policy_loss)
    loss: str = "clip"
    clip_low: float = 0.2  # the ratio is clipped below at 1 - clip_low (cispo: 1.0 removes the floor)
    clip_high: float = 0.2  # the ratio is clipped above at 1 + clip_high (DAPO: 0.28)
    dual_clip: float | None = None  # c > 1 bounds the loss of negative-advantage tokens at -A c; null disables
    # clip_cov / kl_cov: the fraction of a mini-batch's response tokens selected (objectives.cov_selection),
    # drawn once per mini-batch from its old log-probs and advantages, so micro-batching does not change it.
    cov_fraction: float = 2.0e-4
    cov_low: float = 1.0  # clip_cov: tokens are drawn among those with covariance in (cov_low, cov_high)
    cov_high: float = 5.0  # clip_cov: the upper end of that window
    kl_cov_coef: float = 1.0  # kl_cov: weight of the k2 penalty on the selected tokens' log-ratio
    # How per-token losses reduce to a scalar: a mode of objectives.aggregate, or GVM's M-step, every prompt
    # weighted equally and its samples averaged (objectives.prompt_mean; docs/gvm.md): prompt-mean is
    # Algorithm 1 over the samples with a nonzero advantage, prompt-mean-unbiased Lemma 1's 1 / (n_i p_i) with
    # GVM's stage-1 p_i (needs allocation gvm). With the M-step modes the KL and entropy terms stay token-means.
    agg: str = "token-mean"
    agg_max_len: int | None = None  # constant length for seq-mean-token-sum-norm (Dr.GRPO)
    kl_coef: float = 0.0  # weight of the KL penalty to the reference policy; 0 keeps no reference model
    kl_kind: str = "k3"  # the KL estimator (objectives.kl_penalty)
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted from the loss)
    reward: str = "binary"  # binary {0, 1} | signed {-1, +1}
    # math: the final answer against the gold answer (rewards.correctness_reward); code: the completion's python
    # run against the record's tests in the sandbox (rewards.code_reward, the gold answer holding the tests,
    # e.g. data.train: code-basic); correct = every test passed
    verifier: str = "math"
    code_reward: str = "fraction"  # verifier code: fraction (of tests passed) | all (1 only when every test passes)
    format_reward: float = 0.0  # weight of a bonus for responses with an extractable final answer; 0 disables
    group_filter: str = "none"  # none | mixed (drop groups whose rewards all agree)
    dynamic_sampling: bool = False  # DAPO: resample until enough mixed groups
    max_sampling_rounds: int = 3  # bound on DAPO's generation rounds per step
    overlong_buffer: int = 0  # DAPO overlong penalty; 0 disables
    overlong_factor: float = 1.0  # the overlong penalty at max_new_tokens
    prl_eta: float | None = None  # set to shape per-token advantages with PRL
    # "recompute": old log-probs from a teacher-forced pass before the first update; "sampler": the
    # sampler's own (equal to 1e-5 in f32, and a forward pass cheaper); "auto": the sampler's when there is
    # a single update per rollout batch (the ratio is then 1 either way), else recompute.
    old_logp: str = "auto"
    prl_step_len: int | None = None  # PRL step length in response tokens; null: a step per token
    gamma: float = 1.0  # advantage gae: the discount of the token rewards
    lam: float = 1.0  # advantage gae: GAE's lambda (1: the return minus the value; 0: the one-step TD error)
    # advantage gae: each token's reward is minus this times the per-token KL penalty of the old log-probs to
    # the reference policy's (objectives.kl_penalty with kl_kind), plus the outcome reward on the last token.
    kl_reward_coef: float = 0.0
    # advantage gae: normalise the per-token advantages to mean 0 and standard deviation 1 over all response
    # tokens of the rollout batch (verl's and OpenRLHF's whitening of GAE advantages).
    whiten_advantages: bool = True
    # Sampler/trainer mismatch correction (objectives.rollout_correction, docs/rollout_correction.md): "" off, or
    # the level of the ratio r = pi_trainer / pi_sampler of the sampled tokens: "token" (r_t per token),
    # "sequence" (the product over the response) or "geometric" (its geometric mean); each token's policy loss is
    # multiplied by its weight. It needs the trainer's own old log-probs: old_logp auto then recomputes them (one
    # more forward pass per step); old_logp sampler is refused.
    rollout_correction: str = ""
    # truncate (TIS: w = min(r, high)) | mask (MIS: w = r inside [low, high], else 0) | reject (w = 1 inside
    # [low, high], else 0)
    rollout_correction_mode: str = "truncate"
    rollout_correction_low: float = 0.0  # mask / reject: ratios below this get weight 0 (at most 1)
    rollout_correction_high: float = 2.0  # truncate: the cap of the weight; mask / reject: ratios above get 0 (>= 1)


@dataclass(frozen=True)
class CriticSection:
    """The value model of PPO with a critic (used when algorithm.advantage is gae): the policy's decoder trunk
    with a scalar head (`models.flax_modules.ValueModel`'s parameters), trained on the clipped value loss
    (objectives.value_loss, token-mean) with an AdamW of its own; optim's b1, b2, mini_batches, epochs and
    micro_batch_size apply to it too. Checkpoints hold its parameters and optimizer state."""

    # Where the trunk's weights come from: "policy" (a copy of the policy's at the start of the run), or
    # "bundled", an HF folder or a .gguf file of a model with the policy's vocabulary (the head starts at zero),
    # or a trained critic's folder (a run's final_critic/: its head too).
    source: str = "policy"
    lr: float = 1e-5  # the critic's peak learning rate
    warmup_steps: int = 0  # linear warmup of the critic's learning rate from 0, in optimizer updates
    weight_decay: float = 0.01  # AdamW decoupled weight decay of the critic
    grad_clip: float = 1.0  # global gradient-norm clip of the critic's gradient
    # c of the clipped value loss: a value moves at most c away from its value at scoring time; null disables
    value_clip: float | None = 0.5


@dataclass(frozen=True)
class OptimSection:
    """AdamW, the learning-rate schedule, and how a rollout batch is split into updates."""

    lr: float = 1e-5  # peak learning rate
    warmup_steps: int = 0  # linear warmup from 0, in optimizer updates
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    grad_clip: float = 1.0  # global gradient-norm clip
    b1: float = 0.9  # AdamW beta1
    b2: float = 0.999  # AdamW beta2
    mini_batches: int = 1  # optimizer updates per rollout batch and epoch
    epochs: int = 1  # passes over each rollout batch
    # Packed rows (prompts, each with its responses) per forward/backward, and per forward of the old/reference
    # log-prob and value passes. The demo's 8 prompts make one micro-batch: no gradient accumulator beside the
    # gradient (a model's size of memory saved).
    micro_batch_size: int = 8
    # Tokens per packed row at most (prompt + responses; 0: no limit): a prompt's responses are spread over
    # rows that each repeat the prompt (exact; bounds activation memory for long responses).
    max_row_tokens: int = 0


@dataclass(frozen=True)
class TrainSection:
    """Run length, evaluation, checkpoints, the output directory, the verifier and the device mesh."""

    steps: int = 20  # RL steps (one rollout batch each)
    seed: int = 0  # seed of sampling and of the mini-batch shuffles
    eval_every: int = 0  # 0: only before and after training
    eval_problems: int = 100  # held-out problems per evaluation (0 skips evaluation)
    eval_samples: int = 4  # samples per problem: the k of the reported avg@k
    eval_temperature: float = 1.0  # sampling temperature of evaluations
    save_every: int = 10  # checkpoint every k steps (0: only at the end and at evaluations)
    keep_checkpoints: int = 2  # most recent checkpoints kept (the best by held-out accuracy is kept too)
    save_concurrent_gb: float = 0.25  # host memory a checkpoint write may fill at once (raise for faster remote saves)
    out_dir: str = "runs/default"  # run directory: metrics.jsonl, TensorBoard, checkpoints, final/
    max_bad_steps: int = 3  # consecutive non-finite updates before the run stops
    verifier_timeout: float = 5.0  # seconds allowed to check one answer
    verifier_workers: int = 0  # 0: score in-process (with timeouts); >0: process pool
    mesh: str = ""  # e.g. "data=2,fsdp=2,tensor=2", "fsdp=4,expert=2" (a mixture's experts split); empty: one device


@dataclass(frozen=True)
class ToolsSection:
    """Tool-integrated rollouts (`sampling.multiturn`, `tools.env`): with an environment, each sample is a
    conversation in which the model may call the tool in a fenced block (```python ... ```) and reads its output
    (appended with loss mask 0) before it goes on; sampling.max_new_tokens bounds a conversation's tokens after
    the prompt, observations included. The answer is scored on the model's own tokens."""

    env: str = ""  # "" (single-turn text), "python" (tools.run_python in its sandbox) or "calculator"
    # How a call is written (docs/tool_use.md): "markdown", a fenced block tagged with the tool's name, answered by
    # an output block; "chat", the model's chat template with a tool role (the tools' schemas in the prompt, a JSON
    # call between the template's markers, the result as a "tool" message), refused at start where it has none
    format: str = "markdown"
    max_turns: int = 3  # tool calls per conversation; after that many the next stop ends it
    max_observation_tokens: int = 48  # a longer tool output is cut, and the observation says so
    max_output_chars: int = 400  # characters of a tool's output kept before encoding
    timeout_s: float = 5.0  # wall-clock limit of one python call
    memory_mb: int = 512  # address-space limit of one python call
    isolation: str = "auto"  # run_python's: auto (unshare, else bwrap, else refuse), unshare, bwrap, none
    workers: int = 4  # tool calls run at once (threads; each python call is its own sandboxed process)
    # sampling.engine continuous: decode iterations between two looks at the ended turns (their tools start then,
    # and conversations whose tools are back take free slots while the others decode; docs/tool_use.md)
    segment_iterations: int = 16
    malformed_penalty: float = 0.0  # subtracted from the reward of a conversation that ends inside an unclosed call


@dataclass(frozen=True)
class RolloutsSection:
    """When rollouts are drawn against training (`train/async_rollouts.py`, docs/async_rollouts.md): "sync", each
    step's rollouts drawn with the current policy before its update; "async", a sampler thread draws step t's with
    the policy of max(0, t - max_staleness) steps before, while the trainer trains the steps between; "partial", a
    sampler that never stops decoding, whose unfinished responses continue under each new policy
    (`train/partial_rollouts.py`)."""

    mode: str = "sync"  # "sync", "async" or "partial"
    # async: k, the updates between the policy that drew a step's rollouts and the trainer's; partial: the most
    # versions any token of a group the trainer takes may lag behind it (older groups: `stale`)
    max_staleness: int = 1
    partial_lag: int = 1  # partial: a segment decodes with version max(0, r - lag), r the batch it fills
    segment_iterations: int = 16  # partial: decode iterations per segment (versions change between segments)
    stale: str = "drop"  # partial: a group over max_staleness is dropped (counted) or its prompt redrawn ("redraw")
    # partial: at a version change, the KV caches of the prompts and responses in flight recomputed under the new
    # weights (a prefill of the live prompts and one decode step per token so far); false keeps them
    recompute_cache: bool = False
    # async: the last n devices sample (on their own mesh, rollouts.sampler_mesh) and the others train (train.mesh);
    # the weights go to the sampler's devices after every update. 0: both share every device.
    sampler_devices: int = 0
    sampler_mesh: str = ""  # the sampler's mesh over its devices, as train.mesh (empty: every one on fsdp)


@dataclass(frozen=True)
class DistillSection:
    """On-policy distillation (docs/distillation.md): a teacher scores every token the student samples, and the
    student is pushed towards the teacher's distribution on its own states (reverse KL). With a teacher set, the
    advantages are coef x (log pi_teacher - log pi_sampler) per token (objectives.reverse_kl_advantages), alone
    (reward none: the verifier is not called) or added to the algorithm's (reward add: GRPO + distillation); with
    mode topk the train step adds coef x the top-K loss on the teacher's top_k ids instead."""

    # The teacher's weights: "" (no distillation), "policy" (the student's starting weights; under LoRA the base),
    # "bundled", an HF folder (a run's final/) or a .gguf file. Its vocabulary must be the policy's.
    teacher: str = ""
    adapter: str = ""  # a PEFT adapter folder merged into the teacher's weights (e.g. a LoRA run's final_adapter/)
    # sampled: the reverse KL of each sampled token as its advantage; topk: the teacher's top_k most likely tokens
    # at each position, renormalised, against the student's log-softmax there (objectives.topk_distill_loss), a
    # loss added to the policy loss
    mode: str = "sampled"
    top_k: int = 16  # topk: the teacher's ids per response position (at most the vocabulary)
    coef: float = 1.0  # weight of the distillation advantage (sampled) or loss (topk)
    reward: str = "none"  # none: distillation alone, no verifier; add: the algorithm's advantages plus it
    teacher_dtype: str = "float32"  # the teacher's weights: float32, bfloat16 or int8 (projections per channel)


@dataclass(frozen=True)
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    lora: LoraSection = field(default_factory=LoraSection)
    data: DataSection = field(default_factory=DataSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    critic: CriticSection = field(default_factory=CriticSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    tools: ToolsSection = field(default_factory=ToolsSection)
    rollouts: RolloutsSection = field(default_factory=RolloutsSection)
    distill: DistillSection = field(default_factory=DistillSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    """A configuration key or value that cannot run; the message names the key and the reason."""


# The values a key may take. Where a registry defines them (the objectives' estimators, loss kinds, aggregation
# modes, KL kinds and correction levels; the sampler's engines; the tool environments and sandboxes; the quantized
# base's dtypes; the model's remat policies and attention implementations) the set is built from it: a new entry
# there is a new config value here.
_ALLOWED = {
    ("sampling", "allocation"): {"uniform", "gvm"},
    ("sampling", "engine"): set(ENGINES),
    ("sampling", "gvm_weighting"): {"gvm", "solved"},
    ("sampling", "gvm_estimates"): {"stage1", "history"},
    ("sampling", "gvm_budget"): {"prompts", "solvable"},
    ("sampling", "dtype"): {"", "bfloat16", "int8"},
    # gae: PPO with a critic, whose per-token advantages come from objectives.gae_advantages (not a registry entry)
    ("algorithm", "advantage"): set(objectives.ADVANTAGE_ESTIMATORS) | {"gae"},
    ("algorithm", "loss"): set(objectives.POLICY_LOSSES),
    # GVM's M-step modes reach policy_loss as token-means over advantages the host scaled (train/rollouts.py)
    ("algorithm", "agg"): set(objectives.AGG_MODES) | set(objectives.PROMPT_MEAN_MODES),
    ("algorithm", "kl_kind"): set(objectives.KL_KINDS),
    ("algorithm", "reward"): {"binary", "signed"},
    ("algorithm", "verifier"): {"math", "code"},
    ("algorithm", "code_reward"): {"fraction", "all"},
    ("tools", "env"): {""} | set(ENVIRONMENTS),
    ("tools", "format"): {"markdown", "chat"},
    ("tools", "isolation"): set(ISOLATIONS),
    ("rollouts", "mode"): {"sync", "async", "partial"},
    ("rollouts", "stale"): {"drop", "redraw"},
    ("algorithm", "group_filter"): {"none", "mixed"},
    ("algorithm", "old_logp"): {"auto", "recompute", "sampler"},
    ("model", "param_dtype"): {"float32", "bfloat16"},
    ("lora", "base_dtype"): {""} | set(QUANT_KINDS),
    ("model", "compute_dtype"): {"float32", "bfloat16"},
    ("model", "remat_policy"): set(REMAT_POLICIES),
    ("model", "attention_impl"): set(ATTENTION_IMPLS),
    ("model", "routing_replay"): {"none", "rollout"},
    ("model", "moe_impl"): set(MOE_IMPLS),
    ("algorithm", "rollout_correction"): {""} | set(objectives.ROLLOUT_CORRECTION_LEVELS),
    ("algorithm", "rollout_correction_mode"): set(objectives.ROLLOUT_CORRECTION_MODES),
    ("distill", "mode"): {"sampled", "topk"},
    ("distill", "reward"): {"none", "add"},
    ("distill", "teacher_dtype"): {"float32", "bfloat16", "int8"},
}


def _section_fields(section_cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section_cls)}


def _all_keys() -> list[str]:
    keys = []
    for sec in dataclasses.fields(RunConfig):
        keys += [f"{sec.name}.{name}" for name in _section_fields(sec.default_factory)]
    return keys


# Common names from other trainers that string similarity cannot map to ours.
_ALIASES = {"learning_rate": "optim.lr", "max_steps": "train.steps", "num_steps": "train.steps",
            "total_steps": "train.steps", "batch_size": "sampling.prompts_per_step",
            "num_samples": "sampling.samples_per_prompt", "n_samples": "sampling.samples_per_prompt",
            "max_tokens": "sampling.max_new_tokens", "max_response_length": "sampling.max_new_tokens",
            "kl_loss_coef": "algorithm.kl_coef", "clip_ratio": "algorithm.clip_low", "seed": "train.seed"}


def _unknown_key(key: str, where: str) -> ConfigError:
    alias = _ALIASES.get(key.rpartition(".")[2])
    close = [alias] if alias else difflib.get_close_matches(key, _all_keys(), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(_all_keys())}"
    return ConfigError(f"unknown config key '{key}' ({where}){hint}")


def _coerce(key: str, value: Any, f: dataclasses.Field) -> Any:
    typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if typ == "Any":
        return value
    if value is None:
        if "None" in typ:
            return None
        raise ConfigError(f"config key '{key}' may not be null (expected {typ})")
    try:
        if typ.startswith("bool"):
            if isinstance(value, str):
                if value.lower() not in ("true", "false"):
                    raise ValueError(value)
                return value.lower() == "true"
            return bool(value)
        if typ.startswith("int"):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if typ.startswith("float"):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"config key '{key}' expects {typ}, got {value!r}") from None


def _apply(tree: dict[str, dict[str, Any]], flat: dict[str, Any], where: str) -> None:
    sections = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)}
    for key, value in flat.items():
        sec, _, name = key.partition(".")
        if sec not in sections or name not in _section_fields(sections[sec]):
            raise _unknown_key(key, where)
        tree[sec][name] = _coerce(key, value, _section_fields(sections[sec])[name])


def _flatten(d: dict[str, Any], where: str) -> dict[str, Any]:
    flat = {}
    for sec, body in d.items():
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: top-level key '{sec}' must be a section mapping, got {body!r}")
        for name, value in body.items():
            flat[f"{sec}.{name}"] = value
    return flat


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["optim.lr=1e-5", "train.steps=3"]` -> {"optim.lr": 1e-05, "train.steps": 3} (values parsed as YAML)."""
    flat = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form section.key=value")
        flat[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
    return flat


def load_config(path: str | pathlib.Path | None = None, overrides: list[str] | dict[str, Any] = ()) -> RunConfig:
    """Build a validated RunConfig from defaults, an optional YAML file, then `section.key=value` overrides.

    A preset may name another with `base: other.yaml` (resolved next to it) to inherit its values.
    """
    tree = {f.name: {} for f in dataclasses.fields(RunConfig)}
    if path is not None:
        _apply(tree, _read_yaml(pathlib.Path(path)), str(path))
    flat = parse_overrides(list(overrides)) if not isinstance(overrides, dict) else dict(overrides)
    _apply(tree, flat, "command line")
    sections = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)}
    config = RunConfig(**{name: cls(**tree[name]) for name, cls in sections.items()})
    validate(config)
    return config


def _read_yaml(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        body = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if not isinstance(body, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    base = body.pop("base", None)
    flat = _read_yaml(path.parent / base) if base else {}
    flat.update(_flatten(body, str(path)))
    return flat


def validate(config: RunConfig) -> None:
    """Reject values that cannot run, naming the key and the reason."""
    d = config.to_dict()
    for (sec, name), allowed in _ALLOWED.items():
        if d[sec][name] not in allowed:
            raise ConfigError(f"config key '{sec}.{name}' must be one of {sorted(allowed)}, got {d[sec][name]!r}")
    for section_checks in _CHECKS:
        for key, ok, reason in section_checks(config):
            if not ok:
                sec, name = key.split(".")
                raise ConfigError(f"config key '{key}' {reason}, got {d[sec][name]!r}")
    _validate_lora(config.lora)
    _validate_single_device(config)


def _validate_single_device(config: RunConfig) -> None:
    """Quantized copies (the sampler's int8 weights, LoRA's int8/int4 base) run on one device only for now."""
    if config.sampling.dtype == "int8" and config.train.mesh:
        raise ConfigError(f"config key 'sampling.dtype'='int8' (a quantized sampler copy) runs on one device only for "
                          f"now: leave train.mesh empty ({config.train.mesh!r} given)")
    if config.lora.base_dtype and config.train.mesh:
        raise ConfigError(f"config key 'lora.base_dtype'={config.lora.base_dtype!r} (a quantized base) runs on one "
                          f"device only for now: leave train.mesh empty ({config.train.mesh!r} given)")


def _model_checks(config: RunConfig) -> list[tuple[str, bool, str]]:
    """model: attention tiling."""
    return [
    ("model.attention_block_size", config.model.attention_block_size is None
     or config.model.attention_block_size >= 1, "must be >= 1 or null"),
    ("model.attention_block_min_length", config.model.attention_block_min_length >= 0, "must be >= 0"),
    ("model.router_aux_loss_coef", config.model.router_aux_loss_coef >= 0, "must be >= 0"),
    ]


def _optim_checks(config: RunConfig) -> list[tuple[str, bool, str]]:
    """optim: the optimizer and the batch split."""
    return [
    ("optim.lr", config.optim.lr > 0, "must be > 0"),
    ("optim.weight_decay", config.optim.weight_decay >= 0, "must be >= 0"),
    ("optim.grad_clip", config.optim.grad_clip > 0, "must be > 0"),
    ("optim.warmup_steps", config.optim.warmup_steps >= 0, "must be >= 0"),
    ("optim.mini_batches", config.optim.mini_batches >= 1, "must be >= 1"),
    ("optim.epochs", config.optim.epochs >= 1, "must be >= 1"),
    ("optim.micro_batch_size", config.optim.micro_batch_size >= 1, "must be >= 1"),
    ("optim.max_row_tokens", config.optim.max_row_tokens >= 0, "must be >= 0 (0: no limit)"),
    ]


def _algorithm_checks(config: RunConfig) -> list[tuple[str, bool, str]]:
    """algorithm: clipping, penalties, Clip-Cov / KL-Cov, DAPO rounds, aggregation."""
    return [
    ("algorithm.clip_low", 0 <= config.algorithm.clip_low < 1
     or (config.algorithm.loss == "cispo" and config.algorithm.clip_low == 1),
     "must be in [0, 1): the ratio floor is 1 - clip_low (loss cispo also takes 1: no floor)"),
    ("algorithm.clip_high", config.algorithm.clip_high >= 0, "must be >= 0"),
    ("algorithm.dual_clip", config.algorithm.dual_clip is None or config.algorithm.dual_clip > 1,
     "must be > 1 (or null to disable)"),
    ("algorithm.kl_coef", config.algorithm.kl_coef >= 0, "must be >= 0"),
    ("algorithm.cov_fraction", 0 < config.algorithm.cov_fraction <= 1, "must be in (0, 1]"),
    ("algorithm.cov_high", config.algorithm.cov_low < config.algorithm.cov_high, "must be > algorithm.cov_low"),
    ("algorithm.kl_cov_coef", config.algorithm.kl_cov_coef >= 0, "must be >= 0"),
    ("algorithm.prl_eta", config.algorithm.prl_eta is None or config.algorithm.prl_eta > 0, "must be > 0 or null"),
    ("algorithm.max_sampling_rounds", config.algorithm.max_sampling_rounds >= 1, "must be >= 1"),
    ("algorithm.agg_max_len", config.algorithm.agg != "seq-mean-token-sum-norm"
     or (config.algorithm.agg_max_len or 0) > 0, "must be set (> 0) for agg seq-mean-token-sum-norm"),
    ("algorithm.agg", config.algorithm.agg != "prompt-mean-unbiased"
     or config.sampling.allocation == "gvm",
     "needs sampling.allocation=gvm (its stage-1 acceptance rates p_i); with uniform sampling use prompt-mean"),
    ]


def _sampling_checks(config: RunConfig) -> list[tuple[str, bool, str]]:
    """sampling: batch shape, decoding, the engines' bounds and GVM's allocation."""
    return [
    ("sampling.prompts_per_step", config.sampling.prompts_per_step >= 1, "must be >= 1"),
    ("sampling.samples_per_prompt", config.sampling.samples_per_prompt >= 1, "must be >= 1"),
    ("sampling.max_new_tokens", config.sampling.max_new_tokens >= 1, "must be >= 1"),
    ("sampling.temperature", config.sampling.temperature >= 0, "must be >= 0 (0 is greedy)"),
    ("sampling.top_p", 0 < config.sampling.top_p <= 1, "must be in (0, 1]"),
    ("sampling.top_k", config.sampling.top_k >= 0, "must be >= 0 (0 disables)"),
    ("sampling.max_rows_per_call", config.sampling.max_rows_per_call >= 0,
     "must be >= 0 (0: all of a step's rows in one sampler call)"),
    ("sampling.max_slots", config.sampling.max_slots >= 0,
     "must be >= 0 (0: one decode slot per sample of a sampler call)"),
    ("sampling.max_slots", config.sampling.engine == "continuous" or config.sampling.max_slots == 0,
     "applies to sampling.engine=continuous; the static engine bounds its cache with sampling.max_rows_per_call"),
    ("sampling.max_prompt_entries", config.sampling.max_prompt_entries >= 0,
     "must be >= 0 (0: decode slots + one prefill chunk)"),
    ("sampling.max_prompt_entries",
     config.sampling.engine == "continuous" or config.sampling.max_prompt_entries == 0,
     "applies to sampling.engine=continuous (its prompt cache)"),
    ("sampling.max_rows_per_call", config.sampling.engine == "static" or config.sampling.max_rows_per_call == 0,
     "applies to sampling.engine=static; the continuous engine bounds its cache with sampling.max_slots"),
    ("sampling.gvm_stage1_samples", config.sampling.gvm_stage1_samples >= 1, "must be >= 1"),
    ("sampling.gvm_samples_per_prompt", config.sampling.gvm_samples_per_prompt >= 1, "must be >= 1"),
    ("sampling.gvm_alpha", config.sampling.gvm_alpha >= 0, "must be >= 0"),
    ("sampling.gvm_beta", math.isfinite(config.sampling.gvm_beta), "must be a finite number"),
    ("sampling.gvm_filter_threshold", 0 < config.sampling.gvm_filter_threshold <= 1,
     "must be in (0, 1] (1.0 disables the filter)"),
    ("sampling.gvm_filter_insufficient", config.sampling.gvm_filter_insufficient >= 0,
     "must be >= 0 (0 disables the filter)"),
    ("sampling.gvm_max_samples", config.sampling.gvm_max_samples >= 0, "must be >= 0 (0: no cap)"),
    ("sampling.gvm_refresh_every", config.sampling.gvm_refresh_every >= 1, "must be >= 1"),
    ("sampling.gvm_history_decay", 0 <= config.sampling.gvm_history_decay <= 1, "must be in [0, 1]"),
    ("sampling.gvm_history_probe", config.sampling.gvm_history_probe >= 0, "must be >= 0 (0: no probe)"),
    ("sampling.gvm_history_probe_visits", config.sampling.gvm_history_probe_visits >= 0,
     "must be >= 0 (0: no limit)"),
    ("sampling.gvm_rows_per_chunk", config.sampling.gvm_rows_per_chunk >= 0,
     "must be >= 0 (0: optim.micro_batch_size rows at a time)"),
    ("sampling.gvm_param_subset", bool(config.sampling.gvm_param_subset.strip(", ")),
     "must name at least one parameter path, e.g. 'embed' or 'embed,layers/q_proj'"),
    ]


def _combination_checks(config: RunConfig) -> list[tuple[str, bool, str]]:
    """Keys that combine sections: the algorithm against the sampling, the critic and the correction."""
    return [
    ("algorithm.dynamic_sampling", not (config.sampling.allocation == "gvm" and config.algorithm.dynamic_sampling),
     "cannot be combined with sampling.allocation=gvm (GVM already chooses how many samples each prompt gets)"),
    ("algorithm.gamma", 0 <= config.algorithm.gamma <= 1, "must be in [0, 1]"),
    ("algorithm.lam", 0 <= config.algorithm.lam <= 1, "must be in [0, 1]"),
    ("algorithm.kl_reward_coef", config.algorithm.kl_reward_coef >= 0, "must be >= 0"),
    ("algorithm.kl_reward_coef", config.algorithm.kl_reward_coef == 0 or uses_critic(config),
     "needs algorithm.advantage=gae (the KL penalty is part of the critic's token rewards)"),
    ("algorithm.rollout_correction_low", 0 <= config.algorithm.rollout_correction_low <= 1,
     "must be in [0, 1] (a token whose ratio is 1 keeps its weight)"),
    ("algorithm.rollout_correction_high", config.algorithm.rollout_correction_high >= 1,
     "must be >= 1 (a token whose ratio is 1 keeps its weight)"),
    ("algorithm.old_logp", not (config.algorithm.rollout_correction and config.algorithm.old_logp == "sampler"),
     "cannot be 'sampler' with algorithm.rollout_correction: the correction weighs the trainer's recomputed "
     "old log-probs against the sampler's (use 'auto' or 'recompute')"),
    ("algorithm.loss", not config.algorithm.rollout_correction
     or config.algorithm.loss not in ("clip_cov", "kl_cov"),
     "cannot be clip_cov or kl_cov with algorithm.rollout_correction: the trainer folds the weights into the "
     "advantages, which would change their covariance selection (and kl_cov's penalty is not linear in A)"),
    ("algorithm.prl_eta", config.algorithm.prl_eta is None or not uses_critic(config),
     "cannot be combined with algorithm.advantage=gae (both set per-token advantages)"),
    ("algorithm.agg", config.algorithm.agg not in ("prompt-mean", "prompt-mean-unbiased")
     or not uses_critic(config), "prompt-mean modes need sequence advantages, not algorithm.advantage=gae"),
    ("sampling.allocation", config.sampling.allocation != "gvm" or not uses_critic(config),
     "gvm cannot be combined with algorithm.advantage=gae (GVM allocates by sequence advantages)"),
    ]


def _critic_checks(config: RunConfig) -> list[tuple[str, bool, str]]:
    """critic: the value model's optimizer."""
    return [
    ("critic.source", bool(config.critic.source.strip()),
     "must be 'policy', 'bundled', an HF folder or a .gguf file"),
    ("critic.lr", config.critic.lr > 0, "must be > 0"),
    ("critic.warmup_steps", config.critic.warmup_steps >= 0, "must be >= 0"),
    ("critic.weight_decay", config.critic.weight_decay >= 0, "must be >= 0"),
    ("critic.grad_clip", config.critic.grad_clip > 0, "must be > 0"),
    ("critic.value_clip", config.critic.value_clip is None or config.critic.value_clip > 0,
     "must be > 0 (or null to disable)"),
    ]


def _train_checks(config: RunConfig) -> list[tuple[str, bool, str]]:
    """train: run length, evaluation and checkpoints."""
    return [
    ("train.steps", config.train.steps >= 0, "must be >= 0"),
    ("train.eval_problems", config.train.eval_problems >= 0, "must be >= 0"),
    ("train.eval_samples", config.train.eval_samples >= 1, "must be >= 1"),
    ("train.keep_checkpoints", config.train.keep_checkpoints >= 1, "must be >= 1"),
    ("train.save_concurrent_gb", config.train.save_concurrent_gb > 0, "must be > 0"),
    ("train.max_bad_steps", config.train.max_bad_steps >= 1, "must be >= 1"),
    ]


def _tools_checks(config: RunConfig) -> list[tuple[str, bool, str]]:
    """tools: tool-call limits and the sandbox."""
    return [
    ("tools.max_turns", config.tools.max_turns >= 0, "must be >= 0"),
    ("tools.max_observation_tokens", config.tools.max_observation_tokens >= 8, "must be >= 8"),
    ("tools.max_output_chars", config.tools.max_output_chars >= 16, "must be >= 16"),
    ("tools.timeout_s", config.tools.timeout_s > 0, "must be > 0"),
    ("tools.memory_mb", config.tools.memory_mb >= 64, "must be >= 64"),
    ("tools.workers", config.tools.workers >= 1, "must be >= 1"),
    ("tools.segment_iterations", config.tools.segment_iterations >= 1, "must be >= 1"),
    ("tools.malformed_penalty", config.tools.malformed_penalty >= 0, "must be >= 0"),
    ]


def _rollouts_checks(config: RunConfig) -> list[tuple[str, bool, str]]:
    """rollouts: the async schedule and the sampler's devices."""
    return [
    ("rollouts.max_staleness", config.rollouts.max_staleness >= 0, "must be >= 0 (0: the synchronous schedule)"),
    ("rollouts.sampler_devices", config.rollouts.sampler_devices >= 0, "must be >= 0 (0: share every device)"),
    ("rollouts.partial_lag", config.rollouts.partial_lag >= 0, "must be >= 0"),
    ("rollouts.partial_lag", config.rollouts.mode != "partial"
     or config.rollouts.partial_lag <= config.rollouts.max_staleness,
     "must be at most rollouts.max_staleness (a group's newest tokens are partial_lag versions old)"),
    ("rollouts.segment_iterations", config.rollouts.segment_iterations >= 1, "must be >= 1"),
    ("rollouts.recompute_cache", config.rollouts.mode == "partial" or not config.rollouts.recompute_cache,
     "applies to rollouts.mode=partial (the KV caches of responses continued under new weights)"),
    ("rollouts.mode", config.rollouts.mode != "partial" or not config.tools.env,
     "partial cannot be combined with tools.env yet (a conversation's turns end inside the sampler)"),
    ("rollouts.mode", config.rollouts.mode != "partial" or not config.algorithm.dynamic_sampling,
     "partial cannot be combined with algorithm.dynamic_sampling (a step takes the first prompts_per_step groups)"),
    ("rollouts.sampler_devices", config.rollouts.mode == "async" or config.rollouts.sampler_devices == 0,
     "applies to rollouts.mode=async (the synchronous loop samples on the trainer's devices)"),
    ("rollouts.sampler_mesh", config.rollouts.sampler_devices > 0 or not config.rollouts.sampler_mesh,
     "applies with rollouts.sampler_devices > 0 (the sampler's own devices)"),
    ("rollouts.mode", config.rollouts.mode == "sync" or config.sampling.allocation != "gvm",
     f"{config.rollouts.mode} cannot be combined with sampling.allocation=gvm yet (its gradient-norm pass runs on "
     "the trainer's parameters and devices)"),
    ("rollouts.sampler_devices", config.rollouts.sampler_devices == 0 or not config.lora.base_dtype,
     "cannot be combined with lora.base_dtype (a quantized base runs on one device only for now)"),
    ("rollouts.sampler_devices", config.rollouts.sampler_devices == 0 or config.sampling.dtype != "int8",
     "cannot be combined with sampling.dtype=int8 (a quantized sampler copy runs on one device only for now)"),
    ]


def _distill_checks(config: RunConfig) -> list[tuple[str, bool, str]]:
    """distill: the teacher and what its signal replaces."""
    d, algo = config.distill, config.algorithm
    alone = bool(d.teacher) and d.reward == "none"
    return [
    ("distill.coef", d.coef > 0, "must be > 0"),
    ("distill.adapter", bool(d.teacher) or not d.adapter, "applies with a distill.teacher"),
    ("distill.top_k", d.top_k >= 1, "must be >= 1 (the teacher's ids per position of distill.mode topk)"),
    ("distill.mode", bool(d.teacher) or d.mode == "sampled", "topk applies with a distill.teacher"),
    ("distill.reward", not alone or (algo.group_filter == "none" and not algo.dynamic_sampling),
     "none gives every sample reward 0: it cannot be combined with algorithm.group_filter mixed or "
     "dynamic_sampling (use reward add)"),
    ("distill.reward", not alone or config.sampling.allocation == "uniform",
     "none cannot be combined with sampling.allocation gvm (GVM allocates by the verifier's acceptance rates)"),
    ("distill.reward", not alone or not uses_critic(config),
     "none cannot be combined with algorithm.advantage gae (the critic learns the verifier's rewards)"),
    ("distill.teacher_dtype", d.teacher_dtype != "int8" or not config.train.mesh,
     "int8 (a quantized teacher) runs on one device only for now: leave train.mesh empty"),
    ]


# The checks in the order they are made: the first failing one is reported.
_CHECKS = (_model_checks, _optim_checks, _algorithm_checks, _sampling_checks, _combination_checks, _critic_checks,
           _train_checks, _tools_checks, _rollouts_checks, _distill_checks)


def _validate_lora(lora: LoraSection) -> None:
    if lora.rank < 0:
        raise ConfigError(f"config key 'lora.rank' must be >= 0 (0: no adapters), got {lora.rank!r}")
    if not lora.alpha > 0:
        raise ConfigError(f"config key 'lora.alpha' must be > 0, got {lora.alpha!r}")
    try:
        resolve_targets(lora.targets)
    except ValueError as err:
        raise ConfigError(f"config key 'lora.targets': {err}") from None
    if lora.base_dtype and not (lora.rank > 0 or lora.adapter):
        raise ConfigError(f"config key 'lora.base_dtype'={lora.base_dtype!r} quantizes the frozen base of a LoRA "
                          f"run: set lora.rank > 0 (or lora.adapter) too, or leave it empty")


def uses_critic(config: RunConfig) -> bool:
    """Whether the run trains a value model (PPO with a critic: algorithm.advantage gae)."""
    return config.algorithm.advantage == "gae"


def lora_enabled(config: RunConfig) -> bool:
    """Whether the run trains adapters (a rank or an adapter folder to continue from) instead of every weight."""
    return config.lora.rank > 0 or bool(config.lora.adapter)
