"""`train --live --write-cache DIR`: commit what the live target produces to a cache.

Epoch 0's batches are written as the cache's segments (unit 0, batch g = the batch's index in the
whole epoch plan), through the same manifest, plan table, lock, segment writer and commit protocol
as `dflash-cache extract`, so the result is an ordinary cache: `inspect --verify` checks it and
`train --cache DIR` continues offline. Batches a data-parallel epoch drops (the remainder that
does not split evenly over ranks) and samples too short to train on are not in it. A resumed live
run skips the segments already committed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from dflash_cache.data.inputs import build_manifest
from dflash_cache.errors import UserError
from dflash_cache.store.batch import HostBatch, PackedBatch
from dflash_cache.store.codecs import get_codec
from dflash_cache.store.layout import segment_name
from dflash_cache.store.location import is_url
from dflash_cache.store.lock import CacheLock
from dflash_cache.store.plan import Plan, PlanConfig, PlannedBatch
from dflash_cache.store.segments import read_records
from dflash_cache.store.writer import commit_segment, finish_cache, open_or_create
from dflash_cache.target.model import TargetDescription
from dflash_cache.train.epoch_plan import SampleTable, SourceConfig
from dflash_cache.train.live_source import LiveData
from dflash_cache.train.place import Place

log = logging.getLogger(__name__)


def epoch0_plan(table: SampleTable, config: SourceConfig, bucket_bounds: tuple[int, ...], world: int) -> Plan:
    """Epoch 0 of every rank, interleaved into global batch order (rank r's j-th is j * world + r)."""
    shares = [table.epoch(config, 0, r, world) for r in range(world)]
    batches = []
    for j in range(len(shares[0])):
        for r in range(world):
            pos = shares[r][j]
            batches.append(PlannedBatch(unit=0, batch=len(batches), bucket=int(table.buckets[pos[0]]),
                                        rows=table.sample_ids[pos], lengths=table.lengths[pos].astype(np.int32)))
    rows = max((len(b.rows) for b in batches), default=1)
    plan_config = PlanConfig(token_budget=config.token_budget, max_rows=rows, unit_rows=max(1, len(table.sample_ids)),
                             bucket_bounds=tuple(bucket_bounds))
    return Plan(config=plan_config, num_rows=int(table.sample_ids.max(initial=-1)) + 1, batches=tuple(batches))


class CacheTee:
    """Callable the live source hands each epoch-0 batch to; `close()` waits for the writes."""

    def __init__(self, out: str, codec: str, *, target: TargetDescription, data: LiveData,
                 source_config: SourceConfig, place: Place) -> None:
        """Epoch 0 of `data` as `source_config` plans it for `place.world` processes, written by each
        (rank `place.rank`) into the cache at `out` in `codec`."""
        rank, world = place.rank, place.world
        if is_url(out):
            raise UserError(f"--write-cache {out}: the live run writes its cache to a local directory only; write "
                            "it there (and copy it up), or make the cache with dflash-cache extract --out URL")
        self.root, self.rank, self.world = Path(out), rank, world
        self.codec = get_codec(codec)
        self.n_layers = len(target.layer_ids)
        self.specs = self.codec.arrays(self.n_layers, target.hidden_size)
        self.plan = epoch0_plan(data.table, source_config, data.bucket_bounds, world)
        manifest = build_manifest(target, data.dataset, self.plan, codec=codec, max_len=data.max_len,
                                  overlong=data.overlong)
        self._lock = CacheLock(self.root, name=f".lock-rank{rank}")
        self._lock.__enter__()
        self.committed = open_or_create(self.root, manifest, self.plan) if rank == 0 else set()
        if world > 1:  # the other ranks write into the cache rank 0 has just created or reopened
            torch.distributed.barrier()
            self.committed = {r.name for r in read_records(self.root)}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dflash-tee")
        self._in_flight = threading.BoundedSemaphore(2)
        self._futures: list[Future] = []
        self._stream = None
        self._t0 = time.perf_counter()

    def __call__(self, g: int, batch: PackedBatch, ready: torch.cuda.Event | None) -> None:
        """Write epoch 0's global batch `g` as segment (0, g), unless it is committed already."""
        if segment_name(0, g) in self.committed:
            return
        if batch.features.is_cuda:
            self._stream = self._stream or torch.cuda.Stream(batch.features.device)
            batch.features.record_stream(self._stream)
        self._in_flight.acquire()
        fut = self._pool.submit(self._write, g, batch, ready)
        fut.add_done_callback(lambda _: self._in_flight.release())
        self._futures.append(fut)

    def _write(self, g: int, batch: PackedBatch, ready: torch.cuda.Event | None) -> None:
        features, stream = batch.features, self._stream  # the stream: made by __call__ for a batch on a GPU
        with torch.cuda.stream(stream) if features.is_cuda else contextlib.nullcontext():
            if ready is not None:
                if stream is None:
                    raise RuntimeError("CacheTee: a batch with a device event but no copy stream")
                stream.wait_event(ready)
            encoded = {k: v.cpu() for k, v in self.codec.encode(features, self.n_layers).items()}
        commit_segment(self.root, self.plan.batches[g], HostBatch.from_packed(batch), encoded, specs=self.specs,
                       rank=self.rank)

    def close(self) -> None:
        try:
            for fut in self._futures:
                fut.result()
            self._pool.shutdown()
            if self.world > 1:  # every rank's segments are committed before rank 0 indexes them
                torch.distributed.barrier()
            if self.rank == 0:
                finish_cache(self.root, log.info, time.perf_counter() - self._t0)
        finally:
            self._lock.__exit__(None, None, None)
