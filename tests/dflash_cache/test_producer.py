"""The producer thread (dflash_cache.producer): order, back-pressure, errors, close."""

from __future__ import annotations

import threading
import time

import pytest

from dflash_cache.producer import Producer


def test_items_arrive_in_order_then_stop():
    p = Producer(lambda: iter(range(5)), depth=2, name="t-order")
    assert list(p) == [0, 1, 2, 3, 4]
    with pytest.raises(StopIteration):
        p.next()


def test_the_producer_runs_at_most_depth_items_ahead():
    made = []

    def produce():
        for i in range(10):
            made.append(i)
            yield i

    p = Producer(produce, depth=2, name="t-depth")
    time.sleep(0.3)
    assert len(made) <= 3, made  # two queued, one waiting to be handed over
    assert p.next() == 0
    p.close(timeout=5)


def test_the_producers_exception_is_raised_in_the_consumer():
    def produce():
        yield 1
        raise ValueError("bad row 7")

    p = Producer(produce, depth=4, name="t-raise")
    assert p.next() == 1
    with pytest.raises(ValueError, match="bad row 7"):
        p.next()


def test_close_stops_a_blocked_producer():
    p = Producer(lambda: iter(range(1000)), depth=1, name="t-close")
    assert p.next() == 0
    p.close(timeout=5)
    assert not any(t.name == "t-close" for t in threading.enumerate())
