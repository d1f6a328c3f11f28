"""The store's writer: creating and reopening caches, committing segments, finishing a cache."""

from __future__ import annotations

import errno
import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dflash_cache.errors import UserError
from dflash_cache.profiler import StageProfiler
from dflash_cache.store.batch import HostBatch, PackedBatch
from dflash_cache.store.codecs import get_codec
from dflash_cache.store.layout import COMMITS_DIR, CREATING_FILE, INDEX_FILE, PLAN_FILE, SEGMENTS_DIR
from dflash_cache.store.manifest import read_manifest, write_manifest
from dflash_cache.store.plan import Plan, PlanConfig, PlannedBatch, read_plan
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.report import verify
from dflash_cache.store.segments import SegmentRecord, check_files
from dflash_cache.store.writer import disk_error, finish_cache, open_or_create
from tests.dflash_cache.store._util import bf16_features, make_manifest, write_synthetic_segment

NAME = "u000000-b00000"


def one_segment_plan() -> Plan:
    """The plan `make_manifest()` describes: one segment of samples 0..2 (17, 25 and 18 tokens)."""
    return Plan(config=PlanConfig(token_budget=2048, max_rows=16, unit_rows=64, bucket_bounds=(0, 770)), num_rows=3,
                batches=(PlannedBatch(unit=0, batch=0, bucket=0, rows=np.arange(3, dtype=np.int64),
                                      lengths=np.array([17, 25, 18], np.int32)),))


def new_cache(root: Path, codec: str = "bf16"):
    plan = one_segment_plan()
    manifest = make_manifest(codec)
    assert manifest.plan == plan.params(max_len=None, overlong="truncate")
    return manifest, plan, open_or_create(root, manifest, plan)


# --- creating and reopening -------------------------------------------------------------------

def test_a_new_cache_holds_manifest_plan_and_empty_groups(tmp_path):
    root = tmp_path / "c"
    manifest, plan, committed = new_cache(root)
    assert committed == set()
    assert sorted(p.name for p in root.iterdir()) == [COMMITS_DIR, "manifest.json", PLAN_FILE, SEGMENTS_DIR,
                                                      "zarr.json"]
    assert read_manifest(root) == manifest
    assert [(b.unit, b.batch, b.rows.tolist()) for b in read_plan(root, manifest).batches] == [(0, 0, [0, 1, 2])]
    assert (root / SEGMENTS_DIR / "zarr.json").is_file() and not (root / CREATING_FILE).exists()


def test_reopening_a_matching_cache_keeps_commits_and_drops_leftovers(tmp_path):
    manifest, plan, _ = new_cache(tmp_path)
    rec, _ = write_synthetic_segment(tmp_path, manifest)
    leftover = tmp_path / SEGMENTS_DIR / "u000000-b00001"
    shutil.copytree(tmp_path / SEGMENTS_DIR / NAME, leftover)  # a crash before its commit
    (tmp_path / SEGMENTS_DIR / "zarr.json").unlink()  # a cache made before segments/ was a group
    assert open_or_create(tmp_path, manifest, plan) == {rec.name}
    assert not leftover.exists() and (tmp_path / SEGMENTS_DIR / "zarr.json").is_file()
    assert check_files(tmp_path, rec) == []


def test_a_run_sharing_the_cache_removes_only_its_own_leftovers(tmp_path):
    """`owned` (extract --copy): another run may be writing the other segments, so their files
    without a record stay, and so do their temporary records; this run's own leftovers go. With
    `created_by` a run only reopens: a missing cache is an error naming who creates it."""
    with pytest.raises(UserError, match="holds no cache yet: copy 0 creates it; start that one first"):
        open_or_create(tmp_path / "none", make_manifest(), one_segment_plan(), created_by="copy 0")
    assert not (tmp_path / "none").exists()
    manifest, plan, _ = new_cache(tmp_path)
    rec, _ = write_synthetic_segment(tmp_path, manifest)
    mine, theirs = tmp_path / SEGMENTS_DIR / "u000000-b00001", tmp_path / SEGMENTS_DIR / "u000000-b00002"
    for leftover in (mine, theirs):
        shutil.copytree(tmp_path / SEGMENTS_DIR / NAME, leftover)
        (tmp_path / COMMITS_DIR / f"{leftover.name}.json.123.tmp").write_text("{")
    assert open_or_create(tmp_path, manifest, plan, owned={NAME, mine.name}.__contains__, created_by="copy 0") \
        == {rec.name}
    assert not mine.exists() and theirs.is_dir()
    assert sorted(p.name for p in (tmp_path / COMMITS_DIR).iterdir()) == [f"{NAME}.json", f"{theirs.name}.json.123.tmp"]


