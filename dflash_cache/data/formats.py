"""Format-specific lazy readers behind `dflash_cache.data.dataset`.

Each reader ("source") knows its files, column names and row count up front (from Arrow memory maps,
Parquet footers or a JSONL line-offset index) and yields record batches for any contiguous row range
without reading rows outside it. Validation of the values is done once, in `dflash_cache.data.dataset`.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_cache.errors import UserError, one_line

# A label that nothing is learned from: what a dataset's `labels` column holds for unsupervised tokens,
# and what the drafter's blocks put where there is nothing to predict (torch's cross-entropy default).
IGNORE_INDEX = -100

# (global index of the batch's first row, batch, file label for messages)
Batch = tuple[int, pa.RecordBatch, str]

ACCEPTED = (
    "a Hugging Face save_to_disk directory (Arrow files), an .arrow file, a .parquet file or directory "
    "of .parquet files, or a .jsonl file or directory of .jsonl files"
)
_JSONL_SUFFIXES = (".jsonl", ".json")
# `org/name` as the Hub spells a dataset (no file suffix): what a user coming from `load_dataset` types.
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_HF_METADATA = ("state.json", "dataset_info.json", "dataset_dict.json")  # save_to_disk's own files
_PARQUET_BATCH = 8192
_JSONL_BATCH = 2048
_SPECIAL = {stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFCHR: "a character device",
            stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def _ranges(counts: np.ndarray, start: int, stop: int) -> Iterator[tuple[int, int, int, int]]:
    """Yield (part, part_first_global_row, lo, hi) for the parts of `counts` overlapping [start, stop)."""
    firsts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    first_part = int(np.searchsorted(firsts, start, side="right")) - 1
    for part in range(max(first_part, 0), len(counts)):
        base = int(firsts[part])
        if base >= stop:
            break
        lo, hi = max(start - base, 0), min(stop - base, int(counts[part]))
        if hi > lo:
            yield part, base, lo, hi


class Source:
    """Row-addressable collection of record batches from one or more files (or one table)."""

    kind: str
    root: Path | None
    files: list[Path]
    columns: list[str]
    num_rows: int
    note: str = ""

    def batches(self, start: int, stop: int, columns: list[str]) -> Iterator[Batch]:
        raise NotImplementedError

    def describe(self) -> str:
        n = len(self.files)
        return f"{self.kind}: {n} file{'s' if n != 1 else ''}{self.note}"

    def rel_name(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix() if self.root else path.name


class ArrowSource(Source):
    """Arrow IPC stream/file data, memory-mapped (zero-copy), or an in-memory table."""

    def __init__(self, tables: list[pa.Table], labels: list[str], *, kind: str, files: list[Path],
                 root: Path | None, note: str = "", description: str | None = None) -> None:
        self.kind, self.files, self.root, self.note = kind, files, root, note
        self.description = description
        self.tables, self.labels = tables, labels
        self.counts = np.array([t.num_rows for t in tables], dtype=np.int64)
        self.num_rows = int(self.counts.sum())
        self.columns = list(tables[0].schema.names) if tables else []

    @classmethod
    def from_files(cls, files: list[Path], root: Path, note: str = "") -> ArrowSource:
        tables = [_read_arrow(p) for p in files]
        return cls(tables, [p.name for p in files], kind="arrow", files=files, root=root, note=note)

    def describe(self) -> str:
        return self.description or super().describe()

    def batches(self, start: int, stop: int, columns: list[str]) -> Iterator[Batch]:
        for part, base, lo, hi in _ranges(self.counts, start, stop):
            first = base + lo
            for batch in self.tables[part].select(columns).slice(lo, hi - lo).to_batches():
                if batch.num_rows:
                    yield first, batch, self.labels[part]
                    first += batch.num_rows


def _read_arrow(path: Path) -> pa.Table:
    try:
        with open(path, "rb") as fh:
            magic = fh.read(6)
        source = pa.memory_map(str(path))  # kept open: the table's buffers point into the map
        if magic == b"ARROW1":
            return pa.ipc.open_file(source).read_all()
        return pa.ipc.open_stream(source).read_all()
    except (OSError, pa.ArrowInvalid) as exc:
        raise UserError(f"cannot read Arrow file {path}: {one_line(exc)}; expected Arrow IPC stream or file format") from exc


class ParquetSource(Source):
    """Parquet files read by row group; only the row groups and columns a range needs are decoded."""

    kind = "parquet"

    def __init__(self, files: list[Path], root: Path) -> None:
        self.files, self.root = files, root
        self.meta = []
        for path in files:
            try:
                self.meta.append(pq.read_metadata(path))
            except (OSError, pa.ArrowInvalid) as exc:
                raise UserError(f"cannot read Parquet file {path}: {one_line(exc)}; is it a valid .parquet file?") from exc
        self.group_counts = [np.array([m.row_group(g).num_rows for g in range(m.num_row_groups)], dtype=np.int64)
                             for m in self.meta]
        self.counts = np.array([int(c.sum()) for c in self.group_counts], dtype=np.int64)
        self.num_rows = int(self.counts.sum())
        self.columns = list(self.meta[0].schema.to_arrow_schema().names) if self.meta else []

    def batches(self, start: int, stop: int, columns: list[str]) -> Iterator[Batch]:
        for part, base, lo, hi in _ranges(self.counts, start, stop):
            path = self.files[part]
            pf = pq.ParquetFile(path, metadata=self.meta[part])
            missing = [c for c in columns if c not in pf.schema_arrow.names]
            if missing:
                raise UserError(f"Parquet file {path.name} has no {missing[0]} column although the first file does; "
                                "all files of a dataset must share one schema")
            for group, gbase, glo, ghi in _ranges(self.group_counts[part], lo, hi):
                off = 0  # offset of the current batch inside the row group
                for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, row_groups=[group], columns=columns):
                    b_lo, b_hi = max(glo - off, 0), min(ghi - off, batch.num_rows)
                    if b_hi > b_lo:
                        yield base + gbase + off + b_lo, batch.slice(b_lo, b_hi - b_lo), path.name
                    off += batch.num_rows
                    if off >= ghi:
                        break


class JsonlSource(Source):
    """JSON-lines files with a byte-offset index of non-empty lines; reads seek to the lines they need."""

    kind = "jsonl"

    def __init__(self, files: list[Path], root: Path) -> None:
        self.files, self.root = files, root
        self.index = [_line_index(p) for p in files]
        self.counts = np.array([len(s) for s, _ in self.index], dtype=np.int64)
        self.num_rows = int(self.counts.sum())
        self.columns = []
        for part, path in enumerate(files):
            if self.counts[part]:
                first = self._parse(path, *self.index[part], 0, 1, 0)[0]
                self.columns = list(first)
                break

    def _parse(self, path: Path, starts: np.ndarray, ends: np.ndarray, lo: int, hi: int, first: int) -> list[dict]:
        with open(path, "rb") as fh:
            fh.seek(int(starts[lo]))
            blob = fh.read(int(ends[hi - 1] - starts[lo]))
        rows = []
        for i in range(lo, hi):
            a, b = int(starts[i] - starts[lo]), int(ends[i] - starts[lo])
            try:
                obj = json.loads(blob[a:b])
            except ValueError as exc:
                raise UserError(f"row {first + i - lo} ({path.name}): invalid JSON ({one_line(exc)}); "
                                "each line must be one JSON object") from exc
            if not isinstance(obj, dict):
                raise UserError(f"row {first + i - lo} ({path.name}): line is a JSON {type(obj).__name__}, not an "
                                "object; each line must be an object with input_ids and loss_mask or labels")
            rows.append(obj)
        return rows

    def batches(self, start: int, stop: int, columns: list[str]) -> Iterator[Batch]:
        for part, base, lo, hi in _ranges(self.counts, start, stop):
            path = self.files[part]
            for chunk in range(lo, hi, _JSONL_BATCH):
                end = min(chunk + _JSONL_BATCH, hi)
                rows = self._parse(path, *self.index[part], chunk, end, base + chunk)
                arrays = [_to_arrow([r.get(c) for r in rows], c, base + chunk, path.name) for c in columns]
                yield base + chunk, pa.RecordBatch.from_arrays(arrays, names=columns), path.name


def _to_arrow(values: list, column: str, first: int, label: str) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as exc:
        bad = next((i for i, v in enumerate(values) if not _converts(v)), 0)  # error path only
        expected = "a list of {role, content} objects" if column == "messages" else "a list of integers"
        raise UserError(f"row {first + bad} ({label}): {column} has mixed or unsupported values ({one_line(exc)}); "
                        f"expected {expected}") from exc


def _converts(value: object) -> bool:
    try:
        pa.array([value])
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
        return False
    return True


def _line_index(path: Path, chunk: int = 64 << 20) -> tuple[np.ndarray, np.ndarray]:
    """Byte (start, end) offsets of the non-empty lines of a file, scanning it once in chunks."""
    newlines = []
    size = path.stat().st_size
    with open(path, "rb") as fh:
        pos = 0
        while data := fh.read(chunk):
            newlines.append(np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10).astype(np.int64) + pos)
            pos += len(data)
    nl = np.concatenate(newlines) if newlines else np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], nl + 1]).astype(np.int64)
    ends = np.concatenate([nl, [size]]).astype(np.int64)
    keep = ends > starts
    return starts[keep], ends[keep]


def _special(path: Path) -> str | None:
    """What `path` is if it is neither a regular file nor a directory (links followed): reading a
    FIFO waits for a writer and a device like /dev/zero never ends, so neither is ever opened."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return _SPECIAL.get(stat.S_IFMT(mode), "not a regular file")


