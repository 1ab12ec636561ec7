"""The rollout and RL-step benchmarks' counting helpers, against hand counts."""

import importlib.util
import pathlib

import numpy as np
import pytest

_DIR = pathlib.Path(__file__).parent.parent / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"{name}_bench", _DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rollouts = _load("rollouts")
rl_step = _load("rl_step")


def test_useful_lengths_counts_through_the_first_stop():
    tokens = np.array([[5, 2, 7, 7],    # stop at index 1 -> 2 tokens
                       [5, 6, 7, 8],    # no stop -> the full width, 4
                       [0, 2, 2, 2],    # the first token is a stop id -> 1
                       [9, 9, 9, 2]])   # stop as the last token -> 4
    assert rollouts.useful_lengths(tokens, (2, 0)).tolist() == [2, 4, 1, 4]


def test_lengths_before_stop_adds_the_stop_token():
    # tunix cuts its output before the first stop id: 3 kept of 8 -> 4 useful; 8 kept -> no stop, 8; 7 -> 8.
    assert rollouts.lengths_before_stop([3, 8, 0, 7], 8).tolist() == [4, 8, 1, 8]


def test_batches():
    assert rollouts.batches(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert rollouts.batches(4, 8) == [(0, 4)]


def test_slot_steps_and_occupancy_hand_count():
    # call 1: 4 rows (bucket), lengths 3, 5 and two padding rows -> 4 x 5 = 20 slots;
    # call 2: 4 rows, lengths 2, 2, 1, 4 -> 4 x 4 = 16 slots. Useful 3 + 5 + 2 + 2 + 1 + 4 = 17.
    calls = [np.array([3, 5]), np.array([2, 2, 1, 4])]
    assert rollouts.slot_steps(calls, [4, 4]) == 36
    assert rollouts.occupancy(17, 36) == pytest.approx(17 / 36)
    assert rollouts.occupancy(0, 0) == 0.0


def test_slot_steps_rejects_more_lengths_than_rows():
    with pytest.raises(ValueError):
        rollouts.slot_steps([np.array([1, 2, 3])], [2])
    with pytest.raises(ValueError):
        rollouts.slot_steps([np.array([1])], [2, 2])


def test_summary_figures():
    calls = [np.array([3, 5]), np.array([2, 2])]
    result = rollouts.summary("x", np.array([3, 5, 2, 2]), calls, [2, 2], [4.0, 2.0, 3.0])
    assert result["useful_tokens"] == 12 and result["slot_steps"] == 14
    assert result["seconds"] == 3.0 and result["useful_tok_s"] == 4.0
    assert result["mean_length"] == 3.0 and result["max_length"] == 5 and result["calls"] == 2


def test_median_split_leaves_out_the_compiling_step():
    steps = [dict(wall_s=30.0, sample_s=20.0, score_s=1.0, train_s=9.0),
             dict(wall_s=4.0, sample_s=2.0, score_s=0.5, train_s=1.5),
             dict(wall_s=6.0, sample_s=3.0, score_s=0.5, train_s=2.5),
             dict(wall_s=5.0, sample_s=1.0, score_s=1.5, train_s=2.5)]
    assert rl_step.median_split(steps) == dict(wall_s=5.0, sample_s=2.0, score_s=0.5, train_s=2.5)
    assert rl_step.median_split(steps[:1]) == dict(wall_s=30.0, sample_s=20.0, score_s=1.0, train_s=9.0)


def test_compile_counter_counts_backend_compiles():
    import jax

    with rl_step.CompileCounter() as counter:
        f = jax.jit(lambda x: x * 3 + 1)  # host arrays in: no other program (jnp.ones would compile one)
        f(np.ones(7, np.float32)).block_until_ready()
        f(np.ones(7, np.float32)).block_until_ready()  # cached: no new compile
        first = counter.count
        f(np.ones(9, np.float32)).block_until_ready()  # a new shape compiles again
    assert first >= 1 and counter.count == first + 1
    f(np.ones(11, np.float32)).block_until_ready()  # after exit the listener is gone
    assert counter.count == first + 1
