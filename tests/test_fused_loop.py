"""The fully jitted RL iteration (jaxrl_llm.ondevice.fused) and its on-device reward, against the host path:
the reward equals the host verifier, the sampler inside the fused program (`sample_tokens`) equals
`generate`, one fused iteration's update equals `make_train_step` on the same rollouts, and a scan of K
iterations equals K calls."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import models, rewards
from jaxrl_llm.ondevice.device_reward import (TokenBytes, boxed_integer_reward, gold_integers, last_boxed_span,
                                              token_bytes)
from jaxrl_llm.ondevice.fused import (PromptBatch, check_fused_config, make_fused_iteration, make_fused_loop,
                                      prompt_batches)
from jaxrl_llm.rewards.extract import last_boxed
from jaxrl_llm.run.config import AlgorithmSection, SamplingSection
from jaxrl_llm.run.state import init_state
from jaxrl_llm.sampling import generate
from jaxrl_llm.train import load_config
from jaxrl_llm.train.algorithms import sequence_advantages, token_advantages
from jaxrl_llm.train.rollouts import ScoredRollouts, build_train_batches
from jaxrl_llm.train.step import make_train_step

VOCAB = 24
STOP = 23
# Token i < 2 decodes to "\boxed{i}", 2 to "\boxed{}" (blank), 3 to "}", the rest to a space: a random
# policy then writes boxed answers, so rewards and advantages vary inside groups.
TOY_TEXT = ["\\boxed{0}", "\\boxed{1}", "\\boxed{}", "}"] + [" "] * (VOCAB - 4)


def toy_table() -> TokenBytes:
    width = max(len(t) for t in TOY_TEXT)
    table = np.zeros((VOCAB, width), np.uint8)
    for i, text in enumerate(TOY_TEXT):
        table[i, :len(text)] = list(text.encode())
    # the stop token decodes to nothing, as a special token does
    return TokenBytes(table, np.array([0 if i == STOP else len(t) for i, t in enumerate(TOY_TEXT)], np.int32))


def toy_decode(tokens, length) -> str:
    return "".join("" if t == STOP else TOY_TEXT[t] for t in tokens[:length])


@pytest.fixture(scope="module")
def tiny():
    config = models.ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=8, tie_word_embeddings=True, max_position_embeddings=256)
    params = models.init_params(config, jax.random.key(0))
    params["embed"] = params["embed"] * 3.0  # logits spread over a few nats
    return config, params


@pytest.fixture(scope="module")
def smol_tokenizer():
    from jaxrl_llm.models.bundled import bundled_gguf_path

    try:
        path = bundled_gguf_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return models.Tokenizer.from_gguf(path)


def toy_prompts(num_prompts, seed=0, width=16):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 9, size=num_prompts).astype(np.int32)
    tokens = np.zeros((num_prompts, width), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(4, VOCAB - 1, size=n)
    return PromptBatch(tokens, lengths, np.ones(num_prompts, np.int32))  # gold answer: 1


# ---- the on-device reward against the host verifier -------------------------------------------------------

FRAGMENTS = ["\\boxed", "\\fbox", "boxed", "\\", "\\\\", "{", "}", "\\{", "\\}", " ", "\t", "\n", "$", "1", "7",
             "-", "x", "=", "\\boxedx", "\\boxed{", "\\boxed ", "}}"]


def test_last_boxed_span_matches_host_extraction_on_fuzzed_text():
    """Which box counts and where its argument ends: equal to rewards.extract.last_boxed on 400 texts
    built from braces, escapes, box commands, blanks and dollars."""
    rng = random.Random(0)
    texts = ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 14))) for _ in range(400)]
    texts += ["\\boxed{6} and \\boxed{}", "\\boxed{3}\\boxed{4", "\\boxed{5\\}", "\\boxed{{5}}", "\\boxed 7$",
              "\\boxedx{3}", "\\boxed\n5", "a\\\\boxed{2}", "\\boxed{\\\\}", "\\boxed"]
    width = max(len(t) for t in texts) + 3
    rows = np.full((len(texts), width), -1, np.int32)
    for i, text in enumerate(texts):
        rows[i, :len(text)] = list(text.encode())
    found, start, end = jax.jit(jax.vmap(last_boxed_span))(jnp.asarray(rows))
    boxes = 0
    for i, text in enumerate(texts):
        expected = last_boxed(text)
        got = text[int(start[i]):int(end[i])].strip() if bool(found[i]) else None
        assert got == expected, (text, got, expected)
        boxes += expected is not None
    assert boxes > 100  # the fuzz does reach well-formed boxes


# Responses the model writes on the 3-shot arithmetic prompt, and forms around them (text, gold).
AGREEING = [
    ("7 - 9 = -2 \\boxed{-2}", "-2"), ("7 - 9 = -2 \\boxed{2}", "-2"), ("4 + 3 = 7 \\boxed{7}<|im_end|>", "7"),
    ("4 + 3 = 7 \\boxed{7}<|im_end|>", "8"), ("\\boxed{ 12 }", "12"), ("\\boxed{+5}", "5"), ("\\boxed{-0}", "0"),
    ("\\boxed{5} then \\boxed{6}", "6"), ("\\boxed{5} then \\boxed{6}", "5"), ("\\boxed{6} and \\boxed{}", "6"),
    ("\\boxed{6} and \\boxed{  }", "6"), ("\\boxed 7", "7"), ("\\boxed 7.", "7"), ("$\\boxed{5}$", "5"),
    ("\\fbox{3}", "3"), ("\\boxedx{3}", "3"), ("\\boxed{3", "3"), ("\\boxed{3}\\boxed{4", "3"), ("\\boxed{5\\}", "5"),
    ("2 - 7 = -5 \\boxed{-5}\n<|im_start|>user", "-5"), ("8 - 3 = 5", "5"), ("", "5"), ("\\boxed{}", "0"),
    ("\\boxed{x}", "0"), ("\\boxed{1 2}", "12"), ("\\boxed{{5}}", "5"), ("\\boxed{05}", "5"),
    ("\\boxed{5}.", "5"), ("\\boxed{5.}", "5"),
    ("\\boxed{ - 5 }", "-5"), ("9 + 9 = 18 \\boxed{18}", "18"), ("\\boxed{123456789}", "123456789"),
]
# Forms the host verifier accepts and the on-device reward (integers in a box only) does not.
HOST_ONLY = [("\\boxed{\\frac{10}{2}}", "5"), ("The answer is 5", "5"), ("#### 5", "5"), ("\\boxed{5.0}", "5"),
             ("\\boxed{2+3}", "5"), ("\\boxed{--5}", "5")]


@pytest.fixture(scope="module")
def verdicts(smol_tokenizer):
    """(device, host) rewards of AGREEING + HOST_ONLY, tokenized by the bundled SmolLM2 tokenizer."""
    tokenizer, cases = smol_tokenizer, AGREEING + HOST_ONLY
    stop = tokenizer.stop_ids[0]
    ids = [tokenizer.encode(text) for text, _ in cases]
    width = max(len(i) for i in ids) + 1
    tokens = np.full((len(ids), width), tokenizer.pad_token_id, np.int32)
    lengths = np.zeros(len(ids), np.int32)
    for r, row in enumerate(ids):
        row = row + [stop] if r % 2 else row  # half the rows end with the stop token, as sampled ones do
        tokens[r, :len(row)] = row
        lengths[r] = len(row)
    golds = [gold for _, gold in cases]
    device = np.asarray(jax.jit(boxed_integer_reward)(jnp.asarray(tokens), jnp.asarray(lengths),
                                                      jnp.asarray(gold_integers(golds)),
                                                      token_bytes(tokenizer, tokenizer.vocab_size)))
    # the host path of train.rollouts.sample_and_score: decode without special tokens, then verify
    texts = [tokenizer.decode(list(row[:n]), skip_special_tokens=True) for row, n in zip(tokens, lengths)]
    host = np.asarray(rewards.correctness_reward(texts, golds), np.float32)
    return device, host


def test_device_reward_equals_host_verifier_on_model_style_responses(verdicts):
    device, host = (v[:len(AGREEING)] for v in verdicts)
    for (text, gold), d, h in zip(AGREEING, device, host):
        assert d == h, (text, gold, d, h)
    assert 8 <= host.sum() <= len(AGREEING) - 8  # both verdicts are well represented


def test_device_reward_is_zero_where_only_the_host_verifier_is_lenient(verdicts):
    device, host = (v[len(AGREEING):] for v in verdicts)
    assert host.tolist() == [1.0] * len(HOST_ONLY)
    assert device.tolist() == [0.0] * len(HOST_ONLY)


def test_token_bytes_are_the_decoded_tokens(smol_tokenizer):
    table = token_bytes(smol_tokenizer, smol_tokenizer.vocab_size + 5)
    ids = smol_tokenizer.encode("7 - 9 = -2 \\boxed{-2}")
    joined = b"".join(bytes(table.bytes[i, :table.lengths[i]].tolist()) for i in ids)
    assert joined == b"7 - 9 = -2 \\boxed{-2}"
    assert table.lengths[smol_tokenizer.stop_ids[0]] == 0  # special tokens are skipped, as in decode
    assert table.lengths[-5:].tolist() == [0] * 5  # embedding rows past the tokenizer's vocabulary


def test_gold_integers_and_bad_answers():
    assert gold_integers(["-2", "15", " 7 ", "+3"]).tolist() == [-2, 15, 7, 3]
    for bad in ("1/2", "x", "1234567890", "--2", ""):
        with pytest.raises(ValueError, match="not an integer"):
            gold_integers([bad])


# ---- sampler, update, scan ----------------------------------------------------------------------------------

ALGO = AlgorithmSection()  # GRPO, clip 0.2, token-mean, no KL: the demo's algorithm
SAMPLING = SamplingSection(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8)
# Adam with a large eps: the update g / (|g| + eps) is smooth in the gradient, so float reassociation
# between differently compiled programs cannot flip the sign of a near-zero component's update
OPTIMIZER = optax.adam(1e-2, eps=1e-3)


def fresh_state(params):
    return init_state(jax.tree_util.tree_map(jnp.array, params), OPTIMIZER)  # iterations donate their state


@pytest.fixture(scope="module")
def iteration(tiny):
    return make_fused_iteration(tiny[0], ALGO, OPTIMIZER, sampling=SAMPLING, token_table=toy_table(),
                                micro_batch_size=2, stop_ids=(STOP,), pad_id=0, keep_rollouts=True)


@pytest.fixture(scope="module")
def first_iteration(tiny, iteration):
    """One fused iteration from the initial policy: (prompts, rng, new state, metrics as numpy)."""
    prompts, rng = toy_prompts(4), jax.random.key(3)
    state, metrics = iteration(fresh_state(tiny[1]), rng, jax.tree_util.tree_map(jnp.asarray, prompts))
    return prompts, rng, state, jax.tree_util.tree_map(np.asarray, metrics)


def test_fused_rollouts_equal_generate(tiny, first_iteration):
    """`sample_tokens` inside the fused program draws what `generate` draws for the same prompts and rng."""
    config, params = tiny
    prompts, rng, _, out = first_iteration
    want = generate(params, config, [list(t[:n]) for t, n in zip(prompts.tokens, prompts.lengths)], num_samples=4,
                    max_new_tokens=8, stop_ids=(STOP,), rng=rng, pad_id=0)
    # Different programs (log-probs to rounding); tokens exactly: both draw row r's token t with the same key, and a
    # draw (24 tokens, 128 draws) moves only if rounding puts it within ~1e-6 of a CDF boundary.
    np.testing.assert_array_equal(out["tokens"], want.tokens)
    np.testing.assert_array_equal(out["lengths"], want.lengths)
    np.testing.assert_allclose(out["logprobs"], want.logprobs, atol=1e-6)
    assert want.lengths.min() < 8 < want.lengths.max() + 1  # some rows stopped early, some ran to the end


def test_fused_update_equals_train_step_on_the_same_rollouts(tiny, first_iteration):
    """The fused update (fixed-slot packing on device) against host packing + make_train_step on the
    same rollouts, rewards and advantages, from the same initial state."""
    config, params = tiny
    prompts, _, state, out = first_iteration
    group = np.repeat(np.arange(4), 4)
    # the device verdicts equal the host verifier on the rollouts' text
    texts = [toy_decode(t, n) for t, n in zip(out["tokens"], out["lengths"])]
    np.testing.assert_array_equal(out["correct"], rewards.correctness_reward(texts, ["1"] * len(texts)))
    mixed = [len(set(out["rewards"][group == g])) > 1 for g in range(4)]
    assert sum(mixed) >= 2, out["rewards"]  # non-zero advantages: the update is not trivially zero

    mask = (np.arange(8)[None] < out["lengths"][:, None]).astype(np.float32)
    records = [{"prompt_ids": list(t[:n]), "answer": "1"} for t, n in zip(prompts.tokens, prompts.lengths)]
    scored = ScoredRollouts(records=records, prompt_index=group.astype(np.int32), tokens=out["tokens"], mask=mask,
                            logprobs=out["logprobs"], lengths=out["lengths"], rewards=out["rewards"],
                            correct=out["correct"] > 0)
    seq_adv = sequence_advantages(ALGO, scored.rewards, scored.prompt_index, 4)
    advantages = token_advantages(ALGO, seq_adv, scored.logprobs, np.zeros_like(mask), mask)
    [(batch, denom, _)] = build_train_batches(scored, advantages, scored.logprobs, np.zeros_like(mask), ALGO,
                                              mini_batches=1, micro_batch_size=2, pad_id=0,
                                              rng=np.random.default_rng(0))
    host_state, host_metrics = make_train_step(config, ALGO, OPTIMIZER, micro_batch_size=2)(
        fresh_state(params), batch, np.float32(denom))
    for name in ("loss", "grad_norm"):
        np.testing.assert_allclose(out[name], np.asarray(host_metrics[name]), rtol=1e-4, atol=1e-7)
    assert out["grad_norm"] > 1e-3
    moved = 0.0
    for a, b, p in zip(*(jax.tree_util.tree_leaves(x) for x in (state.params, host_state.params, params))):
        np.testing.assert_allclose(np.asarray(a) - p, np.asarray(b) - p, atol=1e-5)
        moved = max(moved, float(np.abs(np.asarray(a) - p).max()))
    assert moved > 1e-3


def test_scan_of_k_iterations_equals_k_calls(tiny, iteration):
    batches = [toy_prompts(4, seed=k) for k in range(3)]
    stacked = PromptBatch(*(jnp.asarray(np.stack(x)) for x in zip(*batches)))
    rng = jax.random.key(11)
    scanned, scan_metrics = make_fused_loop(iteration)(fresh_state(tiny[1]), rng, stacked)
    state = fresh_state(tiny[1])
    for k, batch in enumerate(batches):
        state, metrics = iteration(state, jax.random.fold_in(rng, k), jax.tree_util.tree_map(jnp.asarray, batch))
        # A scan and separate calls are different programs (parameters to rounding below); the draws use the same
        # keys, and one moves only if that rounding puts it at a CDF boundary (24 tokens, 384 draws).
        np.testing.assert_array_equal(np.asarray(scan_metrics["tokens"][k]), np.asarray(metrics["tokens"]))
        np.testing.assert_allclose(float(scan_metrics["reward"][k]), float(metrics["reward"]), atol=1e-6)
    assert int(scanned.step) == int(state.step) == 3
    for a, b in zip(jax.tree_util.tree_leaves(scanned.params), jax.tree_util.tree_leaves(state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_prompt_batches_pad_to_one_shape():
    batches = [[{"prompt_ids": [5, 6, 7], "answer": "-2"}, {"prompt_ids": [8], "answer": "3"}],
               [{"prompt_ids": [9, 9], "answer": "0"}, {"prompt_ids": [1, 2, 3, 4], "answer": "11"}]]
    out = prompt_batches(batches, pad_id=0)
    assert out.tokens.shape == (2, 2, 4)
    assert out.tokens[0].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert out.lengths.tolist() == [[3, 1], [2, 4]]
    assert out.gold.tolist() == [[-2, 3], [0, 11]]
    with pytest.raises(ValueError, match="shorter than the longest prompt"):
        prompt_batches(batches, pad_id=0, prompt_len=3)
    with pytest.raises(ValueError, match="same non-zero size"):
        prompt_batches([batches[0], batches[1][:1]], pad_id=0)


@pytest.mark.parametrize("override, key", [
    ("algorithm.kl_coef=0.001", "algorithm.kl_coef"), ("sampling.allocation=gvm", "sampling.allocation"),
    ("algorithm.group_filter=mixed", "algorithm.group_filter"), ("optim.mini_batches=2", "optim.mini_batches"),
    ("optim.micro_batch_size=3", "optim.micro_batch_size"), ("algorithm.format_reward=0.1", "algorithm.format_reward"),
    ("sampling.max_rows_per_call=16", "sampling.max_rows_per_call"),
])
def test_check_fused_config_names_the_key(override, key):
    check_fused_config(load_config(None, []))  # the demo config runs fused
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        check_fused_config(load_config(None, [override]))


class CharTokenizer:
    """One token per ASCII character; `spaced` decodes with a space between tokens (not concatenative)."""

    vocab_size = 128

    def __init__(self, spaced=False):
        self.spaced = spaced

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return (" " if self.spaced else "").join(chr(i) for i in ids)


def test_token_bytes_refuses_a_tokenizer_whose_decode_is_not_concatenation():
    table = token_bytes(CharTokenizer(), 130)
    assert table.bytes[ord("{"), :table.lengths[ord("{")]].tolist() == [123]
    assert table.lengths.tolist() == [1] * 128 + [0, 0]
    with pytest.raises(ValueError, match="not the concatenation"):
        token_bytes(CharTokenizer(spaced=True), 128)
