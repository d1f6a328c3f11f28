"""The cache's file tree: every name in it, and how a path in it is made.

A reader, a writer, repair and a remote destination must agree on where everything lives, so the
tree is defined here once; the other store modules take their names from this module and define
none. A cache on object storage has the same tree under its URL prefix (keys for paths)::

    CACHE/
      zarr.json                the zarr v3 root group                             ZARR_JSON
      manifest.json            what the cache holds and how it was made; written   MANIFEST_FILE
                               last when a cache is made (store.manifest)
      plan.parquet             the plan: one row per planned sample (store.plan)   PLAN_FILE
      index.parquet            sample -> segment, row offset, length; derived      INDEX_FILE
                               from the commit records (store.reader)
      .creating                only while a local cache is being made              CREATING_FILE
                               (store.repair)
      .lock                    the flock of the run writing the cache, not part    LOCK_FILE
                               of it (store.lock, store.remote_lock)
      segments/                a zarr group, so zarr tools walking from the root   SEGMENTS_DIR
        zarr.json              find every segment                                 SEGMENTS_GROUP_META
        uUUUUUU-bBBBBB/        one zarr group per planned batch (unit, batch)      segment_name, NAME_RE
          zarr.json
          <array>/zarr.json    one per stored array: the token arrays              array_meta_rel
                               (input_ids, loss_mask, offsets, sample_ids) and
                               the codec's (features, scales, ...)
          <array>/c/<i>[/0]    its shard files, by whole rows, in row order        shard_keys
      commits/                                                                     COMMITS_DIR
        uUUUUUU-bBBBBB.json    the segment's commit record, written last           record_rel
      <file>.<pid>.tmp         a file being replaced by a rename                   tmp_stem
                               (`dflash_cache.files.tmp_path_for`): the root files
                               above, and commit records in commits/

A segment exists for readers iff its record exists: a segment directory without one is a crash
leftover, and so is every temporary file. Of the root's entries, those in `CACHE_ENTRIES` (and
the temporary files of `ROOT_FILES`) are the cache's own; anything else there is a stranger's and
is left alone.
"""

from __future__ import annotations

import re
from pathlib import Path

from dflash_cache.errors import CacheCorruptError
from dflash_cache.files import TMP_SUFFIX, inside

__all__ = [
    "CACHE_ENTRIES",
    "COMMITS_DIR",
    "CREATING_FILE",
    "INDEX_FILE",
    "LOCK_FILE",
    "MANIFEST_FILE",
    "MAX_BATCH",
    "MAX_UNIT",
    "NAME_RE",
    "PLAN_FILE",
    "RECORD_SUFFIX",
    "ROOT_FILES",
    "ROOT_STEMS",
    "SEGMENTS_DIR",
    "SEGMENTS_GROUP_META",
    "TMP_SUFFIX",
    "ZARR_JSON",
    "array_meta_rel",
    "check_segment_name",
    "is_cache_entry",
    "is_lock_file",
    "is_root_tmp",
    "is_segment_name",
    "record_path",
    "record_rel",
    "record_segment",
    "segment_dir",
    "segment_name",
    "segment_rel",
    "shard_keys",
    "tmp_stem",
]

ZARR_JSON = "zarr.json"  # a zarr v3 node's metadata, named by zarr's spec (zarr.core.common.ZARR_JSON)
MANIFEST_FILE = "manifest.json"
PLAN_FILE = "plan.parquet"  # one row per planned sample: row, unit, batch, bucket, length
INDEX_FILE = "index.parquet"
CREATING_FILE = ".creating"
LOCK_FILE = ".lock"
SEGMENTS_DIR = "segments"
COMMITS_DIR = "commits"
SEGMENTS_GROUP_META = f"{SEGMENTS_DIR}/{ZARR_JSON}"
RECORD_SUFFIX = ".json"

# The files at the root, each replaced by renaming `<file>.<pid>.tmp` over it (zarr.json is
# zarr's to write, but a temporary file of that name is ours too).
ROOT_FILES = (ZARR_JSON, MANIFEST_FILE, PLAN_FILE, INDEX_FILE)
ROOT_STEMS = frozenset(name.split(".")[0] for name in ROOT_FILES)
# Everything a cache's creation makes at its root; lock files are not among them.
CACHE_ENTRIES = (*ROOT_FILES, SEGMENTS_DIR, COMMITS_DIR, CREATING_FILE)

# A segment is named by its planned batch: 6 digits of unit, 5 of batch (the ranges a commit
# record may claim follow from them).
NAME_RE = re.compile(r"^u(\d{6})-b(\d{5})$")
MAX_UNIT = 999_999
MAX_BATCH = 99_999


def segment_name(unit: int, batch: int) -> str:
    return f"u{unit:06d}-b{batch:05d}"


def is_segment_name(name: str) -> bool:
    return NAME_RE.match(name) is not None


def check_segment_name(name: str) -> str:
    """`name`, or CacheCorruptError if it is no segment name: a name from a received cache (a
    listing, a record) becomes a path only after this (or `segment_dir`)."""
    if not is_segment_name(name):
        raise CacheCorruptError(f"bad segment name {name!r}")
    return name


def segment_rel(name: str) -> str:
    """A segment's directory (or key prefix) relative to the cache root."""
    return f"{SEGMENTS_DIR}/{name}"


def segment_dir(root: Path, name: str) -> Path:
    """A segment's directory in the local cache `root`, resolved and inside it; CacheCorruptError
    for a bad name or a path that leaves the root."""
    return inside(root, root / segment_rel(check_segment_name(name)))


def record_rel(name: str) -> str:
    """A segment's commit record relative to the cache root."""
    return f"{COMMITS_DIR}/{name}{RECORD_SUFFIX}"


def record_path(root: Path, name: str) -> Path:
    return root / record_rel(name)


def record_segment(file_name: str) -> str | None:
    """The segment whose commit record is the file `file_name` of commits/; None for temporary
    files and strangers."""
    if not file_name.endswith(RECORD_SUFFIX):
        return None
    name = file_name[:-len(RECORD_SUFFIX)]
    return name if is_segment_name(name) else None


def array_meta_rel(key: str) -> str:
    """An array's zarr.json relative to its segment's directory."""
    return f"{key}/{ZARR_JSON}"


def shard_keys(key: str, shape: tuple[int, ...], shard_rows: int) -> list[str]:
    """The shard files of an array sharded by whole rows (zarr's default chunk keys, '/' between
    the grid's coordinates), relative to its segment's directory, in row order."""
    tail = "/0" * (len(shape) - 1)
    return [f"{key}/c/{i}{tail}" for i in range(-(-shape[0] // shard_rows))]


def tmp_stem(file_name: str) -> str | None:
    """What the temporary file `file_name` will replace, up to its first dot: a root file's stem
    ("manifest"), or in commits/ a segment's name. None if `file_name` is not a temporary file."""
    return file_name.split(".")[0] if file_name.endswith(TMP_SUFFIX) else None


def is_root_tmp(file_name: str) -> bool:
    """Whether a file at the root is the temporary file of one of `ROOT_FILES`."""
    return tmp_stem(file_name) in ROOT_STEMS


def is_lock_file(name: str) -> bool:
    """Whether an entry at the root is a run's lock: `.lock`, or another lock named from it (each
    `extract --copy` run holds one of its own); never the cache's own."""
    return name.startswith(LOCK_FILE)


def is_cache_entry(name: str) -> bool:
    """Whether an entry at the root is the cache's own (`CACHE_ENTRIES`, or a temporary file of a
    root file); lock files and strangers' files are not."""
    return name in CACHE_ENTRIES or is_root_tmp(name)
