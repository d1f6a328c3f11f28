"""The plan a cache is made by, and its on-disk form, plan.parquet (one row per planned sample).

A `Plan` is a list of `PlannedBatch`es: which dataset rows (in order) go into each future segment,
named by (unit, batch). `dflash_cache.extract.planning` makes plans; this module is the only one
that reads or writes plan.parquet, so extraction's ranks, the live tee and `inspect` need neither
the dataset nor the planner to know what a cache should hold.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from dflash_cache.errors import CacheCorruptError, UserError
from dflash_cache.files import ParquetLimits, write_parquet_atomic
from dflash_cache.options import check_options, option
from dflash_cache.store.layout import PLAN_FILE, segment_name
from dflash_cache.store.manifest import Manifest, PlanParams

if TYPE_CHECKING:  # the reader loads torch: plans are made (and options declared) without it
    from dflash_cache.store.location import Location

DEFAULT_BUCKETS = (0, 770, 1216, 1728, 2432, 3296)
DEFAULT_TOKEN_BUDGET = 49152
DEFAULT_MAX_ROWS = 64
DEFAULT_UNIT_ROWS = 4096


@dataclass(frozen=True, slots=True)
class PlanConfig:
    """How rows are batched into segments; the fields are also `extract`'s options."""

    token_budget: int = option(DEFAULT_TOKEN_BUDGET, min=1, help="Padded tokens per forward batch.")
    max_rows: int = option(DEFAULT_MAX_ROWS, min=1, help="Rows per forward batch at most.")
    unit_rows: int = option(DEFAULT_UNIT_ROWS, min=1, help="Dataset rows per work unit (sort window).")
    bucket_bounds: tuple[int, ...] = option(DEFAULT_BUCKETS, flag="--buckets",
                                            help="Length-bucket lower bounds; rows batch only with rows of their "
                                                 "bucket.")

    def __post_init__(self) -> None:
        check_options(self)
        b = self.bucket_bounds
        if not b or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:], strict=False)):
            raise UserError(f"--buckets {','.join(map(str, b)) or '(empty)'} must start at 0 and increase, "
                            "e.g. 0,770,1216")


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

    @property
    def padded_tokens(self) -> int:
        """What the target's forward costs: rows x the longest row (the batch is padded to it)."""
        return len(self.lengths) * int(self.lengths.max(initial=0))


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

    def params(self, *, max_len: int | None, overlong: str) -> PlanParams:
        """What a manifest records of this plan, with the --max-len policy its lengths were taken under."""
        c = self.config
        return PlanParams(
            unit_rows=c.unit_rows, token_budget=c.token_budget, max_rows=c.max_rows,
            bucket_bounds=tuple(c.bucket_bounds), max_len=max_len, overlong=overlong,
            num_rows=self.num_rows, num_units=self.num_units, num_segments=len(self.batches),
            num_samples=self.num_samples, num_tokens=self.num_tokens,
        )

    def missing(self, committed: set[str]) -> list[PlannedBatch]:
        """The planned batches whose segments are not committed, in plan order."""
        return [b for b in self.batches if segment_name(b.unit, b.batch) not in committed]

    def summary(self) -> str:
        """The plan as printed at start: batch count, rows per batch, and the bucket table."""
        rows = np.array([len(b.rows) for b in self.batches]) if self.batches else np.zeros(1)
        lines = [f"Batches per epoch: {len(self.batches)} (min={rows.min()} max={rows.max()} avg={rows.mean():.1f})"]
        buckets = np.asarray([b.bucket for b in self.batches], dtype=np.int64)
        counts = np.bincount(buckets, minlength=len(self.config.bucket_bounds)).tolist()
        lines += bucket_table(self.config.bucket_bounds, counts, "batches")
        return "\n".join(lines)


