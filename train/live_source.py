"""The live source: the target runs next to the drafter and feeds it through a bounded queue.

The fallback when there is no cache. It plans exactly the batches a cache of the same dataset
would give (`dflash_cache.train.epoch_plan` over the same canonical sample table), and computes each batch's
features with the extraction code itself: rows are laid out by `dflash_cache.extract.pipeline.layout_batch`
and run through `dflash_cache.extract.target.HiddenStateCapture`, which packs every captured layer on the
forward's own stream. One worker thread per target device takes every n-th batch; the consumer
takes them back in order. A batch crosses to the drafter only with an event recorded after its
forward (and the device-to-device copy, when the devices differ), so the drafter's stream waits on
the GPU, never on the host, and never reads a tensor the forward may still be writing. A worker
that fails ends the run with its error; it cannot leave the trainer waiting.

`tee` optionally commits epoch 0's batches to a cache as they are made (`--write-cache`), so a run
can start live and continue offline.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from dflash_cache.errors import UserError
from dflash_cache.extract.capture import HiddenStateCapture
from dflash_cache.extract.dataset import DatasetScan, TokenizedDataset
from dflash_cache.extract.pipeline import layout_batch
from dflash_cache.extract.planning import buckets_of, plan_unit
from dflash_cache.profiler import StageProfiler
from dflash_cache.store.batch import HostLayout, PackedBatch, positions_from_cu_seqlens
from dflash_cache.store.plan import PlanConfig
from dflash_cache.train.epoch_plan import Position, SampleTable, SourceConfig, position_after

log = logging.getLogger(__name__)
DEFAULT_QUEUE_DEPTH = 60


def live_sample_table(scan: DatasetScan, bucket_bounds: tuple[int, ...]) -> SampleTable:
    """The sample table a cache of this dataset would hold: kept rows, their lengths and buckets."""
    rows = np.flatnonzero(scan.keep)
    lengths = scan.lengths[rows]
    table, _ = SampleTable.sorted(rows, lengths, scan.supervised[rows], buckets_of(lengths, bucket_bounds))
    return table


@dataclass
class _Made:
    index: int
    batch: PackedBatch
    ready: torch.cuda.Event | None


class _Failure:
    def __init__(self, device: torch.device, exc: BaseException) -> None:
        self.device, self.exc = device, exc


class LiveSource:
    """Yields (Position after this batch, PackedBatch on `device`), like CacheSource."""

    def __init__(self, *, dataset: TokenizedDataset, table: SampleTable, config: SourceConfig,
                 captures: list[HiddenStateCapture], target_devices: list[torch.device], device: torch.device,
                 max_len: int | None, overlong: str, forward_plan: PlanConfig | None = None,
                 queue_depth: int = DEFAULT_QUEUE_DEPTH, rank: int = 0,
                 world: int = 1, profiler: StageProfiler | None = None,
                 tee: Callable[[int, PackedBatch, torch.cuda.Event | None], None] | None = None) -> None:
        if len(captures) != len(target_devices) or not captures:
            raise ValueError("one capture per target device")
        self.dataset, self.table, self.config = dataset, table, config
        self.captures, self.target_devices, self.device = captures, target_devices, device
        self.max_len, self.overlong, self.queue_depth = max_len, overlong, queue_depth
        self.forward_plan = forward_plan or PlanConfig()
        self.rank, self.world = rank, world
        self.profiler = profiler or StageProfiler(None)
        self.tee = tee

    def epoch_batches(self, epoch: int, start: int = 0) -> list[np.ndarray]:
        return self.table.epoch(self.config, epoch, self.rank, self.world, start)

    def longest_sample(self) -> int:
        return int(self.table.lengths.max(initial=0))

    def identity(self) -> dict[str, str]:
        """What a resumed run must find again: the same samples of the same dataset."""
        return {"kind": "live", "samples": self.table.digest(), "dataset": self.dataset.fingerprint}

    def close(self) -> None:
        """Wait for the tee's writes and index the cache it made."""
        if self.tee is not None:
            self.tee.close()

    def batches_per_epoch(self) -> int:
        return len(self.epoch_batches(0))

    def iterate(self, start: Position, epochs: int | None = None) -> Iterator[tuple[Position, PackedBatch]]:
        epoch, first = start.epoch, start.batch
        while epochs is None or epoch < epochs:
            plan = self.epoch_batches(epoch, first)
            # Closed explicitly: a consumer that stops early must find the workers stopped and
            # joined, not still running forwards that the next source would race with.
            with contextlib.closing(self._run_epoch(plan)) as made_batches:
                for i, made in made_batches:
                    if made.ready is not None:
                        stream = torch.cuda.current_stream(self.device)
                        stream.wait_event(made.ready)
                        made.batch.features.record_stream(stream)
                    if self.tee is not None and epoch == 0:  # the batch's global index in the epoch
                        self.tee(first + i * self.world + self.rank, made.batch, made.ready)
                    yield position_after(epoch, first, i, self.world), made.batch
            epoch, first = epoch + 1, 0

    def _run_epoch(self, plan: list[np.ndarray]) -> Iterator[tuple[int, _Made]]:
        n = len(self.captures)
        jobs = list(range(len(plan)))
        queues = [queue.Queue(maxsize=max(1, self.queue_depth // n)) for _ in range(n)]
        stop = threading.Event()
        threads = [threading.Thread(target=self._work, args=(k, plan, jobs[k::n], queues[k], stop),
                                    name=f"dflash-target-{k}", daemon=True) for k in range(n)]
        for t in threads:
            t.start()
        try:
            for j, i in enumerate(jobs):
                item = self._take(queues[j % n], threads[j % n])
                if isinstance(item, _Failure):
                    raise UserError(f"target worker on {item.device} failed: {type(item.exc).__name__}: "
                                    f"{item.exc}") from item.exc
                yield i, item
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)

    @staticmethod
    def _take(q: queue.Queue, thread: threading.Thread):
        """The next item, or an error if the worker died without saying why (never a hang)."""
        while True:
            try:
                return q.get(timeout=1.0)
            except queue.Empty:
                if not thread.is_alive() and q.empty():
                    return _Failure(torch.device("cpu"), RuntimeError(f"{thread.name} exited unexpectedly"))

    def _work(self, k: int, plan: list[np.ndarray], jobs: list[int], out: queue.Queue, stop: threading.Event) -> None:
        device = self.target_devices[k]
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        try:
            for i in jobs:
                made = self._make(i, plan[i], self.captures[k], device, stream)
                while not stop.is_set():
                    try:
                        out.put(made, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as e:  # handed to the consumer, which raises it
            out.put(_Failure(device, e))

    def _make(self, i: int, positions: np.ndarray, capture: HiddenStateCapture, device: torch.device,
              stream: torch.cuda.Stream | None) -> _Made:
        sample_ids = self.table.sample_ids[positions]
        lengths = self.table.lengths[positions]
        with self.profiler.span("target.read_rows"):
            rows = [self.dataset.read_rows(int(r), int(r) + 1, max_len=self.max_len, overlong=self.overlong)[0]
                    for r in sample_ids]
        # The target runs the batch in forward batches planned exactly as extraction plans them
        # (length-sorted, under its token budget and row cap), so its memory stays bounded and, with
        # the same settings, each sample sees the same forward shapes as in a cache.
        forwards = plan_unit(0, 0, lengths, np.ones(len(rows), bool), self.forward_plan)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            parts, order = [], []
            for fb in forwards:
                host = layout_batch(fb, [rows[j] for j in fb.rows], pin=device.type == "cuda")
                with self.profiler.device_span("target.model_forward", stream):
                    parts.append(capture(host.input_ids.to(device, non_blocking=True),
                                         host.attention.to(device, non_blocking=True),
                                         host.gather.to(device, non_blocking=True)))
                order += [np.arange(offsets[j], offsets[j + 1]) for j in fb.rows]
            # token t of the training batch sits at place[t] of the concatenated forward outputs
            place = np.empty(int(offsets[-1]), dtype=np.int64)
            place[np.concatenate(order)] = np.arange(int(offsets[-1]))
            with self.profiler.device_span("target.pack_hidden", stream):
                features = torch.cat(parts).index_select(0, torch.from_numpy(place).to(device, non_blocking=True))
            if device != self.device:
                with self.profiler.device_span("target.to_drafter", stream):
                    features = features.to(self.device, non_blocking=True)
            ready = None
            if stream is not None:
                ready = torch.cuda.Event()
                ready.record(stream)
        cu = torch.from_numpy(offsets.astype(np.int64))
        total = int(offsets[-1])
        layout = HostLayout(input_ids=torch.from_numpy(np.concatenate([r.input_ids for r in rows]).astype(np.int64)),
                            loss_mask=torch.from_numpy(np.concatenate([r.loss_mask for r in rows]).astype(bool)),
                            cu_seqlens=cu)
        batch = PackedBatch(
            input_ids=layout.input_ids.to(self.device),
            loss_mask=layout.loss_mask.to(self.device),
            position_ids=positions_from_cu_seqlens(cu, total).to(self.device),
            cu_seqlens=cu.to(self.device),
            sample_ids=torch.from_numpy(sample_ids.astype(np.int64)).to(self.device),
            features=features,
            host=layout,
        )
        return _Made(i, batch, ready)
