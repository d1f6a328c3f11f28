"""Reading a cache: the manifest, the committed segments, the sample index, and feature data.

`CacheReader` is the API phase 2 builds on. Opening one reads JSON and Parquet only (never
pickle) and sees committed segments only. A cache may come from anyone, so before a segment's
data is touched its directory is walked once (every path inside the root, regular files only,
exactly the files its record lists) and each array's zarr.json is held to what the writer makes
(shape, dtype, codecs, bounded chunks, every shard file present, and every chunk the writer wrote
present in its shard's index): damage is an error naming the segment, never a block of zeros or an
allocation sized by a stranger. After that first look, a chunk file that vanishes or a commit
record that is replaced (the cache deleted or made again under a training run) is such an error too.

Memory is held to what the cache's bytes can stand for before it is allocated: a segment may
decode to at most `MAX_EXPANSION` times its files, each chunk's Blosc header must claim exactly
what its shape holds (numcodecs allocates what the header says), and plan.parquet and
index.parquet are decoded only after their footers' row counts, columns and page sizes agree with
the manifest and the records (`read_parquet_within`).

A reader is shared by the trainer's prefetch threads: its caches of opened arrays, decoded
one-chunk arrays and checked segments are guarded by a lock.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import zarr
from zarr.abc.store import RangeByteRequest
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore, WrapperStore

from dflash_cache.errors import CacheCorruptError, UserError
from dflash_cache.files import ParquetClaimError, ParquetLimits, read_parquet_within, write_parquet_atomic
from dflash_cache.store.batch import HostBatch
from dflash_cache.store.codecs import TOKEN_ARRAYS, FeatureCodec, get_codec, numpy_to_torch
from dflash_cache.store.layout import INDEX_FILE, ZARR_JSON, array_meta_rel
from dflash_cache.store.location import LocalCache, Location, open_location
from dflash_cache.store.manifest import Manifest
from dflash_cache.store.segments import (
    ArrayLayout,
    ChunkCheck,
    SegmentRecord,
    array_problems,
    expansion_problem,
    listing_problems,
    segment_layouts,
)

log = logging.getLogger(__name__)

OPEN_ARRAYS = 1024  # opened zarr arrays kept per reader (random sample access hits many segments)
# Bytes of whole decoded one-chunk arrays kept per reader (`CacheReader._rows`): a segment's token
# arrays, and every array of a short segment or a small target, are one chunk each.
DECODED_BYTES = 64 << 20
INDEX_BYTES_PER_SAMPLE = 256  # an index.parquet larger than this per sample (+1 MiB) is not read
# What zarr 3.1 / numcodecs raise when stored bytes fail to decode: ValueError for a CRC32C
# mismatch (a flipped byte, a truncated shard, a damaged shard index), RuntimeError from Blosc
# for a stream it cannot decompress. Only the zarr read itself sits inside the try.
DECODE_ERRORS = (ValueError, RuntimeError)


class MissingChunk(Exception):
    """A segment's chunk file that zarr asked for is not there (`_SegmentStore`)."""


class ChunkClaim(Exception):
    """A stored chunk claims to decode to more than its shape holds (`_SegmentStore`)."""


