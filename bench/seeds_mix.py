"""The seeds' length mix: token rows whose extraction plan has the seeds' share of batches per bucket.

The live pipeline this project grew out of trained on ~1.1M regenerated chat samples; its extraction
plan (buckets 0 / 770 / 1,216 / 1,728 / 2,432 / 3,296 / 8,193 tokens, the default `extract` plan)
put 3.8%, 7.4%, 10.5%, 15.0%, 16.6% and 46.6% of its batches in those buckets: half of the batches
hold rows of 3,296-8,192 tokens. `seeds_mix_lengths` draws row lengths uniformly inside each bucket,
as many per bucket as make the real planner (`dflash_cache.data.planning.make_plan`) reproduce
those shares, within about half a point; each row then has a prompt of 10-30% of its tokens.
Benchmarks measure speed on this mix, the data a user's run sees, rather than on equal lengths.
`python3 -m bench.seeds_mix` prints the plan's shares for 400 extraction batches of the mix.
"""

from __future__ import annotations

import argparse

import numpy as np
import pyarrow as pa

from dflash_cache.data.planning import make_plan
from dflash_cache.store.plan import DEFAULT_BUCKETS, PlanConfig

BUCKET_BOUNDS = (*DEFAULT_BUCKETS, 8193)
BATCH_SHARES = np.array([3.8, 7.4, 10.5, 15.0, 16.6, 46.6]) / 100
ROWS_PER_BATCH = np.array([64, 40, 28, 20, 15, 8])  # a first guess of the plan's rows per batch, per bucket


def _draw(rows_per_bucket: np.ndarray, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    parts = [rng.integers(max(lo, 64), hi, size=int(round(n)))
             for lo, hi, n in zip(BUCKET_BOUNDS[:-1], BUCKET_BOUNDS[1:], rows_per_bucket, strict=True)]
    lengths = np.concatenate(parts)
    return lengths[rng.permutation(len(lengths))]


def plan_shares(lengths: np.ndarray) -> np.ndarray:
    """The share of the default extraction plan's batches in each bucket."""
    plan = make_plan(lengths, np.ones(len(lengths), bool), PlanConfig())
    counts = np.bincount([b.bucket for b in plan.batches], minlength=len(BATCH_SHARES))
    return counts / counts.sum()


def seeds_mix_lengths(extract_batches: int, seed: int = 0) -> np.ndarray:
    """Row lengths whose default extraction plan has about `extract_batches` batches in the seeds' shares."""
    rows = BATCH_SHARES * extract_batches * ROWS_PER_BATCH
    for _ in range(3):  # the planner's rows per batch depend on the lengths drawn: refit twice
        shares = plan_shares(_draw(rows, seed))
        # a bucket drawn empty (a few batches: its rows round to none) has no share to refit by
        rows = rows * np.where(shares > 0, BATCH_SHARES / np.maximum(shares, 1e-9), 1.0)
    return _draw(rows, seed)


def prompt_lengths(lengths: np.ndarray, seed: int = 0) -> np.ndarray:
    """A prompt of 10-30% of each row (the rest is the supervised answer)."""
    rng = np.random.default_rng(seed + 1)
    return np.maximum(1, (lengths * rng.uniform(0.1, 0.3, size=len(lengths))).astype(np.int64))


def seeds_mix_rows(extract_batches: int, vocab: int, seed: int = 0) -> pa.Table:
    """A tokenized dataset (input_ids, loss_mask) of random tokens in the seeds' length mix."""
    lengths = seeds_mix_lengths(extract_batches, seed)
    prompts = prompt_lengths(lengths, seed)
    rng = np.random.default_rng(seed + 2)
    ids = [rng.integers(0, vocab - 1, size=n, dtype=np.int32) for n in lengths]
    masks = [np.r_[np.zeros(p, np.uint8), np.ones(n - p, np.uint8)] for n, p in zip(lengths, prompts, strict=True)]
    return pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32())),
                     "loss_mask": pa.array(masks, type=pa.list_(pa.uint8()))})


if __name__ == "__main__":
    argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    mix = seeds_mix_lengths(400)
    print(f"{len(mix)} rows, {mix.sum():,} tokens; plan shares "
          f"{' '.join(f'{100 * s:.1f}%' for s in plan_shares(mix))} (seeds: "
          f"{' '.join(f'{100 * s:.1f}%' for s in BATCH_SHARES)})")
