"""GVM's p_i and G_i from earlier visits (`sampling.gvm_estimates: history`, train/gvm_history.py)."""

import json

import jax
import numpy as np
import pytest

from jaxrl_llm.run.config import ConfigError, load_config
from jaxrl_llm.train.gvm import gvm_rollouts
from jaxrl_llm.train.gvm_history import GvmHistory, prompt_key
from test_gvm import TINY, StubScorer, StubTokenizer, _records, _sampling  # noqa: F401
from test_gvm import bundled_policy, params  # noqa: F401 (fixtures)


def test_discounted_counts_by_hand():
    records = [{"id": "a"}, {"id": "b"}, {"question": "q"}]
    history = GvmHistory(decay=0.5)
    history.observe(records, accepted=[2, 0, 1], drawn=[4, 4, 0], norm_sum=[3.0, 0, 9], norm_count=[2, 0, 1], visit=1)
    history.observe(records, accepted=[1, 0, 0], drawn=[1, 2, 0], norm_sum=[5.0, 0, 0], norm_count=[1, 0, 0], visit=1)
    seen, p, g = history.estimates(records)
    # Same visit: counts add undiscounted. Prompt 3 drew nothing, so it stays unseen.
    np.testing.assert_array_equal(seen, [True, True, False])
    np.testing.assert_allclose(p, [3 / 5, 0, 0])
    np.testing.assert_allclose(g, [8 / 3, 0, 0])
    history.observe(records, accepted=[0, 1, 0], drawn=[2, 2, 0], norm_sum=[0, 4.0, 0], norm_count=[0, 1, 0], visit=2)
    _, p, g = history.estimates(records)
    # Next visit: the older counts are halved. a: (0 + 1.5) / (2 + 2.5); b: (1 + 0) / (2 + 3).
    np.testing.assert_allclose(p, [1.5 / 4.5, 1 / 5, 0])
    np.testing.assert_allclose(g, [4.0 / 1.5, 4.0, 0])
    assert prompt_key(records[2]) == "question:q" and prompt_key({"id": 7}) == "7"


def test_probe_counts_and_json_round_trip():
    records = [{"id": "solved"}, {"id": "unsolved"}, {"id": "new"}]
    history = GvmHistory(decay=0.25)
    history.observe(records, accepted=[1, 0, 0], drawn=[8, 8, 0], norm_sum=[1, 0, 0], norm_count=[1, 0, 0], visit=0)
    np.testing.assert_array_equal(history.probe_counts(records, 8, 2), [0, 2, 8])
    np.testing.assert_array_equal(history.probe_counts(records, 8, 0), [0, 0, 8])
    again = GvmHistory.from_json(json.loads(json.dumps(history.to_json())))
    assert again == history
    with pytest.raises(ValueError, match="gvm_history is malformed"):
        GvmHistory.from_json({"decay": 0.5, "entries": {"a": [1, 2]}})
    # A checkpoint written before the visit count (5 numbers per entry) counts one visit.
    old = GvmHistory.from_json({"decay": 0.5, "entries": {"unsolved": [0, 8, 0, 0, 3]}})
    assert old.entries["unsolved"] == [0, 8, 0, 0, 3, 1]


def test_probes_stop_after_the_configured_unsolved_visits():
    records = [{"id": "hard"}, {"id": "easy"}, {"id": "late"}]
    history = GvmHistory(decay=0.5)
    # Visit 0: stage 1 (4 each); a probe and stage 2 in the same visit count once.
    history.observe(records, accepted=[0, 2, 0], drawn=[4, 4, 4], norm_sum=[0] * 3, norm_count=[0] * 3, visit=0)
    history.observe(records, accepted=[0, 1, 0], drawn=[0, 4, 0], norm_sum=[0] * 3, norm_count=[0] * 3, visit=0)
    assert [history.entries[k][5] for k in ("hard", "easy", "late")] == [1, 1, 1]
    np.testing.assert_array_equal(history.probe_counts(records, 4, 2, probe_visits=2), [2, 0, 2])
    # Visit 5: both unsolved prompts probed; "late" is solved at last.
    history.observe(records, accepted=[0, 0, 1], drawn=[2, 0, 2], norm_sum=[0] * 3, norm_count=[0] * 3, visit=5)
    assert [history.entries[k][5] for k in ("hard", "easy", "late")] == [2, 1, 2]
    # "hard": 2 visits, never solved -> no more probes with probe_visits = 2; still probed without a limit.
    np.testing.assert_array_equal(history.probe_counts(records, 4, 2, probe_visits=2), [0, 0, 0])
    np.testing.assert_array_equal(history.probe_counts(records, 4, 2, probe_visits=3), [2, 0, 0])
    np.testing.assert_array_equal(history.probe_counts(records, 4, 2), [2, 0, 0])


