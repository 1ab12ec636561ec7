"""The grain pipeline: records -> per-process shard -> seeded shuffle -> batches of records -> epochs.

Built on ``grain.MapDataset`` (random access), so the whole stream is a pure function of
(records, seed, shard): batch b of process p is the same on every run, and resuming only needs the
position, ``{"next_index": b}``, which is what ``get_state`` returns (JSON-able, for checkpoints).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grain


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    """Batching, order and sharding of a record stream.

    batch_size: records per batch on THIS process. num_epochs: None repeats forever. shuffle: a new
    seeded permutation each epoch (grain reseeds every repeat). shard_index / shard_count: this
    process's share; None means ``jax.process_index()`` / ``jax.process_count()``.
    drop_remainder: drop each epoch's last partial batch (else it is yielded short).
    """

    batch_size: int
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None
    shard_index: int | None = None
    shard_count: int | None = None
    drop_remainder: bool = True

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None (forever), got {self.num_epochs}")


def _shard(config: LoaderConfig) -> tuple[int, int]:
    index, count = config.shard_index, config.shard_count
    if index is None or count is None:
        import jax  # only needed when the shard is not given explicitly

        index = jax.process_index() if index is None else index
        count = jax.process_count() if count is None else count
    if not 0 <= index < count:
        raise ValueError(f"shard_index must be in [0, shard_count={count}), got {index}")
    return index, count


def shard_records(records: Sequence, shard_index: int, shard_count: int) -> grain.MapDataset:
    """Process ``shard_index``'s share: records i with i % shard_count == shard_index.

    The tail ``len % shard_count`` records are dropped first so every process gets the same number of
    records and so the same number of steps (unequal shards would leave hosts waiting on each other).
    """
    even = len(records) - len(records) % shard_count
    if even == 0:
        raise ValueError(f"{len(records)} records cannot be split over {shard_count} processes")
    return grain.MapDataset.source(records)[shard_index:even:shard_count]


def make_dataset(records: Sequence[dict], config: LoaderConfig) -> grain.MapDataset:
    """The batched MapDataset for this process: shard -> shuffle -> batch (lists of records) -> repeat."""
    if len(records) == 0:
        raise ValueError("no records to load")
    dataset = shard_records(records, *_shard(config))
    if config.drop_remainder and len(dataset) < config.batch_size:
        raise ValueError(f"this process's shard holds {len(dataset)} records, fewer than batch_size "
                         f"{config.batch_size}: no full batch (use a smaller batch or drop_remainder=False)")
    if config.shuffle:
        dataset = dataset.shuffle(seed=config.seed)
    # batch before repeat: every epoch starts a new batch; repeat reseeds the shuffle each epoch
    dataset = dataset.batch(config.batch_size, drop_remainder=config.drop_remainder, batch_fn=list)
    return dataset.repeat(config.num_epochs)


class RecordBatches:
    """Iterator over batches (lists of record dicts) with a checkpointable position.

    ``get_state()`` -> ``{"next_index": int, "seed": int, "shard": [index, count]}``; ``set_state``
    restores it (and refuses a state written for a different seed or shard).
    """

    def __init__(self, records: Sequence[dict], config: LoaderConfig):
        self.config = config
        self.shard_index, self.shard_count = _shard(config)
        self.shard_size = len(records) // self.shard_count  # records this process reads per epoch
        self._dataset = make_dataset(records, dataclasses.replace(
            config, shard_index=self.shard_index, shard_count=self.shard_count))
        self._iterator = iter(self._dataset.to_iter_dataset(
            grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))  # records are in memory: no prefetch

    @property
    def batches_per_epoch(self) -> int:
        """Batches in one pass over this process's shard (a partial batch counts unless dropped)."""
        full, partial = divmod(self.shard_size, self.config.batch_size)
        return full + (1 if partial and not self.config.drop_remainder else 0)

    def __iter__(self):
        return self

    def __next__(self) -> list[dict]:
        return next(self._iterator)

    def get_state(self) -> dict:
        state = dict(self._iterator.get_state())
        state.update(seed=self.config.seed, shard=[self.shard_index, self.shard_count])
        return state

    def set_state(self, state: dict) -> None:
        if state.get("seed", self.config.seed) != self.config.seed:
            raise ValueError(f"data state was saved with seed {state['seed']}, this loader has seed {self.config.seed}")
        if list(state.get("shard", [self.shard_index, self.shard_count])) != [self.shard_index, self.shard_count]:
            raise ValueError(f"data state was saved for shard {state['shard']}, this process reads shard "
                             f"{[self.shard_index, self.shard_count]}")
        self._iterator.set_state({key: value for key, value in state.items() if key not in ("seed", "shard")})
