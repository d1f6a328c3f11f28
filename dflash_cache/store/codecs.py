"""Feature codecs: how a packed bf16 feature matrix [T, n_layers * H] is stored.

Each codec says which arrays it stores (name, dtype, columns), how to turn device features into
those arrays (`encode`, run on the GPU before the device-to-host copy so PCIe and CPUs move the
small form) and back (`decode`, run on the training device), and which zarr codec chain
compresses each array. Every chain ends with a CRC32C so a flipped byte raises on read.

* ``none``: raw bf16 bits, checksummed only.
* ``bf16``: lossless; byte shuffle + zstd-1 through Blosc (bf16 exponents compress, mantissas don't).
* ``fp8``: e4m3 with one float32 scale per token per layer (see `dflash_cache.store.fp8`), then zstd.
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
    """A way to store features; `name` is what the manifest records and the CLI accepts."""

    name: str
    lossless: bool

    def arrays(self, n_layers: int, hidden_size: int) -> dict[str, ArraySpec]:
        width = n_layers * hidden_size
        if self.name == "none":
            return {"features": ArraySpec(np.dtype(np.uint16), width, (Crc32cCodec(),))}
        if self.name == "bf16":
            return {"features": ArraySpec(np.dtype(np.uint16), width, tuple(zstd_chain(2)))}
        # fp8: the bytes are already dense; bit-shuffling groups the e4m3 sign/exponent bits.
        return {
            "features": ArraySpec(np.dtype(np.uint8), width, tuple(zstd_chain(1, shuffle="bitshuffle"))),
            "scales": ArraySpec(np.dtype(np.float32), n_layers, tuple(zstd_chain(4))),
        }

    def encode(self, features: torch.Tensor, n_layers: int) -> dict[str, torch.Tensor]:
        """bf16 [T, W] on any device -> the stored arrays, same device, storage dtypes."""
        if features.dtype != torch.bfloat16:
            raise ValueError(f"features must be bfloat16, got {features.dtype}")
        if self.name in ("none", "bf16"):
            return {"features": features.view(torch.int16)}
        from dflash_cache.store.fp8 import quantize_fp8

        q, scales = quantize_fp8(features, n_layers)
        return {"features": q, "scales": scales}

    def decode(self, arrays: dict[str, torch.Tensor], n_layers: int) -> torch.Tensor:
        """The stored arrays (as torch tensors on the target device) -> bf16 [T, W]."""
        feats = arrays["features"]
        if self.name in ("none", "bf16"):
            return feats.view(torch.bfloat16) if feats.dtype == torch.int16 else _u16_to_bf16(feats)
        from dflash_cache.store.fp8 import dequantize_fp8

        return dequantize_fp8(feats, arrays["scales"], n_layers)


def _u16_to_bf16(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint16:
        return t.view(torch.bfloat16)
    raise ValueError(f"bf16 features must be stored as 16-bit integers, got {t.dtype}")


CODECS: dict[str, FeatureCodec] = {
    "none": FeatureCodec("none", lossless=True),
    "bf16": FeatureCodec("bf16", lossless=True),
    "fp8": FeatureCodec("fp8", lossless=False),
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
