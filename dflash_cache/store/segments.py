"""Segments: immutable groups of whole samples, and the records that commit them.

Where a segment and its record live is `dflash_cache.store.layout`. A segment exists for readers
iff its record exists. The record lists every file the segment wrote with its size, because zarr
3.1 reads a missing shard as zeros without complaint; readers check the list before touching data.
Names are validated and every path is resolved inside the root before use, so a cache received
from someone else cannot point a reader elsewhere.

This module is the format: records, how an array is chunked and sharded (`write_array`) and the
checks that hold a received segment to that. Committing a segment is
`dflash_cache.store.writer.commit_segment`.
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.storage import LocalStore

from dflash_cache.errors import CacheCorruptError
from dflash_cache.files import inside, read_json
from dflash_cache.store.codecs import TOKEN_ARRAYS, ArraySpec, codec_names, token_spec
from dflash_cache.store.layout import (
    COMMITS_DIR,
    MAX_BATCH,
    MAX_UNIT,
    SEGMENTS_DIR,
    array_meta_rel,
    is_segment_name,
    record_segment,
    segment_dir,
    segment_name,
    segment_rel,
    shard_keys,
    tmp_stem,
)
from dflash_cache.typed_json import INT64_MAX, load_dataclass

CHUNK_BYTES = 8 << 20  # target bytes per compressed chunk inside a shard
SHARD_BYTES = 96 << 20  # target bytes per shard file: several per large segment, so zarr
                        # compresses them concurrently and one segment's write is not serial
MAX_SEGMENT_TOKENS = 1 << 24
MAX_SEGMENT_FILES = 1 << 16  # far above a real segment's (5-6 arrays, one shard per SHARD_BYTES)
CHUNK_SLACK = 4  # a received chunk may decode to this many times CHUNK_BYTES (or 16 rows), no more
MAX_CHUNKS_PER_SHARD = 1 << 16  # bounds a shard's index (16 bytes per chunk)
MAX_ARRAY_META_BYTES = 1 << 20  # an array's zarr.json (the writer's are ~1.5 KB)
# A segment's arrays may decode to at most MAX_EXPANSION times the bytes of its files, plus
# EXPANSION_SLACK (so that small segments of all-zero arrays read): real features compress 1.0-1.7x,
# a few KB of compressed zeros standing in for gigabytes is a bomb however consistent its claims.
MAX_EXPANSION = 16
EXPANSION_SLACK = 64 << 20
MAX_RECORD_BYTES = 16 << 20  # a commit record
# Integer ranges of commit-record fields, by field name (default: [0, 2**63)).
_RECORD_BOUNDS: dict[str, tuple[int, int]] = {
    "unit": (0, MAX_UNIT),
    "batch": (0, MAX_BATCH),
    "bucket": (0, (1 << 15) - 1),  # the index stores buckets as int16
    "rank": (0, (1 << 31) - 1),
    "num_tokens": (1, MAX_SEGMENT_TOKENS),
    "sample_ids": (-INT64_MAX - 1, INT64_MAX),
    "lengths": (1, MAX_SEGMENT_TOKENS),
    "supervised": (0, MAX_SEGMENT_TOKENS),
}


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
    def from_json(cls, obj: Any, *, where: str) -> SegmentRecord:
        """Parse and check a record: exact JSON types (a string is never a list), ranges, sums."""
        try:
            rec = load_dataclass(cls, obj, "record", _RECORD_BOUNDS)
        except ValueError as e:
            raise CacheCorruptError(f"commit record {where} is malformed ({e})") from None
        rec.check(where)
        return rec

    def check(self, where: str) -> None:
        problems = []
        if not is_segment_name(self.name) or self.name != segment_name(self.unit, self.batch):
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
        if len(self.files) > MAX_SEGMENT_FILES:
            problems.append(f"{len(self.files)} files listed, more than {MAX_SEGMENT_FILES}")
        if problems:
            raise CacheCorruptError(f"commit record {where}: {'; '.join(problems)}")


def chunk_rows(row_bytes: int) -> int:
    """Rows per zarr chunk so a chunk holds about CHUNK_BYTES (a power of two, 16..65536)."""
    rows = max(1, CHUNK_BYTES // max(1, row_bytes))
    return int(min(65536, max(16, 1 << (rows.bit_length() - 1))))


def max_chunk_rows(row_bytes: int) -> int:
    """The most rows a received chunk may hold: `chunk_rows` with slack for other settings."""
    return max(16, CHUNK_SLACK * CHUNK_BYTES // max(1, row_bytes))


def write_array(store: LocalStore, name: str, data: np.ndarray, compressors: tuple | list) -> None:
    """An array as shard files of checksummed, compressed chunks, each shard written in one call.
    Every shard is written, all-zero ones too: a missing shard file then always means damage."""
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
        config={"write_empty_chunks": True},
    )


def read_records(root: Path) -> list[SegmentRecord]:
    """Every committed record, sorted by name. Temporary files and strangers are ignored."""
    commits = root / COMMITS_DIR
    if not commits.is_dir():
        return []

    def load(name: str) -> Any:
        return read_json(inside(root, commits / name), max_bytes=MAX_RECORD_BYTES)

    return records_from([p.name for p in commits.iterdir()], load)


def committed_names(root: Path) -> list[str]:
    """The committed segments' names, sorted, from one directory listing (no record is read)."""
    commits = root / COMMITS_DIR
    return committed_segments(p.name for p in commits.iterdir()) if commits.is_dir() else []


