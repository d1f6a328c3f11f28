"""A received cache is inert: symlinks out of the root, FIFOs, chunk bombs, size and type lies.

Issue 16 items 7-10. Each case builds a small hostile cache and expects one line of
CacheCorruptError, quickly, without following the link, blocking, or allocating what it claims.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.core.common import ZARR_JSON
from zarr.storage import LocalStore

from dflash_cache.errors import CacheCorruptError
from dflash_cache.files import read_json
from dflash_cache.store.layout import COMMITS_DIR, INDEX_FILE, MANIFEST_FILE, PLAN_FILE, SEGMENTS_DIR
from dflash_cache.store.manifest import read_manifest, write_manifest
from dflash_cache.store.plan import plan_limits
from dflash_cache.store.reader import CacheReader, build_index, read_parquet, write_index
from dflash_cache.store.segments import check_files, read_records
from dflash_cache.store.writer import list_files
from tests.dflash_cache.store._util import (
    finishes_within,
    make_manifest,
    synthetic_cache,
    write_synthetic_segment,
)

NAME = "u000000-b00000"
TIMEOUT = 10.0  # seconds: a FIFO that is opened blocks forever, a refused one takes milliseconds


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg and msg, msg
    return msg


def _seg(root: Path) -> Path:
    return root / SEGMENTS_DIR / NAME


def _edit_record(root: Path, edit) -> None:
    """Change the commit record as a hostile sender would (the record is theirs too)."""
    path = root / COMMITS_DIR / f"{NAME}.json"
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))


def _relist(root: Path) -> None:
    """Make the record's file list match the segment directory exactly (sizes included), so only
    the property under test is wrong."""
    _edit_record(root, lambda obj: obj.update(files=list_files(_seg(root))))


def _unlist(root: Path, rel: str) -> None:
    _edit_record(root, lambda obj: obj["files"].pop(rel))


def _move_out(root: Path, rel: str, outside: Path) -> None:
    """Replace `rel` (file or directory) under the segment by a symlink to a copy outside the root."""
    path = _seg(root) / rel
    shutil.move(path, outside)
    os.symlink(outside, path, target_is_directory=outside.is_dir())


def _read_all(root: Path) -> None:
    r = CacheReader(root)
    r.read_segment(NAME)
    r.sample(1)


# --- 16.7: symlinks leaving the root --------------------------------------------------------
@pytest.mark.parametrize("rel", ["features/c/0/0", "features/zarr.json", "input_ids/c/0", "zarr.json"])
def test_unlisted_symlink_out_of_the_root_is_refused(tmp_path, rel):
    """The file is dropped from the record's list, so the old per-listed-file check never saw it."""
    root = tmp_path / "cache"
    synthetic_cache(root)
    _move_out(root, rel, tmp_path / "outside")
    _unlist(root, rel)
    assert (_seg(root) / rel).is_file()  # the data is intact through the link
    with pytest.raises(CacheCorruptError, match=f"segment {NAME} is damaged: .*outside the cache root") as ei:
        _read_all(root)
    _one_line(ei.value)
    assert any("outside the cache root" in p for p in check_files(root, read_records(root)[0]))


def test_symlinked_directory_inside_segment_out_of_the_root_is_refused(tmp_path):
    root = tmp_path / "cache"
    synthetic_cache(root)
    _move_out(root, "features/c", tmp_path / "outside")
    _unlist(root, "features/c/0/0")
    with pytest.raises(CacheCorruptError, match="outside the cache root"):
        _read_all(root)


def test_manifest_symlink_out_of_the_root_is_refused(tmp_path):
    root = tmp_path / "cache"
    synthetic_cache(root)
    shutil.move(root / MANIFEST_FILE, tmp_path / "manifest.json")
    os.symlink(tmp_path / "manifest.json", root / MANIFEST_FILE)
    for call in (lambda: read_manifest(root), lambda: CacheReader(root)):
        with pytest.raises(CacheCorruptError, match="points outside the cache root"):
            call()


