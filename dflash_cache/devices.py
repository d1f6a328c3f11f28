"""Which devices a command runs on, and which rank this process is: the one resolver behind every
device flag.

Two spellings, one set of checks. `--gpus` (extract, train) and `--target-gpus` (train --live) name
devices by index, one rank or target each: 'all', 'cpu' or indices like 0,2,3 (`gpu_devices`,
`parse_gpus`). `--device` (train's single process, eval, regenerate) names one torch device: 'auto',
'cpu', 'cuda' or 'cuda:N' (`resolve_device`). Both check CUDA indices against the GPUs torch can see
in the same words, so a mistake reads the same whichever flag made it, as one line naming the fix.

A process started as one of several, by torchrun or by `dflash_cache.launch` (which gives its ranks
torchrun's environment), learns its rank from that environment (`torchrun_env`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from dflash_cache.errors import UserError

log = logging.getLogger(__name__)


def parse_gpus(spec: str, flag: str = "--gpus") -> list[int] | None:
    """'cpu' -> None; 'all' -> every visible GPU (None if there is none); '0,2,3' -> [0, 2, 3]."""
    spec = spec.strip().lower()
    if spec == "cpu":
        return None
    if spec == "all":
        n = torch.cuda.device_count()
        if n == 0:
            # A warning where torch cannot use the machine's GPU (a CPU build of torch, a driver problem);
            # on a machine without one, news.
            log.log(logging.WARNING if _machine_has_gpu() else logging.INFO,
                    "%s all: no CUDA device visible, running on the CPU", flag)
            return None
        return list(range(n))
    try:
        ids = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} {spec!r}: expected 'all', 'cpu' or comma-separated GPU indices like 0,2,3") from None
    _check_cuda_indices(f"{flag} {spec!r}", flag, ids)
    return ids


def gpu_devices(spec: str, flag: str = "--gpus") -> list[torch.device]:
    """`--gpus` as devices: the CPU for 'cpu' (or 'all' without a GPU), else one CUDA device per index."""
    ids = parse_gpus(spec, flag)
    return [torch.device("cpu")] if ids is None else [torch.device("cuda", i) for i in ids]


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """--device: 'auto' (the GPU if there is one; a launched or torchrun rank's own), 'cpu', 'cuda'
    (GPU `local_rank`) or 'cuda:i'; a wrong one is a UserError."""
    if spec == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {spec!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise UserError(f"--device {spec!r}: only cpu and cuda devices are supported")
    index = local_rank if dev.index is None else dev.index
    _check_cuda_indices(f"--device {spec}", "--device", [index])
    return torch.device("cuda", index)


def _check_cuda_indices(shown: str, flag: str, ids: list[int]) -> None:
    """`ids` must name GPUs torch can see; `shown` is the flag and value as the message quotes them."""
    n = torch.cuda.device_count()
    if n == 0:
        raise UserError(f"{shown}: no CUDA device is visible; use {flag} cpu")
    if not ids or any(not 0 <= i < n for i in ids):
        raise UserError(f"{shown}: {n} CUDA device(s) visible, so valid indices are 0..{n - 1}")


def _machine_has_gpu() -> bool:
    """Whether the system shows an NVIDIA or AMD GPU's device files, whatever torch can see."""
    return any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) when torchrun, or `dflash_cache.launch`, started this process as one of several."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def torchrun_device() -> torch.device:
    """torchrun's convention: local rank n uses GPU n (of those CUDA_VISIBLE_DEVICES shows)."""
    return resolve_device("auto", int(os.environ.get("LOCAL_RANK", 0)))
