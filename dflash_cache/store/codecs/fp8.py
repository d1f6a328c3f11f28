"""The `fp8` codec: per-token, per-layer scaled float8 e4m3 for packed hidden states.

Layout: `x` is bf16 `[T, L*H]`; columns `[l*H:(l+1)*H]` belong to layer `l`. Quantisation stores

    scale[t, l] = amax(|x[t, l*H:(l+1)*H]|) / 448        (float32; 1.0 where that is 0)
    q[t, c]     = e4m3_bits(round_to_nearest_even(x[t, c] / scale[t, c // H]))   (uint8)

and dequantisation returns `bf16(float32(e4m3(q)) * scale)`. Every step is an IEEE float32 operation
with round-to-nearest-even, so the torch path (CPU reference) and the Triton kernels (CUDA, or CPU
under the Triton interpreter) produce the same bytes. The float -> e4m3 and float32 -> bf16 roundings
are done on integer bit patterns inside the kernels: that is exact on GPU and in the interpreter alike
(triton 3.9's interpreter truncates fp32 -> bf16 and rounds fp32 -> fp8 with ties away from zero, so
`.to(tl.float8e4nv)` is not bit-exact there), and it matches `torch.Tensor.to(torch.float8_e4m3fn)`
bit for bit, including its NaN for magnitudes >= 464 (which the scaling never produces).

Error bound (documented and enforced by the tests), per element, with `amax` the row-layer amax:

    |x_hat - x| <= FP8_RELATIVE_ERROR_BOUND * |x| + FP8_AMAX_ERROR_BOUND * amax

* e4m3 normals (|x/scale| >= 2**-6) carry 4 significant bits: rounding error <= 2**-4 * |x/scale|.
* e4m3 subnormals are spaced 2**-9 apart: absolute error <= 2**-10 in scaled units, i.e.
  2**-10 * scale = 2**-10 / 448 * amax (about 2.2e-6 * amax) in input units.
* the bf16 output rounding adds <= 2**-8 relative; float32 division/multiplication adds a few 2**-24.
  Summed: 2**-4 + 2**-8 + 2**-12 + O(2**-24) relative and 2**-10/448 * (1 + 2**-8 + O(2**-24)) * amax.

The exported constants round those up a little: relative 2**-4 + 2**-8 + 2**-11 (~0.0669) and
2**-10 / 448 * (1 + 2**-6) per unit of amax. The bound holds whenever the scale is a normal float32
(amax >= 448 * 2**-126, about 5.3e-36); for even tinier layers the error is still below ~1e-40.
On standard normal data the relative Frobenius error ||x_hat - x|| / ||x|| is about 2.65%
(measured with H = 4096; the worst per-element relative error seen is ~0.062).

Neither path synchronises with the host. Triton is imported lazily: importing this module works
without it (e.g. macOS), `quantize_fp8` / `dequantize_fp8` then use torch, and the `*_triton`
functions raise a RuntimeError. In triton 3.9 `TRITON_INTERPRET` is read when `@triton.jit`
decorates a function, which for triton.language's own helpers happens at `import triton`: the
variable must be set before triton is imported. The kernels here are built on first use; a
variable changed after triton's import is detected and refused with a RuntimeError.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dflash_cache.store.codecs import dispatch
from dflash_cache.store.codecs.base import ArraySpec, FeatureCodec, check_bf16, zstd_chain
from dflash_cache.triton_support import check_triton_device, on_device_of, require_triton, triton_available

__all__ = [
    "E4M3_MAX",
    "Fp8Codec",
    "FP8_AMAX_ERROR_BOUND",
    "FP8_RELATIVE_ERROR_BOUND",
    "dequantize_fp8",
    "dequantize_fp8_torch",
    "dequantize_fp8_triton",
    "fp8_error_bound",
    "quantize_fp8",
    "quantize_fp8_torch",
    "quantize_fp8_triton",
    "triton_available",
]

E4M3_MAX = 448.0
FP8_RELATIVE_ERROR_BOUND: float = 2.0**-4 + 2.0**-8 + 2.0**-11
FP8_AMAX_ERROR_BOUND: float = 2.0**-10 / E4M3_MAX * (1.0 + 2.0**-6)


def fp8_error_bound(x: torch.Tensor, n_layers: int) -> torch.Tensor:
    """Per-element bound on |x_hat - x| (float32, same shape as `x`)."""
    xf = x.float()
    t = xf.shape[0]
    amax = xf.reshape(t, n_layers, -1).abs().amax(dim=-1, keepdim=True)
    bound = FP8_RELATIVE_ERROR_BOUND * xf.abs().reshape(t, n_layers, -1) + FP8_AMAX_ERROR_BOUND * amax
    return bound.reshape(x.shape)


# ----------------------------------------------------------------------------------------------
# validation


def _check_n_layers(n_layers: int) -> None:
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"fp8: n_layers must be a positive int, got {n_layers!r}")


def _check_quantize_args(x: torch.Tensor, n_layers: int) -> int:
    _check_n_layers(n_layers)
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"fp8: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"fp8: x must be bfloat16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"fp8: x must be 2-D [T, L*H], got shape {tuple(x.shape)}")
    width = x.shape[1]
    if width == 0 or width % n_layers:
        raise ValueError(f"fp8: x width {width} is not a positive multiple of n_layers={n_layers}")
    return width // n_layers


def _check_dequantize_args(
    q: torch.Tensor, scales: torch.Tensor, n_layers: int, out: torch.Tensor | None
) -> int:
    _check_n_layers(n_layers)
    if not isinstance(q, torch.Tensor) or not isinstance(scales, torch.Tensor):
        raise ValueError("fp8: q and scales must be torch.Tensors")
    if q.dtype != torch.uint8:
        raise ValueError(f"fp8: q must be uint8, got {q.dtype}")
    if scales.dtype != torch.float32:
        raise ValueError(f"fp8: scales must be float32, got {scales.dtype}")
    if q.dim() != 2:
        raise ValueError(f"fp8: q must be 2-D [T, L*H], got shape {tuple(q.shape)}")
    t, width = q.shape
    if width == 0 or width % n_layers:
        raise ValueError(f"fp8: q width {width} is not a positive multiple of n_layers={n_layers}")
    if tuple(scales.shape) != (t, n_layers):
        raise ValueError(f"fp8: scales must have shape {(t, n_layers)}, got {tuple(scales.shape)}")
    if scales.device != q.device:
        raise ValueError(f"fp8: q is on {q.device} but scales on {scales.device}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16:
            raise ValueError(f"fp8: out must be a bfloat16 tensor, got {getattr(out, 'dtype', type(out))}")
        if tuple(out.shape) != (t, width):
            raise ValueError(f"fp8: out must have shape {(t, width)}, got {tuple(out.shape)}")
        if out.device != q.device:
            raise ValueError(f"fp8: q is on {q.device} but out on {out.device}")
    return width // n_layers


# ----------------------------------------------------------------------------------------------
# torch reference path


def quantize_fp8_torch(x: torch.Tensor, n_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [T, L*H] -> (q uint8 [T, L*H], scales float32 [T, L]) in plain torch (any device)."""
    h = _check_quantize_args(x, n_layers)
    t = x.shape[0]
    xf = x.float().reshape(t, n_layers, h)
    amax = xf.abs().amax(dim=-1)
    # A tensor divisor: torch on CUDA divides by a Python scalar via its reciprocal, which is not
    # the correctly rounded quotient the kernels (tl.div_rn) and torch on CPU compute.
    scale = amax / torch.full_like(amax, E4M3_MAX)
    # `scale > 0` rather than `amax > 0`: also covers a scale flushed to zero.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = xf / scale.unsqueeze(-1)
    q = y.to(torch.float8_e4m3fn).view(torch.uint8).reshape(t, n_layers * h)
    return q, scale.contiguous()


