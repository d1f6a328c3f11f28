"""CacheReader: exact sample rows, unknown ids, and the sample index (fresh, stale, absent)."""

from __future__ import annotations

import logging
import os
import sys
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import dflash_cache.store.reader as reader_mod
from dflash_cache.errors import UserError
from dflash_cache.store.layout import INDEX_FILE
from dflash_cache.store.reader import CacheReader, build_index, write_index
from dflash_cache.store.segments import SegmentRecord, read_records
from tests.dflash_cache.store._util import many_segments, preempt_in, synthetic_cache, write_synthetic_segment


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy()


def _check_all_samples(r: CacheReader, written: list) -> None:
    for rec, inp in written:
        offs = np.concatenate([[0], np.cumsum(inp["lengths"])])
        for i, sid in enumerate(inp["sample_ids"].tolist()):
            s = r.sample(sid)
            lo, hi = offs[i], offs[i + 1]
            assert s.segment == rec.name and s.sample_id == sid
            assert s.features.shape == (hi - lo, r.manifest.feature_width)
            np.testing.assert_array_equal(_bits(s.features), _bits(inp["features"][lo:hi]))
            np.testing.assert_array_equal(s.input_ids, inp["input_ids"][lo:hi])
            np.testing.assert_array_equal(s.loss_mask, inp["loss_mask"][lo:hi])


def test_sample_returns_exactly_the_rows_written(tmp_path):
    _, written = synthetic_cache(tmp_path, "none", segments=3)
    r = CacheReader(tmp_path)
    assert r.num_samples == 9 and r.num_tokens == 180
    assert sorted(r.index.column("sample_id").to_pylist()) == [0, 1, 2, 10, 11, 12, 20, 21, 22]
    _check_all_samples(r, written)
    assert r.locate(21) | {} == {"sample_id": 21, "segment": "u000000-b00002", "row_offset": 17, "length": 25,
                                  "supervised": written[2][0].supervised[1], "unit": 0, "batch": 2, "bucket": 0}


@pytest.mark.parametrize("sid", [3, -1, 9, 13, 10**12])
def test_unknown_sample_id_is_user_error(tmp_path, sid):
    synthetic_cache(tmp_path, segments=2)
    with pytest.raises(UserError, match=rf"sample {sid} is not in this cache \(6 samples committed\)"):
        CacheReader(tmp_path).sample(sid)


def test_unknown_segment_is_user_error(tmp_path):
    synthetic_cache(tmp_path)
    with pytest.raises(UserError, match="segment u000009-b00000 is not committed"):
        CacheReader(tmp_path).read_segment("u000009-b00000")


def test_missing_root_is_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        CacheReader(tmp_path / "nope")


