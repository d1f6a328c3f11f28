"""A stage profiler that never synchronises the GPU.

Host stages are timed with `perf_counter`. Device stages record a pair of CUDA events and are
resolved lazily: an event pair is only read once `query()` says both have completed, so timing
adds no host synchronisation to the hot path. Every `interval` seconds `maybe_report` logs each
stage's average and max wall time and the token rate since the last report. A profiler with no
interval is off: it reads no clock and takes no lock, so the hot path may always call it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dflash_cache.errors import UserError

if TYPE_CHECKING:  # torch loads where device spans are timed, not for the options' help
    import torch

log = logging.getLogger(__name__)
ENV_VAR = "DFLASH_PROFILE_INTERVAL"
INTERVAL_HELP = f"Seconds between stage-timing reports (or {ENV_VAR})."


def interval_from_env(value: float | None) -> float | None:
    """The CLI value if given, else DFLASH_PROFILE_INTERVAL, else None (profiler off).

    Checked up front, so a typo in the environment stops the run before it writes anything."""
    where = "--profile-interval"
    if value is None:
        env = os.environ.get(ENV_VAR, "").strip()
        if not env:
            return None
        where = f"{ENV_VAR}={env!r}"
        try:
            value = float(env)
        except ValueError:
            raise UserError(f"{where} is not a number; set it to seconds between reports, e.g. 30, or unset it") from None
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"{where}: the interval must be a positive number of seconds, e.g. 30; "
                        "leave it unset to turn profiling off")
    return float(value)


@dataclass
class _Stat:
    total: float = 0.0
    peak: float = 0.0
    count: int = 0

    def add(self, seconds: float) -> None:
        self.total += seconds
        self.peak = max(self.peak, seconds)
        self.count += 1


@dataclass
class StageProfiler:
    """Per-stage times and a token rate, shared by the threads of one rank: spans, tokens and reports
    may come from any thread. `clock` is the host timer, injectable so that tests can drive time."""

    interval: float | None = None
    prefix: str = ""
    clock: Callable[[], float] = time.perf_counter
    peak_flops: float | None = None  # the device's peak FLOP/s: reports then give model FLOPs utilisation
    # Called with each report's figures by name (tok_s, tflop_s, mfu, <stage>_avg_ms, <stage>_max_ms): trackers.
    listeners: list[Callable[[dict[str, float]], None]] = field(default_factory=list)
    _stats: dict[str, _Stat] = field(default_factory=lambda: defaultdict(_Stat))
    _pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _tokens: int = 0
    _flops: float = 0.0
    _last: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if self.enabled:  # the first report covers the time since construction
            self._last = self.clock()

    @property
    def enabled(self) -> bool:
        return self.interval is not None

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Host wall time of the block (counted also when it raises)."""
        if not self.enabled:
            yield
            return
        t0 = self.clock()
        try:
            yield
        finally:
            self.add(name, self.clock() - t0)

    @contextmanager
    def device_span(self, name: str, stream: torch.cuda.Stream | None = None) -> Iterator[None]:
        """Device time of the work the block enqueues on `stream`; host time on CPU."""
        if not self.enabled or stream is None:
            with self.span(name):
                yield
            return
        import torch  # loaded already: `stream` is one of its streams

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        try:
            yield
        finally:
            end.record(stream)
            with self._lock:
                self._pending.append((name, start, end))

    def add(self, name: str, seconds: float) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._stats[name].add(seconds)

    def add_tokens(self, n: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._tokens += n

    def add_flops(self, n: float) -> None:
        """Model FLOPs of work done (a training step's, see dflash_cache.train.flops)."""
        if not self.enabled:
            return
        with self._lock:
            self._flops += n

    def _resolve(self) -> None:
        """Count the device spans whose events have completed; the others wait for a later report."""
        still = []
        for name, start, end in self._pending:
            if end.query():
                self._stats[name].add(start.elapsed_time(end) / 1e3)
            else:
                still.append((name, start, end))
        self._pending = still

    def maybe_report(self, *, force: bool = False) -> str | None:
        """Log and return a report of everything recorded since the last one, once `interval` seconds
        have passed since it (or now, if `force`); None otherwise. Each report starts a new interval."""
        interval = self.interval
        if interval is None:  # off (not `enabled`)
            return None
        if not force and self.clock() - self._last < interval:
            return None  # the common case, decided without the lock
        with self._lock:
            now = self.clock()
            elapsed = now - self._last
            if not force and elapsed < interval:
                return None  # another thread reported in the meantime
            self._resolve()
            self._last = now
            rate = self._tokens / elapsed if elapsed > 0 else 0.0
            values = {"tok_s": rate}
            head = f"{self.prefix}profile over {elapsed:.1f}s: {rate:,.0f} tok/s"
            if self._flops and elapsed > 0:
                achieved = self._flops / elapsed
                values["tflop_s"] = achieved / 1e12
                head += f", {achieved / 1e12:,.0f} TFLOP/s"
                if self.peak_flops:
                    values["mfu"] = achieved / self.peak_flops
                    head += f" (MFU {achieved / self.peak_flops:.1%} of {self.peak_flops / 1e12:,.0f})"
            lines = [head]
            for name in sorted(self._stats):
                s = self._stats[name]
                values |= {f"{name}_avg_ms": 1e3 * s.total / s.count, f"{name}_max_ms": 1e3 * s.peak}
                lines.append(
                    f"  {name:<28} avg {1e3 * s.total / s.count:9.2f} ms  max {1e3 * s.peak:9.2f} ms  n={s.count}"
                )
            self._stats.clear()
            self._tokens, self._flops = 0, 0.0
        report = "\n".join(lines)
        log.info("%s", report)
        for listener in self.listeners:
            listener(values)
        return report
