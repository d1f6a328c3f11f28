"""A producer thread feeding a consumer through a bounded queue: the shape of the extraction
reader (dataset rows -> host batches) and of the live source's target workers (rows -> features).

The queue's bound is the back-pressure that keeps memory flat; an exception in the producer is
raised in the consumer, a producer that dies without saying why is an error rather than a hang,
and `close()` stops the producer at its next hand-over.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
_POLL_S = 0.1


class _Finished:
    """Put after the last item."""


class _Raised:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Producer(Generic[T]):
    """Runs `produce()` on a daemon thread named `name`, at most `depth` items ahead of `next()`."""

    def __init__(self, produce: Callable[[], Iterator[T]], *, depth: int, name: str) -> None:
        self._queue: queue.Queue[T | _Finished | _Raised] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._run, args=(produce,), name=name, daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return self._thread.name

    def _run(self, produce: Callable[[], Iterator[T]]) -> None:
        try:
            for item in produce():
                if not self._put(item):
                    return
            self._put(_Finished())
        except BaseException as e:  # raised in the consumer by next()
            self._put(_Raised(e))

    def _put(self, item: T | _Finished | _Raised) -> bool:
        """Hand `item` over, waiting for room; False once the consumer has closed."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def next(self) -> T:
        """The next item; StopIteration after the last; the producer's exception if it raised one."""
        while not self._finished:
            try:
                item = self._queue.get(timeout=10 * _POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError(f"{self.name} exited without finishing") from None
                continue
            if isinstance(item, _Finished | _Raised):
                self._finished = True
                if isinstance(item, _Raised):
                    raise item.exc
            elif not self._finished:
                return item
        raise StopIteration

    def __iter__(self) -> Iterator[T]:
        while True:
            try:
                yield self.next()
            except StopIteration:
                return

    def close(self, timeout: float | None = None) -> None:
        """Stop the producer at its next hand-over; with `timeout`, wait that long for it to end."""
        self._stop.set()
        if timeout is not None:
            self._thread.join(timeout)
