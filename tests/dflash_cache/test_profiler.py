"""The stage profiler: `interval_from_env` (the CLI value, else DFLASH_PROFILE_INTERVAL; a bad one is one
line, not a crash), and StageProfiler's spans, periodic reports, device spans, off switch and threads."""

from __future__ import annotations

import logging
import re
import sys
import threading

import pytest
import torch

from dflash_cache.errors import UserError
from dflash_cache.profiler import ENV_VAR, StageProfiler, interval_from_env


def test_cli_value_wins_and_unset_means_off(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert interval_from_env(None) is None
    monkeypatch.setenv(ENV_VAR, "  ")
    assert interval_from_env(None) is None
    monkeypatch.setenv(ENV_VAR, "2.5")
    assert interval_from_env(None) == 2.5
    assert interval_from_env(7) == 7.0


@pytest.mark.parametrize("value", ["abc", "0", "-3", "nan", "inf"])
def test_bad_environment_value_is_one_line(monkeypatch, value):
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(UserError, match=f"^{ENV_VAR}='{value}'") as info:
        interval_from_env(None)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("value", [0, -1.0, float("nan")])
def test_bad_cli_value_is_one_line(monkeypatch, value):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(UserError, match="^--profile-interval: the interval must be a positive number of seconds"):
        interval_from_env(value)


class FakeClock:
    """A host clock that moves only when the test moves it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


HEADER = re.compile(r"^(?P<prefix>.*)profile over (?P<seconds>[\d.]+)s: (?P<rate>[\d,]+) tok/s$")
STAGE = re.compile(r"^  (?P<name>\S+) +avg +(?P<avg>[\d.]+) ms +max +(?P<max>[\d.]+) ms +n=(?P<n>\d+)$")


def parse(report: str) -> tuple[dict[str, str], dict[str, tuple[float, float, int]]]:
    """(header fields, {stage: (avg ms, max ms, count)}) of one report; every line must parse."""
    first, *rest = report.split("\n")
    header = HEADER.match(first)
    assert header, first
    stages = {}
    for line in rest:
        m = STAGE.match(line)
        assert m, line
        stages[m["name"]] = (float(m["avg"]), float(m["max"]), int(m["n"]))
    return header.groupdict(), stages


def timed(profiler: StageProfiler, clock: FakeClock, name: str, seconds: float) -> None:
    with profiler.span(name):
        clock.advance(seconds)


def test_spans_accumulate_average_max_and_count_per_stage():
    clock = FakeClock()
    p = StageProfiler(10.0, prefix="[rank 3] ", clock=clock)
    for seconds in (0.002, 0.004, 0.009):
        timed(p, clock, "read", seconds)
    timed(p, clock, "forward", 0.5)
    p.add("write", 0.25)  # a time measured elsewhere counts like a span
    p.add_tokens(3000)
    p.add_tokens(1000)
    clock.advance(4.0 - 0.515)  # 4 s since construction in all
    header, stages = parse(p.maybe_report(force=True))
    assert header == {"prefix": "[rank 3] ", "seconds": "4.0", "rate": "1,000"}
    assert list(stages) == ["forward", "read", "write"], "stages are listed by name"
    assert stages == {"forward": (500.0, 500.0, 1), "read": (5.0, 9.0, 3), "write": (250.0, 250.0, 1)}


def test_a_span_whose_block_raises_is_still_counted():
    clock = FakeClock()
    p = StageProfiler(10.0, clock=clock)
    with pytest.raises(KeyError), p.span("lookup"):
        clock.advance(0.003)
        raise KeyError("x")
    assert parse(p.maybe_report(force=True))[1] == {"lookup": (3.0, 3.0, 1)}


def test_reports_come_once_per_interval_and_cover_only_their_interval():
    clock = FakeClock()
    p = StageProfiler(10.0, clock=clock)
    timed(p, clock, "step", 1.0)
    p.add_tokens(500)
    clock.advance(8.99)
    assert p.maybe_report() is None, "9.99 s is not yet 10"
    clock.advance(0.01)
    header, stages = parse(p.maybe_report())
    assert (header["seconds"], header["rate"], stages) == ("10.0", "50", {"step": (1000.0, 1000.0, 1)})
    assert p.maybe_report() is None, "the next interval starts at the report"
    timed(p, clock, "step", 2.0)
    clock.advance(7.0)
    assert p.maybe_report() is None
    clock.advance(1.0)
    header, stages = parse(p.maybe_report())
    assert (header["seconds"], header["rate"], stages) == ("10.0", "0", {"step": (2000.0, 2000.0, 1)})


def test_force_reports_at_once_even_twice_at_the_same_instant():
    """`force` is the end-of-run summary: it does not wait for the interval, and a report right after
    another (a zero-length interval on a coarse clock) says 0 tok/s instead of dividing by zero."""
    clock = FakeClock()
    p = StageProfiler(60.0, clock=clock)
    p.add_tokens(10)
    clock.advance(2.0)
    assert parse(p.maybe_report(force=True))[0]["rate"] == "5"
    p.add_tokens(10)
    header, stages = parse(p.maybe_report(force=True))
    assert (header["seconds"], header["rate"], stages) == ("0.0", "0", {})


def test_model_flops_give_tflops_and_mfu_against_the_peak():
    """Model FLOPs added per step become TFLOP/s over the interval, and an MFU once the device's
    peak is known; the next interval starts from zero."""
    clock = FakeClock()
    p = StageProfiler(10.0, clock=clock)
    p.add_flops(3e15)
    p.add_tokens(100)
    clock.advance(10.0)
    first = p.maybe_report().split("\n")[0]
    assert first == "profile over 10.0s: 10 tok/s, 300 TFLOP/s", first
    p.peak_flops = 1000e12
    p.add_flops(4e15)
    clock.advance(10.0)
    assert p.maybe_report().split("\n")[0] == "profile over 10.0s: 0 tok/s, 400 TFLOP/s (MFU 40.0% of 1,000)"
    clock.advance(10.0)
    assert p.maybe_report().split("\n")[0] == "profile over 10.0s: 0 tok/s"
    off = StageProfiler(None)
    off.add_flops(1e12)
    assert off.maybe_report(force=True) is None


def test_the_report_is_logged_as_returned(caplog):
    clock = FakeClock()
    p = StageProfiler(1.0, prefix="[rank 0] ", clock=clock)
    timed(p, clock, "step", 0.1)
    clock.advance(1.0)
    with caplog.at_level(logging.INFO, logger="dflash_cache.profiler"):
        report = p.maybe_report()
        assert p.maybe_report() is None
    assert [r.getMessage() for r in caplog.records] == [report]
    assert caplog.records[0].levelno == logging.INFO and report.startswith("[rank 0] profile over 1.1s")


class Forbidden:
    """Stands in for the clock and the lock of a profiler that is off: touching either fails."""

    def __call__(self) -> float:
        raise AssertionError("a profiler that is off read the clock")

    def __enter__(self) -> None:
        raise AssertionError("a profiler that is off took its lock")

    def __exit__(self, *exc) -> None:
        return None


def test_a_profiler_that_is_off_costs_nothing_and_reports_nothing(caplog):
    p = StageProfiler(None, clock=Forbidden(), _lock=Forbidden())
    assert not p.enabled
    ran = []
    with caplog.at_level(logging.DEBUG, logger="dflash_cache.profiler"):
        with p.span("host"):
            ran.append("host")
        with p.device_span("device", stream=None):
            ran.append("device")
        with pytest.raises(ValueError), p.span("fails"):
            raise ValueError("the block's own error comes through")
        p.add("stage", 1.0)
        p.add_tokens(100)
        assert p.maybe_report() is None and p.maybe_report(force=True) is None
    assert ran == ["host", "device"] and not caplog.records


def test_device_span_without_a_stream_times_the_host():
    clock = FakeClock()
    p = StageProfiler(10.0, clock=clock)
    with p.device_span("target.forward", stream=None):
        clock.advance(0.02)
    assert parse(p.maybe_report(force=True))[1] == {"target.forward": (20.0, 20.0, 1)}


class FakeDevice:
    """torch.cuda.Event and is_available, for device spans without a GPU: events stamp the fake clock's
    time when recorded and complete only when `done` is set; waiting on one is an error."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.done, self.streams = clock, False, []
        device = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing, "a timing event"
                self.at: float | None = None

            def record(self, stream) -> None:
                device.streams.append(stream)
                self.at = device.clock()

            def query(self) -> bool:
                return device.done

            def elapsed_time(self, end: Event) -> float:
                assert device.done, "read before completion"
                return (end.at - self.at) * 1e3  # milliseconds, as CUDA reports them

            def synchronize(self) -> None:
                raise AssertionError("the profiler waited for the device")

        self.Event = Event


def test_device_spans_are_read_once_their_events_complete_never_waited_for(monkeypatch):
    clock = FakeClock()
    device = FakeDevice(clock)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", device.Event)
    p = StageProfiler(10.0, clock=clock)
    with p.device_span("target.model_forward", stream="s1"):
        clock.advance(0.25)
    assert device.streams == ["s1", "s1"], "start and end are recorded on the span's stream"
    assert parse(p.maybe_report(force=True))[1] == {}, "still running: left for a later report"
    device.done = True
    assert parse(p.maybe_report(force=True))[1] == {"target.model_forward": (250.0, 250.0, 1)}
    assert parse(p.maybe_report(force=True))[1] == {}, "counted once"


def test_threads_sharing_a_profiler_lose_and_double_count_nothing():
    """Spans from worker threads while another thread reports: every span is in exactly one report.
    A tiny switch interval makes the threads interleave inside the profiler's methods."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    p = StageProfiler(1e-9)  # the real clock: every maybe_report is due
    workers, spans_each = 4, 10_000
    counted = {"a": 0, "b": 0}
    stop = threading.Event()

    def work() -> None:
        for i in range(spans_each):
            with p.span("a" if i % 2 else "b"):
                pass
            p.add_tokens(1)

    def report() -> None:
        while not stop.is_set():
            if (text := p.maybe_report()) is not None:
                for name, (_, _, n) in parse(text)[1].items():
                    counted[name] += n

    try:
        reporter = threading.Thread(target=report)
        reporter.start()
        threads = [threading.Thread(target=work) for _ in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        reporter.join()
    finally:
        sys.setswitchinterval(old)
    for name, (_, _, n) in parse(p.maybe_report(force=True))[1].items():
        counted[name] += n
    assert counted == {"a": workers * spans_each // 2, "b": workers * spans_each // 2}
