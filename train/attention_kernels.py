"""Which kernels FlexAttention lowers to in the drafter's compiled static-shape graph.

`triton` is inductor's own FlexAttention template: deterministic (dQ by programs of its own) and
always there. `flash` is flash-attention 4's CuTe kernels (torch's BACKEND="FLASH"), from the
optional flash-attn-4 package (`pip install 'dflash-cache[flash]'`): on an NVIDIA H200 its forward
and backward on the DFlash mask take 0.76x the Triton template's time, and a bench step 0.97x.
Its backward on Hopper sums dQ by atomic adds, so two runs of it differ in the last bits.
`flash` (and `auto`, which takes it where it can) needs compiled bf16 layers with heads of 128 on a
Hopper or Blackwell GPU, the package installed. At heads of 256 (Qwen3.5-27B's drafter) its Hopper
forward tiles the keys 80 at a time, which the mask's 128-key blocks do not divide (an error at the
first step, measured). The dynamic-shape graph always runs the Triton template: torch does not lower
FLASH with symbolic sizes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import flex_attention

from dflash_cache.errors import UserError, one_line
from dflash_cache.train.run_config import ATTENTION_KERNELS

# Compute capabilities flash-attention 4's FlexAttention kernels are built for: Hopper, Blackwell.
FLASH_MAJORS = (9, 10)
# Head sizes they are known to run at with the masks' 128-token blocks (bench/train.py on an H200).
FLASH_HEAD_DIMS = (128,)
FLASH_PACKAGE = "flash-attn-4"


def flash_flex_attention(q, k, v, **kwargs):
    """flex_attention lowered to flash-attention 4's kernels (compiled graphs only)."""
    return flex_attention(q, k, v, kernel_options={"BACKEND": "FLASH"}, **kwargs)


def flash_unavailable(device: torch.device, *, compiled: bool, low_precision: bool,
                      head_dim: int = FLASH_HEAD_DIMS[0]) -> str | None:
    """Why the flash kernels cannot run here, or None when they can (`low_precision`: the layers
    run under bf16 autocast; the kernels take bf16 or fp16 only)."""
    if device.type != "cuda":
        return f"they need an NVIDIA GPU, not {device.type}"
    if not compiled:
        return "they need compiled layers (without --no-compile)"
    if not low_precision:
        return "they need bf16 attention inputs (the GPU's autocast)"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in FLASH_MAJORS:
        return f"they are built for Hopper and Blackwell GPUs, not compute capability {major}.{minor}"
    if head_dim not in FLASH_HEAD_DIMS:
        return f"they run at heads of {', '.join(map(str, FLASH_HEAD_DIMS))} here, not {head_dim}"
    try:  # imported, not only looked up: an install that cannot import (a missing dependency) is named
        importlib.import_module("flash_attn.cute")
    except ModuleNotFoundError as e:
        if e.name in ("flash_attn", "flash_attn.cute"):
            return f"the {FLASH_PACKAGE} package is not installed (pip install 'dflash-cache[flash]')"
        return f"flash_attn.cute does not import ({type(e).__name__}: {one_line(e)})"
    except Exception as e:  # whatever a broken install raises: its reason, not a traceback
        return f"flash_attn.cute does not import ({type(e).__name__}: {one_line(e)})"
    return None


def choose_attention_kernels(requested: str, device: torch.device, *, compiled: bool, low_precision: bool,
                             head_dim: int) -> tuple[str, str | None]:
    """`requested` (one of ATTENTION_KERNELS) resolved to 'triton' or 'flash' for this run, with why
    flash does not run here (None when it does, or when 'triton' was asked for: nothing checked)."""
    if requested not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernels must be one of {ATTENTION_KERNELS}, got {requested!r}")
    if requested == "triton":
        return "triton", None
    reason = flash_unavailable(device, compiled=compiled, low_precision=low_precision, head_dim=head_dim)
    if requested == "flash" and reason is not None:
        raise UserError(f"--attention-kernels flash cannot run here: {reason}; use --attention-kernels triton")
    return ("flash" if reason is None else "triton"), reason


def static_flex_attention(kernels: str) -> Callable:
    """The flex_attention the static-shape graph calls for resolved `kernels` ('triton' or 'flash')."""
    return flash_flex_attention if kernels == "flash" else flex_attention


__all__ = ["ATTENTION_KERNELS", "FLASH_HEAD_DIMS", "choose_attention_kernels", "flash_flex_attention", "flash_unavailable",
           "static_flex_attention"]
