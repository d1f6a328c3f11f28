"""A loss-chunk kernel that reads the logits once: an experiment that `bench/lm_head.py` times
against the trainer's two-pass kernel (settings `segCOLUMNSxWARPS`). Not adopted: on an NVIDIA H200
(2026-12-02) it took 1.45-2.07 ms for one 3,840-row chunk of 151,936-column bf16 logits, where the
two-pass kernel took 1.07-1.11 (`bench/results/2026-12-02-h200-lm-head-one-read.*`), and a
training step with it was 1.1% slower (0.504 against 0.499 s, `...-train-one-read.*`, the row
`resident-loss-triton-one-read`; `bench/train.py --loss-kernels one-read` runs it now).

The trainer's kernel (`dflash_cache.train.loss_kernel`) reads each row twice, since the gradient
needs the row's log-sum-exp before any of it can be written, and a 151,936-column row does not fit
in one program's registers or shared memory. Here a row is split into `segment`-column pieces, one
program each, held in registers: each program publishes its piece's max, sum of exponentials and
first argmax, waits (spinning on an atomic counter) until the row's other pieces have published
theirs, combines them, and writes its part of the gradient from registers, keeping exp(x - max)
so that each element also takes one exp instead of two. The wait relies on the pieces of a row
being consecutive programs, hence resident together. The interpreter runs programs one after
another, so there the publishing and the finishing run as two launches of the same kernel.

`TRITON_INTERPRET=1 python3 -m bench.one_read_loss` checks it against the torch loss on a CPU.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import TYPE_CHECKING

import torch

from dflash_cache.triton_support import check_triton_device, on_device_of, require_triton

_WHO = "one-read loss kernel"
SEGMENT = 16384
if TYPE_CHECKING:  # as the kernels see it once built (typed as None, each tl.* in them would be an error)
    import triton.language as tl
else:
    tl = None  # triton.language, bound on first kernel build (kernels resolve names through module globals)


@functools.cache
def _build_kernel(interpret: bool):
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def _segment_kernel(logits_ptr, labels_ptr, row_scale_ptr, ce_ptr, correct_ptr, part_max_ptr, part_sum_ptr,
                        part_col_ptr, arrived_ptr, V, stride_row, S: tl.constexpr, S_POW2: tl.constexpr,
                        SEG: tl.constexpr, PUBLISH: tl.constexpr, FINISH: tl.constexpr, HAS_GRAD: tl.constexpr):
        pid = tl.program_id(0)
        row = (pid // S).to(tl.int64)
        seg = pid % S
        base = logits_ptr + row * stride_row
        idx = seg * SEG + tl.arange(0, SEG)
        keep = idx < V
        x = tl.load(base + idx, mask=keep, other=float("-inf")).to(tl.float32)
        seg_max = tl.max(x, axis=0)
        seg_col = tl.argmax(x, axis=0) + seg * SEG  # the piece's first maximal column
        e = tl.exp(x - seg_max)
        label = tl.load(labels_ptr + row)
        target = tl.maximum(label, 0)  # rows with weight 0 may carry -100
        x_target = tl.sum(tl.where(idx == target, x, 0.0), axis=0)  # meaningful in the target's piece only
        if PUBLISH:
            tl.store(part_max_ptr + row * S + seg, seg_max)
            tl.store(part_sum_ptr + row * S + seg, tl.sum(e, axis=0))
            tl.store(part_col_ptr + row * S + seg, seg_col)
            tl.debug_barrier()  # every thread's stores before the release below
            tl.atomic_add(arrived_ptr + row, 1, sem="release")
        if FINISH:
            while tl.atomic_add(arrived_ptr + row, 0, sem="acquire") < S:
                pass
            tl.debug_barrier()
            s = tl.arange(0, S_POW2)
            part = row * S + s
            maxes = tl.load(part_max_ptr + part, mask=s < S, other=float("-inf"), cache_modifier=".cg")
            sums = tl.load(part_sum_ptr + part, mask=s < S, other=0.0, cache_modifier=".cg")
            row_max = tl.max(maxes, axis=0)
            lse = row_max + tl.log(tl.sum(sums * tl.exp(maxes - row_max), axis=0))
            if seg == 0:
                cols = tl.load(part_col_ptr + part, mask=s < S, other=0, cache_modifier=".cg")
                first = tl.min(tl.where(maxes == row_max, s, S_POW2), axis=0)  # ties: the first column
                best_col = tl.sum(tl.where(s == first, cols, 0), axis=0)
                tl.store(correct_ptr + row, (best_col == label).to(tl.int8))
            # (triton types tl.max's and tl.sum's results as a tensor or a tuple)
            if target // SEG == seg:
                tl.store(ce_ptr + row, lse - x_target)  # pyright: ignore[reportOperatorIssue]
            if HAS_GRAD:
                scale = tl.load(row_scale_ptr + row)
                grad = e * (tl.exp(seg_max - lse) * scale)  # pyright: ignore[reportOperatorIssue]
                grad = tl.where(idx == target, grad - scale, grad)
                tl.store(base + idx, grad.to(logits_ptr.dtype.element_ty), mask=keep)

    return _segment_kernel


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def logits_loss_and_grad_one_read(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                                  total_weight: torch.Tensor | None, *, segment: int = SEGMENT,
                                  num_warps: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`dflash_cache.train.loss.logits_loss_and_grad`'s contract; the gradient is written over `logits`."""
    interpret = require_triton(_WHO, "run it on a CUDA device or under TRITON_INTERPRET=1")
    check_triton_device(logits, _WHO)
    rows, vocab = logits.shape
    seg = min(segment, _next_power_of_2(vocab))
    n_seg = -(-vocab // seg)
    dev = logits.device
    weights = weights.float().contiguous()
    ce = torch.empty(rows, dtype=torch.float32, device=dev)
    correct = torch.empty(rows, dtype=torch.int8, device=dev)
    has_grad = total_weight is not None
    row_scale = (weights / total_weight).contiguous() if has_grad else weights
    if rows:
        part_max = torch.empty(rows * n_seg, dtype=torch.float32, device=dev)
        part_sum = torch.empty_like(part_max)
        part_col = torch.empty(rows * n_seg, dtype=torch.int32, device=dev)
        arrived = torch.zeros(rows, dtype=torch.int32, device=dev)
        stages = ((True, False), (False, True)) if interpret else ((True, True),)
        with on_device_of(logits):
            for publish, finish in stages:
                _build_kernel(interpret)[(rows * n_seg,)](
                    logits, labels.contiguous(), row_scale, ce, correct, part_max, part_sum, part_col, arrived, vocab,
                    logits.stride(0), S=n_seg, S_POW2=_next_power_of_2(n_seg), SEG=seg, PUBLISH=publish,
                    FINISH=finish, HAS_GRAD=has_grad,
                    # a launch option, which triton's typing of kernel[grid] (the kernel's own signature) lacks
                    num_warps=num_warps)  # pyright: ignore[reportCallIssue]
    loss_sum = torch.where(weights != 0, ce * weights, torch.zeros_like(ce)).sum()
    return loss_sum, correct.bool(), logits if has_grad else None


def check_against_torch() -> None:
    """Loss, argmax (ties too) and gradient against the torch loss, with several pieces per row."""
    from dflash_cache.train.loss import logits_loss_and_grad

    for rows, vocab, dtype, segment in [(6, 50, torch.float32, SEGMENT), (6, 9000, torch.float32, 1024),
                                        (5, 9000, torch.bfloat16, 2048)]:
        for with_grad in (True, False):
            g = torch.Generator().manual_seed(rows + vocab)
            logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
            labels = torch.randint(0, vocab, (rows,), generator=g)
            weights = torch.rand(rows, generator=g) + 0.1
            weights[1], labels[1] = 0.0, -100
            logits[3, 7] = logits[3, vocab - 2] = 50.0  # a tie across pieces: the first column wins
            labels[3] = 7
            total = weights.sum() if with_grad else None
            ref = logits_loss_and_grad(logits.clone(), labels, weights, total)
            out = logits_loss_and_grad_one_read(logits.clone(), labels, weights, total, segment=segment)
            loss_err = abs(float(out[0]) - float(ref[0])) / abs(float(ref[0]))
            grad_err, grad_tol = 0.0, 2**-7 if dtype == torch.bfloat16 else 1e-6
            if with_grad:
                out_grad, ref_grad = out[2], ref[2]
                if out_grad is None or ref_grad is None:  # not reached: a total weight asks for the gradient
                    raise RuntimeError("a loss with a total weight returned no gradient")
                grad_err = float((out_grad.float() - ref_grad.float()).abs().max())
                grad_tol *= float(ref_grad.float().abs().max())
            ok = loss_err < 1e-5 and torch.equal(out[1], ref[1]) and bool(out[1][3]) and grad_err <= grad_tol
            print(f"{rows} x {vocab} {dtype} pieces of {segment} grad={with_grad}: loss err {loss_err:.1e}, "
                  f"grad err {grad_err:.1e} -> {'ok' if ok else 'FAILED'}")
            if not ok:
                sys.exit(1)


if __name__ == "__main__":
    argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    check_against_torch()
