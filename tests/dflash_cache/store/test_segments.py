"""Commit records, path safety, file-list checks and crash-leftover cleanup."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from dflash_cache.errors import CacheCorruptError
from dflash_cache.store.layout import COMMITS_DIR, SEGMENTS_DIR, segment_dir
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.segments import (
    MAX_SEGMENT_TOKENS,
    SegmentRecord,
    check_files,
    read_records,
    remove_uncommitted,
)
from tests.dflash_cache.store._util import synthetic_cache

NAME = "u000000-b00000"


def good_record() -> dict:
    return {
        "name": "u000003-b00007", "unit": 3, "batch": 7, "bucket": 1, "rank": 0, "num_tokens": 30,
        "sample_ids": [4, 9], "lengths": [10, 20], "supervised": [5, 20],
        "files": {"zarr.json": 100, "features/c/0/0": 5000},
    }


def test_good_record_parses_and_round_trips():
    rec = SegmentRecord.from_json(good_record(), where="x.json")
    assert rec.name == "u000003-b00007" and rec.num_samples == 2 and rec.lengths == (10, 20)
    assert SegmentRecord.from_json(json.loads(json.dumps(rec.to_json())), where="x") == rec


@pytest.mark.parametrize(
    "change, message",
    [
        ({"name": "../../etc"}, "bad segment name"),
        ({"name": "u000003-b00008"}, "bad segment name"),  # does not match unit/batch
        ({"name": "u000003-b00007\n"}, "bad segment name"),
        ({"name": "u3-b7"}, "bad segment name"),
        ({"files": {"../../../etc/passwd": 10}}, "bad file entry"),
        ({"files": {"features/../../x": 10}}, "bad file entry"),
        ({"files": {"/etc/passwd": 10}}, "bad file entry"),
        ({"files": {"zarr.json": -1}}, r"files\['zarr.json'\] must be an integer in \[0, "),
        ({"lengths": [10, 21]}, "lengths do not add up"),
        ({"lengths": [0, 30]}, r"lengths must hold integers in \[1, "),
        ({"lengths": [10, 20, 5], "num_tokens": 35}, "disagree in length"),
        ({"supervised": [5]}, "disagree in length"),
        ({"sample_ids": [], "lengths": [], "supervised": [], "num_tokens": 0}, "num_tokens must be an integer"),
        ({"sample_ids": [], "lengths": [], "supervised": []}, "empty"),
        ({"supervised": [11, 20]}, "supervised counts exceed"),
        ({"supervised": [-1, 20]}, r"supervised must hold integers in \[0, "),
        ({"num_tokens": 10**15, "lengths": [10, 10**15 - 10]}, rf"num_tokens must be an integer in \[1, {MAX_SEGMENT_TOKENS}\]"),
        ({"num_tokens": MAX_SEGMENT_TOKENS + 1, "lengths": [1, MAX_SEGMENT_TOKENS]}, "num_tokens must be an integer"),
        ({"num_tokens": "lots"}, "malformed"),
        ({"lengths": None}, "malformed"),
        ({"files": ["zarr.json"]}, "malformed"),
        # strict JSON types (issue 16.10): nothing is coerced
        ({"sample_ids": "12"}, "sample_ids must be a list of integers"),  # was read as (1, 2)
        ({"lengths": "12"}, "lengths must be a list of integers"),
        ({"sample_ids": [4.0, 9]}, "sample_ids must hold integers"),
        ({"sample_ids": [True, 9]}, "sample_ids must hold integers"),
        ({"num_tokens": 30.0}, "num_tokens must be an integer"),
        ({"unit": "3"}, "unit must be an integer"),
        ({"rank": False}, "rank must be an integer"),
        ({"bucket": 40000}, r"bucket must be an integer in \[0, 32767\]"),  # the index stores int16
        ({"name": 5}, "name must be a string"),
        ({"files": {"zarr.json": "100"}}, r"files\['zarr.json'\] must be an integer"),
        ({"files": {"zarr.json": 1.5}}, r"files\['zarr.json'\] must be an integer"),
        ({"extra": 1}, "unknown field 'extra'"),
    ],
)
def test_malformed_records_refused(change, message):
    obj = good_record() | change
    with pytest.raises(CacheCorruptError, match=message) as ei:
        SegmentRecord.from_json(obj, where="commit-x.json")
    assert "commit-x.json" in str(ei.value)


def test_missing_key_refused():
    obj = good_record()
    del obj["files"]
    with pytest.raises(CacheCorruptError, match="malformed.*lacks field 'files'"):
        SegmentRecord.from_json(obj, where="w")


@pytest.mark.parametrize("obj", [[], "record", 3, None])
def test_record_that_is_not_an_object_refused(obj):
    with pytest.raises(CacheCorruptError, match="commit record w is malformed"):
        SegmentRecord.from_json(obj, where="w")


def test_read_records_refuses_bad_record_on_disk(tmp_path):
    synthetic_cache(tmp_path)
    path = tmp_path / COMMITS_DIR / f"{NAME}.json"
    obj = json.loads(path.read_text())
    obj["files"]["../../outside"] = 1
    path.write_text(json.dumps(obj))
    with pytest.raises(CacheCorruptError, match="bad file entry"):
        read_records(tmp_path)
    with pytest.raises(CacheCorruptError, match="bad file entry"):
        CacheReader(tmp_path)


def test_read_records_refuses_record_naming_another_segment(tmp_path):
    synthetic_cache(tmp_path, segments=2)
    a, b = tmp_path / COMMITS_DIR / f"{NAME}.json", tmp_path / COMMITS_DIR / "u000000-b00001.json"
    a.write_bytes(b.read_bytes())
    with pytest.raises(CacheCorruptError, match="names segment u000000-b00001"):
        read_records(tmp_path)


def test_read_records_refuses_unreadable_json(tmp_path):
    synthetic_cache(tmp_path)
    (tmp_path / COMMITS_DIR / f"{NAME}.json").write_text("{not json")
    with pytest.raises(CacheCorruptError, match="unreadable"):
        read_records(tmp_path)


def test_read_records_ignores_tmp_and_strangers(tmp_path):
    synthetic_cache(tmp_path)
    commits = tmp_path / COMMITS_DIR
    (commits / "u000000-b00009.json.1234.tmp").write_text("{torn")
    (commits / "u000000-b00008.json.tmp").write_text("")
    (commits / "notes.json").write_text("[]")
    (commits / "README").write_text("hi")
    recs = read_records(tmp_path)
    assert [r.name for r in recs] == [NAME]
    assert CacheReader(tmp_path).num_samples == 3


def test_read_records_without_commits_dir(tmp_path):
    assert read_records(tmp_path) == []


def test_records_sorted_by_name(tmp_path):
    synthetic_cache(tmp_path, segments=3)
    assert [r.name for r in read_records(tmp_path)] == [f"u000000-b0000{i}" for i in range(3)]


def _move_segment_outside(tmp_path):
    root = tmp_path / "cache"
    _, [(rec, _)] = synthetic_cache(root)
    outside = tmp_path / "elsewhere"
    seg = root / SEGMENTS_DIR / rec.name
    shutil.move(seg, outside)
    os.symlink(outside, seg, target_is_directory=True)
    return root, rec


def test_segment_dir_symlink_outside_root_refused(tmp_path):
    root, rec = _move_segment_outside(tmp_path)
    # the data is intact and readable through the link, so a reader that followed it would succeed
    assert (root / SEGMENTS_DIR / rec.name / "features" / "c" / "0" / "0").is_file()
    with pytest.raises(CacheCorruptError, match="outside the cache root"):
        segment_dir(root, rec.name)
    with pytest.raises(CacheCorruptError, match="outside the cache root"):
        check_files(root, rec)
    r = CacheReader(root)
    with pytest.raises(CacheCorruptError, match="outside the cache root"):
        r.sample(0)
    with pytest.raises(CacheCorruptError, match="outside the cache root"):
        r.read_segment(rec.name)
    # even with file checks off, the reader does not open the directory
    with pytest.raises(CacheCorruptError, match="outside the cache root"):
        CacheReader(root, check_segment_files=False).read_array(rec.name, "features")


def test_file_symlink_outside_root_reported(tmp_path):
    _, [(rec, _)] = synthetic_cache(tmp_path / "cache")
    root = tmp_path / "cache"
    shard = root / SEGMENTS_DIR / rec.name / "features" / "c" / "0" / "0"
    outside = tmp_path / "shard-copy"
    shutil.copy(shard, outside)
    shard.unlink()
    os.symlink(outside, shard)
    problems = check_files(root, rec)
    assert len(problems) == 1 and "outside the cache root" in problems[0]
    with pytest.raises(CacheCorruptError, match=rf"segment {rec.name} is damaged.*outside the cache root"):
        CacheReader(root).sample(0)


def test_commit_record_symlink_outside_root_refused(tmp_path):
    root = tmp_path / "cache"
    synthetic_cache(root)
    rec_path = root / COMMITS_DIR / f"{NAME}.json"
    outside = tmp_path / "rec.json"
    shutil.move(rec_path, outside)
    os.symlink(outside, rec_path)
    with pytest.raises(CacheCorruptError, match="outside the cache root"):
        read_records(root)


def test_deleted_shard_reported_never_zeros(tmp_path):
    _, [(rec, inp)] = synthetic_cache(tmp_path)
    (tmp_path / SEGMENTS_DIR / rec.name / "features" / "c" / "0" / "0").unlink()
    assert check_files(tmp_path, rec) == ["features/c/0/0 is missing"]
    r = CacheReader(tmp_path)
    for call in (lambda: r.sample(1), lambda: r.read_segment(rec.name), lambda: r.read_array(rec.name, "features")):
        with pytest.raises(CacheCorruptError, match=rf"segment {rec.name} is damaged: features/c/0/0 is missing"):
            call()
    # zarr alone would read the absent shard as zeros; even without the record's file list the
    # reader knows from the array's metadata which shard files must exist (issue 16.9)
    with pytest.raises(CacheCorruptError, match=rf"segment {rec.name} is damaged: features/c/0/0 is missing"):
        CacheReader(tmp_path, check_segment_files=False).read_array(rec.name, "features")


def test_deleted_token_shard_reported(tmp_path):
    _, [(rec, _)] = synthetic_cache(tmp_path)
    (tmp_path / SEGMENTS_DIR / rec.name / "input_ids" / "c" / "0").unlink()
    assert check_files(tmp_path, rec) == ["input_ids/c/0 is missing"]
    with pytest.raises(CacheCorruptError, match="input_ids/c/0 is missing"):
        CacheReader(tmp_path).sample(0)


def test_resized_file_reported(tmp_path):
    _, [(rec, _)] = synthetic_cache(tmp_path)
    shard = tmp_path / SEGMENTS_DIR / rec.name / "features" / "c" / "0" / "0"
    size = shard.stat().st_size
    assert rec.files["features/c/0/0"] == size
    with open(shard, "ab") as f:
        f.write(b"\0" * 3)
    assert check_files(tmp_path, rec) == [f"features/c/0/0 is {size + 3} bytes, the commit recorded {size}"]
    with pytest.raises(CacheCorruptError, match="is damaged"):
        CacheReader(tmp_path).sample(0)
    os.truncate(shard, size - 10)
    assert check_files(tmp_path, rec) == [f"features/c/0/0 is {size - 10} bytes, the commit recorded {size}"]


def test_deleted_segment_dir_reports_every_file(tmp_path):
    _, [(rec, _)] = synthetic_cache(tmp_path)
    shutil.rmtree(tmp_path / SEGMENTS_DIR / rec.name)
    problems = check_files(tmp_path, rec)
    assert sorted(problems) == sorted(f"{rel} is missing" for rel in rec.files)
    assert len(problems) == len(rec.files) >= 10


def test_remove_uncommitted(tmp_path):
    synthetic_cache(tmp_path, segments=2)
    segs, commits = tmp_path / SEGMENTS_DIR, tmp_path / COMMITS_DIR
    # a crashed segment: its directory, no record (its record only got as far as a temp file)
    crashed = segs / "u000000-b00005"
    shutil.copytree(segs / NAME, crashed)
    (commits / "u000000-b00005.json.777.tmp").write_text("{")
    stray = segs / "stray-file"
    stray.write_text("x")
    committed = {r.name for r in read_records(tmp_path)}
    assert committed == {NAME, "u000000-b00001"}
    assert remove_uncommitted(tmp_path, committed) == 2
    assert sorted(p.name for p in segs.iterdir()) == [NAME, "u000000-b00001"]
    assert sorted(p.name for p in commits.iterdir()) == [f"{NAME}.json", "u000000-b00001.json"]
    r = CacheReader(tmp_path)
    assert all(check_files(tmp_path, rec) == [] for rec in r.records)
    assert r.num_samples == 6
    assert remove_uncommitted(tmp_path, committed) == 0


def test_remove_uncommitted_unlinks_symlinked_dir_without_following(tmp_path):
    root = tmp_path / "cache"
    synthetic_cache(root)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    link = root / SEGMENTS_DIR / "u000000-b00003"
    os.symlink(victim, link, target_is_directory=True)
    assert remove_uncommitted(root, {NAME}) == 1
    assert not os.path.lexists(link)
    assert (victim / "keep.txt").read_text() == "precious"
    assert (root / SEGMENTS_DIR / NAME).is_dir()
