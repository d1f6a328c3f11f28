"""Static shapes (dflash_cache.train.static_shapes): padding a batch's context and anchors to one of
the run's shapes hides the padding from every query and from the loss, so outputs and gradients are
the unpadded batch's; the shapes are chosen from the plan to pad as little as possible."""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest
import torch

from dflash_cache.target.tiny import tiny_config
from dflash_cache.train.anchors import anchors_at_most, sample_anchors
from dflash_cache.train.config import FULL_ATTENTION, DrafterConfig
from dflash_cache.train.drafter import init_drafter
from dflash_cache.train.masks import context_doc_pos, dense_mask, document_masks
from dflash_cache.train.static_shapes import (
    PAD_DOCUMENT,
    ROW_QUANTUM,
    Context,
    Shape,
    ShapeBuckets,
    ShapeRecord,
    anchor_quantum,
    choose_buckets,
    warm_up_batch,
)
from tests.train.test_masks import make_batch

B = 4
PAD = 37
MASK = 7777


def padded_pair(seed: int = 0):
    batch = make_batch([23, 9, 31], seed=seed, p_sup=0.9)
    blocks = sample_anchors(batch, block_size=B, num_anchors=5, mask_token_id=MASK,
                            generator=torch.Generator().manual_seed(seed))
    doc, pos = context_doc_pos(batch)
    context = Context(features=torch.randn(batch.num_tokens, 3 * 64, generator=torch.Generator().manual_seed(seed)),
                      positions=pos, docs=doc)
    return context, context.padded_to(context.rows + PAD), blocks


@pytest.mark.parametrize("window", [None, 3])
def test_padded_rows_are_hidden_from_every_query(window):
    context, padded, blocks = padded_pair()
    T = context.rows
    plain = dense_mask(context.docs, context.positions, blocks, sliding_window=window)
    wide = dense_mask(padded.docs, padded.positions, blocks, sliding_window=window)
    assert blocks.num_anchors > 0 and not wide[:, T:T + PAD].any()
    torch.testing.assert_close(torch.cat((wide[:, :T], wide[:, T + PAD:]), dim=1), plain)


