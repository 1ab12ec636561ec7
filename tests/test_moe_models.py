"""Mixture-of-experts families against transformers on tiny random checkpoints that transformers itself made:
float32 logits, greedy decoding through the sampler against a float64 argmax loop, the sampler's log-probs
against the trainer's log-prob pass, and the checkpoint round trip (per-expert files as transformers writes
them, and the fused layout it holds in memory).

The checkpoints differ in what they exercise: Qwen3-MoE with 8 experts, 2 per token, no renormalisation
(norm_topk_prob false), q/k norms, a dense layer between two sparse ones (mlp_only_layers [1]) and an untied
head; Mixtral with 4 experts, 3 per token, renormalised, a sliding window of 5, tied embeddings; gpt-oss with 6
experts, 4 per token, router and expert biases, its clamped SwiGLU (gate/up weights drawn wide enough that a fifth
of the values pass the clamp at 7), attention sinks and biases, sliding (window 4) and full layers alternating, and
YaRN RoPE scaling. One compiled program per pass and family, shared by the tests (module-scoped fixtures)."""

import functools

import jax
import numpy as np
import pytest
from safetensors import safe_open

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxrl_llm.models import forward, load_hf, save_hf  # noqa: E402
from jaxrl_llm.models.hf_io import params_from_hf  # noqa: E402
from jaxrl_llm.sampling import FINISH_LENGTH, generate  # noqa: E402
from jaxrl_llm.train.logprobs import response_logprobs  # noqa: E402
from jaxrl_llm.train.packing import pack_groups, unpack  # noqa: E402

pytestmark = pytest.mark.reference
VOCAB = 96
TOL = 1e-4
forward_jit = jax.jit(forward, static_argnums=1)


def hf_config(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_hidden_layers=3, head_dim=16, intermediate_size=48,
                                           moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                                           norm_topk_prob=False, mlp_only_layers=[1], rope_theta=1e6,
                                           tie_word_embeddings=False)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, num_hidden_layers=2, intermediate_size=24, num_local_experts=4,
                                          num_experts_per_tok=3, sliding_window=5, rope_theta=1e4,
                                          tie_word_embeddings=True)
    if family == "gpt_oss":
        return transformers.GptOssConfig(**common, num_hidden_layers=3, head_dim=8, intermediate_size=16,
                                         num_local_experts=6, num_experts_per_tok=4, sliding_window=4,
                                         rope_parameters=dict(rope_type="yarn", factor=8.0, beta_fast=32.0,
                                                              beta_slow=1.0, truncate=False, rope_theta=150000.0,
                                                              original_max_position_embeddings=32),
                                         tie_word_embeddings=False)
    raise ValueError(family)


# transformers' own loops: eager attention (the sliding window as the modeling code writes it), eager experts
REFERENCE = dict(attn_implementation="eager", experts_implementation="eager")


def make_checkpoint(root, family: str, seed: int = 0):
    """A tiny random transformers model of `family` saved with save_pretrained: weights wider than the default
    init (router logits a few units apart, so no near-tie decides a route), norms around 1."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32, **REFERENCE)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            wide = name.endswith("experts.gate_up_proj")  # gpt-oss: values past its SwiGLU's clamp
            param.copy_(1.0 + 0.2 * noise if "norm" in name else (1.0 if wide else 0.15) * noise)
    path = root / family
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "gpt_oss"])
def family_model(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("moe"), request.param)
    config, params = load_hf(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **REFERENCE).eval()
    return request.param, path, config, params, reference


def torch_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long), use_cache=False).logits.numpy()


def tokens_of(batch, length, seed=0):
    return np.random.RandomState(seed).randint(3, VOCAB, size=(batch, length)).astype(np.int32)


def test_checkpoint_holds_what_the_family_writes(family_model):
    family, path, config, params, _ = family_model
    names = set(safe_open(str(path / "model.safetensors"), "np").keys())
    if family == "qwen3_moe":
        assert config.sparse_layers() == (True, False, True) and not config.norm_topk_prob
        assert "model.layers.0.mlp.experts.7.down_proj.weight" in names and "model.layers.1.mlp.up_proj.weight" in names
        assert "model.layers.0.mlp.gate.weight" in names and not any(".layers.1.mlp.experts" in n for n in names)
    elif family == "mixtral":
        assert config.sliding_window == 5 and config.num_experts_per_tok == 3 and config.tie_word_embeddings
        assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
    else:
        assert config.sliding_layers() == (True, False, True) and config.swiglu_limit == 7.0
        assert dict(config.rope_scaling)["rope_type"] == "yarn" and config.attention_sinks
        assert {"model.layers.2.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj_bias",
                "model.layers.0.mlp.router.bias", "model.layers.0.self_attn.sinks"} <= names


def test_logits_match_transformers(family_model):
    family, _, config, params, reference = family_model
    tokens = tokens_of(2, 13)
    positions = np.tile(np.arange(13, dtype=np.int32), (2, 1))
    ours = np.asarray(forward_jit(params, config, tokens, positions))
    ref = torch_logits(reference, tokens)
    assert np.abs(ref).max() > 1.0
    assert np.abs(ours - ref).max() <= TOL
    if family == "gpt_oss":  # the clamp is reached, and attention in tiles of 4 (the sinks start each row's sums)
        h = reference.model.layers[0].post_attention_layernorm(reference.model.embed_tokens(torch.as_tensor(tokens)))
        assert (torch.abs(h @ reference.model.layers[0].mlp.experts.gate_up_proj[0]) > 7).float().mean() > 0.1
        tiled = forward(params, config.replace(attention_block_size=4), tokens, positions)
        assert np.abs(np.asarray(tiled) - ref).max() <= TOL


def test_yarn_frequencies_and_attention_factor_equal_transformers(family_model):
    family, _, config, _, reference = family_model
    if family != "gpt_oss":
        pytest.skip("YaRN: gpt-oss's RoPE")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxrl_llm.models.layers import rope_attention_factor, rope_inv_freq

    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](reference.config)
    np.testing.assert_allclose(rope_inv_freq(config), inv_freq.numpy(), rtol=1e-6)
    assert rope_attention_factor(config) == pytest.approx(factor) == pytest.approx(0.1 * np.log(8.0) + 1)
    assert np.abs(rope_inv_freq(config) - rope_inv_freq(config.replace(rope_scaling=None))).max() > 0.01


@functools.lru_cache(maxsize=None)
def _float64_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **REFERENCE).eval()


@pytest.fixture(scope="module")
def greedy(family_model):
    """One greedy `generate` call per family, shared: 3 prompts (one longer than Mixtral's window), 12 tokens."""
    _, _, config, params, _ = family_model
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (4, 9, 2)]
    return prompts, generate(params, config, prompts, num_samples=1, max_new_tokens=12, temperature=0.0,
                             rng=jax.random.key(0))