class _SegmentStore(WrapperStore):
    """A segment's store that holds what zarr reads to the segment's layouts, as it reads it.

    A missing chunk file raises MissingChunk: zarr itself reads a missing chunk as the fill value,
    zeros. Every chunk of a committed segment was written (the reader checked them once), except
    in arrays that its record says are all zeros (older writers skipped those); one gone since was
    deleted under the reader. And each chunk's Blosc header must claim exactly what the chunk's
    shape holds (`ChunkCheck`, from the array's zarr.json as zarr reads it), else ChunkClaim: a
    header's claim is what numcodecs allocates, before zarr compares it with the shape."""

    def __init__(self, store, layouts: dict[str, ArrayLayout]) -> None:
        super().__init__(store)
        self._layouts = layouts
        self._chunks: dict[str, ChunkCheck | None] = {}  # by array, once zarr has read its zarr.json

    def _check(self, key: str, value, byte_range):
        array, _, rest = key.partition("/")
        layout = self._layouts.get(array)
        if value is None:
            if not key.endswith(ZARR_JSON) and not (layout is not None and layout.zeros):
                raise MissingChunk(key)
        elif layout is not None and rest == ZARR_JSON:
            self._chunks[array] = ChunkCheck.of(json.loads(value.to_bytes()), layout)
        elif (check := self._chunks.get(array)) is not None and (
                byte_range is None or isinstance(byte_range, RangeByteRequest)):
            # a whole shard, or one chunk of it (zarr asks for a shard's index by a suffix request)
            problem = check.problem(value.as_numpy_array(), whole_shard=byte_range is None)
            if problem:
                raise ChunkClaim(f"{key}: {problem}")
        return value

    async def get(self, key, prototype, byte_range=None):
        return self._check(key, await self._store.get(key, prototype, byte_range), byte_range)

    async def get_partial_values(self, prototype, key_ranges):
        key_ranges = list(key_ranges)
        values = await self._store.get_partial_values(prototype, key_ranges)
        return [self._check(key, value, byte_range) for (key, byte_range), value in zip(key_ranges, values, strict=True)]


def memory_store(blobs: dict[str, bytes]) -> MemoryStore:
    """A read-only zarr store over files held in memory (relative path -> bytes)."""
    buffer = default_buffer_prototype().buffer
    return MemoryStore({rel: buffer.from_bytes(data) for rel, data in blobs.items()}, read_only=True)
INDEX_SCHEMA = pa.schema(
    [
        ("sample_id", pa.int64()),
        ("segment", pa.string()),
        ("row_offset", pa.int64()),
        ("length", pa.int32()),
        ("supervised", pa.int32()),
        ("unit", pa.int32()),
        ("batch", pa.int32()),
        ("bucket", pa.int16()),
    ]
)


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample read back from the cache. `features` is bf16 [length, n_layers * H]."""

    sample_id: int
    segment: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    features: torch.Tensor


def _per_sample(records: list[SegmentRecord], attr: str, total: int) -> np.ndarray:
    return np.fromiter((v for r in records for v in getattr(r, attr)), np.int64, total)


def build_index(records: list[SegmentRecord]) -> pa.Table:
    """Sample index of the given records, in record order then in-segment order. Vectorised:
    the records are the truth, and rebuilding from them is cheap even for millions of samples."""
    counts = np.fromiter((r.num_samples for r in records), np.int64, len(records))
    total = int(counts.sum())
    lengths = _per_sample(records, "lengths", total)
    seg = np.repeat(np.arange(len(records)), counts)
    starts = np.cumsum(lengths) - lengths  # over all records; each segment's first sample is its zero
    row_offset = starts - np.repeat(starts[np.cumsum(counts) - counts], counts)
    per_segment = {key: np.fromiter((getattr(r, key) for r in records), np.int64, len(records))[seg]
                   for key in ("unit", "batch", "bucket")}
    cols = {
        "sample_id": _per_sample(records, "sample_ids", total),
        "segment": pc.take(pa.array([r.name for r in records], pa.string()), pa.array(seg, pa.int64())),
        "row_offset": row_offset,
        "length": lengths,
        "supervised": _per_sample(records, "supervised", total),
        **per_segment,
    }
    return pa.table(cols, schema=INDEX_SCHEMA)


def index_difference(table: pa.Table, expected: pa.Table) -> str | None:
    """What differs between an index table and the one the records imply (None: nothing)."""
    if table.schema != expected.schema:
        return f"{INDEX_FILE} has columns {table.schema.names} of other types than {expected.schema.names}"
    if table.num_rows != expected.num_rows:
        return f"{INDEX_FILE} has {table.num_rows} rows, the commit records {expected.num_rows}"
    for name in expected.column_names:
        if not table.column(name).equals(expected.column(name)):
            return f"{INDEX_FILE} disagrees with the commit records in column {name}"
    return None


def records_digest(records: list[SegmentRecord]) -> str:
    return hashlib.sha256("\n".join(r.name for r in records).encode()).hexdigest()


def index_table(records: list[SegmentRecord]) -> pa.Table:
    """index.parquet's table, tagged with the commits it covers."""
    return build_index(records).replace_schema_metadata(
        {"commits": str(len(records)), "commits_digest": records_digest(records)}
    )


