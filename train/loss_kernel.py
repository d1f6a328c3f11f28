"""One loss chunk's softmax, cross-entropy, argmax and logits gradient as one Triton kernel.

`logits_loss_and_grad_triton` computes what `dflash_cache.train.loss.logits_loss_and_grad` does, in
two passes over each row of the [c, V] logits: the first keeps a running max, rescaled sum of
exponentials and first argmax (one exp per element); the second writes (softmax - onehot) * weight
/ total over the logits themselves. The logits are read twice and written once: on an H200 this
took 10.2 ms for a step's 30,720 x 151,936 bf16 logits (in 3,840-row chunks, 4,096 columns per
iteration), where inductor's kernel for the same function took 20.7 ms. Writing the gradient in
place also drops the second [c, V] buffer. A kernel that reads them once was slower
(bench/one_read_loss.py).

Rounding differs from the eager function by float32 ulps (the log-sum-exp is accumulated block by
block), and the float32 -> bf16 rounding of the gradient is the GPU's round-to-nearest-even; the
Triton interpreter truncates instead, which the CPU tests allow for.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from dflash_cache.triton_support import check_triton_device, on_device_of, require_triton

_WHO = "loss kernel"
# Columns per iteration, 32 float32 per thread at 8 warps. On an H200 (bench/lm_head.py, one 3,840-row
# chunk) 8,192 took 1.068 and 1.076 ms on two days where 4,096 took 1.111 and 1.119.
BLOCK_V = 8192
if TYPE_CHECKING:  # as the kernels see it once built (typed as None, each tl.* in them would be an error)
    import triton.language as tl
else:
    tl = None  # triton.language, bound on first kernel build (the import is lazy)


@functools.cache
def _build_kernel(interpret: bool):
    # `interpret` only keys the cache (see dflash_cache.triton_support). Kernels resolve names through
    # this module's globals (neither compiled Triton nor the interpreter sees closures), hence `global tl`.
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def _chunk_kernel(logits_ptr, labels_ptr, row_scale_ptr, ce_ptr, correct_ptr, V, stride_row,
                      HAS_GRAD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_row
        cols = tl.arange(0, BLOCK)
        running_max = tl.full([], float("-inf"), tl.float32)
        sum_exp = tl.full([], 0.0, tl.float32)
        best = tl.full([], float("-inf"), tl.float32)
        best_col = tl.full([], 0, tl.int64)
        for start in range(0, V, BLOCK):
            idx = start + cols
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            block_max = tl.max(x, axis=0)
            block_col = tl.argmax(x, axis=0).to(tl.int64) + start  # the first maximal column
            new_max = tl.maximum(running_max, block_max)
            sum_exp = sum_exp * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
            take = block_max > best  # strictly: an equal later maximum keeps the first column, as torch does
            best_col = tl.where(take, block_col, best_col)
            best = tl.where(take, block_max, best)
        lse = running_max + tl.log(sum_exp)
        label = tl.load(labels_ptr + row)
        target = tl.maximum(label, 0)  # rows with weight 0 may carry -100
        x_target = tl.load(base + target).to(tl.float32)
        tl.store(ce_ptr + row, lse - x_target)
        tl.store(correct_ptr + row, (best_col == label).to(tl.int8))
        if HAS_GRAD:
            scale = tl.load(row_scale_ptr + row)
            for start in range(0, V, BLOCK):
                idx = start + cols
                keep = idx < V
                x = tl.load(base + idx, mask=keep, other=0.0).to(tl.float32)
                p = tl.exp(x - lse)
                grad = tl.where(idx == target, p - 1.0, p) * scale
                tl.store(base + idx, grad.to(logits_ptr.dtype.element_ty), mask=keep)

    return _chunk_kernel


def logits_loss_and_grad_triton(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                                total_weight: torch.Tensor | None, *, block: int = BLOCK_V, num_warps: int = 8
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`logits_loss_and_grad`'s contract, on CUDA (or CPU under TRITON_INTERPRET=1).

    The gradient, when asked for, is written over `logits` and returned: the caller must not need
    the logits afterwards. `block` (columns per iteration, a power of 2) and `num_warps` are the
    launch settings bench/lm_head.py compares.
    """
    interpret = require_triton(_WHO, "train with --no-compile, or on a CPU, for the torch loss")
    check_triton_device(logits, _WHO)
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"{_WHO}: logits must be [c, V] with contiguous rows, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    rows, vocab = logits.shape
    labels = labels.contiguous()
    weights = weights.float().contiguous()
    ce = torch.empty(rows, dtype=torch.float32, device=logits.device)
    correct = torch.empty(rows, dtype=torch.int8, device=logits.device)
    has_grad = total_weight is not None
    row_scale = (weights / total_weight).contiguous() if has_grad else weights  # unused without the gradient
    if rows:
        with on_device_of(logits):
            _build_kernel(interpret)[(rows,)](logits, labels, row_scale, ce, correct, vocab, logits.stride(0),
                                              HAS_GRAD=has_grad, BLOCK=min(block, _next_power_of_2(vocab)),
                                              # a launch option, which triton's typing of kernel[grid] lacks
                                              num_warps=num_warps)  # pyright: ignore[reportCallIssue]
    loss_sum = torch.where(weights != 0, ce * weights, torch.zeros_like(ce)).sum()
    return loss_sum, correct.bool(), logits if has_grad else None


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
