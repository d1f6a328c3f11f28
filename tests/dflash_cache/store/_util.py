"""Helpers shared by the store-layer tests: synthetic manifests and segments, damage tools."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import numpy as np
import torch

from dflash_cache.store.batch import HostBatch, cu_seqlens_of
from dflash_cache.store.codecs import get_codec, to_stored_numpy
from dflash_cache.store.layout import COMMITS_DIR, SEGMENTS_DIR, segment_name
from dflash_cache.store.manifest import Manifest, PlanParams, TargetIdentity, write_manifest
from dflash_cache.store.plan import PlannedBatch
from dflash_cache.store.segments import SegmentRecord
from dflash_cache.store.writer import commit_segment

VOCAB = 1000


def make_manifest(codec: str = "bf16", *, layer_ids=(1, 3), hidden_size: int = 32, num_segments: int = 1,
                  num_samples: int = 3, num_tokens: int = 60) -> Manifest:
    return Manifest(
        target=TargetIdentity(name="synthetic", model_type="qwen3", config_hash="abc123", dtype="bfloat16",
                              num_hidden_layers=4, hidden_size=hidden_size, vocab_size=VOCAB),
        layer_ids=tuple(layer_ids),
        hidden_size=hidden_size,
        codec=codec,
        codec_layout=get_codec(codec).layout,
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
    """Commit one segment of random tokens through the codec's encode + commit_segment; returns the
    record and inputs."""
    lengths = np.asarray(lengths, dtype=np.int64)
    t = int(lengths.sum())
    codec = get_codec(manifest.codec)
    rng = np.random.default_rng(seed)
    if features is None:
        features = bf16_features(t, manifest.feature_width, seed)
    encoded = codec.encode(features, manifest.n_layers)
    sample_ids = np.arange(first_id, first_id + len(lengths), dtype=np.int64)
    packed = HostBatch(input_ids=rng.integers(0, VOCAB, size=t).astype(np.int32),
                       loss_mask=(rng.random(t) < 0.6).astype(np.uint8), cu_seqlens=cu_seqlens_of(lengths),
                       sample_ids=sample_ids)
    planned = PlannedBatch(unit=unit, batch=batch, bucket=0, rows=sample_ids, lengths=lengths.astype(np.int32))
    rec = commit_segment(root, planned, packed, encoded,
                         specs=codec.arrays(manifest.n_layers, manifest.hidden_size), rank=0)
    inputs = {"features": features, "input_ids": packed.input_ids, "loss_mask": packed.loss_mask, "lengths": lengths,
              "sample_ids": sample_ids, "stored": to_stored_numpy(encoded), "packed": packed}
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


def many_segments(root: Path, count: int, *, distinct: int = 8, hidden_size: int = 4) -> list[str]:
    """A cache of `count` tiny committed segments, fast: `distinct` are written by commit_segment
    with their own random data, the rest hard-link a written one's files under their own name and
    commit a record of their own (their sample ids differ; their stored data repeats). Good for
    exercising the reader's bookkeeping of many segments; not a cache for `verify`."""
    (root / COMMITS_DIR).mkdir(parents=True, exist_ok=True)
    m = make_manifest("bf16", layer_ids=(1,), hidden_size=hidden_size, num_segments=count,
                      num_samples=2 * count, num_tokens=10 * count)
    write_manifest(root, m)
    written = [write_synthetic_segment(root, m, batch=b, lengths=(4, 6), first_id=2 * b, seed=b)[0]
               for b in range(distinct)]
    names = [rec.name for rec in written]
    for k in range(distinct, count):
        src, (unit, batch) = written[k % distinct], divmod(k, 100)
        name = segment_name(unit, batch)
        for rel in src.files:
            dst = root / SEGMENTS_DIR / name / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(root / SEGMENTS_DIR / src.name / rel, dst)
        record = src.to_json() | {"name": name, "unit": unit, "batch": batch, "sample_ids": [2 * k, 2 * k + 1]}
        (root / COMMITS_DIR / f"{name}.json").write_text(json.dumps(record))
        names.append(name)
    return names


def preempt_in(module: ModuleType) -> Callable:
    """A `sys.settrace` function that yields the GIL before every bytecode run in `module`: a
    race on its shared state then shows within a few hundred calls instead of once in a while."""

    def each_opcode(frame: FrameType, event: str, arg: Any) -> Callable:
        time.sleep(0)
        return each_opcode

    def on_call(frame: FrameType, event: str, arg: Any) -> Callable | None:
        if frame.f_code.co_filename != module.__file__:
            return None
        frame.f_trace_opcodes = True
        return each_opcode

    return on_call


def finishes_within(seconds: float, fn: Callable[[], Any], fifo: Path | None = None) -> tuple[bool, Any]:
    """(finished, result or exception) of `fn` run in a daemon thread for at most `seconds`. If it
    is still blocked then, every open waiting on `fifo` (zarr's I/O threads included, which the
    interpreter would wait for at exit) is released by opening the FIFO's other end, so a failing
    test never hangs the run."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as e:  # handed to the test to assert on
            box.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    finished = not thread.is_alive()
    deadline = time.monotonic() + seconds
    while fifo is not None and thread.is_alive() and time.monotonic() < deadline:
        with contextlib.suppress(OSError):  # ENXIO: nobody is waiting on the FIFO right now
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(0.05)
    return finished, box[0] if finished and box else None
