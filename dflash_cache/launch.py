"""One process per device, started through torch's elastic launcher exactly as torchrun starts them.

`launch(fn, args, devices, echo=...)` runs `fn(*args, device=devices[LOCAL_RANK], echo=...)` in one
launched process per device, each with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, ...), so code written for a torchrun rank runs unchanged. A rank's `echo` sends each
line to the parent, which shows it with its own `echo` (stdout for the CLI): what a rank says to
the user comes out where a single-process run would put it. The launcher is single-node with a
private c10d rendezvous on a free port and no restarts: a failing rank stops the others at once.

Failures come back as one line. A rank that fails writes a small report (its UserError's message,
or the type and first line of an unexpected exception, whose traceback it logs itself) into a
directory only this launch uses; the parent raises the earliest report as `RankFailed`, a
UserError. Elastic's own failure logging, which would print tracebacks for user mistakes, is
silenced while it runs (unless debug logging is on).

Signals: elastic turns SIGINT/SIGTERM/SIGHUP/SIGQUIT in the parent into stopping the ranks (SIGTERM,
then SIGKILL after its shutdown timeout). The parent's own handlers are put back afterwards and the
signal raised again, so Ctrl-C still ends in KeyboardInterrupt. A signal this process ignores (SIGHUP
under nohup) stays ignored.

Ranks that stop on their own at a signal, at a point of their choosing (training's, which save a
checkpoint at the next step boundary), are launched with `interruptible=True`. A Ctrl-C already
reaches them from the terminal, so elastic stopping them too would be a second signal, the one that
means "stop at once". So the parent keeps SIGINT/SIGTERM/SIGHUP from elastic: the first one it gets
it passes on to every rank as STOP_REQUEST, a signal a rank's handler takes as "stop" but never
counts as a second one (a rank may have got the same Ctrl-C or group SIGTERM itself); the ranks
then end as they choose, their return values coming back from `launch`. A second signal ends the
ranks at once (SIGKILL) and `launch` raises KeyboardInterrupt, as it does when ranks ended on their
own with exit status 130 (a second Ctrl-C that reached them).

How ranks start: CPU ranks are forked from a server process that has torch and the modules the ranks
need already loaded (multiprocessing's forkserver, started once per launching process), so a rank
starts in a fraction of a second rather than importing torch afresh (1.3 s on a 2-core machine;
4.4 s with the trainer). GPU ranks are still spawned: a forkserver is safe for CUDA only while nothing in it has touched the
driver, and that has not yet been run on a GPU. A forked rank takes from the launcher, as of the
launch, what a spawned one inherits and the server may hold from an earlier time: the environment,
standard output and error (a redirect, a test's capture), and which stop signals are ignored. The
server (and multiprocessing's resource tracker, for either start) starts with the stop signals
blocked, so a signal to the whole process group (Slurm's SIGTERM, a closed terminal's SIGHUP) cannot
end it under the ranks it forked; they unblock them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from multiprocessing import reduction
from multiprocessing.context import BaseContext, get_spawning_popen
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from dflash_cache.errors import UserError, one_line
from dflash_cache.logs import setup_logging

log = logging.getLogger(__name__)
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # what elastic would handle by default
PASSED_ON = ("SIGINT", "SIGTERM", "SIGHUP")  # what the parent of interruptible ranks passes on, once
STOP_REQUEST = signal.SIGUSR1  # how: "stop at your next chance", never counted as a second signal
STOP_POLL_S = 0.05  # how often a rank looks whether the parent asks it to stop
INTERRUPTED = 130  # the exit status of a rank that a KeyboardInterrupt ended
CPU_START = "forkserver"  # how CPU ranks start (GPU ranks are spawned)
_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


class RankFailed(UserError):
    """A launched rank failed: its own UserError's message, or what killed it."""


@dataclass(frozen=True)
class Report:
    """What a failed rank tells the parent."""

    rank: int
    user_error: bool
    message: str
    time: float

    def write(self, folder: Path) -> None:
        tmp = folder / f"rank-{self.rank}.tmp"
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(folder / f"rank-{self.rank}.json")

    @classmethod
    def read_all(cls, folder: Path) -> list[Report]:
        return sorted((cls(**json.loads(p.read_text())) for p in folder.glob("rank-*.json")), key=lambda r: r.time)


