"""Which implementation the lossy codecs run on a GPU: the one place that choice is made.

A codec encodes on the extraction GPU (before the device-to-host copy) and decodes on the training
GPU (after the host-to-device copy). What runs there today:

    codec       encode on a GPU                              decode on a GPU
    none, bf16  a bit view                                   a bit view
    fp8         hand-written Triton kernels                  hand-written Triton kernels
                (`fp8.quantize_fp8_triton`)                  (`fp8.dequantize_fp8_triton`)
    fp4         the eager torch reference, compiled by       the eager torch reference
                torch.compile (`fp4.quantize_fp4_layout`)    (`fp4.dequantize_fp4`)

Off a GPU (and for fp8 where triton does not import) every codec runs its torch reference. Each
fast path is tested to store the bytes of its reference (fp8 under the Triton interpreter, fp4 on
a GPU), so the choice changes speed, never a cache.

Two strategies for one job would be one too many, and an NVIDIA H200 measured both
(`python3 -m bench.codec_kernels`, bench/results/2026-12-05-h200-codec-kernels.md): torch.compile of
the torch reference is the faster strategy for fp8 (1.7x), but its encoder stores other bytes than
the reference (the generated code divides approximately; the reference and the Triton kernels divide
correctly rounded), and compiled fp4 decoding changes bits too. One strategy would take a change of
stored format (an fp8 quantiser that does not divide, as fp4's), so the split above stays, measured:
fp8's kernels cost ~0.16% of a target forward's time per token. The predicates below are the one place
that choice is made (the dispatchers `fp8.quantize_fp8`, `fp8.dequantize_fp8` and
`fp4.quantize_fp4_layout` call them).
"""

from __future__ import annotations

import torch

from dflash_cache.triton_support import triton_available


def fp8_runs_triton(t: torch.Tensor) -> bool:
    """Whether fp8 encodes and decodes `t` with its Triton kernels (else its torch reference)."""
    return t.is_cuda and triton_available()


def fp4_encode_compiled(t: torch.Tensor) -> bool:
    """Whether fp4 encodes `t` through torch.compile (else eagerly); it always decodes eagerly."""
    return t.device.type == "cuda"
