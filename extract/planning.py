"""The deterministic extraction plan: work units, length buckets, token-budget batches.

The dataset is cut into work units of `unit_rows` consecutive rows. Inside a unit, rows are sorted
by length, split into length buckets, and packed greedily into batches whose *padded* size
(rows x longest row) stays under the token budget and whose row count stays under the cap. Each
batch becomes one segment, named by (unit, batch). The plan depends only on the dataset's
lengths and these parameters, never on the number of ranks: that is what lets a cache be
resumed by a run with another GPU count. Units are sorted windows rather than one global sort so
that a unit reads one contiguous slice of the dataset (Parquet row groups, JSONL lines).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from dflash_cache.errors import UserError
from dflash_cache.inspect import bucket_table

DEFAULT_BUCKETS = (0, 770, 1216, 1728, 2432, 3296)
DEFAULT_TOKEN_BUDGET = 49152
DEFAULT_MAX_ROWS = 64
DEFAULT_UNIT_ROWS = 4096


@dataclass(frozen=True, slots=True)
class PlanConfig:
    token_budget: int = DEFAULT_TOKEN_BUDGET
    max_rows: int = DEFAULT_MAX_ROWS
    unit_rows: int = DEFAULT_UNIT_ROWS
    bucket_bounds: tuple[int, ...] = DEFAULT_BUCKETS

    def __post_init__(self) -> None:
        if self.token_budget < 1:
            raise UserError(f"--token-budget must be positive, got {self.token_budget}")
        if self.max_rows < 1:
            raise UserError(f"--max-rows must be positive, got {self.max_rows}")
        if self.unit_rows < 1:
            raise UserError(f"--unit-rows must be positive, got {self.unit_rows}")
        b = self.bucket_bounds
        if not b or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:], strict=False)):
            raise UserError(f"bucket bounds {list(b)} must start at 0 and increase")


@dataclass(frozen=True, slots=True)
class PlannedBatch:
    """One future segment: which dataset rows (global indices, in order) and its bucket."""

    unit: int
    batch: int
    bucket: int
    rows: np.ndarray  # int64 global row indices, sorted by length
    lengths: np.ndarray  # int32 tokens per row

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


@dataclass(frozen=True, slots=True)
class Plan:
    config: PlanConfig
    num_rows: int
    batches: tuple[PlannedBatch, ...]

    @property
    def num_units(self) -> int:
        return -(-self.num_rows // self.config.unit_rows)

    @property
    def num_tokens(self) -> int:
        return sum(b.num_tokens for b in self.batches)

    @property
    def num_samples(self) -> int:
        return sum(len(b.rows) for b in self.batches)

    def for_rank(self, rank: int, world: int) -> Iterator[PlannedBatch]:
        """Whole units go to one rank (unit % world == rank) so each rank reads contiguous rows."""
        return (b for b in self.batches if b.unit % world == rank)

    def summary(self) -> str:
        """The plan as printed at start: batch count, rows per batch, and the bucket table."""
        rows = np.array([len(b.rows) for b in self.batches]) if self.batches else np.zeros(1)
        lines = [f"Batches per epoch: {len(self.batches)} (min={rows.min()} max={rows.max()} avg={rows.mean():.1f})"]
        buckets = np.asarray([b.bucket for b in self.batches], dtype=np.int64)
        counts = np.bincount(buckets, minlength=len(self.config.bucket_bounds)).tolist()
        lines += bucket_table(self.config.bucket_bounds, counts, "batches")
        return "\n".join(lines)


def buckets_of(lengths: np.ndarray, bounds: tuple[int, ...]) -> np.ndarray:
    """The length bucket of each length: i such that bounds[i] <= length < bounds[i + 1]."""
    return np.searchsorted(np.asarray(bounds), lengths, side="right") - 1


def plan_unit(unit: int, first_row: int, lengths: np.ndarray, keep: np.ndarray, config: PlanConfig) -> list[PlannedBatch]:
    """Batches of one unit. `lengths`/`keep` cover the unit's rows only."""
    local = np.flatnonzero(keep)
    order = local[np.argsort(lengths[local], kind="stable")]
    bucket_of = buckets_of(lengths[order], config.bucket_bounds)
    batches: list[PlannedBatch] = []
    for bucket in np.unique(bucket_of):
        rows = order[bucket_of == bucket]
        start = 0
        while start < len(rows):
            stop = start + 1
            # Rows are ascending, so the padded size of rows[start:stop] is (stop - start) * len[stop-1].
            while (
                stop < len(rows)
                and stop - start < config.max_rows
                and (stop + 1 - start) * int(lengths[rows[stop]]) <= config.token_budget
            ):
                stop += 1
            chosen = rows[start:stop]
            batches.append(
                PlannedBatch(
                    unit=unit,
                    batch=len(batches),
                    bucket=int(bucket),
                    rows=(chosen + first_row).astype(np.int64),
                    lengths=lengths[chosen].astype(np.int32),
                )
            )
            start = stop
    return batches


def make_plan(lengths: np.ndarray, keep: np.ndarray, config: PlanConfig) -> Plan:
    n = len(lengths)
    batches: list[PlannedBatch] = []
    for unit, first in enumerate(range(0, n, config.unit_rows)):
        last = min(n, first + config.unit_rows)
        batches += plan_unit(unit, first, lengths[first:last], keep[first:last], config)
    return Plan(config=config, num_rows=n, batches=tuple(batches))


PLAN_COLUMNS = ("row", "unit", "batch", "bucket", "length")


def plan_from_columns(config: PlanConfig, num_rows: int, row: np.ndarray, unit: np.ndarray, batch: np.ndarray,
                      bucket: np.ndarray, length: np.ndarray) -> Plan:
    """Rebuild a Plan from its flat per-sample columns (consecutive rows of one batch)."""
    key = unit.astype(np.int64) << 32 | batch.astype(np.int64)
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if len(key) else np.zeros(0, np.int64)
    stops = np.r_[starts[1:], len(key)]
    batches = tuple(
        PlannedBatch(unit=int(unit[a]), batch=int(batch[a]), bucket=int(bucket[a]),
                     rows=row[a:b].astype(np.int64), lengths=length[a:b].astype(np.int32))
        for a, b in zip(starts, stops, strict=True)
    )
    return Plan(config=config, num_rows=num_rows, batches=batches)