def record_files(names: Iterable[str]) -> list[str]:
    """The commit records' file names among the file names of a commits directory, sorted:
    temporary files and strangers left out. Shared by local and remote caches."""
    return sorted(n for n in names if record_segment(n) is not None)


def committed_segments(names: Iterable[str]) -> list[str]:
    """The segments named by the commit records among the file names of a commits directory, in
    `record_files`' order. Shared by local and remote caches."""
    return [segment for n in record_files(names) if (segment := record_segment(n)) is not None]


def records_from(names: Iterable[str], load: Callable[[str], Any]) -> list[SegmentRecord]:
    """The commit records among the file names of a commits directory (`record_files`), each
    parsed from `load(name)` (JSON) and checked; sorted by name."""
    records = []
    for name in record_files(names):
        try:
            obj = load(name)
        except (ValueError, OSError) as e:
            raise CacheCorruptError(f"commit record {name} is unreadable ({e})") from None
        rec = SegmentRecord.from_json(obj, where=name)
        if rec.name != record_segment(name):
            raise CacheCorruptError(f"commit record {name} names segment {rec.name}")
        records.append(rec)
    return records


# --- checking a received segment -------------------------------------------------------------
# `segment_files` walks a segment directory once: every path (symlinks resolved) must stay inside
# the cache root and be a directory or a regular file. `listing_problems` compares what it found
# with the record's file list; `array_problems` holds each array's zarr.json to what `write_array`
# produces and requires every shard file zarr will read. Together they cover every file zarr opens.

Found = dict[str, int | None]  # relative path -> size; None: unusable, its problem already reported


def segment_files(root: Path, name: str) -> tuple[Found, list[str]]:
    """The files under a segment's directory and the problems met walking it (a missing directory
    is no problem here: the record's list then reports every file missing)."""
    seg = segment_dir(root, name)
    if not seg.exists():
        return {}, []
    if not seg.is_dir():
        return {}, [f"{segment_rel(name)} is not a directory"]
    found: Found = {}
    problems: list[str] = []
    base, pending, seen = root.resolve(), [(seg, "")], {seg}
    while pending:
        directory, prefix = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                rel = prefix + entry.name
                path, st, problem = _resolve_entry(base, Path(entry.path), entry.is_symlink(), rel)
                if st is not None and stat.S_ISDIR(st.st_mode):
                    if path not in seen:  # a link back up the tree is walked once
                        seen.add(path)
                        pending.append((path, rel + "/"))
                    continue
                found[rel] = None if st is None else st.st_size
                if problem:
                    problems.append(problem)
                if len(found) > MAX_SEGMENT_FILES:
                    return found, [*problems, f"more than {MAX_SEGMENT_FILES} files"]
    return found, problems


def _resolve_entry(base: Path, path: Path, is_link: bool, rel: str) -> tuple[Path, os.stat_result | None, str | None]:
    """(path resolved if a link, its stat, None) for a directory or regular file inside `base`;
    (path, None, problem) for anything else."""
    if is_link:
        try:
            path = inside(base, path)
        except CacheCorruptError as e:
            return path, None, str(e)
    try:
        st = os.stat(path)
    except OSError:
        return path, None, f"{rel} is a broken link"
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return path, None, f"{rel} is not a regular file"
    return path, st, None