def open_source(path: Path) -> Source:
    """Detect the format of `path` and open it lazily."""
    if not path.exists():
        # org/name whose org is no local folder: a Hub name, not a mistyped local path
        if (_HUB_NAME.fullmatch(str(path)) and path.suffix not in (".parquet", ".arrow", *_JSONL_SUFFIXES)
                and not path.parent.exists()):
            raise UserError(f"--data {path} looks like a Hugging Face Hub name, but only local datasets are read; "
                            f"save it first: python -c \"import datasets; datasets.load_dataset('{path}', "
                            f"split='train').save_to_disk('data/{path.name}')\", then pass --data data/{path.name}")
        raise UserError(f"dataset path {path} does not exist; pass {ACCEPTED}")
    special = _special(path)
    if special:
        raise UserError(f"dataset path {path} is {special}, not a data file or directory; pass {ACCEPTED} "
                        "(write a stream to a file first)")
    if not os.access(path, os.R_OK):
        raise UserError(f"dataset path {path} is not readable; check its permissions")
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            return ParquetSource([path], path.parent)
        if suffix in _JSONL_SUFFIXES:
            return JsonlSource([path], path.parent)
        if suffix == ".arrow":
            return ArrowSource.from_files([path], path.parent)
        raise UserError(f"unrecognised dataset file {path} (suffix {suffix or 'none'}); pass {ACCEPTED}")
    return _open_dir(path, path, "")


