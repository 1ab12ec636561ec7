"""Tiny random `transformers` checkpoints for tests (needs torch; callers should importorskip it).

    path = make_tiny_hf_checkpoint(tmp_path, "llama", seed=0)
    config, params = jaxrl_llm.models.load_hf(path)
    model = load_torch_model(path)   # the transformers reference

Families: "llama" (GQA 4/2 heads, untied lm_head, Llama-3 RoPE scaling), "qwen2" (q/k/v biases,
tied embeddings), "qwen3" (q/k norm, head_dim 24 != hidden/heads, untied). WINDOWED_FAMILIES:
"mistral" (sliding window 5 on every layer), "gemma2" (window 4 on alternate layers, attention and final
logit soft-capping, query_pre_attn_scalar != head_dim), "gemma3_text" (window 4 on layers 0 and 2, q/k
norms, local RoPE base 10^4 and a linearly scaled global base 10^6). Their references run transformers'
eager attention. Weights are drawn wider than the default init and norms/biases are randomised too, so
every path moves the logits.

`tiny_sampler_model()` is the sampler tests' small jaxrl_llm model, without torch.
"""

from __future__ import annotations

import pathlib

FAMILIES = ("llama", "qwen2", "qwen3")
WINDOWED_FAMILIES = ("mistral", "gemma2", "gemma3_text")
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
    if family == "mistral":
        return transformers.MistralConfig(**_COMMON, tie_word_embeddings=False, rope_theta=10000.0, sliding_window=5)
    if family == "gemma2":
        return transformers.Gemma2Config(**_COMMON, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
                                         attn_logit_softcapping=5.0, final_logit_softcapping=4.0,
                                         tie_word_embeddings=True, pad_token_id=0)
    if family == "gemma3_text":
        return transformers.Gemma3TextConfig(
            **{**_COMMON, "num_hidden_layers": 3}, head_dim=24, query_pre_attn_scalar=16, sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            tie_word_embeddings=True, pad_token_id=0)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES + WINDOWED_FAMILIES}")


def _attn_kwargs(family: str) -> dict:
    """Eager attention for the windowed families: soft-capping and windows as the modeling code writes them."""
    return {"attn_implementation": "eager"} if family in WINDOWED_FAMILIES else {}


def make_tiny_torch_model(family: str, seed: int = 0):
    """A float32 transformers causal LM of `family` with seeded random weights (eval mode)."""
    import torch
    import transformers

    config = tiny_hf_config(family)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **_attn_kwargs(family))
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
    import json

    import torch
    import transformers

    family = json.loads((pathlib.Path(path) / "config.json").read_text())["model_type"]
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             **_attn_kwargs(family)).eval()


def transformers_greedy(model, prompt, max_new_tokens):
    """Greedy continuation of one prompt (batch 1: no padding) with every stop token disabled."""
    import torch

    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0, top_k=None,
                             top_p=None, temperature=None)
    return out[0, len(prompt):].tolist()


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


def random_tokens(batch: int, length: int, seed: int = 0):
    """int32 [batch, length] token ids in [3, VOCAB_SIZE) (ids below 3 are left to special tokens)."""
    import numpy as np

    return np.random.RandomState(seed).randint(3, VOCAB_SIZE, size=(batch, length)).astype(np.int32)


def position_ids(batch: int, length: int, start: int = 0):
    """int32 [batch, length]: start, start + 1, ... on every row."""
    import numpy as np

    return np.tile(np.arange(start, start + length, dtype=np.int32), (batch, 1))


def tiny_sampler_model(vocab_size: int = 64, **overrides):
    """(config, params) of a 2-layer GQA jaxrl_llm model (4 query / 2 KV heads of 8 dims, tied embedding) whose
    logits spread over a few nats (the embedding scaled up 3x), so sampled tokens differ by key: the sampler
    tests' model. Needs no torch."""
    import jax

    from jaxrl_llm.models import ModelConfig, init_params

    base = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, tie_word_embeddings=True, max_position_embeddings=512)
    config = ModelConfig(**{**base, **overrides})
    params = init_params(config, jax.random.key(0))
    params["embed"] = params["embed"] * 3.0
    return config, params