def write_index(root: Path, records: list[SegmentRecord]) -> pa.Table:
    """Write index.parquet atomically, tagged with the commits it covers."""
    table = index_table(records)
    write_parquet_atomic(root / INDEX_FILE, table)
    return table


def read_parquet(root: str | Path | Location, name: str, limits: ParquetLimits, max_bytes: int = 1 << 30) -> pa.Table:
    """A Parquet file of a cache (plan.parquet, index.parquet): a local one's read with the care
    of `open_regular`, and decoded only within `limits`; CacheCorruptError naming the file and the
    fix otherwise."""
    table = parquet_or_corrupt(open_location(root), name, limits, max_bytes)
    if table is None:
        raise CacheCorruptError(f"{name} is missing; copy the cache again or re-run extract")
    return table


def parquet_or_corrupt(location: Location, name: str, limits: ParquetLimits, max_bytes: int) -> pa.Table | None:
    """`location.parquet` decoded within `limits`, with a file that cannot be read, or claims more
    than they allow, as CacheCorruptError naming it and the fix."""
    try:
        return location.parquet(name, max_bytes, partial(read_parquet_within, name=name, limits=limits))
    except ParquetClaimError as e:
        raise CacheCorruptError(f"{e}; copy the cache again or re-run extract") from None
    except (OSError, ValueError, pa.ArrowException) as e:
        raise CacheCorruptError(f"{name} is unreadable ({e}); copy the cache again or re-run extract") from None


class _Recent:
    """Values by key up to a total weight (a count, or bytes), least recently used dropped first.
    Prefetch threads share one reader, so every look-up and eviction holds the lock; making a
    value happens outside it (opening parses JSON, decoding decompresses). A value heavier than
    the whole capacity is not kept."""

    def __init__(self, capacity: int, weigh: Callable[[Any], int] = lambda _value: 1) -> None:
        self.capacity = max(1, capacity)
        self._weigh = weigh
        self._lock = threading.Lock()
        self._items: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._weight = 0

    def get(self, key: tuple[str, str]) -> Any | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: tuple[str, str], value: Any) -> None:
        weight = self._weigh(value)
        if weight > self.capacity:
            return
        with self._lock:
            old = self._items.pop(key, None)
            self._weight += weight - (old[1] if old is not None else 0)
            self._items[key] = (value, weight)
            while self._weight > self.capacity:
                self._weight -= self._items.popitem(last=False)[1][1]


