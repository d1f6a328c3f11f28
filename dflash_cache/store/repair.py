"""Recovering caches: half-made ones (killed while being created) and damaged ones.

A new cache carries `.creating` from its first byte until its manifest is written, so a run that
finds the marker without a manifest knows the directory is its own unfinished work (no segment
can have been committed yet) and may make it again.

A damaged committed segment is repaired by un-committing it: its record is removed first (from
then on readers no longer see it), then its data, then the index is rewritten from the records
that remain. The next `extract` finds the segment missing and redoes exactly it. The caller holds
the cache lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path

from dflash_cache.files import fsync_path, remove_tmp_files
from dflash_cache.store.layout import (
    COMMITS_DIR,
    CREATING_FILE,
    MANIFEST_FILE,
    ROOT_STEMS,
    SEGMENTS_DIR,
    ZARR_JSON,
    check_segment_name,
    is_root_tmp,
    record_path,
    tmp_stem,
)
from dflash_cache.store.reader import write_index
from dflash_cache.store.segments import committed_names, read_records, remove_uncommitted

log = logging.getLogger(__name__)


def is_half_made(root: Path) -> bool:
    """A cache whose creation was interrupted: the marker is there, the manifest is not."""
    return (root / CREATING_FILE).exists() and not (root / MANIFEST_FILE).is_file()


def remove_uncommitted_segments(root: Path, committed: set[str], owned: Callable[[str], bool] | None = None) -> int:
    """Crash leftovers: segment directories no record covers (the segments group's own metadata
    stays); with `owned`, only those of the segments it accepts. Without `owned` (no other run can
    be writing) also the temporary files of the cache's own files (`index.parquet.PID.tmp`)."""
    if owned is None:
        remove_tmp_files(root, stems=ROOT_STEMS)
    return remove_uncommitted(root, committed | {ZARR_JSON}, owned)


def leftovers(root: Path) -> list[str]:
    """What interrupted runs left in a cache directory (paths relative to it): temporary files and
    segment directories no record covers. Harmless to readers; the next extract removes them (while
    an extract runs, its segments in progress are listed too)."""
    committed = set(committed_names(root)) | {ZARR_JSON}
    found = [p.name for p in sorted(root.iterdir()) if is_root_tmp(p.name)]
    for sub, keep in ((COMMITS_DIR, lambda n: tmp_stem(n) is None), (SEGMENTS_DIR, committed.__contains__)):
        if (root / sub).is_dir():
            found += [f"{sub}/{p.name}" for p in sorted((root / sub).iterdir()) if not keep(p.name)]
    return found


def uncommit(root: Path, names: Iterable[str]) -> list[str]:
    """Un-commit the named segments and rewrite the index; returns the names un-committed."""
    names = [check_segment_name(name) for name in sorted(set(names))]
    for name in names:
        record_path(root, name).unlink(missing_ok=True)
    fsync_path(root / COMMITS_DIR)
    remaining = read_records(root)
    removed = remove_uncommitted_segments(root, {r.name for r in remaining})
    write_index(root, remaining)
    log.info("un-committed %d segment(s); removed %d segment directories", len(names), removed)
    return names
