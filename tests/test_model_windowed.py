"""Mistral, Gemma 2 and Gemma 3 (text) against transformers (float32, eager attention) on tiny random
checkpoints whose sliding windows (4 and 5) are shorter than the sequences: the full forward, packed rows,
the KV cache and the sampler's cache token by token, greedy generation, the log-prob pass, save_hf."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")

from tiny_models import (WINDOWED_FAMILIES, load_torch_model, position_ids, random_tokens,  # noqa: E402
                         torch_logits, transformers_greedy)

from jaxrl_llm.models import (ModelConfig, forward, forward_cached, hidden_states, init_cache, load_hf,  # noqa: E402
                              save_hf)
from jaxrl_llm.sampling import FINISH_LENGTH, generate  # noqa: E402
from jaxrl_llm.sampling.decoder import (RowCache, decode_step, empty_row_cache, prefill_cache,  # noqa: E402
                                        unstack_layers)
from jaxrl_llm.train.logprobs import chunked_logprobs, row_logprobs  # noqa: E402

pytestmark = pytest.mark.reference
TOL = 1e-4
LENGTH = 13  # longer than every window
forward_jit = jax.jit(forward, static_argnums=1)
hidden_jit = jax.jit(hidden_states, static_argnums=1)


@pytest.fixture(scope="module", params=WINDOWED_FAMILIES)
def family_model(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    config, params = load_hf(path)
    return config, params, load_torch_model(path)


def test_config_reads_the_family_settings(family_model):
    config, _, _ = family_model
    expected = {
        "mistral": dict(sliding_window=5, layer_types=None, qk_norm=False, final_logit_softcapping=None),
        "gemma2": dict(sliding_window=4, layer_types=("sliding_attention", "full_attention"), qk_norm=False,
                       attn_logit_softcapping=5.0, final_logit_softcapping=4.0, query_pre_attn_scalar=24),
        "gemma3_text": dict(sliding_window=4, qk_norm=True, rope_local_theta=10000.0, rope_theta=1e6,
                            rope_scaling=(("factor", 2.0), ("rope_type", "linear")), query_pre_attn_scalar=16,
                            layer_types=("sliding_attention", "full_attention", "sliding_attention")),
    }[config.model_type]
    assert {k: getattr(config, k) for k in expected} == expected
    assert config.sliding_layers() == {"mistral": (True, True), "gemma2": (True, False),
                                       "gemma3_text": (True, False, True)}[config.model_type]


def test_full_forward_matches_transformers(family_model):
    config, params, torch_model = family_model
    tokens = random_tokens(2, LENGTH)
    ours = np.asarray(forward_jit(params, config, tokens, position_ids(2, LENGTH)))
    ref = torch_logits(torch_model, tokens)
    assert np.abs(ref).max() > 1.0
    assert np.abs(ours - ref).max() <= TOL
    # The window is in effect: attending to every earlier key gives other logits after position 4.
    unwindowed = np.asarray(forward_jit(params, config.replace(sliding_window=None, layer_types=None), tokens,
                                        position_ids(2, LENGTH)))
    assert np.abs(unwindowed - ref)[:, 6:].max() > 1e-2


@pytest.mark.parametrize("variant", [dict(scan_layers=False, remat=True),
                                     dict(attention_block_size=4, remat=True, remat_policy="dots")])
def test_unrolled_remat_and_blocked_forward_match_transformers(family_model, variant):
    config, params, torch_model = family_model
    tokens = random_tokens(2, LENGTH, seed=2)
    ours = np.asarray(forward_jit(params, config.replace(**variant), tokens, position_ids(2, LENGTH)))
    assert np.abs(ours - torch_logits(torch_model, tokens)).max() <= TOL


def test_hidden_states_match_transformers_last_hidden_state(family_model):
    import torch

    config, params, torch_model = family_model
    tokens = random_tokens(1, LENGTH, seed=3)
    ours = np.asarray(hidden_jit(params, config, tokens, position_ids(1, LENGTH)))
    with torch.no_grad():
        ref = torch_model.model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).last_hidden_state.numpy()
    assert np.abs(ours - ref).max() <= TOL * max(1.0, np.abs(ref).max())


def test_packed_row_equals_separate_rows(family_model):
    """A prompt (segment 0) then two responses (segments 1, 2) that restart their positions after it."""
    config, params, _ = family_model
    prompt, first, second = random_tokens(1, 5, 4)[0], random_tokens(1, 7, 5)[0], random_tokens(1, 6, 6)[0]
    tokens = np.concatenate([prompt, first, second])[None]
    segments = np.array([[0] * 5 + [1] * 7 + [2] * 6], np.int32)
    positions = np.array([list(range(5)) + list(range(5, 12)) + list(range(5, 11))], np.int32)
    packed = np.asarray(hidden_states(params, config, tokens, positions, segment_ids=segments))[0]
    for response, start in ((first, 5), (second, 12)):
        row = np.concatenate([prompt, response])[None]
        alone = np.asarray(hidden_jit(params, config, row, position_ids(1, row.shape[1])))[0]
        # f32 rounding of rows of other lengths: 1.2e-5 on a value of 1.32 on an AMD EPYC (1e-5 held on Intel);
        # a wrong segment mask moves these hidden states by O(1)
        np.testing.assert_allclose(packed[start:start + len(response)], alone[5:], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(packed[:5], alone[:5], atol=1e-5, rtol=1e-5)


def test_kv_cache_token_by_token_matches_transformers(family_model):
    config, params, torch_model = family_model
    tokens = random_tokens(2, LENGTH, seed=7)
    ref = torch_logits(torch_model, tokens)
    cache = init_cache(config, 2, 16)
    step = jax.jit(forward_cached, static_argnums=1)
    logits, cache = step(params, config, tokens[:, :3], position_ids(2, 3), cache)  # a prefill chunk first
    out = [np.asarray(logits)]
    for t in range(3, LENGTH):
        logits, cache = step(params, config, tokens[:, t:t + 1], position_ids(2, 1, t), cache)
        out.append(np.asarray(logits))
    assert np.abs(np.concatenate(out, axis=1) - ref).max() <= TOL


def test_sampler_cache_token_by_token_matches_transformers(family_model):
    """The sampler's split cache (prompt bucket 8, response slots by step, a ring of `window` slots on the
    sliding layers, which 8 steps wrap around): prompts of 3 and 7 tokens, then 8 teacher-forced decode
    steps, each step's logits against the reference on the whole row."""
    config, params, torch_model = family_model
    lengths = np.array([3, 7], np.int32)
    rows = random_tokens(2, 7 + 8, seed=8)
    prompts = np.where(np.arange(8)[None] < lengths[:, None], np.pad(rows[:, :7], ((0, 0), (0, 1))), 0)
    logits, keys, values = jax.jit(prefill_cache, static_argnums=1)(params, config, jnp.asarray(prompts),
                                                                    jnp.asarray(lengths))
    cache = empty_row_cache(config, 2, 8, 8)._replace(prompt_k=tuple(keys), prompt_v=tuple(values))
    assert [k.shape[-1] for k in cache.response_k] == [
        config.sliding_window if sliding else 8 for sliding in config.sliding_layers()]
    layers = unstack_layers(params)
    decode = jax.jit(lambda c, tok, s: decode_step(params, layers, config, tok, jnp.asarray(lengths), s, c))
    ours = [np.asarray(logits)]  # [rows, V] at each row's last prompt token, then after each decoded token
    for step in range(8):
        fed = np.array([rows[r, lengths[r] + step] for r in range(2)], np.int32)
        logits, cache = decode(cache, jnp.asarray(fed), jnp.asarray(step))
        ours.append(np.asarray(logits))
    assert isinstance(cache, RowCache)
    for r in range(2):
        row = rows[r:r + 1, :lengths[r] + 8]
        ref = torch_logits(torch_model, row)[0, lengths[r] - 1:]
        assert np.abs(np.stack([o[r] for o in ours]) - ref).max() <= TOL, r


