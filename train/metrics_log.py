"""A training run's logged metrics (metrics.jsonl and the log line), taken without waiting for the device.

Reading a loss on the host waits for every step queued before it. The device then drains its
queue and idles while the host prepares the next step: on an H200 about 0.1 s for a step fed by
the cache (its batch fetch, copy and anchors; bench/train.py's "with fill" rates), 2% of a
10-step logging interval. So a log step only queues its averages (all-reduced over ranks too)
and their copy to the host; the row is written at the next step, by when the device has long
finished them. Rates are taken between device events, so they are the device's, not how fast the
host queued work.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_cache.train.loss import tau_hat

log = logging.getLogger(__name__)

Mark = torch.cuda.Event | float  # a point in the run: a device event, or host time on a CPU


@dataclass
class _Queued:
    stats: torch.Tensor  # [loss, slot accuracies..., skipped steps, run of skips, stop flag], on the host once `ready` has completed
    ready: torch.cuda.Event | None
    since: Mark
    until: Mark
    row: dict[str, Any]  # what the host knew at the log step
    tokens: int
    left_out: float = 0.0  # seconds of the window spent on other work (evaluations): not in its rate
    timed: bool = True  # False: the window is a run's first step alone, start-up in it: no rate to give


@dataclass
class MetricsLog:
    """Queue a log step's metrics (`queue`), write them a step later (`write`). Every rank calls both
    at the same steps: `write` returns whether any rank asked to stop, so that all stop together."""

    path: Path
    device: torch.device
    slots: int  # accuracies per row: the block's slots 1..B-1
    rank: int = 0
    world: int = 1
    clock: Callable[[], float] = time.perf_counter  # host time: a CPU's marks
    last: dict[str, Any] = field(default_factory=dict)  # the newest written row
    _queued: _Queued | None = None
    _since: Mark | None = None
    _host: torch.Tensor | None = None  # pinned, reused: a fresh pinned buffer may wait for the device
    _left_out: float = 0.0  # `leave_out`'s seconds in the window being timed
    _other_rows: list[tuple[dict[str, Any], str | None]] = field(default_factory=list)  # `add`'s, not yet written
    sinks: list[Callable[[dict[str, Any]], None]] = field(default_factory=list)  # each row rank 0 writes (trackers)

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            self._host = torch.empty(self.slots + 4, dtype=torch.float32, pin_memory=True)

    def start(self) -> None:
        """Where the window being timed starts: the run's start, or the end of its first step, so that
        start-up is no part of the rate (the trainer then counts the tokens from there). Later windows
        start where the one before ended."""
        self._since = self._mark()
        self._left_out = 0.0

    def leave_out(self, seconds: float) -> None:
        """Time of the window being timed that went to other work than training (an evaluation, with
        the device idle before and after it): left out of its rate."""
        self._left_out += seconds

    def add(self, row: dict[str, Any], line: str | None = None) -> None:
        """A row of another kind (an evaluation's: it says so in its own field), and the log line that
        says it: written after the training row still queued, so that the file stays in step order,
        or now when none is. Rank 0 writes it; it never becomes `last`."""
        self._other_rows.append((row, line))
        if self._queued is None:
            self._write_other_rows()

    def queue(self, window: list[dict[str, torch.Tensor]], tokens: int, stop_requested: bool,
              row: dict[str, Any], skip_run: torch.Tensor | None = None, *, timed: bool = True) -> None:
        """Average the window's step metrics ("loss", "acc" [B - 1]) over its steps that were not
        skipped ("skipped": their gradients were not finite), count those, and start the copy to the
        host; `skip_run` is how many steps in a row were skipped up to this one. `row` holds the
        host-side fields (step, epoch, lr, tokens_seen; any others are written as they are). A row
        still queued is written first. `timed=False`: the window holds nothing but start-up and the
        run's first step, so its row's tokens_per_s is null rather than a rate start-up dragged down."""
        self.write()
        dev = window[0]["loss"].device
        skipped = torch.stack([w["skipped"] if "skipped" in w else torch.zeros((), dtype=torch.bool, device=dev)
                               for w in window]).float()
        kept = 1.0 - skipped
        taken = kept.sum()  # an average over no step is NaN: the row then says null
        # The flags by a fill, not a tensor from a list: that copies from pageable memory, which waits
        # for the device.
        stats = torch.cat([(torch.stack([w["loss"] for w in window]).nan_to_num() * kept).sum()[None] / taken,
                           (torch.stack([w["acc"] for w in window]).float() * kept[:, None]).sum(0) / taken,
                           skipped.sum()[None],
                           (skip_run.float() if skip_run is not None else torch.zeros((), device=dev))[None],
                           torch.full((1,), float(stop_requested), device=dev)])
        if self.world > 1:
            torch.distributed.all_reduce(stats)
            stats[:-1] /= self.world  # the skip counts too: every rank skips the same steps (all-reduced gradients)
            tokens *= self.world
        since = self._since
        if since is None:
            raise RuntimeError("MetricsLog.queue before start(): the window has no start to time it from")
        until, ready = self._mark(), None
        if self._host is not None:
            stats = self._host.copy_(stats, non_blocking=True)  # the row before is written: it is free
            ready = torch.cuda.Event()
            ready.record()
        self._queued = _Queued(stats, ready, since, until, row, tokens, self._left_out, timed)
        self._since, self._left_out = until, 0.0

    def write(self) -> bool:
        """Write the queued row, if any (waiting for its copy, which by the next step has long
        completed); True when some rank asked to stop at its log step."""
        q, self._queued = self._queued, None
        if q is None:
            return False
        if q.ready is not None:
            q.ready.synchronize()
        since, until = q.since, q.until  # both device events, or both host times (the device decides)
        if isinstance(since, torch.cuda.Event) and isinstance(until, torch.cuda.Event):
            seconds = since.elapsed_time(until) / 1e3
        elif isinstance(since, torch.cuda.Event) or isinstance(until, torch.cuda.Event):
            raise RuntimeError("MetricsLog: a window timed by a device event at one end and host time at the other")
        else:
            seconds = until - since
        seconds -= q.left_out
        loss, acc, stop = float(q.stats[0]), q.stats[1:-3], bool(q.stats[-1] > 0)  # acc: slots 1..B-1
        skipped, skip_run = int(round(float(q.stats[-3]))), int(round(float(q.stats[-2])))
        finite = math.isfinite(loss) and bool(torch.isfinite(acc).all())
        row = {"step": q.row["step"], "epoch": q.row["epoch"], "loss": loss if finite else None, "lr": q.row["lr"],
               "tau_hat": tau_hat(acc) if finite else None,
               "slot_acc": [round(float(a), 4) for a in acc] if finite else None,
               "tokens_per_s": q.tokens / max(seconds, 1e-9) if q.timed else None, "tokens_seen": q.row["tokens_seen"]}
        if skipped:  # steps whose gradients were not finite: no update, and left out of the averages
            row |= {"skipped_steps": skipped, "skip_run": skip_run}
        row |= {k: v for k, v in q.row.items() if k not in row}  # the trainer's other fields (anchors_kept)
        if self.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(row, allow_nan=False) + "\n")
            for sink in self.sinks:
                sink(row)
            if finite:
                rate = f"{row['tokens_per_s']:.0f} tok/s" if q.timed else "tok/s from the next row (start-up)"
                log.info("step %d  loss %.4f  tau_hat %.3f  acc@1 %.3f  lr %.2e  %s", row["step"], loss,
                         row["tau_hat"], row["slot_acc"][0], row["lr"], rate)
            if skipped:
                log.warning("step %d: %d of the last window's steps were skipped, their gradients not finite%s",
                            row["step"], skipped, f" ({skip_run} in a row)" if skip_run > 1 else "")
        self.last = row
        self._write_other_rows()
        return stop

    def _write_other_rows(self) -> None:
        rows, self._other_rows = self._other_rows, []
        if self.rank != 0 or not rows:
            return
        with open(self.path, "a") as f:
            f.write("".join(json.dumps(row, allow_nan=False) + "\n" for row, _ in rows))
        for row, _ in rows:
            for sink in self.sinks:
                sink(row)
        for _, line in rows:
            if line is not None:
                log.info("%s", line)

    def write_finishing(self) -> None:
        """`write` for a run that is ending, also by an error: a device that cannot copy the row
        back any more is logged, not raised, so that it does not hide what stopped the run."""
        step = self._queued.row["step"] if self._queued is not None else None
        try:
            self.write()
        except Exception as e:
            log.warning("the metrics of step %s could not be written: %s", step, e)

    def _mark(self) -> Mark:
        if self.device.type != "cuda":
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
