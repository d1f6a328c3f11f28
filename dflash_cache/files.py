"""Atomic, durable files, and careful opening of files that came from someone else.

Everything the cache and the trainer commit (manifest, segment records, checkpoints) goes through
here, so a crash leaves either the old file, the new file, or an ignorable ``*.tmp``: never a torn one.

Caches get copied between machines and teams, so reading is defensive: paths are resolved and
must stay inside the cache root (`inside`), and only regular files are opened (`open_regular`: a
FIFO would block forever). `dflash_cache.typed_json` then checks what a JSON file holds.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_cache.errors import CacheCorruptError

TMP_SUFFIX = ".tmp"


def fsync_path(path: Path) -> None:
    """Make a file's data, or a directory's entries, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def json_bytes(obj: Any) -> bytes:
    """How every JSON file of ours is written, on disk and on object storage alike."""
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def parquet_bytes(table: pa.Table) -> bytes:
    """A table as one zstd-compressed Parquet file's bytes (plan, index, demo rows)."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


def write_json_atomic(path: Path, obj: Any) -> None:
    write_bytes_atomic(path, json_bytes(obj))


def write_parquet_atomic(path: Path, table: pa.Table) -> None:
    """A table as one zstd-compressed Parquet file, replaced atomically."""
    write_bytes_atomic(path, parquet_bytes(table))


def list_files(directory: Path) -> dict[str, int]:
    """Every file under `directory` (relative path -> size): what a commit record lists."""
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def inside(root: Path, path: Path) -> Path:
    """`path` resolved, or CacheCorruptError if it leaves `root` (symlinks included)."""
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise CacheCorruptError(f"cache path {path} points outside the cache root {root}; refusing to read it")
    return resolved


def open_regular(path: Path) -> BinaryIO:
    """Open `path` for reading if it is a regular file; ValueError otherwise. The open does not
    block (a FIFO would wait forever for a writer) and the type is checked on the opened file."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ValueError(f"{path.name} is not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped after the stat above
            raise ValueError(f"{path.name} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_json(path: Path, *, max_bytes: int = 64 << 20) -> Any:
    """Read a JSON file (regular files only), refusing absurd sizes before reading and nesting
    too deep to parse. Raises ValueError or OSError; callers say which file it was."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise ValueError(f"{path.name} is {size} bytes, more than the {max_bytes} a record may hold")
        data = f.read(max_bytes + 1)
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"{path.name} is nested too deeply to be a valid record") from None


def hash_ends(h: Any, path: Path, size: int, span: int = 1 << 20) -> None:
    """Feed a file's first and last `span` bytes into hasher `h`: how dataset and weight files are
    fingerprinted without reading gigabytes (their names and sizes are hashed by the caller)."""
    with open(path, "rb") as f:
        h.update(f.read(span))
        f.seek(max(0, size - span))
        h.update(f.read(span))
