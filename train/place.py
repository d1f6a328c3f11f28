"""Where a part of a run works: `Place`, the one set of settings every part of a process shares."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_cache.profiler import StageProfiler


@dataclass(frozen=True)
class Place:
    """Where a part of a run works: `device`, as rank `rank` of `world` processes, timed by `profiler`
    (a held-out evaluation's parts get an idle one: the run's profiler times training alone)."""

    device: torch.device
    rank: int = 0
    world: int = 1
    profiler: StageProfiler = field(default_factory=lambda: StageProfiler(None))
