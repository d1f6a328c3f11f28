"""Epoch plans with a global position: a run resumes with another number of processes."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_cache.train.epoch_plan import SampleTable, SourceConfig, position_after


def _table(n=400, seed=0) -> SampleTable:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 400, size=n)
    supervised = rng.integers(0, lengths + 1)
    buckets = np.searchsorted([0, 100, 250], lengths, side="right") - 1
    return SampleTable.sorted(np.arange(n), lengths, supervised, buckets)[0]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 3), (3, 2), (4, 4)])
def test_resume_with_another_world_size_continues_the_global_order(before, after):
    table, cfg = _table(), SourceConfig(token_budget=1000, min_supervised=20, seed=3)
    order = [b.tolist() for b in table.epoch(cfg, 2, rank=0, world=1)]
    steps = 5
    consumed = [table.epoch(cfg, 2, rank=r, world=before)[:steps] for r in range(before)]
    position = position_after(2, 0, steps - 1, before)
    assert position.batch == steps * before
    rest = [table.epoch(cfg, 2, rank=r, world=after, start=position.batch) for r in range(after)]
    assert len({len(r) for r in rest}) == 1, "ranks stay in step"
    seen = [b.tolist() for share in consumed for b in share] + [b.tolist() for share in rest for b in share]
    assert sorted(seen) == sorted(order[: len(seen)]) and len(seen) > len(order) - after, \
        "every batch of the epoch once, in the global order, only the remainder dropped"
    assert sorted(b.tolist() for b in consumed[0] + consumed[-1]) == sorted(
        order[i] for i in list(range(0, steps * before, before)) + list(range(before - 1, steps * before, before)))


def test_digest_changes_with_the_samples():
    a, b = _table(seed=0), _table(seed=1)
    assert a.digest() == _table(seed=0).digest() and a.digest() != b.digest()