def launch(fn: Callable[..., Any], args: tuple[Any, ...], devices: Sequence[torch.device], *,
           echo: Callable[[str], None] = log.info, crash_hint: str = "", interruptible: bool = False,
           preload: Sequence[str] = ()) -> list[Any]:
    """Run `fn(*args, device=..., echo=...)` once per device, each in its own launched rank (fn, args
    and what fn returns must pickle); the lines a rank echoes reach `echo` here. Returns what each
    rank's fn returned, in rank order.

    Raises RankFailed for the first rank that failed. `crash_hint` is appended when that was not a
    UserError (a bug or a kill), to say what the user can do next. `interruptible`: the ranks stop
    themselves at a signal (see the module's doc); a run they were told to stop at once raises
    KeyboardInterrupt. `preload`: modules fn imports when it runs, loaded once for every CPU rank
    (by the first launch of this process, which starts the server that forks them, unless
    `preload_cpu_ranks` started it earlier)."""
    handled = [name for name in STOP_SIGNALS if _handler(name) is not signal.SIG_IGN]
    ours = [name for name in handled if name in PASSED_ON] if interruptible else []
    forked = all(device.type == "cpu" for device in devices)
    context = multiprocessing.get_context(CPU_START if forked else "spawn")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=len(devices), run_id=f"dflash-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
        start_method=context.get_start_method(), signals_to_handle=",".join(n for n in handled if n not in ours),
    )
    _start_helpers(context, ["torch", fn.__module__, *preload])
    received = None
    stop = _StopRequests(ours, context) if interruptible else None
    inherited = _Inherited(dict(os.environ), tuple(name for name in STOP_SIGNALS if name not in handled))
    with (tempfile.TemporaryDirectory(prefix="dflash-ranks-") as tmp, _lines_to(echo, context) as lines,
          _parent_state_kept(handled)):
        try:
            level = logging.getLogger().getEffectiveLevel()
            with stop or contextlib.nullcontext():
                returned = elastic_launch(config, _rank_main)(fn, args, list(devices), lines, tmp, level,
                                                               stop.flag if stop else None, inherited)
        except ChildFailedError as e:
            if stop is not None and stop.at_once(e, Path(tmp)):
                raise KeyboardInterrupt from None
            raise _failure(e, Path(tmp), devices, crash_hint) from None
        except SignalException as e:
            if stop is not None and e.sigval == signal.SIGKILL:  # our second signal: the ranks are gone
                raise KeyboardInterrupt from None
            received = e.sigval
    if received is not None:  # the ranks are stopped and our handlers are back: react as we would have
        signal.raise_signal(received)
    return [returned[rank] for rank in range(len(devices))]


class _StopRequests:
    """The parent's handler of the signals it passes on to interruptible ranks (`with` it while they
    run): the first sets `flag`, which each rank turns into a STOP_REQUEST to itself; the second has
    elastic end the ranks at once.

    `flag` is a byte of shared memory the ranks poll, with no lock: a multiprocessing Event's set()
    waits for every thread waiting on it to say it woke, and the waiting thread of a rank that ended
    meanwhile never does (a Ctrl-C ends a rank still starting up at once, often before the parent's
    handler runs): the launcher hung there."""

    def __init__(self, names: list[str], context: BaseContext) -> None:
        self.signals = [getattr(signal, name) for name in names]
        self.flag = context.RawValue("b", 0)
        self.received = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopRequests:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.signals}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: object) -> None:
        self.received += 1
        name = signal.Signals(signum).name
        if self.received == 1:
            log.info("%s received: asking every rank to stop", name)
            self.flag.value = 1
            return
        log.warning("%s received again: stopping every rank at once", name)
        raise SignalException(f"{name} received twice", sigval=signal.SIGKILL)  # elastic: SIGKILL them all

    def at_once(self, error: ChildFailedError, reports: Path) -> bool:
        """Whether the ranks that failed were interrupted at once (a second signal; ranks that stop at
        a step boundary exit normally), rather than failing with something to report."""
        if Report.read_all(reports):
            return False
        return self.received > 0 or error.get_first_failure()[1].exitcode == INTERRUPTED


