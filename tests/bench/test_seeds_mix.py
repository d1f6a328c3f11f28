"""The seeds' length mix: its plan's shares, and a size that follows the batches asked for."""

from __future__ import annotations

import numpy as np
import pytest

from bench.seeds_mix import BATCH_SHARES, plan_shares, seeds_mix_lengths


@pytest.mark.parametrize("batches", [1, 2, 3, 5])
def test_a_few_batches_make_a_few_batches_of_tokens(batches: int) -> None:
    """Asked for one or two extraction batches, the mix once came out as millions of rows (a bucket
    drawn empty counted as a share of zero, and its rows were multiplied by 1e9)."""
    lengths = seeds_mix_lengths(batches)
    assert 0 < lengths.sum() <= 4 * 43_500 * batches, (len(lengths), int(lengths.sum()))


def test_many_batches_hold_the_seeds_shares() -> None:
    shares = plan_shares(seeds_mix_lengths(200))
    np.testing.assert_allclose(shares, BATCH_SHARES, atol=0.02)
