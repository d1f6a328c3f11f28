"""The launcher on the CPU: ranks started by torch's elastic launcher with gloo, as on GPUs.

Functions a launched rank runs are defined at module level: a rank (forked or spawned) imports them by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dflash_cache.errors import UserError
from dflash_cache.launch import STOP_REQUEST, RankFailed, launch
from tests.conftest import REPO

TWO_CPUS = [torch.device("cpu"), torch.device("cpu")]
Echo = Callable[[str], None]
DISK_FULL = "disk full while writing to the cache; free space and run the same command again"
pytestmark = pytest.mark.usefixtures("preloaded_ranks")  # ranks fork from one server holding their modules


def note_device(folder: str, *, device: torch.device, echo: Echo) -> None:
    """A rank that writes down what it was given and joins the others, as extraction ranks do."""
    dist.init_process_group("gloo")
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    (Path(folder) / f"rank-{dist.get_rank()}").write_text(f"{device} {env}")
    echo(f"rank {dist.get_rank()} says hello")
    dist.barrier()
    dist.destroy_process_group()


def rank_1_fails(kind: str, *, device: torch.device, echo: Echo) -> None:
    """Rank 1 fails as `kind` says; rank 0 would work for a minute ('user') or waits for rank 1 ('bug')."""
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise UserError(DISK_FULL) if kind == "user" else RuntimeError("simulated bug\nsecond line of its message")
    if kind == "user":
        time.sleep(60)
    dist.barrier()  # fails when rank 1 dies: an error of rank 0's own that must not be reported


def test_each_rank_gets_its_device_and_the_parent_is_left_as_it_was(tmp_path):
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    environ = dict(os.environ)
    said = []
    launch(note_device, (str(tmp_path),), [torch.device("cpu", 1), torch.device("cpu", 0)], echo=said.append)
    assert sorted(said) == ["rank 0 says hello", "rank 1 says hello"]
    got = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert got["rank-0"].startswith("cpu:1 ") and got["rank-1"].startswith("cpu:0 ")
    assert "'LOCAL_RANK': '1', 'WORLD_SIZE': '2', 'MASTER_ADDR'" in got["rank-1"]
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    assert dict(os.environ) == environ


def test_a_rank_user_error_stops_the_others_and_comes_back_as_its_one_line(capfd):
    t0 = time.perf_counter()
    with pytest.raises(RankFailed) as failed:
        launch(rank_1_fails, ("user",), TWO_CPUS, crash_hint="never shown for a UserError")
    assert time.perf_counter() - t0 < 30, "rank 0 was not stopped"
    assert str(failed.value) == DISK_FULL and isinstance(failed.value, UserError)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "failed (exitcode" not in err, err


def test_an_unexpected_exception_shows_its_traceback_then_one_line(capfd):
    with pytest.raises(RankFailed) as failed:
        launch(rank_1_fails, ("bug",), TWO_CPUS, crash_hint="run it again")
    assert str(failed.value) == ("rank 1 on cpu failed with RuntimeError: simulated bug (traceback above); "
                                 "run it again")
    err = capfd.readouterr().err
    assert "[rank 1] " in err and "Traceback" in err and "RuntimeError: simulated bug" in err, err
    assert "[rank 0] " not in err, "rank 0 was stopped by rank 1's failure: that is not an error of its own"


def _ready_until_asked(echo: Echo, signals: tuple[int, ...]) -> list[int]:
    """Handle `signals` by noting them, say "ready", and wait (30 s at most) for the first; returns
    the signals noted."""
    asked: list[int] = []
    for sig in signals:
        signal.signal(sig, lambda signum, _frame: asked.append(signum))
    echo("ready")
    deadline = time.time() + 30
    while not asked and time.time() < deadline:
        time.sleep(0.01)
    return asked


def wait_to_be_asked(*, device: torch.device, echo: Echo) -> int:
    """An interruptible rank that says it is ready, then runs until asked to stop; returns its rank."""
    asked = _ready_until_asked(echo, (STOP_REQUEST,))
    assert asked == [STOP_REQUEST], asked  # no SIGTERM from elastic either: that would have ended this rank
    return int(os.environ["RANK"])


def test_interruptible_ranks_are_asked_to_stop_once_and_what_they_return_comes_back():
    """A SIGTERM to the parent of interruptible ranks is not elastic's to act on (it would end them):
    each rank gets one stop request, ends as it chooses, and launch returns what each returned."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    said = []

    def echo(line: str) -> None:
        said.append(line)
        if said.count("ready") == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    assert launch(wait_to_be_asked, (), TWO_CPUS, echo=echo, interruptible=True) == [0, 1]
    assert {s: signal.getsignal(s) for s in handlers} == handlers