class _Lines:
    """A rank's `echo`: each line goes through a pipe to the parent."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def __call__(self, line: str) -> None:
        self.queue.put(line)


@contextlib.contextmanager
def _lines_to(echo: Callable[[str], None], context: BaseContext) -> Iterator[_Lines]:
    """A `_Lines` for the ranks, and a thread here handing what they send to `echo`, in order."""
    queue = context.SimpleQueue()

    def pump() -> None:
        while (line := queue.get()) is not None:
            try:
                echo(line)
            except Exception:  # keep draining: a rank must never block on a full pipe
                log.exception("could not show a line from rank 0: %s", line)

    thread = threading.Thread(target=pump, name="rank-lines", daemon=True)
    thread.start()
    try:
        yield _Lines(queue)
    finally:  # every rank has exited, so all it sent is in the pipe, ahead of the end mark
        queue.put(None)
        thread.join(timeout=10)
        queue.close()


def _rank_main(fn: Callable[..., Any], args: tuple[Any, ...], devices: list[torch.device], echo: _Lines,
               reports: str, log_level: int, stop: Any, inherited: _Inherited) -> Any:
    """A launched rank: the parent's logging with the rank in front, its device, a report if it fails.
    `stop`, for interruptible ranks: the byte the parent sets when the ranks are asked to stop.
    `inherited` has been applied already, as it was unpickled."""
    rank = int(os.environ["RANK"])
    setup_logging(log_level, prefix=f"[rank {rank}] ")
    folder = Path(reports)
    device = devices[int(os.environ["LOCAL_RANK"])]
    try:  # from the first handler on: a KeyboardInterrupt that escaped would end the rank "successfully"
        signal.signal(signal.SIGINT, _interrupted)
        if stop is not None:
            signal.signal(STOP_REQUEST, _interrupted)  # until fn handles it: stopped before it began
            threading.Thread(target=_request_stop_when, args=(stop,), name="stop-request", daemon=True).start()
        # Each rank's entry (extract's and train's) sets its threads, splitting a host's free cores.
        return fn(*args, device=device, echo=echo)
    except UserError as e:
        Report(rank, True, str(e), time.time()).write(folder)
        raise SystemExit(e.exit_code) from None
    except KeyboardInterrupt:  # the parent says so (torch's wrapper would end the rank with status 0)
        raise SystemExit(INTERRUPTED) from None
    except Exception as e:
        if Report.read_all(folder):  # another rank failed first and took the collectives down with it
            log.debug("rank %d stopped after another rank failed: %s", rank, e)
            raise SystemExit(1) from None
        log.exception("rank %d failed", rank)
        message = f"{type(e).__name__}: {one_line(e)}" if str(e).strip() else type(e).__name__
        Report(rank, False, message, time.time()).write(folder)
        raise SystemExit(1) from None


def preload_cpu_ranks(modules: Sequence[str]) -> None:
    """Start this process's server of CPU ranks now, with `modules` loaded. For a process that launches
    ranks of several kinds (a test session): otherwise its first launch's preload stays, and each later
    rank that needs more imports it afresh. Does nothing where the server runs already."""
    _start_helpers(multiprocessing.get_context(CPU_START), ["torch", *modules])


def _start_helpers(context: BaseContext, preload: list[str]) -> None:
    """Start multiprocessing's helper processes unless they run: the resource tracker (which removes
    the ranks' semaphores should they die) and, for forked ranks, this process's forkserver, which
    loads `preload` before it forks any rank (a running one keeps what its first launch loaded; a
    rank imports the rest itself). The stop signals are blocked while they start, and so stay
    blocked in them: a helper must outlive a signal to the process group (a closed terminal's SIGHUP
    killed the tracker, whose restart printed a KeyError for each semaphore it had not seen), which
    the ranks handle. One that comes here meanwhile is held, then handled as the block ends."""
    blocked = {getattr(signal, name) for name in STOP_SIGNALS}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        multiprocessing.resource_tracker.ensure_running()  # it unblocks SIGINT and SIGTERM as it starts
        if context.get_start_method() == CPU_START:
            context.set_forkserver_preload(preload)
            signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
            multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@dataclass(frozen=True)
class _Inherited:
    """What a rank takes from the launcher as of the launch: its environment and, through `ignored`,
    which stop signals it ignores (nohup's SIGHUP); with them its standard output and error. Applied
    when a rank unpickles it, which comes before elastic sets the rank's own variables (RANK, ...).
    A spawned rank has all of this already; one forked from the server has them as they were when
    the server started, and the server's blocked stop signals."""

    environ: dict[str, str]
    ignored: tuple[str, ...]

    def __reduce__(self) -> tuple[Any, ...]:
        if get_spawning_popen() is None:  # a copy would apply it here, to the launcher
            raise TypeError("_Inherited is pickled only to start a rank")
        return _inherit, (self.environ, self.ignored, reduction.DupFd(1), reduction.DupFd(2))


def _inherit(environ: dict[str, str], ignored: tuple[str, ...], stdout: Any, stderr: Any) -> _Inherited:
    """Make this rank's environment, standard streams and stop signals the launcher's (see `_Inherited`)."""
    os.environ.clear()
    os.environ.update(environ)
    for target, passed in ((1, stdout.detach()), (2, stderr.detach())):
        if passed != target:  # a spawned rank gets the launcher's stream under its own number
            os.dup2(passed, target)
            os.close(passed)
    stops = [getattr(signal, name) for name in STOP_SIGNALS]
    for sig in stops:  # SIGINT until `_rank_main` handles it: a Ctrl-C reaches the launcher too, which acts
        ignore = sig == signal.SIGINT or signal.Signals(sig).name in ignored
        signal.signal(sig, signal.SIG_IGN if ignore else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
    return _Inherited(environ, ignored)


def _interrupted(_signum: int, _frame: object) -> None:
    """Ctrl-C reaches a rank twice, from the terminal and then from the parent stopping it (or, for
    an interruptible rank, passing it on): the first one unwinds (finishing the segments being
    written), the second must not interrupt that. Later ones go to a handler that does nothing, not to
    SIG_IGN: one already due when the handler changes would make Python raise "Signal ... ignored due
    to race condition" (the terminal's Ctrl-C and the parent's stop request often come together)."""
    signal.signal(signal.SIGINT, _ignored)
    signal.signal(STOP_REQUEST, _ignored)
    raise KeyboardInterrupt


def _ignored(_signum: int, _frame: object) -> None:
    """A signal after the one that ends the rank: nothing more to do."""


def _request_stop_when(stop: Any) -> None:
    """Send this rank STOP_REQUEST once the parent sets the shared byte `stop` (at once if it was set
    before the rank started): what handles it here (the trainer's DeferredInterrupt) decides when to stop."""
    while not stop.value:
        time.sleep(STOP_POLL_S)
    os.kill(os.getpid(), STOP_REQUEST)


def _failure(error: ChildFailedError, reports: Path, devices: Sequence[torch.device], crash_hint: str) -> RankFailed:
    """The one line that says which rank failed first and why."""
    hint = f"; {crash_hint}" if crash_hint else ""
    found = Report.read_all(reports)
    if found:
        first = found[0]
        if first.user_error:
            return RankFailed(first.message)
        return RankFailed(f"rank {first.rank} on {devices[first.rank]} failed with {first.message} "
                          f"(traceback above){hint}")
    rank, failure = error.get_first_failure()
    how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with status {failure.exitcode}"
    where = f" on {devices[rank]}" if 0 <= rank < len(devices) else ""
    return RankFailed(f"rank {rank}{where} {how}{hint}")


def _handler(name: str) -> Any:
    return signal.getsignal(getattr(signal, name))


@contextlib.contextmanager
def _parent_state_kept(handled: list[str]) -> Iterator[None]:
    """Undo what elastic does to this process: its signal handlers, its environment variables and
    (unless debugging) its failure logging, which would show tracebacks for a user's mistake."""
    main_thread = threading.current_thread() is threading.main_thread()
    handlers = {name: h for name in handled if (h := _handler(name)) is not None} if main_thread else {}
    environ = dict(os.environ)
    quiet = logging.getLogger().getEffectiveLevel() > logging.DEBUG
    levels = _silence_elastic() if quiet else {}
    try:
        yield
    finally:
        for name, handler in handlers.items():
            signal.signal(getattr(signal, name), handler)
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _silence_elastic() -> dict[str, int]:
    """Raise elastic's loggers above CRITICAL (the parents too, for those made later); returns their
    levels before."""
    existing = [name for name, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger)]
    names = {*_ELASTIC_LOGGERS, *(n for n in existing if n.startswith(tuple(f"{p}." for p in _ELASTIC_LOGGERS)))}
    before = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    return before
