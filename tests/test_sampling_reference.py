"""Greedy `generate` equals transformers `generate(do_sample=False)` token for token: tiny random
Llama and Qwen2 checkpoints, and (slow) the bundled SmolLM2-135M-Instruct."""

import jax
import numpy as np
import pytest

from jaxrl_llm.models import load_hf
from jaxrl_llm.sampling import FINISH_LENGTH, generate

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.reference

from tiny_models import transformers_greedy  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_matches_transformers_tiny(tiny_checkpoint, family):
    from tiny_models import load_torch_model

    path = tiny_checkpoint(family)
    config, params = load_hf(path)
    model = load_torch_model(path)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, config.vocab_size, size=n).tolist() for n in (5, 11, 3, 18)]
    out = generate(params, config, prompts, num_samples=[1, 2, 1, 1], max_new_tokens=16, temperature=0.0,
                   rng=jax.random.key(0))
    assert (out.finish_reason == FINISH_LENGTH).all() and (out.lengths == 16).all()
    # Another implementation, so logits differ by rounding (<= 1e-4, test_model_parity.py); the argmaxes still agree
    # exactly since the top two logits along these paths are >= 7e-4 (llama) and 1e-2 (qwen2) apart.
    for row, p in enumerate(out.prompt_index):
        assert out.tokens[row].tolist() == transformers_greedy(model, prompts[p], 16), (family, row)


@pytest.mark.slow
def test_greedy_matches_transformers_bundled_smollm2(tmp_path):
    from tiny_models import load_torch_model

    from jaxrl_llm.models import load_bundled, save_hf

    config, params, tokenizer = load_bundled()
    save_hf(tmp_path / "smollm2", config, params)
    model = load_torch_model(tmp_path / "smollm2")
    questions = ["What is 7 + 5?", "Name a primary colour."]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    out = generate(params, config, prompts, num_samples=1, max_new_tokens=20, temperature=0.0,
                   rng=jax.random.key(0))
    # The top two logits along these paths are >= 0.02 apart: rounding differences cannot flip an argmax.
    for row, prompt in enumerate(prompts):
        assert out.tokens[row].tolist() == transformers_greedy(model, prompt, 20), tokenizer.decode(out.tokens[row])