def test_greedy_generation_matches_transformers(family_model):
    config, params, torch_model = family_model
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, config.vocab_size, size=n).tolist() for n in (3, 9)]
    out = generate(params, config, prompts, num_samples=1, max_new_tokens=20, temperature=0.0,
                   rng=jax.random.key(0))
    assert (out.finish_reason == FINISH_LENGTH).all() and (out.lengths == 20).all()
    # Logits of the two implementations differ by rounding (<= TOL); the argmaxes still agree exactly since the top
    # two logits along these paths are >= 7e-3 apart (mistral; gemma2 0.09, gemma3 0.02).
    for row, p in enumerate(out.prompt_index):
        assert out.tokens[row].tolist() == transformers_greedy(torch_model, prompts[p], 20), (config.model_type, row)


def test_logprob_pass_matches_transformers(family_model):
    import torch

    config, params, torch_model = family_model
    tokens = random_tokens(2, LENGTH, seed=9)
    prompt_lens = np.array([4, 6], np.int32)
    response = np.stack([tokens[r, prompt_lens[r]:prompt_lens[r] + 6] for r in range(2)])
    ours = np.asarray(row_logprobs(params, config, jnp.asarray(tokens), jnp.asarray(prompt_lens),
                                   jnp.asarray(response), chunk=48))
    ref_logp = torch.log_softmax(torch.as_tensor(torch_logits(torch_model, tokens)), -1).numpy()
    ref = np.stack([[ref_logp[r, prompt_lens[r] - 1 + i, response[r, i]] for i in range(6)] for r in range(2)])
    assert np.abs(ours - ref).max() <= TOL


