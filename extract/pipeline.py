"""The overlapped extraction pipeline of one rank.

    reader thread    dataset rows -> forward inputs: padded ids, mask, gather index (host; pinned on
                     CUDA), and the packed host batch the segment stores
    main thread      H2D -> cut target forward with packing hooks -> codec encode (fp8 on GPU)
                     -> D2H into pinned buffers on a side stream (no host sync)
    writer threads   wait for the copy's event -> compress + write the segment -> commit
                     (`dflash_cache.store.writer.commit_segment`, as the live tee does)

Stages are joined by bounded queues (the reader's queue, a semaphore on in-flight segments), so
memory stays bounded and a slow stage back-pressures the ones before it. The main thread never
waits on the GPU: only writer threads synchronise, each on its own batch's event.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dflash_cache.data.dataset import Row, TokenizedDataset
from dflash_cache.producer import Producer
from dflash_cache.profiler import StageProfiler
from dflash_cache.store.batch import HostBatch
from dflash_cache.store.codecs import ArraySpec, get_codec
from dflash_cache.store.plan import PlannedBatch
from dflash_cache.store.segments import SegmentRecord
from dflash_cache.store.writer import commit_segment, disk_error
from dflash_cache.target.capture import ForwardInputs, HiddenStateCapture

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExtractBatch:
    """A planned batch read from the dataset: laid out for the forward, and packed for its segment."""

    planned: PlannedBatch
    forward: ForwardInputs
    packed: HostBatch


def layout_batch(planned: PlannedBatch, rows: list[Row], pin: bool) -> ExtractBatch:
    ids = [r.input_ids for r in rows]
    return ExtractBatch(planned, ForwardInputs.of_rows(ids, pin),
                        HostBatch.pack(ids, [r.loss_mask for r in rows], planned.rows))


_TORCH_DTYPES = {np.dtype(np.uint16): torch.int16, np.dtype(np.uint8): torch.uint8,
                 np.dtype(np.float32): torch.float32}


class PinnedSlots:
    """A fixed set of pinned host buffers for the device-to-host copies, allocated once.

    Pinning gigabytes (cudaHostAlloc) takes long enough to stall the forward thread, so it is
    done up front rather than per batch; a slot returns to the pool when its segment is written.
    """

    def __init__(self, specs: dict[str, ArraySpec], rows: int, count: int) -> None:
        self.rows = rows
        self._free: queue.Queue = queue.Queue()
        for _ in range(count):
            self._free.put({k: torch.empty((rows, spec.columns), dtype=_TORCH_DTYPES[spec.dtype], pin_memory=True)
                            for k, spec in specs.items()})

    def acquire(self) -> dict[str, torch.Tensor]:
        return self._free.get()

    def release(self, slot: dict[str, torch.Tensor]) -> None:
        self._free.put(slot)


def read_batches(dataset: TokenizedDataset, batches: list[PlannedBatch], *, unit_rows: int, max_len: int | None,
                 overlong: str, pin: bool, profiler: StageProfiler) -> Iterator[ExtractBatch]:
    """Planned batches laid out in order (on the reader thread); one unit's rows are cached at a time."""
    unit, rows_by_index = -1, {}
    for planned in batches:
        with profiler.span("loader.read_rows"):
            if planned.unit != unit:
                unit = planned.unit
                start = unit * unit_rows
                stop = min(dataset.num_rows, start + unit_rows)
                rows = dataset.read_rows(start, stop, max_len=max_len, overlong=overlong)
                rows_by_index = {r.index: r for r in rows}
            host = layout_batch(planned, [rows_by_index[int(i)] for i in planned.rows], pin)
        yield host


@dataclass
class RankResult:
    segments: int
    tokens: int
    seconds: float
    drain_seconds: float  # from the last forward's submission to the last commit