@pytest.mark.parametrize("window", [None, 3])
def test_padded_blocks_see_only_themselves_and_nobody_sees_them(window):
    context, padded, blocks = padded_pair()
    more = blocks.padded_to(blocks.num_anchors + 3, pad_document=PAD_DOCUMENT, mask_token_id=MASK)
    plain = dense_mask(padded.docs, padded.positions, blocks, sliding_window=window)
    wide = dense_mask(padded.docs, padded.positions, more, sliding_window=window)
    q, T = blocks.num_anchors * B, padded.rows
    torch.testing.assert_close(torch.cat((wide[:q, :T + q], wide[:q, T + q + 3 * B:]), dim=1), plain)
    assert not wide[:q, T + q:].any()  # no real query sees a padded block
    own = wide[q:, T + q:].reshape(3, B, 3, B)
    assert not wide[q:, :T + q].any()  # a padded block sees no context and no real block
    assert all(own[a, :, b].any() == (a == b) for a in range(3) for b in range(3))
    assert more.real_anchors == blocks.num_anchors and more.padding == 3
    assert (more.weights[q // B:] == 0).all() and (more.labels[q // B:] == -100).all()
    assert (more.input_ids[q // B:] == MASK).all()


def test_document_masks_take_padded_batches():
    """The CPU's per-document masks accept padded context and blocks (PAD_DOCUMENT sorts last) and
    admit what the reference admits."""
    context, padded, blocks = padded_pair(seed=2)
    more = blocks.padded_to(blocks.num_anchors + 2, pad_document=PAD_DOCUMENT, mask_token_id=MASK)
    masks = document_masks(padded.docs, padded.positions, more, sliding_window=None)
    reference = dense_mask(padded.docs, padded.positions, more, sliding_window=None)
    T = padded.rows
    rebuilt = torch.zeros_like(reference)
    for ctx, rows, m in zip(masks.context, masks.queries, masks.masks, strict=True):
        keys = torch.cat((torch.arange(ctx.start, ctx.stop), T + torch.arange(rows.start, rows.stop)))
        rebuilt[rows.start:rows.stop][:, keys] = m[0, 0]
    assert torch.equal(rebuilt, reference)


def test_padding_changes_no_output_or_gradient():
    """Padded context rows and padded blocks: the real blocks' outputs and every gradient of a loss
    on them are the unpadded batch's."""
    cfg = DrafterConfig.from_target(tiny_config(), (1, 3, 5), block_size=B)
    context, _, blocks = padded_pair(seed=1)
    context.features = torch.randn(context.rows, 3 * cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    cases = [(context, blocks), (context.padded_to(context.rows + PAD),
                                 blocks.padded_to(blocks.num_anchors + 5, pad_document=PAD_DOCUMENT,
                                                  mask_token_id=MASK))]
    real = blocks.num_anchors * B
    embeds = torch.randn(real, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    outs, grads = [], []
    for ctx, blk in cases:
        drafter = init_drafter(cfg, seed=0)
        masks = {FULL_ATTENTION: dense_mask(ctx.docs, ctx.positions, blk, sliding_window=None)[None, None]}
        pad_embeds = torch.randn(blk.padding * B, cfg.hidden_size)
        out = drafter(ctx.features, ctx.positions, torch.cat((embeds, pad_embeds)), blk.position_ids.reshape(-1), masks)
        out[:real].square().mean().backward()
        outs.append(out[:real].detach())
        grads.append(torch.cat([p.grad.flatten() for p in drafter.parameters()]))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_padding_appends_rows_without_changing_the_real_ones():
    context, padded, blocks = padded_pair()
    assert padded.rows == context.rows + PAD
    assert torch.equal(padded.features[:context.rows], context.features)
    assert not padded.features[context.rows:].any() and (padded.docs[context.rows:] == PAD_DOCUMENT).all()
    assert context.padded_to(context.rows) is context
    assert blocks.padded_to(blocks.num_anchors, pad_document=PAD_DOCUMENT, mask_token_id=MASK) is blocks
    with pytest.raises(ValueError, match="cannot pad"):
        context.padded_to(context.rows - 1)
    with pytest.raises(ValueError, match="cannot pad"):
        blocks.padded_to(blocks.num_anchors - 1, pad_document=PAD_DOCUMENT, mask_token_id=MASK)


def _padding(bounds: list[int], values) -> int:
    return sum(bounds[np.searchsorted(bounds, v)] - v for v in values)


def test_bucket_choice_pads_least():
    """The dynamic program's bounds pad exactly as little as the best of every choice of bounds."""
    rng = np.random.default_rng(0)
    for _ in range(150):
        values = rng.integers(1, 40, size=int(rng.integers(1, 12)))
        k = int(rng.integers(1, 5))
        bounds = choose_buckets(values, k)
        distinct = np.unique(values)
        best = min(_padding(sorted([*c, int(distinct[-1])]), values)
                   for r in range(k) for c in itertools.combinations(distinct[:-1].tolist(), r))
        assert len(bounds) <= k and bounds[-1] == values.max() and set(bounds) <= set(values.tolist())
        assert _padding(bounds, values) == best, (values, k, bounds)
    assert choose_buckets(np.array([], dtype=np.int64), 3) == []


def test_buckets_from_the_plan():
    tokens = np.array([1000, 4000, 3900, 200])
    anchors = np.array([33, 100, 250, 0])
    buckets = ShapeBuckets.from_plan(batch_tokens=tokens, batch_anchors=anchors, largest_batch=4096, block_size=16,
                                     max_shapes=2)
    q = anchor_quantum(16)
    assert q == 8 and buckets.context_rows == 4096
    assert buckets.anchors == (104, 250)  # counts in whole tiles of queries, the largest as it is
    assert buckets.shape_for(3000, 1) == Shape(4096, 104) and buckets.shape_for(4096, 104) == Shape(4096, 104)
    assert buckets.shape_for(10, 105) == Shape(4096, 250) and buckets.shape_for(10, 0) == Shape(4096, 104)
    assert buckets.shape_for(10, 251) is None and buckets.shape_for(4097, 1) is None
    assert buckets.widened(251, 16).anchors == (104, 250, 256)
    overlong = ShapeBuckets.from_plan(batch_tokens=np.array([5000]), batch_anchors=np.array([9]),
                                      largest_batch=4096, block_size=8, max_shapes=3)
    assert overlong.context_rows == 5000 + ROW_QUANTUM - 5000 % ROW_QUANTUM and overlong.anchors == (9,)


def test_anchors_at_most_bounds_every_draw():
    """No draw of `sample_anchors` takes more anchors from a document than `anchors_at_most` says
    (an answer that ends its document offers supervised - B + 1 of them)."""
    g = torch.Generator().manual_seed(0)
    for seed in range(20):
        lengths = torch.randint(5, 120, (4,), generator=g).tolist()
        batch = make_batch(lengths, seed=seed, p_sup=float(torch.rand(1, generator=g)) * 0.5 + 0.5)
        sup = [int(batch.loss_mask[a:b].sum()) for a, b in itertools.pairwise(batch.cu_seqlens.tolist())]
        most = anchors_at_most(np.array(lengths), np.array(sup), block_size=B, num_anchors=1000)
        blocks = sample_anchors(batch, block_size=B, num_anchors=1000, mask_token_id=MASK, generator=g)
        drawn = torch.bincount(blocks.doc, minlength=len(lengths)).tolist()
        assert all(d <= m for d, m in zip(drawn, most, strict=True)), (drawn, most)
    lengths, sup = np.array([50, 10, 40]), np.array([30, 9, 7])
    assert anchors_at_most(lengths, sup, block_size=B, num_anchors=1000).tolist() == [29, 7, 0]
    assert anchors_at_most(lengths, sup, block_size=B, num_anchors=20).tolist() == [20, 7, 0]
    batch = make_batch([50], p_sup=1.0)
    batch.loss_mask[:20] = False  # a prompt of 20, then an answer of 30 to the end
    blocks = sample_anchors(batch, block_size=B, num_anchors=1000, mask_token_id=MASK, generator=g)
    assert blocks.num_anchors == 30 - B + 1


def test_warm_up_batches_fill_their_shape():
    for shape, b in [(Shape(1024, 40), 8), (Shape(4096, 512), 16), (Shape(256, 200), 16)]:
        batch = warm_up_batch(shape, block_size=b, width=24, device=torch.device("cpu"))
        blocks = sample_anchors(batch, block_size=b, num_anchors=shape.anchors, max_anchors=shape.anchors,
                                mask_token_id=0, generator=torch.Generator().manual_seed(0))
        assert batch.num_tokens <= shape.context_rows and blocks.num_anchors <= shape.anchors
        assert batch.features.shape == (batch.num_tokens, 24) and batch.features.dtype == torch.bfloat16
        assert blocks.num_anchors == min(shape.anchors, batch.num_tokens - (b - 1) * len(batch.sample_ids))


def test_a_failed_compiled_step_is_logged_once_and_undone(caplog):
    record, shape, undone = ShapeRecord(), Shape(256, 16), []

    def failing():
        raise RuntimeError("shape '[10161, 128]' is invalid for input of size 8193")

    with caplog.at_level(logging.WARNING):
        assert record.try_compiled(shape, lambda: 7, undo=lambda: undone.append(1)) == 7
        assert record.try_compiled(shape, failing, undo=lambda: undone.append(1)) is None
    assert undone == [1] and shape in record.failed and "is invalid" in record.failed[shape]
    warned = [m for m in caplog.messages if "16 anchors x 256 context rows" in m]
    assert len(warned) == 1 and torch.__version__ in warned[0] and "eagerly" in warned[0]
    with pytest.raises(torch.OutOfMemoryError):
        record.try_compiled(shape, lambda: (_ for _ in ()).throw(torch.OutOfMemoryError("x")), undo=lambda: None)


def test_window_fields_report_padding_and_restart():
    record = ShapeRecord()
    assert record.window_fields() == {}
    record.count(eager=False, anchors=90, anchor_padding=10, rows=900, row_padding=124)
    record.count(eager=True, anchors=100, anchor_padding=0, rows=1000, row_padding=24)
    assert record.window_fields() == {"anchor_padding": 0.05, "context_padding": round(148 / 2048, 4),
                                      "eager_steps": 1}
    assert record.compiled_steps == 1 and record.eager_steps == 1 and record.window_fields() == {}
