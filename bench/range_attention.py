"""Full attention over the DFlash mask's two key ranges per block, as Triton kernels: an experiment
that `bench/attention.py` times against FlexAttention (settings "ranges ..."). Not adopted: on an
NVIDIA H200 (2026-12-02) its forward matched FlexAttention's (2.72 against 2.71 ms a layer) and its
backward was slower, forward+backward 15.2 ms at best against 10.8-10.9 ms, with dQ by atomic adds
and with dQ by programs of its own alike (`bench/results/2026-12-02-h200-attention-ranges*.log`). So
the atomic adds are not what it pays for; its dK/dV programs are slower than FlexAttention's, for a
reason not found here (no hardware counters were read).

Every row of a block sees the same keys: its document's context rows ``[ctx_lo, ctx_hi)`` and its
own block's ``B`` keys (`dflash_cache.train.masks._KeyRanges`). A query tile of whole blocks
therefore walks one contiguous run of context keys from its first visible row, not from a
128-aligned tile, and its own blocks' keys in one square: the only masked work is the edge of the
run and that square's off-diagonal blocks.

The backward takes five products per (key tile, query tile) pair where FlexAttention's takes seven:
each key tile's program also forms that pair's query gradient and adds it into a float32 buffer
(`tl.atomic_add`), instead of a second set of programs computing the scores again for dQ; the
float32 sums' order then varies from run to run, by float32 rounding. `KernelConfig.split_dq`
computes dQ by such programs instead (seven products, no atomic adds).

Shapes: q [Hq, Q, D], k and v [Hkv, T + Q, D] (any strides with unit last stride), Hq a multiple
of Hkv; out [Hq, Q, D] and log-sum-exp (base 2) [Hq, Q] float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dflash_cache.triton_support import triton_available

if TYPE_CHECKING or triton_available():  # type checkers see the modules the kernels use
    import triton
    import triton.language as tl
else:  # pragma: no cover - triton is a Linux dependency
    triton = tl = None

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch settings: forward query/key tiles, backward key/query tiles."""

    fwd_m: int = 128
    fwd_n: int = 64
    fwd_warps: int = 8
    fwd_stages: int = 3
    bwd_n: int = 128
    bwd_m: int = 64
    bwd_warps: int = 8
    bwd_stages: int = 2
    split_dq: bool = False  # dQ by programs of its own (three products a pair), no atomic adds
    dq_m: int = 128
    dq_n: int = 64
    dq_warps: int = 8
    dq_stages: int = 2


@dataclass(frozen=True)
class RangePlan:
    """What the kernels read besides q/k/v, all on the device and built without a host sync.

    ``ctx_lo``/``ctx_hi`` int32 [A]: each block's context rows. ``fwd_order`` int32: forward query
    tiles, longest key run first (the tail of the launch then holds the short ones); ``dq_order`` the
    same for the dQ programs' tiles. ``bwd_tiles``/``bwd_q_lo``/``bwd_q_hi`` int32: context key tiles, most query rows first, and the
    query rows [lo, hi) whose blocks may see each of them.
    """

    block_size: int
    num_context: int
    num_queries: int
    ctx_lo: torch.Tensor
    ctx_hi: torch.Tensor
    fwd_order: torch.Tensor
    dq_order: torch.Tensor
    bwd_tiles: torch.Tensor
    bwd_q_lo: torch.Tensor
    bwd_q_hi: torch.Tensor
    config: KernelConfig


