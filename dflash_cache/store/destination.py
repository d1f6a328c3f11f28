"""Where a cache is written: a local directory, or a prefix on object storage.

The writer (`dflash_cache.store.writer`) decides what is written and in which order; a destination
decides how a file becomes visible there, extending the reading side (`dflash_cache.store.location`).

Locally a file is written in place, fsynced and renamed into place, and a new cache carries its
`.creating` marker until its manifest is written. An object store has no rename, but a single
object PUT is atomic, so visibility is carried by order: a segment is written into a local
staging directory exactly as it is written locally, its files are uploaded under
`segments/<name>/` with concurrent requests, and only then is its commit record PUT. A new cache's
objects are uploaded the same way with the manifest last, so no marker is needed: a prefix holding
our entries without a manifest (and without commits) is a creation that was cut short, and is made
again. Staging directories live under the system's temporary directory, one per write.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pyarrow as pa
from zarr.storage import LocalStore

from dflash_cache.errors import UserError, one_line
from dflash_cache.files import (
    fsync_path,
    json_bytes,
    list_files,
    parquet_bytes,
    write_json_atomic,
    write_parquet_atomic,
)
from dflash_cache.store.layout import (
    COMMITS_DIR,
    CREATING_FILE,
    INDEX_FILE,
    MANIFEST_FILE,
    PLAN_FILE,
    SEGMENTS_DIR,
    ZARR_JSON,
    is_cache_entry,
    is_lock_file,
    is_segment_name,
    record_path,
    record_rel,
    segment_rel,
)
from dflash_cache.store.location import LocalCache, RemoteCache, is_url
from dflash_cache.store.repair import is_half_made, remove_uncommitted_segments
from dflash_cache.store.segments import SegmentRecord

log = logging.getLogger(__name__)
# An overwritten remote cache is deleted records first and manifest last: a run killed meanwhile
# leaves a cache that is reopened or overwritten again, never records whose data is gone.
_REMOVAL_ORDER = (COMMITS_DIR, SEGMENTS_DIR, INDEX_FILE, PLAN_FILE, ZARR_JSON, MANIFEST_FILE)

WriteFiles = Callable[[Path], dict[str, int]]  # writes into a directory, returns its files (path -> size)


def disk_error(root: Path | str, exc: OSError, *, creating: bool = False) -> UserError:
    """One line for a write that failed: disk full, or the path (permissions, read-only, ...)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        doing, kept = ("creating the cache at", "nothing was left behind") if creating else \
            ("writing to", "committed segments are kept")
        return UserError(f"disk full while {doing} {root}; free space and run the same command again ({kept})")
    what = "create the cache at" if creating else "write to"
    return UserError(f"cannot {what} {root}: {exc.strerror or exc}; check the path and permissions")


