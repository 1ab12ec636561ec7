"""generate(max_rows_per_call=...): a step's rows decoded in several sampler calls give the rows of one call
(tokens, lengths, finish reasons exactly, log-probs to f32 rounding), `plan.plan_calls` splits rows by hand-checked
counts, and `sampling.max_rows_per_call` reaches the sampler from the run config (tiny model, CPU)."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from tiny_models import tiny_sampler_model

from jaxrl_llm.run.config import ConfigError
from jaxrl_llm.sampling import generate, make_plan
from jaxrl_llm.sampling.plan import plan_calls
from jaxrl_llm.train import load_config

VOCAB = 24
PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10, 11], [12, 13]]
COUNTS = [3, 0, 5, 1, 2]  # 11 rows; prompt 2's samples straddle calls of 4 rows


@pytest.fixture(scope="module")
def tiny():
    return tiny_sampler_model(VOCAB)  # logits spread over a few nats, so draws differ by key


def test_plan_calls_split_rows_by_hand():
    lengths = np.array([len(p) for p in PROMPTS])
    counts = np.array(COUNTS)
    plan = make_plan(lengths, counts, 6)
    runs = plan_calls(lengths, counts, 6, max_rows_per_call=4)
    # Rows by prompt: 0 0 0 | 2 2 2 2 2 | 3 | 4 4 -> runs of 4: [0 0 0 2], [2 2 2 2], [3 4 4].
    assert [call.first_row for call in runs] == [0, 4, 8]
    assert [call.shapes.row_prompt.tolist() for call in runs] == [[0, 0, 0, 2], [2, 2, 2, 2], [3, 4, 4]]
    assert [call.shapes.prefill_prompts.tolist() for call in runs] == [[0, 2], [2], [3, 4]]
    assert {call.shapes.row_bucket for call in runs} == {4}  # one compiled decode for every run
    assert {call.shapes.prompt_bucket for call in runs} == {plan.prompt_bucket} == {16}
    assert {call.shapes.prompts_per_prefill for call in runs} == {plan.prompts_per_prefill} == {4}  # one prefill
    assert {call.shapes.prompt_group for call in runs} == {1}  # counts 3, 1, 4, 1, 2 share no group
    assert {call.shapes.row_bucket for call in plan_calls(lengths, counts, 6, max_rows_per_call=1)} == {2}  # never 1
    for per_call in (0, 11):  # one call: make_plan's plan
        [call] = plan_calls(lengths, counts, 6, max_rows_per_call=per_call)
        assert call.first_row == 0 and dataclasses.replace(call.shapes, row_prompt=None, prefill_prompts=None) \
            == dataclasses.replace(plan, row_prompt=None, prefill_prompts=None)
        assert call.shapes.row_prompt.tolist() == plan.row_prompt.tolist()
    sharded = plan_calls(lengths, counts, 6, max_rows_per_call=3, row_multiple=2)  # padded to the 2-device split
    assert [call.shapes.num_rows for call in sharded] == [3, 3, 3, 2]
    assert {call.shapes.row_bucket for call in sharded} == {4}


def test_plan_calls_row_bucket_hand_values():
    def row_bucket(rows, per_call, multiple=1):
        calls = plan_calls(np.array([3]), np.array([rows]), 6, max_rows_per_call=per_call, row_multiple=multiple)
        assert {call.shapes.row_bucket for call in calls} == {calls[0].shapes.row_bucket}
        return calls[0].shapes.row_bucket

    assert row_bucket(11, 0) == 16  # one call: make_plan's bucket of all rows
    assert row_bucket(11, 11) == 16 and row_bucket(11, 12) == 16
    assert row_bucket(11, 5) == 8 and row_bucket(11, 1) == 2  # never a 1-row state
    assert row_bucket(8192, 1024, 8) == 1024 and row_bucket(8192, 100, 16) == 128
    assert row_bucket(8192, 300, 1) == 512  # above 256 rows, buckets are multiples of 256


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_chunked_calls_equal_one_call(tiny, temperature, top_k, top_p):
    config, params = tiny
    kwargs = dict(num_samples=COUNTS, max_new_tokens=6, temperature=temperature, top_k=top_k, top_p=top_p,
                  stop_ids=(5,), rng=jax.random.key(3), pad_id=0)
    whole = generate(params, config, PROMPTS, **kwargs)
    for per_call in (1, 4, 5):
        chunked = generate(params, config, PROMPTS, max_rows_per_call=per_call, **kwargs)
        for name, a, b in zip(whole._fields, whole, chunked):
            message = f"{name} with max_rows_per_call={per_call}"
            # Other rows per call compile other programs, whose f32 rounding may differ (by CPU): log-probs to
            # rounding. Tokens exactly: a row draws with its output row's key in every call, so a token could
            # only move if rounding put its draw within ~1e-6 of a CDF boundary (24 tokens, 66 draws).
            if name == "logprobs":
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=message)
            else:
                np.testing.assert_array_equal(a, b, err_msg=message)
    # Rows differ from one another and some stop early: the equality above is not that of identical rows.
    assert len({tuple(row) for row in whole.tokens}) > 5 and whole.finish_reason.min() == 0


def test_rows_follow_their_output_index_not_their_call(tiny):
    """A run's rows draw with the keys of their output rows: a prompt sampled alone in a later call differs
    from the same prompt sampled as rows 0.. of its own call, so the offset is what makes chunking exact."""
    config, params = tiny
    kwargs = dict(max_new_tokens=6, rng=jax.random.key(3))
    chunked = generate(params, config, PROMPTS, num_samples=COUNTS, max_rows_per_call=4, **kwargs)
    alone = generate(params, config, [PROMPTS[3]], num_samples=1, **kwargs)  # prompt 3 as output row 0
    assert not np.array_equal(chunked.tokens[8], alone.tokens[0])


def test_bad_max_rows_per_call(tiny):
    config, params = tiny
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="max_rows_per_call must be an int >= 0"):
            generate(params, config, PROMPTS, num_samples=1, max_new_tokens=2, rng=jax.random.key(0),
                     max_rows_per_call=bad)
    with pytest.raises(ConfigError, match="sampling.max_rows_per_call.*>= 0"):
        load_config(None, ["sampling.max_rows_per_call=-2"])
    with pytest.raises(ConfigError, match="sampling.gvm_rows_per_chunk.*>= 0"):
        load_config(None, ["sampling.gvm_rows_per_chunk=-1"])
    assert load_config(None, ["sampling.max_rows_per_call=64"]).sampling.max_rows_per_call == 64
    assert load_config(None, []).sampling.max_rows_per_call == 0


MESH_SCRIPT = textwrap.dedent("""
    import json
    import jax
    import numpy as np
    from jaxrl_llm.models import ModelConfig, init_params
    from jaxrl_llm.models.sharding import make_mesh
    from jaxrl_llm.sampling import generate

    config = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, tie_word_embeddings=True, max_position_embeddings=512)
    params = init_params(config, jax.random.key(0))
    params["embed"] = params["embed"] * 3.0
    mesh = make_mesh("data=2,fsdp=2")
    kwargs = dict(num_samples=[3, 0, 5, 1, 2], max_new_tokens=6, stop_ids=(5,), rng=jax.random.key(3), mesh=mesh)
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10, 11], [12, 13]]
    whole = generate(params, config, prompts, **kwargs)
    chunked = generate(params, config, prompts, max_rows_per_call=3, **kwargs)  # 3-row calls on 4 row shards
    # 3-row calls compile other programs than one call: log-probs to f32 rounding, the rest exactly
    same = {name: np.allclose(a, b, rtol=1e-6, atol=1e-6) if name == "logprobs" else np.array_equal(a, b)
            for name, a, b in zip(whole._fields, whole, chunked)}
    print("RESULT", json.dumps({name: bool(v) for name, v in same.items()}))
""")


def test_chunked_calls_on_a_mesh_equal_one_call():
    """Rows sharded over data=2 x fsdp=2 simulated devices: calls of 3 rows (state padded to 4, one row per
    device) give the rows of one call. A subprocess, since the device count is fixed when JAX starts."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT], capture_output=True, text=True, env=env,
                          cwd=pathlib.Path(__file__).resolve().parents[1], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result == {name: True for name in result} and len(result) == 8, result  # routes: None (dense)
