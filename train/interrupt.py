"""Stopping a training run only between steps.

A Ctrl-C (SIGINT) or a scheduler's SIGTERM that lands inside a step would leave it half done: the
anchor RNG advanced, some parameters updated, while the step counter still names the step before.
A checkpoint taken then cannot resume bit-exactly. So while training runs, the first such signal
only sets a flag: the trainer finishes the step in flight, saves at the step boundary and raises
`TrainingInterrupted`. A second Ctrl-C interrupts at once, without saving.

The launcher of `train --gpus` ranks passes a signal it gets on to them as a stop request
(dflash_cache.launch.STOP_REQUEST, SIGUSR1): it asks for the same stop but never counts as the
second signal, since the ranks may have got the same Ctrl-C (or a group's SIGTERM) themselves.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from dflash_cache.launch import STOP_REQUEST

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt):
    """Raised at a step boundary after a deferred signal, once the checkpoint is written."""

    def __init__(self, step: int, checkpoint: str | None) -> None:
        super().__init__(f"interrupted at step {step}")
        self.step, self.checkpoint = step, checkpoint


class DeferredInterrupt:
    """`with DeferredInterrupt() as stop:` ... `if stop.requested:` save and leave.

    Python runs a signal handler only between bytecodes of the main thread, so one inside a long
    torch call (a CPU step's backward can take minutes) waits for the call to return. So the C-level
    handler's wakeup byte (`signal.set_wakeup_fd`) is also read by a thread of its own, which answers
    at once: the first signal is said on the terminal (what the run waits for), and a second ends the
    process there and then with exit status 130, without saving: the last checkpoint stays the
    resume point. The Python handler only sets the flag the trainer reads at step boundaries.

    Handlers are installed only in the main thread (signals are delivered there); elsewhere the
    context does nothing and a KeyboardInterrupt behaves as usual.

    `finishing`: what the first signal waits for, as its line says. `say`: whether this process says
    what the signals do (rank 0 does, for every rank; another rank logs it at debug level only).
    """

    def __init__(self, finishing: str = "finishing the current step, then saving a checkpoint",
                 *, say: bool = True) -> None:
        self.finishing = finishing
        self.level = logging.WARNING if say else logging.DEBUG
        self.signum: int | None = None
        # each signal's handler before ours: a function, SIG_DFL or SIG_IGN, or None (not set from Python)
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | signal.Handlers | None] = {}
        self._previous_wakeup: int | None = None
        self._pipe: tuple[int, int] | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            read_end, write_end = os.pipe()
            os.set_blocking(write_end, False)
            self._pipe = (read_end, write_end)
            self._previous_wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
            threading.Thread(target=self._watch, args=(read_end,), name="dflash-interrupt", daemon=True).start()
            for sig in (*SIGNALS, STOP_REQUEST):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum

    def _watch(self, read_end: int) -> None:
        """The wakeup bytes, one per signal, as they arrive: say the first, end the process on the second
        (a stop request is said if it comes first, and never counted)."""
        seen, asked = 0, False  # signals counted; whether a stop request was said
        while True:
            try:
                data = os.read(read_end, 64)
            except OSError:
                return
            if not data:  # the write end closed: the context ended
                os.close(read_end)
                return
            for signum in data:
                if signum == STOP_REQUEST and not (seen or asked):
                    asked = True
                    self.signum = self.signum or signum
                    log.log(self.level, "the launcher asks every rank to stop: %s (Ctrl-C again to stop at once "
                            "without saving)", self.finishing)
                if signum not in SIGNALS:
                    continue
                seen += 1
                name = signal.Signals(signum).name
                if seen == 1:
                    self.signum = self.signum or signum
                    # after the launcher's request, this is most likely the same Ctrl-C (the terminal's
                    # group): the stop was said already
                    log.log(logging.DEBUG if asked else self.level, "%s received: %s (Ctrl-C again to stop at once "
                            "without saving)", name, self.finishing)
                else:
                    log.log(self.level, "%s received again: stopping now without saving; --resume continues from "
                            "the last checkpoint", name)
                    logging.shutdown()
                    os._exit(130)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_wakeup if self._previous_wakeup is not None else -1)
            read_end, write_end = self._pipe
            os.close(write_end)  # the watcher reads end-of-file, closes the read end and returns
            self._pipe = None