def test_a_cache_made_differently_is_refused_naming_the_field_unless_overwritten(tmp_path):
    manifest, plan, _ = new_cache(tmp_path)
    write_synthetic_segment(tmp_path, manifest)
    other = replace(manifest, codec="fp8")
    with pytest.raises(UserError, match=r"made differently: codec: cache has 'bf16', this run has 'fp8'.*--overwrite"):
        open_or_create(tmp_path, other, plan)
    assert open_or_create(tmp_path, other, plan, overwrite=True) == set()
    assert read_manifest(tmp_path).codec == "fp8" and not list((tmp_path / COMMITS_DIR).iterdir())


def test_a_directory_that_is_no_cache_is_left_alone(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(UserError, match="exists and is not a dflash-cache"):
        open_or_create(tmp_path, make_manifest(), one_segment_plan(), overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["precious.txt"]


def test_lock_files_alone_do_not_make_a_directory_foreign(tmp_path):
    (tmp_path / ".lock").write_text("")
    new_cache(tmp_path)
    assert (tmp_path / ".lock").exists() and (tmp_path / "manifest.json").is_file()


def test_a_half_made_cache_is_made_again(tmp_path):
    (tmp_path / CREATING_FILE).touch()
    (tmp_path / PLAN_FILE).write_bytes(b"torn")
    (tmp_path / "zarr.json").write_text("{")
    new_cache(tmp_path)
    assert not (tmp_path / CREATING_FILE).exists() and CacheReader(tmp_path).records == []


def test_a_failed_creation_leaves_nothing(tmp_path, monkeypatch):
    import dflash_cache.store.writer as writer

    def disk_full(root, _manifest):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "write_manifest", disk_full)
    with pytest.raises(UserError, match="disk full while creating the cache at .*nothing was left behind"):
        new_cache(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_disk_errors_are_one_line_saying_what_to_do(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device")
    assert str(disk_error(tmp_path, full)) == (f"disk full while writing to {tmp_path}; free space and run the same "
                                               "command again (committed segments are kept)")
    denied = OSError(errno.EACCES, "Permission denied")
    assert str(disk_error(tmp_path, denied, creating=True)) == (
        f"cannot create the cache at {tmp_path}: Permission denied; check the path and permissions")


# --- committing ---------------------------------------------------------------------------------

def test_the_record_describes_the_packed_batch(tmp_path):
    manifest, _, _ = new_cache(tmp_path)
    rec, inp = write_synthetic_segment(tmp_path, manifest, unit=0, batch=0, first_id=5)
    packed = inp["packed"]
    assert (rec.name, rec.unit, rec.batch, rec.bucket, rec.rank) == (NAME, 0, 0, 0, 0)
    assert rec.sample_ids == (5, 6, 7) and rec.lengths == (17, 25, 18) and rec.num_tokens == 60
    assert rec.supervised == tuple(packed.supervised().tolist())
    assert SegmentRecord.from_json(json.loads((tmp_path / COMMITS_DIR / f"{NAME}.json").read_text()), where="") == rec


def test_record_lists_every_file_with_its_size(tmp_path):
    manifest, _, _ = new_cache(tmp_path)
    rec, _ = write_synthetic_segment(tmp_path, manifest)
    seg = tmp_path / SEGMENTS_DIR / rec.name
    on_disk = {str(p.relative_to(seg)): p.stat().st_size for p in seg.rglob("*") if p.is_file()}
    assert rec.files == on_disk
    assert {"zarr.json", "features/zarr.json", "features/c/0/0", "offsets/c/0", "sample_ids/c/0"} <= set(rec.files)
    assert check_files(tmp_path, rec) == []
    assert rec.supervised == tuple(int(s.sum()) for s in np.split(
        CacheReader(tmp_path).read_array(rec.name, "loss_mask"), np.cumsum(rec.lengths)[:-1]))


def test_rewriting_a_segment_replaces_crash_garbage(tmp_path):
    manifest, _, _ = new_cache(tmp_path)
    rec, _ = write_synthetic_segment(tmp_path, manifest)
    garbage = tmp_path / SEGMENTS_DIR / NAME / "junk.bin"
    garbage.write_bytes(b"x" * 10)
    rec2, _ = write_synthetic_segment(tmp_path, manifest)
    assert not garbage.exists() and "junk.bin" not in rec2.files
    assert rec2 == rec


def test_large_segment_is_split_into_several_shards(tmp_path, monkeypatch):
    """Shards are written concurrently; each round-trips, and losing any one is reported."""
    import dflash_cache.store.segments as segments

    monkeypatch.setattr(segments, "CHUNK_BYTES", 2048)
    monkeypatch.setattr(segments, "SHARD_BYTES", 8192)
    (tmp_path / COMMITS_DIR).mkdir()
    m = make_manifest(num_tokens=300)
    write_manifest(tmp_path, m)
    rec, inp = write_synthetic_segment(tmp_path, m, lengths=(100, 140, 60))
    shards = sorted(p.name for p in (tmp_path / SEGMENTS_DIR / rec.name / "features" / "c").iterdir())
    assert len(shards) == 5, shards  # 300 rows of 128 B: 16-row chunks, 64-row shards
    stored = CacheReader(tmp_path).read_segment(rec.name)["features"]
    assert np.array_equal(stored, inp["stored"]["features"])
    (tmp_path / SEGMENTS_DIR / rec.name / "features" / "c" / "3" / "0").unlink()
    assert check_files(tmp_path, rec) == ["features/c/3/0 is missing"]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("codec", ["bf16", "fp8"])
def test_extraction_and_the_tee_commit_the_same_segment(tmp_path, codec):
    """The same rows and features, through extraction's writer thread and through the tee (their
    own methods, on stand-ins for the objects around them), give byte-identical segments."""
    from dflash_cache.data.dataset import Row
    from dflash_cache.extract.pipeline import RankExtractor, layout_batch
    from dflash_cache.train.tee import CacheTee

    rng = np.random.default_rng(0)
    lengths = (17, 25, 18)
    rows = [Row(index=i, input_ids=rng.integers(0, 1000, n).astype(np.int32),
                loss_mask=(rng.random(n) < 0.6).astype(np.uint8)) for i, n in enumerate(lengths)]
    features = bf16_features(sum(lengths), make_manifest(codec).feature_width)
    planned = one_segment_plan().batches[0]
    codec_ = get_codec(codec)
    writer = dict(specs=codec_.arrays(2, 32), rank=0, codec=codec_, n_layers=2)

    extracted, teed = tmp_path / "extracted", tmp_path / "teed"
    for root in (extracted, teed):
        open_or_create(root, make_manifest(codec), one_segment_plan())
    extractor = SimpleNamespace(root=extracted, profiler=StageProfiler(None), **writer)
    RankExtractor._write_segment(extractor, layout_batch(planned, rows, pin=False), codec_.encode(features, 2))
    live = HostBatch.pack([r.input_ids for r in rows], [r.loss_mask for r in rows], planned.rows)
    tee = SimpleNamespace(root=teed, plan=one_segment_plan(), _stream=None, **writer)
    CacheTee._write(tee, 0, PackedBatch.from_host(live, features), None)

    assert _tree(extracted / SEGMENTS_DIR) == _tree(teed / SEGMENTS_DIR)
    assert _tree(extracted / COMMITS_DIR) == _tree(teed / COMMITS_DIR)


# --- finishing ----------------------------------------------------------------------------------

def test_a_commit_made_while_the_index_is_written_is_indexed(tmp_path, monkeypatch):
    """Two `--copy` runs ending together: the other run commits its last segment after this one
    listed the commits; this run's index (the last written) must still cover it."""
    from dflash_cache.store.destination import LocalDestination

    manifest, _, _ = new_cache(tmp_path)
    real_put = LocalDestination.put_parquet
    late = []

    def put_then_the_other_run_commits(self, rel, table):
        real_put(self, rel, table)
        if not late:
            late.append(write_synthetic_segment(tmp_path, manifest))

    monkeypatch.setattr(LocalDestination, "put_parquet", put_then_the_other_run_commits)
    said: list[str] = []
    finish_cache(tmp_path, said.append, 1.0)
    assert late and said == ["complete: 1/1 segments, 60 tokens committed; this run took 1.0s"]
    assert CacheReader(tmp_path).index_problem is None


def test_finish_cache_indexes_the_commits_and_says_how_complete(tmp_path):
    manifest, _, _ = new_cache(tmp_path)
    said: list[str] = []
    finish_cache(tmp_path, said.append, 1.5)
    assert said == ["INCOMPLETE: 0/1 segments, 0 tokens committed; this run took 1.5s"]
    write_synthetic_segment(tmp_path, manifest)
    finish_cache(tmp_path, said.append, 2.0)
    assert said[-1] == "complete: 1/1 segments, 60 tokens committed; this run took 2.0s"
    reader = CacheReader(tmp_path)
    assert (tmp_path / INDEX_FILE).is_file() and reader.index_problem is None and not verify(reader)
    assert reader.locate(1)["row_offset"] == 17


def test_a_full_disk_at_the_index_write_is_one_line_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    import dflash_cache.files as files

    manifest, _, _ = new_cache(tmp_path)
    write_synthetic_segment(tmp_path, manifest)
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(UserError) as e:
        finish_cache(tmp_path, lambda _: None, 1.0)
    monkeypatch.undo()
    assert str(e.value) == (f"disk full while writing to {tmp_path}; free space and run the same command again "
                            "(committed segments are kept)")
    assert not list(tmp_path.glob("*.tmp"))
    finish_cache(tmp_path, lambda _: None, 1.0)
    assert CacheReader(tmp_path).index_problem is None
