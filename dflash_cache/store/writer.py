"""Writing a cache: creating or reopening it, committing segments, finishing it.

The one writer of the store, for `dflash-cache extract` and the live tee alike. It takes
store-level inputs only: a Manifest and a Plan to make a cache by, a planned batch's packed host
form and its encoded features to commit. The caller holds the cache lock.

An existing cache is reopened only if its manifest matches field by field; otherwise it is
refused unless `overwrite`. A new cache carries its `.creating` marker (`dflash_cache.store.repair`)
from its first byte until its manifest is written, so a creation killed or refused a disk is
recognised and made again by the next run; a failed creation removes what it wrote. Crash
leftovers (segments without a commit) are removed when a cache is opened.
"""

from __future__ import annotations

import errno
import logging
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import zarr
from zarr.core.common import ZARR_JSON
from zarr.storage import LocalStore

from dflash_cache.errors import UserError
from dflash_cache.files import TMP_SUFFIX, fsync_path, write_json_atomic
from dflash_cache.store.batch import HostBatch
from dflash_cache.store.codecs import ArraySpec, to_stored_numpy, token_spec
from dflash_cache.store.lock import LOCK_FILE
from dflash_cache.store.manifest import MANIFEST_FILE, Manifest, mismatches, read_manifest, write_manifest
from dflash_cache.store.plan import PLAN_FILE, Plan, PlannedBatch, write_plan_table
from dflash_cache.store.reader import INDEX_FILE, write_index
from dflash_cache.store.repair import CREATING_FILE, is_half_made, remove_uncommitted_segments
from dflash_cache.store.segments import (
    COMMITS_DIR,
    SEGMENTS_DIR,
    SegmentRecord,
    read_records,
    segment_name,
    write_array,
)

log = logging.getLogger(__name__)
_CACHE_ENTRIES = (MANIFEST_FILE, PLAN_FILE, INDEX_FILE, SEGMENTS_DIR, COMMITS_DIR, ZARR_JSON, CREATING_FILE)
_CACHE_STEMS = {name.split(".")[0] for name in _CACHE_ENTRIES if not name.startswith(".")}


def disk_error(root: Path, exc: OSError, *, creating: bool = False) -> UserError:
    """One line for a write that failed: disk full, or the path (permissions, read-only, ...)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        doing, kept = ("creating the cache at", "nothing was left behind") if creating else \
            ("writing to", "committed segments are kept")
        return UserError(f"disk full while {doing} {root}; free space and run the same command again ({kept})")
    what = "create the cache at" if creating else "write to"
    return UserError(f"cannot {what} {root}: {exc.strerror or exc}; check the path and permissions")


# --- creating or reopening --------------------------------------------------------------------

def open_or_create(root: Path, manifest: Manifest, plan: Plan, *, overwrite: bool = False) -> set[str]:
    """Create the cache, or reopen a matching one; returns the committed segment names.

    A half-made cache (killed or refused a disk while being created) holds no committed segment,
    so it is made again from the start, with or without `overwrite`."""
    is_cache = (root / MANIFEST_FILE).is_file()
    if is_cache and not overwrite:
        check_matches(root, manifest)
        _reopen(root)
    elif is_cache or is_half_made(root) or not foreign_entries(root):
        if is_half_made(root):
            log.info("%s: its creation was interrupted; making it again", root)
        _create(root, plan, manifest)
    else:
        raise UserError(f"--out {root} exists and is not a dflash-cache; choose an empty or new directory")
    committed = {r.name for r in read_records(root)}
    removed = remove_uncommitted_segments(root, committed)
    if removed:
        log.info("removed %d uncommitted segment(s) left by an interrupted run", removed)
    return committed


def check_matches(root: Path, wanted: Manifest) -> None:
    """UserError unless the cache at `root` was made as `wanted` says (read-only: a dry run asks too)."""
    diff = mismatches(read_manifest(root), wanted)
    if diff:
        shown = "; ".join(f"{field}: cache has {old!r}, this run has {new!r}" for field, old, new in diff[:3])
        more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
        raise UserError(
            f"cache {root} was made differently: {shown}{more}; pass --overwrite to start over "
            "or choose another --out"
        )


def _ours(name: str) -> bool:
    """Entries a cache's creation writes (or its temporary files); lock files are not among them."""
    return name in _CACHE_ENTRIES or (name.endswith(TMP_SUFFIX) and name.split(".")[0] in _CACHE_STEMS)


def foreign_entries(root: Path) -> bool:
    """Whether `root` holds anything besides lock files (a new or empty directory holds nothing)."""
    return root.exists() and any(not p.name.startswith(LOCK_FILE) for p in root.iterdir())


