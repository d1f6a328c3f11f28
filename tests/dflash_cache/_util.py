"""Helpers shared by the store-layer tests: synthetic manifests and segments, damage tools."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dflash_cache.codecs import get_codec, to_stored_numpy
from dflash_cache.manifest import Manifest, PlanParams, TargetIdentity, write_manifest
from dflash_cache.segments import COMMITS_DIR, SegmentRecord, write_segment

VOCAB = 1000


def make_manifest(codec: str = "bf16", *, layer_ids=(1, 3), hidden_size: int = 32, num_segments: int = 1,
                  num_samples: int = 3, num_tokens: int = 60) -> Manifest:
    return Manifest(
        target=TargetIdentity(name="synthetic", model_type="qwen3", config_hash="abc123", dtype="bfloat16",
                              num_hidden_layers=4, hidden_size=hidden_size, vocab_size=VOCAB),
        layer_ids=tuple(layer_ids),
        hidden_size=hidden_size,
        codec=codec,
        dataset_fingerprint="f" * 64,
        dataset_description="synthetic",
        plan=PlanParams(unit_rows=64, token_budget=2048, max_rows=16, bucket_bounds=(0, 770), max_len=None,
                        overlong="truncate", num_rows=num_samples, num_units=1, num_segments=num_segments,
                        num_samples=num_samples, num_tokens=num_tokens),
    )


def bf16_features(num_tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    """Random normal bf16 with outliers, exact zeros and negative zeros mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, width, generator=g)
    flat = x.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)
    flat[idx[:7]] = torch.tensor([300.0, -1234.5, 65504.0, -2.0e4, 1e-30, -1e-30, 3.0e38])
    flat[idx[7:20]] = 0.0
    flat[idx[20:33]] = -0.0
    return x.to(torch.bfloat16)


def write_synthetic_segment(root: Path, manifest: Manifest, *, unit: int = 0, batch: int = 0,
                            lengths=(17, 25, 18), first_id: int = 0, seed: int = 0,
                            features: torch.Tensor | None = None) -> tuple[SegmentRecord, dict]:
    """Write one segment through the codec's encode + write_segment; returns the record and inputs."""
    lengths = np.asarray(lengths, dtype=np.int64)
    t = int(lengths.sum())
    codec = get_codec(manifest.codec)
    rng = np.random.default_rng(seed)
    if features is None:
        features = bf16_features(t, manifest.feature_width, seed)
    arrays = to_stored_numpy(codec.encode(features, manifest.n_layers))
    input_ids = rng.integers(0, VOCAB, size=t).astype(np.int32)
    loss_mask = (rng.random(t) < 0.6).astype(np.uint8)
    sample_ids = np.arange(first_id, first_id + len(lengths), dtype=np.int64)
    rec = write_segment(
        root, unit=unit, batch=batch, bucket=0, rank=0, feature_arrays=arrays,
        feature_specs=codec.arrays(manifest.n_layers, manifest.hidden_size), input_ids=input_ids,
        loss_mask=loss_mask, lengths=lengths, sample_ids=sample_ids,
    )
    inputs = {"features": features, "input_ids": input_ids, "loss_mask": loss_mask, "lengths": lengths,
              "sample_ids": sample_ids, "stored": arrays}
    return rec, inputs


def synthetic_cache(root: Path, codec: str = "bf16", *, segments: int = 1, **kw) -> tuple[Manifest, list]:
    """A cache root with a manifest and `segments` committed synthetic segments (3 samples each)."""
    (root / COMMITS_DIR).mkdir(parents=True, exist_ok=True)
    m = make_manifest(codec, num_segments=segments, num_samples=3 * segments, num_tokens=60 * segments, **kw)
    write_manifest(root, m)
    out = [write_synthetic_segment(root, m, batch=b, first_id=10 * b, seed=b) for b in range(segments)]
    return m, out


def flip_byte(path: Path, pos: int | None = None) -> int:
    data = bytearray(path.read_bytes())
    pos = len(data) // 2 if pos is None else pos
    data[pos] ^= 0xFF
    path.write_bytes(bytes(data))
    return pos
