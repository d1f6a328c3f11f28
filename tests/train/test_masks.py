"""Attention masks for drafter training (dflash_cache.train.masks): hand-built rules, dense vs flex agreement."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_mask

from dflash_cache.store.batch import PackedBatch, positions_from_cu_seqlens
from dflash_cache.train.anchors import Blocks, sample_anchors
from dflash_cache.train.masks import (
    DocumentMasks,
    build_masks,
    context_doc_pos,
    dense_mask,
    document_masks,
    flex_block_mask,
)

MASK = 7777


def make_batch(lengths: list[int], *, seed: int = 0, p_sup: float = 0.8) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return PackedBatch(input_ids=torch.randint(0, 500, (T,), generator=g),
                       loss_mask=torch.rand(T, generator=g) < p_sup,
                       position_ids=positions_from_cu_seqlens(cu, T), cu_seqlens=cu,
                       sample_ids=torch.arange(len(lengths)), features=torch.zeros(T, 2, dtype=torch.bfloat16))


def hand_blocks(batch: PackedBatch, anchors: list[tuple[int, int]], B: int) -> Blocks:
    """Blocks for explicit (doc, document-local position) anchors."""
    doc = torch.tensor([d for d, _ in anchors], dtype=torch.int64)
    pos = torch.tensor([p for _, p in anchors], dtype=torch.int64)
    ti = batch.cu_seqlens[doc] + pos
    offs = torch.arange(B)
    ids = torch.full((len(anchors), B), MASK)
    ids[:, 0] = batch.input_ids[ti]
    labels = batch.input_ids[ti[:, None] + offs]
    labels[:, 0] = -100
    return Blocks(token_index=ti, doc=doc, anchor_pos=pos, input_ids=ids, position_ids=pos[:, None] + offs,
                  labels=labels, weights=torch.ones(len(anchors), B), block_size=B)


@pytest.fixture
def two_docs():
    batch = make_batch([7, 9])
    B = 3
    # block 0: doc 0 @ 4; block 1: doc 1 @ 2; block 2: doc 1 @ 6
    blocks = hand_blocks(batch, [(0, 4), (1, 2), (1, 6)], B)
    return batch, blocks


def test_context_doc_pos(two_docs):
    batch, _ = two_docs
    doc, pos = context_doc_pos(batch)
    assert doc.tolist() == [0] * 7 + [1] * 9
    assert pos.tolist() == list(range(7)) + list(range(9))


def test_full_attention_hand_built(two_docs):
    batch, blocks = two_docs
    T, B, A = 16, 3, 3
    doc, pos = context_doc_pos(batch)
    m = dense_mask(doc, pos, blocks, sliding_window=None)
    assert m.shape == (A * B, T + A * B) and m.dtype == torch.bool
    ctx, blk = m[:, :T], m[:, T:]
    # expected context: block 0 -> doc 0 tokens 0..3; block 1 -> doc 1 tokens 0..1 (flat 7, 8);
    # block 2 -> doc 1 tokens 0..5 (flat 7..12)
    expect_ctx = torch.zeros(A, T, dtype=torch.bool)
    expect_ctx[0, 0:4] = True
    expect_ctx[1, 7:9] = True
    expect_ctx[2, 7:13] = True
    assert torch.equal(ctx, expect_ctx.repeat_interleave(B, dim=0))
    # the anchor token itself (context index) is never visible
    assert not ctx[0:3, 4].any() and not ctx[3:6, 9].any() and not ctx[6:9, 13].any()
    # other document's context never visible
    assert not ctx[0:3, 7:].any() and not ctx[3:9, :7].any()
    # own block fully visible (bidirectional), other blocks never
    assert torch.equal(blk, torch.block_diag(*[torch.ones(B, B, dtype=torch.bool)] * A))


def visible_columns(m: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row).flatten().tolist() for row in m]


def test_sliding_window_counts_back_from_each_query(two_docs):
    """As SGLang / vLLM / z-lab serve sliding layers: slot k (position anchor+k) sees the keys at
    positions anchor+k-W+1 .. anchor+k: context before the anchor, and its block causally."""
    batch, blocks = two_docs
    T, W = 16, 3
    doc, pos = context_doc_pos(batch)
    m = dense_mask(doc, pos, blocks, sliding_window=W)
    blk0, blk1, blk2 = T, T + 3, T + 6  # first key column of each block
    assert visible_columns(m) == [
        [2, 3, blk0],                       # doc 0 @ 4, slot 0 (pos 4): context pos 2, 3
        [3, blk0, blk0 + 1],                # slot 1 (pos 5): context pos 3, slots 0-1
        [blk0, blk0 + 1, blk0 + 2],         # slot 2 (pos 6): slots 0-2 only
        [7, 8, blk1],                       # doc 1 @ 2, slot 0: context pos 0, 1 (flat 7, 8)
        [8, blk1, blk1 + 1],
        [blk1, blk1 + 1, blk1 + 2],
        [11, 12, blk2],                     # doc 1 @ 6, slot 0: context pos 4, 5 (flat 11, 12)
        [12, blk2, blk2 + 1],
        [blk2, blk2 + 1, blk2 + 2],
    ]
    # every query sees exactly W keys here, itself included; W = 1 leaves only itself
    assert m.sum(1).tolist() == [W] * 9
    assert torch.equal(dense_mask(doc, pos, blocks, sliding_window=1), torch.cat(
        [torch.zeros(9, T, dtype=torch.bool), torch.eye(9, dtype=torch.bool)], dim=1))


def test_sliding_window_beyond_every_document_is_full_context_and_causal_block(two_docs):
    batch, blocks = two_docs
    T, B, A = 16, 3, 3
    doc, pos = context_doc_pos(batch)
    full = dense_mask(doc, pos, blocks, sliding_window=None)
    wide = dense_mask(doc, pos, blocks, sliding_window=100)
    assert torch.equal(wide[:, :T], full[:, :T])
    causal = torch.tril(torch.ones(B, B, dtype=torch.bool))
    assert torch.equal(wide[:, T:], torch.block_diag(*[causal] * A))


def test_window_must_be_positive(two_docs):
    batch, blocks = two_docs
    doc, pos = context_doc_pos(batch)
    for build in (dense_mask, document_masks, flex_block_mask):
        with pytest.raises(ValueError, match="sliding_window must be >= 1"):
            build(doc, pos, blocks, sliding_window=0)


def assemble(per_doc: DocumentMasks) -> torch.Tensor:
    """The [Q, T + Q] matrix that per-document masks stand for (everything outside them is False)."""
    T, Q = per_doc.num_context, per_doc.num_queries
    full = torch.zeros(Q, T + Q, dtype=torch.bool)
    for ctx, rows, m in zip(per_doc.context, per_doc.queries, per_doc.masks, strict=True):
        n_ctx = ctx.stop - ctx.start
        full[rows, ctx] = m[0, 0, :, :n_ctx]
        full[rows, T + rows.start:T + rows.stop] = m[0, 0, :, n_ctx:]
    return full


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_document_masks_match_dense(seed):
    g = torch.Generator().manual_seed(200 + seed)
    lengths = torch.randint(3, 70, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist()
    batch = make_batch(lengths, seed=seed)
    blocks = sample_anchors(batch, block_size=4, num_anchors=5, mask_token_id=MASK,
                            generator=torch.Generator().manual_seed(seed))
    assert blocks.num_anchors > 0
    doc, pos = context_doc_pos(batch)
    for window in (None, 1, 3, 9, 1000):
        per_doc = document_masks(doc, pos, blocks, sliding_window=window)
        assert len(per_doc.masks) == len(set(blocks.doc.tolist()))  # short documents: one span each
        assert torch.equal(assemble(per_doc), dense_mask(doc, pos, blocks, sliding_window=window))


def test_a_document_with_many_anchors_is_cut_into_spans_of_whole_blocks():
    """Queries see no other block, so a document's blocks attend in spans of about its length: the
    masks grow with anchors x document length, not with the square of its anchors."""
    batch = make_batch([40, 300], seed=5, p_sup=1.0)
    blocks = sample_anchors(batch, block_size=4, num_anchors=290, mask_token_id=MASK,
                            generator=torch.Generator().manual_seed(0))
    doc, pos = context_doc_pos(batch)
    per_doc = document_masks(doc, pos, blocks, sliding_window=None)
    q_long = 4 * int((blocks.doc == 1).sum())
    assert q_long > 3 * 300  # doc 1: 1,160 queries over 300 context tokens
    spans = [(c.stop - c.start, r.stop - r.start) for c, r in zip(per_doc.context, per_doc.queries, strict=True)]
    assert spans[0] == (40, 4 * int((blocks.doc == 0).sum()))  # doc 0: one span, fewer than 256 queries
    assert [t for t, _ in spans[1:]] == [300] * 4 and [q for _, q in spans[1:]] == [300, 300, 300, q_long - 900]
    assert all(r.start % 4 == 0 for r in per_doc.queries)  # whole blocks
    assert torch.equal(assemble(per_doc), dense_mask(doc, pos, blocks, sliding_window=None))
    assert torch.equal(assemble(document_masks(doc, pos, blocks, sliding_window=7)),
                       dense_mask(doc, pos, blocks, sliding_window=7))


def test_document_masks_need_blocks_grouped_by_document(two_docs):
    batch, blocks = two_docs
    doc, pos = context_doc_pos(batch)
    order = torch.tensor([1, 0, 2])  # doc 1, doc 0, doc 1: doc 1's blocks are not contiguous
    shuffled = Blocks(**{f: (v[order] if isinstance(v := getattr(blocks, f), torch.Tensor) else v)
                         for f in blocks.__dataclass_fields__})
    with pytest.raises(ValueError, match="sorted by document"):
        document_masks(doc, pos, shuffled, sliding_window=None)
    with pytest.raises(ValueError, match="grouped by document"):
        document_masks(doc.flip(0), pos, blocks, sliding_window=None)


def flex_to_dense(bm: BlockMask, q_len: int, kv_len: int) -> torch.Tensor:
    dense = create_mask(bm.mask_mod, None, None, q_len, kv_len, device="cpu")
    return dense[0, 0]


def check_flex_agrees(doc, pos, blocks, window):
    q_len = blocks.num_anchors * blocks.block_size
    kv_len = doc.shape[0] + q_len
    ref = dense_mask(doc, pos, blocks, sliding_window=window)
    bm = flex_block_mask(doc, pos, blocks, sliding_window=window)
    assert isinstance(bm, BlockMask)
    assert tuple(bm.shape) == (1, 1, q_len, kv_len)
    assert torch.equal(flex_to_dense(bm, q_len, kv_len), ref)
    # the block-sparsity structure covers every allowed entry
    bq, bk = bm.BLOCK_SIZE
    blocks_dense = bm.to_dense()[0, 0].bool()
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    padded = torch.zeros(nq * bq, nk * bk, dtype=torch.bool)
    padded[:q_len, :kv_len] = ref
    needed = padded.view(nq, bq, nk, bk).any(3).any(1)
    assert not (needed & ~blocks_dense[:nq, :nk]).any()


def test_flex_matches_dense_hand_built(two_docs):
    batch, blocks = two_docs
    doc, pos = context_doc_pos(batch)
    for window in (None, 1, 2, 3, 50):
        check_flex_agrees(doc, pos, blocks, window)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("window", [None, 1, 5])
def test_flex_matches_dense_random(seed, window):
    g = torch.Generator().manual_seed(100 + seed)
    n_docs = int(torch.randint(2, 6, (1,), generator=g))
    lengths = torch.randint(3, 60, (n_docs,), generator=g).tolist()
    batch = make_batch(lengths, seed=seed)
    B = [3, 4, 5][seed]
    blocks = sample_anchors(batch, block_size=B, num_anchors=6, mask_token_id=MASK,
                            generator=torch.Generator().manual_seed(seed))
    assert blocks.num_anchors > 0
    doc, pos = context_doc_pos(batch)
    check_flex_agrees(doc, pos, blocks, window)


def test_flex_spans_multiple_kernel_blocks():
    # Q and KV longer than one 128 block so the BlockMask has several rows / columns.
    batch = make_batch([150, 90, 120], seed=4, p_sup=0.9)
    blocks = sample_anchors(batch, block_size=4, num_anchors=20, mask_token_id=MASK,
                            generator=torch.Generator().manual_seed(0))
    assert blocks.num_anchors * 4 > 128
    doc, pos = context_doc_pos(batch)
    for window in (None, 16):
        check_flex_agrees(doc, pos, blocks, window)


BLOCK_MASK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize(("lengths", "B", "pad", "pad_blocks"), [([700, 300, 1000], 16, 0, 0),
                                                                 ([150, 90, 620], 12, 77, 9),
                                                                 ([2000], 8, 128, 16), ([64] * 6, 5, 0, 3)])
def test_full_attention_layout_is_create_block_mask_s(lengths, B, pad, pad_blocks):
    """The full-attention BlockMask laid out from each query's key ranges has exactly the partial and
    full blocks (and their order) that evaluating the rule on every pair gives: several documents,
    blocks that straddle 128-row tiles, a context padded with rows no query sees and padded blocks
    (static shapes)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash_cache.train.masks import _mask_mod
    from dflash_cache.train.static_shapes import PAD_DOCUMENT, Context

    batch = make_batch(lengths, seed=B, p_sup=0.95)
    blocks = sample_anchors(batch, block_size=B, num_anchors=40, mask_token_id=MASK,
                            generator=torch.Generator().manual_seed(B))
    blocks = blocks.padded_to(blocks.num_anchors + pad_blocks, pad_document=PAD_DOCUMENT, mask_token_id=MASK)
    doc, pos = context_doc_pos(batch)
    ctx = Context(features=batch.features, positions=pos, docs=doc).padded_to(batch.num_tokens + pad)
    q_len, kv_len = blocks.num_anchors * B, ctx.rows + blocks.num_anchors * B
    laid_out = flex_block_mask(ctx.docs, ctx.positions, blocks, sliding_window=None)
    evaluated = create_block_mask(_mask_mod(ctx.docs, ctx.positions, blocks, None), None, None, q_len, kv_len,
                                  device="cpu")
    assert int(laid_out.kv_num_blocks.sum()) > 0
    assert (int(laid_out.full_kv_num_blocks.sum()) > 0) == (max(lengths) > 256)  # documents of 2+ tiles have full ones
    for name in BLOCK_MASK_FIELDS:
        assert torch.equal(getattr(laid_out, name), getattr(evaluated, name)), name
    assert laid_out.seq_lengths == evaluated.seq_lengths