def bucket_table(bounds: list[int] | tuple[int, ...], counts: list[int], noun: str) -> list[str]:
    """`  Bucket i [lo, hi):  count noun (pct%)` lines, the layout extract's plan print uses too."""
    total = max(1, sum(counts))
    width = len(str(max(bounds[-1], 1)))
    lines = []
    for i, lo in enumerate(bounds):
        hi = bounds[i + 1] if i + 1 < len(bounds) else "inf"
        lines.append(f"  Bucket {i} [{lo:>{width}}, {hi}): {counts[i]:>6} {noun} ({100 * counts[i] / total:5.1f}%)")
    return lines


def deal(batches: Sequence[PlannedBatch], world: int) -> list[list[PlannedBatch]]:
    """Share `batches` out over `world` ranks so their forward work is even, whatever the data's size.

    Largest batch first, each to the rank with the least padded tokens so far (ties: the lowest
    rank); each share is then put back in plan order, so a rank reads the dataset front to back.
    Every rank computes the same shares from the same plan and the same committed set, and a resume
    with another rank count simply deals what is still missing.
    """
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    order = sorted(range(len(batches)), key=lambda i: (-batches[i].padded_tokens, i))
    loads = [(0, rank) for rank in range(world)]  # a heap of (padded tokens, rank)
    shares: list[list[int]] = [[] for _ in range(world)]
    for i in order:
        load, rank = heapq.heappop(loads)
        shares[rank].append(i)
        heapq.heappush(loads, (load + batches[i].padded_tokens, rank))
    return [[batches[i] for i in sorted(share)] for share in shares]


PLAN_SCHEMA = pa.schema([("row", pa.int64()), ("unit", pa.int32()), ("batch", pa.int32()), ("bucket", pa.int16()),
                         ("length", pa.int32())])
PLAN_COLUMNS = tuple(PLAN_SCHEMA.names)


def plan_limits(manifest: Manifest) -> ParquetLimits:
    """What plan.parquet may claim: the plan's columns, one row per sample the manifest plans."""
    n = manifest.plan.num_samples
    return ParquetLimits(PLAN_SCHEMA, n, f"the manifest plans {n} samples")


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


def write_plan_table(root: Path, plan: Plan) -> None:
    """The plan, one row per sample in plan order, so workers and `inspect` need neither data nor planner."""
    parts = {"row": [], "unit": [], "batch": [], "bucket": [], "length": []}
    for b in plan.batches:
        n = len(b.rows)
        parts["row"].append(b.rows)
        parts["unit"].append(np.full(n, b.unit, np.int32))
        parts["batch"].append(np.full(n, b.batch, np.int32))
        parts["bucket"].append(np.full(n, b.bucket, np.int16))
        parts["length"].append(b.lengths)
    write_parquet_atomic(root / PLAN_FILE, pa.table({k: np.concatenate(v) for k, v in parts.items()}))


def read_plan(root: str | Path | Location, manifest: Manifest) -> Plan:
    """The plan a cache (a directory, a URL or a location) was made with, from plan.parquet and the manifest."""
    from dflash_cache.store.reader import read_parquet

    t = read_parquet(root, PLAN_FILE, plan_limits(manifest))
    p = manifest.plan
    config = PlanConfig(token_budget=p.token_budget, max_rows=p.max_rows, unit_rows=p.unit_rows,
                        bucket_bounds=tuple(p.bucket_bounds))
    return plan_from_columns(config, p.num_rows, *(t.column(c).to_numpy() for c in PLAN_COLUMNS))


def segments_of_plan(t: pa.Table | None) -> list[tuple[int, int]]:
    """(unit, batch) of every segment in a plan.parquet table (none without one)."""
    if t is None:
        return []
    if not {"unit", "batch"} <= set(t.column_names):
        raise CacheCorruptError(f"{PLAN_FILE} has no unit and batch columns; copy the cache again or re-run extract")
    pairs = np.stack([t.column("unit").to_numpy(), t.column("batch").to_numpy()], axis=1)
    return [tuple(p) for p in np.unique(pairs, axis=0).tolist()]