def test_parquet_symlink_out_of_the_root_is_refused(tmp_path):
    root = tmp_path / "cache"
    synthetic_cache(root)
    write_index(root, read_records(root))
    shutil.move(root / INDEX_FILE, tmp_path / "index.parquet")
    os.symlink(tmp_path / "index.parquet", root / INDEX_FILE)
    r = CacheReader(root)
    assert "outside the cache root" in r.index_problem
    assert r.index.equals(build_index(r.records))
    with pytest.raises(CacheCorruptError, match="outside the cache root"):
        read_parquet(root, INDEX_FILE, plan_limits(make_manifest()))


def test_symlinks_that_stay_inside_the_root_are_followed(tmp_path):
    """Links are not damage in themselves: one to a file elsewhere inside the cache reads fine."""
    root = tmp_path / "cache"
    _, [(rec, inp)] = synthetic_cache(root)
    shard = _seg(root) / "features" / "c" / "0" / "0"
    shutil.move(shard, root / "elsewhere.bin")
    os.symlink(root / "elsewhere.bin", shard)
    assert check_files(root, rec) == []
    stored = CacheReader(root).read_segment(NAME)["features"]
    assert np.array_equal(stored, inp["stored"]["features"])


def test_unlisted_file_in_a_segment_is_reported(tmp_path):
    root = tmp_path / "cache"
    _, [(rec, _)] = synthetic_cache(root)
    (_seg(root) / "features" / "c" / "9").write_bytes(b"x")
    assert check_files(root, rec) == ["features/c/9 is not in the commit record"]
    with pytest.raises(CacheCorruptError, match="features/c/9 is not in the commit record"):
        _read_all(root)


# --- 16.8: FIFOs ------------------------------------------------------------------------------
def _fifo(path: Path) -> Path:
    path.unlink()
    os.mkfifo(path)
    return path


def _refused_in_time(fn, fifo: Path, match: str) -> None:
    finished, result = finishes_within(TIMEOUT, fn, fifo)
    assert finished, f"blocked on the FIFO {fifo}"
    assert isinstance(result, CacheCorruptError) and match in str(result), result
    _one_line(result)


def test_fifo_commit_record_does_not_hang(tmp_path):
    synthetic_cache(tmp_path)
    fifo = _fifo(tmp_path / COMMITS_DIR / f"{NAME}.json")
    _refused_in_time(lambda: CacheReader(tmp_path), fifo, "not a regular file")


@pytest.mark.parametrize("listed", [True, False])
def test_fifo_shard_does_not_hang(tmp_path, listed):
    synthetic_cache(tmp_path)
    fifo = _fifo(_seg(tmp_path) / "features" / "c" / "0" / "0")
    if not listed:
        _unlist(tmp_path, "features/c/0/0")
    _refused_in_time(lambda: _read_all(tmp_path), fifo, "features/c/0/0 is not a regular file")
    _refused_in_time(lambda: CacheReader(tmp_path, check_segment_files=False).read_array(NAME, "features"),
                     fifo, "is not a regular file")


def test_fifo_array_metadata_does_not_hang(tmp_path):
    synthetic_cache(tmp_path)
    fifo = _fifo(_seg(tmp_path) / "features" / "zarr.json")
    _refused_in_time(lambda: _read_all(tmp_path), fifo, "features/zarr.json is not a regular file")


def test_fifo_manifest_does_not_hang(tmp_path):
    synthetic_cache(tmp_path)
    fifo = _fifo(tmp_path / MANIFEST_FILE)
    _refused_in_time(lambda: CacheReader(tmp_path), fifo, "is not a regular file")