def test_fresh_index_file_agrees_and_is_not_reported(tmp_path, caplog):
    _, written = synthetic_cache(tmp_path, segments=2)
    table = write_index(tmp_path, read_records(tmp_path))
    assert pq.read_schema(tmp_path / INDEX_FILE).metadata[b"commits"] == b"2"
    r = CacheReader(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert r.index.equals(table.replace_schema_metadata(None))
    assert r.index_problem is None and not caplog.records
    _check_all_samples(r, written)


def test_stale_index_is_rebuilt(tmp_path):
    m, written = synthetic_cache(tmp_path, segments=1)
    write_index(tmp_path, read_records(tmp_path))
    # a segment committed after index.parquet was written, with sample ids sorting before the old ones
    later = [write_synthetic_segment(tmp_path, m, unit=1, batch=0, first_id=-50, lengths=(5, 30, 9), seed=7)]
    r = CacheReader(tmp_path)
    assert r.index.num_rows == 6
    assert r.index.equals(build_index(read_records(tmp_path)))
    _check_all_samples(r, written + later)
    assert r.sample(-48).features.shape[0] == 9


def test_index_file_for_other_commits_is_ignored(tmp_path):
    """An index written for a segment that is no longer committed is not trusted."""
    m, written = synthetic_cache(tmp_path, segments=2)
    recs = read_records(tmp_path)
    write_index(tmp_path, recs[:1])
    r = CacheReader(tmp_path)
    _check_all_samples(r, written)


def test_reader_is_a_snapshot(tmp_path):
    m, written = synthetic_cache(tmp_path, segments=1)
    r = CacheReader(tmp_path)
    write_synthetic_segment(tmp_path, m, batch=1, first_id=100)
    assert [x.name for x in r.records] == ["u000000-b00000"]
    with pytest.raises(UserError):
        r.sample(100)
    assert CacheReader(tmp_path).sample(100).sample_id == 100


def test_iter_segments_and_complete(tmp_path):
    _, written = synthetic_cache(tmp_path, "bf16", segments=2)
    r = CacheReader(tmp_path)
    assert r.complete is True
    seen = [(rec.name, arrays["sample_ids"].tolist()) for rec, arrays in r.iter_segments()]
    assert seen == [("u000000-b00000", [0, 1, 2]), ("u000000-b00001", [10, 11, 12])]
    assert r.bytes_on_disk() == sum(sum(rec.files.values()) for rec, _ in written)


def test_one_reader_shared_by_8_threads_reads_what_one_thread_reads(tmp_path, monkeypatch):
    """Issue 10.1: prefetch threads share a reader whose caches of opened and of decoded arrays
    evict constantly (4 arrays, 512 bytes; 520 segments). Every bytecode of the reader module yields
    the GIL, so a race on its shared state (today: KeyError / 'dictionary changed size', reported as
    a corrupt segment) shows on every run, not once in a while."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    names = many_segments(tmp_path, 520, distinct=4)
    rng = np.random.default_rng(0)
    keys, n = ("features", "input_ids", "loss_mask"), 160
    jobs = [(names[i], keys[k], int(a), int(a + m)) for i, k, a, m in
            zip(rng.integers(0, len(names), n), rng.integers(0, 3, n), rng.integers(0, 8, n),
                rng.integers(1, 4, n), strict=True)]
    single = CacheReader(tmp_path)
    expected = [single.read_array(*job) for job in jobs]
    shared = CacheReader(tmp_path, open_arrays=4, decoded_bytes=512)  # a few decoded arrays: evicted constantly
    results: list = [None] * len(jobs)
    errors: list = []

    def work(first: int) -> None:
        sys.settrace(preempt_in(reader_mod))
        try:
            for i in range(first, len(jobs), 8):
                results[i] = shared.read_array(*jobs[i])
        except Exception as e:
            errors.append(e)
        finally:
            sys.settrace(None)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for job, got, want in zip(jobs, results, expected, strict=True):
        assert np.array_equal(got, want), job


def _tampered_index(root, edit) -> None:
    """index.parquet rewritten by `edit(table)`, still tagged as covering exactly the commits."""
    table = write_index(root, read_records(root))
    pq.write_table(edit(table).replace_schema_metadata(table.schema.metadata), root / INDEX_FILE)


def _set(name: str, change):
    def edit(t: pa.Table) -> pa.Table:
        values = t.column(name).to_numpy(zero_copy_only=False).copy()
        change(values)
        return t.set_column(t.schema.get_field_index(name), name, pa.array(values, t.schema.field(name).type))
    return edit


@pytest.mark.parametrize("edit, column", [
    (_set("row_offset", lambda v: v.__setitem__(1, v[1] + 1)), "row_offset"),  # trained on the wrong slice
    (_set("length", lambda v: v.__setitem__(4, v[4] - 2)), "length"),
    (_set("supervised", lambda v: v.__setitem__(0, 0)), "supervised"),
    (_set("sample_id", lambda v: v.__setitem__([0, 1], v[[1, 0]])), "sample_id"),
    (_set("segment", lambda v: v.__setitem__(0, v[4])), "segment"),
    (_set("bucket", lambda v: v.__setitem__(2, 7)), "bucket"),
])
def test_index_file_disagreeing_with_the_records_is_not_trusted(tmp_path, caplog, edit, column):
    """Issue 16.6: the records are the truth; an index.parquet that differs is reported and the
    index rebuilt from the records is used, so every sample reads its own rows."""
    _, written = synthetic_cache(tmp_path, "none", segments=2)
    _tampered_index(tmp_path, edit)
    r = CacheReader(tmp_path)
    with caplog.at_level(logging.WARNING, logger="dflash_cache.store.reader"):
        assert r.index.equals(build_index(read_records(tmp_path)))
    message = f"{INDEX_FILE} disagrees with the commit records in column {column}"
    assert r.index_problem == message
    assert [rec.getMessage() for rec in caplog.records] == [
        f"{message}; using the index rebuilt from the records (re-run extract to rewrite the file)"]
    _check_all_samples(r, written)


@pytest.mark.parametrize("damage, problem", [
    (lambda p: p.write_bytes(b"PAR1 not really parquet"), "index.parquet is unreadable"),
    (lambda p: p.write_bytes(b""), "index.parquet is unreadable"),
    (lambda p: (p.unlink(), p.mkdir()), "index.parquet is unreadable (index.parquet is not a regular file)"),
])
def test_unreadable_index_file_is_reported_not_a_traceback(tmp_path, damage, problem):
    _, written = synthetic_cache(tmp_path, "none", segments=2)
    write_index(tmp_path, read_records(tmp_path))
    damage(tmp_path / INDEX_FILE)
    r = CacheReader(tmp_path)
    _check_all_samples(r, written)
    assert r.index_problem.startswith(problem) and "\n" not in r.index_problem


@pytest.mark.parametrize("edit, problem", [
    (lambda t: t.drop_columns(["unit"]), "has columns"),
    (lambda t: t.set_column(3, "length", pa.array([str(v) for v in t.column("length").to_pylist()])), "has columns"),
    (lambda t: t.slice(0, 5), "has 5 rows, the commit records 6"),
    (lambda t: pa.concat_tables([t, t.slice(0, 1)]), "has 7 rows"),
])
def test_malformed_index_file_is_reported_not_a_traceback(tmp_path, edit, problem):
    _, written = synthetic_cache(tmp_path, "none", segments=2)
    _tampered_index(tmp_path, edit)
    r = CacheReader(tmp_path)
    assert r.index.equals(build_index(r.records))
    _check_all_samples(r, written)
    assert problem in r.index_problem


def test_stale_or_absent_index_file_is_no_problem(tmp_path):
    m, _ = synthetic_cache(tmp_path, segments=1)
    assert CacheReader(tmp_path).index_problem is None
    write_index(tmp_path, read_records(tmp_path))
    write_synthetic_segment(tmp_path, m, batch=1, first_id=100)
    assert CacheReader(tmp_path).index_problem is None  # written before the last commit: extract rewrites it


def test_build_index_matches_a_plain_loop_over_the_records():
    rng = np.random.default_rng(3)
    records = []
    for b in range(40):
        lengths = rng.integers(1, 50, size=int(rng.integers(1, 6))).tolist()
        records.append(SegmentRecord(
            name=f"u{b // 7:06d}-b{b % 7:05d}", unit=b // 7, batch=b % 7, bucket=int(rng.integers(0, 5)), rank=0,
            num_tokens=sum(lengths), sample_ids=tuple(int(i) for i in rng.integers(-9, 10**12, len(lengths))),
            lengths=tuple(lengths), supervised=tuple(int(rng.integers(0, n + 1)) for n in lengths), files={}))
    rows = [{"sample_id": sid, "segment": rec.name, "row_offset": sum(rec.lengths[:i]), "length": n, "supervised": s,
             "unit": rec.unit, "batch": rec.batch, "bucket": rec.bucket}
            for rec in records for i, (sid, n, s) in enumerate(zip(rec.sample_ids, rec.lengths, rec.supervised, strict=True))]
    assert build_index(records).to_pylist() == rows
    assert build_index([]).num_rows == 0


def _shards(root, name: str, key: str) -> list:
    return sorted(p for p in (root / "segments" / name / key).rglob("*") if p.is_file() and p.name != "zarr.json")


def test_a_shard_deleted_after_the_first_read_is_an_error_not_zeros(tmp_path):
    """The reader checks a segment's files once; a shard that vanishes afterwards (an `extract
    --overwrite` on the cache being read, say) must stop the read, naming the segment."""
    from dflash_cache.errors import CacheCorruptError

    _, written = synthetic_cache(tmp_path, "none", segments=2)
    r = CacheReader(tmp_path)
    name = written[0][0].name
    r.read_array(name, "input_ids", 0, 3)  # checked and opened (features not yet decoded)
    for shard in _shards(tmp_path, name, "features"):
        shard.unlink()
    with pytest.raises(CacheCorruptError, match=f"segment {name}.*features.*missing"):
        r.read_array(name, "features", 0, 3)


def _counting_decodes(monkeypatch) -> list:
    """The arrays' names zarr decodes rows of, one entry per read, from now on."""
    import zarr

    decoded: list = []
    real = zarr.Array.__getitem__

    def counted(self, selection):
        decoded.append(self.basename)
        return real(self, selection)

    monkeypatch.setattr(zarr.Array, "__getitem__", counted)
    return decoded


def test_an_array_of_one_chunk_is_decoded_once_for_all_its_samples(tmp_path, monkeypatch):
    """zarr decodes a whole chunk for any rows of it: a segment's token arrays (and every array of
    a short segment) are one chunk, read by each of its samples. The reader decodes such an array
    once and serves every later slice, exactly, from what it decoded."""
    _, [(rec, inp)] = synthetic_cache(tmp_path, "bf16")
    r = CacheReader(tmp_path)
    decoded = _counting_decodes(monkeypatch)
    _check_all_samples(r, [(rec, inp)])
    _check_all_samples(r, [(rec, inp)])
    assert sorted(decoded) == ["features", "input_ids", "loss_mask"], decoded
    got = r.read_array(rec.name, "input_ids", 3, 9)
    got[:] = -1  # a caller's copy: what the reader keeps is not changed through it
    np.testing.assert_array_equal(r.read_array(rec.name, "input_ids", 3, 9), inp["input_ids"][3:9])


def test_arrays_of_many_chunks_or_over_the_budget_are_read_by_the_chunk_each_time(tmp_path, monkeypatch):
    """Only one-chunk arrays are kept, and only as many bytes of them as `decoded_bytes` allows: a
    sample of a long segment decodes just the chunks its rows are in."""
    import dflash_cache.store.segments as segments

    with monkeypatch.context() as m:  # 16-row chunks: the 60-row arrays are several chunks each
        m.setattr(segments, "CHUNK_BYTES", 16 * 64 * 2)
        _, [(rec, inp)] = synthetic_cache(tmp_path, "bf16")
    r = CacheReader(tmp_path)
    decoded = _counting_decodes(monkeypatch)
    _check_all_samples(r, [(rec, inp)])
    _check_all_samples(r, [(rec, inp)])
    assert decoded.count("features") == 6 and decoded.count("input_ids") == 1, decoded  # 60 tokens: one chunk
    small = CacheReader(tmp_path, decoded_bytes=100)  # the 240-byte input_ids do not fit, the 60-byte loss_mask does
    decoded.clear()
    _check_all_samples(small, [(rec, inp)])
    _check_all_samples(small, [(rec, inp)])
    assert decoded.count("input_ids") == 6 and decoded.count("loss_mask") == 1, decoded


def test_a_segment_rewritten_under_the_reader_is_refused(tmp_path):
    """A segment whose commit record was replaced after the reader opened the cache (the cache
    made again at the same path) is not read on as if it were the one opened."""
    from dflash_cache.errors import CacheCorruptError

    _, written = synthetic_cache(tmp_path, "none", segments=2)
    r = CacheReader(tmp_path)
    name = written[1][0].name
    r.read_array(name, "input_ids")
    record = tmp_path / "commits" / f"{name}.json"
    text = record.read_text()
    record.unlink()
    record.write_text(text)  # the same content, another file: a new generation of the cache
    with pytest.raises(CacheCorruptError, match=f"segment {name} changed .*while it was being read"):
        r.read_array(name, "input_ids")


def test_a_record_whose_lengths_disagree_with_the_stored_offsets_is_refused_when_read(tmp_path):
    """A record that moves tokens from one sample to the next keeps every size the first look checks;
    the stored offsets still say what was written, and reading the batch compares them."""
    import json

    from dflash_cache.errors import CacheCorruptError
    from dflash_cache.store.layout import COMMITS_DIR

    root = tmp_path
    synthetic_cache(root, "bf16", segments=2)  # committed by the store's writer, as extraction commits
    rec = next(r for r in read_records(root) if len(r.lengths) > 1 and r.lengths[0] > 5)
    record_path = root / COMMITS_DIR / f"{rec.name}.json"
    record = json.loads(record_path.read_text())
    record["lengths"][0] -= 5
    record["lengths"][1] += 5
    record_path.write_text(json.dumps(record))

    reader = CacheReader(root)
    with pytest.raises(CacheCorruptError, match=f"segment {rec.name}: its stored offsets or sample ids disagree"):
        reader.read_batch(rec.name)
