"""The train-step benchmark's FLOP count (hand counts) and the model's rematerialisation policies."""

import importlib.util
import math
import pathlib
import re

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.models.model import param_shapes

_PATH = pathlib.Path(__file__).parent.parent / "benchmarks" / "train_step.py"
_spec = importlib.util.spec_from_file_location("train_step_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

# V=10, D=4, F=6, L=2, H=2 heads of hd=2 (q width 4), one KV head (k, v width 2).
HAND = models.ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=2, num_heads=2,
                          num_kv_heads=1, head_dim=2, tie_word_embeddings=True)


def test_flops_hand_count():
    # Per layer: q 4x4=16, k 4x2=8, v 4x2=8, o 4x4=16, gate/up/down 3 x 4x6=72 -> 120; two layers 240.
    assert bench.layer_matrix_params(HAND) == 240
    # 5 tokens, 3 scored, one causal row of 5 -> 15 pairs:
    # 6*240*5 = 7200, head 6*10*4*3 = 720, attention 12 * L2 * H2 * hd2 * 15 = 1440.
    assert bench.train_step_flops(HAND, tokens=5, scored=3, pairs=15) == 7200 + 720 + 1440


def test_flops_reduce_to_six_params_tokens():
    """Every position scored, no attention: 6 x (all matrix parameters, tied head once) x tokens."""
    shapes = jax.tree_util.tree_flatten_with_path(param_shapes(HAND), is_leaf=lambda x: isinstance(x, tuple))[0]
    matrices = sum(math.prod(s) for path, s in shapes if not path[-1].key.endswith("norm"))
    assert matrices == 240 + 40
    assert bench.train_step_flops(HAND, tokens=7, scored=7, pairs=0) == 6 * matrices * 7


def test_attended_pairs_causal_and_packed():
    assert bench.attended_pairs(np.arange(4)[None]) == 1 + 2 + 3 + 4
    # prompt (segment 0, positions 0, 1), response A (segment 1, positions 2, 3), response B (segment 2,
    # position 2): prompt tokens see 1 and 2 keys; A sees the prompt and itself (3, 4); B the prompt and
    # itself (3), not A's token at the same position.
    positions = np.array([[0, 1, 2, 3, 2]])
    segments = np.array([[0, 0, 1, 1, 2]])
    assert bench.attended_pairs(positions, segments) == 1 + 2 + 3 + 4 + 3
    assert bench.attended_pairs(np.tile(np.arange(3), (2, 1))) == 2 * 6


TINY = models.ModelConfig(vocab_size=37, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=4)


def _loss(params, config, tokens):
    logits = models.forward(params, config, tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape))
    return jnp.mean(jax.nn.log_softmax(logits)[..., 3])


def _saved_bytes(config, params, tokens, capsys) -> int:
    """Bytes of the residuals the VJP of the loss keeps (jax.ad_checkpoint.print_saved_residuals)."""
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(lambda p: _loss(p, config, tokens), params)
    total = 0
    for dtype, dims in re.findall(r"\b(f32|i32|bool)\[([\d,]*)\]", capsys.readouterr().out):
        total += math.prod(int(d) for d in dims.split(",") if d) * (1 if dtype == "bool" else 4)
    return total