class LocalDestination(LocalCache):
    """A cache directory on this machine: files renamed into place and fsynced."""

    kind = "directory"

    def guard(self) -> AbstractContextManager[None]:
        """Local errors keep their type: the callers name the disk's problem (`disk_error`)."""
        return contextlib.nullcontext()

    def has(self, rel: str) -> bool:
        return (self.root / rel).is_file()

    def is_half_made(self) -> bool:
        return is_half_made(self.root)

    def foreign_entries(self) -> bool:
        """Whether the directory holds anything besides lock files (a new or empty one holds nothing)."""
        return self.root.exists() and any(not is_lock_file(p.name) for p in self.root.iterdir())

    @contextmanager
    def creating(self) -> Iterator[Path]:
        """Make a new cache in the block: the directory to write it in. The marker goes first and
        leaves last, so a cache killed in between is recognised as half-made (and redone) by the
        next run; a disk error removes what the block made."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / CREATING_FILE).touch()
            fsync_path(self.root)
        except OSError as e:  # nothing made yet, nothing removed yet
            raise disk_error(self.root, e, creating=True) from None
        try:
            self._remove_entries()
            yield self.root
        except OSError as e:
            self._undo_create()
            raise disk_error(self.root, e, creating=True) from None
        (self.root / CREATING_FILE).unlink()
        fsync_path(self.root)

    def _remove_entries(self) -> None:
        """Delete what a (half-made or overwritten) cache holds, leaving foreign files and locks alone."""
        for path in self.root.iterdir():
            if is_cache_entry(path.name) and path.name != CREATING_FILE:
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)

    def _undo_create(self) -> None:
        """Best effort: what stays (a disk that refuses even deletes) still carries the marker."""
        try:
            self._remove_entries()
            (self.root / CREATING_FILE).unlink(missing_ok=True)
        except OSError as e:
            log.warning("could not remove the half-made cache at %s (%s); the next run will", self.root, e)

    def reopen(self) -> None:
        """Drop a marker left by a kill just after the manifest was written."""
        (self.root / CREATING_FILE).unlink(missing_ok=True)

    def zarr_root(self) -> LocalStore:
        return LocalStore(self.root)

    def remove_uncommitted(self, committed: set[str], owned: Callable[[str], bool] | None = None) -> int:
        return remove_uncommitted_segments(self.root, committed, owned)

    def put_segment(self, name: str, write: WriteFiles) -> dict[str, int]:
        """Write a segment's files in place, fsynced: durable before a commit can point at them.
        Garbage from a crashed attempt at the same segment is replaced."""
        seg_dir = self.root / segment_rel(name)
        if seg_dir.exists():
            shutil.rmtree(seg_dir)
        files = write(seg_dir)
        for rel in files:
            fsync_path(seg_dir / rel)
        return files

    def put_record(self, record: SegmentRecord) -> None:
        write_json_atomic(record_path(self.root, record.name), record.to_json())

    def put_parquet(self, rel: str, table: pa.Table) -> None:
        write_parquet_atomic(self.root / rel, table)


class RemoteDestination(RemoteCache):
    """A cache under a URL prefix: files staged locally, uploaded, and made visible by order."""

    kind = "prefix"
    doing = "write"  # a failed request, even a read of what is there, is one line naming the URL (`guard`)

    def __init__(self, url: str) -> None:
        super().__init__(url)
        for rel in (COMMITS_DIR, SEGMENTS_DIR):  # other processes (ranks, an earlier run) may have written
            self.fs.invalidate_cache(self._key(rel))  # since this filesystem listed them (and the prefix)

    def has(self, rel: str) -> bool:
        return self.fs.exists(self._key(rel))

    def _entries(self) -> set[str]:
        """The names directly under the prefix, lock objects aside."""
        try:
            listing = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return set()
        names = {key.rstrip("/").rsplit("/", 1)[-1] for key in listing}
        return {n for n in names if n and not is_lock_file(n)}

    def is_half_made(self) -> bool:
        """Our entries without a manifest and without a commit: a creation cut short."""
        entries = self._entries()
        return bool(entries) and all(is_cache_entry(n) for n in entries) and MANIFEST_FILE not in entries \
            and COMMITS_DIR not in entries

    def foreign_entries(self) -> bool:
        return bool(self._entries())

    @contextmanager
    def creating(self) -> Iterator[Path]:
        """Make a new cache in the block: a staging directory to write it in, uploaded when the
        block ends with the manifest last, so it appears only once the cache is usable. A failure
        removes what was uploaded."""
        with self.guard():
            try:
                self._remove_entries()
                with tempfile.TemporaryDirectory(prefix="dflash-cache-create-") as tmp:
                    stage = Path(tmp)
                    yield stage
                    files = [rel for rel in list_files(stage) if rel != MANIFEST_FILE]
                    self._upload(stage, files)
                    self._upload(stage, [MANIFEST_FILE])
            except self.errors:
                self._undo_create()
                raise

    def _remove_entries(self) -> None:
        """Delete what a (half-made or overwritten) cache holds, records first and manifest last;
        foreign objects and locks stay."""
        entries = self._entries()
        for name in _REMOVAL_ORDER:
            if name in entries:
                self.fs.rm(self._key(name), recursive=True)
        rest = [self._key(n) for n in entries if is_cache_entry(n) and n not in _REMOVAL_ORDER]
        if rest:
            self.fs.rm(rest, recursive=True)

    def _undo_create(self) -> None:
        try:
            self._remove_entries()
        except self.errors as e:
            log.warning("could not remove the half-made cache at %s (%s); the next run will", self.url, one_line(e))

    def reopen(self) -> None:
        """Nothing to tidy: a remote cache has no marker."""

    def zarr_root(self):
        return self._zarr("", read_only=False)

    def remove_uncommitted(self, committed: set[str], owned: Callable[[str], bool] | None = None) -> int:
        """Delete segment prefixes no record covers (what a killed run had uploaded so far); with
        `owned`, only those of the segments it accepts."""
        try:
            listing = self.fs.ls(self._key(SEGMENTS_DIR), detail=False)
        except FileNotFoundError:
            return 0
        names = {key.rstrip("/").rsplit("/", 1)[-1] for key in listing}
        stale = sorted(n for n in names if n not in committed and n != ZARR_JSON and n not in ("", ".", "..")
                       and (owned is None or owned(n)))
        if stale:
            self.fs.rm([self._key(segment_rel(n)) for n in stale], recursive=True)
        return len(stale)

    def put_segment(self, name: str, write: WriteFiles) -> dict[str, int]:
        """Write a segment's files into a staging directory, then upload them concurrently."""
        if not is_segment_name(name):
            raise ValueError(f"bad segment name {name!r}")
        with tempfile.TemporaryDirectory(prefix="dflash-cache-commit-") as tmp:
            staged = Path(tmp) / name
            try:
                files = write(staged)
            except OSError as e:  # the staging disk's problem, not the bucket's
                raise disk_error(staged, e) from None
            self._upload(staged, list(files), under=segment_rel(name))
        return files

    def put_record(self, record: SegmentRecord) -> None:
        """One PUT, atomic: the segment is visible from this moment, never before its files."""
        self.fs.pipe_file(self._key(record_rel(record.name)), json_bytes(record.to_json()))

    def put_parquet(self, rel: str, table: pa.Table) -> None:
        self.fs.pipe_file(self._key(rel), parquet_bytes(table))

    def _upload(self, directory: Path, files: list[str], under: str = "") -> None:
        """Upload files of `directory` (relative paths) under the prefix `under`, concurrently."""
        if files:
            base = f"{under}/" if under else ""
            self.fs.put([str(directory / rel) for rel in files], [self._key(base + rel) for rel in files])


Destination = LocalDestination | RemoteDestination


def open_destination(out: str | Path | Destination) -> Destination:
    """Where the cache `out` (a directory, a URL, or a destination already) is written."""
    if isinstance(out, LocalDestination | RemoteDestination):
        return out
    return RemoteDestination(out) if is_url(out) else LocalDestination(Path(out))
