"""Atomic, durable files, and careful opening of files that came from someone else.

Everything the cache and the trainer commit (manifest, segment records, checkpoints) goes through
here, so a crash leaves either the old file, the new file, or an ignorable ``*.tmp``: never a torn one.

Caches get copied between machines and teams, so reading is defensive: paths are resolved and
must stay inside the cache root (`inside`), and only regular files are opened (`open_regular`: a
FIFO would block forever; `check_regular` for the files zarr opens itself).
`dflash_cache.typed_json` then checks what a JSON file holds, and Parquet files are decoded only
after their footers agree with what the records allow (`read_parquet_within`).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.compute as pc
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


def tmp_path_for(path: Path) -> Path:
    """Where `path` is written before it is renamed into place: beside it, named by this process."""
    return path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` durably; a failed write (a full disk) leaves the old file and no
    temporary one."""
    tmp = tmp_path_for(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def remove_tmp_files(directory: Path, stems: Iterable[str] | None = None) -> list[str]:
    """Delete the temporary files a killed writer left in `directory` (`name.PID.tmp`; with `stems`,
    only those of the files named so); returns their names. The caller holds the lock of whatever
    `directory` belongs to, so no live writer owns them."""
    if not directory.is_dir():
        return []
    wanted = None if stems is None else set(stems)
    removed = []
    for p in sorted(directory.iterdir()):
        if p.name.endswith(TMP_SUFFIX) and not p.is_dir() and (wanted is None or p.name.split(".")[0] in wanted):
            p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


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


def file_kind(mode: int) -> str:
    """What a file of `st_mode` is, in words, for messages refusing anything but a regular file."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((word for test, word in kinds if test(mode)), "not a regular file")


def check_regular(root: Path, rel: str) -> None:
    """CacheCorruptError unless `root/rel` is absent or a regular file inside `root`: for the files
    zarr opens itself, where `open_regular` cannot be put in its way (opening a FIFO blocks forever)."""
    path = root / rel
    if not os.path.lexists(path):
        return
    inside(root, path)
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise CacheCorruptError(f"cache file {rel} cannot be read ({e.strerror or e}); remove it or choose another "
                                "cache") from None
    if not stat.S_ISREG(mode):
        raise CacheCorruptError(f"cache file {rel} is {file_kind(mode)}, not a regular file; remove it (extract "
                                "writes it again) or choose another cache")


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


@dataclass(frozen=True, slots=True)
class ParquetLimits:
    """What a Parquet file of ours may claim, held to its footer before any page is decoded: a
    file of a megabyte can hold a billion run-length encoded rows, or one long string that its
    dictionary repeats for every row. `schema` names the columns in order; an integer column may
    be of any width (older writers), a string one holds values of at most `max_string` bytes.
    `rows` is exact (`said` is who says so, for the message). A file whose footer lacks one of
    the `tagged` key-value pairs is not the one meant (an index written before later commits):
    it is not decoded at all."""

    schema: pa.Schema
    rows: int
    said: str  # "the manifest plans 180 samples", "the commit records 180"
    max_string: int = 64
    tagged: dict[bytes, bytes] = field(default_factory=dict)


PAGE_SLACK = 64 << 10  # per column chunk, beyond twice its plain size: headers, statistics, dictionaries


class ParquetClaimError(ValueError):
    """A Parquet file claims more than the records that the store trusts allow (the message names
    the file and the limit)."""


def _claims_problem(name: str, f: pq.ParquetFile, limits: ParquetLimits) -> str | None:
    """What the footer claims beyond `limits`: other columns, another row count, pages that would
    decompress to more than such rows take."""
    want = [(c.name, c.type) for c in limits.schema]
    have = [(c.name, c.type.value_type if pa.types.is_dictionary(c.type) else c.type) for c in f.schema_arrow]
    same = [n for n, _ in have] == [n for n, _ in want] and all(
        pa.types.is_string(h) if pa.types.is_string(w) else pa.types.is_integer(h)
        for (_, w), (_, h) in zip(want, have, strict=True))
    if not same:
        return (f"{name} has columns {', '.join(f'{n} {t}' for n, t in have)} of other types than "
                f"{', '.join(f'{n} {t}' for n, t in want)}")
    meta = f.metadata
    groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
    rows = sum(g.num_rows for g in groups)
    if meta.num_rows != limits.rows or rows != limits.rows:  # the footer's count, or its row groups' sum
        return f"{name} has {rows if rows != limits.rows else meta.num_rows} rows, {limits.said}"
    row_bytes = {n: limits.max_string + 4 if pa.types.is_string(t) else t.bit_width // 8 for n, t in have}
    for g in groups:
        for i in range(g.num_columns):
            chunk = g.column(i)
            column = chunk.path_in_schema
            bound = 2 * g.num_rows * row_bytes[column] + PAGE_SLACK
            if chunk.total_uncompressed_size > bound:
                return (f"{name} column {column} claims {chunk.total_uncompressed_size:,} bytes of pages, more than "
                        f"the {bound:,} that {g.num_rows} rows take")
    return None


def read_parquet_within(source: Any, name: str, limits: ParquetLimits) -> pa.Table | None:
    """The table in Parquet file `source` (a file object or buffer) named `name`, decoded only if
    its footer claims no more than `limits` (ParquetClaimError otherwise); None for a file without
    the `tagged` footer entries. Strings are decoded through their dictionary, whose values are
    checked first, so a long one is refused before it is repeated for every row."""
    strings = [f.name for f in limits.schema if pa.types.is_string(f.type)]
    f = pq.ParquetFile(source, read_dictionary=strings)
    footer = f.metadata.metadata or {}
    if any(footer.get(k) != v for k, v in limits.tagged.items()):
        return None
    problem = _claims_problem(name, f, limits)
    if problem:
        raise ParquetClaimError(problem)
    table = f.read()
    for column in strings:
        values = table.column(column)
        # (pyarrow.compute makes its functions when it is imported, where type checkers cannot see them)
        lengths = (pc.max(pc.binary_length(c.dictionary)).as_py()  # pyright: ignore[reportAttributeAccessIssue]
                   for c in values.chunks)
        longest = max((n or 0 for n in lengths), default=0)
        if longest > limits.max_string:
            raise ParquetClaimError(f"{name} column {column} holds a value of {longest} bytes, more than "
                                    f"{limits.max_string}")
        table = table.set_column(table.schema.get_field_index(column), column, values.cast(pa.string()))
    return table


def hash_ends(h: Any, path: Path, size: int, span: int = 1 << 20) -> None:
    """Feed a file's first and last `span` bytes into hasher `h`: how dataset and weight files are
    fingerprinted without reading gigabytes (their names and sizes are hashed by the caller)."""
    with open(path, "rb") as f:
        h.update(f.read(span))
        f.seek(max(0, size - span))
        h.update(f.read(span))
