"""Static shapes (dflash_cache.train.static_shapes): padding a batch's context to the run's static
shape hides the padded rows from every query, so outputs and gradients are the unpadded batch's."""

from __future__ import annotations

import pytest
import torch

from dflash_cache.extract.tiny import tiny_config
from dflash_cache.train.anchors import sample_anchors
from dflash_cache.train.config import FULL_ATTENTION, DrafterConfig
from dflash_cache.train.drafter import init_drafter
from dflash_cache.train.masks import context_doc_pos, dense_mask
from dflash_cache.train.static_shapes import (
    MAX_STATIC_SHAPES,
    ROW_QUANTUM,
    WARM_UP_ANCHORS,
    Context,
    StaticShape,
    warm_up_batches,
)
from tests.train.test_masks import make_batch

B = 4
PAD = 37


def padded_pair(seed: int = 0):
    batch = make_batch([23, 9, 31], seed=seed, p_sup=0.9)
    blocks = sample_anchors(batch, block_size=B, num_anchors=5, mask_token_id=7777,
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


def test_padding_changes_no_output_or_gradient():
    cfg = DrafterConfig.from_target(tiny_config(), (1, 3, 5), block_size=B)
    context, padded, blocks = padded_pair(seed=1)
    context.features = torch.randn(context.rows, 3 * cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    padded = context.padded_to(context.rows + PAD)
    embeds = torch.randn(blocks.num_anchors * B, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    outs, grads = [], []
    for ctx in (context, padded):
        drafter = init_drafter(cfg, seed=0)
        masks = {FULL_ATTENTION: dense_mask(ctx.docs, ctx.positions, blocks, sliding_window=None)[None, None]}
        out = drafter(ctx.features, ctx.positions, embeds, blocks.position_ids.reshape(-1), masks)
        out.square().mean().backward()
        outs.append(out.detach())
        grads.append(torch.cat([p.grad.flatten() for p in drafter.parameters()]))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_padding_appends_rows_without_changing_the_real_ones():
    context, padded, _ = padded_pair()
    assert padded.rows == context.rows + PAD
    assert torch.equal(padded.features[:context.rows], context.features)
    assert not padded.features[context.rows:].any()
    assert context.padded_to(context.rows) is context
    with pytest.raises(ValueError, match="cannot pad"):
        context.padded_to(context.rows - 1)


def test_static_context_is_the_largest_batch_rounded_to_full_blocks():
    assert StaticShape.for_run(largest_batch=12_289).context_rows == 12_288 + ROW_QUANTUM
    assert StaticShape.for_run(largest_batch=4096).context_rows == 4096


def test_static_anchors_are_the_largest_count_seen_a_few_times_at_most():
    shape = StaticShape.for_run(largest_batch=1000)
    assert shape.admit(1000, 2048) and shape.admit(10, 2048)   # the first batch sets it
    assert not shape.admit(1025, 2048)                          # a context longer than the padding
    assert not shape.admit(1000, 2047) and not shape.admit(1000, 0)
    grown = [shape.admit(1000, a) for a in (3000, 4000, 5000, 6000)]
    assert grown == [True, True, False, False] and shape.anchors == 4000 and shape.shapes == MAX_STATIC_SHAPES
    assert shape.admit(1000, 4000) and not shape.admit(1000, 3000)


def test_warm_up_batches_have_odd_distinct_sizes_and_anchors():
    """The made-up batches make every size symbolic and tie none to another: token and anchor
    counts odd and unlike the other batch's, and within a batch no two sizes the compiled step
    sees (tokens, queries, keys, and their FlexAttention block counts) alike."""
    for b in (8, 16):
        sizes = []
        for batch in warm_up_batches(block_size=b, width=24, device=torch.device("cpu")):
            blocks = sample_anchors(batch, block_size=b, num_anchors=WARM_UP_ANCHORS, mask_token_id=0,
                                    generator=torch.Generator().manual_seed(0))
            t, a = batch.num_tokens, blocks.num_anchors
            assert batch.features.shape == (t, 24) and batch.features.dtype == torch.bfloat16
            queries, keys = a * b, t + a * b
            one = [t, a, queries, keys, -(-queries // ROW_QUANTUM), -(-keys // ROW_QUANTUM)]
            assert len(set(one)) == len(one) and t % 2 and a % 2, one
            sizes.append(one)
        assert all(x != y for x, y in zip(*sizes, strict=True)), sizes