@pytest.mark.parametrize("keep_logits", [True, False])
def test_soft_capped_chunked_logprobs_and_gradients_match_direct_autodiff(keep_logits):
    """c tanh(z / c) inside the chunked log-softmax and its custom backward pass, against plain autodiff of
    log_softmax(c tanh(h W^T / c)) (with the entropy term)."""
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(2, 3, 8)) * 2.0, jnp.float32)
    head = jnp.asarray(rng.normal(size=(20, 8)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 20, size=(2, 3)), jnp.int32)
    cap = 3.0

    def direct(h, w):
        logits = cap * jnp.tanh(jnp.einsum("brd,vd->brv", h, w) / cap)
        logp = jax.nn.log_softmax(logits)
        entropy = -(jnp.exp(logp) * logp).sum(-1)
        return jnp.take_along_axis(logp, targets[..., None], -1)[..., 0], entropy

    def chunked(h, w):
        return chunked_logprobs(h, w, targets, chunk=7, with_entropy=True, keep_logits=keep_logits, softcap=cap)

    for fn in (direct, chunked):
        assert float(jnp.abs(jnp.einsum("brd,vd->brv", hidden, head)).max()) > 2 * cap  # the cap bites
    np.testing.assert_allclose(chunked(hidden, head)[0], direct(hidden, head)[0], atol=1e-5)
    np.testing.assert_allclose(chunked(hidden, head)[1], direct(hidden, head)[1], atol=1e-5)
    loss = lambda fn: lambda h, w: (fn(h, w)[0].sum() + 0.5 * fn(h, w)[1].sum())  # noqa: E731
    ours = jax.jit(jax.grad(loss(chunked), argnums=(0, 1)))(hidden, head)  # compiled: op by op, every primitive
    ref = jax.jit(jax.grad(loss(direct), argnums=(0, 1)))(hidden, head)  # of the backward would compile apart
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_save_hf_then_transformers_gives_the_same_logits(family_model, tmp_path):
    config, params, torch_model = family_model
    path = save_hf(tmp_path / config.model_type, config, params)
    tokens = random_tokens(2, LENGTH, seed=10)
    reloaded = load_torch_model(path)
    assert np.abs(torch_logits(reloaded, tokens) - torch_logits(torch_model, tokens)).max() <= TOL
    config_again, params_again = load_hf(path)
    assert config_again == config
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), params, params_again))


