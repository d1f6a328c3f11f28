"""A group-scaled 4-bit (e2m1, "FP4") codec for packed hidden states: torch reference.

Why: fp8 costs ~1 byte per value; real targets need <= 0.5 byte per value. One scale per token
per layer cannot carry 4-bit codes because a few massive-activation channels (values thousands of
times the median, Sun et al. 2024) set the scale and flatten everything else to zero. So, in the
style of MXFP4/NVFP4: one scale per group of `group_size` consecutive elements of a token's layer
row, and optionally the `outliers` largest-|x| channels per token per layer kept exactly in bf16.

Layout: `x` is bf16 `[T, L*H]`; columns `[l*H:(l+1)*H]` belong to layer `l`. Stored arrays:

* ``codes``  uint8 ``[T, L*H/2]``: e2m1 codes (sign << 3 | magnitude index), element ``2i`` in the
  low nibble and element ``2i+1`` in the high nibble of byte ``i``.
* ``scales`` one per group ``[T, L*H/G]``: ``e4m3`` (uint8) relative to ``row_scales`` float32
  ``[T, L]``, each a power of two (NVFP4's two levels: e4m3 alone cannot reach massive-activation magnitudes), or
  ``bf16`` bits, which needs no second level.
* with ``outliers = k > 0``: ``outlier_idx`` ``[T, L*k]`` (channel within its layer) and
  ``outlier_val`` bf16 bits ``[T, L*k]``. Indices are per token; massive-activation channels are
  fixed, so the rows repeat and zstd shrinks them (~2.7x measured on synthetic 5 x 4096).
* with ``sign_xor``, ``codes`` hold each layer's sign bit XOR the previous layer's at the same
  channel (`xor_layer_signs`; lossless, the dequantised values are the same bits).
* with ``per_layer``, the codes and ``scales`` are stored as one array per layer l, e.g.
  ``sign_xor_codes_l`` ``[T, H/2]`` and ``scales_l`` ``[T, H/G]`` (`Fp4Config.split_keys`), so
  zstd fits each layer its own Huffman table (lossless).

The 16-bit arrays are stored as uint16 (`fp4_arrays`); `quantize_fp4` returns them as int16 tensors
(torch has no uint16 arithmetic) holding the same bits, and `dequantize_fp4` takes either view.

Quantisation: outlier positions are zeroed in the body; ``s = amax(group) * fl(1/6)`` rounded to
the scale format (nearest; e4m3 relative to a power-of-two row scale); ``code = rne_e2m1(clamp(x /
s, -6, 6))``, decided by comparing |x| with the midpoints times s, so no division is involved and
every backend (eager, or compiled to Triton, whose float32 division is approximate) makes the
same codes. Dequantisation: ``bf16(E2M1[code] * s)``, then the outliers are written back bit for
bit.

Error bound (per element, enforced by the tests), outlier elements exact:

    |x_hat - x| <= FP4_RELATIVE_ERROR_BOUND * |x| + FP4_GROUP_ERROR_BOUND * amax(group)
                   + FP4_ROW_ERROR_BOUND * amax(layer row)

e2m1 carries 2 significant bits (<= 1/4 relative rounding for |x/s| >= 1, absolute 1/4 * s below);
a scale rounded down clips at most 6/(1 - 1/16) to 6 (<= 1/16 relative); bf16 output adds 2**-8.
The row term covers e4m3 scales that underflow to subnormals (tiny groups in a loud row).

Measured (bench/codec_study_fp4.py, bench/results/2026-11-30-cpu-fp4-study.json): e4m3 scales cost
half of bf16's bytes for ~0.3 points more relative error, hence the default; float16 would cost as
much as bf16 and underflow quiet groups below 6e-5.

What zstd makes of the codes (bench/fp4_size.py, bench/results/2026-12-01-cpu-fp4-size.json): no
more than their order-0 entropy, ~3.85-3.95 bits a code. On homogeneous channels (a random-weight
Qwen3) that would save 1.3%, under the 1/64 zstd's faster levels need to store a block compressed,
so the codes stay 10,240 bytes/token at 5 x 4096 and the layout ~10,620; no Blosc setting fast
enough to use saves more than 0.4%. Storing signs relative to the previous layer (``sign_xor``)
brings it to ~10,100, and one array per layer (``per_layer``) to ~9,920.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dflash_cache.errors import UserError, compile_failure
from dflash_cache.store.codecs import dispatch
from dflash_cache.store.codecs.base import ArraySpec, FeatureCodec, check_bf16, zstd_chain

__all__ = [
    "E2M1_GRID",
    "FP4_LAYOUT",
    "FP4_GROUP_ERROR_BOUND",
    "FP4_RELATIVE_ERROR_BOUND",
    "FP4_ROW_ERROR_BOUND",
    "Fp4Codec",
    "Fp4Config",
    "dequantize_fp4",
    "fp4_arrays",
    "fp4_error_bound",
    "pack_nibbles",
    "quantize_fp4",
    "quantize_fp4_layout",
    "unpack_nibbles",
    "unxor_layer_signs",
    "xor_layer_signs",
]

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
SCALE_FORMATS = ("e4m3", "bf16")

FP4_RELATIVE_ERROR_BOUND: float = 0.25 + 2.0**-7
FP4_GROUP_ERROR_BOUND: float = 0.25 / E2M1_MAX * (1.0 + 2.0**-3)
FP4_ROW_ERROR_BOUND: float = 2.0**-7 / E4M3_MAX  # the row scale, a power of two, is up to 2x the least


@dataclass(frozen=True, slots=True)
class Fp4Config:
    """How to quantise: elements per scale, the scale's format, bf16 outlier channels per layer,
    whether each layer's code signs are stored XOR the previous layer's (`xor_layer_signs`), and
    whether the codes and the group scales are stored as one array per layer (`split_keys`)."""

    group_size: int = 16
    scale_format: str = "e4m3"
    outliers: int = 0
    sign_xor: bool = False
    per_layer: bool = False

    def check(self, hidden_size: int) -> None:
        """Refuse shapes the layout cannot represent (raise ValueError)."""
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 2 or g % 2 or hidden_size % g:
            raise ValueError(
                f"fp4: group_size must be an even divisor of hidden size {hidden_size}, got {g!r}"
            )
        if self.scale_format not in SCALE_FORMATS:
            raise ValueError(f"fp4: scale_format must be one of {SCALE_FORMATS}, got {self.scale_format!r}")
        k = self.outliers
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= hidden_size or hidden_size > 32767:
            raise ValueError(f"fp4: outliers must be in [0, {hidden_size}] (hidden size <= 32767), got {k!r}")
        for flag in ("sign_xor", "per_layer"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"fp4: {flag} must be a bool, got {getattr(self, flag)!r}")

    @property
    def codes_key(self) -> str:
        """The codes' array name: sign-XOR codes have their own, so a reader of one layout never
        decodes the other's codes (a cache records only the codec's name)."""
        return "sign_xor_codes" if self.sign_xor else "codes"

    @property
    def description(self) -> str:
        """The layout in a few words, e.g. 'g32 e4m3 top-8 sign-xor per-layer'."""
        flags = [name for name, on in (("sign-xor", self.sign_xor), ("per-layer", self.per_layer)) if on]
        return " ".join([f"g{self.group_size}", self.scale_format, f"top-{self.outliers}", *flags])

    def split_keys(self, key: str, n_layers: int) -> list[str]:
        """Stored names of the codes (`codes_key`) or the group `scales`: the name itself, or with
        `per_layer` one array per layer, `{key}_{l}`. Why per layer: zstd fits one Huffman table to
        a block, and layers differ (the first keeps its raw signs, later ones XOR signs that agree
        64-84% of the time), so a table per layer takes 1.8% off the random-weight Qwen3's codes
        and 10% off its scales (bench/fp4_size.py). The names differ from the joined ones, so a
        reader of one layout never takes the other's arrays."""
        return [f"{key}_{layer}" for layer in range(n_layers)] if self.per_layer else [key]


