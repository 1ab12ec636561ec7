"""Decoder models: config, pure-functional forward with KV cache, HF checkpoints, sharding rules.

`load_gguf`, `load_bundled`, `bundled_gguf_path`, `Tokenizer` and the Flax modules (`Decoder`,
`DecoderLayer`, `ValueModel`, `logical_axis_rules`) are resolved on first use from their own modules,
so importing this package stays light.
"""

import importlib
import importlib.util

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.hf_io import (is_hf_value_model, load_hf, load_hf_value, params_from_hf, params_to_hf, save_hf,
                                    save_hf_value)
from jaxrl_llm.models.model import (
    KVCache,
    decoder_layer,
    embed_tokens,
    forward,
    forward_cached,
    hidden_states,
    init_cache,
    init_params,
    layer_constants,
    output_logits,
)

_LAZY = {
    "load_gguf": "jaxrl_llm.models.gguf",
    "load_bundled": "jaxrl_llm.models.bundled",
    "bundled_gguf_path": "jaxrl_llm.models.bundled",
    "Tokenizer": "jaxrl_llm.models.tokenizer",
    "Decoder": "jaxrl_llm.models.flax_modules",
    "DecoderLayer": "jaxrl_llm.models.flax_modules",
    "ValueModel": "jaxrl_llm.models.flax_modules",
    "logical_axis_rules": "jaxrl_llm.models.flax_modules",
}

__all__ = [
    "ModelConfig", "init_params", "forward", "forward_cached", "hidden_states", "output_logits",
    "KVCache", "init_cache", "embed_tokens", "decoder_layer", "layer_constants", "params_from_hf", "params_to_hf", "load_hf", "save_hf",
    "load_hf_value", "save_hf_value", "is_hf_value_model",
    *(name for name, module in _LAZY.items() if importlib.util.find_spec(module) is not None),
]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxrl_llm.models' has no attribute {name!r}")
