"""Deferred interrupts (dflash_cache.train.interrupt) while the main thread is inside one long torch op,
where Python runs no signal handler until the op returns: the first signal is answered at once on
the terminal, and a second ends the process at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import REPO

# A step that is one long torch call (as a CPU backward at default sizes is): minutes of matrix products.
_STUCK_IN_TORCH = textwrap.dedent("""
    import logging, sys, torch
    from dflash_cache.train.interrupt import DeferredInterrupt
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    torch.set_num_threads(1)
    x = torch.ones(4096, 4096)
    with DeferredInterrupt():
        print("in the step", file=sys.stderr, flush=True)
        for _ in range(1000):
            torch.linalg.matrix_power(x, 200)  # one call of ~2.7 TFLOP: a minute or more on a CPU
    print("the step ended", file=sys.stderr, flush=True)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_ends_a_step_stuck_in_torch_at_once(sig, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _STUCK_IN_TORCH], cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stderr.readline().strip() == "in the step"
    time.sleep(0.5)  # inside the long call now
    proc.send_signal(sig)
    first = proc.stderr.readline()
    assert "received: finishing the current step" in first and "again to stop at once" in first, first
    t0 = time.perf_counter()
    proc.send_signal(sig)
    rest = proc.communicate(timeout=30)[1]
    assert time.perf_counter() - t0 < 5, "the second signal must end the process within seconds"
    assert proc.returncode == 130, (proc.returncode, rest)
    assert "stopping now" in rest and "the step ended" not in rest, rest


@pytest.mark.parametrize("order", ["request first", "signal first"])
def test_one_ctrl_c_that_reaches_a_rank_twice_is_said_once(order, caplog):
    """A launched rank gets a Ctrl-C from the terminal and the launcher's stop request for the same
    Ctrl-C, in either order: one line says the stop (and how to stop at once), and the run stops at
    its step boundary, not at once."""
    from dflash_cache.launch import STOP_REQUEST
    from dflash_cache.train.interrupt import DeferredInterrupt

    signals = [STOP_REQUEST, signal.SIGINT] if order == "request first" else [signal.SIGINT, STOP_REQUEST]
    with caplog.at_level("INFO", logger="dflash_cache.train.interrupt"), DeferredInterrupt() as stop:
        for sig in signals:
            os.kill(os.getpid(), sig)
            time.sleep(0.1)  # the watcher thread reads each signal's wakeup byte in turn
        deadline = time.time() + 5
        while time.time() < deadline and not caplog.records:
            time.sleep(0.01)
        time.sleep(0.1)
    said = [r for r in caplog.records if r.levelname == "WARNING"]
    assert stop.requested and len(said) == 1, [r.getMessage() for r in caplog.records]
    assert "Ctrl-C again to stop at once without saving" in said[0].getMessage()
