"""Tiny random `transformers` checkpoints for tests (needs torch; callers should importorskip it).

    path = make_tiny_hf_checkpoint(tmp_path, "llama", seed=0)
    config, params = jaxrl_llm.models.load_hf(path)
    model = load_torch_model(path)   # the transformers reference

Families: "llama" (GQA 4/2 heads, untied lm_head, Llama-3 RoPE scaling), "qwen2" (q/k/v biases,
tied embeddings), "qwen3" (q/k norm, head_dim 24 != hidden/heads, untied). Weights are drawn wider
than the default init and norms/biases are randomised too, so every path moves the logits.
"""

from __future__ import annotations

import pathlib

FAMILIES = ("llama", "qwen2", "qwen3")
VOCAB_SIZE = 128

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_hf_config(family: str):
    """The transformers config object of a tiny model of `family`."""
    import transformers

    if family == "llama":
        return transformers.LlamaConfig(
            **_COMMON,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            # original length 64 puts some frequencies in each of the three llama3 bands for head_dim 16
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=64),
        )
    if family == "qwen2":
        return transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True, rope_theta=1000000.0)
    if family == "qwen3":
        return transformers.Qwen3Config(**_COMMON, head_dim=24, tie_word_embeddings=False, rope_theta=50000.0)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def make_tiny_torch_model(family: str, seed: int = 0):
    """A float32 transformers causal LM of `family` with seeded random weights (eval mode)."""
    import torch
    import transformers

    config = tiny_hf_config(family)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.3 * noise)
            else:
                param.copy_(0.15 * noise)
    return model.eval()


def make_tiny_hf_checkpoint(tmp_path, family: str, seed: int = 0, max_shard_size=None) -> pathlib.Path:
    """Save a tiny random `family` model with save_pretrained (safetensors) under tmp_path/family-seed
    and return that directory. `max_shard_size` (e.g. "40KB") writes a sharded index instead."""
    path = pathlib.Path(tmp_path) / f"{family}-{seed}" if max_shard_size is None else \
        pathlib.Path(tmp_path) / f"{family}-{seed}-sharded"
    model = make_tiny_torch_model(family, seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return path


def load_torch_model(path):
    """transformers' float32 reference model for a checkpoint directory."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def torch_logits(model, tokens, positions=None, attention_mask=None):
    """Reference logits as a float32 numpy array [B, T, V]."""
    import numpy as np
    import torch

    kwargs = {"input_ids": torch.as_tensor(np.asarray(tokens), dtype=torch.long)}
    if positions is not None:
        kwargs["position_ids"] = torch.as_tensor(np.asarray(positions), dtype=torch.long)
    if attention_mask is not None:
        kwargs["attention_mask"] = torch.as_tensor(np.asarray(attention_mask), dtype=torch.long)
    with torch.no_grad():
        return model(**kwargs, use_cache=False).logits.float().numpy()
