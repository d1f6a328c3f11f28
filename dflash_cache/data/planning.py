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

import numpy as np

from dflash_cache.store.plan import Plan, PlanConfig, PlannedBatch


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
