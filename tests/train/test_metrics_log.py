"""MetricsLog: a log step's row is queued and written a step later, with the window's averages."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_cache.train.metrics_log import MetricsLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _window(losses, accs):
    return [{"loss": torch.tensor(x), "acc": torch.tensor(a)} for x, a in zip(losses, accs, strict=True)]


def _fields(step: int) -> dict:
    return {"step": step, "epoch": 0, "lr": 1e-3, "tokens_seen": 100 * step}


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_row_is_written_at_the_next_step_with_the_windows_averages(tmp_path):
    clock = Clock()
    log = MetricsLog(tmp_path / "metrics.jsonl", torch.device("cpu"), slots=2, clock=clock)
    log.start()
    clock.now = 2.0
    log.queue(_window([1.0, 3.0], [[0.5, 0.25], [0.5, 0.75]]), tokens=400, stop_requested=False, row=_fields(2))
    assert _rows(tmp_path / "metrics.jsonl") == [] and log.last == {}, "queueing writes nothing"
    assert log.write() is False
    (row,) = _rows(tmp_path / "metrics.jsonl")
    assert row["step"] == 2 and row["tokens_seen"] == 200 and row["lr"] == 1e-3
    assert row["loss"] == pytest.approx(2.0)
    assert row["slot_acc"] == [0.5, 0.5]
    assert row["tau_hat"] == pytest.approx(1 + 0.5 + 0.25)
    assert row["tokens_per_s"] == pytest.approx(200.0)  # 400 tokens over the 2 s since start()
    assert log.last == row
    assert log.write() is False, "nothing queued: nothing written"
    assert len(_rows(tmp_path / "metrics.jsonl")) == 1


def test_each_window_is_timed_from_the_last_log_step(tmp_path):
    clock = Clock()
    log = MetricsLog(tmp_path / "metrics.jsonl", torch.device("cpu"), slots=1, clock=clock)
    log.start()
    for step, now in ((1, 1.0), (2, 5.0)):
        clock.now = now
        log.queue(_window([1.0], [[1.0]]), tokens=100, stop_requested=False, row=_fields(step))  # writes the last
    log.write()
    assert [r["tokens_per_s"] for r in _rows(tmp_path / "metrics.jsonl")] == pytest.approx([100.0, 25.0])


def test_the_stop_flag_comes_back_with_its_row(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl", torch.device("cpu"), slots=1)
    log.start()
    log.queue(_window([1.0], [[1.0]]), tokens=1, stop_requested=True, row=_fields(1))
    assert log.write() is True


def test_other_ranks_keep_the_row_but_write_no_file(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl", torch.device("cpu"), slots=1, rank=1)
    log.start()
    log.queue(_window([1.0], [[1.0]]), tokens=1, stop_requested=False, row=_fields(1))
    log.write()
    assert not (tmp_path / "metrics.jsonl").exists() and log.last["step"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_queueing_does_not_wait_for_the_device_and_the_rate_is_the_devices(tmp_path):
    """Queued behind ~1 s of device work, queue() returns at once (a stop flag made by torch.tensor
    from a list waited the whole second here); the row's rate covers that work."""
    import time

    dev = torch.device("cuda")
    log = MetricsLog(tmp_path / "metrics.jsonl", dev, slots=3)
    log.start()
    window = [{"loss": torch.tensor(1.0, device=dev), "acc": torch.ones(3, device=dev)}]
    # A first row loads the kernels: with CUDA's lazy loading a kernel's first launch may wait for the
    # device, once per process.
    log.queue(window, tokens=1000, stop_requested=False, row=_fields(1))
    log.write()
    torch.cuda._sleep(2_000_000_000)  # clock cycles: ~1 s at an H200's 1.98 GHz
    t0 = time.perf_counter()
    log.queue(window, tokens=1000, stop_requested=False, row=_fields(2))
    queued = time.perf_counter() - t0
    assert queued < 0.2, f"queue() waited {queued:.2f} s for the device"
    assert len(_rows(tmp_path / "metrics.jsonl")) == 1, "the second row is not written yet"
    log.write()
    row = _rows(tmp_path / "metrics.jsonl")[1]
    assert row["loss"] == 1.0 and row["tokens_per_s"] < 1000 / 0.5, row