@pytest.mark.parametrize("name", [INDEX_FILE, PLAN_FILE])
def test_fifo_parquet_does_not_hang(tmp_path, name):
    synthetic_cache(tmp_path)
    write_index(tmp_path, read_records(tmp_path))
    (tmp_path / PLAN_FILE).write_bytes(b"")
    fifo = _fifo(tmp_path / name)
    _refused_in_time(lambda: read_parquet(tmp_path, name, plan_limits(make_manifest())), fifo, "not a regular file")
    if name == INDEX_FILE:
        finished, problem = finishes_within(TIMEOUT, lambda: CacheReader(tmp_path).index_problem, fifo)
        assert finished and "not a regular file" in problem


def test_read_json_refuses_a_fifo_without_blocking(tmp_path):
    fifo = tmp_path / "x.json"
    os.mkfifo(fifo)
    finished, result = finishes_within(TIMEOUT, lambda: read_json(fifo), fifo)
    assert finished and isinstance(result, ValueError) and "not a regular file" in str(result)


# --- 16.9: chunk bombs and size lies ----------------------------------------------------------
def _rewrite_meta(root: Path, key: str, edit) -> None:
    path = _seg(root) / key / "zarr.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))
    _relist(root)


def _sharding(meta: dict) -> dict:
    return meta["codecs"][0]["configuration"]


def _refused_small(root: Path, match: str) -> None:
    """Refused with one line, having allocated next to nothing."""
    tracemalloc.start()
    try:
        with pytest.raises(CacheCorruptError, match=match) as ei:
            _read_all(root)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    _one_line(ei.value)
    assert peak < 32 << 20, peak


def test_chunk_bomb_is_refused_before_reading(tmp_path):
    """The array's shape is right; its chunks claim 400M elements (800 MB to decode each)."""
    synthetic_cache(tmp_path)
    rows = 400_000_000 // 64

    def bomb(meta):
        meta["chunk_grid"]["configuration"]["chunk_shape"] = [rows, 64]
        _sharding(meta)["chunk_shape"] = [rows, 64]

    _rewrite_meta(tmp_path, "features", bomb)
    _refused_small(tmp_path, rf"segment {NAME} is damaged: array features: chunk rows {rows} .*exceed")


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["chunk_grid"]["configuration"].update(chunk_shape=[1 << 20, 64]), "shard rows 1048576"),
    (lambda m: _sharding(m).update(chunk_shape=[1, 64]) or m["chunk_grid"]["configuration"].update(
        chunk_shape=[1 << 17, 64]), "exceed what the writer makes"),
    (lambda m: _sharding(m).update(chunk_shape=[60, 32]), "not whole rows"),
    (lambda m: m.update(shape=[10**9, 64]), r"is uint16\[1000000000, 64\], expected uint16\[60, 64\]"),
    (lambda m: m.update(data_type="float64"), r"is float64\[60, 64\], expected uint16"),
    (lambda m: _sharding(m)["codecs"].pop(), "codecs differ from the writer's"),  # no CRC32C
    (lambda m: _sharding(m)["index_codecs"].pop(), "codecs differ from the writer's"),
    (lambda m: _sharding(m).update(index_location="start"), "shard index at the start"),
    (lambda m: m.update(codecs=[{"name": "bytes", "configuration": {"endian": "little"}}]), "sharding_indexed"),
    (lambda m: m["chunk_key_encoding"]["configuration"].update(separator="."), "chunk key encoding"),
    (lambda m: m.update(storage_transformers=[{"name": "x"}]), "storage transformer"),
    (lambda m: m.update(zarr_format=2), "not a zarr v3 array"),
    (lambda m: m.update(node_type="group"), "not a zarr v3 array"),
    (lambda m: m.update(shape="60"), r"expected uint16\[60, 64\]"),
])
def test_array_metadata_unlike_the_writers_is_refused(tmp_path, edit, match):
    synthetic_cache(tmp_path)
    _rewrite_meta(tmp_path, "features", edit)
    _refused_small(tmp_path, f"segment {NAME} is damaged: array features: .*{match}")


