"""Lazy, validated readers for tokenized training datasets.

Extraction runs for hours and writes a cache that training trusts, so the dataset is checked once, up
front, by `TokenizedDataset.scan`: every row's types, lengths, loss mask values and token ids are
validated (vectorised per record batch) before any hidden state is written, and a bad row surfaces as a
one-line `UserError` instead of a half-written cache. Data is never loaded whole: Arrow files are
memory-mapped, Parquet is read by row group and JSONL through a line-offset index
(see `dflash_cache.data.formats`), so `read_rows` touches only the rows it returns.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tqdm import tqdm

from dflash_cache.data.chat import ChatSource, ChatSpec, as_chat
from dflash_cache.data.formats import IGNORE_INDEX, ArrowSource, Source, open_source
from dflash_cache.errors import UserError
from dflash_cache.files import hash_ends

__all__ = ["DatasetScan", "Row", "TokenizedDataset", "from_table", "open_dataset"]

OVERLONG_POLICIES = ("truncate", "skip")
_CHUNK_ROWS = 4096  # rows validated at once; bounds temporary memory per step
_INT32_MAX = np.iinfo(np.int32).max


@dataclass(frozen=True, slots=True)
class Row:
    index: int  # global row index in the dataset
    input_ids: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # uint8 [n], 1 = supervised


@dataclass(frozen=True, slots=True)
class DatasetScan:
    lengths: np.ndarray  # int32 [num_rows], length after the max_len policy (0 for skipped rows)
    supervised: np.ndarray  # int32 [num_rows], supervised tokens after the policy (0 for skipped rows)
    keep: np.ndarray  # bool [num_rows], False for rows skipped by the max_len policy or dropped
    truncated: int
    skipped: int
    dropped: int = 0  # chat rows that gave no training row (see `dflash_cache.data.chat`)


@dataclass(frozen=True, slots=True)
class _Checked:
    """One validated chunk: row lengths and the flattened token ids / loss mask."""

    first: int
    lengths: np.ndarray  # int64 [rows]
    ids: np.ndarray  # int32 [tokens]
    mask: np.ndarray  # uint8 [tokens]


def _check_policy(max_len: int | None, overlong: str) -> None:
    if max_len is not None and max_len <= 0:
        raise UserError(f"max_len must be a positive number of tokens, got {max_len}; pass e.g. --max-len 2048")
    if overlong not in OVERLONG_POLICIES:
        raise UserError(f"unknown overlong policy {overlong!r}; use one of: {', '.join(OVERLONG_POLICIES)}")


def _where(index: int, label: str) -> str:
    return f"row {index} ({label})" if label else f"row {index}"


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _names(source: Source) -> str:
    """The dataset's files for a message (a few, then a count), or its description."""
    files = [source.rel_name(p) for p in source.files]
    shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return f"{shown} ({source.describe()})" if files else f"({source.describe()})"


def _row_of(flat_index: int, lengths: np.ndarray) -> int:
    return int(np.searchsorted(np.cumsum(lengths), flat_index, side="right"))


def hash_source_files(h: Any, source: Source) -> None:
    """Feed `h` each file's name, size and sha256 of its first and last MiB: a cheap identity of the data."""
    for path in source.files:
        size = path.stat().st_size
        h.update(f"{source.rel_name(path)}\0{size}\0".encode())
        part = hashlib.sha256()
        hash_ends(part, path, size)
        h.update(part.digest())