@pytest.mark.parametrize(("lengths", "B", "pad", "pad_blocks"), [([300, 41, 520, 97], 8, 0, 0),
                                                                 ([150, 90, 620], 12, 77, 5),
                                                                 ([64] * 6, 5, 128, 11)])
def test_key_range_mask_mod_is_the_full_attention_rule(lengths, B, pad, pad_blocks):
    """The key-range mask_mod admits exactly the pairs the full-attention rule admits, padded context
    rows (no document) and padded blocks included."""
    from dflash_cache.train.masks import key_range_mask_mod
    from dflash_cache.train.static_shapes import PAD_DOCUMENT, Context

    batch = make_batch(lengths, seed=B, p_sup=0.9)
    blocks = sample_anchors(batch, block_size=B, num_anchors=30, mask_token_id=MASK,
                            generator=torch.Generator().manual_seed(B))
    blocks = blocks.padded_to(blocks.num_anchors + pad_blocks, pad_document=PAD_DOCUMENT, mask_token_id=MASK)
    doc, pos = context_doc_pos(batch)
    ctx = Context(features=batch.features, positions=pos, docs=doc).padded_to(batch.num_tokens + pad)
    q_len, kv_len = blocks.num_anchors * B, ctx.rows + blocks.num_anchors * B
    got = create_mask(key_range_mask_mod(blocks, ctx.rows), None, None, q_len, kv_len, device="cpu")[0, 0]
    assert torch.equal(got, dense_mask(ctx.docs, ctx.positions, blocks, sliding_window=None))


