"""The cache format as README's "Reading a cache without dflash-cache" states it: a reader written
from that text alone, with zarr and numpy only, decodes every codec's features to the very bits
dflash-cache's own reader does."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import zarr

from dflash_cache.store.reader import CacheReader

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def e4m3_to_float32(b: np.ndarray) -> np.ndarray:
    """OCP e4m3fn bytes -> float32: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits."""
    b = b.astype(np.int32)
    sign = np.where(b & 0x80, -1.0, 1.0).astype(np.float32)
    exp, man = (b >> 3) & 0xF, (b & 7).astype(np.float32)
    normal = (1 + man / 8) * np.exp2(exp - 7, dtype=np.float32)
    subnormal = man / 8 * np.float32(2.0**-6)
    return (sign * np.where(exp == 0, subnormal, normal)).astype(np.float32)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), rounded to nearest, ties to even."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_float32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def decode(group: zarr.Group, codec: str, n_layers: int, hidden: int) -> np.ndarray:
    """A segment's features as bf16 bits [T, L*H], from the README's table and paragraphs only."""
    if codec in ("none", "bf16"):
        return group["features"][:]
    if codec == "fp8":
        q, scales = group["features"][:], group["scales"][:]
        return bf16_bits(e4m3_to_float32(q) * np.repeat(scales, hidden, axis=1))
    assert codec == "fp4"
    t = group["row_scales"].shape[0]
    out = np.empty((t, n_layers * hidden), dtype=np.uint16)
    sign = np.zeros((t, hidden), dtype=np.uint8)
    for layer in range(n_layers):
        packed = group[f"sign_xor_codes_{layer}"][:]
        codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(t, hidden)  # low nibble first
        sign ^= codes >> 3                                                          # prefix XOR over layers
        scale = e4m3_to_float32(group[f"scales_{layer}"][:]) * group["row_scales"][:, layer:layer + 1]
        values = np.where(sign == 1, -1.0, 1.0).astype(np.float32) * E2M1[codes & 7]
        out[:, layer * hidden:(layer + 1) * hidden] = bf16_bits(values * np.repeat(scale, 32, axis=1))
    idx, val = group["outlier_idx"][:].astype(np.int64), group["outlier_val"][:]
    k = idx.shape[1] // n_layers
    columns = idx + np.repeat(np.arange(n_layers) * hidden, k)[None, :]
    np.put_along_axis(out, columns, val, axis=1)  # the outliers overwrite what the codes gave
    return out


@pytest.mark.parametrize("codec", ["bf16", "fp8", "fp4"])
def test_a_reader_written_from_the_spec_decodes_the_same_bits(real_cache, codec):
    root = real_cache(codec)
    manifest = json.loads((root / "manifest.json").read_text())
    n_layers, hidden = len(manifest["layer_ids"]), manifest["hidden_size"]
    reader = CacheReader(root)
    checked = 0
    for path in sorted((root / "commits").glob("*.json")):
        record = json.loads(path.read_text())
        seg = root / "segments" / path.stem
        assert {rel: (seg / rel).stat().st_size for rel in record["files"]} == record["files"]
        group = zarr.open_group(str(seg), mode="r")
        ours = reader.decode_features(reader.read_segment(path.stem))
        theirs = decode(group, codec, n_layers, hidden)
        assert np.array_equal(theirs, ours.view(torch.int16).numpy().view(np.uint16)), path.stem
        assert np.isfinite(bf16_to_float32(theirs)).all()
        checked += 1
    assert checked == len(reader.records) > 0
