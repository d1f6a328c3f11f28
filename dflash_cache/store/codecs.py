"""Feature codecs: how a packed bf16 feature matrix [T, n_layers * H] is stored.

Each codec says which arrays it stores (name, dtype, columns), how to turn device features into
those arrays (`encode`, run on the GPU before the device-to-host copy so PCIe and CPUs move the
small form) and back (`decode`, run on the training device), and which zarr codec chain
compresses each array. Every chain ends with a CRC32C so a flipped byte raises on read.

* ``none``: raw bf16 bits, checksummed only.
* ``bf16``: lossless; byte shuffle + zstd-1 through Blosc (bf16 exponents compress, mantissas don't).
* ``fp8``: e4m3 with one float32 scale per token per layer (see `dflash_cache.store.fp8`), then zstd.
* ``fp4``: e2m1 codes with an e4m3 scale per 32 elements (relative to a power of two per token
  per layer) and each layer's 8 largest-|x| channels per token kept in bf16 (`FP4_LAYOUT`, see
  `dflash_cache.store.fp4`): about half a byte per value, a quarter of `bf16`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from zarr.codecs import BloscCodec, Crc32cCodec

from dflash_cache.errors import UserError

# Arrays every segment stores next to the features: name -> numpy dtype.
TOKEN_ARRAYS: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.uint8),
    "offsets": np.dtype(np.int64),
    "sample_ids": np.dtype(np.int64),
}


def zstd_chain(typesize: int, shuffle: str = "shuffle", clevel: int = 1) -> list:
    """Blosc(zstd) with the given shuffle, then a CRC32C over the compressed chunk."""
    return [BloscCodec(cname="zstd", clevel=clevel, shuffle=shuffle, typesize=typesize), Crc32cCodec()]


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """One stored per-token array of a codec: dtype and columns per token."""

    dtype: np.dtype
    columns: int
    compressors: tuple


def token_spec(key: str) -> ArraySpec:
    """How the writer stores token array `key` (one of TOKEN_ARRAYS): its dtype, zstd, a CRC32C."""
    dtype = TOKEN_ARRAYS[key]
    return ArraySpec(dtype, 1, tuple(zstd_chain(dtype.itemsize)))


def codec_names(codecs: tuple | list) -> list[str]:
    """The zarr v3 names of a codec chain, as its zarr.json lists them (a reader checks them)."""
    return [c.to_dict()["name"] for c in codecs]


@dataclass(frozen=True, slots=True)
class FeatureCodec:
    """A way to store features; `name` is what the manifest records and the CLI accepts. This base
    stores raw bf16 bits under `compressors` (the `none` and `bf16` codecs); the lossy codecs below
    override what they store."""

    name: str
    lossless: bool
    compressors: tuple = ()

    @property
    def layout(self) -> str:
        """Which arrays the name stands for, recorded in the manifest: a reader refuses a cache of
        another layout in one line instead of calling its segments damaged. Empty for a codec
        whose stored arrays never changed."""
        return ""

    def arrays(self, n_layers: int, hidden_size: int) -> dict[str, ArraySpec]:
        return {"features": ArraySpec(np.dtype(np.uint16), n_layers * hidden_size, self.compressors)}

    def check(self, hidden_size: int) -> None:
        """Refuse a target whose hidden size this codec cannot store (a UserError naming the fix)."""

    def stored_problem(self, key: str, values: np.ndarray, hidden_size: int) -> str | None:
        """What is wrong with array `key` as read from a segment, if a checksum cannot catch it and
        it would make decoding fail; checked on the host, where it is cheap (None: nothing)."""
        return None

    def encode(self, features: torch.Tensor, n_layers: int) -> dict[str, torch.Tensor]:
        """bf16 [T, W] on any device -> the stored arrays, same device, storage dtypes."""
        _check_bf16(features)
        return {"features": features.view(torch.int16)}

    def decode(self, arrays: dict[str, torch.Tensor], n_layers: int) -> torch.Tensor:
        """The stored arrays (as torch tensors on the target device) -> bf16 [T, W]."""
        feats = arrays["features"]
        return feats.view(torch.bfloat16) if feats.dtype == torch.int16 else _u16_to_bf16(feats)


@dataclass(frozen=True, slots=True)
class Fp8Codec(FeatureCodec):
    """e4m3 with a float32 scale per token per layer; Triton kernels on GPUs (`store.fp8`)."""

    def arrays(self, n_layers: int, hidden_size: int) -> dict[str, ArraySpec]:
        # The bytes are already dense; bit-shuffling groups the e4m3 sign/exponent bits.
        return {
            "features": ArraySpec(np.dtype(np.uint8), n_layers * hidden_size, tuple(zstd_chain(1, shuffle="bitshuffle"))),
            "scales": ArraySpec(np.dtype(np.float32), n_layers, tuple(zstd_chain(4))),
        }

    def encode(self, features: torch.Tensor, n_layers: int) -> dict[str, torch.Tensor]:
        from dflash_cache.store.fp8 import quantize_fp8

        _check_bf16(features)
        q, scales = quantize_fp8(features, n_layers)
        return {"features": q, "scales": scales}

    def decode(self, arrays: dict[str, torch.Tensor], n_layers: int) -> torch.Tensor:
        from dflash_cache.store.fp8 import dequantize_fp8

        return dequantize_fp8(arrays["features"], arrays["scales"], n_layers)


@dataclass(frozen=True, slots=True)
class Fp4Codec(FeatureCodec):
    """e2m1 in groups with outlier channels in bf16, the fixed `FP4_LAYOUT` (`store.fp4`)."""

    @property
    def layout(self) -> str:
        from dflash_cache.store.fp4 import FP4_LAYOUT

        return FP4_LAYOUT.description

    def arrays(self, n_layers: int, hidden_size: int) -> dict[str, ArraySpec]:
        from dflash_cache.store.fp4 import FP4_LAYOUT, fp4_arrays

        return fp4_arrays(FP4_LAYOUT, n_layers, hidden_size)

    def check(self, hidden_size: int) -> None:
        from dflash_cache.store.fp4 import FP4_LAYOUT

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
        from dflash_cache.store.fp4 import quantize_fp4_layout

        _check_bf16(features)
        return quantize_fp4_layout(features, n_layers)

    def decode(self, arrays: dict[str, torch.Tensor], n_layers: int) -> torch.Tensor:
        from dflash_cache.store.fp4 import FP4_LAYOUT, dequantize_fp4

        return dequantize_fp4(arrays, n_layers, FP4_LAYOUT)


def _check_bf16(features: torch.Tensor) -> None:
    if features.dtype != torch.bfloat16:
        raise ValueError(f"features must be bfloat16, got {features.dtype}")


def _u16_to_bf16(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint16:
        return t.view(torch.bfloat16)
    raise ValueError(f"bf16 features must be stored as 16-bit integers, got {t.dtype}")


CODECS: dict[str, FeatureCodec] = {
    "none": FeatureCodec("none", lossless=True, compressors=(Crc32cCodec(),)),
    "bf16": FeatureCodec("bf16", lossless=True, compressors=tuple(zstd_chain(2))),
    "fp8": Fp8Codec("fp8", lossless=False),
    "fp4": Fp4Codec("fp4", lossless=False),
}


def get_codec(name: str) -> FeatureCodec:
    try:
        return CODECS[name]
    except KeyError:
        raise UserError(f"unknown codec {name!r}; choose one of: {', '.join(CODECS)}") from None


def to_stored_numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Host tensors from `FeatureCodec.encode` as numpy arrays of the stored dtypes (int16 bits
    become uint16), without copying: what the segment writer takes."""
    out = {}
    for key, t in tensors.items():
        a = t.numpy()
        out[key] = a.view(np.uint16) if a.dtype == np.int16 else a
    return out


def numpy_to_torch(name: str, array: np.ndarray) -> torch.Tensor:
    """Wrap a stored numpy array as a torch tensor without copying (uint16 becomes int16 bits)."""
    if array.dtype == np.uint16:
        array = array.view(np.int16)
    return torch.from_numpy(array)
