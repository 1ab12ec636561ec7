import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.run.checkpoint import Checkpointer
from jaxrl_llm.run.config import ConfigError, OptimSection, load_config
from jaxrl_llm.run.metrics import MetricsWriter, read_metrics
from jaxrl_llm.run.setup import write_bound_gb
from jaxrl_llm.run.state import init_state, learning_rate, make_optimizer
from jaxrl_llm.train.logprobs import chunked_logprobs, gather_response_hidden


def test_chunked_logprobs_match_full_softmax():
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(2, 3, 8)).astype(np.float32)
    head = rng.normal(size=(37, 8)).astype(np.float32)  # 37 = 4 chunks of 10 with 3 padded columns
    targets = np.array([[0, 36, 5], [10, 9, 20]])
    logits = hidden @ head.T
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    want = np.take_along_axis(logits, targets[..., None], -1)[..., 0] - log_z
    p = np.exp(logits - log_z[..., None])
    want_entropy = -(p * np.log(p)).sum(-1)
    logp, entropy = chunked_logprobs(jnp.asarray(hidden), jnp.asarray(head), jnp.asarray(targets), chunk=10,
                                     with_entropy=True)
    np.testing.assert_allclose(logp, want, atol=1e-5)
    np.testing.assert_allclose(entropy, want_entropy, atol=1e-5)


def test_gather_response_hidden_picks_predicting_positions():
    hidden = jnp.arange(2 * 6, dtype=jnp.float32).reshape(2, 6, 1)
    out = gather_response_hidden(hidden, jnp.array([2, 4]), 2)
    # Row 0: prompt of 2 tokens -> response token r is predicted at position 1 + r.
    np.testing.assert_array_equal(out[..., 0], [[1, 2], [9, 10]])


def test_adamw_with_warmup_and_clip_matches_hand_update():
    cfg = OptimSection(lr=0.1, warmup_steps=2, weight_decay=0.5, grad_clip=1.0)
    params = {"w": jnp.array([[1.0, -1.0]]), "norm": jnp.array([2.0])}
    opt = make_optimizer(cfg)
    state = init_state(params, opt)
    grads = {"w": jnp.array([[3.0, 4.0]]), "norm": jnp.array([0.0])}  # global norm 5 -> clipped to 1
    updates, _ = opt.update(grads, state.opt_state, params)
    # Step 0 of warmup: lr 0 -> no change at all, weight decay included (it is scaled by lr).
    np.testing.assert_allclose(updates["w"], 0.0)
    assert learning_rate(cfg, 1) == pytest.approx(0.05) and learning_rate(cfg, 5) == pytest.approx(0.1)
    updates, opt_state = opt.update(grads, state.opt_state, params)
    updates, _ = opt.update(grads, opt_state, params)  # second step: lr = 0.05
    # Adam with a constant gradient: m_hat / sqrt(v_hat) = sign(g) -> update = -lr * (1 + wd * w) for w;
    # the norm scale gets no decay and a zero gradient.
    np.testing.assert_allclose(updates["w"], [[-0.05 * (1 + 0.5 * 1.0), -0.05 * (1 + 0.5 * -1.0)]], rtol=1e-4)
    np.testing.assert_allclose(updates["norm"], [0.0], atol=1e-7)