def test_manifest_size_lie_is_refused_before_any_array_is_opened(tmp_path):
    """hidden_size 128000 with a matching array took verify to 9.4 GB; the manifest is refused."""
    synthetic_cache(tmp_path)
    path = tmp_path / MANIFEST_FILE
    obj = json.loads(path.read_text())
    obj["hidden_size"] = obj["target"]["hidden_size"] = 128000
    path.write_text(json.dumps(obj))
    with pytest.raises(CacheCorruptError, match=r"manifest is malformed \(manifest.hidden_size must be an integer "
                                                r"in \[1, 65536\], not 128000\)") as ei:
        CacheReader(tmp_path)
    _one_line(ei.value)


def test_huge_array_metadata_file_is_refused(tmp_path):
    synthetic_cache(tmp_path)
    _rewrite_meta(tmp_path, "features", lambda m: m.update(attributes={"pad": "x" * (2 << 20)}))
    _refused_small(tmp_path, "array features: zarr.json is .* bytes, more than")


@pytest.mark.parametrize("key, rel", [("features", "features/c/0/0"), ("input_ids", "input_ids/c/0"),
                                      ("offsets", "offsets/c/0")])
def test_segment_without_its_data_file_is_refused_not_zeros(tmp_path, key, rel):
    """The record no longer lists the shard and the shard is gone: zarr alone reads zeros."""
    synthetic_cache(tmp_path)
    (_seg(tmp_path) / rel).unlink()
    _unlist(tmp_path, rel)
    with pytest.raises(CacheCorruptError, match=rf"segment {NAME} is damaged: {rel} is missing"):
        CacheReader(tmp_path).read_array(NAME, key)


def test_zarr_v2_array_in_place_of_v3_is_refused(tmp_path):
    """Arrays open as zarr format 3 only: a v2 array (.zarray) with the same data is not read."""
    _, [(rec, inp)] = synthetic_cache(tmp_path)
    shutil.rmtree(_seg(tmp_path) / "features")
    zarr.create_array(store=LocalStore(_seg(tmp_path)), name="features", data=inp["stored"]["features"],
                      zarr_format=2)
    _relist(tmp_path)
    with pytest.raises(CacheCorruptError, match="features/zarr.json is missing"):
        CacheReader(tmp_path).read_array(NAME, "features")


def test_writer_keeps_all_zero_shards(tmp_path):
    """zarr skips writing chunks equal to the fill value; the writer keeps them, so a missing
    shard file can always be told from an all-zero array (here: sample id 0 alone, no labels)."""
    (tmp_path / COMMITS_DIR).mkdir()
    rec, _ = write_synthetic_segment(tmp_path, make_manifest(), lengths=(20,), first_id=0)
    assert "sample_ids/c/0" in rec.files
    assert check_files(tmp_path, rec) == []


def test_old_cache_without_an_all_zero_shard_still_reads(tmp_path):
    """Caches written before that kept no shard for an all-zero array; the record says it is all
    zeros (sample id 0 alone), so its absence is no damage there."""
    (tmp_path / COMMITS_DIR).mkdir()
    write_manifest(tmp_path, make_manifest())
    write_synthetic_segment(tmp_path, make_manifest(), lengths=(20,), first_id=0)
    (_seg(tmp_path) / "sample_ids" / "c" / "0").unlink(missing_ok=True)  # older writers did not write it
    _relist(tmp_path)
    assert CacheReader(tmp_path).read_array(NAME, "sample_ids").tolist() == [0]


def test_link_loop_inside_a_segment_is_walked_once(tmp_path):
    _, [(rec, _)] = synthetic_cache(tmp_path)
    os.symlink(_seg(tmp_path), _seg(tmp_path) / "features" / "loop", target_is_directory=True)
    assert check_files(tmp_path, rec) == []  # inert: inside the root, nothing new to read