def test_greedy_sampler_equals_a_float64_argmax_loop(family_model, greedy):
    """transformers' float64 model, the full forward over every prompt and its tokens so far at each step (the
    sequences right-padded into one batch: causal attention never reads the padding), its argmax appended: the
    sampler's greedy tokens."""
    _, path, _, _, _ = family_model
    model = _float64_model(str(path))
    prompts, out = greedy
    sequences, gaps = [list(p) for p in prompts], []
    for _ in range(out.tokens.shape[1]):
        width = max(map(len, sequences))
        tokens = np.array([q + [0] * (width - len(q)) for q in sequences])
        last = np.array([len(q) - 1 for q in sequences])
        with torch.no_grad():
            logits = model(input_ids=torch.as_tensor(tokens), use_cache=False).logits.numpy()
        logits = logits[np.arange(len(sequences)), last]
        top2 = np.sort(logits, axis=1)[:, -2:]
        gaps.append((top2[:, 1] - top2[:, 0]).min())
        for q, token in zip(sequences, logits.argmax(1)):
            q.append(int(token))
    # float32 rounding (<= 1e-4 on these logits) cannot flip an argmax whose top two are further apart
    assert min(gaps) > 1e-3
    assert (out.finish_reason == FINISH_LENGTH).all()
    for row, (prompt, sequence) in enumerate(zip(prompts, sequences)):
        assert out.tokens[out.prompt_index == row][0].tolist() == sequence[len(prompt):], row


def test_sampler_logprobs_equal_the_trainers_logprob_pass(family_model, greedy):
    """The sampler's log-probs of its (greedy) tokens against the trainer's log-prob pass over the packed rows."""
    _, _, config, params, _ = family_model
    prompts, out = greedy
    groups = [np.flatnonzero(out.prompt_index == g) for g in range(len(prompts))]
    batch = pack_groups(prompts, groups, out.tokens, out.lengths)
    trainer = unpack(np.asarray(jax.jit(response_logprobs, static_argnums=1)(params, config, batch)), groups,
                     len(out.lengths))
    on = out.mask > 0
    assert on.sum() == 36 and out.logprobs[on].min() < -1.0  # tokens the model was far from sure of
    np.testing.assert_allclose(trainer[on], out.logprobs[on], atol=2e-5)


def test_save_load_round_trip(family_model, tmp_path):
    _, _, config, params, reference = family_model
    save_hf(tmp_path / "saved", config, params)
    config_back, params_back = load_hf(tmp_path / "saved")
    assert config_back == config
    for got, want in zip(jax.tree.leaves(params_back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(got, want)
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32,
                                                              **REFERENCE).eval()
    tokens = tokens_of(1, 6, seed=5)
    np.testing.assert_array_equal(torch_logits(saved, tokens), torch_logits(reference, tokens))
    # the fused layout transformers holds in memory (gate_up_proj [E, 2F, D], down_proj [E, D, F]) reads the same
    fused = {name: tensor.numpy() for name, tensor in reference.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in fused)
    for got, want in zip(jax.tree.leaves(params_from_hf(config, fused)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(got, want)
