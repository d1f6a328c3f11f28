"""Segments: immutable groups of whole samples, and the records that commit them.

Layout of a cache root::

    zarr.json               the zarr v3 root group
    manifest.json           what the cache holds (dflash_cache.manifest)
    segments/<name>/        one zarr group per segment: features [T, W] (+ scales), input_ids [T],
                            loss_mask [T], offsets [n + 1], sample_ids [n]; one shard file per array
    commits/<name>.json     the segment's commit record: written last, atomically
    index.parquet           sample -> (segment, row offset, length), rebuilt from commits

A segment exists for readers iff its record exists. The record lists every file the segment wrote
with its size, because zarr 3.1 reads a missing shard as zeros without complaint; readers check
the list before touching data. Names are validated and every path is resolved inside the root
before use, so a cache received from someone else cannot point a reader elsewhere.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.storage import LocalStore

from dflash_cache.codecs import TOKEN_ARRAYS, ArraySpec, zstd_chain
from dflash_cache.errors import CacheCorruptError
from dflash_cache.jsonio import TMP_SUFFIX, read_json, write_json_atomic

SEGMENTS_DIR = "segments"
COMMITS_DIR = "commits"
NAME_RE = re.compile(r"^u(\d{6})-b(\d{5})$")
CHUNK_BYTES = 8 << 20  # target bytes per compressed chunk inside a shard
SHARD_BYTES = 96 << 20  # target bytes per shard file: several per large segment, so zarr
                        # compresses them concurrently and one segment's write is not serial
MAX_SEGMENT_TOKENS = 1 << 24


def segment_name(unit: int, batch: int) -> str:
    return f"u{unit:06d}-b{batch:05d}"


def inside(root: Path, path: Path) -> Path:
    """`path` resolved, or CacheCorruptError if it leaves `root` (symlinks included)."""
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise CacheCorruptError(f"cache path {path} points outside the cache root {root}; refusing to read it")
    return resolved


@dataclass(frozen=True, slots=True)
class SegmentRecord:
    """What a commit promises about one segment. Everything a planner needs, no feature data."""

    name: str
    unit: int
    batch: int
    bucket: int
    rank: int
    num_tokens: int
    sample_ids: tuple[int, ...]
    lengths: tuple[int, ...]
    supervised: tuple[int, ...]
    files: dict[str, int]

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any], *, where: str) -> SegmentRecord:
        try:
            rec = cls(
                name=str(obj["name"]),
                unit=int(obj["unit"]),
                batch=int(obj["batch"]),
                bucket=int(obj["bucket"]),
                rank=int(obj["rank"]),
                num_tokens=int(obj["num_tokens"]),
                sample_ids=tuple(int(i) for i in obj["sample_ids"]),
                lengths=tuple(int(i) for i in obj["lengths"]),
                supervised=tuple(int(i) for i in obj["supervised"]),
                files={str(k): int(v) for k, v in dict(obj["files"]).items()},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CacheCorruptError(f"commit record {where} is malformed ({e})") from None
        rec.check(where)
        return rec

    def check(self, where: str) -> None:
        problems = []
        if not NAME_RE.match(self.name) or self.name != segment_name(self.unit, self.batch):
            problems.append(f"bad segment name {self.name!r}")
        if not (len(self.sample_ids) == len(self.lengths) == len(self.supervised)) or not self.sample_ids:
            problems.append("sample lists disagree in length or are empty")
        if any(n <= 0 for n in self.lengths) or sum(self.lengths) != self.num_tokens:
            problems.append("lengths do not add up to num_tokens")
        if not 0 < self.num_tokens <= MAX_SEGMENT_TOKENS:
            problems.append(f"num_tokens {self.num_tokens} out of range")
        if any(s < 0 or s > n for s, n in zip(self.supervised, self.lengths, strict=False)):  # unequal lengths: above
            problems.append("supervised counts exceed lengths")
        for rel, size in self.files.items():
            if rel.startswith("/") or ".." in Path(rel).parts or size < 0:
                problems.append(f"bad file entry {rel!r}")
        if problems:
            raise CacheCorruptError(f"commit record {where}: {'; '.join(problems)}")


def chunk_rows(row_bytes: int) -> int:
    """Rows per zarr chunk so a chunk holds about CHUNK_BYTES (a power of two, 16..65536)."""
    rows = max(1, CHUNK_BYTES // max(1, row_bytes))
    return int(min(65536, max(16, 1 << (rows.bit_length() - 1))))


def write_array(store: LocalStore, name: str, data: np.ndarray, compressors: tuple | list) -> None:
    """One array as a single shard file of checksummed, compressed chunks, written in one call."""
    row_bytes = data.dtype.itemsize * (data.shape[1] if data.ndim == 2 else 1)
    rows = min(chunk_rows(row_bytes), max(16, data.shape[0]))
    per_shard = max(1, SHARD_BYTES // (rows * row_bytes))
    shard_rows = min(per_shard, -(-data.shape[0] // rows)) * rows
    tail = data.shape[1:]
    zarr.create_array(
        store=store,
        name=name,
        data=data,
        chunks=(rows, *tail),
        shards=(shard_rows, *tail),
        compressors=list(compressors),
        filters=[],
        fill_value=0,
    )


def list_files(directory: Path) -> dict[str, int]:
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def fsync_tree(directory: Path) -> None:
    """Make a segment's files durable before its commit can point at them (files only: the
    directories are new, and the commit's own rename + directory fsync orders after them)."""
    for p in directory.rglob("*"):
        if not p.is_file():
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_segment(
    root: Path,
    *,
    unit: int,
    batch: int,
    bucket: int,
    rank: int,
    feature_arrays: dict[str, np.ndarray],
    feature_specs: dict[str, ArraySpec],
    input_ids: np.ndarray,
    loss_mask: np.ndarray,
    lengths: np.ndarray,
    sample_ids: np.ndarray,
) -> SegmentRecord:
    """Write one segment's arrays, fsync them, then commit its record. Returns the record."""
    name = segment_name(unit, batch)
    seg_dir = root / SEGMENTS_DIR / name
    if seg_dir.exists():  # garbage from a crashed attempt at the same work
        shutil.rmtree(seg_dir)
    store = LocalStore(seg_dir)
    zarr.create_group(store=store)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = {
        "input_ids": input_ids.astype(TOKEN_ARRAYS["input_ids"], copy=False),
        "loss_mask": loss_mask.astype(TOKEN_ARRAYS["loss_mask"], copy=False),
        "offsets": offsets,
        "sample_ids": sample_ids.astype(TOKEN_ARRAYS["sample_ids"], copy=False),
    }
    for key, arr in tokens.items():
        write_array(store, key, arr, zstd_chain(arr.dtype.itemsize))
    for key, arr in feature_arrays.items():
        write_array(store, key, arr, feature_specs[key].compressors)
    fsync_tree(seg_dir)
    supervised = np.add.reduceat(tokens["loss_mask"].astype(np.int64), offsets[:-1]) if len(lengths) else []
    record = SegmentRecord(
        name=name,
        unit=unit,
        batch=batch,
        bucket=bucket,
        rank=rank,
        num_tokens=int(offsets[-1]),
        sample_ids=tuple(int(i) for i in sample_ids),
        lengths=tuple(int(n) for n in lengths),
        supervised=tuple(int(s) for s in supervised),
        files=list_files(seg_dir),
    )
    record.check(name)
    write_json_atomic(root / COMMITS_DIR / f"{name}.json", record.to_json())
    return record


