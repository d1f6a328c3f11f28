"""Reading a cache: the manifest, the committed segments, the sample index, and feature data.

`CacheReader` is the API phase 2 builds on. Opening one reads JSON and Parquet only (never
pickle), sees committed segments only, and checks each segment's file list before its data is
touched, so a missing shard is an error naming the segment rather than a block of zeros.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import zarr
from zarr.storage import LocalStore

from dflash_cache.codecs import TOKEN_ARRAYS, FeatureCodec, get_codec, numpy_to_torch
from dflash_cache.errors import CacheCorruptError, UserError
from dflash_cache.jsonio import write_bytes_atomic
from dflash_cache.manifest import Manifest, read_manifest
from dflash_cache.segments import SegmentRecord, check_files, read_records, segment_dir

INDEX_FILE = "index.parquet"
OPEN_ARRAYS = 1024  # opened zarr arrays kept per reader (random sample access hits many segments)
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


def build_index(records: list[SegmentRecord]) -> pa.Table:
    """Sample index of the given records, in record order then in-segment order."""
    cols: dict[str, list] = {name: [] for name in INDEX_SCHEMA.names}
    for rec in records:
        offsets = np.concatenate([[0], np.cumsum(rec.lengths)[:-1]]) if rec.lengths else []
        n = rec.num_samples
        cols["sample_id"].extend(rec.sample_ids)
        cols["segment"].extend([rec.name] * n)
        cols["row_offset"].extend(int(o) for o in offsets)
        cols["length"].extend(rec.lengths)
        cols["supervised"].extend(rec.supervised)
        cols["unit"].extend([rec.unit] * n)
        cols["batch"].extend([rec.batch] * n)
        cols["bucket"].extend([rec.bucket] * n)
    return pa.table(cols, schema=INDEX_SCHEMA)


def records_digest(records: list[SegmentRecord]) -> str:
    return hashlib.sha256("\n".join(r.name for r in records).encode()).hexdigest()


def write_index(root: Path, records: list[SegmentRecord]) -> pa.Table:
    """Write index.parquet atomically, tagged with the commits it covers."""
    table = build_index(records).replace_schema_metadata(
        {"commits": str(len(records)), "commits_digest": records_digest(records)}
    )
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    write_bytes_atomic(root / INDEX_FILE, sink.getvalue().to_pybytes())
    return table


class CacheReader:
    """Read-only view of a cache's committed state at the time it was opened."""

    def __init__(self, root: str | Path, *, check_segment_files: bool = True) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise UserError(f"cache directory {self.root} does not exist; check the path")
        self.manifest: Manifest = read_manifest(self.root)
        self.codec: FeatureCodec = get_codec(self.manifest.codec)
        self.records: list[SegmentRecord] = read_records(self.root)
        self._by_name = {r.name: r for r in self.records}
        self._check_segment_files = check_segment_files
        self._checked: set[str] = set()
        self._open: dict[tuple[str, str], zarr.Array] = {}

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

    # --- index ---------------------------------------------------------------------------
    @cached_property
    def index(self) -> pa.Table:
        """The sample index (Arrow). Uses index.parquet when it covers exactly the commits."""
        path = self.root / INDEX_FILE
        if path.is_file():
            meta = pq.read_schema(path).metadata or {}
            if meta.get(b"commits_digest", b"").decode() == records_digest(self.records):
                return pq.read_table(path).replace_schema_metadata(None)
        return build_index(self.records)

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

    def _array(self, name: str, key: str) -> zarr.Array:
        rec = self.record(name)
        if self._check_segment_files and name not in self._checked:
            problems = check_files(self.root, rec)
            if problems:
                raise CacheCorruptError(f"segment {name} is damaged: {'; '.join(problems)}")
            self._checked.add(name)
        cached = self._open.get((name, key))
        if cached is not None:
            return cached
        store = LocalStore(segment_dir(self.root, name), read_only=True)
        arr = zarr.open_array(store, path=key, mode="r")
        self._check_shape(rec, key, arr)
        if len(self._open) >= OPEN_ARRAYS:  # opening parses JSON: keep recent arrays open
            self._open.pop(next(iter(self._open)))
        self._open[(name, key)] = arr
        return arr

    def _check_shape(self, rec: SegmentRecord, key: str, arr: zarr.Array) -> None:
        """Refuse arrays whose recorded shape disagrees with the commit, before allocating."""
        m = self.manifest
        specs = self.codec.arrays(m.n_layers, m.hidden_size)
        expected: tuple[int, ...]
        if key in specs:
            expected, dtype = (rec.num_tokens, specs[key].columns), specs[key].dtype
        elif key in ("input_ids", "loss_mask"):
            expected, dtype = (rec.num_tokens,), TOKEN_ARRAYS[key]
        else:
            expected, dtype = (rec.num_samples + (key == "offsets"),), TOKEN_ARRAYS[key]
        if tuple(arr.shape) != expected or np.dtype(arr.dtype) != dtype:
            raise CacheCorruptError(
                f"segment {rec.name}: array {key} is {arr.dtype}{list(arr.shape)}, "
                f"expected {dtype}{list(expected)}"
            )

    def read_array(self, name: str, key: str, start: int | None = None, stop: int | None = None) -> np.ndarray:
        try:
            return np.asarray(self._array(name, key)[start:stop])
        except (CacheCorruptError, UserError):
            raise
        except Exception as e:  # zarr raises assorted types for a failed checksum or decode
            raise CacheCorruptError(f"segment {name}: array {key} failed to decode ({type(e).__name__}: {e})") from None

    def read_segment(self, name: str) -> dict[str, np.ndarray]:
        """All arrays of one segment (stored dtypes), decoded from disk."""
        keys = [*TOKEN_ARRAYS, *self.codec.arrays(self.manifest.n_layers, self.manifest.hidden_size)]
        return {k: self.read_array(name, k) for k in keys}

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