def listing_problems(record: SegmentRecord, found: Found) -> list[str]:
    """Files the record lists that are missing or resized, and files it does not list."""
    problems = []
    for rel, size in record.files.items():
        if rel not in found:
            problems.append(f"{rel} is missing")
        elif found[rel] is not None and found[rel] != size:
            problems.append(f"{rel} is {found[rel]} bytes, the commit recorded {size}")
    problems += [f"{rel} is not in the commit record" for rel, size in found.items()
                 if size is not None and rel not in record.files]
    return problems


def check_files(root: Path, record: SegmentRecord) -> list[str]:
    """Problems with a segment's files (missing, resized, unlisted, outside the root, not regular
    files); [] if none."""
    found, problems = segment_files(root, record.name)
    return problems + listing_problems(record, found)


@dataclass(frozen=True, slots=True)
class ArrayLayout:
    """What `write_array` makes of one array of a segment. `zeros` marks an array the record says
    is all zeros: caches written before every shard was kept may lack its shard file."""

    shape: tuple[int, ...]
    dtype: np.dtype
    compressors: tuple
    zeros: bool = False


def segment_layouts(record: SegmentRecord, feature_specs: dict[str, ArraySpec]) -> dict[str, ArrayLayout]:
    """The layout of every array of a segment, from its record and the codec's array specs."""
    t, n = record.num_tokens, record.num_samples
    shapes = {"input_ids": (t,), "loss_mask": (t,), "offsets": (n + 1,), "sample_ids": (n,)}
    zeros = {"loss_mask": not any(record.supervised), "sample_ids": not any(record.sample_ids)}
    out = {key: ArrayLayout(shapes[key], token_spec(key).dtype, token_spec(key).compressors, zeros.get(key, False))
           for key in TOKEN_ARRAYS}
    out |= {key: ArrayLayout((t, spec.columns), spec.dtype, spec.compressors) for key, spec in feature_specs.items()}
    return out


def decoded_bytes(layout: ArrayLayout) -> int:
    """What an array decodes to in memory: its shape times its dtype."""
    return int(np.prod(layout.shape, dtype=np.int64)) * layout.dtype.itemsize


def expansion_problem(found: Found, layouts: dict[str, ArrayLayout]) -> str | None:
    """A segment whose arrays would decode to far more than its files hold (`MAX_EXPANSION`): the
    manifest, the record and every zarr.json may agree and still be kilobytes standing for
    gigabytes. Checked before any array is opened."""
    stored = sum(size for size in found.values() if size is not None)
    decoded = sum(decoded_bytes(layout) for layout in layouts.values())
    if decoded <= MAX_EXPANSION * stored + EXPANSION_SLACK:
        return None
    return (f"its arrays would decode to {decoded:,} bytes, more than {MAX_EXPANSION} times its {stored:,} bytes of "
            f"files (+{EXPANSION_SLACK >> 20} MiB): compressed zeros standing in for data, not a segment the writer "
            "makes")


def _shape(value: Any) -> tuple[int, ...] | None:
    ok = isinstance(value, list) and all(type(v) is int and v >= 1 for v in value)
    return tuple(value) if ok else None


def _conf(obj: Any, name: str) -> dict:
    """The configuration of a `{"name": name, "configuration": {...}}` entry, or ValueError."""
    if not isinstance(obj, dict) or obj.get("name") != name or not isinstance(obj.get("configuration"), dict):
        raise ValueError(f"expected a {name!r} entry")
    return obj["configuration"]


def _names(chain: Any) -> list[Any]:
    return [c.get("name") if isinstance(c, dict) else None for c in chain] if isinstance(chain, list) else []


