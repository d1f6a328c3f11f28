"""What every feature codec is made of: the stored-array spec, the compressor chains, the codec
base class, and the token arrays every segment stores next to the features.

A codec says which arrays it stores (name, dtype, columns), how to turn device features into
those arrays (`encode`, run on the GPU before the device-to-host copy so PCIe and CPUs move the
small form) and back (`decode`, run on the training device), and which zarr codec chain
compresses each array. Every chain ends with a CRC32C so a flipped byte raises on read.

This module imports no codec: each codec module builds on it, and the package's `__init__`
gathers the codecs into the registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from zarr.codecs import BloscCodec, Crc32cCodec

if TYPE_CHECKING:
    from zarr.codecs.blosc import Shuffle  # "noshuffle" | "shuffle" | "bitshuffle"

# Arrays every segment stores next to the features: name -> numpy dtype.
TOKEN_ARRAYS: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.uint8),
    "offsets": np.dtype(np.int64),
    "sample_ids": np.dtype(np.int64),
}


def zstd_chain(typesize: int, shuffle: Shuffle = "shuffle", clevel: int = 1) -> list:
    """Blosc(zstd) with the given shuffle, then a CRC32C over the compressed chunk."""
    return [BloscCodec(cname="zstd", clevel=clevel, shuffle=shuffle, typesize=typesize), Crc32cCodec()]


def crc_chain() -> list:
    """No compression, only the CRC32C every chain ends with."""
    return [Crc32cCodec()]


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
class FeatureCodec(ABC):
    """A way to store features; `name` is what the manifest records and the CLI accepts."""

    name: str
    lossless: bool

    @property
    def layout(self) -> str:
        """Which arrays the name stands for, recorded in the manifest: a reader refuses a cache of
        another layout in one line instead of calling its segments damaged. Empty for a codec
        whose stored arrays never changed."""
        return ""

    @abstractmethod
    def arrays(self, n_layers: int, hidden_size: int) -> dict[str, ArraySpec]:
        """The per-token arrays this codec stores for features of `n_layers` x `hidden_size`."""

    def check(self, hidden_size: int) -> None:
        """Refuse a target whose hidden size this codec cannot store (a UserError naming the fix);
        by default every size is fine."""
        return None

    def stored_problem(self, key: str, values: np.ndarray, hidden_size: int) -> str | None:
        """What is wrong with array `key` as read from a segment, if a checksum cannot catch it and
        it would make decoding fail; checked on the host, where it is cheap (None: nothing)."""
        return None

    @abstractmethod
    def encode(self, features: torch.Tensor, n_layers: int) -> dict[str, torch.Tensor]:
        """bf16 [T, W] on any device -> the stored arrays, same device, storage dtypes."""

    @abstractmethod
    def decode(self, arrays: dict[str, torch.Tensor], n_layers: int) -> torch.Tensor:
        """The stored arrays (as torch tensors on the target device) -> bf16 [T, W]."""


def check_bf16(features: torch.Tensor) -> None:
    """What every codec's `encode` takes: bf16 features (ValueError otherwise)."""
    if features.dtype != torch.bfloat16:
        raise ValueError(f"features must be bfloat16, got {features.dtype}")


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
