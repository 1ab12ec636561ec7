"""ModelConfig: one frozen description of the Llama 3 / SmolLM2, Qwen2 / Qwen2.5, Qwen3, Mistral, Gemma 2
and Gemma 3 (text) decoders, and of the Qwen3-MoE, Mixtral and gpt-oss mixtures of experts.

The fields mirror the `transformers` config.json keys of those families; `from_hf_dict` and
`to_hf_dict` translate between the two so checkpoints round-trip through `transformers`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "qwen3_moe", "mixtral",
                         "gpt_oss")
# Families whose feed-forward block may be a mixture of experts (`models.moe`).
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "gpt_oss")
# Gemma's layer: RMSNorm scaling by (1 + w), embeddings times sqrt(hidden), GeGLU (tanh GELU) MLP, and
# norms after attention and after the MLP as well as before them.
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")
_DTYPES = ("float32", "bfloat16")
# What a rematerialised layer keeps for the backward pass: "full" keeps only its input (recomputes
# everything), "dots" also keeps the outputs of matmuls without batch dimensions (the projections),
# "qkv_attn_mlp" keeps q, k, v after RoPE, the attention output and the MLP's gate and up projections
# (recomputes the norms, RoPE, attention scores and softmax, and SiLU: little compute, less memory than no remat).
REMAT_POLICIES = ("full", "dots", "qkv_attn_mlp")
# How training rows attend (`models.attention`).
ATTENTION_IMPLS = ("auto", "xla", "splash", "cudnn")
# How the experts' grouped matmuls run (`models.moe.expert_mlp`).
MOE_IMPLS = ("auto", "ragged_dot", "tiles")
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


# Gemma3TextConfig's defaults: the image-text Gemma 3 checkpoints (model_type "gemma3") write a text_config
# holding only the values that differ from them.
_GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                             sliding_window=4096, max_position_embeddings=131072, rope_theta=1000000.0,
                             rope_local_base_freq=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                             hidden_activation="gelu_pytorch_tanh")


# Families that read `sliding_window` from config.json, and those with Qwen3's q/k norms.
_WINDOWED_MODEL_TYPES = ("mistral", "mixtral", "gpt_oss", *GEMMA_MODEL_TYPES)
_QK_NORM_MODEL_TYPES = ("qwen3", "gemma3_text", "qwen3_moe")


def _expert_fields(model_type: str, d: dict) -> dict:
    """The ModelConfig expert fields of a config.json dict, with transformers' defaults for absent keys
    (Qwen3MoeConfig: 128 experts, 8 per token, width 768, no renormalisation; MixtralConfig: 8 experts, 2 per
    token, width `intermediate_size`, always renormalised)."""
    if model_type == "qwen3_moe":
        return dict(num_experts=d.get("num_experts", d.get("num_local_experts", 128)),
                    num_experts_per_tok=d.get("num_experts_per_tok", 8),
                    moe_intermediate_size=d.get("moe_intermediate_size", 768),
                    norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                    decoder_sparse_step=d.get("decoder_sparse_step") or 1,
                    mlp_only_layers=tuple(d.get("mlp_only_layers") or ()))
    if model_type == "mixtral":
        return dict(num_experts=d.get("num_local_experts", d.get("num_experts", 8)),
                    num_experts_per_tok=d.get("num_experts_per_tok", 2))
    if model_type == "gpt_oss":  # GptOssConfig: 128 experts, 4 per token (the released files say experts_per_token)
        return dict(num_experts=d.get("num_local_experts", d.get("num_experts", 128)),
                    num_experts_per_tok=d.get("num_experts_per_tok", d.get("experts_per_token", 4)),
                    swiglu_limit=float(d.get("swiglu_limit", 7.0)), swiglu_alpha=float(d.get("swiglu_alpha", 1.702)))
    return {}


# GptOssConfig's defaults where a config.json leaves them out: RoPE base 150000 with YaRN scaling 32 from 4096,
# sliding (128) and full layers alternating from layer 0.
_GPT_OSS_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                     original_max_position_embeddings=4096)


def _hashable(value: Any) -> Any:
    """Turn lists / dicts from JSON into tuples so the config stays hashable (a jit static arg)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters. Frozen and hashable so it can be a `jax.jit` static argument.

    `rope_scaling` is None or a sorted tuple of (key, value) pairs, e.g. for Llama 3.1
    (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
     ("original_max_position_embeddings", 8192), ("rope_type", "llama3")).
    `attention_bias` adds q/k/v biases (always on for Qwen2); `attention_out_bias` adds an o_proj
    bias (Llama / Qwen3 with `attention_bias: true` in config.json); `qk_norm` is Qwen3's RMSNorm
    over head_dim applied to q and k before RoPE (also Gemma 3's).

    Gemma 2 / 3 and Mistral: `query_pre_attn_scalar` sets the attention scale to its inverse square root
    (None: 1/sqrt(head_dim)); `attn_logit_softcapping` c maps attention scores s to c tanh(s / c) and
    `final_logit_softcapping` does the same to the output logits (None: off). `sliding_window` w lets a
    query at position p see keys at positions p - w < q <= p on the sliding layers: those named
    "sliding_attention" in `layer_types` (one entry per layer), or every layer when `layer_types` is None
    (Mistral). `rope_local_theta` (Gemma 3) is the RoPE base of the sliding layers, which then take no
    `rope_scaling`; None: the sliding layers rotate as the full ones.

    Mixtures of experts (`models.moe`; `num_experts` > 0, Qwen3-MoE and Mixtral): a sparse layer's feed-forward
    block routes each token to its `num_experts_per_tok` best of `num_experts` experts (SwiGLU MLPs of width
    `moe_intermediate_size`, None: `intermediate_size`), weighted by the softmax of the router's logits over all
    experts at the chosen ones, renormalised over the chosen ones when `norm_topk_prob` (always for Mixtral).
    Layer i is sparse unless i is in `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`
    (Qwen3-MoE's rule); the other layers keep the dense MLP of width `intermediate_size`. `moe_impl` (one of
    MOE_IMPLS, a runtime setting) picks how the experts' grouped matmuls run (`models.moe.expert_mlp`).

    gpt-oss (`model_type` "gpt_oss") adds biases to the router and the experts, clamps the experts' SwiGLU
    (`swiglu_limit`, `swiglu_alpha`: `models.moe.swiglu`), and gives every attention head a learned sink logit
    in its softmax's denominator (`attention_sinks`); its layers alternate sliding and full attention
    (`layer_types`) and its RoPE is YaRN-scaled (`rope_scaling` rope_type "yarn").

    `remat` recomputes each layer in the backward pass (`jax.checkpoint`); `remat_policy` (one of
    REMAT_POLICIES) says what the layer saves.
    `attention_block_size` (None or a positive int) computes full-sequence attention in tiles of that
    many queries x keys with an online softmax, so no [B, H, T, T] scores are held (long packed rows);
    rows of fewer than `attention_block_min_length` tokens (default 0: none) still take full attention,
    which is faster on short rows (`attention_block_for`). The KV-cache path is unaffected. `scan_layers`
    runs the training forward's layers as one `lax.scan` (True, the default) or unrolled (False). `remat_logits` recomputes the output logits in the log-prob
    backward pass (`train.logprobs.chunked_logprobs` with keep_logits=False) instead of keeping them.
    `attention_impl` (one of ATTENTION_IMPLS) picks how training rows attend (`models.attention.resolve`: "auto"
    is Pallas splash attention where the program is lowered for a TPU, cuDNN for a GPU, XLA on a CPU); `max_prompt_tokens` bounds
    a packed row's prompt (the data's bound: longer prompts are dropped), which sizes the fused kernels'
    regrouped rows. Like `remat` these are runtime settings: never read from or written to config.json.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "llama"
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: bool = False
    remat_policy: str = "full"
    attention_block_size: int | None = None
    attention_block_min_length: int = 0
    scan_layers: bool = True
    remat_logits: bool = False
    attention_impl: str = "auto"
    moe_impl: str = "auto"
    max_prompt_tokens: int | None = None

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"{name} must be one of {_DTYPES}, got {getattr(self, name)!r}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy must be one of {REMAT_POLICIES}, got {self.remat_policy!r}")
        block = self.attention_block_size
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
            raise ValueError(f"attention_block_size must be a positive int or None, got {block!r}")
        least = self.attention_block_min_length
        if isinstance(least, bool) or not isinstance(least, int) or least < 0:
            raise ValueError(f"attention_block_min_length must be an int >= 0, got {least!r}")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"scan_layers must be true or false, got {self.scan_layers!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {self.moe_impl!r}")
        self._check_experts()
        bound = self.max_prompt_tokens
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 1):
            raise ValueError(f"max_prompt_tokens must be a positive int or None, got {bound!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        # Normalise JSON containers so equal configs hash equally.
        object.__setattr__(self, "rope_scaling", _hashable(self.rope_scaling))
        object.__setattr__(self, "eos_token_id", _hashable(self.eos_token_id))
        object.__setattr__(self, "layer_types", _hashable(self.layer_types))
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {window!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
                raise ValueError(f"layer_types must list one of {LAYER_TYPES} for each of the {self.num_layers} "
                                 f"layers, got {self.layer_types!r}")
            if window is None and "sliding_attention" in self.layer_types:
                raise ValueError("layer_types names sliding_attention layers but sliding_window is None")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None, got {value!r}")
        rope_type = self.rope_scaling_dict().get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    def _check_experts(self) -> None:
        object.__setattr__(self, "mlp_only_layers", tuple(sorted(set(_hashable(self.mlp_only_layers or ())))))
        for name in ("num_experts", "num_experts_per_tok", "decoder_sparse_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "decoder_sparse_step" else 0):
                raise ValueError(f"{name} must be an int >= {1 if name == 'decoder_sparse_step' else 0}, got {value!r}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok!r}")
        width = self.moe_intermediate_size
        if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
            raise ValueError(f"moe_intermediate_size must be a positive int or None, got {width!r}")
        if any(not isinstance(i, int) or not 0 <= i < self.num_layers for i in self.mlp_only_layers):
            raise ValueError(f"mlp_only_layers must list layer indices in [0, {self.num_layers}), "
                             f"got {self.mlp_only_layers!r}")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def rope_scaling_dict(self) -> dict:
        return dict(self.rope_scaling) if self.rope_scaling else {}

    @property
    def architecture(self) -> str:
        return _ARCHITECTURES[self.model_type]

    @property
    def is_gemma(self) -> bool:
        """Gemma's layer: (1 + w) RMSNorm, sqrt(hidden)-scaled embeddings, GeGLU, sandwich norms."""
        return self.model_type in GEMMA_MODEL_TYPES

    @property
    def attention_scale(self) -> float:
        """The factor on q k^T: query_pre_attn_scalar^-1/2, else head_dim^-1/2."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def attention_sinks(self) -> bool:
        """Whether every attention head has a learned sink logit in its softmax's denominator (gpt-oss)."""
        return self.model_type == "gpt_oss"

    @property
    def expert_biases(self) -> bool:
        """Whether the router and the experts' projections carry biases (gpt-oss)."""
        return self.model_type == "gpt_oss" and self.num_experts > 0

    @property
    def expert_intermediate_size(self) -> int:
        """The width of one expert's SwiGLU: `moe_intermediate_size`, else `intermediate_size`."""
        return self.moe_intermediate_size or self.intermediate_size

    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its feed-forward block is the mixture of experts (else the dense MLP): every layer
        i not in `mlp_only_layers` with (i + 1) a multiple of `decoder_sparse_step`, when `num_experts` > 0."""
        return tuple(self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                     for i in range(self.num_layers))

    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends within `sliding_window` only."""
        if self.sliding_window is None:
            return (False,) * self.num_layers
        if self.layer_types is None:
            return (True,) * self.num_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @classmethod
    def from_hf_dict(cls, d: dict, **overrides) -> "ModelConfig":
        """Build from a transformers config.json dict; `overrides` replace any field afterwards. An
        image-text Gemma 3 config ("gemma3") gives its text model's ("gemma3_text", from text_config)."""
        model_type = d.get("model_type")
        if model_type == "gemma3":
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise ValueError("a gemma3 config needs a text_config mapping (the text model's settings)")
            tokens = {k: d[k] for k in ("bos_token_id", "eos_token_id") if k in d}
            # newer files write the whole text_config (rope_parameters instead of rope_theta): no defaults then
            defaults = {} if "rope_parameters" in text else _GEMMA3_TEXT_DEFAULTS
            return cls.from_hf_dict({**defaults, **tokens, **text, "model_type": "gemma3_text"}, **overrides)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r} in config; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for key in ("mlp_bias", "use_sliding_window"):
            if d.get(key):
                raise ValueError(f"config option {key}=true is not supported for {model_type}")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise ValueError(f"config is missing required keys: {', '.join(missing)}")
        num_heads = d["num_attention_heads"]
        activation = d.get("hidden_activation") or d.get("hidden_act")
        expected_activation = ("gelu_pytorch_tanh", "gelu_tanh") if model_type in GEMMA_MODEL_TYPES else ("silu",)
        if activation is not None and activation not in expected_activation:
            raise ValueError(f"hidden activation {activation!r} is not supported for {model_type}; "
                             f"expected {expected_activation[0]!r}")
        if d.get("use_bidirectional_attention"):
            raise ValueError(f"config option use_bidirectional_attention=true is not supported for {model_type}")
        rope_params = d.get("rope_parameters") or {}  # newer transformers nest RoPE settings here
        local_rope = {}
        if "full_attention" in rope_params:  # Gemma 3 in newer transformers: one entry per layer type
            local_rope = rope_params.get("sliding_attention") or {}
            rope_params = rope_params["full_attention"] or {}
        rope_theta = d.get("rope_theta", rope_params.get("rope_theta", 150000.0 if model_type == "gpt_oss" else 10000.0))
        rope_scaling = d.get("rope_scaling")
        if model_type == "gpt_oss" and rope_scaling is None and not rope_params:
            rope_scaling = dict(_GPT_OSS_ROPE)
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_scaling.setdefault("rope_type", rope_scaling.pop("type", "default"))
            rope_scaling.pop("type", None)
            if rope_scaling["rope_type"] == "default":
                rope_scaling = None
        rope_local_theta = None
        if model_type == "gemma3_text":
            rope_local_theta = float(d.get("rope_local_base_freq", local_rope.get("rope_theta", 10000.0)))
        sliding_window = d.get("sliding_window", 128 if model_type == "gpt_oss" else None) \
            if model_type in _WINDOWED_MODEL_TYPES else None
        layer_types = d.get("layer_types")
        num_layers = d["num_hidden_layers"]
        if sliding_window is None:
            layer_types = None
        elif layer_types is None and model_type == "gemma2":  # older config.json: every other layer, from 0
            layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        elif layer_types is None and model_type == "gpt_oss":  # GptOssConfig's default: sliding from layer 0
            layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        elif layer_types is None and model_type == "gemma3_text":  # older config.json: a global layer every n
            pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        has_bias = bool(d.get("attention_bias", model_type == "gpt_oss"))
        fields = dict(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and never an o_proj bias; Llama/Qwen3 put both behind one flag.
            attention_bias=True if model_type == "qwen2" else has_bias,
            attention_out_bias=False if model_type == "qwen2" else has_bias,
            qk_norm=model_type in _QK_NORM_MODEL_TYPES,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            query_pre_attn_scalar=d.get("query_pre_attn_scalar") if model_type in GEMMA_MODEL_TYPES else None,
            attn_logit_softcapping=d.get("attn_logit_softcapping"),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            sliding_window=sliding_window,
            layer_types=layer_types,
            rope_local_theta=rope_local_theta,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            **_expert_fields(model_type, d),
        )
        fields.update(overrides)
        return cls(**fields)

    def attention_block_for(self, length: int) -> int | None:
        """The attention tile size for rows of `length` tokens: `attention_block_size`, or None (full
        attention) when it is unset or the rows are shorter than `attention_block_min_length`."""
        return None if length < self.attention_block_min_length else self.attention_block_size

    def to_hf_dict(self) -> dict:
        """A transformers config.json dict (with `architectures`) for this model."""
        self._check_hf_representable()
        d = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "gelu_pytorch_tanh" if self.is_gemma else "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict() or None,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": self.param_dtype,
            "use_cache": True,
        }
        if self.model_type == "qwen2":
            d["use_sliding_window"] = False
        if self.model_type in _WINDOWED_MODEL_TYPES:
            d["sliding_window"] = self.sliding_window
        if self.is_gemma:
            d["hidden_activation"] = d["hidden_act"]
            d["query_pre_attn_scalar"] = self.query_pre_attn_scalar or self.head_dim
            d["attn_logit_softcapping"] = self.attn_logit_softcapping
            d["final_logit_softcapping"] = self.final_logit_softcapping
            d["layer_types"] = ["sliding_attention" if s else "full_attention" for s in self.sliding_layers()]
        if self.model_type == "gemma3_text":
            d["rope_local_base_freq"] = self.rope_local_theta or self.rope_theta
        if self.model_type not in ("qwen2", "mixtral"):
            d["attention_bias"] = self.attention_out_bias
            d["mlp_bias"] = False
        if self.model_type == "qwen3_moe":
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.expert_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                     decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                     use_sliding_window=False)
        if self.model_type == "mixtral":
            d.update(num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok)
        if self.model_type == "gpt_oss":
            d.update(num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha,
                     layer_types=["sliding_attention" if s else "full_attention" for s in self.sliding_layers()])
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            eos = self.eos_token_id
            d["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
        return d

    def _check_hf_representable(self) -> None:
        """transformers ties some options to the family; refuse combinations it cannot express."""
        if self.qk_norm != (self.model_type in _QK_NORM_MODEL_TYPES):
            raise ValueError(f"qk_norm={self.qk_norm} cannot be expressed for model_type {self.model_type!r}")
        if self.model_type == "qwen2":
            ok = self.attention_bias and not self.attention_out_bias
        else:
            ok = self.attention_bias == self.attention_out_bias
        if not ok:
            raise ValueError(
                f"attention_bias={self.attention_bias}, attention_out_bias={self.attention_out_bias} "
                f"cannot be expressed for model_type {self.model_type!r}"
            )
        gemma_only = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")
        if not self.is_gemma and any(getattr(self, name) is not None for name in gemma_only):
            raise ValueError(f"{', '.join(gemma_only)} cannot be expressed for model_type {self.model_type!r}")
        if self.model_type not in _WINDOWED_MODEL_TYPES and self.sliding_window is not None:
            raise ValueError(f"sliding_window cannot be expressed for model_type {self.model_type!r}")
        if self.model_type in ("mistral", "mixtral") and len(set(self.sliding_layers())) > 1:
            raise ValueError(f"model_type {self.model_type!r} slides the window on every layer or none; "
                             "layer_types mixes them")
        self._check_experts_representable()
        if self.rope_local_theta is not None and self.model_type != "gemma3_text":
            raise ValueError(f"rope_local_theta cannot be expressed for model_type {self.model_type!r}")

    def _check_experts_representable(self) -> None:
        if self.num_experts and self.model_type not in MOE_MODEL_TYPES:
            raise ValueError(f"experts (num_experts={self.num_experts}) cannot be expressed for model_type "
                             f"{self.model_type!r}; families with experts: {', '.join(MOE_MODEL_TYPES)}")
        if (self.swiglu_limit is not None) != (self.model_type == "gpt_oss"):
            raise ValueError(f"swiglu_limit={self.swiglu_limit} cannot be expressed for model_type {self.model_type!r}: "
                             "gpt-oss always clamps its experts' SwiGLU, the other families never")
        if self.model_type == "gpt_oss":
            if not (self.num_experts and self.norm_topk_prob and all(self.sparse_layers())
                    and self.attention_bias and self.moe_intermediate_size in (None, self.intermediate_size)):
                raise ValueError("model_type 'gpt_oss' has experts on every layer, renormalised over the chosen ones, "
                                 "of width intermediate_size, and attention biases")
            return
        if self.model_type != "mixtral":
            return
        if not self.num_experts:
            raise ValueError("model_type 'mixtral' needs num_experts > 0")
        if self.attention_bias:
            raise ValueError("model_type 'mixtral' has no attention biases")
        if not self.norm_topk_prob or self.decoder_sparse_step != 1 or self.mlp_only_layers:
            raise ValueError("model_type 'mixtral' renormalises the chosen experts' weights (norm_topk_prob) and "
                             "makes every layer sparse (decoder_sparse_step 1, no mlp_only_layers)")
        if self.moe_intermediate_size not in (None, self.intermediate_size):
            raise ValueError("model_type 'mixtral' has one MLP width: moe_intermediate_size must be None or "
                             "intermediate_size")