def meta_grid(meta: Any, layout: ArrayLayout) -> tuple[int, int]:
    """Check an array's zarr.json against the writer's layout; returns (rows per chunk, rows per
    shard). Raises
    ValueError before anything is allocated: another shape, dtype, key encoding or codec chain,
    or chunks and shards larger than the writer makes (a chunk bomb)."""
    if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        raise ValueError("not a zarr v3 array")
    want = layout.shape
    if _shape(meta.get("shape")) != want or meta.get("data_type") != layout.dtype.name:
        raise ValueError(f"is {meta.get('data_type')}{meta.get('shape')!r}, expected {layout.dtype.name}{list(want)}")
    if _conf(meta.get("chunk_key_encoding"), "default") != {"separator": "/"} or meta.get("storage_transformers"):
        raise ValueError("uses a chunk key encoding or storage transformer the writer never makes")
    codecs = meta.get("codecs")
    sharding = _conf(codecs[0] if isinstance(codecs, list) and len(codecs) == 1 else None, "sharding_indexed")
    chain = ["bytes", *codec_names(layout.compressors)]
    if _names(sharding.get("codecs")) != chain or _names(sharding.get("index_codecs")) != ["bytes", "crc32c"]:
        raise ValueError(f"codecs differ from the writer's ({chain})")
    if sharding.get("index_location", "end") != "end":  # every check reads a shard's index from its end
        raise ValueError("keeps its shard index at the start of the shard; the writer puts it at the end")
    shard = _shape(_conf(meta.get("chunk_grid"), "regular").get("chunk_shape"))
    chunk = _shape(sharding.get("chunk_shape"))
    if chunk is None or shard is None or chunk[1:] != want[1:] or shard[1:] != want[1:]:
        raise ValueError(f"chunk shape {sharding.get('chunk_shape')} or shard shape is not whole rows of {list(want)}")
    _check_rows(chunk[0], shard[0], want[0], layout.dtype.itemsize * int(np.prod(want[1:], dtype=np.int64)))
    return chunk[0], shard[0]


def _check_rows(chunk: int, shard: int, rows: int, row_bytes: int) -> None:
    """Chunk and shard rows within what `write_array` could have chosen for `rows` rows."""
    per_shard, whole = shard // chunk, -(-rows // chunk) * chunk
    if chunk > max_chunk_rows(row_bytes) or shard % chunk or not 1 <= per_shard <= MAX_CHUNKS_PER_SHARD \
            or shard > whole:
        raise ValueError(f"chunk rows {chunk} / shard rows {shard} exceed what the writer makes")


def _shard_problem(rel: str, size: int | None, layout: ArrayLayout, index_bytes: int) -> str | None:
    """zarr reads an absent or empty shard as zeros: either is damage (unless the record says zeros)."""
    if size is None:
        return None if layout.zeros else f"{rel} is missing"
    if size < index_bytes:
        return f"{rel} is {size} bytes, too short to hold its shard index"
    return None


EMPTY_CHUNK = 2**64 - 1  # a shard index's (offset, length) of a chunk that was never written


def shard_index_problem(rel: str, tail: bytes, size: int, chunks: int, written: int) -> str | None:
    """A shard's index, its last `16 * chunks + 4` bytes: the writer writes every chunk inside the
    array (`write_array`), so of its first `written` entries none may be marked empty (zarr would
    read that chunk as zeros) or reach past the shard's data. The CRC32C is zarr's to check."""
    entries = np.frombuffer(tail[:16 * chunks], dtype="<u8").reshape(chunks, 2)[:written]
    empty = (entries == EMPTY_CHUNK).all(axis=1)
    if empty.any():
        return f"{rel}: {int(empty.sum())} of its {written} chunks are marked empty, yet the writer writes every one"
    data_end = size - len(tail)
    if bool(((entries[:, 0] > data_end) | (entries[:, 1] > data_end - np.minimum(entries[:, 0], data_end))).any()):
        return f"{rel}: its index points past the end of its {data_end} bytes of chunks"
    return None


BLOSC_HEADER = 16  # version, flags, typesize, then uint32 decoded bytes, block bytes, frame bytes


def blosc_problem(chunk: Any, nbytes: int) -> str | None:
    """A stored Blosc chunk (its frame, then the CRC32C the writer's chain ends with) must decode
    to exactly the `nbytes` its shape holds: numcodecs sizes (and fills) its output by the frame's
    header before anything compares it with the chunk's shape."""
    if len(chunk) < BLOSC_HEADER + 4:
        return f"a chunk of {len(chunk)} bytes is too short to be a Blosc frame"
    claimed, block, frame = struct.unpack_from("<III", chunk, 4)
    if claimed != nbytes:
        return f"a Blosc chunk claims {claimed} bytes decoded, its shape holds {nbytes}"
    if not 0 < block <= claimed or frame != len(chunk) - 4:
        return f"a Blosc chunk's header claims {block}-byte blocks in a {frame}-byte frame, not its {len(chunk) - 4}"
    return None


