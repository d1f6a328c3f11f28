"""The lossless codecs, `none` and `bf16`: the features' bf16 bits as they are.

* ``none``: raw bf16 bits, checksummed only.
* ``bf16``: byte shuffle + zstd-1 through Blosc (bf16 exponents compress, mantissas don't).

Encoding and decoding are bit views, no kernel on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dflash_cache.store.codecs.base import ArraySpec, FeatureCodec, check_bf16


@dataclass(frozen=True, slots=True)
class Bf16Codec(FeatureCodec):
    """Raw bf16 bits, stored as uint16 under `compressors`."""

    compressors: tuple = ()

    def arrays(self, n_layers: int, hidden_size: int) -> dict[str, ArraySpec]:
        return {"features": ArraySpec(np.dtype(np.uint16), n_layers * hidden_size, self.compressors)}

    def encode(self, features: torch.Tensor, n_layers: int) -> dict[str, torch.Tensor]:
        check_bf16(features)
        return {"features": features.view(torch.int16)}

    def decode(self, arrays: dict[str, torch.Tensor], n_layers: int) -> torch.Tensor:
        feats = arrays["features"]
        if feats.dtype in (torch.int16, torch.uint16):
            return feats.view(torch.bfloat16)
        raise ValueError(f"bf16 features must be stored as 16-bit integers, got {feats.dtype}")