def test_legacy_gemma3_config_json_is_read():
    """config.json as the Gemma 3 checkpoints on the Hub write it (before transformers nested RoPE per
    layer type): rope_local_base_freq, sliding_window_pattern, rope_scaling."""
    raw = dict(model_type="gemma3_text", vocab_size=262208, hidden_size=2560, intermediate_size=10240,
               num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
               query_pre_attn_scalar=256, rope_theta=1000000.0, rope_local_base_freq=10000.0,
               rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024, sliding_window_pattern=6,
               hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None)
    config = ModelConfig.from_hf_dict(raw)
    assert config.sliding_layers() == (True,) * 5 + (False, True, True)
    assert (config.rope_local_theta, config.rope_theta, config.qk_norm) == (10000.0, 1e6, True)
    assert config.rope_scaling_dict() == {"factor": 8.0, "rope_type": "linear"}
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(config.to_hf_dict()))) == config
    legacy_gemma2 = dict(raw, model_type="gemma2", num_hidden_layers=4, final_logit_softcapping=30.0)
    del legacy_gemma2["rope_local_base_freq"], legacy_gemma2["rope_scaling"]
    assert ModelConfig.from_hf_dict(legacy_gemma2).sliding_layers() == (True, False, True, False)


def test_bad_family_settings_raise_clear_errors():
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                head_dim=4)
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig(**base, model_type="gemma2", sliding_window=4, layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match="sliding_window must be"):
        ModelConfig(**base, model_type="mistral", sliding_window=0)
    with pytest.raises(ValueError, match="hidden activation 'silu'"):
        ModelConfig.from_hf_dict(dict(model_type="gemma2", hidden_activation="silu", vocab_size=8, hidden_size=8,
                                      intermediate_size=8, num_hidden_layers=2, num_attention_heads=2))
    with pytest.raises(ValueError, match="cannot be expressed for model_type 'llama'"):
        ModelConfig(**base, final_logit_softcapping=30.0).to_hf_dict()


def test_image_text_gemma3_checkpoint_loads_its_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration folder (model_type "gemma3": text_config, tensors under
    language_model.model., a vision tower and projector beside them) loads as its text model, with the
    conditional model's logits on text."""
    import torch
    import transformers
    from tiny_models import make_tiny_torch_model, tiny_hf_config

    text = tiny_hf_config("gemma3_text")
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=1, image_token_index=127, boi_token_index=125,
                                       eoi_token_index=126)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    text_model = make_tiny_torch_model("gemma3_text", seed=3)
    model.model.language_model.load_state_dict(text_model.model.state_dict())
    model.save_pretrained(tmp_path / "gemma3")
    ours_config, params = load_hf(tmp_path / "gemma3")
    assert ours_config.model_type == "gemma3_text" and ours_config.layer_types == tuple(text.layer_types)
    tokens = random_tokens(1, LENGTH, seed=11)
    reloaded = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "gemma3", dtype=torch.float32,
                                                                          attn_implementation="eager").eval()
    ref = torch_logits(reloaded, tokens)
    assert np.abs(np.asarray(forward_jit(params, ours_config, tokens, position_ids(1, LENGTH))) - ref).max() <= TOL


def test_sparse_hub_gemma3_config_gives_the_4b_text_model():
    """google/gemma-3-4b-it's config.json writes only what differs from Gemma3TextConfig's defaults."""
    from jaxrl_llm.capacity.memory import KNOWN_MODELS

    raw = {"model_type": "gemma3", "eos_token_id": [1, 106],
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024}}
    config = ModelConfig.from_hf_dict(raw)
    assert config.eos_token_id == (1, 106)
    assert config.replace(eos_token_id=None) == KNOWN_MODELS["gemma-3-4b-it"]
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_hf_dict({"model_type": "gemma3"})