@dataclass(frozen=True, slots=True)
class ChunkCheck:
    """What every stored chunk of one array must decode to, from its zarr.json as zarr reads it
    (held to the writer's layout again there). For arrays whose chain has no Blosc, a chunk's size
    is all zarr allocates by, and the shard index bounds that."""

    nbytes: int  # decoded bytes of one chunk
    per_shard: int  # chunks in a shard: entries in its index

    @classmethod
    def of(cls, meta: Any, layout: ArrayLayout) -> ChunkCheck | None:
        """The check for an array's chunks (None: no Blosc in its chain); ValueError as `meta_grid`."""
        chunk, shard = meta_grid(meta, layout)
        if "blosc" not in codec_names(layout.compressors):
            return None
        return cls(chunk * decoded_bytes(layout) // layout.shape[0], shard // chunk)

    def problem(self, data: Any, *, whole_shard: bool) -> str | None:
        """What is wrong with `data`: one stored chunk, or (`whole_shard`) a shard file whose index
        locates its chunks. A shard too short for its index is zarr's to refuse."""
        if not whole_shard:
            return blosc_problem(data, self.nbytes)
        index_bytes = 16 * self.per_shard + 4
        if len(data) < index_bytes:
            return None
        entries = np.frombuffer(data[len(data) - index_bytes:len(data) - 4], dtype="<u8").reshape(-1, 2)
        for offset, length in entries.tolist():
            if offset != EMPTY_CHUNK:
                problem = blosc_problem(data[offset:offset + length], self.nbytes)
                if problem:
                    return problem
        return None


def array_problems(read_meta: Callable[[str], Any], found: Found, layouts: dict[str, ArrayLayout],
                   read_tail: Callable[[str, int, int], bytes] | None = None) -> list[str]:
    """Problems with a segment's arrays: metadata unlike the writer's, or a shard file that zarr
    would silently read as zeros because it is absent or empty, or (with `read_tail(rel, nbytes,
    size)`, the last bytes of a file) whose index marks a chunk empty that the writer wrote.
    `read_meta(rel)` parses the segment's JSON file `rel` (at most MAX_ARRAY_META_BYTES)."""
    problems = []
    for key, layout in layouts.items():
        meta_rel = array_meta_rel(key)
        if found.get(meta_rel) is None:
            problems.append(f"{meta_rel} is missing")
            continue
        try:
            chunk, shard = meta_grid(read_meta(meta_rel), layout)
        except (ValueError, OSError) as e:
            problems.append(f"array {key}: {e}")
            continue
        index_bytes = 16 * (shard // chunk) + 4  # a shard ends in (offset, length) per chunk and a CRC32C
        shard_problems = (_shard_problem(rel, found.get(rel), layout, index_bytes)
                          for rel in shard_keys(key, layout.shape, shard))
        first = next((p for p in shard_problems if p), None)  # one per array is enough to name it
        if first is None and read_tail is not None and not layout.zeros:
            for i, rel in enumerate(shard_keys(key, layout.shape, shard)):
                size = found[rel]
                if size is None:  # not reached: _shard_problem named it (the array is not all zeros)
                    raise RuntimeError(f"{rel}: a missing shard passed the check for missing shards")
                written = -(-min(shard, layout.shape[0] - i * shard) // chunk)
                first = shard_index_problem(rel, read_tail(rel, index_bytes, size), size, shard // chunk, written)
                if first:
                    break
        if first:
            problems.append(first)
    return problems


def remove_uncommitted(root: Path, committed: set[str], owned: Callable[[str], bool] | None = None) -> int:
    """Delete segment directories and temp records that no commit covers (crash leftovers); with
    `owned`, only those of segments it accepts (another run may be writing the others)."""
    removed = 0
    seg_root = root / SEGMENTS_DIR
    mine = owned or (lambda _name: True)
    if seg_root.is_dir():
        for d in seg_root.iterdir():
            if d.name not in committed and mine(d.name):
                if d.is_dir() and not d.is_symlink():
                    shutil.rmtree(d, ignore_errors=True)
                else:  # a file or a symlink: remove the link itself, never what it points at
                    d.unlink(missing_ok=True)
                removed += 1
    commits = root / COMMITS_DIR
    if commits.is_dir():
        for p in commits.iterdir():
            stem = tmp_stem(p.name)
            if stem is not None and mine(stem):
                p.unlink(missing_ok=True)
    return removed
