"""HF checkpoints in and out: config translation, safetensors (single / sharded), save_hf -> transformers,
and the errors a bad checkpoint gives."""

import json
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxrl_llm.models import (
    ModelConfig,
    forward,
    init_params,
    load_hf,
    params_from_hf,
    params_to_hf,
    save_hf,
)
from jaxrl_llm.models.hf_io import hf_tensor_shapes

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16)
FAMILY_CONFIGS = {
    "llama": ModelConfig(**TINY, model_type="llama", rope_scaling=(
        ("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
        ("original_max_position_embeddings", 64), ("rope_type", "llama3"))),
    "qwen2": ModelConfig(**TINY, model_type="qwen2", attention_bias=True, tie_word_embeddings=True),
    "qwen3": ModelConfig(**TINY, model_type="qwen3", qk_norm=True, eos_token_id=(2, 5)),
}


def _positions(batch, length):
    return np.tile(np.arange(length, dtype=np.int32), (batch, 1))


def _copy_checkpoint(src, dst) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(src, dst))


# ---------------------------------------------------------------- config and tensor naming


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_config_round_trips_through_hf_dict(family):
    config = FAMILY_CONFIGS[family]
    d = config.to_hf_dict()
    assert d["architectures"] == [config.architecture] and d["model_type"] == family
    assert ModelConfig.from_hf_dict(d) == config
    assert hash(ModelConfig.from_hf_dict(d)) == hash(config)


def test_from_hf_dict_reads_nested_rope_parameters_and_defaults():
    d = {"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 12,
         "num_hidden_layers": 1, "num_attention_heads": 2, "eos_token_id": [3, 4],
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 2.0}}
    config = ModelConfig.from_hf_dict(d, param_dtype="bfloat16")
    assert config.head_dim == 4 and config.num_kv_heads == 2  # hidden/heads; kv heads default to heads
    assert config.rope_theta == 5e5
    assert config.rope_scaling == (("factor", 2.0), ("rope_type", "llama3"))
    assert config.attention_bias and not config.attention_out_bias and not config.qk_norm
    assert config.eos_token_id == (3, 4) and config.param_dtype == "bfloat16"


def test_from_hf_dict_rejects_unsupported_settings():
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    with pytest.raises(ValueError, match=r"'gpt2'.*supported: llama, qwen2, qwen3"):
        ModelConfig.from_hf_dict({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_scaling type 'dynamic'"):
        ModelConfig.from_hf_dict({**base, "model_type": "llama", "rope_scaling": {"rope_type": "dynamic"}})
    with pytest.raises(ValueError, match="missing required keys: hidden_size"):
        ModelConfig.from_hf_dict({k: v for k, v in {**base, "model_type": "llama"}.items() if k != "hidden_size"})


def test_transformers_tensor_names_and_shapes_match():
    pytest.importorskip("torch")
    from tiny_models import make_tiny_torch_model

    for family in ("llama", "qwen2", "qwen3"):
        model = make_tiny_torch_model(family)
        config = ModelConfig.from_hf_dict(model.config.to_dict())
        state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if config.tie_word_embeddings:
            state.pop("lm_head.weight")
        assert hf_tensor_shapes(config) == state, family


def test_params_round_trip_through_hf_layout():
    config = FAMILY_CONFIGS["qwen3"]
    params = init_params(config, jax.random.key(0))
    tensors = params_to_hf(config, params)
    # HF keeps linear weights [out, in]: q_proj of layer 1 is the transpose of our stacked [in, out].
    np.testing.assert_array_equal(tensors["model.layers.1.self_attn.q_proj.weight"],
                                  np.asarray(params["layers"]["q_proj"][1]).T)
    back = params_from_hf(config, tensors)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, back)


def test_init_params_follows_the_transformers_initialisation():
    config = FAMILY_CONFIGS["qwen2"].replace(param_dtype="bfloat16")
    params = init_params(config, jax.random.key(1))
    assert params["embed"].dtype == jnp.bfloat16
    assert "lm_head" not in params  # tied
    layers = params["layers"]
    assert layers["q_proj"].shape == (2, 64, 64) and layers["k_proj"].shape == (2, 64, 32)
    np.testing.assert_allclose(float(jnp.std(layers["gate_proj"].astype(jnp.float32))), 0.02, rtol=0.05)
    assert jnp.all(layers["attn_norm"] == 1) and jnp.all(layers["q_bias"] == 0)
    assert not jnp.array_equal(layers["q_proj"][0], layers["q_proj"][1])  # layers drawn independently


def test_params_from_hf_names_the_bad_tensor():
    config = FAMILY_CONFIGS["llama"]
    tensors = params_to_hf(config, init_params(config, jax.random.key(0)))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight.*shape \(96, 32\).*\(96, 64\)"):
        params_from_hf(config, {**tensors, "model.layers.1.mlp.up_proj.weight": np.zeros((96, 32), np.float32)})
    missing = dict(tensors)
    del missing["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.0.self_attn.k_proj.weight'"):
        params_from_hf(config, missing)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model.layers.0.self_attn.q_norm.weight'"):
        params_from_hf(config, {**tensors, "model.layers.0.self_attn.q_norm.weight": np.ones(16, np.float32)})


# ---------------------------------------------------------------- loading checkpoints


def test_sharded_index_loads_the_same_params(tiny_checkpoint, tmp_path):
    from tiny_models import make_tiny_hf_checkpoint

    single = tiny_checkpoint("llama")
    sharded = make_tiny_hf_checkpoint(tmp_path, "llama", max_shard_size="60KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    assert not (sharded / "model.safetensors").exists()
    config_a, params_a = load_hf(single)
    config_b, params_b = load_hf(sharded)
    assert config_a == config_b
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params_a, params_b)


def test_load_hf_in_bfloat16(tiny_checkpoint):
    path = tiny_checkpoint("qwen2")
    config, params = load_hf(path, dtype="bfloat16")
    assert config.param_dtype == config.compute_dtype == "bfloat16"
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params))
    stored = load_file(str(path / "model.safetensors"))["model.layers.0.self_attn.v_proj.bias"]
    np.testing.assert_array_equal(np.asarray(params["layers"]["v_bias"][0]), stored.astype(ml_dtypes.bfloat16))