def test_empty_blocks():
    batch = make_batch([5, 6])
    blocks = sample_anchors(batch, block_size=4, num_anchors=8, mask_token_id=MASK,
                            generator=torch.Generator().manual_seed(0))
    assert blocks.num_anchors == 0
    doc, pos = context_doc_pos(batch)
    assert dense_mask(doc, pos, blocks, sliding_window=None).shape == (0, 11)
    assert dense_mask(doc, pos, blocks, sliding_window=3).shape == (0, 11)
    per_doc = document_masks(doc, pos, blocks, sliding_window=3)
    assert (per_doc.num_queries, per_doc.num_context, per_doc.masks) == (0, 11, ())


@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_build_masks_shared_per_layer_type(two_docs, backend):
    batch, blocks = two_docs
    doc, pos = context_doc_pos(batch)
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention", "full_attention"]
    masks = build_masks(doc, pos, blocks, layer_types=types, sliding_window=3, backend=backend)
    assert set(masks) == {"full_attention", "sliding_attention"}
    q_len, kv_len = 9, 16 + 9
    full = dense_mask(doc, pos, blocks, sliding_window=None)
    sliding = dense_mask(doc, pos, blocks, sliding_window=3)
    if backend == "dense":
        assert isinstance(masks["full_attention"], DocumentMasks)
        assert torch.equal(assemble(masks["full_attention"]), full)
        assert torch.equal(assemble(masks["sliding_attention"]), sliding)
    else:
        assert isinstance(masks["full_attention"], BlockMask)
        assert torch.equal(flex_to_dense(masks["full_attention"], q_len, kv_len), full)
        assert torch.equal(flex_to_dense(masks["sliding_attention"], q_len, kv_len), sliding)
    # only full layers -> only one mask, no window needed
    only_full = build_masks(doc, pos, blocks, layer_types=["full_attention"] * 4, sliding_window=None,
                            backend=backend)
    assert list(only_full) == ["full_attention"]