class CacheReader:
    """Read-only view of a cache's committed state at the time it was opened. Thread-safe.

    `check_segment_files=False` skips comparing a segment's files with its record's list; the
    safety checks (paths inside the root, regular files, array metadata, shard files present)
    always run. `open_arrays` bounds the opened zarr arrays kept, `decoded_bytes` the decoded
    one-chunk arrays."""

    def __init__(self, root: str | Path, *, check_segment_files: bool = True, open_arrays: int = OPEN_ARRAYS,
                 decoded_bytes: int = DECODED_BYTES) -> None:
        self.location = open_location(root)
        # The local directory (None for a cache on object storage, which is read-only here).
        self.root: Path | None = self.location.root if isinstance(self.location, LocalCache) else None
        if not self.location.exists():
            kind = "cache directory" if self.root is not None else "cache"
            raise UserError(f"{kind} {self.location} does not exist; check the path")
        self.manifest: Manifest = self.location.manifest()
        self.codec: FeatureCodec = get_codec(self.manifest.codec)
        if self.manifest.codec_layout != self.codec.layout:
            made = f"layout {self.manifest.codec_layout!r}" if self.manifest.codec_layout else "an earlier layout"
            raise UserError(f"cache {self.location} stores codec {self.codec.name} in {made}; this release reads "
                            f"{self.codec.layout!r}: extract it again (--overwrite), or read it with the release that wrote it")
        self.records: list[SegmentRecord] = self.location.records()
        self._by_name = {r.name: r for r in self.records}
        self._check_segment_files = check_segment_files
        self._lock = threading.Lock()
        # Segments whose files and array metadata passed, with their commit record's stamp then: a
        # record replaced since means the cache was made again under this reader.
        self._checked: dict[str, tuple | None] = {}
        self._open = _Recent(open_arrays)
        self._decoded = _Recent(decoded_bytes, weigh=lambda values: values.nbytes)

    # --- summary -------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return sum(r.num_samples for r in self.records)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.records)

    @property
    def num_supervised(self) -> int:
        return sum(sum(r.supervised) for r in self.records)

    @property
    def complete(self) -> bool:
        return len(self.records) == self.manifest.plan.num_segments

    def bytes_on_disk(self) -> int:
        return sum(sum(r.files.values()) for r in self.records)

    def read_parquet(self, name: str, limits: ParquetLimits, max_bytes: int = 1 << 30) -> pa.Table | None:
        """A Parquet file at the cache root (plan.parquet, index.parquet), None if absent;
        CacheCorruptError naming the file and the fix if it cannot be read within `limits`."""
        return parquet_or_corrupt(self.location, name, limits, max_bytes)

    # --- index ---------------------------------------------------------------------------
    @cached_property
    def index(self) -> pa.Table:
        """The sample index (Arrow), always what the commit records imply: index.parquet is
        derived data, so one that disagrees is reported (a warning, and `index_problem` for
        verify) and the index rebuilt from the records is used instead."""
        if self.index_problem:
            log.warning("%s; using the index rebuilt from the records (re-run extract to rewrite the file)",
                        self.index_problem)
        return self._built_index

    @cached_property
    def _built_index(self) -> pa.Table:
        return build_index(self.records)

    @cached_property
    def index_problem(self) -> str | None:
        """Why index.parquet cannot be trusted, or None when it is absent, stale (written before
        later commits: extract rewrites it) or agrees exactly with the commit records. Its footer
        is read first: a stale file is never decoded, and one that claims other columns, another
        row count or absurd sizes is reported undecoded (`read_parquet_within`)."""
        limit = INDEX_BYTES_PER_SAMPLE * self.num_samples + (1 << 20)
        limits = ParquetLimits(INDEX_SCHEMA, self.num_samples, f"the commit records {self.num_samples}",
                               tagged={b"commits_digest": records_digest(self.records).encode()})
        read = partial(read_parquet_within, name=INDEX_FILE, limits=limits)
        try:
            table = self.location.parquet(INDEX_FILE, limit, read)
        except (CacheCorruptError, ParquetClaimError) as e:
            return str(e)
        except (OSError, ValueError, pa.ArrowException) as e:
            return f"{INDEX_FILE} is unreadable ({e})"
        if table is None:
            return None
        return index_difference(table.replace_schema_metadata(None), self._built_index)

    @cached_property
    def _sample_lookup(self) -> tuple[np.ndarray, np.ndarray]:
        ids = self.index.column("sample_id").to_numpy()
        order = np.argsort(ids, kind="stable")
        return ids[order], order

    def locate(self, sample_id: int) -> dict:
        ids, order = self._sample_lookup
        pos = int(np.searchsorted(ids, sample_id))
        if pos >= len(ids) or ids[pos] != sample_id:
            raise UserError(f"sample {sample_id} is not in this cache ({len(ids)} samples committed)")
        return self.index.slice(int(order[pos]), 1).to_pylist()[0]

    # --- data ----------------------------------------------------------------------------
    def record(self, name: str) -> SegmentRecord:
        try:
            return self._by_name[name]
        except KeyError:
            raise UserError(f"segment {name} is not committed in this cache") from None

    def layouts(self, rec: SegmentRecord) -> dict[str, ArrayLayout]:
        """Every array of a segment as the writer makes it, from its record and the manifest."""
        return segment_layouts(rec, self.codec.arrays(self.manifest.n_layers, self.manifest.hidden_size))

    def check_segment(self, rec: SegmentRecord, *, check_files: bool = False) -> None:
        """Walk a segment and check its arrays' metadata, once per reader; CacheCorruptError
        naming the segment and every problem. `check_files` compares its files with the record's
        list even if the reader skips that. Threads may race to check: the check is idempotent."""
        with self._lock:
            if rec.name in self._checked:
                return
        stamp = self.location.commit_stamp(rec.name)
        found, problems = self.location.segment_files(rec.name)
        if self._check_segment_files or check_files:
            problems += listing_problems(rec, found)
        layouts = self.layouts(rec)
        if not problems:
            problems = [p for p in [expansion_problem(found, layouts)] if p]
        if not problems:
            metas = {rel: found[rel] for rel in map(array_meta_rel, layouts) if rel in found}
            problems = array_problems(self.location.segment_metas(rec.name, metas), found, layouts,
                                      self.location.segment_tails(rec.name))
        if problems:
            raise CacheCorruptError(f"segment {rec.name} is damaged: {'; '.join(problems)}")
        with self._lock:
            self._checked[rec.name] = stamp

    def check_unchanged(self, name: str) -> None:
        """CacheCorruptError if the segment's commit record is not the one it had when checked (a stat:
        callers reading many rows of one segment check once, after the last)."""
        with self._lock:
            stamp = self._checked.get(name)
        if stamp is not None and self.location.commit_stamp(name) != stamp:
            raise CacheCorruptError(f"segment {name} changed (its commit record was deleted or replaced) while it "
                                    "was being read: the cache was deleted or made again under this run; let the "
                                    "other job finish, then start again")

    def _array(self, name: str, key: str) -> zarr.Array:
        cached = self._open.get((name, key))
        if cached is not None:
            return cached
        rec = self.record(name)
        self.check_segment(rec)
        layouts = self.layouts(rec)
        arr = self._open_array(_SegmentStore(self.location.zarr_store(name), layouts), rec, key, layouts)
        self._open.put((name, key), arr)
        return arr

    def _open_array(self, store, rec: SegmentRecord, key: str,
                    layouts: dict[str, ArrayLayout] | None = None) -> zarr.Array:
        """Array `key` of segment `rec` (checked) from `store`, held to the layout the writer makes."""
        layout = (layouts if layouts is not None else self.layouts(rec)).get(key)
        if layout is None:
            raise UserError(f"segment {rec.name} has no array {key!r}")
        try:
            arr = zarr.open_array(store, path=key, mode="r", zarr_format=3)
        except (ValueError, TypeError, KeyError, OSError) as e:  # metadata passed our check but not zarr's
            raise CacheCorruptError(f"segment {rec.name}: array {key} cannot be opened ({type(e).__name__}: {e})") from None
        if tuple(arr.shape) != layout.shape or np.dtype(arr.dtype) != layout.dtype:  # changed since checked
            raise CacheCorruptError(f"segment {rec.name}: array {key} changed while it was being read")
        return arr

    def read_array(self, name: str, key: str, start: int | None = None, stop: int | None = None, *,
                   check_unchanged: bool = True) -> np.ndarray:
        """Rows start:stop of one array of a committed segment, decoded; an error naming the segment
        if it cannot be, or (unless the caller checks later: `check_unchanged`) if the segment changed
        on disk since this reader checked it."""
        values = self._rows(self._array(name, key), name, key, start, stop)
        if check_unchanged:
            self.check_unchanged(name)
        return values

    def _rows(self, arr: zarr.Array, name: str, key: str, start: int | None, stop: int | None) -> np.ndarray:
        """Rows start:stop of an opened array, held to the codec. zarr decodes a whole chunk for any
        of its rows, so an array stored as one chunk is decoded once and kept (`decoded_bytes`): every
        sample of its segment would decode all of it again. What is kept was decoded and checksummed;
        a file deleted after that is not read again for it."""
        if (start is None and stop is None) or arr.chunks[0] < arr.shape[0]:
            values = self._decoded_values(arr, name, key, start, stop)
        else:
            whole = self._decoded.get((name, key))
            if whole is None:
                whole = self._decoded_values(arr, name, key)
                self._decoded.put((name, key), whole)
            values = whole[start:stop].copy()
        problem = self.codec.stored_problem(key, values, self.manifest.hidden_size)
        if problem:
            raise CacheCorruptError(f"segment {name}: array {key}: {problem}")
        return values

    def _decoded_values(self, arr: zarr.Array, name: str, key: str, start: int | None = None,
                        stop: int | None = None) -> np.ndarray:
        """Rows start:stop of an opened array, decoded (every chunk's CRC32C checked)."""
        try:
            with self.location.guard():  # a failed request to object storage: one line naming the URL
                return np.asarray(arr[start:stop])
        except DECODE_ERRORS as e:
            raise CacheCorruptError(f"segment {name}: array {key} failed to decode ({type(e).__name__}: {e})") from None
        except ChunkClaim as e:
            raise CacheCorruptError(f"segment {name}: array {key}: {e}; copy the cache again or re-run extract") from None
        except MissingChunk as e:
            raise CacheCorruptError(f"segment {name}: array {key}: its file {e} is missing (it was there when "
                                    "the cache was opened: deleted since, by another job on this cache?); let the "
                                    "other job finish, then start again") from None

    def read_segment(self, name: str) -> dict[str, np.ndarray]:
        """All arrays of one segment (stored dtypes), decoded. On object storage the segment's
        objects are first fetched whole, concurrently (`RemoteCache.fetch_segment`)."""
        keys = [*TOKEN_ARRAYS, *self.codec.arrays(self.manifest.n_layers, self.manifest.hidden_size)]
        if isinstance(self.location, LocalCache):
            return {k: self.read_array(name, k) for k in keys}
        rec = self.record(name)
        self.check_segment(rec)
        blobs = self.location.fetch_segment(name, rec.files)
        layouts = self.layouts(rec)
        problems = array_problems(lambda rel: json.loads(blobs[rel]), {rel: len(b) for rel, b in blobs.items()},
                                  layouts, lambda rel, nbytes, size: blobs[rel][-nbytes:])
        if problems:
            raise CacheCorruptError(f"segment {name} is damaged: {'; '.join(problems)}")
        store = _SegmentStore(memory_store(blobs), layouts)
        return {k: self._rows(self._open_array(store, rec, k, layouts), name, k, None, None) for k in keys}

    def read_batch(self, name: str) -> tuple[HostBatch, dict[str, np.ndarray]]:
        """A segment as it was committed: its packed batch and its stored (encoded) feature arrays."""
        arrays = self.read_segment(name)
        features = {k: arrays[k] for k in self.codec.arrays(self.manifest.n_layers, self.manifest.hidden_size)}
        batch = HostBatch.from_stored(arrays)
        record = self._by_name.get(name)
        if record is not None and not (np.array_equal(batch.lengths, record.lengths)
                                       and np.array_equal(batch.sample_ids, record.sample_ids)):
            # A few numbers per batch: a record claiming tokens its arrays do not hold (rows that would
            # read as the padding of the last chunk) is caught here, not only by `inspect --verify`.
            raise CacheCorruptError(f"segment {name}: its stored offsets or sample ids disagree with its commit "
                                    "record; run `dflash-cache inspect CACHE --verify --repair`, then extract again")
        return batch, features

    def decode_features(self, arrays: dict[str, np.ndarray], device: str | torch.device = "cpu") -> torch.Tensor:
        specs = self.codec.arrays(self.manifest.n_layers, self.manifest.hidden_size)
        tensors = {k: numpy_to_torch(k, arrays[k]).to(device) for k in specs}
        return self.codec.decode(tensors, self.manifest.n_layers)

    def sample(self, sample_id: int) -> Sample:
        loc = self.locate(sample_id)
        name, start = loc["segment"], loc["row_offset"]
        stop = start + loc["length"]
        specs = self.codec.arrays(self.manifest.n_layers, self.manifest.hidden_size)
        stored = {k: self.read_array(name, k, start, stop) for k in specs}
        return Sample(
            sample_id=sample_id,
            segment=name,
            input_ids=self.read_array(name, "input_ids", start, stop),
            loss_mask=self.read_array(name, "loss_mask", start, stop),
            features=self.decode_features(stored),
        )

    def iter_segments(self) -> Iterator[tuple[SegmentRecord, dict[str, np.ndarray]]]:
        for rec in self.records:
            yield rec, self.read_segment(rec.name)