def test_load_hf_imports_neither_torch_nor_transformers(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    code = ("import sys; from jaxrl_llm.models import load_hf; load_hf(sys.argv[1]); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere: no such checkpoint directory"):
        load_hf(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"config.json: missing"):
        load_hf(tmp_path)


def test_unsupported_architecture_names_the_file(tiny_checkpoint, tmp_path):
    path = _copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"config.json: unsupported model_type 'gpt2'.*llama, qwen2, qwen3"):
        load_hf(path)


def test_config_weight_shape_mismatch_names_file_and_tensor(tiny_checkpoint, tmp_path):
    path = _copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' "
                                         r"has shape \(96, 64\) but the config implies \(80, 64\)"):
        load_hf(path)


def test_truncated_safetensors_names_the_file(tiny_checkpoint, tmp_path):
    path = _copy_checkpoint(tiny_checkpoint("qwen2"), tmp_path / "ckpt")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model.safetensors: not a readable safetensors file, truncated or corrupt"):
        load_hf(path)


def test_missing_weights_and_missing_tensor(tiny_checkpoint, tmp_path):
    path = _copy_checkpoint(tiny_checkpoint("qwen3"), tmp_path / "ckpt")
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"ckpt: missing tensor 'model.layers.1.self_attn.k_norm.weight'"):
        load_hf(path)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_hf(path)


def test_missing_shard_names_the_shard(tmp_path):
    pytest.importorskip("torch")
    from tiny_models import make_tiny_hf_checkpoint

    path = make_tiny_hf_checkpoint(tmp_path, "qwen2", max_shard_size="60KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=f"{shard}: missing safetensors file"):
        load_hf(path)


# ---------------------------------------------------------------- saving checkpoints


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_save_hf_then_transformers_gives_the_same_logits(family, tmp_path):
    pytest.importorskip("torch")
    from tiny_models import load_torch_model, torch_logits

    config = FAMILY_CONFIGS[family]
    params = init_params(config, jax.random.key(3))
    # widen the weights so the logits differ visibly between tokens
    params = jax.tree.map(lambda x: x * 6.0 if x.ndim == 3 or x.shape == (128, 64) else x, params)
    save_hf(tmp_path / "saved", config, params)
    written = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert written["architectures"] == [config.architecture]
    tokens = np.random.RandomState(0).randint(0, 128, (2, 9)).astype(np.int32)
    ours = np.asarray(forward(params, config, tokens, _positions(2, 9)))
    ref = torch_logits(load_torch_model(tmp_path / "saved"), tokens)
    assert np.abs(ref).max() > 0.5
    assert np.abs(ours - ref).max() <= 1e-4
    if config.rope_scaling:  # the comparison is sensitive to transformers honouring the llama3 scaling
        unscaled = np.asarray(forward(params, config.replace(rope_scaling=None), tokens, _positions(2, 9)))
        assert np.abs(unscaled - ref).max() > 1e-3
    reloaded_config, _ = load_hf(tmp_path / "saved")
    assert reloaded_config == config


def test_save_hf_bfloat16_round_trips_exactly(tmp_path):
    config = FAMILY_CONFIGS["llama"].replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    params = init_params(config, jax.random.key(4))
    save_hf(tmp_path, config, params)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    config_back, params_back = load_hf(tmp_path, dtype="bfloat16")
    assert config_back == config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params_back)


def test_save_hf_writes_tokenizer_files(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "hello": 1, "world": 2, "2+2": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    # llama: transformers 5 re-reads any tokenizer beside a qwen2 config.json as Qwen2Tokenizer
    config = FAMILY_CONFIGS["llama"]
    save_hf(tmp_path, config, init_params(config, jax.random.key(5)), tokenizer=tokenizer)
    reloaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert reloaded.encode("hello world 2+2 zzz", add_special_tokens=False) == [1, 2, 3, 0]
