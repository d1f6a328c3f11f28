"""The live source: the target runs next to the drafter and feeds it through a bounded queue.

The fallback when there is no cache. It plans exactly the batches a cache of the same dataset
would give (`dflash_cache.train.epoch_plan` over the same canonical sample table), and computes
each batch's features with the code extraction runs: rows are laid out by
`dflash_cache.target.capture.ForwardInputs` and run through
`dflash_cache.target.capture.HiddenStateCapture`, which packs every captured layer on the
forward's own stream. The tokens are packed into a `HostBatch` as extraction packs them, and the
batch is made from it as the cache source makes its own (`PackedBatch.from_host`).

One worker thread per target device takes every n-th batch; the consumer takes them back in
order. A batch crosses to the drafter only with an event recorded after its forward (and the
device-to-device copy, when the devices differ), so the drafter's stream waits on the GPU, never
on the host, and never reads a tensor the forward may still be writing. A worker that fails ends
the run with its error; it cannot leave the trainer waiting.

`tee` optionally commits epoch 0's batches to a cache as they are made (`--write-cache`), so a run
can start live and continue offline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_cache.data.dataset import DatasetScan, TokenizedDataset
from dflash_cache.data.planning import buckets_of, plan_unit
from dflash_cache.errors import UserError
from dflash_cache.producer import Producer
from dflash_cache.profiler import StageProfiler
from dflash_cache.store.batch import HostBatch, PackedBatch
from dflash_cache.store.plan import PlanConfig
from dflash_cache.target.capture import ForwardInputs, HiddenStateCapture
from dflash_cache.train.epoch_plan import Position, SampleTable, SourceConfig, position_after
from dflash_cache.train.place import Place
from dflash_cache.train.source import PlannedSource

log = logging.getLogger(__name__)
DEFAULT_QUEUE_DEPTH = 60


def live_sample_table(scan: DatasetScan, bucket_bounds: tuple[int, ...]) -> SampleTable:
    """The sample table a cache of this dataset would hold: kept rows, their lengths and buckets."""
    rows = np.flatnonzero(scan.keep)
    lengths = scan.lengths[rows]
    table, _ = SampleTable.sorted(rows, lengths, scan.supervised[rows], buckets_of(lengths, bucket_bounds))
    return table


@dataclass(frozen=True)
class LiveData:
    """The dataset a live run reads: its rows under `max_len` (`overlong` says what a longer one
    becomes), and the sample table a cache of it would hold, bucketed by `bucket_bounds`."""

    dataset: TokenizedDataset
    table: SampleTable
    bucket_bounds: tuple[int, ...]
    max_len: int | None = None
    overlong: str = "truncate"


@dataclass(frozen=True)
class LiveTargets:
    """The target copies that compute the features, one worker each on `devices[k]`, and how they
    run: forward batches planned under `forward_plan`, at most `queue_depth` batches made ahead."""

    captures: list[HiddenStateCapture]
    devices: list[torch.device]
    forward_plan: PlanConfig = field(default_factory=PlanConfig)
    queue_depth: int = DEFAULT_QUEUE_DEPTH

    def __post_init__(self) -> None:
        if len(self.captures) != len(self.devices) or not self.captures:
            raise ValueError("one capture per target device")


@dataclass
class _Made:
    index: int
    batch: PackedBatch
    ready: torch.cuda.Event | None


class LiveSource(PlannedSource):
    """Yields (Position after this batch, PackedBatch on `place.device`), like CacheSource (a `Source`).
    `tee`, if any, is handed each batch of epoch 0 (`--write-cache`)."""

    def __init__(self, data: LiveData, config: SourceConfig, targets: LiveTargets, place: Place,
                 tee: Callable[[int, PackedBatch, torch.cuda.Event | None], None] | None = None) -> None:
        super().__init__(data.table, config, place)
        self.data, self.dataset, self.targets = data, data.dataset, targets
        self.tee = tee

    def for_dataset(self, data: LiveData, config: SourceConfig) -> LiveSource:
        """A source of another dataset through this one's loaded targets (held-out batches): the
        captures take one forward at a time, so both can run; no tee, no profiler."""
        return LiveSource(data, config, self.targets, dataclasses.replace(self.place, profiler=StageProfiler(None)))

    def identity(self) -> dict[str, str]:
        """What a resumed run must find again: the same samples of the same dataset."""
        return {"kind": "live", "samples": self.table.digest(), "dataset": self.dataset.fingerprint}

    def close(self) -> None:
        """Wait for the tee's writes and index the cache it made."""
        if self.tee is not None:
            self.tee.close()

    def iterate(self, start: Position,
                epochs: int | None = None) -> Generator[tuple[Position, PackedBatch], None, None]:
        for epoch, first, plan in self.epoch_plans(start, epochs):
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

    def _run_epoch(self, plan: list[np.ndarray]) -> Generator[tuple[int, _Made], None, None]:
        n = len(self.targets.captures)
        jobs = list(range(len(plan)))
        workers = [Producer(functools.partial(self._made, k, plan, jobs[k::n]), depth=self.targets.queue_depth // n,
                            name=f"dflash-target-{k}") for k in range(n)]
        try:
            for j, i in enumerate(jobs):
                k = j % n
                try:
                    made = workers[k].next()
                except Exception as e:
                    raise UserError(f"target worker on {self.targets.devices[k]} failed: {type(e).__name__}: "
                                    f"{e}") from e
                yield i, made
        finally:
            for worker in workers:
                worker.close(timeout=30)

    def _made(self, k: int, plan: list[np.ndarray], jobs: list[int]) -> Iterator[_Made]:
        """Target worker k's batches, in order (on its producer thread, on its own CUDA stream)."""
        device = self.targets.devices[k]
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        for i in jobs:
            yield self._make(i, plan[i], self.targets.captures[k], device, stream)

    def _make(self, i: int, positions: np.ndarray, capture: HiddenStateCapture, device: torch.device,
              stream: torch.cuda.Stream | None) -> _Made:
        sample_ids = self.table.sample_ids[positions]
        lengths = self.table.lengths[positions]
        with self.profiler.span("target.read_rows"):
            rows = [self.dataset.read_rows(int(r), int(r) + 1, max_len=self.data.max_len,
                                           overlong=self.data.overlong)[0] for r in sample_ids]
        packed = HostBatch.pack([r.input_ids for r in rows], [r.loss_mask for r in rows], sample_ids)
        # The target runs the batch in forward batches planned exactly as extraction plans them
        # (length-sorted, under its token budget and row cap), so its memory stays bounded and, with
        # the same settings, each sample sees the same forward shapes as in a cache.
        forwards = plan_unit(0, 0, lengths, np.ones(len(rows), bool), self.targets.forward_plan)
        offsets = packed.cu_seqlens
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            parts, order = [], []
            for fb in forwards:
                inputs = ForwardInputs.of_rows([rows[j].input_ids for j in fb.rows], pin=device.type == "cuda")
                with self.profiler.device_span("target.model_forward", stream):
                    parts.append(capture(*inputs.to(device)))
                # (numpy's stubs take an element of an array indexed by an untyped value for an array)
                order += [np.arange(offsets[j], offsets[j + 1])  # pyright: ignore[reportCallIssue, reportArgumentType]
                          for j in fb.rows]
            # token t of the training batch sits at place[t] of the concatenated forward outputs
            place = np.empty(packed.num_tokens, dtype=np.int64)
            place[np.concatenate(order)] = np.arange(packed.num_tokens)
            with self.profiler.device_span("target.pack_hidden", stream):
                features = torch.cat(parts).index_select(0, torch.from_numpy(place).to(device, non_blocking=True))
            if device != self.device:
                with self.profiler.device_span("target.to_drafter", stream):
                    features = features.to(self.device, non_blocking=True)
            ready = None
            if stream is not None:
                ready = torch.cuda.Event()
                ready.record(stream)
        # tokens, positions and bounds are made on the host and copied synchronously: nothing the
        # drafter's stream reads is left to a kernel on this thread's stream
        return _Made(i, PackedBatch.from_host(packed, features).to(self.device), ready)