def _open_dir(path: Path, root: Path, note: str) -> Source:
    if (path / "dataset_dict.json").is_file():
        splits = _dataset_dict_splits(path)
        if "train" not in splits or not (path / "train").is_dir():
            raise UserError(f"DatasetDict at {path} has no train split (splits: {', '.join(splits) or 'none'}); "
                            f"pass the split directory you want, e.g. {path}/<split>")
        return _open_dir(path / "train", root, " (train split)")
    arrows = _data_files(path, (".arrow",))
    parquets = _data_files(path, (".parquet",))
    jsonls = [p for p in _data_files(path, _JSONL_SUFFIXES) if p.name not in _HF_METADATA]
    _refuse_mixed(path, {"Arrow": arrows, "Parquet": parquets, "JSONL": jsonls})
    if (path / "state.json").is_file() or (path / "dataset_info.json").is_file() or arrows:
        files = _state_files(path) or arrows
        if not files:
            raise UserError(f"Hugging Face dataset directory {path} has no .arrow data files; re-save it with save_to_disk")
        return ArrowSource.from_files(files, root, note)
    if parquets:
        return ParquetSource(parquets, root)
    if jsonls:
        return JsonlSource(jsonls, root)
    raise UserError(f"unrecognised dataset directory {path} (no dataset_dict.json, state.json, .arrow, .parquet or "
                    f".jsonl files); pass {ACCEPTED}")


def _data_files(path: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """The regular files of directory `path` with one of `suffixes` (any case), sorted; a FIFO or a
    device among them is refused (reading it would hang), a subdirectory is no data file."""
    files = []
    for p in sorted(path.iterdir()):
        if p.suffix.lower() not in suffixes:
            continue
        special = _special(p)
        if special:
            raise UserError(f"dataset directory {path} holds {p.name}, which is {special}; move it out or write "
                            "its rows to a regular file")
        if p.is_file():
            files.append(p)
    return files


def _refuse_mixed(path: Path, by_format: dict[str, list[Path]]) -> None:
    """One format per directory: reading only one of two would drop the other's rows silently."""
    found = {fmt: files for fmt, files in by_format.items() if files}
    if len(found) > 1:
        shown = " and ".join(f"{fmt} ({files[0].name}{', ...' if len(files) > 1 else ''})"
                             for fmt, files in found.items())
        both = "both " if len(found) == 2 else ""
        raise UserError(f"dataset directory {path} holds {both}{shown} files; keep one format per directory "
                        "or pass one file")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {one_line(exc)}; re-save the dataset with save_to_disk") from exc
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a JSON object; re-save the dataset with save_to_disk")
    return data


def _dataset_dict_splits(path: Path) -> list[str]:
    splits = _read_json(path / "dataset_dict.json").get("splits")
    if isinstance(splits, list):
        return [str(s) for s in splits]
    return sorted(p.name for p in path.iterdir() if p.is_dir())


def _state_files(path: Path) -> list[Path]:
    state = path / "state.json"
    if not state.is_file():
        return []
    entries = _read_json(state).get("_data_files") or []
    files = [path / e["filename"] for e in entries if isinstance(e, dict) and "filename" in e]
    for f in files:
        special = _special(f)
        if special:
            raise UserError(f"{state} lists {f.name}, which is {special}; re-save the dataset with save_to_disk")
        if not f.is_file():
            raise UserError(f"{state} lists {f.name} but the file is missing; re-save the dataset with save_to_disk")
    return files