def rank_0_dies(*, device: torch.device, echo: Echo) -> int:
    """Rank 0 is killed (saying its process id first), as a Ctrl-C at start-up ends a rank; rank 1 runs
    until asked to stop."""
    if os.environ["RANK"] == "0":
        echo(f"rank 0 dies {os.getpid()}")
        os.kill(os.getpid(), signal.SIGKILL)
    return wait_to_be_asked(device=device, echo=echo)


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie not yet reaped counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_stop_asked_once_a_rank_died_ends_the_run_at_once():
    """A Ctrl-C reaches the parent after it ended a rank (the terminal signals every process; a rank
    still starting up ends at once): the stop request the parent then passes on must not wait for the
    dead rank. It did, forever, on a multiprocessing Event, whose set() waits for every thread that
    waited on it to say it woke, the dead rank's too."""
    def echo(line: str) -> None:
        if line.startswith("rank 0 dies"):
            pid = int(line.split()[-1])
            deadline = time.time() + 30
            while not _gone(pid) and time.time() < deadline:
                time.sleep(0.005)
            os.kill(os.getpid(), signal.SIGINT)

    def hung(_signum: int, _frame: object) -> None:
        raise TimeoutError("the stop request waited for the dead rank")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        with pytest.raises((RankFailed, KeyboardInterrupt)):
            launch(rank_0_dies, (), TWO_CPUS, echo=echo, interruptible=True)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_stop_asked_while_the_ranks_start_ends_the_run():
    """A Ctrl-C (or a SIGTERM to the launcher alone) while the ranks start: each rank sees the stop
    request the moment it begins. Its KeyboardInterrupt came before the rank's own handling was in
    place, so torch's wrapper ended the rank with status 0 and no return value, which elastic then
    waited on for ever: this test hung each time."""
    def hung(_signum: int, _frame: object) -> None:
        raise TimeoutError("the run hung after a stop asked while its ranks started")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    ask = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
    try:
        ask.start()
        try:
            returned = launch(wait_to_be_asked, (), TWO_CPUS, interruptible=True)
        except KeyboardInterrupt:  # the ranks were stopped before their function began
            returned = None
        assert returned in (None, [0, 1]), returned
    finally:
        ask.cancel()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_stop_request_that_lands_with_the_ctrl_c_is_ignored_not_an_error():
    """A rank's Ctrl-C and the parent's stop request can arrive together: the first handled ends the
    rank (KeyboardInterrupt) and the other must then be ignored quietly. Swapping the handler to
    SIG_IGN under a pending signal made Python raise "OSError: Signal 10 ignored due to race
    condition" instead, a traceback in a run stopped while starting up."""
    from dflash_cache.launch import _interrupted

    both = {signal.SIGINT, STOP_REQUEST}
    previous = {sig: signal.signal(sig, _interrupted) for sig in both}
    try:
        with pytest.raises(KeyboardInterrupt):
            signal.pthread_sigmask(signal.SIG_BLOCK, both)
            for sig in both:
                os.kill(os.getpid(), sig)  # both pending: both handlers are due at once when unblocked
            signal.pthread_sigmask(signal.SIG_UNBLOCK, both)
            for _ in range(1000):  # bytecodes, where Python runs what is due
                time.sleep(0)
        for _ in range(1000):
            time.sleep(0)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, both)
        for sig, handler in previous.items():
            signal.signal(sig, handler)



def say_what_was_inherited(*, device: torch.device, echo: Echo) -> None:
    """A rank that tells what it inherited: a variable through echo, and a line on each stream."""
    echo(f"rank {os.environ['RANK']} sees {os.environ.get('DFLASH_TEST_VALUE')}")
    print(f"stdout of rank {os.environ['RANK']}", flush=True)
    print(f"stderr of rank {os.environ['RANK']}", file=sys.stderr, flush=True)


def test_ranks_take_the_environment_and_streams_the_launcher_has_at_each_launch(monkeypatch, capfd):
    """CPU ranks are forked from a server that the first launch of this process started: they must
    still see the launcher's environment and standard streams as they are now (a later variable, this
    test's capture), as spawned ranks did, not as they were when the server started."""
    launch(say_what_was_inherited, (), TWO_CPUS)  # the server is running from here on, if not before
    capfd.readouterr()
    said = []
    monkeypatch.setenv("DFLASH_TEST_VALUE", "set after the server started")
    launch(say_what_was_inherited, (), TWO_CPUS, echo=said.append)
    assert sorted(said) == [f"rank {r} sees set after the server started" for r in (0, 1)]
    out, err = capfd.readouterr()
    assert "stdout of rank 0" in out and "stdout of rank 1" in out, out
    assert "stderr of rank 0" in err and "stderr of rank 1" in err, err


def say_whether_loaded(module: str, *, device: torch.device, echo: Echo) -> None:
    echo(f"{module} loaded: {module in sys.modules}")


def test_ranks_fork_from_a_server_that_holds_the_modules_preloaded_for_them():
    """This module's ranks import no trainer (this module does not), yet find it loaded: the server they
    fork from was started by `preload_cpu_ranks` (tests/conftest.py's `preloaded_ranks`) with it."""
    said = []
    launch(say_whether_loaded, ("dflash_cache.train.trainer",), TWO_CPUS, echo=said.append)
    assert said == ["dflash_cache.train.trainer loaded: True"] * 2


def stop_at_a_signal(*, device: torch.device, echo: Echo) -> int:
    """An interruptible rank as training's are: a SIGTERM or SIGHUP of its own, or the parent's stop
    request, asks it to stop; it then returns its rank."""
    asked = _ready_until_asked(echo, (signal.SIGTERM, signal.SIGHUP, STOP_REQUEST))
    assert asked, "never asked to stop"
    return int(os.environ["RANK"])


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_a_signal_to_the_process_group_lets_the_ranks_stop_as_they_choose(name):
    """Slurm (SIGTERM) and closing terminals (SIGHUP) signal every process of the group, the helpers
    too: they must outlive the signal. Had the server that forks CPU ranks died, the parent would have
    read every rank it forked as ended (status 255) and killed them mid-checkpoint; a killed resource
    tracker, restarted, printed a KeyError traceback for each semaphore the ranks released."""
    script = ("import torch; from dflash_cache.launch import launch; from tests.dflash_cache.test_launch import "
              "stop_at_a_signal; print('returned', launch(stop_at_a_signal, (), [torch.device('cpu')] * 2, "
              "echo=print, interruptible=True), flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        ready = 0
        while ready < 2 and (line := proc.stdout.readline()):
            ready += line.strip() == "ready"
        assert ready == 2, proc.stderr.read() if proc.stderr else ""
        os.killpg(proc.pid, getattr(signal, name))
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0 and "returned [0, 1]" in out, (proc.returncode, out, err)
    assert "Traceback" not in err, err
