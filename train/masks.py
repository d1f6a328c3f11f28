"""Attention masks for DFlash drafter training on a packed batch.

Queries are the ``A * B`` block tokens (block ``a`` occupies query rows ``a*B .. a*B + B - 1``).
Keys are ``[the T context tokens of the packed batch | the A*B block tokens]``, ``K = T + A*B``.
A query of block ``a`` (anchor at document-local position ``p_a`` in document ``d_a``) may attend:

* context key ``t`` iff ``doc[t] == d_a`` and ``pos[t] < p_a`` (same document, strictly before the
  anchor; the anchor token itself is slot 0 of the block),
* every key of its own block (bidirectional), and nothing else.

Sliding-window layers (window ``W``) additionally require, for context keys,
``p_a - W <= pos[t]`` (equivalently ``pos[t] > p_a - 1 - W``): the query block sees at most the
``W`` context positions ``p_a - W .. p_a - 1`` immediately before its anchor, whatever its slot.
Inside the block, attention is causal: slot ``i`` sees slots ``0 .. i``.

``dense_mask`` is the reference (a materialised bool matrix, for SDPA on CPU / small tests);
``flex_block_mask`` expresses the same rule as a FlexAttention ``mask_mod``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from train.anchors import Blocks
from train.batch import PackedBatch

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


def context_doc_pos(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(doc [T], pos [T]) of the context tokens: document ids from cu_seqlens, document-local positions."""
    return batch.doc_ids(), batch.position_ids.to(torch.int64)


def _check_window(sliding_window: int | None) -> None:
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 or None, got {sliding_window}")


def dense_mask(ctx_doc: torch.Tensor, ctx_pos: torch.Tensor, blocks: Blocks, *,
               sliding_window: int | None) -> torch.Tensor:
    """bool [A*B, T + A*B], True = may attend (reference implementation, see module doc)."""
    _check_window(sliding_window)
    B = blocks.block_size
    A = blocks.num_anchors
    device = ctx_doc.device
    q_doc = blocks.doc.to(device).repeat_interleave(B)                # [Q]
    q_anchor = blocks.anchor_pos.to(device).repeat_interleave(B)      # [Q]

    ctx = (ctx_doc[None, :] == q_doc[:, None]) & (ctx_pos[None, :] < q_anchor[:, None])
    if sliding_window is not None:
        ctx &= ctx_pos[None, :] >= q_anchor[:, None] - sliding_window

    idx = torch.arange(A * B, device=device)
    blk = (idx[:, None] // B) == (idx[None, :] // B)                  # own block only
    if sliding_window is not None:
        blk &= (idx[None, :] % B) <= (idx[:, None] % B)              # causal inside the block
    return torch.cat([ctx, blk], dim=1)


def _mask_mod(ctx_doc: torch.Tensor, ctx_pos: torch.Tensor, blocks: Blocks, sliding_window: int | None):
    """A FlexAttention mask_mod over per-key / per-query lookup tables (no data-dependent branching)."""
    B = blocks.block_size
    A = blocks.num_anchors
    T = int(ctx_doc.shape[0])
    device = ctx_doc.device
    i64 = torch.int64
    q = torch.arange(A * B, device=device, dtype=i64)
    q_block = q // B
    q_slot = q % B
    q_doc = blocks.doc.to(device=device, dtype=i64).repeat_interleave(B)
    q_anchor = blocks.anchor_pos.to(device=device, dtype=i64).repeat_interleave(B)
    # Key tables over all K = T + A*B keys. Block keys get doc -1 (never a query's doc); context keys
    # get block -1 (never a query's block).
    neg = torch.full((A * B,), -1, device=device, dtype=i64)
    k_doc = torch.cat([ctx_doc.to(i64), neg])
    k_pos = torch.cat([ctx_pos.to(i64), torch.zeros(A * B, device=device, dtype=i64)])
    k_block = torch.cat([torch.full((T,), -1, device=device, dtype=i64), q_block])
    k_slot = torch.cat([torch.zeros(T, device=device, dtype=i64), q_slot])

    if sliding_window is None:
        def mask_mod(b, h, q_idx, kv_idx):
            ctx_ok = (k_doc[kv_idx] == q_doc[q_idx]) & (k_pos[kv_idx] < q_anchor[q_idx])
            return ctx_ok | (k_block[kv_idx] == q_block[q_idx])
    else:
        W = int(sliding_window)

        def mask_mod(b, h, q_idx, kv_idx):
            kp = k_pos[kv_idx]
            qa = q_anchor[q_idx]
            ctx_ok = (k_doc[kv_idx] == q_doc[q_idx]) & (kp < qa) & (kp >= qa - W)
            blk_ok = (k_block[kv_idx] == q_block[q_idx]) & (k_slot[kv_idx] <= q_slot[q_idx])
            return ctx_ok | blk_ok

    return mask_mod


@functools.cache
def _compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def flex_block_mask(ctx_doc: torch.Tensor, ctx_pos: torch.Tensor, blocks: Blocks, *,
                    sliding_window: int | None, compile: bool = False):
    """The same rule as ``dense_mask`` as a FlexAttention BlockMask (B=None, H=None, Q=A*B, KV=T+A*B).

    ``compile`` (for GPUs) fuses computing the mask and reducing it to blocks into compiled kernels;
    eager evaluation materialises the whole Q x K mask and its int64 intermediates, gigabytes at
    training sizes.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    _check_window(sliding_window)
    q_len = blocks.num_anchors * blocks.block_size
    kv_len = int(ctx_doc.shape[0]) + q_len
    mask_mod = _mask_mod(ctx_doc, ctx_pos, blocks, sliding_window)
    build = _compiled_create_block_mask() if compile else create_block_mask
    return build(mask_mod, None, None, q_len, kv_len, device=ctx_doc.device)


def build_masks(ctx_doc: torch.Tensor, ctx_pos: torch.Tensor, blocks: Blocks, *, layer_types: Sequence[str],
                sliding_window: int | None, backend: str, compile: bool = False) -> dict[str, object]:
    """One mask per distinct layer type in ``layer_types``, built once and shared by all such layers.

    backend "dense": bool [1, 1, Q, K] (True = attend, for SDPA's attn_mask); "flex": a BlockMask.
    """
    if backend not in ("dense", "flex"):
        raise ValueError(f"unknown mask backend {backend!r} (expected 'dense' or 'flex')")
    masks: dict[str, object] = {}
    for layer_type in layer_types:
        if layer_type in masks:
            continue
        if layer_type == FULL_ATTENTION:
            window = None
        elif layer_type == SLIDING_ATTENTION:
            if sliding_window is None:
                raise ValueError("layer type 'sliding_attention' needs a sliding_window")
            window = sliding_window
        else:
            raise ValueError(f"unknown layer type {layer_type!r} (expected one of {LAYER_TYPES})")
        if backend == "dense":
            masks[layer_type] = dense_mask(ctx_doc, ctx_pos, blocks, sliding_window=window)[None, None]
        else:
            masks[layer_type] = flex_block_mask(ctx_doc, ctx_pos, blocks, sliding_window=window, compile=compile)
    return masks


__all__ = ["FULL_ATTENTION", "LAYER_TYPES", "SLIDING_ATTENTION", "build_masks", "context_doc_pos",
           "dense_mask", "flex_block_mask"]
