"""Anchor sampling and block construction for DFlash (block-diffusion) drafter training.

Every anchor is a token of a packed batch at document-local position ``p``. The drafter is shown a
block of ``B`` tokens ``[input_ids[p], mask, ..., mask]`` at positions ``p .. p + B - 1`` and slot
``k`` (1 <= k < B) is trained to predict ``input_ids[p + k]`` (same-position labels). Slot 0 is the
given anchor token and carries no loss.

Candidate anchors, per document of length ``L``:

* ``loss_mask[p]`` and ``loss_mask[p + 1]`` are both set,
* ``p + B <= L`` (the whole block lies inside the document, so it never crosses a boundary),
* the document has at least ``2 * B`` supervised tokens (otherwise it gets no anchors).

Up to ``num_anchors`` candidates are drawn per document uniformly without replacement (one
``torch.randperm`` over all candidates of the batch as random keys; the first ``num_anchors`` of
each document in key order are kept); with ``max_anchors``, a uniform random subset of that size
is kept when there are more (one more ``randperm``, drawn only then). The kept anchors are
returned sorted by flat token index, i.e. by (document, position), so the blocks of one document
are contiguous in query order: `dflash_cache.train.masks.document_masks` attends document by document on that
promise (and checks it). Random numbers are drawn on the generator's device and moved to the
batch's device, so a CPU generator gives identical anchors on CPU and CUDA.

When the batch carries its host layout (the sources attach one), all of this runs on the host and
only the finished blocks are copied to the device, asynchronously: the step never waits for the
GPU to report how many candidates there are.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from dflash_cache.data.formats import IGNORE_INDEX
from dflash_cache.store.batch import PackedBatch, positions_from_cu_seqlens

DEFAULT_NUM_ANCHORS = 512

_DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """Decay of the per-slot loss weight: 7 for B=16, 5 for B=10, 4 for B=8, else B * 7 / 16."""
    return _DEFAULT_GAMMA.get(int(block_size), block_size * 7.0 / 16.0)


@dataclass
class Blocks:
    token_index: torch.Tensor   # int64 [A], flat index into the packed batch of each anchor token
    doc: torch.Tensor           # int64 [A], document of each anchor
    anchor_pos: torch.Tensor    # int64 [A], document-local position of each anchor
    input_ids: torch.Tensor     # int64 [A, B]: anchor token, then mask_token_id x (B - 1)
    position_ids: torch.Tensor  # int64 [A, B]: anchor_pos + 0..B-1 (document-local, for RoPE)
    labels: torch.Tensor        # int64 [A, B]: labels[a, k] = batch.input_ids[token_index[a] + k]; slot 0 = -100
    weights: torch.Tensor       # float32 [A, B]: loss_mask[p + k] * exp(-(k - 1) / gamma); slot 0 = 0
    block_size: int
    # Sum of anchor_pos: the context keys a block's queries attend, summed over blocks (FLOP
    # accounting); counted when sampling on the host, None when sampled on the device (a sync).
    prefix_keys: int | None = None
    # Anchors the documents offered (up to num_anchors each) before `max_anchors` kept a subset: how
    # much the memory cap takes from what --num-anchors asks for.
    offered: int | None = None

    # Blocks appended by `padded_to` (the last ones): they see only themselves and weigh 0 in the loss.
    padding: int = 0

    @property
    def num_anchors(self) -> int:
        """Blocks, the padding included: what the drafter runs on."""
        return int(self.token_index.shape[0])

    @property
    def real_anchors(self) -> int:
        """Blocks of sampled anchors (the padding left out): what the model learns from."""
        return self.num_anchors - self.padding

    def padded_to(self, anchors: int, *, pad_document: int, mask_token_id: int) -> Blocks:
        """These blocks and `anchors - A` more that attend to nothing but themselves: document
        `pad_document` (no context row's but padding's), anchor position 0 (nothing before it),
        token 0 (an empty key range in `dflash_cache.train.masks`), mask tokens as inputs, label -100
        and weight 0. A static shape's step pads its anchors so (`dflash_cache.train.static_shapes`)."""
        extra = anchors - self.num_anchors
        if extra < 0:
            raise ValueError(f"cannot pad {self.num_anchors} blocks to {anchors}")
        if extra == 0:
            return self
        B, device = self.block_size, self.token_index.device

        def more(x: torch.Tensor, value: float | int, rows: tuple[int, ...] = ()) -> torch.Tensor:
            return torch.cat((x, torch.full((extra, *rows), value, dtype=x.dtype, device=device)))

        offs = torch.arange(B, device=device, dtype=self.position_ids.dtype)
        position_ids = torch.cat((self.position_ids, offs[None].expand(extra, B)))
        return Blocks(token_index=more(self.token_index, 0), doc=more(self.doc, pad_document),
                      anchor_pos=more(self.anchor_pos, 0), input_ids=more(self.input_ids, mask_token_id, (B,)),
                      position_ids=position_ids, labels=more(self.labels, IGNORE_INDEX, (B,)),
                      weights=more(self.weights, 0.0, (B,)), block_size=B, prefix_keys=self.prefix_keys,
                      offered=self.offered, padding=self.padding + extra)

    def to(self, device: torch.device) -> Blocks:
        """Host blocks copied to `device` from pinned memory without blocking the host (a no-op when
        `device` is the CPU or the blocks are already on an accelerator)."""
        if device.type == "cpu" or self.token_index.device.type != "cpu":
            return self
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.pin_memory().to(device, non_blocking=True)
        return Blocks(**moved)


