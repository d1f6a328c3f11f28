"""CacheReader: exact sample rows, unknown ids, and the sample index (fresh, stale, absent)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import dflash_cache.reader as reader_mod
from dflash_cache.errors import UserError
from dflash_cache.reader import INDEX_FILE, CacheReader, build_index, write_index
from dflash_cache.segments import read_records
from tests.dflash_cache._util import synthetic_cache, write_synthetic_segment


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


def test_fresh_index_file_is_used(tmp_path, monkeypatch):
    _, written = synthetic_cache(tmp_path, segments=2)
    table = write_index(tmp_path, read_records(tmp_path))
    assert pq.read_schema(tmp_path / INDEX_FILE).metadata[b"commits"] == b"2"

    def boom(records):
        raise AssertionError("index rebuilt although index.parquet is current")

    monkeypatch.setattr(reader_mod, "build_index", boom)
    r = CacheReader(tmp_path)
    assert r.index.equals(table.replace_schema_metadata(None))
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
