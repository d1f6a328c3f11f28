"""Epoch plans shared by every source, so the trainer cannot tell them apart.

A source describes its samples as a `SampleTable` in canonical order (ascending sample id);
`plan_epoch` turns it into this rank's batches for an epoch. Planning is pure numpy, deterministic
in (seed, epoch), and depends on nothing but the table: a cache and a live target over the same
dataset plan identical batches. A position is two integers, (epoch, batches
consumed by all ranks together), from which the plan is recomputed on resume. The position is
global: the epoch's batch order does not depend on the number of ranks (rank r takes every
world-th batch from the position on), so a run can resume with another number of processes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from dflash_cache.errors import UserError


@dataclass(frozen=True, kw_only=True)
class SourceConfig:
    token_budget: int = 32768  # real (unpadded) tokens per packed batch
    min_supervised: int = 32   # samples with fewer supervised tokens are dropped (DFlash: 2 x block size)
    seed: int = 0
    prefetch: int = 4
    read_threads: int = 4
    max_batches: int | None = None  # a rank's batches of an epoch at most (a held-out evaluation's share)

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.prefetch < 1 or self.read_threads < 1:
            raise UserError("--token-budget, --prefetch and --read-threads must be positive")


@dataclass(frozen=True, slots=True)
class Position:
    """Where a job stands: the epoch and how many of its batches all ranks together consumed."""

    epoch: int
    batch: int


@dataclass(frozen=True)
class SampleTable:
    """Per-sample arrays in ascending sample-id order."""

    sample_ids: np.ndarray  # int64
    lengths: np.ndarray     # int64
    supervised: np.ndarray  # int64
    buckets: np.ndarray     # int64

    @classmethod
    def sorted(cls, sample_ids, lengths, supervised, buckets) -> tuple[SampleTable, np.ndarray]:
        """The table in canonical order, and the permutation that sorted the inputs."""
        order = np.argsort(np.asarray(sample_ids), kind="stable")
        cols = (np.asarray(c)[order].astype(np.int64) for c in (sample_ids, lengths, supervised, buckets))
        return cls(*cols), order

    def digest(self) -> str:
        """A hash of the table's content: a resume checks that it plans over the same samples."""
        h = hashlib.sha256()
        for column in (self.sample_ids, self.lengths, self.supervised, self.buckets):
            h.update(np.ascontiguousarray(column, dtype=np.int64).tobytes())
        return h.hexdigest()[:32]

    def epoch(self, config: SourceConfig, epoch: int, rank: int, world: int, start: int = 0) -> list[np.ndarray]:
        """This rank's batches of `epoch` from global batch `start` on, as arrays of positions into the table."""
        return plan_epoch(self.lengths, self.supervised, self.buckets, seed=config.seed, epoch=epoch,
                          token_budget=config.token_budget, min_supervised=config.min_supervised,
                          rank=rank, world=world, start=start)


def plan_epoch(lengths: np.ndarray, supervised: np.ndarray, buckets: np.ndarray, *, seed: int, epoch: int,
               token_budget: int, min_supervised: int, rank: int = 0, world: int = 1,
               start: int = 0) -> list[np.ndarray]:
    """This rank's batches of one epoch from global batch `start` on, each an array of index rows.

    Deterministic in (seed, epoch); the global order is the same for any `world`. Every rank gets
    as many batches as the others (the remainder of the epoch after `start` is cut to a multiple of
    `world`), so DDP ranks never wait on one another at an epoch's end.
    """
    rng = np.random.default_rng([seed, epoch])
    keep = np.flatnonzero(supervised >= min_supervised)
    batches: list[np.ndarray] = []
    for bucket in np.unique(buckets[keep]):
        rows = keep[buckets[keep] == bucket]
        rows = rows[rng.permutation(len(rows))]
        cum = np.cumsum(lengths[rows])
        lo = 0
        while lo < len(rows):
            base = cum[lo - 1] if lo else 0
            hi = int(np.searchsorted(cum, base + token_budget, side="right"))
            hi = max(hi, lo + 1)  # a sample longer than the budget travels alone
            batches.append(rows[lo:hi])
            lo = hi
    order = rng.permutation(len(batches))[start:]
    usable = len(order) - len(order) % world
    return [batches[i] for i in order[:usable][rank::world]]


def position_after(epoch: int, start: int, local_index: int, world: int) -> Position:
    """The global position once every rank has consumed its `local_index`-th batch from `start`."""
    return Position(epoch, start + (local_index + 1) * world)