def anchors_at_most(lengths: np.ndarray, supervised: np.ndarray, *, block_size: int, num_anchors: int) -> np.ndarray:
    """Per sample, the most anchors `sample_anchors` can draw from it, knowing only its length and
    supervised tokens (an index's columns): a candidate and the token after it are supervised, so a
    run of s supervised tokens holds at most s - 1, and the block must fit, at most L - B + 1; none
    below 2B supervised tokens. (An answer that ends its document offers s - B + 1.)"""
    lengths, supervised = np.asarray(lengths, dtype=np.int64), np.asarray(supervised, dtype=np.int64)
    most = np.minimum(supervised - 1, lengths - block_size + 1).clip(min=0)
    return np.where(supervised >= 2 * block_size, np.minimum(most, num_anchors), 0)


def sample_anchors(batch: PackedBatch, *, block_size: int, num_anchors: int = DEFAULT_NUM_ANCHORS,
                   mask_token_id: int, generator: torch.Generator, gamma: float | None = None,
                   max_anchors: int | None = None) -> Blocks:
    """Sample up to ``num_anchors`` anchors per document and build their blocks (see module doc)."""
    B = int(block_size)
    if B < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    if num_anchors < 0:
        raise ValueError(f"num_anchors must be >= 0, got {num_anchors}")
    if gamma is None:
        gamma = default_gamma(B)
    h = batch.host
    if h is not None:
        cu = h.cu_seqlens.to(torch.int64)
        tensors = (h.input_ids, h.loss_mask, positions_from_cu_seqlens(cu, int(h.input_ids.shape[0])), cu)
    else:
        tensors = (batch.input_ids, batch.loss_mask, batch.position_ids, batch.cu_seqlens)
    blocks = _sample(*tensors, B=B, num_anchors=num_anchors, mask_token_id=mask_token_id, generator=generator,
                     gamma=gamma, max_anchors=max_anchors)
    return blocks.to(batch.input_ids.device)


def _sample(ids: torch.Tensor, loss_mask: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
            *, B: int, num_anchors: int, mask_token_id: int, generator: torch.Generator, gamma: float,
            max_anchors: int | None) -> Blocks:
    """sample_anchors on the tensors' own device."""
    device = ids.device
    T = int(ids.shape[0])
    n_docs = int(cu_seqlens.shape[0]) - 1
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lm = loss_mask.to(device=device, dtype=torch.bool)
    pos = position_ids.to(device=device, dtype=torch.int64)
    doc_len = cu[1:] - cu[:-1]
    doc = torch.repeat_interleave(torch.arange(n_docs, device=device), doc_len, output_size=T)

    n_sup = torch.zeros(n_docs, dtype=torch.int64, device=device).index_add_(0, doc, lm.long())
    lm_next = torch.cat([lm[1:], lm.new_zeros(1)]) if T > 0 else lm
    # p + B <= L implies p + 1 < L, so lm_next never reads across a document boundary here.
    cand = lm & lm_next & (pos + B <= doc_len[doc]) & (n_sup[doc] >= 2 * B)
    cand_idx = torch.nonzero(cand, as_tuple=False).flatten()                       # [C], ascending
    C = int(cand_idx.shape[0])

    # Uniform sampling without replacement per document: random distinct keys, then stable sort
    # by key and stable sort by doc; the first num_anchors of each document's run are kept.
    keys = torch.randperm(C, generator=generator, device=generator.device).to(device)
    by_key = torch.argsort(keys, stable=True)
    cand_doc = doc[cand_idx][by_key]
    by_doc = torch.argsort(cand_doc, stable=True)
    order = by_key[by_doc]                                                         # cand ranks, doc-major
    doc_sorted = cand_doc[by_doc]
    counts = torch.bincount(doc_sorted, minlength=n_docs)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(C, device=device) - starts[doc_sorted]
    kept = order[rank < num_anchors]
    offered = int(kept.shape[0])
    if max_anchors is not None and offered > max_anchors:
        pick = torch.randperm(offered, generator=generator, device=generator.device)[:max_anchors]
        kept = kept[pick.to(device)]
    token_index = cand_idx[torch.sort(kept).values]                                # sorted by (doc, pos)

    A = int(token_index.shape[0])
    offs = torch.arange(B, device=device)
    idx = token_index[:, None] + offs[None, :]                                     # [A, B], inside the doc
    anchor_pos = pos[token_index]
    anchor_doc = doc[token_index]

    input_ids = torch.full((A, B), int(mask_token_id), dtype=torch.int64, device=device)
    input_ids[:, 0] = ids[token_index].to(torch.int64)
    position_ids = anchor_pos[:, None] + offs[None, :]
    labels = ids[idx].to(torch.int64)
    labels[:, 0] = IGNORE_INDEX
    decay = torch.exp(-(offs.to(torch.float32) - 1.0) / float(gamma))
    decay[0] = 0.0
    weights = lm[idx].to(torch.float32) * decay[None, :]

    return Blocks(token_index=token_index, doc=anchor_doc, anchor_pos=anchor_pos, input_ids=input_ids,
                  position_ids=position_ids, labels=labels, weights=weights, block_size=B,
                  prefix_keys=int(anchor_pos.sum()) if device.type == "cpu" else None, offered=offered)


__all__ = ["DEFAULT_NUM_ANCHORS", "Blocks", "anchors_at_most", "default_gamma", "sample_anchors"]
