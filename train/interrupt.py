"""Stopping a training run only between steps.

A Ctrl-C (SIGINT) or a scheduler's SIGTERM that lands inside a step would leave it half done: the
anchor RNG advanced, some parameters updated, while the step counter still names the step before.
A checkpoint taken then cannot resume bit-exactly. So while training runs, the first such signal
only sets a flag: the trainer finishes the step in flight, saves at the step boundary and raises
`TrainingInterrupted`. A second Ctrl-C interrupts at once, without saving.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt):
    """Raised at a step boundary after a deferred signal, once the checkpoint is written."""

    def __init__(self, step: int, checkpoint: str | None) -> None:
        super().__init__(f"interrupted at step {step}")
        self.step, self.checkpoint = step, checkpoint


class DeferredInterrupt:
    """`with DeferredInterrupt() as stop:` ... `if stop.requested:` save and leave.

    Handlers are installed only in the main thread (signals are delivered there); elsewhere the
    context does nothing and a KeyboardInterrupt behaves as usual.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # the second one: stop now
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("%s received: finishing the current step, then saving a checkpoint "
                    "(Ctrl-C again to stop at once without saving)", signal.Signals(signum).name)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