class TokenizedDataset:
    """A tokenized dataset with `input_ids` plus `loss_mask` or `labels`, read lazily by row range
    (a chat dataset is tokenized on the fly by its `ChatSource`; its unusable rows come back empty
    and are dropped like rows --overlong skip drops)."""

    def __init__(self, source: Source, *, limit: int | None = None, table: pa.Table | None = None) -> None:
        if limit is not None and limit <= 0:
            raise UserError(f"--limit must be a positive number of rows, got {limit}")
        self._source, self._limit, self._table = source, limit, table
        self._chat = source.encoder.identity if isinstance(source, ChatSource) else None
        if source.num_rows == 0:  # before the columns: a file with no rows has none to show
            raise UserError(f"dataset {_names(source)} has no rows; pass a dataset with at least one row")
        cols = source.columns
        found = ", ".join(cols) or "none"
        if "input_ids" not in cols:
            raise UserError(f"dataset has no input_ids column (found: {found}); expected input_ids plus loss_mask or labels")
        if "loss_mask" in cols:
            self._mask_col = "loss_mask"
        elif "labels" in cols:
            self._mask_col = "labels"
        else:
            raise UserError(f"dataset has no loss_mask or labels column (found: {found}); expected input_ids plus "
                            f"loss_mask (1 = supervised) or labels ({IGNORE_INDEX} = unsupervised)")
        self.num_rows: int = source.num_rows if limit is None else min(limit, source.num_rows)
        self.description: str = source.describe() + (f", first {self.num_rows} rows" if limit is not None else "")

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over the files' names, sizes, first and last MiB (or a table's IPC bytes), and the limit."""
        h = hashlib.sha256()
        h.update(f"{self._source.kind}\0".encode())
        if self._table is not None:
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, self._table.schema) as writer:
                writer.write_table(self._table)
            h.update(sink.getvalue())
        hash_source_files(h, self._source)
        h.update(f"limit={self._limit}".encode())
        if self._chat is not None:  # another template or tokenizer gives other rows
            h.update(f"\0chat={self._chat}".encode())
        return h.hexdigest()

    def _chunks(self, start: int, stop: int, vocab_size: int | None) -> Iterator[_Checked]:
        cols = ["input_ids", self._mask_col]
        for first, batch, label in self._source.batches(start, stop, cols):
            for off in range(0, batch.num_rows, _CHUNK_ROWS):
                yield self._check(batch.slice(off, _CHUNK_ROWS), first + off, label, vocab_size)

    def _check(self, batch: pa.RecordBatch, first: int, label: str, vocab_size: int | None) -> _Checked:
        """Validate one chunk (vectorised) and return its lengths and flattened ids / mask."""
        ids, mask, mcol = batch.column(0), batch.column(1), self._mask_col
        where = f" ({label})" if label else ""
        for name, arr in (("input_ids", ids), (mcol, mask)):
            if arr.null_count:
                bad = first + int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
                raise UserError(f"{_where(bad, label)}: {name} is null; drop or fill rows without tokens")
            if not _is_list(arr.type):
                raise UserError(f"{name} must be a list of integers per row, but its type is {arr.type}{where}; "
                                "store token ids as lists of ints")
        # pyarrow.compute makes its functions when it is imported, where type checkers cannot see them
        lengths = (pc.list_value_length(ids)  # pyright: ignore[reportAttributeAccessIssue]
                   .to_numpy(zero_copy_only=False).astype(np.int64))
        mlengths = (pc.list_value_length(mask)  # pyright: ignore[reportAttributeAccessIssue]
                    .to_numpy(zero_copy_only=False).astype(np.int64))
        if (lengths == 0).any() and self._chat is None:
            bad = first + int(np.flatnonzero(lengths == 0)[0])
            raise UserError(f"{_where(bad, label)}: input_ids is empty; drop empty rows before caching")
        if (lengths != mlengths).any():
            i = int(np.flatnonzero(lengths != mlengths)[0])
            raise UserError(f"{_where(first + i, label)}: input_ids has {lengths[i]} tokens but {mcol} has "
                            f"{mlengths[i]}; they must be the same length")
        ids_np = self._flat_ints(ids, "input_ids", first, label, lengths)
        limit = vocab_size if vocab_size is not None else _INT32_MAX + 1
        if ids_np.size and (int(ids_np.min()) < 0 or int(ids_np.max()) >= limit):
            j = int(np.flatnonzero((ids_np < 0) | (ids_np >= limit))[0])
            fix = f"outside [0, {vocab_size}) for vocab size {vocab_size}; tokenize with the target model's tokenizer" \
                if vocab_size is not None else "is negative or does not fit int32; token ids must be >= 0"
            raise UserError(f"{_where(first + _row_of(j, lengths), label)}: token id {ids_np[j]} {fix}")
        if mcol == "labels":
            mask_np = (self._flat_ints(mask, mcol, first, label, lengths) != IGNORE_INDEX).astype(np.uint8)
        else:
            values = pc.list_flatten(mask)  # pyright: ignore[reportAttributeAccessIssue] (made at import, as above)
            if pa.types.is_boolean(values.type) and not values.null_count:
                mask_np = values.to_numpy(zero_copy_only=False).astype(np.uint8)
            else:
                raw = self._flat_ints(mask, mcol, first, label, lengths, allow="ints or bools")
                bad = (raw != 0) & (raw != 1)
                if bad.any():
                    j = int(np.flatnonzero(bad)[0])
                    raise UserError(f"{_where(first + _row_of(j, lengths), label)}: loss_mask value {raw[j]} is "
                                    "not 0 or 1; use 1 for supervised tokens and 0 otherwise")
                mask_np = raw.astype(np.uint8)
        return _Checked(first, lengths, ids_np.astype(np.int32), mask_np)

    @staticmethod
    def _flat_ints(arr: pa.Array, name: str, first: int, label: str, lengths: np.ndarray,
                   allow: str = "integers") -> np.ndarray:
        values = pc.list_flatten(arr)  # pyright: ignore[reportAttributeAccessIssue] (made at import: see above)
        if values.null_count:
            j = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
            raise UserError(f"{_where(first + _row_of(j, lengths), label)}: {name} contains a null value; "
                            "every element must be an integer")
        if not pa.types.is_integer(values.type):
            where = f" ({label})" if label else ""
            raise UserError(f"{name} must be a list of {allow}, but its type is {arr.type}{where}; "
                            "store flat lists of ints (not strings, floats or nested lists)")
        return values.to_numpy(zero_copy_only=False)

    def scan(self, *, vocab_size: int | None, max_len: int | None, overlong: str = "truncate") -> DatasetScan:
        """Validate every row and return per-row lengths / supervised counts after the max_len policy."""
        _check_policy(max_len, overlong)
        if vocab_size is not None and vocab_size <= 0:
            raise UserError(f"vocab_size must be positive, got {vocab_size}")
        n = self.num_rows
        lengths, supervised, keep = np.zeros(n, np.int32), np.zeros(n, np.int32), np.ones(n, bool)
        truncated = skipped = dropped = 0
        # Minutes on a million rows (chat rows are rendered and tokenized here): shown on a terminal.
        bar = tqdm(total=n, unit="row", unit_scale=True, desc="scanning the dataset", disable=None, leave=False)
        for c in self._chunks(0, n, vocab_size):
            bar.update(len(c.lengths))
            rows = slice(c.first, c.first + len(c.lengths))
            ends = np.cumsum(c.lengths)
            starts = ends - c.lengths
            kept_len, row_keep = c.lengths, c.lengths > 0  # empty: a dropped chat row
            dropped += int((~row_keep).sum())
            mask = c.mask
            if max_len is not None and (c.lengths > max_len).any():
                over = c.lengths > max_len
                if overlong == "skip":
                    skipped += int(over.sum())
                    row_keep = row_keep & ~over
                    kept_len = np.where(over, 0, c.lengths)
                else:
                    truncated += int(over.sum())
                    kept_len = np.minimum(c.lengths, max_len)
                pos = np.arange(len(mask)) - np.repeat(starts, c.lengths)
                mask = mask * (pos < kept_len.repeat(c.lengths))
            csum = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
            lengths[rows], supervised[rows], keep[rows] = kept_len, csum[ends] - csum[starts], row_keep
        bar.close()
        if dropped == n:
            raise UserError(f"all {n} chat rows were dropped (no usable assistant turn; the log names the first "
                            "and why); check the messages and the chat template")
        if not keep.any():
            raise UserError(f"all {n} rows are longer than max_len {max_len} and overlong=skip leaves nothing; "
                            "raise --max-len or use --overlong truncate")
        if not supervised.any():  # a cache or a live run of it would train on nothing, silently
            unsupervised, fix = (f"every label is {IGNORE_INDEX}", f"labels other than {IGNORE_INDEX}") \
                if self._mask_col == "labels" else ("every loss_mask is 0", "loss_mask 1")
            cut = " within --max-len" if truncated else ""
            raise UserError(f"dataset {_names(self._source)}: no supervised token in any row{cut} "
                            f"({unsupervised}), so there is nothing to learn; mark the tokens to train on (the "
                            f"replies) with {fix}")
        return DatasetScan(lengths, supervised, keep, truncated, skipped, dropped)

    def read_rows(self, start: int, stop: int, *, max_len: int | None, overlong: str = "truncate") -> list[Row]:
        """Rows [start, stop) in order, with the same max_len policy as `scan` (skipped rows omitted)."""
        _check_policy(max_len, overlong)
        if not 0 <= start <= stop <= self.num_rows:
            raise ValueError(f"row range [{start}, {stop}) is outside [0, {self.num_rows})")
        out: list[Row] = []
        for c in self._chunks(start, stop, None):
            ends = np.cumsum(c.lengths)
            for i, (end, length) in enumerate(zip(ends.tolist(), c.lengths.tolist(), strict=True)):
                begin = end - length
                if length == 0:  # a dropped chat row
                    continue
                if max_len is not None and length > max_len:
                    if overlong == "skip":
                        continue
                    end = begin + max_len
                out.append(Row(c.first + i, c.ids[begin:end], c.mask[begin:end]))
        return out


def open_dataset(spec: str | Path | pa.Table, *, limit: int | None = None,
                 chat: ChatSpec | None = None) -> TokenizedDataset:
    """Open a HF save_to_disk directory, Arrow, Parquet or JSONL file/directory, or an in-memory table;
    rows of `messages` are rendered and tokenized with `chat`'s tokenizer and template."""
    if isinstance(spec, pa.Table):
        return TokenizedDataset(as_chat(_table_source(spec, "memory"), chat), limit=limit, table=spec)
    return TokenizedDataset(as_chat(open_source(Path(spec).expanduser()), chat), limit=limit)


def from_table(table: pa.Table, *, name: str = "memory") -> TokenizedDataset:
    """Wrap an in-memory Arrow table (used by the built-in demo data)."""
    return TokenizedDataset(_table_source(table, name), table=table)


def _table_source(table: pa.Table, name: str) -> ArrowSource:
    return ArrowSource([table], [""], kind="memory", files=[], root=None,
                       description=f"memory: {name} ({table.num_rows} rows)")
