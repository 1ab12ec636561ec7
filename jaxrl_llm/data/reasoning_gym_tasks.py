"""Adapter over the ``reasoning-gym`` package (Apache-2.0; offline procedural generators), a dependency of
jaxrl_llm, imported only when a reasoning-gym task is asked for. Any of its dataset names works; the ones used here are
``basic_arithmetic``, ``chain_sum`` and ``gsm_symbolic``. Its gold answers are plain strings that the
project's verifier compares like any other gold (tests check the two agree).
"""

from __future__ import annotations

from collections.abc import Iterable

REASONING_GYM_TASKS = ("basic_arithmetic", "chain_sum", "gsm_symbolic")


def _reasoning_gym():
    import reasoning_gym  # slow to import: only when a task is asked for

    return reasoning_gym


def reasoning_gym_records(task: str, *, size: int, seed: int = 0, exclude: Iterable[str] = (),
                          **task_config) -> list[dict]:
    """``size`` problems of reasoning-gym dataset ``task`` generated with ``seed`` (deterministic).

    ``task_config`` goes to the dataset's config (e.g. ``min_terms=2, max_terms=2, min_digits=1,
    max_digits=1, operators=("+", "-"), allow_parentheses=False, allow_negation=False`` for
    ``basic_arithmetic``). Questions listed in ``exclude`` (e.g. a held-out set's) are dropped, so the
    result may be shorter than ``size``. Records keep reasoning-gym's entry under ``"metadata"``.
    """
    reasoning_gym = _reasoning_gym()
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_config)
    except (KeyError, ValueError, TypeError, AssertionError) as err:
        raise ValueError(f"reasoning-gym dataset {task!r} with config {task_config}: {err}") from err
    excluded = set(exclude)
    records = []
    for index, entry in enumerate(dataset):
        if entry["question"] in excluded:
            continue
        records.append({"id": f"rg-{task}-s{seed}-{index}", "source": f"reasoning_gym:{task}",
                        "question": entry["question"], "answer": str(entry["answer"]).strip(),
                        "metadata": entry.get("metadata", {})})
    return records


def reasoning_gym_split(task: str, *, train_size: int, heldout_size: int, seed: int = 0,
                        heldout_seed: int = 10_000, **task_config) -> tuple[list[dict], list[dict]]:
    """(train, held-out) records whose questions never overlap: training drops held-out questions."""
    heldout = reasoning_gym_records(task, size=heldout_size, seed=heldout_seed, **task_config)
    train = reasoning_gym_records(task, size=train_size, seed=seed,
                                  exclude={record["question"] for record in heldout}, **task_config)
    return train, heldout
