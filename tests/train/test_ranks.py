"""`train --gpus` stopped by a signal: two launched CPU ranks (gloo) behave as one process does.

The CLI runs in a subprocess in a process group of its own, so that a test can signal the whole
group as a terminal's Ctrl-C does, or the launching process alone as a scheduler's SIGTERM does.
Functions a launched rank runs are defined at module level: ranks import them by name (and
so does the slow-steps test's launching process). So the top of this module imports nothing those
processes do not load anyway; helpers of other test modules (the trainer's, extraction's, which load
the trainer and more) are imported where they are used.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from click.testing import CliRunner
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel

from dflash_cache.cli import cli
from dflash_cache.train import ranks
from dflash_cache.train.checkpoint import list_checkpoints

if TYPE_CHECKING:
    from dflash_cache.train.run_config import TrainConfig

REPO = Path(__file__).resolve().parents[2]
INTERRUPTED = re.compile(r"^Interrupted: checkpoint saved at step (\d+); continue with --resume\.$")
STOPPED_AT_ONCE = "Stopped without saving the last steps; --resume continues from the last checkpoint."

TWO_CPU_RANKS = """
import os, signal, sys, torch
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if our runner ignores it
from dflash_cache.train import ranks
ranks.gpu_devices = lambda _spec: [torch.device("cpu")] * 2
if os.environ.get("SLOW_STEPS"):
    from tests.train.test_ranks import slow_train_rank
    ranks.train_rank = slow_train_rank
from dflash_cache.cli import cli
try:
    cli(sys.argv[1:])
finally:  # the launcher trains nowhere itself: only its ranks load the trainer and the models
    if "dflash_cache.train.trainer" in sys.modules:
        print("the launching process loaded the trainer", file=sys.stderr)
"""


def slow_train_rank(cfg: TrainConfig, gpus: str, *, device: torch.device, echo) -> object:
    """A training rank whose steps take half a second (each forward of its DDP model waits first), so
    that two signals land in one step."""
    def wait(module: torch.nn.Module, _args: object) -> None:
        if isinstance(module, DistributedDataParallel):
            time.sleep(0.5)

    register_module_forward_pre_hook(wait)
    return ranks.train_rank(cfg, gpus, device=device, echo=echo)


def _endless() -> list[str]:
    """The two-rank run of the trainer's tests, long enough to be interrupted, a row every step, no
    checkpoint but the one a signal asks for."""
    from tests.train.test_trainer import TWO_RANK_RUN

    return [*TWO_RANK_RUN, "--max-steps", "100000", "--log-every", "1", "--save-every", "100000"]


def _start(demo_cache: Path, out: Path, tmp_path: Path, **env: str) -> tuple[subprocess.Popen, Path]:
    """`train --gpus all` on two CPU ranks in a new session; returns it and the file its stderr goes to
    (a file, not a pipe: a pipe nobody reads would stall the ranks' logging)."""
    err = tmp_path / "stderr.txt"
    with err.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", TWO_CPU_RANKS, "train", "--cache", str(demo_cache),
                                 "--out", str(out), *_endless(), "--gpus", "all"], cwd=REPO, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=sink, text=True, env={**os.environ, **env})
    return proc, err


def _wait_for_a_row(proc: subprocess.Popen, out: Path, err: Path, timeout: float = 60) -> None:
    """Wait until the run has logged a step (so it is training, not starting), and insist it still runs."""
    deadline = time.time() + timeout
    metrics = out / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and metrics.read_text().strip():
            break
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before it could be stopped:\n{err.read_text()}"
    assert metrics.is_file(), f"no metrics row in time:\n{err.read_text()}"


def _ended(proc: subprocess.Popen, err: Path, timeout: float = 60) -> tuple[int, list[str]]:
    from tests.extract.test_launch import _group_ends

    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"the run did not end in {timeout} s:\n{err.read_text()}")
    assert _group_ends(proc.pid), "a rank outlived the stopped run"
    return proc.returncode, err.read_text().splitlines()


def _checkpointed_step(code: int, lines: list[str], out: Path) -> int:
    """The step the one 'Interrupted' line names, checked against the newest checkpoint and the rows;
    rank 0 alone says that the stop was heard and where the run stopped."""
    said = "\n".join(lines)
    assert code == 130, said
    found = [m for line in lines if (m := INTERRUPTED.match(line))]
    assert len(found) == 1 and lines[-1] == found[0].group(0), said
    assert "Traceback" not in said and "Error" not in said and STOPPED_AT_ONCE not in said, said
    assert "the launching process loaded the trainer" not in said
    step = int(found[0].group(1))
    heard = [line for line in lines if "dflash_cache.train.interrupt: " in line]
    stopped = [line for line in lines if "dflash_cache.train.trainer: stopped at step" in line]
    assert len(heard) == 1 and heard[0].startswith("[rank 0] "), said
    assert len(stopped) == 1 and stopped[0].startswith("[rank 0] ") and f"stopped at step {step} " in stopped[0], said
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == [f"step_{step:07d}"], said
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == step, "the rows reach the checkpoint's step and no further"
    return step


def test_ctrl_c_stops_every_rank_at_one_step_with_a_checkpoint_that_resume_continues(demo_cache, tmp_path, caplog):
    """Ctrl-C reaches the launcher and both ranks (one process group): one checkpoint at the step both
    ranks stopped at, exit status 130 with the single-process line, and --resume goes on from there."""
    out = tmp_path / "run"
    proc, err = _start(demo_cache, out, tmp_path)
    _wait_for_a_row(proc, out, err)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: signal the whole foreground group
    step = _checkpointed_step(*_ended(proc, err), out)
    with caplog.at_level("INFO"):
        r = CliRunner().invoke(cli, ["train", "--cache", str(demo_cache), "--out", str(out), *_endless(),
                                     "--max-steps", str(step + 1), "--device", "cpu", "--resume"])
    assert r.exit_code == 0, r.output
    assert any(m.startswith(f"resumed from {out / 'checkpoints' / f'step_{step:07d}'} (step {step},")
               for m in caplog.messages), caplog.messages
    assert f"done: step {step + 1}," in r.output


def test_sigterm_to_the_launcher_alone_stops_the_ranks_with_a_checkpoint(demo_cache, tmp_path):
    """A scheduler's SIGTERM to the launching process only: the ranks, which did not get it, are asked
    to stop, and stop as on Ctrl-C."""
    out = tmp_path / "run"
    proc, err = _start(demo_cache, out, tmp_path)
    _wait_for_a_row(proc, out, err)
    os.kill(proc.pid, signal.SIGTERM)
    _checkpointed_step(*_ended(proc, err), out)


def test_a_second_ctrl_c_stops_everything_at_once_without_saving(demo_cache, tmp_path):
    """Two Ctrl-Cs within one (slow) step: no checkpoint, every process gone within seconds, exit
    status 130 with the line that says the last steps were not saved."""
    out = tmp_path / "run"
    proc, err = _start(demo_cache, out, tmp_path, SLOW_STEPS="1")
    _wait_for_a_row(proc, out, err)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    t0 = time.perf_counter()
    code, lines = _ended(proc, err, timeout=20)
    said = "\n".join(lines)
    assert time.perf_counter() - t0 < 10, said
    # (the line may be followed by multiprocessing's resource tracker counting what the killed ranks left)
    assert code == 130 and lines.count(STOPPED_AT_ONCE) == 1, said
    assert "Traceback" not in said and not list_checkpoints(out / "checkpoints"), said
    assert "the launching process loaded the trainer" not in said
