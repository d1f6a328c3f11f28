"""Anchor sampling and block construction (dflash_cache.train.anchors)."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_cache.store.batch import HostLayout, PackedBatch, positions_from_cu_seqlens
from dflash_cache.train.anchors import Blocks, default_gamma, sample_anchors

MASK = 99_999


def make_batch(lengths: list[int], masks: list[list[int]] | None = None, *, seed: int = 0,
               vocab: int = 1000, ids: list[list[int]] | None = None) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    if ids is None:
        input_ids = torch.randint(0, vocab, (T,), generator=g)
    else:
        input_ids = torch.tensor([t for doc in ids for t in doc], dtype=torch.int64)
    if masks is None:
        loss_mask = torch.rand(T, generator=g) < 0.8
    else:
        loss_mask = torch.tensor([m for doc in masks for m in doc], dtype=torch.bool)
    return PackedBatch(input_ids=input_ids, loss_mask=loss_mask,
                       position_ids=positions_from_cu_seqlens(cu, T), cu_seqlens=cu,
                       sample_ids=torch.arange(len(lengths)), features=torch.zeros(T, 4, dtype=torch.bfloat16))


def sample(batch: PackedBatch, *, B: int = 4, n: int = 512, seed: int = 0, gamma: float | None = None) -> Blocks:
    return sample_anchors(batch, block_size=B, num_anchors=n, mask_token_id=MASK,
                          generator=torch.Generator().manual_seed(seed), gamma=gamma)


def valid_candidates(batch: PackedBatch, B: int) -> set[int]:
    """Brute-force candidate set (flat token indices)."""
    out = set()
    cu = batch.cu_seqlens.tolist()
    lm = batch.loss_mask.tolist()
    for d in range(len(cu) - 1):
        s, e = cu[d], cu[d + 1]
        if sum(lm[s:e]) < 2 * B:
            continue
        for p in range(e - s):
            if p + B <= e - s and lm[s + p] and lm[s + p + 1]:
                out.add(s + p)
    return out


def test_default_gamma():
    assert default_gamma(16) == 7.0
    assert default_gamma(10) == 5.0
    assert default_gamma(8) == 4.0
    assert default_gamma(4) == pytest.approx(4 * 7 / 16)
    assert default_gamma(32) == pytest.approx(14.0)


def test_anchors_are_valid_sorted_and_capped():
    batch = make_batch([40, 3, 25, 60, 9, 33], seed=1)
    B = 4
    cands = valid_candidates(batch, B)
    doc = batch.doc_ids()
    for n in (1, 3, 512):
        blk = sample(batch, B=B, n=n, seed=5)
        ti = blk.token_index.tolist()
        assert set(ti) <= cands
        assert ti == sorted(ti) and len(set(ti)) == len(ti)
        assert torch.equal(blk.doc, doc[blk.token_index])
        assert torch.equal(blk.anchor_pos, batch.position_ids[blk.token_index])
        # block fits inside its own document
        end = batch.cu_seqlens[blk.doc + 1]
        assert bool((blk.token_index + B <= end).all())
        assert bool((doc[blk.token_index + B - 1] == blk.doc).all())
        counts = torch.bincount(blk.doc, minlength=batch.num_docs)
        cand_counts = torch.bincount(doc[torch.tensor(sorted(cands))], minlength=batch.num_docs)
        assert torch.equal(counts, torch.minimum(cand_counts, torch.tensor(n)))
    # with a large cap every candidate is taken
    assert set(sample(batch, B=B, n=10_000).token_index.tolist()) == cands


def test_docs_with_few_supervised_tokens_get_no_anchors():
    B = 4
    # doc 0: 7 supervised tokens (< 2B = 8) -> none; doc 1: exactly 8 -> some; doc 2: none supervised
    masks = [[0] * 5 + [1] * 7, [0] * 4 + [1] * 8, [0] * 12]
    batch = make_batch([12, 12, 12], masks)
    blk = sample(batch, B=B)
    assert set(blk.doc.tolist()) == {1}
    # candidates in doc 1: p in 4..8 (p+1 supervised, p+B <= 12)
    assert blk.anchor_pos.tolist() == [4, 5, 6, 7, 8]


def test_no_candidates_gives_empty_blocks():
    B = 4
    batch = make_batch([5, 6], [[1] * 5, [1] * 6])
    blk = sample(batch, B=B)
    assert blk.num_anchors == 0
    assert blk.input_ids.shape == (0, B) and blk.labels.shape == (0, B)
    assert blk.weights.shape == (0, B) and blk.weights.dtype == torch.float32
    assert blk.position_ids.shape == (0, B)
    assert blk.token_index.dtype == torch.int64 and blk.token_index.shape == (0,)


def test_deterministic_per_seed():
    batch = make_batch([200, 150, 90], seed=3)
    a = sample(batch, n=10, seed=7)
    b = sample(batch, n=10, seed=7)
    c = sample(batch, n=10, seed=8)
    assert torch.equal(a.token_index, b.token_index)
    assert torch.equal(a.labels, b.labels) and torch.equal(a.weights, b.weights)
    assert not torch.equal(a.token_index, c.token_index)


def test_host_layout_gives_the_same_blocks():
    """Sampling from the host layout (what the sources attach, so the GPU step never syncs) draws the
    same anchors, labels and weights as sampling from the batch's own tensors, in the stored dtypes."""
    batch = make_batch([200, 150, 90, 40], seed=5)
    ref = sample(batch, n=12, seed=3)
    batch.host = HostLayout(input_ids=batch.input_ids.to(torch.int32), loss_mask=batch.loss_mask.to(torch.uint8),
                            cu_seqlens=batch.cu_seqlens.clone())
    batch.input_ids = torch.zeros_like(batch.input_ids)  # the host path must read nothing else
    got = sample(batch, n=12, seed=3)
    assert ref.num_anchors > 0
    for name in ("token_index", "doc", "anchor_pos", "input_ids", "position_ids", "labels", "weights"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name


def test_max_anchors_keeps_a_random_subset_of_the_per_document_draw():
    batch = make_batch([120, 90, 60, 200], seed=2)
    full = sample(batch, n=40, seed=1)
    capped = sample_anchors(batch, block_size=4, num_anchors=40, mask_token_id=MASK,
                            generator=torch.Generator().manual_seed(1), max_anchors=25)
    assert full.num_anchors > 25 and capped.num_anchors == 25
    assert capped.offered == full.offered == full.num_anchors, "what the documents offered, before the cap"
    assert set(capped.token_index.tolist()) <= set(full.token_index.tolist())
    assert torch.equal(capped.token_index, capped.token_index.sort().values)
    loose = sample_anchors(batch, block_size=4, num_anchors=40, mask_token_id=MASK,
                           generator=torch.Generator().manual_seed(1), max_anchors=10_000)
    assert torch.equal(loose.token_index, full.token_index)  # a cap that does not bind changes nothing


def test_sampling_covers_candidates_roughly_uniformly():
    batch = make_batch([30], [[1] * 30])
    B = 4
    hits = torch.zeros(30)
    for seed in range(400):
        blk = sample(batch, B=B, n=5, seed=seed)
        hits[blk.anchor_pos] += 1
    # candidates p = 0..26 (27 of them); each chosen with prob 5/27 -> ~74 of 400
    assert hits[27:].sum() == 0
    assert hits[:27].min() > 40 and hits[:27].max() < 115


def test_labels_are_same_position_hand_built():
    # doc 0 ids 10..19 all supervised, doc 1 ids 100..107 all supervised; B=3 -> 2B=6 supervised suffices.
    ids = [list(range(10, 20)), list(range(100, 108))]
    batch = make_batch([10, 8], [[1] * 10, [1] * 8], ids=ids)
    B = 3
    blk = sample(batch, B=B, n=512, gamma=2.0)
    # every candidate: doc 0 p=0..7, doc 1 p=0..5
    assert blk.token_index.tolist() == list(range(0, 8)) + list(range(10, 16))
    # anchor at doc 0 position 2 (token id 12): block [12, M, M], labels [-100, 13, 14]
    a = 2
    assert blk.input_ids[a].tolist() == [12, MASK, MASK]
    assert blk.labels[a].tolist() == [-100, 13, 14]
    assert blk.position_ids[a].tolist() == [2, 3, 4]
    # anchor at doc 1 position 5 (token id 105, last candidate): labels [-100, 106, 107]
    a = blk.num_anchors - 1
    assert blk.input_ids[a].tolist() == [105, MASK, MASK]
    assert blk.labels[a].tolist() == [-100, 106, 107]
    assert blk.position_ids[a].tolist() == [5, 6, 7]
    assert blk.doc[a].item() == 1 and blk.anchor_pos[a].item() == 5


def test_blocks_match_batch_and_weights():
    batch = make_batch([50, 70, 20], seed=11)
    B = 5
    gamma = 3.0
    blk = sample(batch, B=B, n=8, gamma=gamma, seed=2)
    assert blk.num_anchors > 0 and blk.block_size == B
    offs = torch.arange(B)
    idx = blk.token_index[:, None] + offs
    assert torch.equal(blk.labels[:, 1:], batch.input_ids[idx][:, 1:])
    assert bool((blk.labels[:, 0] == -100).all())
    assert torch.equal(blk.input_ids[:, 0], batch.input_ids[blk.token_index])
    assert bool((blk.input_ids[:, 1:] == MASK).all())
    assert torch.equal(blk.position_ids, blk.anchor_pos[:, None] + offs)
    expect = torch.zeros(blk.num_anchors, B)
    for a in range(blk.num_anchors):
        for k in range(1, B):
            expect[a, k] = float(batch.loss_mask[idx[a, k]]) * math.exp(-(k - 1) / gamma)
    assert blk.weights.dtype == torch.float32
    torch.testing.assert_close(blk.weights, expect)
    assert bool((blk.weights[:, 0] == 0).all())
    assert bool((blk.weights[:, 1] == 1).all())  # p+1 is always supervised


def test_default_gamma_is_used_for_weights():
    batch = make_batch([40], [[1] * 40])
    blk = sample(batch, B=8, n=2)
    k = torch.arange(1, 8, dtype=torch.float32)
    torch.testing.assert_close(blk.weights[:, 1:], torch.exp(-(k - 1) / 4.0).expand(2, 7))
