from __future__ import annotations

import numpy as np
import pytest

from dflash_cache.data.planning import make_plan
from dflash_cache.errors import UserError
from dflash_cache.store.layout import segment_name
from dflash_cache.store.plan import PlanConfig, deal, plan_from_columns


def _plan(lengths, keep=None, **kw):
    lengths = np.asarray(lengths, dtype=np.int32)
    keep = np.ones(len(lengths), bool) if keep is None else np.asarray(keep)
    return make_plan(lengths, keep, PlanConfig(**kw))


@pytest.mark.parametrize("unit_rows", [1, 7, 50, 1000])
@pytest.mark.parametrize("budget,max_rows", [(64, 4), (300, 8), (10_000, 64)])
def test_every_kept_row_once_within_budget(unit_rows, budget, max_rows):
    rng = np.random.default_rng(unit_rows + budget)
    lengths = rng.integers(1, 200, size=333)
    keep = rng.random(333) > 0.1
    plan = _plan(lengths, keep, token_budget=budget, max_rows=max_rows, unit_rows=unit_rows,
                 bucket_bounds=(0, 50, 120))
    rows = np.concatenate([b.rows for b in plan.batches])
    assert sorted(rows.tolist()) == np.flatnonzero(keep).tolist()
    for b in plan.batches:
        assert len(b.rows) <= max_rows
        assert len(b.rows) == 1 or len(b.rows) * int(b.lengths.max()) <= budget
        assert np.array_equal(b.lengths, lengths[b.rows])
        assert np.all(np.diff(b.lengths) >= 0), "rows sorted by length"
        assert len(set(b.rows // unit_rows)) == 1 and b.unit == b.rows[0] // unit_rows
        bucket = np.searchsorted([0, 50, 120], b.lengths, side="right") - 1
        assert np.all(bucket == b.bucket), "a batch never mixes buckets"
    assert plan.num_tokens == int(lengths[keep].sum())


def test_plan_is_deterministic_and_independent_of_ranks():
    lengths = np.random.default_rng(3).integers(1, 500, size=1000)
    a = _plan(lengths, unit_rows=100, token_budget=2000)
    b = _plan(lengths, unit_rows=100, token_budget=2000)
    assert [(x.unit, x.batch, x.rows.tolist()) for x in a.batches] == [(x.unit, x.batch, x.rows.tolist()) for x in b.batches]
    for world in (1, 2, 3, 8):
        shares = deal(a.batches, world)
        names = [(x.unit, x.batch) for s in shares for x in s]
        assert sorted(names) == sorted((x.unit, x.batch) for x in a.batches)
        assert len(names) == len(set(names))
        again = deal(b.batches, world)
        assert [[(x.unit, x.batch) for x in s] for s in shares] == [[(x.unit, x.batch) for x in s] for s in again]


@pytest.mark.parametrize("world", [2, 3, 8])
def test_dealt_shares_carry_even_work_in_plan_order(world):
    lengths = np.random.default_rng(4).integers(1, 3000, size=3000)
    plan = _plan(lengths, unit_rows=1000, token_budget=8192, max_rows=16)
    shares = deal(plan.batches, world)
    loads = [sum(b.padded_tokens for b in s) for s in shares]
    assert max(loads) - min(loads) <= max(b.padded_tokens for b in plan.batches)
    assert max(loads) / min(loads) < 1.01, loads
    position = {(b.unit, b.batch): i for i, b in enumerate(plan.batches)}
    for share in shares:
        assert [position[(b.unit, b.batch)] for b in share] == sorted(position[(b.unit, b.batch)] for b in share)


def test_a_dataset_of_one_work_unit_still_splits_over_every_rank():
    plan = _plan(np.full(64, 100), unit_rows=4096, token_budget=800, max_rows=8)
    assert plan.num_units == 1 and len(plan.batches) == 8
    assert [len(s) for s in deal(plan.batches, 2)] == [4, 4]
    assert [len(s) for s in deal(plan.batches, 3)] == [3, 3, 2]


def test_what_is_dealt_is_only_what_is_missing():
    plan = _plan(np.full(64, 100), unit_rows=4096, token_budget=800, max_rows=8)
    done = {segment_name(b.unit, b.batch) for b in plan.batches[:5]}
    assert [b.batch for b in plan.missing(done)] == [5, 6, 7]


def test_row_longer_than_budget_gets_its_own_batch():
    plan = _plan([10, 5000, 10], token_budget=100, max_rows=8, bucket_bounds=(0,))
    assert sorted(len(b.rows) for b in plan.batches) == [1, 2]


def test_summary_format():
    plan = _plan([100] * 10 + [1000] * 3, token_budget=400, max_rows=64, bucket_bounds=(0, 770))
    text = plan.summary().splitlines()
    assert text[0] == "Batches per epoch: 6 (min=1 max=4 avg=2.2)"
    assert text[1] == "  Bucket 0 [  0, 770):      3 batches ( 50.0%)"
    assert text[2] == "  Bucket 1 [770, inf):      3 batches ( 50.0%)"


def test_round_trip_through_columns():
    lengths = np.random.default_rng(5).integers(1, 300, size=200)
    plan = _plan(lengths, unit_rows=64, token_budget=1000)
    cols = {k: [] for k in ("row", "unit", "batch", "bucket", "length")}
    for b in plan.batches:
        cols["row"] += b.rows.tolist()
        cols["unit"] += [b.unit] * len(b.rows)
        cols["batch"] += [b.batch] * len(b.rows)
        cols["bucket"] += [b.bucket] * len(b.rows)
        cols["length"] += b.lengths.tolist()
    again = plan_from_columns(plan.config, plan.num_rows, *(np.array(cols[k]) for k in cols))
    assert [(x.unit, x.batch, x.bucket, x.rows.tolist()) for x in again.batches] == [
        (x.unit, x.batch, x.bucket, x.rows.tolist()) for x in plan.batches
    ]


@pytest.mark.parametrize("kw", [dict(token_budget=0), dict(max_rows=0), dict(unit_rows=0),
                                dict(bucket_bounds=(5, 10)), dict(bucket_bounds=(0, 10, 10))])
def test_bad_config(kw):
    with pytest.raises(UserError):
        PlanConfig(**kw)