def test_checkpoint_roundtrip_keeps_latest_and_best(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    tree = {"a": jnp.arange(4.0), "b": {"c": jnp.ones((2, 2), jnp.int32)}}
    accs = {1: 0.9, 2: 0.1, 3: None, 4: 0.2}
    for step, acc in accs.items():
        ckpt.save(step, jax.tree_util.tree_map(lambda x: x + step, tree), {"step": step, "data": [step]},
                  eval_accuracy=acc)
    assert sorted(ckpt.all_steps()) == [1, 3, 4]  # the last two and the best (0.9 at step 1)
    step, state, extra = ckpt.restore(tree)
    assert step == 4 and extra == {"step": 4, "data": [4]}
    np.testing.assert_array_equal(state["a"], np.arange(4.0) + 4)
    _, state1, _ = ckpt.restore(tree, step=1)
    np.testing.assert_array_equal(state1["b"]["c"], np.full((2, 2), 2))
    ckpt.close()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Checkpointer(tmp_path / "empty").restore(tree)


def test_checkpoint_with_a_write_bound_smaller_than_one_array_restores_it_exactly(tmp_path):
    # 66 kB in flight while a 64 kB array and a 4 kB one are written: the writes queue, nothing is dropped.
    tree = {"big": jnp.arange(16384.0).reshape(128, 128), "small": jnp.arange(1024, dtype=jnp.int32)}
    assert write_bound_gb(1e-6, tree) == 65536 / 1e9 and write_bound_gb(0.25, tree) == 0.25
    ckpt = Checkpointer(tmp_path / "ckpt", save_concurrent_gb=66e-6)
    ckpt.save(1, tree, {"step": 1})
    _, state, extra = ckpt.restore(jax.tree_util.tree_map(jnp.zeros_like, tree))
    np.testing.assert_array_equal(state["big"], np.arange(16384.0).reshape(128, 128))
    np.testing.assert_array_equal(state["small"], np.arange(1024))
    assert extra == {"step": 1}
    ckpt.close()
    with pytest.raises(ValueError, match=r"train.save_concurrent_gb=1e-06 .* largest array \(6.55e-05 GB\)"):
        Checkpointer(tmp_path / "tight", save_concurrent_gb=1e-6).save(1, tree, {})
    with pytest.raises(ConfigError, match="train.save_concurrent_gb"):
        load_config(None, ["train.save_concurrent_gb=0"])


def test_metrics_jsonl_and_tensorboard(tmp_path):
    writer = MetricsWriter(tmp_path)
    for step in range(3):
        writer.write(step, {"reward": jnp.float32(step / 2), "accuracy": step / 4, "note": "x",
                            "kl": float("nan")})
    writer.close()
    rows = read_metrics(tmp_path)
    assert [r["reward"] for r in rows] == [0.0, 0.5, 1.0] and rows[0]["kl"] == "nan"
    assert any((tmp_path / "tensorboard").iterdir())
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(tmp_path)


def test_metrics_writer_writes_tensorboard_scalars_without_importing_torch(tmp_path):
    """A training process on a machine with torch installed (the test extra) does not pay torch's import for
    TensorBoard scalars; the events hold the value written, and torch stays importable afterwards."""
    import subprocess
    import sys

    code = f"""
import struct, sys
from jaxrl_llm.run.metrics import MetricsWriter
writer = MetricsWriter({str(tmp_path)!r})
writer.write(7, {{"reward": 0.625}})
writer.close()
print("torch" in sys.modules)
from tensorboardX.proto.event_pb2 import Event
import pathlib
data = next(pathlib.Path({str(tmp_path)!r}, "tensorboard").iterdir()).read_bytes()
values = []
while data:
    (length,) = struct.unpack("<Q", data[:8])
    event = Event.FromString(data[12:12 + length])
    values += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
    data = data[12 + length + 4:]
print(values)
import importlib.util
print(importlib.util.find_spec("torch") is None or __import__("torch").__name__ == "torch")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == ["False", "[(7, 'reward', 0.625)]", "True"], out.stdout


def test_sampling_sd_by_hand():
    from jaxrl_llm.train.loop import sampling_sd

    # Problem 1: 2 of 4 correct -> p(1-p) unbiased = 2*2/(4*3) = 1/3, / k = 1/12; problem 2: all correct -> 0.
    assert sampling_sd([[1, 0, 1, 0], [1, 1, 1, 1]]) == pytest.approx(np.sqrt(1 / 12) / 2)
    assert sampling_sd([[1], [0]]) == 0.0


def test_eval_metrics_log_the_sampling_sd_for_the_plot():
    from jaxrl_llm.train.loop import eval_metrics

    evaluation = {"accuracy": 0.56, "sampling_sd": 0.015, "pass@4": 0.9}
    assert eval_metrics(evaluation) == {"eval_accuracy": 0.56, "eval_sampling_sd": 0.015}
    assert eval_metrics({**evaluation, "sampling_slot_occupancy": 0.7})["eval_slot_occupancy"] == 0.7


def test_eval_rows_per_call_follow_the_training_step():
    from jaxrl_llm.run.config import SamplingSection
    from jaxrl_llm.train.loop import eval_rows_per_call

    assert eval_rows_per_call(SamplingSection()) == 64  # the demo: 8 prompts x 8 samples
    assert eval_rows_per_call(SamplingSection(prompts_per_step=1024, samples_per_prompt=8)) == 128
    assert eval_rows_per_call(SamplingSection(prompts_per_step=2, samples_per_prompt=4)) == 8
    assert eval_rows_per_call(SamplingSection(max_rows_per_call=32)) == 32


def test_release_free_host_memory_returns_freed_pages():
    """After a freed heap of ~200 MB of small blocks, RSS falls back (glibc keeps such pages otherwise)."""
    import ctypes

    from jaxrl_llm.run.setup import release_free_host_memory

    if not hasattr(ctypes.CDLL(None), "malloc_trim"):
        pytest.skip("no glibc malloc_trim on this platform")

    def rss_mb():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024

    blocks, kept = [], []
    for _ in range(3200):  # 64 KB blocks (heap, below the mmap threshold), each followed by a small kept one
        blocks.append(bytearray(64 * 1024))
        kept.append(bytearray(2048))
    held = rss_mb()
    del blocks  # freed between kept blocks: glibc keeps these pages (checked: RSS stays at `held` without the call)
    release_free_host_memory()
    assert rss_mb() < held - 100, (held, rss_mb())
    del kept


FREE_AFTER_LARGE_BLOCK = r"""
import sys
from jaxrl_llm.run.setup import map_large_host_allocations
if sys.argv[1] == "mapped":
    assert map_large_host_allocations()
def rss_mb():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024
big = bytearray(30 * 2**20)
del big  # a 30 MB mapped block freed: glibc's own threshold rises to 30 MB
blocks, kept = [], []
for _ in range(200):  # 1 MB blocks, each followed by a small kept one
    blocks.append(bytearray(2**20))
    kept.append(bytearray(2048))
held = rss_mb()
del blocks
print(held - rss_mb())
"""


def test_map_large_host_allocations_returns_freed_buffers():
    """With the fixed threshold, 200 freed 1 MB buffers leave RSS at once. Whether they stay resident without it
    depends on the C library's version and settings (here they do; on the CI machine glibc returned them too), so
    only the mapped case is asserted: it fails if the call stops taking effect."""
    import ctypes
    import subprocess
    import sys

    if not hasattr(ctypes.CDLL(None), "mallopt"):
        pytest.skip("no glibc mallopt on this platform")
    freed = float(subprocess.run([sys.executable, "-c", FREE_AFTER_LARGE_BLOCK, "mapped"], capture_output=True,
                                 text=True, check=True).stdout.split()[-1])
    assert freed > 150, freed


def _scored(rewards_by_group, resp=4):
    from jaxrl_llm.train.rollouts import ScoredRollouts

    prompt_index = np.concatenate([[g] * len(r) for g, r in enumerate(rewards_by_group)]).astype(np.int32)
    n = prompt_index.size
    rewards = np.concatenate(rewards_by_group).astype(np.float32)
    lengths = np.arange(n) % resp + 1
    mask = (np.arange(resp)[None] < lengths[:, None]).astype(np.float32)
    records = [{"prompt_ids": [5] * (g + 2), "answer": "1"} for g in range(len(rewards_by_group))]
    return ScoredRollouts(records=records, prompt_index=prompt_index, tokens=np.full((n, resp), 7, np.int32),
                          mask=mask, logprobs=-mask, lengths=lengths.astype(np.int32), rewards=rewards,
                          correct=rewards > 0)


def test_train_batches_drop_zero_advantage_rows_but_keep_the_denominator():
    from jaxrl_llm.run.config import AlgorithmSection
    from jaxrl_llm.train.rollouts import build_train_batches

    scored = _scored([[1, 0, 1], [0, 0], [1, 1]])
    adv = np.where(scored.rewards[:, None] > 0, 1.0, 0.0) * scored.mask  # RAFT: rejected rows are 0
    batches = build_train_batches(scored, adv, scored.logprobs, np.zeros_like(adv), AlgorithmSection(),
                                  mini_batches=1, micro_batch_size=2, pad_id=0, rng=np.random.default_rng(0))
    (batch, denom, kept), = batches
    assert denom == scored.mask.sum()  # token-mean over every sample drawn, accepted or not
    assert kept == 4 and batch.mask.sum() == scored.mask[scored.rewards > 0].sum()
    assert batch.tokens.shape[0] == 2  # the all-rejected prompt packs no row
    # With a KL term every row matters (its KL gradient), so nothing is dropped.
    (_, _, kept_kl), = build_train_batches(scored, adv, scored.logprobs, np.zeros_like(adv),
                                          AlgorithmSection(kl_coef=0.1), mini_batches=1, micro_batch_size=2,
                                          pad_id=0, rng=np.random.default_rng(0))
    assert kept_kl == 7


def test_train_batches_put_padding_rows_in_whole_trailing_micro_batches():
    from jaxrl_llm.run.config import AlgorithmSection
    from jaxrl_llm.train.rollouts import build_train_batches
    from jaxrl_llm.train.step import split_micro

    # Five prompts with a mixed group each: five rows, padded to 8 for micro-batches of 2.
    scored = _scored([[1, 0], [0, 1, 1], [1, 0], [0, 1], [1, 0, 0]])
    adv = np.where(scored.rewards[:, None] > 0, 1.0, -1.0) * scored.mask
    (batch, _, kept), = build_train_batches(scored, adv, scored.logprobs, np.zeros_like(adv), AlgorithmSection(),
                                            mini_batches=1, micro_batch_size=2, pad_id=0,
                                            rng=np.random.default_rng(0))
    assert kept == 12 and batch.tokens.shape[0] == 8
    per_micro = np.asarray(split_micro(batch, 2).mask).reshape(4, 2, -1).sum(-1)  # [micro-batch, row] tokens
    assert np.all(per_micro[:2] > 0) and per_micro[2, 0] > 0 and per_micro[2, 1] == 0 and np.all(per_micro[3] == 0)
    assert batch.mask.sum() == scored.mask.sum()


def test_group_selection_and_concat_renumber_prompts():
    from jaxrl_llm.train.rollouts import ScoredRollouts

    scored = _scored([[1, 0], [0, 0], [1, 1]])
    kept = scored.select_groups(np.array([True, False, True]))
    assert [r["prompt_ids"] for r in kept.records] == [[5, 5], [5, 5, 5, 5]]
    np.testing.assert_array_equal(kept.prompt_index, [0, 0, 1, 1])
    both = ScoredRollouts.concat([kept, scored])
    np.testing.assert_array_equal(both.prompt_index, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    assert both.num_samples == 10 and len(both.records) == 5


def test_reward_scorer_binary_signed_and_overlong():
    from jaxrl_llm.run.config import AlgorithmSection, SamplingSection
    from jaxrl_llm.train.rollouts import RewardScorer

    texts, golds = ["so \\boxed{4}", "\\boxed{5}", "no answer"], ["4", "4", "4"]
    correct, reward = RewardScorer(AlgorithmSection(), SamplingSection(), timeout=5, workers=0)(
        texts, golds, np.array([3, 3, 3]))
    np.testing.assert_array_equal(correct, [True, False, False])
    np.testing.assert_array_equal(reward, [1, 0, 0])
    signed = RewardScorer(AlgorithmSection(reward="signed", overlong_buffer=4), SamplingSection(max_new_tokens=10),
                          timeout=5, workers=0)
    _, reward = signed(texts, golds, np.array([6, 8, 10]))
    # overlong: min(-(L - (10 - 4)) / 4, 0) = 0, -0.5, -1
    np.testing.assert_allclose(reward, [1.0, -1.5, -2.0])


@pytest.mark.parametrize("mode", ["prompt-mean", "prompt-mean-unbiased"])
def test_train_batches_with_the_m_step_give_the_prompt_mean_loss(mode):
    """agg prompt-mean: the token-mean over `denom` of the packed batch's vanilla loss -A' x equals GVM's
    M-step (objectives.prompt_mean) of -A x, with D_i = the accepted samples (RAFT advantages)."""
    from jaxrl_llm.objectives import prompt_mean
    from jaxrl_llm.run.config import AlgorithmSection
    from jaxrl_llm.train.rollouts import build_train_batches

    scored = _scored([[1, 0, 1], [0, 0], [1, 1], [0, 1, 0, 0]])
    for record, p in zip(scored.records, [0.5, 0.0, 1.0, 0.25]):  # GVM's stage-1 rates
        record["gvm_accept_rate"] = p
    adv = np.where(scored.rewards[:, None] > 0, 1.0, 0.0) * scored.mask
    values = -np.arange(1, scored.mask.size + 1, dtype=np.float32).reshape(scored.mask.shape) * scored.mask
    algo = AlgorithmSection(advantage="raft", loss="vanilla", agg=mode)
    got = 0.0
    for batch, denom, _ in build_train_batches(scored, adv, values, np.zeros_like(adv), algo, mini_batches=2,
                                               micro_batch_size=2, pad_id=0, rng=np.random.default_rng(0)):
        got += float(np.sum(-batch.advantages * batch.old_logp * batch.mask)) / denom
    # Two mini-batches of two prompts each, each its own M-step: check the sum against their losses.
    rng = np.random.default_rng(0)
    want = 0.0
    for part in np.array_split(rng.permutation(4), 2):
        rows = np.flatnonzero(np.isin(scored.prompt_index, part))
        ids = np.searchsorted(np.sort(part), scored.prompt_index[rows])
        rates = np.array([0.5, 0.0, 1.0, 0.25])[np.sort(part)] if mode == "prompt-mean-unbiased" else None
        want += float(prompt_mean(-adv[rows] * values[rows], scored.mask[rows], ids, num_groups=2,
                                  counted=adv[rows].any(axis=1), accept_rate=rates))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert want != 0.0
