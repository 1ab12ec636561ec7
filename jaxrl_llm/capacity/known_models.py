"""Model shapes the capacity planners know by name: the config.json values of the models the presets train, for a
`model.source` without a config.json on this machine (`model_config_for`)."""

from __future__ import annotations

import json
import pathlib

from jaxrl_llm.models.config import ModelConfig

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
# The mixtures of experts of the MoE presets: Qwen/Qwen3-30B-A3B's config.json (48 sparse layers of 128 experts, 8 per
# token, renormalised) and openai/gpt-oss-20b's (24 layers of 32 experts, 4 per token, sliding (128) and full attention
# alternating, YaRN x32 over 4096 positions), through the same reader as a checkpoint's config.json.
KNOWN_MODELS["qwen3-30b-a3b"] = ModelConfig.from_hf_dict(dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
    attention_bias=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[]))
KNOWN_MODELS["gpt-oss-20b"] = ModelConfig.from_hf_dict(dict(
    model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=201088, hidden_size=2880,
    intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
    rope_theta=150000.0, rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "truncate": False, "original_max_position_embeddings": 4096},
    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True,
    sliding_window=128, layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
    num_local_experts=32, num_experts_per_tok=4, swiglu_limit=7.0))
for _name, _alias in (("smollm2-135m-instruct", "bundled"), ("gemma-2-2b", "gemma-2-2b-it"), ("gemma-3-1b-pt", "gemma-3-1b-it"),
                      ("gemma-3-4b-pt", "gemma-3-4b-it"), ("mistral-7b-v0.1", "mistral-7b-instruct-v0.1"),
                      ("gpt-oss-20b", "gpt-oss-20b-bf16")):
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