def _tile_order(lo: torch.Tensor, hi: torch.Tensor, per_tile: int) -> torch.Tensor:
    """Query tiles of `per_tile` blocks, the longest run of context keys first (empty runs count 0):
    the tail of the launch then holds the short ones."""
    n_tiles = -(-lo.shape[0] // per_tile)
    pad = n_tiles * per_tile - lo.shape[0]
    span = torch.nn.functional.pad(hi - lo, (0, pad)).view(n_tiles, per_tile)
    run = (torch.nn.functional.pad(hi, (0, pad)).view(n_tiles, per_tile).amax(1)
           - torch.nn.functional.pad(lo, (0, pad), value=2**30).view(n_tiles, per_tile).amin(1))
    return torch.argsort(torch.where(span.amax(1) > 0, run, 0), descending=True, stable=True).to(torch.int32)


def plan_ranges(ctx_lo: torch.Tensor, ctx_hi: torch.Tensor, *, block_size: int, num_context: int,
                config: KernelConfig = KernelConfig()) -> RangePlan:
    """The launch plan of one mask (shared by every full-attention layer of a step)."""
    B, A = block_size, int(ctx_lo.shape[0])
    if config.fwd_m % B or config.bwd_n % B or config.dq_m % B:
        raise ValueError(f"tile sizes {config.fwd_m}/{config.bwd_n}/{config.dq_m} must be multiples of the "
                         f"block size {B}")
    device, i32 = ctx_lo.device, torch.int32
    lo, hi = ctx_lo.to(i32), ctx_hi.to(i32)
    fwd_order = _tile_order(lo, hi, config.fwd_m // B)
    dq_order = _tile_order(lo, hi, config.dq_m // B)
    # backward: per context key tile, the first and last block that sees any of its keys
    n_kv = -(-num_context // config.bwd_n)
    k0 = torch.arange(n_kv, device=device, dtype=i32) * config.bwd_n
    sees = (lo[None, :] < k0[:, None] + config.bwd_n) & (hi[None, :] > k0[:, None]) & (hi > lo)[None, :]
    any_ = sees.any(1)
    first = torch.argmax(sees.to(torch.int8), 1)
    last = A - 1 - torch.argmax(sees.flip(1).to(torch.int8), 1)
    q_lo = torch.where(any_, first * B, 0).to(i32)
    q_hi = torch.where(any_, (last + 1) * B, 0).to(i32)
    bwd_tiles = torch.argsort(q_hi - q_lo, descending=True, stable=True).to(i32)
    return RangePlan(B, num_context, A * B, lo, hi, fwd_order, dq_order, bwd_tiles, q_lo[bwd_tiles],
                     q_hi[bwd_tiles], config)


if tl is not None:

    @triton.jit
    def _attend(q, k, v, ok, m_i, l_i, acc, qk_scale):
        """One key tile of the online softmax (base 2); rows with nothing visible yet stay at -inf."""
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _query_tile(ORDER, LO, HI, n_ctx, n_q, GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                    N_HEADS: tl.constexpr):
        """This program's (q head, query tile, taken from ORDER), its rows, their context ranges and the
        run of context keys [lo, hi) the tile walks (rows with no context leave it alone)."""
        pid = tl.program_id(0)
        h = pid % N_HEADS
        tile = tl.load(ORDER + pid // N_HEADS)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_q
        blk = rows // BLOCK
        lo_r = tl.load(LO + blk, mask=row_ok, other=0)
        hi_r = tl.load(HI + blk, mask=row_ok, other=0)
        has = row_ok & (hi_r > lo_r)
        lo = tl.min(tl.where(has, lo_r, n_ctx), 0)
        hi = tl.max(tl.where(has, hi_r, 0), 0)
        return h, h // GROUP, tile, rows, row_ok, blk, lo_r, hi_r, lo, hi

    @triton.jit
    def _context_keys(kb, vb, start, hi, lo_r, hi_r, s_kn, s_vn, d, BLOCK_N: tl.constexpr):
        """K and V of the context keys [start, start + BLOCK_N) below `hi`, and which rows see them."""
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        k = tl.load(kb + cols[:, None] * s_kn + d[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(vb + cols[:, None] * s_vn + d[None, :], mask=col_ok[:, None], other=0.0)
        return k, v, (cols[None, :] >= lo_r[:, None]) & (cols[None, :] < hi_r[:, None])

    @triton.jit
    def _own_square(kb, vb, tile, blk, n_ctx, n_q, s_kn, s_vn, d, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
        """K and V of the tile's own blocks' keys (one square), visible where query and key share a block."""
        own = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        own_ok = own < n_q
        k = tl.load(kb + (n_ctx + own)[:, None] * s_kn + d[None, :], mask=own_ok[:, None], other=0.0)
        v = tl.load(vb + (n_ctx + own)[:, None] * s_vn + d[None, :], mask=own_ok[:, None], other=0.0)
        return k, v, (blk[:, None] == (own // BLOCK)[None, :]) & own_ok[None, :]

    @triton.jit
    def _fwd_kernel(Q, K, V, OUT, LSE, LO, HI, ORDER,
                    s_qh, s_qm, s_kh, s_kn, s_vh, s_vn, s_oh, s_om,
                    n_ctx, n_q, qk_scale,
                    GROUP: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_HEADS: tl.constexpr):
        h, hk, tile, rows, row_ok, blk, lo_r, hi_r, lo, hi = _query_tile(ORDER, LO, HI, n_ctx, n_q, GROUP, BLOCK,
                                                                          BLOCK_M, N_HEADS)
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + h * s_qh + rows[:, None] * s_qm + d[None, :], mask=row_ok[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        kb, vb = K + hk * s_kh, V + hk * s_vh
        # (triton types the loaded bounds as a tensor or a tuple; range over them is the kernel's loop)
        for start in range(lo, hi, BLOCK_N):  # pyright: ignore[reportArgumentType]
            k, v, ok = _context_keys(kb, vb, start, hi, lo_r, hi_r, s_kn, s_vn, d, BLOCK_N)
            m_i, l_i, acc = _attend(q, k, v, ok, m_i, l_i, acc, qk_scale)
        k, v, ok = _own_square(kb, vb, tile, blk, n_ctx, n_q, s_kn, s_vn, d, BLOCK, BLOCK_M)
        m_i, l_i, acc = _attend(q, k, v, ok, m_i, l_i, acc, qk_scale)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]
        tl.store(OUT + h * s_oh + rows[:, None] * s_om + d[None, :], out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + h * n_q + rows, m_i + tl.log2(l_safe), mask=row_ok)

    @triton.jit
    def _bwd_pair(k, v, q, do, lse, delta, ok, dk, dv, qk_scale):
        """dK/dV of one (key tile, query tile) pair, and dS^T for its dQ part."""
        s_t = tl.dot(k, tl.trans(q)) * qk_scale                    # [N, M]
        p_t = tl.where(ok, tl.exp2(s_t - lse[None, :]), 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk += tl.dot(ds_t, q)
        return dk, dv, ds_t

    @triton.jit
    def _dq_pair(q, do, k, v, lse, delta, ok, dq, qk_scale):
        """dQ of one (query tile, key tile) pair (before the softmax scale): three products."""
        s = tl.dot(q, tl.trans(k)) * qk_scale                      # [M, N]
        p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = (p * (dp - delta[:, None])).to(k.dtype)
        return dq + tl.dot(ds, k)

    @triton.jit
    def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, LO, HI, ORDER,
                   s_qh, s_qm, s_kh, s_kn, s_vh, s_vn, s_doh, s_dom, s_dqh, s_dqm,
                   n_ctx, n_q, qk_scale, sm_scale,
                   GROUP: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_HEADS: tl.constexpr):
        """One program per (query tile, q head): the forward's walk, accumulating dQ."""
        h, hk, tile, rows, row_ok, blk, lo_r, hi_r, lo, hi = _query_tile(ORDER, LO, HI, n_ctx, n_q, GROUP, BLOCK,
                                                                          BLOCK_M, N_HEADS)
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + h * s_qh + rows[:, None] * s_qm + d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + h * s_doh + rows[:, None] * s_dom + d[None, :], mask=row_ok[:, None], other=0.0)
        lse = tl.load(LSE + h * n_q + rows, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + h * n_q + rows, mask=row_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        kb, vb = K + hk * s_kh, V + hk * s_vh
        # rows past n_q see no key: their lo/hi are 0 (triton types them as a tensor or a tuple)
        for start in range(lo, hi, BLOCK_N):  # pyright: ignore[reportArgumentType]
            k, v, ok = _context_keys(kb, vb, start, hi, lo_r, hi_r, s_kn, s_vn, d, BLOCK_N)
            dq = _dq_pair(q, do, k, v, lse, delta, ok, dq, qk_scale)
        k, v, ok = _own_square(kb, vb, tile, blk, n_ctx, n_q, s_kn, s_vn, d, BLOCK, BLOCK_M)
        dq = _dq_pair(q, do, k, v, lse, delta, ok, dq, qk_scale)
        tl.store(DQ + h * s_dqh + rows[:, None] * s_dqm + d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
                 mask=row_ok[:, None])

    @triton.jit
    def _bwd_kernel(Q, K, V, DO, LSE, DELTA, DQ, DK, DV, LO, HI, TILES, QLO, QHI,
                    s_qh, s_qm, s_kh, s_kn, s_vh, s_vn, s_doh, s_dom, s_dqh, s_dqm, s_dkh, s_dkn,
                    n_ctx, n_q, qk_scale, sm_scale,
                    GROUP: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_KV_HEADS: tl.constexpr,
                    OWN: tl.constexpr, ATOMIC_DQ: tl.constexpr):
        """OWN=False: one program per (context key tile, kv head) over the query rows that may see
        it. OWN=True: one per (block-key tile, kv head), seen only by the same rows' blocks."""
        pid = tl.program_id(0)
        hk = pid % N_KV_HEADS
        idx = pid // N_KV_HEADS
        if OWN:
            q_lo = idx * BLOCK_N
            q_hi = tl.minimum(q_lo + BLOCK_N, n_q)
            keys = idx * BLOCK_N + tl.arange(0, BLOCK_N)
            key_ok = keys < n_q
            key_rows = n_ctx + keys
        else:
            tile = tl.load(TILES + idx)
            q_lo = tl.load(QLO + idx)
            q_hi = tl.load(QHI + idx)
            keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            key_ok = keys < n_ctx
            key_rows = keys
        d = tl.arange(0, HEAD_DIM)
        k = tl.load(K + hk * s_kh + key_rows[:, None] * s_kn + d[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(V + hk * s_vh + key_rows[:, None] * s_vn + d[None, :], mask=key_ok[:, None], other=0.0)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        for g in range(GROUP):
            h = hk * GROUP + g
            for m0 in range(q_lo, q_hi, BLOCK_M):
                rows = m0 + tl.arange(0, BLOCK_M)
                row_ok = rows < q_hi
                q = tl.load(Q + h * s_qh + rows[:, None] * s_qm + d[None, :], mask=row_ok[:, None], other=0.0)
                do = tl.load(DO + h * s_doh + rows[:, None] * s_dom + d[None, :], mask=row_ok[:, None], other=0.0)
                lse = tl.load(LSE + h * n_q + rows, mask=row_ok, other=0.0)
                delta = tl.load(DELTA + h * n_q + rows, mask=row_ok, other=0.0)
                if OWN:
                    ok = ((keys // BLOCK)[:, None] == (rows // BLOCK)[None, :]) & key_ok[:, None] & row_ok[None, :]
                else:
                    blk = rows // BLOCK
                    lo_r = tl.load(LO + blk, mask=row_ok, other=0)
                    hi_r = tl.load(HI + blk, mask=row_ok, other=0)
                    ok = (keys[:, None] >= lo_r[None, :]) & (keys[:, None] < hi_r[None, :]) & row_ok[None, :]
                dk, dv, ds_t = _bwd_pair(k, v, q, do, lse, delta, ok, dk, dv, qk_scale)
                if ATOMIC_DQ:
                    tl.atomic_add(DQ + h * s_dqh + rows[:, None] * s_dqm + d[None, :], tl.dot(tl.trans(ds_t), k),
                                  mask=row_ok[:, None], sem="relaxed")
        tl.store(DK + hk * s_dkh + key_rows[:, None] * s_dkn + d[None, :], (dk * sm_scale).to(DK.dtype.element_ty),
                 mask=key_ok[:, None])
        tl.store(DV + hk * s_dkh + key_rows[:, None] * s_dkn + d[None, :], dv.to(DV.dtype.element_ty),
                 mask=key_ok[:, None])


def range_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RangePlan,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [Hq, Q, D] laid out as [Q, Hq, D], lse [Hq, Q] float32 base 2)."""
    hq, n_q, d = q.shape
    hkv = k.shape[0]
    cfg = plan.config
    out = torch.empty(n_q, hq, d, device=q.device, dtype=q.dtype).transpose(0, 1)
    lse = torch.empty(hq, n_q, device=q.device, dtype=torch.float32)
    grid = (int(plan.fwd_order.shape[0]) * hq,)
    _fwd_kernel[grid](q, k, v, out, lse, plan.ctx_lo, plan.ctx_hi, plan.fwd_order,
                      q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                      out.stride(0), out.stride(1), plan.num_context, n_q, scale * LOG2E,
                      GROUP=hq // hkv, BLOCK=plan.block_size, HEAD_DIM=d, BLOCK_M=cfg.fwd_m, BLOCK_N=cfg.fwd_n,
                      N_HEADS=hq,
                      # launch options, which triton's typing of kernel[grid] (the kernel's own signature) lacks
                      num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages)  # pyright: ignore[reportCallIssue]
    return out, lse


def range_attention_backward(q, k, v, out, lse, grad_out, plan: RangePlan, scale: float):
    """(dq, dk, dv), dq in q's dtype laid out as [Q, Hq, D], dk/dv as k's rows."""
    hq, n_q, d = q.shape
    hkv, n_k, _ = k.shape
    cfg = plan.config
    delta = (grad_out.float() * out.float()).sum(-1)  # [Hq, Q]
    dk = torch.empty(n_k, hkv, d, device=k.device, dtype=k.dtype).transpose(0, 1)
    dv = torch.empty_like(dk)
    if cfg.split_dq:
        dq = torch.empty(n_q, hq, d, device=q.device, dtype=q.dtype).transpose(0, 1)
        _dq_kernel[(int(plan.dq_order.shape[0]) * hq,)](
            q, k, v, grad_out, lse, delta, dq, plan.ctx_lo, plan.ctx_hi, plan.dq_order,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1), dq.stride(0), dq.stride(1), plan.num_context, n_q,
            scale * LOG2E, scale, GROUP=hq // hkv, BLOCK=plan.block_size, HEAD_DIM=d, BLOCK_M=cfg.dq_m,
            BLOCK_N=cfg.dq_n, N_HEADS=hq,
            # launch options, which triton's typing of kernel[grid] (the kernel's own signature) lacks
            num_warps=cfg.dq_warps, num_stages=cfg.dq_stages)  # pyright: ignore[reportCallIssue]
    else:
        dq = torch.zeros(n_q, hq, d, device=q.device, dtype=torch.float32).transpose(0, 1)
    common = dict(GROUP=hq // hkv, BLOCK=plan.block_size, HEAD_DIM=d, BLOCK_M=cfg.bwd_m, BLOCK_N=cfg.bwd_n,
                  N_KV_HEADS=hkv, ATOMIC_DQ=not cfg.split_dq, num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages)
    args = (q, k, v, grad_out, lse, delta, dq, dk, dv, plan.ctx_lo, plan.ctx_hi, plan.bwd_tiles, plan.bwd_q_lo,
            plan.bwd_q_hi, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1), dq.stride(0), dq.stride(1), dk.stride(0), dk.stride(1),
            plan.num_context, n_q, scale * LOG2E, scale)
    # (triton types kernel[grid] as the kernel's own signature, whose constexpr parameters take no int)
    _bwd_kernel[(int(plan.bwd_tiles.shape[0]) * hkv,)](*args, OWN=False, **common)  # pyright: ignore[reportArgumentType]
    _bwd_kernel[(-(-n_q // cfg.bwd_n) * hkv,)](*args, OWN=True, **common)  # pyright: ignore[reportArgumentType]
    return (dq if cfg.split_dq else (dq * scale).to(q.dtype)), dk, dv


class _RangeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: RangePlan, scale: float):
        out, lse = range_attention_forward(q, k, v, plan, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = range_attention_backward(q, k, v, out, lse, grad_out, ctx.plan, ctx.scale)
        return dq, dk, dv, None, None


def range_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RangePlan,
                    scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v under the plan's key ranges; q [Hq, Q, D], k/v [Hkv, T + Q, D]."""
    if q.shape[0] % k.shape[0] or k.shape != v.shape or q.shape[1] != plan.num_queries \
            or k.shape[1] != plan.num_context + plan.num_queries:
        raise ValueError(f"range attention shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         f"do not fit the plan ({plan.num_queries} queries, {plan.num_context} context rows)")
    return _RangeAttention.apply(q, k, v, plan, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