def test_remat_policies_same_gradients_and_save_less(capsys):
    params = models.init_params(TINY, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, TINY.vocab_size)
    grad = jax.jit(jax.value_and_grad(_loss), static_argnums=1)
    plain_loss, plain_grad = grad(params, TINY, tokens)
    saved = {"off": _saved_bytes(TINY, params, tokens, capsys)}
    for policy in ("full", "qkv_attn_mlp", "dots"):
        config = TINY.replace(remat=True, remat_policy=policy)
        loss, g = grad(params, config, tokens)
        np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
        for a, b in zip(jax.tree_util.tree_leaves(plain_grad), jax.tree_util.tree_leaves(g)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
        saved[policy] = _saved_bytes(config, params, tokens, capsys)
    # Full remat keeps least (each layer's input); qkv_attn_mlp adds q, k, v after RoPE, the attention output,
    # gate and up; dots the projection outputs the backward pass reads (q, k, v before RoPE, gate, up and one
    # more D-wide output: as much here, where q's width is D); no remat keeps every activation.
    assert 0 < saved["full"] < saved["qkv_attn_mlp"] <= saved["dots"] < saved["off"]


def test_unknown_remat_policy_is_refused():
    with pytest.raises(ValueError, match="remat_policy"):
        TINY.replace(remat=True, remat_policy="everything")


def test_square_matmul_rates_from_timed_products():
    """2 n^3 FLOPs over the median time of each size; the peak is the best size."""
    import time

    rates = bench.square_matmul_rates(lambda n: (lambda: time.sleep(0.02 * n)), sizes=(1, 2), repeats=3)
    assert rates[1] == pytest.approx(2 / 0.02, rel=0.3) and rates[2] == pytest.approx(16 / 0.04, rel=0.3)
    assert rates["peak"] == rates[2]


def test_make_batch_packs_responses_after_each_prompt():
    # 2 rows of a 4-token prompt + 3 responses of 2 tokens: the packer's layout, and old log-probs that equal
    # each response's log-probs scored on its own row (prompt + that response), computed independently.
    config = TINY
    params = models.init_params(config, jax.random.PRNGKey(2))
    batch, tokens, adv, old = bench.make_batch(config, params, rows=2, seq_len=10, prompt_len=4, responses=3)
    np.testing.assert_array_equal(batch.tokens, tokens)
    np.testing.assert_array_equal(batch.segments[0], [0, 0, 0, 0, 1, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(batch.positions[0], [0, 1, 2, 3, 4, 5, 4, 5, 4, 5])
    assert batch.mask.shape == (2, 4, 2) and batch.mask[:, :3].all() and not batch.mask[:, 3].any()
    assert adv.shape == (6,) and set(np.unique(adv)) <= {-1.0, 1.0}
    np.testing.assert_array_equal(batch.advantages[:, :3, 0].reshape(-1), adv)
    for row in range(2):
        for s in range(3):
            alone = np.concatenate([tokens[row, :4], tokens[row, 4 + 2 * s:6 + 2 * s]])
            logp = jax.nn.log_softmax(models.forward(params, config, jnp.asarray(alone)[None], jnp.arange(6)[None]))
            expected = [logp[0, 3, alone[4]], logp[0, 4, alone[5]]]
            np.testing.assert_allclose(old[3 * row + s], expected, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(batch.old_logp[row, s], expected, rtol=1e-5, atol=1e-6)
    # Slots of 5 tokens for the same 2-token responses: the same tokens and old log-probs, zeros past each
    # response, and a 10-token row shorter than its 4 x 5 slots (scored in the compact layout).
    wide, _, _, wide_old = bench.make_batch(config, params, rows=2, seq_len=10, prompt_len=4, responses=3, slot_len=5)
    assert wide.mask.shape == (2, 4, 5) and wide.mask[:, :3, :2].all() and wide.mask.sum() == batch.mask.sum()
    np.testing.assert_array_equal(wide.tokens, batch.tokens)
    np.testing.assert_allclose(wide_old[:, :2], old, rtol=1e-5, atol=1e-6)
    assert not wide_old[:, 2:].any() and not wide.old_logp[:, :, 2:].any()
    with pytest.raises(ValueError, match="--slot-len"):
        bench.make_batch(config, params, rows=1, seq_len=10, prompt_len=4, responses=3, slot_len=1)
    with pytest.raises(ValueError, match="--responses"):
        bench.make_batch(config, params, rows=1, seq_len=10, prompt_len=4, responses=4)
    with pytest.raises(ValueError, match="--seq-len 9 .* next one up is 10"):
        bench.make_batch(config, params, rows=1, seq_len=9, prompt_len=3, responses=3)
