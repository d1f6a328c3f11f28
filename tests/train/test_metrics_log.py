"""MetricsLog: a log step's row is queued and written a step later, with the window's averages.
That queueing does not wait for a GPU is in test_cuda.py."""

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