def dequantize_fp8_torch(
    q: torch.Tensor, scales: torch.Tensor, n_layers: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """(q uint8 [T, L*H], scales float32 [T, L]) -> bf16 [T, L*H] in plain torch (any device)."""
    h = _check_dequantize_args(q, scales, n_layers, out)
    t = q.shape[0]
    qf = q.reshape(t, n_layers, h).view(torch.float8_e4m3fn).float()
    res = (qf * scales.unsqueeze(-1)).to(torch.bfloat16).reshape(t, n_layers * h)
    if out is None:
        return res
    out.copy_(res)
    return out


# ----------------------------------------------------------------------------------------------
# Triton path

if TYPE_CHECKING:  # as the kernels see it once built (typed as None, each tl.* in them would be an error)
    import triton.language as tl
else:
    tl = None  # triton.language, bound on first kernel build (the import is lazy)
_WHO = "fp8"


def _kernels():
    interpret = require_triton(_WHO, "use quantize_fp8/dequantize_fp8 (they fall back to torch) or the *_torch "
                                     "functions")
    return _build_kernels(interpret)


@functools.cache
def _build_kernels(interpret: bool):
    # `interpret` only keys the cache: triton reads TRITON_INTERPRET when @triton.jit runs below
    # (and require_triton has checked it agrees with how triton.language was set up).
    # Kernels resolve names through this module's globals (neither compiled Triton nor the
    # interpreter sees closure variables), hence the `global` binding of `tl`.
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def _quantize_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        T,
        H,
        stride_xt,
        stride_xc,
        stride_qt,
        stride_st,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        pid_t = tl.program_id(0)
        layer = tl.program_id(1)
        rows = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        rmask = rows < T
        mask = rmask[:, None] & (cols < H)[None, :]
        ccols = (layer * H + cols).to(tl.int64)
        xb = tl.load(
            x_ptr + rows[:, None] * stride_xt + ccols[None, :] * stride_xc,
            mask=mask,
            other=0.0,
        )
        # bf16 -> fp32 by bits (exact)
        xf = (xb.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        amax = tl.max(tl.abs(xf), axis=1)
        scale = tl.div_rn(amax, 448.0)
        scale = tl.where(scale > 0, scale, 1.0)
        y = tl.div_rn(xf, scale[:, None])
        # Round-to-nearest-even float32 -> e4m3fn on the bit pattern; the same result as torch's
        # `.to(torch.float8_e4m3fn)` (c10 fp8_e4m3fn_from_fp32_value), NaN (0x7f) when |y| >= 464.
        bits = y.to(tl.uint32, bitcast=True)
        sign = (bits >> 31) << 7
        mag = bits & 0x7FFFFFFF
        exp = (mag >> 23).to(tl.int32) - 127
        # normal e4m3 (|y| >= 2**-6): keep 3 of 23 mantissa bits, the carry runs into the exponent
        norm = (mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20
        norm = tl.minimum(norm.to(tl.int32) - (120 << 3), 0x7F)
        # subnormal e4m3 (|y| < 2**-6): code = rne(|y| * 2**9) = rne(mant * 2**(exp - 14))
        mant = ((mag & 0x7FFFFF) | 0x800000).to(tl.int32)
        shift = tl.maximum(tl.minimum(14 - exp, 30), 1)
        sub = (mant + (1 << (shift - 1)) - 1 + ((mant >> shift) & 1)) >> shift
        code = tl.where(exp >= -6, norm, sub)
        q = (code.to(tl.uint32) | sign).to(tl.uint8)
        tl.store(q_ptr + rows[:, None] * stride_qt + ccols[None, :], q, mask=mask)
        tl.store(s_ptr + rows * stride_st + layer, scale, mask=rmask)

    @triton.jit
    def _dequantize_kernel(
        q_ptr,
        s_ptr,
        o_ptr,
        T,
        H,
        stride_qt,
        stride_qc,
        stride_st,
        stride_sl,
        stride_ot,
        stride_oc,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        pid_t = tl.program_id(0)
        layer = tl.program_id(1)
        rows = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        rmask = rows < T
        mask = rmask[:, None] & (cols < H)[None, :]
        ccols = (layer * H + cols).to(tl.int64)
        c = tl.load(q_ptr + rows[:, None] * stride_qt + ccols[None, :] * stride_qc, mask=mask, other=0)
        scale = tl.load(s_ptr + rows * stride_st + layer * stride_sl, mask=rmask, other=1.0)
        # e4m3fn bits -> fp32 (exact)
        c = c.to(tl.uint32)
        csign = (c >> 7) << 31
        ce = (c >> 3) & 0xF
        cm = c & 0x7
        normal = (((ce + 120) << 23) | (cm << 20) | csign).to(tl.float32, bitcast=True)
        subnormal = cm.to(tl.float32) * 0.001953125  # cm * 2**-9, exact
        # sign by bits: compiled `-x` is `0 - x`, which turns -0.0 into +0.0
        subnormal = (subnormal.to(tl.uint32, bitcast=True) | csign).to(tl.float32, bitcast=True)
        val = tl.where(ce != 0, normal, subnormal)
        val = tl.where((c & 0x7F) == 0x7F, float("nan"), val)  # e4m3fn NaN codes 0x7f / 0xff
        z = val * scale[:, None]
        # fp32 -> bf16, round to nearest even, by bits
        zb = z.to(tl.uint32, bitcast=True)
        zb = (zb + 0x7FFF + ((zb >> 16) & 1)) >> 16
        out = zb.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        tl.store(o_ptr + rows[:, None] * stride_ot + ccols[None, :] * stride_oc, out, mask=mask)

    return triton, _quantize_kernel, _dequantize_kernel


def _launch_config(t: int, h: int) -> tuple[int, int, int]:
    block_h = 1 << max(0, (h - 1).bit_length())
    block_t = max(1, min(16, 2048 // block_h))
    num_warps = 4 if block_t * block_h <= 2048 else 8 if block_t * block_h <= 8192 else 16
    return block_t, block_h, num_warps


def quantize_fp8_triton(x: torch.Tensor, n_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `quantize_fp8_torch` (CUDA, or CPU under TRITON_INTERPRET=1); same bytes."""
    h = _check_quantize_args(x, n_layers)
    _, qk, _ = _kernels()
    check_triton_device(x, _WHO)
    t = x.shape[0]
    q = torch.empty((t, n_layers * h), dtype=torch.uint8, device=x.device)
    scales = torch.empty((t, n_layers), dtype=torch.float32, device=x.device)
    if t == 0:
        return q, scales
    block_t, block_h, num_warps = _launch_config(t, h)
    grid = (-(-t // block_t), n_layers)
    with on_device_of(x):
        qk[grid](
            x,
            q,
            scales,
            t,
            h,
            x.stride(0),
            x.stride(1),
            q.stride(0),
            scales.stride(0),
            BLOCK_T=block_t,
            BLOCK_H=block_h,
            # a launch option, which triton's typing of kernel[grid] (the kernel's own signature) lacks
            num_warps=num_warps,  # pyright: ignore[reportCallIssue]
        )
    return q, scales


def dequantize_fp8_triton(
    q: torch.Tensor, scales: torch.Tensor, n_layers: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton version of `dequantize_fp8_torch` (CUDA, or CPU under TRITON_INTERPRET=1); same bytes."""
    h = _check_dequantize_args(q, scales, n_layers, out)
    _, _, dk = _kernels()
    check_triton_device(q, _WHO)
    t = q.shape[0]
    if out is None:
        out = torch.empty((t, n_layers * h), dtype=torch.bfloat16, device=q.device)
    if t == 0:
        return out
    block_t, block_h, num_warps = _launch_config(t, h)
    grid = (-(-t // block_t), n_layers)
    with on_device_of(q):
        dk[grid](
            q,
            scales,
            out,
            t,
            h,
            q.stride(0),
            q.stride(1),
            scales.stride(0),
            scales.stride(1),
            out.stride(0),
            out.stride(1),
            BLOCK_T=block_t,
            BLOCK_H=block_h,
            # a launch option, which triton's typing of kernel[grid] (the kernel's own signature) lacks
            num_warps=num_warps,  # pyright: ignore[reportCallIssue]
        )
    return out


# ----------------------------------------------------------------------------------------------
# dispatch


def quantize_fp8(x: torch.Tensor, n_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [T, L*H] -> (q uint8 [T, L*H], scales float32 [T, L]); Triton or torch (`dispatch`)."""
    _check_quantize_args(x, n_layers)
    if dispatch.fp8_runs_triton(x):
        return quantize_fp8_triton(x, n_layers)
    return quantize_fp8_torch(x, n_layers)


def dequantize_fp8(
    q: torch.Tensor, scales: torch.Tensor, n_layers: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """-> bf16 [T, L*H]; Triton or torch (`dispatch`). Writes into `out` if given (and returns it)."""
    _check_dequantize_args(q, scales, n_layers, out)
    if dispatch.fp8_runs_triton(q):
        return dequantize_fp8_triton(q, scales, n_layers, out)
    return dequantize_fp8_torch(q, scales, n_layers, out)


# ----------------------------------------------------------------------------------------------
# the codec


@dataclass(frozen=True, slots=True)
class Fp8Codec(FeatureCodec):
    """e4m3 with a float32 scale per token per layer, then zstd."""

    def arrays(self, n_layers: int, hidden_size: int) -> dict[str, ArraySpec]:
        # The bytes are already dense; bit-shuffling groups the e4m3 sign/exponent bits.
        return {
            "features": ArraySpec(np.dtype(np.uint8), n_layers * hidden_size, tuple(zstd_chain(1, shuffle="bitshuffle"))),
            "scales": ArraySpec(np.dtype(np.float32), n_layers, tuple(zstd_chain(4))),
        }

    def encode(self, features: torch.Tensor, n_layers: int) -> dict[str, torch.Tensor]:
        check_bf16(features)
        q, scales = quantize_fp8(features, n_layers)
        return {"features": q, "scales": scales}

    def decode(self, arrays: dict[str, torch.Tensor], n_layers: int) -> torch.Tensor:
        return dequantize_fp8(arrays["features"], arrays["scales"], n_layers)