# What `--codec fp4` stores: the study's best size/error trade-off on features with massive
# activations (README, "4-bit study"), with sign-XOR codes (lossless, 5% smaller on a random-weight
# Qwen3's features: bench/fp4_size.py) and one array per layer. The manifest records this layout's
# `description` (`codec_layout`), and a reader refuses a cache of another; a new layout also takes
# array names of its own, so no reader ever decodes another layout's arrays.
FP4_LAYOUT = Fp4Config(group_size=32, scale_format="e4m3", outliers=8, sign_xor=True, per_layer=True)


def fp4_arrays(cfg: Fp4Config, n_layers: int, hidden_size: int) -> dict[str, ArraySpec]:
    """The per-token arrays the codec stores, as `FeatureCodec.arrays` declares them."""
    cfg.check(hidden_size)
    width = n_layers * hidden_size
    # Shuffle choices measured (bench/codec_study_fp4.py, bench/fp4_size.py): codes and e4m3 scales
    # are single bytes of near-uniform 4-bit fields, so bit-shuffle only hurts (zstd's literal coder
    # takes the codes to their byte entropy or leaves them raw); outlier indices repeat token to
    # token and compress best unshuffled; bf16 values byte-shuffled.
    parts = n_layers if cfg.per_layer else 1
    codes = ArraySpec(np.dtype(np.uint8), width // 2 // parts, tuple(zstd_chain(1, shuffle="noshuffle")))
    specs = dict.fromkeys(cfg.split_keys(cfg.codes_key, n_layers), codes)
    n_groups = width // cfg.group_size // parts
    if cfg.scale_format == "e4m3":
        scales = ArraySpec(np.dtype(np.uint8), n_groups, tuple(zstd_chain(1, shuffle="noshuffle")))
    else:
        scales = ArraySpec(np.dtype(np.uint16), n_groups, tuple(zstd_chain(2)))
    specs.update(dict.fromkeys(cfg.split_keys("scales", n_layers), scales))
    if cfg.scale_format == "e4m3":
        specs["row_scales"] = ArraySpec(np.dtype(np.float32), n_layers, tuple(zstd_chain(4)))
    if cfg.outliers:
        k = n_layers * cfg.outliers
        specs["outlier_idx"] = ArraySpec(np.dtype(np.uint16), k, tuple(zstd_chain(2, shuffle="noshuffle")))
        specs["outlier_val"] = ArraySpec(np.dtype(np.uint16), k, tuple(zstd_chain(2)))
    return specs


# ----------------------------------------------------------------------------------------------
# e2m1 and packing


def _grid(device: torch.device) -> torch.Tensor:
    """float32 value of each 4-bit code (sign << 3 | index)."""
    g = torch.tensor(E2M1_GRID, dtype=torch.float32, device=device)
    return torch.cat([g, -g])


E2M1_MIDPOINTS = tuple((lo + hi) / 2 for lo, hi in itertools.pairwise(E2M1_GRID))


def _e2m1_codes(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float32 `x` and its scale `s` (broadcast; 0 = the group is stored as zeros) -> uint8 e2m1
    codes of x / s, rounded to nearest, ties to the even code, |x / s| > 6 to 6.

    Without a division: the magnitude index counts the midpoints m with m * s < |x| (a tie,
    |x| == m * s, goes up when that makes the index even). Products and comparisons are exactly
    rounded on every backend, where float32 division is not (Triton's is approximate), so eager
    and compiled code make the same codes. One pass per midpoint keeps eager memory at a byte per
    element."""
    a = x.abs()
    idx = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, mid in enumerate(E2M1_MIDPOINTS):
        threshold = s * mid  # exact: mid has 3 significant bits
        idx += (a > threshold).to(torch.uint8)
        if i % 2:  # a tie between codes i and i + 1 goes to the even one, i + 1
            idx += (a == threshold).to(torch.uint8)
    sign = (x < 0) | ((x == 0) & torch.signbit(x))
    codes = idx | (sign.to(torch.uint8) << 3)
    return torch.where(s > 0, codes, torch.zeros_like(codes))


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [T, W] (W even, values < 16) -> [T, W/2]: even position low nibble, odd high."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def xor_layer_signs(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [T, L, H] -> each layer's sign bit XOR the previous layer's at the same channel
    (layer 0 as is). Lossless; why: a residual stream keeps a channel's sign from one captured
    layer to the next (64-84% of channels on the tiny target and on a random-weight Qwen3), so the
    stored sign is mostly 0 and zstd codes the nibbles 5-6% smaller (bench/fp4_size.py)."""
    out = codes.clone()
    out[:, 1:] ^= codes[:, :-1] & 8
    return out


def unxor_layer_signs(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of `xor_layer_signs`: a prefix XOR of the sign bits over layers."""
    signs = ((codes >> 3).cumsum(dim=1) & 1).to(codes.dtype)
    return (codes & 7) | (signs << 3)


# ----------------------------------------------------------------------------------------------
# encode / decode


def _check_x(x: torch.Tensor, n_layers: int, cfg: Fp4Config) -> int:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"fp4: x must be a 2-D bfloat16 tensor [T, L*H], got {getattr(x, 'dtype', type(x))}")
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1 or x.shape[1] % n_layers:
        raise ValueError(f"fp4: width {x.shape[1]} is not a multiple of n_layers={n_layers!r}")
    h = x.shape[1] // n_layers
    cfg.check(h)
    return h


def _outliers(xf: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k |x| channels per token and layer of xf [T, L, H]: (indices int64, values) [T, L, k]."""
    idx = xf.abs().topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    return idx, xf.gather(-1, idx)


def _group_scales(amax: torch.Tensor, cfg: Fp4Config) -> dict[str, torch.Tensor]:
    """Group amax float32 [T, L, n] -> stored scale arrays (and 'decoded': float32 [T, L, n]).

    No division (see `_e2m1_codes`): s = amax * fl(1/6), and the row scale is a power of two, the
    smallest with s / row <= 448 for every group of the row, so s / row is a multiplication by a
    power of two, exact."""
    s = amax * _ONE_SIXTH
    if cfg.scale_format == "bf16":
        sb = s.to(torch.bfloat16)
        return {"scales": sb.view(torch.int16), "decoded": sb.float()}
    row, inverse = _row_scales(amax.amax(dim=-1))
    s8 = (s * inverse.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return {"scales": s8.view(torch.uint8), "row_scales": row, "decoded": s8.float() * row.unsqueeze(-1)}


_ONE_SIXTH = 1.0 / E2M1_MAX
# 6 * 448 = 2688 = 1.3125 * 2**11: amax / 2688 <= 2**(E - 11) iff amax's mantissa is <= 1.3125.
_ROW_MANTISSA = int(0.3125 * 2**23)
_ROW_EXPONENT_SHIFT = 11


def _row_scales(amax_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(2**k, 2**-k) float32 with 2**k the smallest power of two >= amax_row / (6 * 448) (1 for an
    all-zero row), built from amax_row's exponent and mantissa bits: integer operations, exact
    everywhere."""
    bits = amax_row.contiguous().view(torch.int32)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    biased = exponent - _ROW_EXPONENT_SHIFT + (mantissa > _ROW_MANTISSA).to(torch.int32)
    biased = torch.where(amax_row > 0, biased.clamp(1, 253), torch.full_like(biased, 127))
    return (biased << 23).view(torch.float32), ((254 - biased) << 23).view(torch.float32)


def _decoded_scales(arrays: dict[str, torch.Tensor], t: int, n_layers: int, cfg: Fp4Config) -> torch.Tensor:
    sc = _joined(arrays, cfg.split_keys("scales", n_layers))
    if cfg.scale_format == "bf16":
        return sc.view(torch.bfloat16).float().reshape(t, n_layers, -1)
    row = arrays["row_scales"].reshape(t, n_layers, 1)
    return sc.view(torch.float8_e4m3fn).float().reshape(t, n_layers, -1) * row


def quantize_fp4(x: torch.Tensor, n_layers: int, cfg: Fp4Config) -> dict[str, torch.Tensor]:
    """bf16 [T, L*H] -> the arrays of `fp4_arrays`, on x's device (bf16/index bits as int16)."""
    h = _check_x(x, n_layers, cfg)
    t = x.shape[0]
    xf = x.float().reshape(t, n_layers, h)
    out: dict[str, torch.Tensor] = {}
    if cfg.outliers:
        idx, val = _outliers(xf, cfg.outliers)
        xf = xf.scatter(-1, idx, 0.0)
        out["outlier_idx"] = idx.to(torch.int16).reshape(t, -1)
        out["outlier_val"] = val.to(torch.bfloat16).view(torch.int16).reshape(t, -1)
    groups = xf.reshape(t, n_layers, h // cfg.group_size, cfg.group_size)
    sc = _group_scales(groups.abs().amax(dim=-1), cfg)
    codes = _e2m1_codes(groups, sc.pop("decoded").unsqueeze(-1)).reshape(t, n_layers, h)
    if cfg.sign_xor:
        codes = xor_layer_signs(codes)
    packed = pack_nibbles(codes.reshape(t, n_layers * h)).reshape(t, n_layers, -1)
    out.update(_split(packed, cfg.split_keys(cfg.codes_key, n_layers)))
    out.update(_split(sc.pop("scales").reshape(t, n_layers, -1), cfg.split_keys("scales", n_layers)))
    out.update({k: v.reshape(t, -1).contiguous() for k, v in sc.items()})
    return out


def _split(per_layer: torch.Tensor, keys: list[str]) -> dict[str, torch.Tensor]:
    """[T, L, C] -> {key: [T, L*C]} for one key, or {key_l: layer l's [T, C]} for one key per layer."""
    t = per_layer.shape[0]
    if len(keys) == 1:
        return {keys[0]: per_layer.reshape(t, -1).contiguous()}
    return {key: per_layer[:, layer].contiguous() for layer, key in enumerate(keys)}


def _joined(arrays: dict[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
    """Inverse of `_split`: [T, L*C]."""
    return arrays[keys[0]] if len(keys) == 1 else torch.cat([arrays[key] for key in keys], dim=1)


def _quantize_layout(x: torch.Tensor, n_layers: int) -> dict[str, torch.Tensor]:
    return quantize_fp4(x, n_layers, FP4_LAYOUT)


@functools.cache
def _compiled_quantize_layout() -> Callable[[torch.Tensor, int], dict[str, torch.Tensor]]:
    # Only the token count varies in a run (marked dynamic per call); the layer count and width stay
    # static, which inductor needs to split rows into groups (symbolic widths fail to compile).
    return torch.compile(_quantize_layout)


def quantize_fp4_layout(x: torch.Tensor, n_layers: int) -> dict[str, torch.Tensor]:
    """`quantize_fp4` with `FP4_LAYOUT`, what `--codec fp4` runs: on a GPU compiled into a few
    fused kernels (eager it is ~20 passes over the features, time the target's forward waits for;
    the stored arrays are tested equal to eager's on the GPU), eager elsewhere (`dispatch` decides).
    A compiler that cannot build kernels here ends the run with one line naming the way out."""
    if not dispatch.fp4_encode_compiled(x):
        return _quantize_layout(x, n_layers)
    torch._dynamo.maybe_mark_dynamic(x, 0)
    try:
        return _compiled_quantize_layout()(x, n_layers)
    # torch._dynamo imports its submodule exc without naming it, so type checkers miss it
    except torch._dynamo.exc.BackendCompilerFailed as e:  # pyright: ignore[reportAttributeAccessIssue]
        raise UserError(f"--codec fp4: torch.compile could not build the quantisation kernels here "
                        f"({compile_failure(e)}); set TORCH_COMPILE_DISABLE=1 to quantise "
                        "eagerly (slower), or use --codec fp8") from e


def dequantize_fp4(arrays: dict[str, torch.Tensor], n_layers: int, cfg: Fp4Config) -> torch.Tensor:
    """The arrays of `quantize_fp4` (any device; unsigned or signed bit views) -> bf16 [T, L*H]."""
    codes = unpack_nibbles(_joined(arrays, cfg.split_keys(cfg.codes_key, n_layers)).view(torch.uint8))
    t, width = codes.shape
    h = width // n_layers
    cfg.check(h)
    if cfg.sign_xor:
        codes = unxor_layer_signs(codes.reshape(t, n_layers, h)).reshape(t, width)
    s = _decoded_scales(arrays, t, n_layers, cfg)
    vals = _grid(codes.device)[codes.long()].reshape(t, n_layers, -1, cfg.group_size)
    x = (vals * s.unsqueeze(-1)).to(torch.bfloat16).reshape(t, n_layers, h)
    if cfg.outliers:
        idx = arrays["outlier_idx"].view(torch.int16).long().reshape(t, n_layers, -1)
        val = arrays["outlier_val"].view(torch.int16).view(torch.bfloat16).reshape(t, n_layers, -1)
        x = x.scatter(-1, idx, val)
    return x.reshape(t, width)


def fp4_error_bound(x: torch.Tensor, n_layers: int, cfg: Fp4Config) -> torch.Tensor:
    """Per-element bound on |x_hat - x| (float32, x's shape); 0 is not claimed for outliers."""
    h = _check_x(x, n_layers, cfg)
    t = x.shape[0]
    xf = x.float().reshape(t, n_layers, h)
    if cfg.outliers:
        xf = xf.scatter(-1, _outliers(xf, cfg.outliers)[0], 0.0)
    g = xf.reshape(t, n_layers, -1, cfg.group_size)
    bound = (
        FP4_RELATIVE_ERROR_BOUND * g.abs()
        + FP4_GROUP_ERROR_BOUND * g.abs().amax(dim=-1, keepdim=True)
        + FP4_ROW_ERROR_BOUND * xf.abs().amax(dim=-1)[..., None, None]
    )
    return bound.reshape(t, n_layers * h)


# ----------------------------------------------------------------------------------------------
# the codec


@dataclass(frozen=True, slots=True)
class Fp4Codec(FeatureCodec):
    """e2m1 in groups with outlier channels in bf16, the fixed `FP4_LAYOUT` (read when called, so
    a test may store another layout)."""

    @property
    def layout(self) -> str:
        return FP4_LAYOUT.description

    def arrays(self, n_layers: int, hidden_size: int) -> dict[str, ArraySpec]:
        return fp4_arrays(FP4_LAYOUT, n_layers, hidden_size)

    def check(self, hidden_size: int) -> None:
        try:
            FP4_LAYOUT.check(hidden_size)
        except ValueError as e:
            raise UserError(f"--codec fp4 cannot store this target's features ({e}); use --codec fp8") from None

    def stored_problem(self, key: str, values: np.ndarray, hidden_size: int) -> str | None:
        # Outlier channel indices must lie inside a layer: on a GPU, one past it in the scatter that
        # decodes them would be a device-side assert, not an error naming the segment.
        if key != "outlier_idx" or values.size == 0:
            return None
        top = int(values.view(np.uint16).max())
        return None if top < hidden_size else f"outlier channel {top} is outside the hidden size {hidden_size}"

    def encode(self, features: torch.Tensor, n_layers: int) -> dict[str, torch.Tensor]:
        check_bf16(features)
        return quantize_fp4_layout(features, n_layers)

    def decode(self, arrays: dict[str, torch.Tensor], n_layers: int) -> torch.Tensor:
        return dequantize_fp4(arrays, n_layers, FP4_LAYOUT)
