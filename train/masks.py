"""Attention masks for DFlash drafter training on a packed batch, masked as the serving engines mask.

Queries are the ``A * B`` block tokens (block ``a`` occupies query rows ``a*B .. a*B + B - 1``);
block ``a`` has its anchor at document-local position ``p_a`` of document ``d_a`` and its slot ``s``
sits at position ``p_a + s``. Keys are ``[the T context tokens of the packed batch | the A*B block
tokens]``, ``K = T + A*B``; a block key carries its slot's position ``p_a + s``.

Full-attention layers (non-causal, as SGLang and vLLM run a DFlash drafter's full layers): a query
of block ``a`` may attend

* context key ``t`` iff ``doc[t] == d_a`` and ``pos[t] < p_a`` (same document, strictly before the
  anchor; the anchor token itself is slot 0 of the block),
* every key of its own block (bidirectional), and nothing else.

Sliding-window layers (window ``W >= 1``) add the engines' causal sliding window, counted back from
each query token (flash-attention window ``(W - 1, 0)``): the query at position ``p = p_a + s`` keeps
only the keys above whose position lies in ``p - W + 1 .. p``. Slot ``s`` therefore sees context
positions ``p_a + s - W + 1 .. p_a - 1`` and its own block's slots ``max(0, s - W + 1) .. s``
(causal inside the block): ``W`` keys in all once the document is long enough.

``dense_mask`` is the reference (one materialised [Q, K] bool matrix, for small tests);
``document_masks`` splits the same rule by document for SDPA on CPU: each span of a document's
blocks (about as many queries as the document has tokens) attends over that document's context
and its own blocks, so memory follows the sum over documents of about ``2 * q_d * t_d`` instead of
``Q * K``; ``flex_block_mask`` expresses the rule as a FlexAttention ``mask_mod`` (GPUs). All three
evaluate one function, ``_visible``, except the FlexAttention mask of full-attention layers: it
states the same rule as two key ranges per block (``key_range_mask_mod``, tested equal), cheaper for
the kernel to evaluate.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dflash_cache.store.batch import PackedBatch
from dflash_cache.train.anchors import Blocks
from dflash_cache.train.config import FULL_ATTENTION, LAYER_TYPES, SLIDING_ATTENTION

MIN_SPAN_QUERIES = 256  # a document's queries are attended in spans of about its length, never fewer than this


class _Rows(NamedTuple):
    """Per-row int64 attributes that the mask rule compares, for queries or for keys."""

    doc: torch.Tensor     # document id; -1 for block keys (they are matched by block instead)
    block: torch.Tensor   # block id; -1 for context keys
    pos: torch.Tensor     # document-local position (block tokens: anchor + slot)
    anchor: torch.Tensor  # queries: their block's anchor position; keys: unused (their position)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> _Rows:
        return _Rows(*(fn(x) for x in self))

    @staticmethod
    def cat(parts: Sequence[_Rows]) -> _Rows:
        return _Rows(*(torch.cat(cols) for cols in zip(*parts, strict=True)))


def _visible(q: _Rows, k: _Rows, window: int | None) -> torch.Tensor:
    """The mask rule of the module doc on broadcastable query / key rows: True = may attend."""
    ok = ((k.doc == q.doc) & (k.pos < q.anchor)) | (k.block == q.block)
    if window is not None:
        ok = ok & (k.pos <= q.pos) & (k.pos > q.pos - window)
    return ok


def _rows(ctx_doc: torch.Tensor, ctx_pos: torch.Tensor, blocks: Blocks) -> tuple[_Rows, _Rows]:
    """(query rows [Q], key rows [T + Q]) of a packed batch, on the context's device."""
    B, device, i64 = blocks.block_size, ctx_doc.device, torch.int64
    Q, T = blocks.num_anchors * B, int(ctx_doc.shape[0])
    q_idx = torch.arange(Q, device=device, dtype=i64)
    q_anchor = blocks.anchor_pos.to(device=device, dtype=i64).repeat_interleave(B)
    q = _Rows(doc=blocks.doc.to(device=device, dtype=i64).repeat_interleave(B), block=q_idx // B,
              pos=q_anchor + q_idx % B, anchor=q_anchor)
    ctx_pos = ctx_pos.to(i64)
    ctx = _Rows(doc=ctx_doc.to(i64), block=torch.full((T,), -1, device=device, dtype=i64), pos=ctx_pos,
                anchor=ctx_pos)
    blk = _Rows(doc=torch.full((Q,), -1, device=device, dtype=i64), block=q.block, pos=q.pos, anchor=q.pos)
    return q, _Rows.cat([ctx, blk])


