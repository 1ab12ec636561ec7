"""`sampling.plan`: a sampler call checked once (`prepare_call`) and planned once (`plan_calls`), by hand-computed
values on small cases (the static engine's runs are pinned in test_sampling_chunks.py)."""

import types

import numpy as np
import pytest

from jaxrl_llm.sampling.plan import CallPlan, plan_calls, prepare_call, row_multiple

CONFIG = types.SimpleNamespace(vocab_size=24, max_position_embeddings=64)  # all that the checks read
LENGTHS = np.array([3, 2, 1, 5, 2])
COUNTS = np.array([3, 0, 5, 1, 2])  # 11 rows of 4 prompts with samples


def test_continuous_plan_by_hand():
    # prompt bucket 16, 32 prefill tokens a call -> 2 prompts a chunk; 4 queued prompts -> a queue of 4
    [call] = plan_calls(LENGTHS, COUNTS, 6, engine="continuous", max_slots=3, prefill_tokens_per_call=32)
    assert (call.first_row, call.slots, call.queue_bucket, call.prompt_entries) == (0, 3, 4, 4)
    assert call.shapes.num_rows == 11 and call.shapes.row_bucket == 16 and call.shapes.prompts_per_prefill == 2
    assert call.shapes.prefill_prompts.tolist() == [0, 2, 3, 4]

    def one(**kwargs) -> CallPlan:
        return plan_calls(LENGTHS, COUNTS, 6, engine="continuous", prefill_tokens_per_call=32, **kwargs)[0]

    assert one(max_slots=1).slots == 2  # never a 1-slot decode
    assert one(max_slots=None).slots == 16  # one slot per sample, their bucket
    assert one(max_slots=3, row_multiple=2).slots == 4  # split over 2 devices
    assert one(max_slots=3, max_prompt_entries=1).prompt_entries == 2  # at least one chunk
    assert one(max_slots=3, max_prompt_entries=1, every_prompt=True).prompt_entries == 4  # every queued prompt
    assert one(max_slots=64).slots == 16  # no more slots than rows' bucket


def test_prepare_call_checks_and_sets_up():
    setup = prepare_call(None, CONFIG, [[1, 2, 3], [4]], num_samples=[2, 1], max_new_tokens=5, stop_ids=[5, 5],
                         pair_stop_ids=[7], temperature=0.0, top_k=3)
    assert [p.tolist() for p in setup.prompts] == [[1, 2, 3], [4]] and setup.prompts[0].dtype == np.int32
    assert setup.counts.tolist() == [2, 1] and setup.num_rows == 3 and setup.row_multiple == 1
    assert setup.stop_ids.tolist() == [5, 7 + 24, -1, -1] and setup.paired_stops  # pair stops stored as id + V
    assert setup.selection()[2] == {"greedy": True, "top_k": 0, "use_top_p": False}
    assert [c.shapes.row_bucket for c in setup.calls()] == [4]
    assert row_multiple(None) == 1
    bad = [(dict(temperature=-1.0), "temperature must be >= 0"), (dict(top_p=0.0), "top_p must be in"),
           (dict(top_k=-1), "top_k must be >= 0"), (dict(num_samples=[1]), "one count per prompt"),
           (dict(max_new_tokens=0), "max_new_tokens must be >= 1"), (dict(stop_ids=[24]), "stop_ids must lie"),
           (dict(engine="continuous", max_slots=0), "max_slots must be an int >= 1"),
           (dict(engine="continuous", max_rows_per_call=4), "max_rows_per_call applies to the static engine"),
           (dict(forced_prefixes=[[1]]), "one per row")]
    for change, message in bad:
        kwargs = dict(num_samples=1, max_new_tokens=5) | change
        with pytest.raises(ValueError, match=message):
            prepare_call(None, CONFIG, [[1, 2, 3], [4]], **kwargs)