def test_segment_with_too_many_files_is_refused(tmp_path, monkeypatch):
    import dflash_cache.store.segments as segments

    _, [(rec, _)] = synthetic_cache(tmp_path)
    r = CacheReader(tmp_path)
    monkeypatch.setattr(segments, "MAX_SEGMENT_FILES", 5)  # the walk stops there, whatever the record says
    assert "more than 5 files" in check_files(tmp_path, rec)
    with pytest.raises(CacheCorruptError, match="more than 5 files"):
        r.read_array(NAME, "features")
    with pytest.raises(CacheCorruptError, match="files listed, more than 5"):  # and a record may not list more
        CacheReader(tmp_path)


def test_empty_shard_file_is_refused_not_zeros(tmp_path):
    """zarr 3.1 reads a 0-byte shard as zeros; its index alone takes 20 bytes."""
    synthetic_cache(tmp_path)
    (_seg(tmp_path) / "features" / "c" / "0" / "0").write_bytes(b"")
    _relist(tmp_path)
    with pytest.raises(CacheCorruptError, match="features/c/0/0 is 0 bytes, too short to hold its shard index"):
        CacheReader(tmp_path).read_array(NAME, "features")


def _rewrite_shard_index(path: Path, edit) -> None:
    """Edit the (offset, length) entries of a shard's index at its end, with a CRC32C that matches
    again: a sender's own shard, which zarr accepts."""
    import google_crc32c

    data = bytearray(path.read_bytes())
    n = next(n for n in range(1, 4096) if len(data) >= 16 * n + 4 and
             google_crc32c.value(bytes(data[-(16 * n + 4):-4])) == int.from_bytes(data[-4:], "little"))
    entries = np.frombuffer(bytes(data[-(16 * n + 4):-4]), dtype="<u8").reshape(n, 2).copy()
    edit(entries)
    index = entries.astype("<u8").tobytes()
    data[-(16 * n + 4):] = index + google_crc32c.value(index).to_bytes(4, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("key, rel", [("features", "features/c/0/0"), ("input_ids", "input_ids/c/0")])
def test_a_shard_index_marking_written_chunks_empty_is_refused_not_zeros(tmp_path, key, rel):
    """The writer writes every chunk, so a shard index that marks one empty (zarr then reads its
    fill value, zeros) is damage, for the reader and for verify."""
    from dflash_cache.store.report import verify

    synthetic_cache(tmp_path)
    _rewrite_shard_index(_seg(tmp_path) / rel, lambda e: e.fill(2**64 - 1))
    _relist(tmp_path)
    with pytest.raises(CacheCorruptError, match=rf"segment {NAME} is damaged: {rel}: .*marked empty"):
        CacheReader(tmp_path).read_array(NAME, key)
    assert any("marked empty" in p for p in verify(CacheReader(tmp_path)))


def test_a_shard_index_pointing_past_its_data_is_refused(tmp_path):
    synthetic_cache(tmp_path)
    _rewrite_shard_index(_seg(tmp_path) / "features/c/0/0", lambda e: e.__setitem__((0, 1), 10**9))
    _relist(tmp_path)
    with pytest.raises(CacheCorruptError, match="features/c/0/0: .*past the end"):
        CacheReader(tmp_path).read_array(NAME, "features")


# --- memory bounded before allocation: what a file claims, held to what the records allow ---------
def _chunks_of(path: Path, n: int) -> list[bytes]:
    """The `n` stored chunks (Blosc frame and CRC32C each) of a shard, in index order."""
    data = path.read_bytes()
    entries = np.frombuffer(data[-(16 * n + 4):-4], dtype="<u8").reshape(n, 2)
    return [data[int(o):int(o) + int(k)] for o, k in entries]


def _write_shard(path: Path, chunks: list[bytes]) -> None:
    """A shard of these stored chunks, with a valid index: what a sender can always make."""
    import google_crc32c

    offsets = np.cumsum([0, *map(len, chunks)])[:-1]
    index = np.stack([offsets, [len(c) for c in chunks]], axis=1).astype("<u8").tobytes()
    path.write_bytes(b"".join(chunks) + index + google_crc32c.value(index).to_bytes(4, "little"))


def _stored_chunk(frame: bytes) -> bytes:
    import google_crc32c

    return frame + google_crc32c.value(frame).to_bytes(4, "little")


def _zeros_frame(nbytes: int) -> bytes:
    """A Blosc(zstd) frame that really decompresses to `nbytes` zeros: a few KB per 32 MB."""
    from numcodecs import Blosc

    return Blosc(cname="zstd", clevel=1, shuffle=Blosc.SHUFFLE, typesize=2).encode(np.zeros(nbytes, np.uint8))


def _peak_traced(fn) -> tuple[int, object]:
    """(peak bytes traced while `fn` ran, its result or exception): numpy and Python buffers are
    traced, so a decode sized by a lie shows here whether or not it fails afterwards."""
    tracemalloc.start()
    try:
        try:
            result = fn()
        except Exception as e:  # handed to the test to assert on
            result = e
        return tracemalloc.get_traced_memory()[1], result
    finally:
        tracemalloc.stop()


def test_blosc_chunk_claiming_more_than_its_shape_is_refused_before_decoding(tmp_path):
    """Audit: a 1.3 MB shard whose Blosc header claims 1.85 GB took `inspect --verify` to 1.85 GB
    (numcodecs sizes its output by the header). Here a frame of 64 MB of zeros stands in a chunk
    whose shape holds 7,680 bytes: refused by the header, nothing decoded."""
    synthetic_cache(tmp_path)
    _write_shard(_seg(tmp_path) / "features/c/0/0", [_stored_chunk(_zeros_frame(64 << 20))])
    _relist(tmp_path)
    match = rf"segment {NAME}: array features: features/c/0/0: a Blosc chunk claims {64 << 20} bytes decoded, " \
            r"its shape holds 7680"
    _refused_small(tmp_path, match)
    from dflash_cache.store.report import verify

    peak, problems = _peak_traced(lambda: verify(CacheReader(tmp_path)))
    assert peak < 32 << 20, peak
    assert len(problems) == 1 and re.search(match, problems[0]), problems


def test_blosc_chunk_lie_is_refused_in_a_partial_read_too(tmp_path, monkeypatch):
    """A sample's rows read only their chunks (byte ranges of the shard, not the whole shard)."""
    import dflash_cache.store.segments as segments

    with monkeypatch.context() as m:  # 16-row chunks: several chunks per shard
        m.setattr(segments, "CHUNK_BYTES", 2048)
        synthetic_cache(tmp_path)
    shard = _seg(tmp_path) / "features/c/0/0"
    chunks = _chunks_of(shard, 4)
    chunks[1] = _stored_chunk(_zeros_frame(64 << 20))  # rows 16..31: sample 1 (rows 17..41) reads it
    _write_shard(shard, chunks)
    _relist(tmp_path)
    r = CacheReader(tmp_path)
    assert r.read_array(NAME, "features", 0, 16).shape == (16, 64)  # chunk 0 alone is intact
    peak, result = _peak_traced(lambda: r.sample(1))
    assert isinstance(result, CacheCorruptError), result
    assert re.search(r"features/c/0/0: a Blosc chunk claims \d+ bytes decoded, its shape holds 2048", str(result))
    _one_line(result)
    assert peak < 32 << 20, peak


def _limits_manifest_cache(root: Path, tokens: int) -> Path:
    """A cache whose manifest sits at the size limits (16 layers x hidden 65536: 2 MB a token) and
    whose one segment's features are all zeros, so a few KB of Blosc frames stand for each 32 MB
    chunk: the arrays, shard files and record are exactly what the writer makes of such a segment."""
    from dflash_cache.store.codecs import get_codec

    (root / COMMITS_DIR).mkdir(parents=True)
    big = make_manifest(layer_ids=tuple(range(16)), hidden_size=65536, num_samples=2, num_tokens=tokens)
    write_manifest(root, big)
    small = make_manifest(layer_ids=(1,), hidden_size=4)  # commits the token arrays and the record
    write_synthetic_segment(root, small, lengths=(tokens // 2, tokens - tokens // 2))
    rows, shard_rows, width = 16, 48, big.feature_width  # `write_array`'s grid for 2 MB rows
    zarr.create_array(store=LocalStore(_seg(root)), name="features", shape=(tokens, width), dtype="uint16",
                      chunks=(rows, width), shards=(shard_rows, width), compressors=list(get_codec("bf16").compressors),
                      filters=[], fill_value=0, overwrite=True)
    chunk = _stored_chunk(_zeros_frame(rows * width * 2))
    for i in range(-(-tokens // shard_rows)):
        path = _seg(root) / "features" / "c" / str(i) / "0"
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_shard(path, [chunk] * (shard_rows // rows))
    _relist(root)
    return root


def test_segment_claiming_far_more_than_its_files_hold_is_refused_before_decoding(tmp_path):
    """Audit: a 144 KB cache with a manifest at the size limits took verify past 6 GB, every claim
    consistent with every other. What gives it away is the bytes behind the claims: a segment may
    decode to at most MAX_EXPANSION times its files (real ones: 1.0-1.7)."""
    from dflash_cache.store.report import verify
    from dflash_cache.store.segments import EXPANSION_SLACK, MAX_EXPANSION

    root = _limits_manifest_cache(tmp_path / "cache", tokens=96)
    on_disk = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert on_disk < 256 << 10 and 96 * (2 << 20) > 2 * EXPANSION_SLACK  # 192 MB claimed by < 256 KB
    peak, problems = _peak_traced(lambda: verify(CacheReader(root)))
    assert peak < 32 << 20, peak
    assert len(problems) == 1, problems
    assert re.search(rf"segment {NAME} is damaged: its arrays would decode to [\d,]+ bytes, more than "
                     rf"{MAX_EXPANSION} times its [\d,]+ bytes of files", problems[0]), problems
    with pytest.raises(CacheCorruptError, match="would decode to") as ei:
        CacheReader(root).read_array(NAME, "input_ids")  # training reads are refused alike
    _one_line(ei.value)


def _forbid_decoding(monkeypatch) -> None:
    """Any Parquet table read fails the test: a refusal must come from the footer alone."""
    import pyarrow.parquet as pq

    def decoded(*args, **kwargs):
        raise AssertionError("a Parquet table was decoded")

    monkeypatch.setattr(pq.ParquetFile, "read", decoded)
    monkeypatch.setattr(pq, "read_table", decoded)


def _long_parquet(path: Path, table, copies: int, **kw) -> None:
    """`table` written `copies` times as row groups: millions of rows in a file of kilobytes."""
    import pyarrow.parquet as pq

    with pq.ParquetWriter(path, table.schema, compression="zstd", **kw) as w:
        for _ in range(copies):
            w.write_table(table)


def test_plan_parquet_with_more_rows_than_the_manifest_plans_is_refused_unread(tmp_path, monkeypatch):
    """Audit: a 1.6 MB plan.parquet (run-length encoded rows) took `inspect` past 6 GB."""
    import pyarrow as pa

    from dflash_cache.store.plan import read_plan
    from dflash_cache.store.report import summarize

    manifest, _ = synthetic_cache(tmp_path)
    n = 1 << 20
    zeros = {k: pa.array(np.zeros(n, t)) for k, t in
             (("row", np.int64), ("unit", np.int32), ("batch", np.int32), ("bucket", np.int16), ("length", np.int32))}
    _long_parquet(tmp_path / PLAN_FILE, pa.table(zeros), 4)
    assert (tmp_path / PLAN_FILE).stat().st_size < 256 << 10
    _forbid_decoding(monkeypatch)
    match = rf"plan.parquet has {4 * n} rows, the manifest plans 3 samples; copy the cache again or re-run extract"
    for call in (lambda: read_plan(tmp_path, manifest), lambda: summarize(CacheReader(tmp_path))):
        with pytest.raises(CacheCorruptError, match=match) as ei:
            call()
        _one_line(ei.value)


def _index_with(root: Path, table, digest: bool = True, copies: int = 1, **kw) -> None:
    """index.parquet holding `table` (`copies` times), tagged as covering the records (or not)."""
    from dflash_cache.store.reader import records_digest

    tag = records_digest(read_records(root)) if digest else "0" * 64
    meta = {"commits": str(len(read_records(root))), "commits_digest": tag}
    _long_parquet(root / INDEX_FILE, table.replace_schema_metadata(meta), copies, **kw)


def _index_rows(n: int, segment: str = NAME):
    import pyarrow as pa

    from dflash_cache.store.reader import INDEX_SCHEMA

    cols = {f.name: pa.array(np.zeros(n, f.type.to_pandas_dtype())) for f in INDEX_SCHEMA if f.name != "segment"}
    return pa.table(cols | {"segment": pa.array([segment] * n)}).select(INDEX_SCHEMA.names).cast(INDEX_SCHEMA)


def test_index_parquet_with_more_rows_than_the_records_is_not_read(tmp_path, monkeypatch, caplog):
    """Audit: a 0.94 MB index.parquet took `train` to 3.8 GB. The index the trainer uses is rebuilt
    from the records; the file is only checked, and now from its footer first."""
    synthetic_cache(tmp_path)
    _index_with(tmp_path, _index_rows(1 << 20), copies=4)
    _forbid_decoding(monkeypatch)
    r = CacheReader(tmp_path)
    assert r.index_problem == f"{INDEX_FILE} has {4 << 20} rows, the commit records 3"
    assert r.index.equals(build_index(r.records))


def test_stale_index_parquet_is_never_decoded(tmp_path, monkeypatch):
    """An index written before other commits is rewritten by extract, not read: whatever it holds."""
    synthetic_cache(tmp_path)
    _index_with(tmp_path, _index_rows(1 << 20), digest=False, copies=4)
    _forbid_decoding(monkeypatch)
    assert CacheReader(tmp_path).index_problem is None


@pytest.mark.parametrize("dictionary, match", [
    (True, rf"{INDEX_FILE} column segment holds a value of 61440 bytes, more than 64"),
    (False, rf"{INDEX_FILE} column segment claims [\d,]+ bytes of pages, more than the [\d,]+ that 3 rows take"),
])
def test_index_parquet_with_absurd_strings_is_refused(tmp_path, dictionary, match):
    """Audit: a 0.94 MB string, stored once in the dictionary and repeated for each of a cache's
    samples, decodes to 0.94 MB a sample (3.8 GB for 4,000); a segment name is 14 bytes. Its pages
    give away a string spelled out row by row; the dictionary is checked before it is expanded."""
    synthetic_cache(tmp_path)
    _index_with(tmp_path, _index_rows(3, segment="u" * (60 << 10)), use_dictionary=dictionary)
    assert (tmp_path / INDEX_FILE).stat().st_size < 16 << 10
    problem = CacheReader(tmp_path).index_problem
    assert re.fullmatch(match, problem), problem


@pytest.mark.parametrize("rel", [ZARR_JSON, f"{SEGMENTS_DIR}/{ZARR_JSON}"])
def test_extract_resuming_into_a_cache_with_a_fifo_does_not_hang(tmp_path, rel):
    """Audit: `extract` resuming into a cache whose segments/zarr.json was a FIFO hung forever
    (zarr opened it to write the segments group again)."""
    from dflash_cache.store.writer import open_or_create
    from tests.dflash_cache.store.test_writer import new_cache

    manifest, plan, _ = new_cache(tmp_path)
    fifo = _fifo(tmp_path / rel)
    _refused_in_time(lambda: open_or_create(tmp_path, manifest, plan), fifo, f"{rel} is a FIFO, not a regular file")