def read_records(root: Path) -> list[SegmentRecord]:
    """Every committed record, sorted by name. Temporary files and strangers are ignored."""
    commits = root / COMMITS_DIR
    if not commits.is_dir():
        return []
    records = []
    for path in sorted(commits.iterdir()):
        if path.name.endswith(TMP_SUFFIX) or not path.name.endswith(".json"):
            continue
        if not NAME_RE.match(path.stem):
            continue
        inside(root, path)
        try:
            obj = read_json(path, max_bytes=16 << 20)
        except (ValueError, OSError) as e:
            raise CacheCorruptError(f"commit record {path.name} is unreadable ({e})") from None
        rec = SegmentRecord.from_json(obj, where=path.name)
        if rec.name != path.stem:
            raise CacheCorruptError(f"commit record {path.name} names segment {rec.name}")
        records.append(rec)
    return records


def segment_dir(root: Path, name: str) -> Path:
    if not NAME_RE.match(name):
        raise CacheCorruptError(f"bad segment name {name!r}")
    return inside(root, root / SEGMENTS_DIR / name)


def check_files(root: Path, record: SegmentRecord) -> list[str]:
    """Problems with the files a record lists (missing, resized, outside the root); [] if none."""
    seg = segment_dir(root, record.name)
    problems = []
    for rel, size in record.files.items():
        path = seg / rel
        try:
            inside(root, path)
        except CacheCorruptError as e:
            problems.append(str(e))
            continue
        if not path.is_file():
            problems.append(f"{rel} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{rel} is {path.stat().st_size} bytes, the commit recorded {size}")
    return problems


def remove_uncommitted(root: Path, committed: set[str]) -> int:
    """Delete segment directories and temp records that no commit covers (crash leftovers)."""
    removed = 0
    seg_root = root / SEGMENTS_DIR
    if seg_root.is_dir():
        for d in seg_root.iterdir():
            if d.name not in committed:
                if d.is_dir() and not d.is_symlink():
                    shutil.rmtree(d, ignore_errors=True)
                else:  # a file or a symlink: remove the link itself, never what it points at
                    d.unlink(missing_ok=True)
                removed += 1
    commits = root / COMMITS_DIR
    if commits.is_dir():
        for p in commits.iterdir():
            if p.name.endswith(TMP_SUFFIX):
                p.unlink(missing_ok=True)
    return removed
