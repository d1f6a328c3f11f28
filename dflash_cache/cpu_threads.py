"""How many intra-op threads torch uses for a command's CPU work: the cores free now, not all of them.

torch starts one thread per core, and its OpenMP threads spin while they wait for each other. On a
machine where other jobs keep cores busy, threads left without a core of their own slow every op
far beyond what they could gain: on a 2-core machine beside other jobs, two threads ran 5 to 37
times slower than one (`eval` decoded 3.4 tokens/s against 125). So every command that runs torch
on the CPU (extract, train, eval, regenerate) takes the cores this process may run on (its
affinity), less those the 1-minute load average says are busy, and at least one. OMP_NUM_THREADS
chooses instead (`dflash-cache --cpu-threads N` sets it).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_cache.errors import UserError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ENV = "OMP_NUM_THREADS"
OVERRIDE = f"{ENV}=N or `dflash-cache --cpu-threads N <command>` chooses"
_said: int | None = None  # the thread count this process last said (`use_free_cores`)


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op threads for CPU work, and what decided them (for the log line)."""

    threads: int
    why: str


def choose_cpu_threads(share: int = 1) -> ThreadChoice:
    """OMP_NUM_THREADS if set; else the allowed cores less the busy ones, split over `share`
    processes that work on this CPU together (a host's ranks); at least one."""
    given = os.environ.get(ENV, "").strip()
    if given:
        first = given.split(",")[0].strip()  # OpenMP also takes a list, one count per nesting level
        if not first.isdigit() or int(first) < 1:
            raise UserError(f"{ENV}={given!r} is not a thread count; set it to a whole number >= 1 "
                            "(or unset it to use the free cores)")
        return ThreadChoice(int(first), f"{ENV}={given}")
    allowed = _allowed_cores()
    total = max(allowed, os.cpu_count() or allowed)
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this system: assume the cores are free
        load = 0.0
    # The load average counts busy cores of the whole machine; of ours, busy in proportion.
    busy = math.floor(load * allowed / total + 0.5)
    free = max(0, allowed - busy)
    threads = max(1, free // max(1, share))
    shared = f", split over {share} processes" if share > 1 else ""
    return ThreadChoice(threads, f"{free} of {allowed} cores free by the 1-minute load average {load:.2f}{shared}"
                                 f"{', at least one' if free < share else ''}")


def use_free_cores(device: torch.device, share: int = 1) -> int | None:
    """Set torch's intra-op threads for work on `device` when it is the CPU (`choose_cpu_threads`)
    and say so in one line; returns the count, or None for another device (left as it is).

    The line is said once per process (a process that extracts, then trains, sets its threads twice:
    a count already said is not said again) and, of the `share` ranks of a host, by its first
    (LOCAL_RANK 0): they split the same free cores the same way, so one line for all of them says
    what each does; the others' lines are debug logging (-v)."""
    global _said
    if device.type != "cpu":
        return None
    import torch

    choice = choose_cpu_threads(share)
    torch.set_num_threads(choice.threads)
    first = share == 1 or os.environ.get("LOCAL_RANK", "0").strip() in ("", "0")  # of the processes sharing
    level = logging.INFO if first and choice.threads != _said else logging.DEBUG
    log.log(level, "CPU work on %d torch thread%s%s (%s); %s", choice.threads, "" if choice.threads == 1 else "s",
            " per process" if share > 1 else "", choice.why, OVERRIDE)
    if level == logging.INFO:
        _said = choice.threads
    return choice.threads


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"
CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")  # cgroup v1: cpu.cfs_quota_us (-1: none) and cpu.cfs_period_us


def _allowed_cores() -> int:
    """The cores this process may run on: its affinity (all of them where that is not known), at
    most its container's CPU quota, rounded up (a container limited to 4 CPUs on a 96-core host sees
    all 96 in its affinity and is throttled past 4)."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cores = max(1, os.cpu_count() or 1)
    quota = _cgroup_quota()
    return min(cores, quota) if quota is not None else cores


def _cgroup_quota(cpu_max: Path | None = None, v1: Path | None = None) -> int | None:
    """The cgroup's CPU quota in whole cores, rounded up; None when there is none."""
    cpu_max, v1 = cpu_max or CGROUP_CPU_MAX, v1 or CGROUP_V1_CPU
    try:
        if cpu_max.is_file():
            quota, period = cpu_max.read_text().split()[:2]
        else:
            quota, period = ((v1 / name).read_text().strip() for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
        cores = int(quota) / int(period)
    except (OSError, ValueError):  # no cgroup file, "max" (no quota), or malformed
        return None
    return max(1, math.ceil(cores)) if cores > 0 else None  # v1 says -1 for no quota


__all__ = ["ENV", "ThreadChoice", "choose_cpu_threads", "use_free_cores"]
