"""Feature codecs: how a packed bf16 feature matrix [T, n_layers * H] is stored.

* ``none``: raw bf16 bits, checksummed only (`bf16`).
* ``bf16``: lossless; byte shuffle + zstd-1 through Blosc (`bf16`).
* ``fp8``: e4m3 with one float32 scale per token per layer, then zstd (`fp8`).
* ``fp4``: e2m1 codes with an e4m3 scale per 32 elements (relative to a power of two per token
  per layer) and each layer's 8 largest-|x| channels per token kept in bf16 (`FP4_LAYOUT`, see
  `fp4`): about half a byte per value, a quarter of `bf16`.

What every codec is made of is in `base`; which implementation the lossy codecs run on a GPU
(Triton kernels, torch.compile, eager torch) is chosen in `dispatch`. Imports flow one way:
`base` and `dispatch` <- each codec <- this registry.
"""

from __future__ import annotations

from dflash_cache.errors import UserError
from dflash_cache.store.codecs.base import (
    TOKEN_ARRAYS,
    ArraySpec,
    FeatureCodec,
    codec_names,
    crc_chain,
    numpy_to_torch,
    to_stored_numpy,
    token_spec,
    zstd_chain,
)
from dflash_cache.store.codecs.bf16 import Bf16Codec
from dflash_cache.store.codecs.fp4 import Fp4Codec
from dflash_cache.store.codecs.fp8 import Fp8Codec

__all__ = ["CODECS", "TOKEN_ARRAYS", "ArraySpec", "Bf16Codec", "FeatureCodec", "Fp4Codec", "Fp8Codec",
           "codec_names", "get_codec", "numpy_to_torch", "to_stored_numpy", "token_spec", "zstd_chain"]

CODECS: dict[str, FeatureCodec] = {
    "none": Bf16Codec("none", lossless=True, compressors=tuple(crc_chain())),
    "bf16": Bf16Codec("bf16", lossless=True, compressors=tuple(zstd_chain(2))),
    "fp8": Fp8Codec("fp8", lossless=False),
    "fp4": Fp4Codec("fp4", lossless=False),
}


def get_codec(name: str) -> FeatureCodec:
    try:
        return CODECS[name]
    except KeyError:
        raise UserError(f"unknown codec {name!r}; choose one of: {', '.join(CODECS)}") from None