class RankExtractor:
    """Runs one rank's share of the plan on one device."""

    def __init__(self, *, root: Path | str, dataset: TokenizedDataset, model: torch.nn.Module, layer_ids: list[int],
                 codec: str, device: torch.device, rank: int, writers: int, prefetch: int,
                 unit_rows: int, max_len: int | None, overlong: str, profiler: StageProfiler,
                 progress: bool, writes: bool = True) -> None:
        self.root, self.dataset, self.device, self.rank = root, dataset, device, rank
        self.writes = writes  # False: a tensor-parallel rank that only takes part in the forwards
        self.capture = HiddenStateCapture(model, layer_ids)
        self.n_layers = len(layer_ids)
        self.codec = get_codec(codec)
        self.specs = self.codec.arrays(self.n_layers, self.capture.hidden_size)
        self.writers, self.prefetch, self.unit_rows = writers, prefetch, unit_rows
        self.max_len, self.overlong = max_len, overlong
        self.profiler, self.progress = profiler, progress
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._slots: PinnedSlots | None = None

    def prepare(self, batches: list[PlannedBatch]) -> None:
        """Pin host buffers for the largest of `batches`, one per segment that may be in flight
        (run() does this itself; call it first to keep the pinning out of a timed run)."""
        need = max((b.num_tokens for b in batches), default=0)
        if self.cuda and need and (self._slots is None or self._slots.rows < need):
            t0 = time.perf_counter()
            self._slots = None
            self._slots = PinnedSlots(self.specs, need, self.writers + 2)
            log.info("pinned %d host buffers of %d tokens in %.1fs", self.writers + 2, need, time.perf_counter() - t0)

    def _pinned(self) -> PinnedSlots:
        """The pinned host buffers of a CUDA rank's copies, which `prepare` made."""
        if self._slots is None:
            raise RuntimeError("RankExtractor: no pinned host buffers; prepare() makes them before a CUDA forward")
        return self._slots

    def run(self, batches: list[PlannedBatch]) -> RankResult:
        total = sum(b.num_tokens for b in batches)
        t0 = time.perf_counter()
        if self.writes:
            self.prepare(batches)
        bar = tqdm(total=total, unit="tok", unit_scale=True, dynamic_ncols=True, smoothing=0.1,
                   desc=f"extract rank {self.rank}", disable=not self.progress)
        reader = Producer(functools.partial(read_batches, self.dataset, batches, unit_rows=self.unit_rows,
                                            max_len=self.max_len, overlong=self.overlong, pin=self.cuda,
                                            profiler=self.profiler),
                          depth=self.prefetch, name="dflash-reader")
        in_flight = threading.BoundedSemaphore(self.writers + 2)
        futures: list[Future] = []  # in flight; finished ones are dropped as they are checked
        submitted = 0
        bar_lock = threading.Lock()

        def done(fut: Future, n_tokens: int, pending: tuple | None) -> None:
            in_flight.release()
            if fut.cancelled():
                if pending is not None:  # a dropped write's pinned buffer goes back to the pool
                    self._pinned().release(pending[1])
            elif fut.exception() is None:
                with bar_lock:
                    bar.update(n_tokens)

        pool = ThreadPoolExecutor(self.writers, thread_name_prefix="dflash-writer")
        try:
            for host in reader:
                if not self.writes:
                    self.capture(*host.forward.to(self.device))
                    continue
                self._raise_first_error(futures)
                job = self._forward(host)
                in_flight.acquire()
                fut = pool.submit(self._write, host, *job)
                fut.add_done_callback(lambda f, n=host.planned.num_tokens, p=job[1]: done(f, n, p))
                futures.append(fut)
                submitted += 1
                self.profiler.add_tokens(host.planned.num_tokens)
                self.profiler.maybe_report()
            t_drain = time.perf_counter()
            for fut in futures:
                fut.result()
        except OSError as e:
            raise disk_error(self.root, e) from None
        finally:
            reader.close()
            # On a stop (Ctrl-C) or an error the segments still queued are dropped, and the ones
            # being written finish: committed whole, so a rerun resumes after them. (Shutting the
            # pool down after the loop, as a `with` block does, wrote every queued one first.)
            pool.shutdown(wait=True, cancel_futures=True)
            bar.close()
        self.profiler.maybe_report(force=True)
        end = time.perf_counter()
        return RankResult(segments=submitted, tokens=total, seconds=end - t0, drain_seconds=end - t_drain)

    @staticmethod
    def _raise_first_error(futures: list[Future]) -> None:
        while futures and futures[0].done():
            futures.pop(0).result()  # raises the writer's exception, if any

    def _forward(self, host: ExtractBatch) -> tuple[dict[str, torch.Tensor], tuple | None]:
        """Enqueue H2D, forward, pack, encode and D2H; returns host arrays and, on CUDA, the copy's
        event and the pinned slot holding them."""
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        with self.profiler.device_span("target.h2d", stream):
            inputs = host.forward.to(self.device)
        with self.profiler.device_span("target.model_forward", stream):
            features = self.capture(*inputs)
        with self.profiler.device_span("target.encode", stream):
            encoded = self.codec.encode(features, self.n_layers)
        copy_stream = self.copy_stream  # None exactly when not on CUDA
        if copy_stream is None:  # fresh tensors per batch: nothing reuses them, no copy needed
            return encoded, None
        ready = torch.cuda.Event()
        ready.record(stream)
        slot = self._pinned().acquire()
        out: dict[str, torch.Tensor] = {}
        copy_stream.wait_event(ready)
        with torch.cuda.stream(copy_stream), self.profiler.device_span("target.d2h", copy_stream):
            for k, v in encoded.items():
                v.record_stream(copy_stream)  # keep the allocator off it until the copy is done
                out[k] = slot[k][: v.shape[0]]
                out[k].copy_(v, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(copy_stream)
        return out, (copied, slot)

    def _write(self, host: ExtractBatch, arrays: dict[str, torch.Tensor], pending: tuple | None) -> SegmentRecord:
        if pending is None:
            return self._write_segment(host, arrays)
        copied, slot = pending
        try:
            with self.profiler.span("writer.wait_d2h"):
                copied.synchronize()
            return self._write_segment(host, arrays)
        finally:
            self._pinned().release(slot)

    def _write_segment(self, host: ExtractBatch, arrays: dict[str, torch.Tensor]) -> SegmentRecord:
        with self.profiler.span("writer.compress_write_commit"):
            return commit_segment(self.root, host.planned, host.packed, arrays, specs=self.specs, rank=self.rank)
