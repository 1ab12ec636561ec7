"""Every algorithm preset in configs/ makes one update on a tiny random model that lowers its own loss on
the same batch: the preset's pieces (advantages, loss kind, clipping, KL, PRL shaping) fit together."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.objectives import aggregate_denominator
from jaxrl_llm.run.state import init_state, make_optimizer
from jaxrl_llm.train import load_config
from jaxrl_llm.train.algorithms import sequence_advantages, token_advantages
from jaxrl_llm.train.packing import pack_groups, unpack
from jaxrl_llm.train.step import make_logprob_fn, make_train_step

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
# ppo updates a critic beside the policy: its preset is tested in tests/test_ppo.py
PRESETS = sorted(p.stem for p in CONFIGS.glob("*.yaml") if p.stem not in ("reference", "ppo") and "gvm" not in p.stem
                 and "paper" not in p.stem)
TINY = models.ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, tie_word_embeddings=True)


def test_all_issue_presets_exist():
    assert {"raft", "raftpp", "grpo", "dr_grpo", "dapo", "reinforce_rej", "prl", "rloo"} <= set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_update_lowers_its_loss(preset):
    cfg = load_config(CONFIGS / f"{preset}.yaml", ["optim.lr=1e-2"])
    algo = cfg.algorithm
    rng = np.random.default_rng(0)
    groups, per_group, prompt, resp = 4, 4, 5, 6
    rows = groups * per_group
    group_ids = np.repeat(np.arange(groups), per_group)
    correct = rng.random(rows) < 0.5
    correct[:per_group] = True  # one all-correct group: filtered presets must cope with it
    rewards = np.where(correct, 1.0, -1.0 if algo.reward == "signed" else 0.0).astype(np.float32)
    seq_adv = sequence_advantages(algo, rewards, group_ids, groups)
    assert np.any(seq_adv != 0)

    prompts = [rng.integers(1, TINY.vocab_size, size=prompt).tolist() for _ in range(groups)]
    responses = rng.integers(1, TINY.vocab_size, size=(rows, resp)).astype(np.int32)
    lengths = np.full(rows, resp)
    members = [np.flatnonzero(group_ids == g) for g in range(groups)]
    mask = np.ones((rows, resp), np.float32)
    params = models.init_params(TINY, jax.random.PRNGKey(0))
    probe = pack_groups(prompts, members, responses, lengths)
    logp = unpack(np.asarray(make_logprob_fn(TINY)(params, probe)), members, rows)
    ref = logp - 0.01 * rng.random(logp.shape).astype(np.float32)  # a reference slightly off the policy
    adv = token_advantages(algo, seq_adv, logp, ref, mask)
    batch = pack_groups(prompts, members, responses, lengths, advantages=adv, old_logp=logp, ref_logp=ref)
    batch = jax.tree_util.tree_map(jnp.asarray, batch)
    denom = aggregate_denominator(jnp.asarray(mask), algo.agg)

    opt = make_optimizer(cfg.optim)
    step = make_train_step(TINY, algo, opt, micro_batch_size=2)
    state, first = step(init_state(params, opt), batch, denom)
    assert float(first["finite"]) == 1.0 and int(state.step) == 1
    _, second = step(state, batch, denom)
    assert float(second["loss"]) < float(first["loss"]), preset
