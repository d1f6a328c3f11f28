"""Epoch plans shared by every source, so the trainer cannot tell them apart.

A source describes its samples as a `SampleTable` in canonical order (ascending sample id);
`plan_epoch` turns it into this rank's batches for an epoch. Planning is pure numpy, deterministic
in (seed, epoch), and depends on nothing but the table: a cache and a live target over the same
dataset plan identical batches. A position is two integers, (epoch, batches consumed), from which
the plan is recomputed on resume.
"""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.prefetch < 1 or self.read_threads < 1:
            raise UserError("--token-budget, --prefetch and --read-threads must be positive")


@dataclass(frozen=True, slots=True)
class Position:
    """Where a source stands: the epoch and how many of this rank's batches of it were consumed."""

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

    def epoch(self, config: SourceConfig, epoch: int, rank: int, world: int) -> list[np.ndarray]:
        """This rank's batches of `epoch`, as arrays of positions into the table."""
        return plan_epoch(self.lengths, self.supervised, self.buckets, seed=config.seed, epoch=epoch,
                          token_budget=config.token_budget, min_supervised=config.min_supervised,
                          rank=rank, world=world)


def plan_epoch(lengths: np.ndarray, supervised: np.ndarray, buckets: np.ndarray, *, seed: int, epoch: int,
               token_budget: int, min_supervised: int, rank: int = 0, world: int = 1) -> list[np.ndarray]:
    """This rank's batches of one epoch, each an array of index rows. Deterministic in (seed, epoch)."""
    rng = np.random.default_rng([seed, epoch])
    keep = np.flatnonzero(supervised >= min_supervised)
    batches: list[np.ndarray] = []
    for bucket in np.unique(buckets[keep]):
        rows = keep[buckets[keep] == bucket]
        rows = rows[rng.permutation(len(rows))]
        cum = np.cumsum(lengths[rows])
        start = 0
        while start < len(rows):
            base = cum[start - 1] if start else 0
            stop = int(np.searchsorted(cum, base + token_budget, side="right"))
            stop = max(stop, start + 1)  # a sample longer than the budget travels alone
            batches.append(rows[start:stop])
            start = stop
    order = rng.permutation(len(batches))
    usable = len(batches) - len(batches) % world
    return [batches[i] for i in order[:usable]][rank::world]