def test_second_visit_skips_stage1_for_solved_prompts(params):  # noqa: F811 (fixture)
    records = [{**r, "id": f"p{i}"} for i, r in enumerate(_records(["yes", "no", "even", "no"]))]
    sampling = _sampling(gvm_estimates="history", gvm_history_probe=1)
    history = GvmHistory(decay=0.5)
    key = jax.random.PRNGKey(0)
    first, info1 = gvm_rollouts(params, TINY, StubTokenizer(), records, sampling, StubScorer(), key,
                                rows_per_chunk=4, history=history, visit=0)
    # A first visit is stage-1 mode: the same samples, allocation and rates as without a history.
    plain, info0 = gvm_rollouts(params, TINY, StubTokenizer(), records, _sampling(), StubScorer(), key,
                                rows_per_chunk=4)
    np.testing.assert_array_equal(first.tokens, plain.tokens)
    assert info1["gvm"]["gvm_n"] == info0["gvm"]["gvm_n"] and info1["gvm"]["gvm_p"] == info0["gvm"]["gvm_p"]
    assert info1["drawn"] == info0["drawn"] == 4 * 4 + 12
    n1 = np.array(info1["gvm"]["gvm_n"])
    # The history now holds stage 1 and stage 2: prompt 0 ("yes") is 4 + n_0 of 4 + n_0, prompt 1 0 of 4.
    seen, p, _ = history.estimates(records)
    assert seen.all() and p[0] == 1.0 and p[1] == 0.0 and history.entries["p0"][1] == 4 + n1[0]
    _, info2 = gvm_rollouts(params, TINY, StubTokenizer(), records, sampling, StubScorer(), jax.random.PRNGKey(1),
                            rows_per_chunk=4, history=history, visit=1)
    # Second visit: only the two unsolved prompts are probed (1 sample each), then the 12-sample budget.
    assert info2["gvm"]["gvm_stage1_drawn"] == 2 and info2["drawn"] == 2 + 12
    n2, p2 = np.array(info2["gvm"]["gvm_n"]), np.array(info2["gvm"]["gvm_p"])
    assert n2.sum() == 12 and n2[1] == 0 and n2[3] == 0 and p2[0] == 1.0


def test_config_keys_are_checked():
    assert load_config(None, ["sampling.gvm_estimates=history"]).sampling.gvm_estimates == "history"
    with pytest.raises(ConfigError, match="gvm_estimates"):
        load_config(None, ["sampling.gvm_estimates=oracle"])
    with pytest.raises(ConfigError, match=r"'sampling.gvm_history_decay' must be in \[0, 1\]"):
        load_config(None, ["sampling.gvm_history_decay=1.5"])
    with pytest.raises(ConfigError, match=r"'sampling.gvm_history_probe' must be >= 0"):
        load_config(None, ["sampling.gvm_history_probe=-1"])
    with pytest.raises(ConfigError, match=r"'sampling.gvm_history_probe_visits' must be >= 0"):
        load_config(None, ["sampling.gvm_history_probe_visits=-1"])
    with pytest.raises(ConfigError, match="gvm_budget"):
        load_config(None, ["sampling.gvm_budget=all"])


def test_loop_keeps_the_history_across_steps_and_resume(tmp_path, monkeypatch, bundled_policy):  # noqa: F811
    """Four prompts revisited every step: step 1 draws stage 1 for all, later steps only probe the unsolved,
    and a resumed run reads the history back from the checkpoint instead of drawing stage 1 again."""
    from jaxrl_llm.train import loop, rollouts
    policy = bundled_policy

    def stub_scorer(self, texts, golds, lengths):  # solved iff the text has an even length: mixed prompts
        correct = np.array([len(t) % 2 == 0 for t in texts], bool)
        return correct, correct.astype(np.float32)

    monkeypatch.setattr(rollouts.RewardScorer, "__call__", stub_scorer)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(4)))
    out = tmp_path / "run"

    def run(steps, resume):
        config = load_config(None, [
            "sampling.allocation=gvm", "sampling.gvm_estimates=history", f"train.steps={steps}", "train.save_every=1",
            "train.eval_problems=0", "sampling.prompts_per_step=4", f"data.train={data}",
            "sampling.gvm_stage1_samples=4", "sampling.gvm_samples_per_prompt=4", "sampling.max_new_tokens=8",
            "optim.micro_batch_size=8", f"train.out_dir={out}"])
        loop.train(config, policy=policy, resume=resume, log=lambda *a: None)
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "gvm_p" in line]

    rows = run(2, resume=False)
    assert rows[0]["gvm_stage1_drawn"] == 16
    unsolved = sum(p == 0 for p in rows[0]["gvm_p"])  # probed with gvm_history_probe = 2 samples at step 2
    assert rows[1]["gvm_stage1_drawn"] == 2 * unsolved < 16
    rows = run(3, resume=True)
    assert rows[-1]["gvm_stage1_drawn"] < 16  # the history came back from the checkpoint