def _remove_entries(root: Path) -> None:
    """Delete what a (half-made or overwritten) cache holds, leaving foreign files and locks alone."""
    for path in root.iterdir():
        if _ours(path.name) and path.name != CREATING_FILE:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)


def _create(root: Path, plan: Plan, manifest: Manifest) -> None:
    """Make a new cache. The marker goes first and leaves last, so a cache killed in between is
    recognised as half-made (and redone) by the next run; a failure here removes what it made."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / CREATING_FILE).touch()
        fsync_path(root)
    except OSError as e:  # nothing made yet, nothing removed yet
        raise disk_error(root, e, creating=True) from None
    try:
        _remove_entries(root)
        group = zarr.create_group(store=LocalStore(root), attributes={"dflash_cache": "see manifest.json"})
        _segments_group(group)
        (root / COMMITS_DIR).mkdir()
        write_plan_table(root, plan)
        write_manifest(root, manifest)  # its presence marks a usable cache
    except OSError as e:
        _undo_create(root)
        raise disk_error(root, e, creating=True) from None
    (root / CREATING_FILE).unlink()
    fsync_path(root)


def _undo_create(root: Path) -> None:
    """Best effort: what stays (a disk that refuses even deletes) still carries the marker."""
    try:
        _remove_entries(root)
        (root / CREATING_FILE).unlink(missing_ok=True)
    except OSError as e:
        log.warning("could not remove the half-made cache at %s (%s); the next run will", root, e)


def _segments_group(root_group: zarr.Group) -> None:
    """`segments/` as a zarr group, so zarr tools walking the hierarchy reach every segment."""
    root_group.create_group(SEGMENTS_DIR, attributes={"dflash_cache": "one group per segment; "
                                                      "only those with a record in commits/ are committed"})


def _reopen(root: Path) -> None:
    """Tidy a matching cache: a marker left by a kill just after the manifest was written, and the
    segments group that caches made before it existed lack."""
    (root / CREATING_FILE).unlink(missing_ok=True)
    if not (root / SEGMENTS_DIR / ZARR_JSON).is_file():
        _segments_group(zarr.open_group(store=LocalStore(root), mode="r+"))


# --- committing a segment ---------------------------------------------------------------------

def commit_segment(root: Path, planned: PlannedBatch, packed: HostBatch, features: Mapping[str, torch.Tensor],
                   *, specs: Mapping[str, ArraySpec], rank: int) -> SegmentRecord:
    """Write planned batch `planned` as its segment: the packed batch's token arrays and the
    codec's encoded `features` (host tensors, as `FeatureCodec.encode` makes them), fsynced, then
    its record, atomically. Garbage from a crashed attempt at the same segment is replaced."""
    name = segment_name(planned.unit, planned.batch)
    seg_dir = root / SEGMENTS_DIR / name
    if seg_dir.exists():
        shutil.rmtree(seg_dir)
    store = LocalStore(seg_dir)
    zarr.create_group(store=store)
    for key, arr in packed.stored().items():
        write_array(store, key, arr, token_spec(key).compressors)
    for key, arr in to_stored_numpy(dict(features)).items():
        write_array(store, key, arr, specs[key].compressors)
    files = list_files(seg_dir)
    for rel in files:
        fsync_path(seg_dir / rel)  # durable before the commit can point at them
    record = SegmentRecord(
        name=name, unit=planned.unit, batch=planned.batch, bucket=planned.bucket, rank=rank,
        num_tokens=packed.num_tokens, sample_ids=tuple(int(i) for i in packed.sample_ids),
        lengths=tuple(int(n) for n in packed.lengths), supervised=tuple(int(s) for s in packed.supervised()),
        files=files,
    )
    record.check(name)
    write_json_atomic(root / COMMITS_DIR / f"{name}.json", record.to_json())
    return record


def list_files(directory: Path) -> dict[str, int]:
    """Every file under `directory` (relative path -> size): what a commit record lists."""
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# --- finishing ----------------------------------------------------------------------------------

def finish_cache(root: Path, echo: Callable[[str], None], seconds: float) -> None:
    """Rewrite the index from the commits and report how complete the cache is."""
    records = read_records(root)
    write_index(root, records)
    manifest = read_manifest(root)
    tokens = sum(r.num_tokens for r in records)
    done = len(records) == manifest.plan.num_segments
    echo(f"{'complete' if done else 'INCOMPLETE'}: {len(records)}/{manifest.plan.num_segments} segments, "
         f"{tokens:,} tokens committed; this run took {seconds:.1f}s")
