"""The drafter's dense (CPU) attention, document by document (dflash_cache.train.drafter.DFlashAttention with
dflash_cache.train.masks.DocumentMasks): same outputs and gradients as one mask over the packed batch, at a
memory that follows the documents."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import dflash_cache.train.masks as masks_mod
from dflash_cache.store.batch import PackedBatch
from dflash_cache.target.tiny import tiny_config
from dflash_cache.train.anchors import Blocks, sample_anchors
from dflash_cache.train.config import DrafterConfig
from dflash_cache.train.drafter import DFlashDrafter, init_drafter
from dflash_cache.train.masks import DocumentMasks, build_masks, context_doc_pos, dense_mask
from tests.train.test_masks import make_batch

B = 4
TYPES = ("sliding_attention", "full_attention", "sliding_attention")


def drafter_cfg(window: int) -> DrafterConfig:
    return dataclasses.replace(
        DrafterConfig.from_target(tiny_config(), (1, 3, 5), num_layers=len(TYPES), block_size=B, sliding_window=window),
        layer_types=TYPES)


def blocks_of(batch: PackedBatch, cfg: DrafterConfig) -> Blocks:
    return sample_anchors(batch, block_size=B, num_anchors=6, mask_token_id=cfg.mask_token_id,
                          generator=torch.Generator().manual_seed(0))


def run(cfg: DrafterConfig, batch: PackedBatch, blocks: Blocks, masks: dict
        ) -> tuple[torch.Tensor, torch.Tensor, DFlashDrafter]:
    """Forward and backward of a freshly initialised drafter: (output, features' gradient, drafter)."""
    g = torch.Generator().manual_seed(1)
    features = torch.randn(batch.num_tokens, 3 * cfg.hidden_size, generator=g).requires_grad_()
    embeds = torch.randn(blocks.num_anchors * B, cfg.hidden_size, generator=g)
    drafter = init_drafter(cfg, seed=0)
    out = drafter(features, batch.position_ids, embeds, blocks.position_ids.reshape(-1), masks)
    out.square().mean().backward()
    return out.detach(), features.grad, drafter


@pytest.mark.parametrize("lengths", [[30, 9, 57, 21], [64], [12] * 7 + [40]])
def test_per_document_attention_matches_one_dense_mask(lengths):
    """Outputs, input gradients and every parameter's gradient agree with the reference path (SDPA
    under one [Q, T+Q] mask) on packed batches of several documents, with sliding and full layers."""
    cfg = drafter_cfg(window=6)
    batch = make_batch(lengths, seed=len(lengths), p_sup=0.9)
    blocks = blocks_of(batch, cfg)
    assert len(set(blocks.doc.tolist())) >= min(len(lengths), 3)
    doc, pos = context_doc_pos(batch)
    per_doc = build_masks(doc, pos, blocks, layer_types=TYPES, sliding_window=6, backend="dense")
    assert all(isinstance(m, DocumentMasks) for m in per_doc.values())
    reference = {t: dense_mask(doc, pos, blocks, sliding_window=6 if t == "sliding_attention" else None)[None, None]
                 for t in set(TYPES)}
    out, feat_grad, drafter = run(cfg, batch, blocks, per_doc)
    ref_out, ref_feat_grad, ref_drafter = run(cfg, batch, blocks, reference)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(feat_grad, ref_feat_grad, rtol=1e-5, atol=1e-7)
    for (name, p), ref in zip(drafter.named_parameters(), ref_drafter.parameters(), strict=True):
        torch.testing.assert_close(p.grad, ref.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_many_documents_never_build_a_batch_sized_mask(monkeypatch):
    """60 documents: every mask and every attention score matrix is one document's, never [Q, T+Q]."""
    cfg = drafter_cfg(window=8)
    lengths = [30 + (i % 7) for i in range(60)]
    batch = make_batch(lengths, seed=3, p_sup=0.95)
    blocks = blocks_of(batch, cfg)
    Q, T = blocks.num_anchors * B, batch.num_tokens
    per_doc_bound = max(6 * B * (n + 6 * B) for n in lengths)
    assert Q * (T + Q) > 100 * per_doc_bound
    built, scores = [], []
    real_visible, real_sdpa = masks_mod._visible, F.scaled_dot_product_attention

    def visible(q, k, window):
        out = real_visible(q, k, window)
        built.append(out.numel())
        return out

    def sdpa(q, k, v, **kw):
        scores.append(q.shape[-2] * k.shape[-2])
        return real_sdpa(q, k, v, **kw)

    monkeypatch.setattr(masks_mod, "_visible", visible)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    doc, pos = context_doc_pos(batch)
    masks = build_masks(doc, pos, blocks, layer_types=TYPES, sliding_window=8, backend="dense")
    out, *_ = run(cfg, batch, blocks, masks)
    assert out.shape == (Q, cfg.hidden_size)
    assert len(built) == 2 * len(lengths)          # one mask per document and layer type
    assert len(scores) == len(TYPES) * len(lengths)  # one SDPA per document and layer (forward)
    assert max(built) <= per_doc_bound and max(scores) <= per_doc_bound


def test_batch_without_anchors_gives_an_empty_output():
    cfg = drafter_cfg(window=8)
    batch = make_batch([5, 6])  # too short for any block of 4
    blocks = blocks_of(batch, cfg)
    assert blocks.num_anchors == 0
    doc, pos = context_doc_pos(batch)
    masks = build_masks(doc, pos, blocks, layer_types=TYPES, sliding_window=8, backend="dense")
    out, *_ = run(cfg, batch, blocks, masks)
    assert out.shape == (0, cfg.hidden_size)


def test_document_masks_of_another_batch_are_refused():
    cfg = drafter_cfg(window=8)
    batch, other = make_batch([30, 20]), make_batch([30, 21])
    doc, pos = context_doc_pos(other)
    masks = build_masks(doc, pos, blocks_of(other, cfg), layer_types=TYPES, sliding_window=8, backend="dense")
    with pytest.raises(ValueError, match="document masks are for"):
        run(cfg, batch, blocks_of(batch, cfg), masks)
