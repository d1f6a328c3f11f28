"""Where a training runs: one process (`--device`), or one rank per device of this host (`--gpus`).

`--gpus 0,2` (or `all`) starts one rank per GPU through `dflash_cache.launch`, the launcher extract
starts its ranks with, which gives each rank exactly the environment torchrun gives its own: every
rank then runs `trainer.train` as it does under torchrun, DDP over NCCL on GPUs and over gloo on
CPUs. A `--gpus` that names one device (`cpu`, or `all` on a host with one GPU or none) runs in this
process. Under torchrun the ranks are torchrun's, so `--gpus` is refused there; `--device` picks
each rank's device as before. Rank 0's result line comes back through the launcher, to where a
single process prints it.

A Ctrl-C or SIGTERM stops the ranks as it stops one process: the launcher starts them interruptible
(dflash_cache.launch), so each rank's first signal stops it at the step boundary the ranks agree on,
where rank 0 saves a checkpoint; a rank then returns where it stopped instead of raising, and this
process raises `TrainingInterrupted` for it. (A rank that exited with it would make the launcher stop
the others, mid-way through their own ending.) A second signal stops every rank at once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from dflash_cache.devices import gpu_devices, torchrun_env
from dflash_cache.errors import UserError
from dflash_cache.launch import launch
from dflash_cache.train.interrupt import TrainingInterrupted
from dflash_cache.train.run_config import TrainConfig
from dflash_cache.train.run_directory import EXPORT_DIR

log = logging.getLogger(__name__)
RESUME_HINT = "--resume continues from the last checkpoint"
TRAINER_MODULES = ("dflash_cache.train.trainer",)  # what a rank imports to train: loaded once for all CPU ranks


def run_training(cfg: TrainConfig, device: str = "auto", gpus: str | None = None,
                 echo: Callable[[str], None] = log.info) -> None:
    """The whole run, on `--device` in this process or on the devices `--gpus` names; `echo` shows
    its result line (the CLI passes click.echo)."""
    if gpus is None:  # one process, or one rank of torchrun's
        _train(cfg, device, echo=echo)
        return
    if device != "auto":
        raise UserError(f"--gpus {gpus} and --device {device} both say where to train: keep --gpus for one rank "
                        "per device, or --device for one process")
    if torchrun_env() is not None:
        raise UserError("--gpus starts its own ranks, and torchrun started this one: drop --gpus (each torchrun rank "
                        "trains on --device, by default its LOCAL_RANK's GPU)")
    train_on(cfg, gpu_devices(gpus), gpus, echo)


def train_on(cfg: TrainConfig, devices: list[torch.device], gpus: str,
             echo: Callable[[str], None] = log.info) -> None:
    """Train on `devices`: one runs in this process, several as one launched rank each (the same
    device may repeat); either way `echo` is called here, in this process."""
    if len(devices) == 1:
        _train(cfg, str(devices[0]), gpus=gpus, echo=echo)
    else:
        stopped = launch(train_rank, (cfg, gpus), devices, echo=echo, crash_hint=RESUME_HINT, interruptible=True,
                         preload=TRAINER_MODULES)[0]
        if stopped is not None:
            raise TrainingInterrupted(*stopped)


def train_rank(cfg: TrainConfig, gpus: str, *, device: torch.device,
               echo: Callable[[str], None]) -> tuple[int, str | None] | None:
    """What each launched rank runs: torchrun's environment says its rank, `device` its device.
    Returns None when the run ended, or the step and checkpoint where a signal stopped it."""
    try:
        _train(cfg, str(device), gpus=gpus, echo=echo)
    except TrainingInterrupted as e:
        return e.step, e.checkpoint
    return None


def _train(cfg: TrainConfig, device: str, gpus: str | None = None, *, echo: Callable[[str], None]) -> None:
    """`trainer.train`, then its result line through `echo` on rank 0 (torchrun's ranks each run the
    command: the others would repeat it). The trainer is imported here: a launching process that trains
    nowhere itself (`--gpus` with several devices) never loads it and the models it imports."""
    from dflash_cache.train.trainer import train

    line = result_line(cfg, train(cfg, device, gpus=gpus))
    if int(os.environ.get("RANK", 0)) == 0:
        echo(line)
    else:
        log.debug("%s", line)


def result_line(cfg: TrainConfig, last: dict | None) -> str:
    """What a finished run says: its last logged window and where it exported the drafter."""
    export = Path(cfg.out) / EXPORT_DIR
    if not last:
        return f"nothing to train: {cfg.out} is already at its last step; exported to {export}"
    shown = f"loss {last['loss']:.4f}, tau_hat {last['tau_hat']:.3f}" if last["loss"] is not None else \
        "every step of the last window skipped (gradients not finite)"
    return f"done: step {last['step']}, {shown}; exported to {export}"