def context_doc_pos(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(doc [T], pos [T]) of the context tokens: document ids from cu_seqlens, document-local positions."""
    return batch.doc_ids(), batch.position_ids.to(torch.int64)


def _check_window(sliding_window: int | None) -> None:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")


def dense_mask(ctx_doc: torch.Tensor, ctx_pos: torch.Tensor, blocks: Blocks, *,
               sliding_window: int | None) -> torch.Tensor:
    """bool [A*B, T + A*B], True = may attend (the reference: the whole batch at once, see module doc)."""
    _check_window(sliding_window)
    q, k = _rows(ctx_doc, ctx_pos, blocks)
    return _visible(q.map(lambda x: x[:, None]), k.map(lambda x: x[None, :]), sliding_window)


@dataclass(frozen=True)
class DocumentMasks:
    """Dense attention split by document, what `build_masks(backend="dense")` returns.

    Span ``i`` (whole blocks of one document) attends with the queries ``queries[i]`` (rows of
    [0, Q)) over the keys ``[its document's context rows context[i] | its block keys T + queries[i]]``
    under ``masks[i]`` (bool [1, 1, q_i, t_i + q_i]). A query sees no other block, so a document's
    blocks may be cut into several spans; the query slices tile [0, Q).
    """

    num_context: int
    num_queries: int
    context: tuple[slice, ...]
    queries: tuple[slice, ...]
    masks: tuple[torch.Tensor, ...]


def document_keys(x: torch.Tensor, context: slice, queries: slice, *, num_context: int, dim: int) -> torch.Tensor:
    """One document's keys out of all ``T + Q`` keys along ``dim``: its context rows, then its blocks."""
    return torch.cat((x.narrow(dim, context.start, context.stop - context.start),
                      x.narrow(dim, num_context + queries.start, queries.stop - queries.start)), dim=dim)


def _span_queries(context_len: int, block_size: int) -> int:
    """Queries per span of one document: about its context length (at least MIN_SPAN_QUERIES), in
    whole blocks. Its block keys then cost no more than its context keys, where one span per document
    would grow with the square of the document's anchors."""
    return -(-max(context_len, MIN_SPAN_QUERIES) // block_size) * block_size


def _document_spans(ctx_doc: torch.Tensor, blocks: Blocks) -> list[tuple[slice, slice]]:
    """(context rows, query rows) of each span: a run of whole blocks of one document, in query order.

    Needs both orders that the packed batch and `sample_anchors` guarantee: context tokens grouped
    by document (cu_seqlens) and blocks sorted by document.
    """
    if ctx_doc.numel() > 1 and bool((ctx_doc[1:] < ctx_doc[:-1]).any()):
        raise ValueError("context tokens must be grouped by document (ascending document ids)")
    docs, counts = torch.unique_consecutive(blocks.doc.to(ctx_doc.device), return_counts=True)
    if docs.numel() > 1 and bool((docs[1:] <= docs[:-1]).any()):
        raise ValueError("blocks must be sorted by document, as sample_anchors returns them")
    starts = torch.searchsorted(ctx_doc, docs.to(ctx_doc.dtype)).tolist()
    ends = torch.searchsorted(ctx_doc, docs.to(ctx_doc.dtype), right=True).tolist()
    q_bounds = [0, *(torch.cumsum(counts, 0) * blocks.block_size).tolist()]
    spans = []
    for s, e, q0, q1 in zip(starts, ends, q_bounds[:-1], q_bounds[1:], strict=True):
        step = _span_queries(e - s, blocks.block_size)
        spans += [(slice(s, e), slice(q, min(q + step, q1))) for q in range(q0, q1, step)]
    return spans


def document_masks(ctx_doc: torch.Tensor, ctx_pos: torch.Tensor, blocks: Blocks, *,
                   sliding_window: int | None) -> DocumentMasks:
    """The module's rule split by document: one small bool mask per span of a document's blocks."""
    _check_window(sliding_window)
    q, k = _rows(ctx_doc, ctx_pos, blocks)
    T = int(ctx_doc.shape[0])
    spans = _document_spans(ctx_doc, blocks)
    masks = []
    for ctx_rows, q_rows in spans:
        q_d = q.map(lambda x, r=q_rows: x[r, None])
        k_d = k.map(lambda x, c=ctx_rows, r=q_rows: document_keys(x, c, r, num_context=T, dim=0)[None, :])
        masks.append(_visible(q_d, k_d, sliding_window)[None, None])
    return DocumentMasks(num_context=T, num_queries=int(q.doc.shape[0]), context=tuple(c for c, _ in spans),
                         queries=tuple(r for _, r in spans), masks=tuple(masks))


def _mask_mod(ctx_doc: torch.Tensor, ctx_pos: torch.Tensor, blocks: Blocks, sliding_window: int | None):
    """A FlexAttention mask_mod over per-query / per-key lookup tables (no data-dependent branching)."""
    q, k = _rows(ctx_doc, ctx_pos, blocks)

    def mask_mod(b, h, q_idx, kv_idx):
        return _visible(q.map(lambda x: x[q_idx]), k.map(lambda x: x[kv_idx]), sliding_window)

    return mask_mod


@functools.cache
def _compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


class _KeyRanges(NamedTuple):
    """The full-attention rule per block as two key ranges, int32 [A] each: the block's queries see
    the context rows ``[ctx_lo, ctx_hi)`` (their document before the anchor: the anchor's row minus
    its document-local position, up to the anchor's row; positions count from 0 along each
    document's rows, as every packed batch's do) and their own block's keys ``[own_lo, own_lo + B)``.
    """

    ctx_lo: torch.Tensor
    ctx_hi: torch.Tensor
    own_lo: torch.Tensor

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> _KeyRanges:
        return _KeyRanges(*(fn(x) for x in self))

    @staticmethod
    def of(blocks: Blocks, num_context: int) -> _KeyRanges:
        # int32: a batch's rows and keys fit; int64 would double the tile count's [Q, K / tile]
        # temporaries, and a GPU does int64 arithmetic in several steps
        device, i32 = blocks.token_index.device, torch.int32
        ctx_hi = blocks.token_index.to(device=device, dtype=i32)
        own_lo = num_context + torch.arange(blocks.num_anchors, device=device, dtype=i32) * blocks.block_size
        return _KeyRanges(ctx_hi - blocks.anchor_pos.to(device=device, dtype=i32), ctx_hi, own_lo)


def _full_attention_tiles(blocks: Blocks, num_context: int, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) bool [Q tiles, K tiles] of the full-attention rule: which tile x tile squares of
    the [Q, T + Q] grid hold some visible pairs but not only those, and which hold only visible ones.

    Counting how much of each key tile a query's two key ranges (`_KeyRanges`) cover, row by row,
    costs [Q, K / tile] work where evaluating the rule on every pair costs [Q, K]. Squares past Q or
    T + Q count as not visible, as FlexAttention pads them.
    """
    B, A = blocks.block_size, blocks.num_anchors
    q_len, kv_len, device = A * B, num_context + A * B, blocks.token_index.device
    q_tiles, kv_tiles = -(-q_len // tile), -(-kv_len // tile)
    rows = torch.arange(q_tiles * tile, device=device, dtype=torch.int32)
    ranges = _KeyRanges.of(blocks, num_context).map(lambda x: x[(rows // B).clamp(max=A - 1)])
    k0 = torch.arange(kv_tiles, device=device, dtype=torch.int32) * tile
    k1 = k0 + tile

    def covered(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        return (torch.minimum(hi[:, None], k1) - torch.maximum(lo[:, None], k0)).clamp(min=0)

    keys = covered(ranges.ctx_lo, ranges.ctx_hi) + covered(ranges.own_lo, ranges.own_lo + B)  # per (row, tile)
    keys = torch.where((rows < q_len)[:, None], keys, 0).view(q_tiles, tile, kv_tiles)
    full = (keys == tile).all(dim=1)
    return (keys > 0).any(dim=1) & ~full, full


def key_range_mask_mod(blocks: Blocks, num_context: int):
    """The full-attention rule as a mask_mod over the key ranges (`_KeyRanges`): three int32 lookups
    by the query's block, the same for all B of its rows, where the general rule (`_mask_mod`) looks
    up eight int64 values per (query, key) pair; attention kernels evaluate the mask_mod on every
    pair of a partial block, in forward and twice in backward. Tested equal to the rule;
    `bench/attention.py` times the two side by side."""
    B, ranges = blocks.block_size, _KeyRanges.of(blocks, num_context)

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // B
        own = ranges.own_lo[block]
        return ((kv_idx >= ranges.ctx_lo[block]) & (kv_idx < ranges.ctx_hi[block])) | \
            ((kv_idx >= own) & (kv_idx < own + B))

    return mask_mod


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, 1, Q tiles] counts and [1, 1, Q tiles, K tiles] column indices, set ones first, as BlockMask holds them."""
    counts = tiles.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None], order[None, None]


def flex_block_mask(ctx_doc: torch.Tensor, ctx_pos: torch.Tensor, blocks: Blocks, *,
                    sliding_window: int | None, compile: bool = False):
    """The same rule as ``dense_mask`` as a FlexAttention BlockMask (B=None, H=None, Q=A*B, KV=T+A*B).

    Full-attention masks are laid out from each query's visible key ranges (`_full_attention_tiles`:
    the same blocks as ``create_block_mask``, tested equal, in a fraction of its time), and the kernel
    evaluates their partial blocks with the same ranges (`key_range_mask_mod`). Sliding-window
    masks evaluate the rule: ``compile`` (for GPUs) fuses computing the mask and reducing it to
    blocks into compiled kernels; eager evaluation materialises the whole Q x K mask and its int64
    intermediates, gigabytes at training sizes.
    """
    from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE as TILE
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    _check_window(sliding_window)
    T, q_len = int(ctx_doc.shape[0]), blocks.num_anchors * blocks.block_size
    kv_len = T + q_len
    if sliding_window is None and q_len > 0:
        partial, full = _full_attention_tiles(blocks, T, TILE)
        return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=TILE,
                                        mask_mod=key_range_mask_mod(blocks, T), seq_lengths=(q_len, kv_len))
    build = _compiled_create_block_mask() if compile else create_block_mask
    return build(_mask_mod(ctx_doc, ctx_pos, blocks, sliding_window), None, None, q_len, kv_len,
                 device=ctx_doc.device)


def _layer_window(layer_type: str, sliding_window: int | None) -> int | None:
    """The window a layer type attends with (None = full attention)."""
    if layer_type == FULL_ATTENTION:
        return None
    if layer_type == SLIDING_ATTENTION:
        if sliding_window is None:
            raise ValueError("layer type 'sliding_attention' needs a sliding_window")
        return sliding_window
    raise ValueError(f"unknown layer type {layer_type!r} (expected one of {LAYER_TYPES})")


def build_masks(ctx_doc: torch.Tensor, ctx_pos: torch.Tensor, blocks: Blocks, *, layer_types: Sequence[str],
                sliding_window: int | None, backend: str, compile: bool = False) -> dict[str, object]:
    """One mask per distinct layer type in ``layer_types``, built once and shared by all such layers.

    backend "dense": a `DocumentMasks` (SDPA per document, for CPUs); "flex": a BlockMask.
    """
    if backend not in ("dense", "flex"):
        raise ValueError(f"unknown mask backend {backend!r} (expected 'dense' or 'flex')")
    masks: dict[str, object] = {}
    for layer_type in layer_types:
        if layer_type in masks:
            continue
        window = _layer_window(layer_type, sliding_window)
        if backend == "dense":
            masks[layer_type] = document_masks(ctx_doc, ctx_pos, blocks, sliding_window=window)
        else:
            masks[layer_type] = flex_block_mask(ctx_doc, ctx_pos, blocks, sliding_window=window, compile=compile)
    return masks


__all__ = ["FULL_ATTENTION", "LAYER_TYPES", "SLIDING_ATTENTION", "DocumentMasks", "build_masks",
           "context_doc_pos", "dense_mask", "document_keys", "document_masks", "flex_block_mask",
           "key_range_mask_mod"]
