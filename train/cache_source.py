"""The cache source: packed training batches streamed from an extraction cache.

Batches are planned from the cache index alone (`dflash_cache.train.epoch_plan`), no feature data.

Reading runs in background threads `prefetch` batches ahead (zarr decompression releases the
GIL); each batch is packed there (`HostBatch.pack`, as extraction packs it) straight into pinned
memory, then copied to the device on a side stream, where fp8 is dequantised (Triton on CUDA), and
made into a `PackedBatch` as the live source makes its own. The consumer's stream waits on an
event, never the host.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_cache.store.batch import HostBatch, PackedBatch, concatenate
from dflash_cache.store.codecs import numpy_to_torch
from dflash_cache.store.manifest import Manifest, TargetIdentity
from dflash_cache.store.reader import CacheReader
from dflash_cache.target.identity import TargetRecord
from dflash_cache.train.epoch_plan import Position, SampleTable, SourceConfig
from dflash_cache.train.place import Place
from dflash_cache.train.source import PlannedSource

log = logging.getLogger(__name__)


class CacheSource(PlannedSource):
    """Yields (Position after this batch, PackedBatch on `place.device`) for one rank (a `Source`).
    With `config.max_batches` (a held-out evaluation's share), nothing past them is read ahead."""

    def __init__(self, reader: CacheReader, config: SourceConfig, place: Place) -> None:
        self.reader = reader
        index = reader.index
        table, order = SampleTable.sorted(*(index.column(c).to_numpy()
                                            for c in ("sample_id", "length", "supervised", "bucket")))
        super().__init__(table, config, place)
        self._segment = index.column("segment").to_numpy(zero_copy_only=False)[order]
        self._offset = index.column("row_offset").to_numpy()[order]
        self._feature_keys = list(reader.codec.arrays(reader.manifest.n_layers, reader.manifest.hidden_size))
        self.cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self.cuda else None

    def identity(self) -> dict[str, str]:
        """What a resumed run must find again: the same samples in the same stored form."""
        m = self.reader.manifest
        return {"kind": "cache", "samples": self.table.digest(), "dataset": m.dataset_fingerprint, "codec": m.codec}

    def close(self) -> None:
        """Nothing to release: reader threads live only while `iterate` runs."""

    def iterate(self, start: Position,
                epochs: int | None = None) -> Generator[tuple[Position, PackedBatch], None, None]:
        """From `start` on, epoch after epoch (forever if `epochs` is None). Reads run `prefetch`
        batches ahead across epoch boundaries too, so a new epoch starts without a bubble."""
        planned = self.planned(start, epochs)
        pending: deque[tuple[Position, Future]] = deque()
        with ThreadPoolExecutor(self.config.read_threads, thread_name_prefix="dflash-cache-read") as pool:
            def refill() -> None:
                while len(pending) < self.config.prefetch and (item := next(planned, None)) is not None:
                    position, rows = item
                    pending.append((position, pool.submit(self._read_host, rows)))

            refill()
            while pending:
                position, fut = pending.popleft()
                refill()
                yield position, self._to_device(fut.result())

    def _read_host(self, rows: np.ndarray) -> _HostRead:
        """Read one batch's samples (stored dtypes) and lay them end to end, on a reader thread."""
        buffers = _HostBuffers(pin=self.cuda)
        with self.profiler.span("cache.read"):
            parts: dict[str, list[np.ndarray]] = {k: [] for k in ("input_ids", "loss_mask", *self._feature_keys)}
            for r in rows:
                name, lo = str(self._segment[r]), int(self._offset[r])
                hi = lo + int(self.table.lengths[r])
                for key in parts:
                    parts[key].append(self.reader.read_array(name, key, lo, hi, check_unchanged=False))
            for name in {str(self._segment[r]) for r in rows}:  # once a segment, after its last read
                self.reader.check_unchanged(name)
            packed = HostBatch.pack(parts.pop("input_ids"), parts.pop("loss_mask"), self.table.sample_ids[rows],
                                    allocate=buffers)
            for key, arrays in parts.items():
                concatenate(key, arrays, allocate=buffers)
        return _HostRead(packed, buffers.tensors)

    def _to_device(self, read: _HostRead) -> PackedBatch:
        keys = self._feature_keys
        if self.cuda:
            stream = self._copy_stream
            with torch.cuda.stream(stream), self.profiler.device_span("loader.h2d", stream):
                dev = {k: t.to(self.device, non_blocking=True) for k, t in read.tensors.items()}
            with torch.cuda.stream(stream), self.profiler.device_span("cache.decode", stream):
                features = self.reader.codec.decode({k: dev[k] for k in keys}, self.reader.manifest.n_layers)
            done = torch.cuda.Event()
            done.record(stream)
            torch.cuda.current_stream(self.device).wait_event(done)
            for t in (*dev.values(), features):
                t.record_stream(torch.cuda.current_stream(self.device))
        else:
            dev = read.tensors
            with self.profiler.span("cache.decode"):
                features = self.reader.codec.decode({k: dev[k] for k in keys}, self.reader.manifest.n_layers)
        return PackedBatch.from_host(read.packed, features, tokens=dev)


@dataclass
class _HostBuffers:
    """Allocates a batch's host arrays as (pinned) torch tensors, kept for the copy to the device:
    reading writes each byte once, straight where the copy starts from."""

    pin: bool
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __call__(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        like = numpy_to_torch(name, np.empty(0, dtype))  # uint16 bits are held as int16
        self.tensors[name] = torch.empty(shape, dtype=like.dtype, pin_memory=self.pin)
        return self.tensors[name].numpy().view(dtype)


@dataclass(frozen=True)
class _HostRead:
    """One batch read on a reader thread: its packed tokens and, by array name, the host tensors
    (tokens and stored features) that `packed` views."""

    packed: HostBatch
    tensors: dict[str, torch.Tensor]


def check_manifest(manifest: Manifest, *, target: TargetIdentity, layer_ids: tuple[int, ...], hidden_size: int) -> None:
    """Refuse a cache made for another target than `target` (the --target: its architecture, then its
    weights, whose outputs the features are) or for other layers than the drafter reads, naming both
    targets and the first field that differs."""
    record = TargetRecord(manifest.target, "cache manifest", "extracted from",
                          "extract a cache for this target and layers, or pass the matching --target")
    record.check(target, weights=True)
    for name, have, want in (("layer_ids", tuple(manifest.layer_ids), tuple(layer_ids)),
                             ("hidden_size", manifest.hidden_size, hidden_size)):
        if have != want:
            raise record.refusal(name, have, target.name, want)
