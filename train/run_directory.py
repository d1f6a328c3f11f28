"""A training run's directory, and the leftovers a killed run can leave in it.

    out/
        .lock              held by the run writing it (one run per directory)
        config.yaml        the run's options (`train --config` runs it again), versions in its header
        metrics.jsonl      one row per logging window (rewritten atomically when a resume truncates it)
        checkpoints/       step_N/ (dflash_cache.train.checkpoint)
        export/            the drafter for serving (dflash_cache.train.export)

Files are replaced by writing `name.PID.tmp` beside them and renaming it; a kill in between leaves
the temporary file. The run that takes the lock next removes them (and finishes or undoes a
checkpoint rotation), so the export directory a user ships holds only what its config names.
"""

from __future__ import annotations

import logging
from pathlib import Path

from dflash_cache.config_files import RUN_CONFIG_FILE
from dflash_cache.files import remove_tmp_files
from dflash_cache.train.checkpoint import tidy_checkpoints

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
EXPORT_DIR = "export"
METRICS_FILE = "metrics.jsonl"


def tidy(out: Path) -> list[str]:
    """Remove what an interrupted run left half written under `out` (hold its lock); returns the
    paths removed, relative to `out`, and says so in one line."""
    removed = [f"{CHECKPOINTS_DIR}/{name}" for name in tidy_checkpoints(out / CHECKPOINTS_DIR)]
    removed += remove_tmp_files(out, stems=[name.split(".")[0] for name in (METRICS_FILE, RUN_CONFIG_FILE)])
    removed += [f"{EXPORT_DIR}/{name}" for name in remove_tmp_files(out / EXPORT_DIR)]
    if removed:
        shown = ", ".join(removed[:5]) + (f" and {len(removed) - 5} more" if len(removed) > 5 else "")
        log.info("removed %d leftover(s) of an interrupted run from %s: %s", len(removed), out, shown)
    return removed