@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_build_masks_builds_each_type_once(two_docs, backend, monkeypatch):
    import dflash_cache.train.masks as masks_mod

    batch, blocks = two_docs
    doc, pos = context_doc_pos(batch)
    name = "document_masks" if backend == "dense" else "flex_block_mask"
    real = getattr(masks_mod, name)
    calls = []
    monkeypatch.setattr(masks_mod, name, lambda *a, **kw: calls.append(kw["sliding_window"]) or real(*a, **kw))
    types = ["sliding_attention", "full_attention"] * 6
    masks = build_masks(doc, pos, blocks, layer_types=types, sliding_window=4, backend=backend)
    assert sorted(calls, key=str) == [4, None]
    per_layer = [masks[t] for t in types]
    assert len({id(m) for m in per_layer}) == 2


def test_build_masks_errors(two_docs):
    batch, blocks = two_docs
    doc, pos = context_doc_pos(batch)
    with pytest.raises(ValueError):
        build_masks(doc, pos, blocks, layer_types=["sliding_attention"], sliding_window=None, backend="dense")
    with pytest.raises(ValueError):
        build_masks(doc, pos, blocks, layer_types=["full_attention"], sliding_window=None, backend="sdpa")
    with pytest.raises(ValueError):
        build_masks(doc, pos, blocks, layer_types=["linear_attention"], sliding_window=None, backend="dense")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_runs_with_mask(two_docs):
    """The BlockMask drives flex_attention (eager, CPU) to the same output as SDPA with the dense mask."""
    from torch.nn.attention.flex_attention import flex_attention

    batch, blocks = two_docs
    doc, pos = context_doc_pos(batch)
    q_len, kv_len = 9, 25
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, q_len, 8, generator=g)
    k = torch.randn(1, 2, kv_len, 8, generator=g)
    v = torch.randn(1, 2, kv_len, 8, generator=g)
    types = ["full_attention", "sliding_attention"]
    dense = {t: dense_mask(doc, pos, blocks, sliding_window=None if t == "full_attention" else 2) for t in types}
    flex = build_masks(doc, pos, blocks, layer_types=types, sliding_window=2, backend="flex")
    for t in types:
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense[t][None, None])
        out = flex_attention(q, k, v, block_mask=flex[t])
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
