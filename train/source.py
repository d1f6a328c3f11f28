"""What a trainer takes batches from: the `Source` protocol, and `PlannedSource`, the part every
source shares (its epoch plan, dflash_cache.train.epoch_plan, and its data position).

The cache source (dflash_cache.train.cache_source) and the live source
(dflash_cache.train.live_source) implement it. A source owns the data position: `position` is
where training stands in the plan (the epoch, and the batches of it all ranks together have
trained on); the trainer `advance`s it past each batch it trained on (batches are read, and
prepared, ahead of that), and a checkpoint holds it through `state_dict`. The plan is recomputed
from the position on resume, so two integers resume a source exactly.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Protocol, runtime_checkable

import numpy as np

from dflash_cache.store.batch import PackedBatch
from dflash_cache.train.epoch_plan import Position, SampleTable, SourceConfig, position_after
from dflash_cache.train.place import Place


@runtime_checkable
class Source(Protocol):
    """Packed batches of this process's share of an epoch plan, on its device."""

    table: SampleTable
    config: SourceConfig
    position: Position

    def iterate(self, start: Position,
                epochs: int | None = None) -> Generator[tuple[Position, PackedBatch], None, None]:
        """(position after the batch, the batch) from `start` on, epoch after epoch (forever if
        `epochs` is None)."""
        ...

    def epoch_batches(self, epoch: int, start: int = 0) -> list[np.ndarray]: ...

    def batches_per_epoch(self) -> int: ...

    def batches_left(self, epochs: int) -> int: ...

    def longest_sample(self) -> int: ...

    def identity(self) -> dict[str, str]:
        """What a resumed run must find again (the same samples, in the same stored form)."""
        ...

    def advance(self, position: Position) -> None: ...

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...

    def close(self) -> None: ...


class PlannedSource:
    """A source's plan and position: rank `place.rank` of `place.world` takes every world-th batch
    of the global plan of `table` under `config` (at most `config.max_batches` of an epoch)."""

    def __init__(self, table: SampleTable, config: SourceConfig, place: Place) -> None:
        self.table, self.config, self.place = table, config, place
        self.device, self.rank, self.world, self.profiler = place.device, place.rank, place.world, place.profiler
        self.position = Position(0, 0)

    def epoch_batches(self, epoch: int, start: int = 0) -> list[np.ndarray]:
        """This rank's batches of `epoch` from global batch `start` on, as arrays of table positions."""
        return self.table.epoch(self.config, epoch, self.rank, self.world, start)[:self.config.max_batches]

    def batches_per_epoch(self) -> int:
        return len(self.epoch_batches(0))

    def batches_left(self, epochs: int) -> int:
        """This rank's batches from `position` to the end of epoch `epochs` - 1."""
        rest = len(self.epoch_batches(self.position.epoch, self.position.batch))
        return rest + self.batches_per_epoch() * max(0, epochs - self.position.epoch - 1)

    def longest_sample(self) -> int:
        return int(self.table.lengths.max(initial=0))

    def epoch_plans(self, start: Position, epochs: int | None) -> Iterator[tuple[int, int, list[np.ndarray]]]:
        """(epoch, its first global batch, this rank's batches of it from there) from `start` on, epoch after
        epoch; nothing if no epoch plans a batch (every epoch plans the same number)."""
        epoch, first = start.epoch, start.batch
        while epochs is None or epoch < epochs:
            plan = self.epoch_batches(epoch, first)
            if not plan and first == 0:
                return
            yield epoch, first, plan
            epoch, first = epoch + 1, 0

    def planned(self, start: Position, epochs: int | None) -> Iterator[tuple[Position, np.ndarray]]:
        """(position after the batch, its rows) of this rank from the global position `start` on."""
        for epoch, first, plan in self.epoch_plans(start, epochs):
            for i, rows in enumerate(plan):
                yield position_after(epoch, first, i, self.world), rows

    def advance(self, position: Position) -> None:
        """Training has taken the batches up to `position` (the one `iterate` gave with the batch)."""
        self.position = position

    def state_dict(self) -> dict[str, int]:
        """The global position: the epoch and the batches of it all ranks together trained on."""
        return {"epoch": self.position.epoch, "batch": self.position.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = Position(state["epoch"], state["batch"])
