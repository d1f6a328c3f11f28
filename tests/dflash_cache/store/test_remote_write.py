"""Caches written to object storage (`extract --out s3://...`) on a real S3-compatible server
(moto's, started here; every byte goes over HTTP through s3fs): the result equals a local
extraction's, a killed run resumes without showing anything half-written, the lock object keeps a
second writer out, and refusals and storage errors are one line."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dflash_cache.cli import cli
from dflash_cache.errors import UserError
from dflash_cache.extract.job import open_or_create as open_job_cache
from dflash_cache.extract.job import plan_job
from dflash_cache.extract.run import job_from_cache, run_rank
from dflash_cache.store.destination import RemoteDestination
from dflash_cache.store.layout import LOCK_FILE
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.remote_lock import RemoteLock
from dflash_cache.store.report import verify
from dflash_cache.store.writer import finish_cache, open_or_create
from dflash_cache.target.model import describe_target
from tests.conftest import extract_config
from tests.dflash_cache.store._util import make_manifest
from tests.dflash_cache.store.test_writer import one_segment_plan

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

BUCKET = "writes"
# The demo's first 64 rows in 7 segments (enough to kill a run in its 4th upload and resume it),
# half the forwards and uploads of all 128 rows in 14; `local_twin` is the same extraction on disk.
DEMO = ["--model", "tiny", "--data", "demo", "--limit", "64", "--gpus", "cpu", "--codec", "bf16",
        "--token-budget", "2048", "--max-rows", "16", "--unit-rows", "64", "--no-progress", "--writers", "2"]


class Killed(Exception):
    """Stands in for a kill: raised where the run would have died."""


def run_cli(*args: str):
    return CliRunner().invoke(cli, list(args))


def names(fs, prefix: str) -> list[str]:
    """The entries directly under `prefix`, listed afresh (the filesystem caches listings)."""
    fs.invalidate_cache()
    return sorted(k.rsplit("/", 1)[-1] for k in fs.ls(prefix, detail=False)) if fs.exists(prefix) else []


def assert_same_cache(fs, url: str, local: Path) -> None:
    """The same records (samples, files and their sizes) and byte-identical segment files."""
    remote, here = CacheReader(url), CacheReader(local)
    assert [r.to_json() for r in remote.records] == [r.to_json() for r in here.records]
    prefix, rels = url.removeprefix("s3://"), [f"segments/{r.name}/{rel}" for r in here.records for rel in r.files]
    objects = fs.cat([f"{prefix}/{rel}" for rel in rels])
    assert [rel for rel in rels if objects[f"{prefix}/{rel}"] != (local / rel).read_bytes()] == []


@pytest.fixture(scope="module")
def bucket(s3_server):
    s3_server.mkdir(BUCKET)
    return s3_server


@pytest.fixture(scope="module")
def local_twin(tmp_path_factory) -> Path:
    """DEMO extracted to a local directory: what every extraction to the bucket must equal. Read-only."""
    out = tmp_path_factory.mktemp("twin") / "cache"
    r = run_cli("extract", *DEMO, "--out", str(out))
    assert r.exit_code == 0, r.output
    return out


@dataclass
class KilledRun:
    """What a demo extraction to S3 killed mid-way left, seen before it was resumed."""

    visible: list[str]  # the segments a reader saw
    damage: list[str]  # what verify found in them
    uncommitted: set[str]  # segment prefixes without a record
    lock_left: bool


def killed_in_the_4th_upload(monkeypatch) -> None:
    """Segments upload whole until the 4th, which uploads half its files and dies (as do any after it)."""
    upload, segments = RemoteDestination._upload, []

    def upload_or_die(self, directory, files, under=""):
        if under.startswith("segments/"):
            segments.append(under)
            if len(segments) >= 4:
                upload(self, directory, files[: len(files) // 2], under)
                raise Killed
        upload(self, directory, files, under)

    monkeypatch.setattr(RemoteDestination, "_upload", upload_or_die)


@pytest.fixture(scope="module")
def demo_run(bucket) -> tuple[str, KilledRun, str]:
    """The demo extracted by the CLI to s3://writes/demo, killed while uploading its 4th segment,
    then resumed (with a stale stranger's segment prefix added): (URL, what the kill left, the
    resumed run's output)."""
    url, prefix = f"s3://{BUCKET}/demo", f"{BUCKET}/demo"
    with pytest.MonkeyPatch.context() as m:
        killed_in_the_4th_upload(m)
        r = run_cli("extract", *DEMO, "--writers", "1", "--out", url)
    assert isinstance(r.exception, Killed), r.output
    reader = CacheReader(url)
    visible = [rec.name for rec in reader.records]
    killed = KilledRun(visible=visible, damage=verify(reader),
                       uncommitted=set(names(bucket, f"{prefix}/segments")) - set(visible) - {"zarr.json"},
                       lock_left=LOCK_FILE in names(bucket, prefix))
    bucket.pipe_file(f"{prefix}/segments/u000099-b00000/zarr.json", b"{}")
    r = run_cli("extract", *DEMO, "--out", url)
    assert r.exit_code == 0, r.output
    return url, killed, r.output


def test_a_killed_extraction_shows_only_whole_committed_segments(demo_run):
    """Records are written only after all of a segment's files are uploaded: the three whole
    segments are visible and clean, the half-uploaded one is not; the lock is released."""
    _, killed, _ = demo_run
    assert len(killed.visible) == 3 and killed.damage == []
    assert killed.uncommitted, "the 4th segment's first files were uploaded, without a record"
    assert not killed.lock_left


def test_the_resumed_extraction_equals_the_local_one(bucket, demo_run, local_twin):
    """The rerun removes uncommitted prefixes, does exactly the rest, indexes everything and
    releases the lock; inspect --verify is clean and records and arrays equal the local extraction's."""
    url, _, output = demo_run
    assert "3 of 7 segments already committed; 4 to extract" in output and "complete: 7/7" in output, output
    assert "u000099-b00000" not in names(bucket, f"{BUCKET}/demo/segments")
    assert names(bucket, f"{BUCKET}/demo") == ["commits", "index.parquet", "manifest.json", "plan.parquet",
                                               "segments", "zarr.json"]
    r = run_cli("inspect", url, "--verify", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["verify"]["ok"], r.output
    assert CacheReader(url).index_problem is None
    assert_same_cache(bucket, url, local_twin)


def test_ranks_write_their_own_shares_to_one_url(bucket, small_parquet):
    """Rank 0 creates and writes its share; another rank takes the job from the URL (manifest and
    plan) and writes the rest; rank 0's index then covers both."""
    cfg = extract_config(small_parquet, f"s3://{BUCKET}/ranks")
    job = plan_job(cfg)
    committed = open_job_cache(job)
    run_rank(job, committed, rank=0, world=2, device=torch.device("cpu"))
    other = job_from_cache(cfg, describe_target(cfg.target))
    assert other.manifest == job.manifest and len(other.plan.batches) == len(job.plan.batches)
    run_rank(other, committed, rank=1, world=2, device=torch.device("cpu"))
    finish_cache(job.root, lambda *_: None, 0.0)
    reader = CacheReader(cfg.out)
    assert reader.complete and reader.index_problem is None and not verify(reader)
    assert {rec.rank for rec in reader.records} == {0, 1}
    assert sorted(s for rec in reader.records for s in rec.sample_ids) == list(range(48))


def test_two_copies_write_one_url_each_under_its_own_lock(bucket, local_twin):
    """extract --copy 0/2 creates the cache and writes its share; copy 1, started while copy 0's lock
    object is held (as if it were still running), is not kept out by it, writes the rest and the
    index; the result is the local extraction byte for byte."""
    url = f"s3://{BUCKET}/copies"
    r = run_cli("extract", *DEMO, "--out", url, "--copy", "0/2")
    assert r.exit_code == 0 and "to extract as copy 0 of 2" in r.output and "INCOMPLETE" in r.output, r.output
    with RemoteLock(url, name=f"{LOCK_FILE}-copy0"):
        r = run_cli("extract", *DEMO, "--out", url, "--copy", "1/2")
    assert r.exit_code == 0 and "complete: 7/7" in r.output, r.output
    assert names(bucket, f"{BUCKET}/copies") == ["commits", "index.parquet", "manifest.json", "plan.parquet",
                                                 "segments", "zarr.json"]
    assert CacheReader(url).index_problem is None
    assert_same_cache(bucket, url, local_twin)


def test_the_lock_refuses_a_second_writer_and_an_expired_one_is_taken_over(bucket):
    url, key = f"s3://{BUCKET}/locked", f"{BUCKET}/locked/{LOCK_FILE}"
    with RemoteLock(url) as held:
        with pytest.raises(UserError, match=rf"^cache {url} is being written by {held.owner} \(lock expires at "
                                            r".+\); wait for it to finish or choose another --out$"):
            with RemoteLock(url):
                pass
        r = run_cli("extract", *DEMO, "--out", url)
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert r.output.strip().splitlines()[-1].startswith(f"Error: cache {url} is being written by {held.owner}")
        assert names(bucket, f"{BUCKET}/locked") == [LOCK_FILE]  # the refused run wrote nothing
    assert names(bucket, f"{BUCKET}/locked") == []
    bucket.pipe_file(key, json.dumps({"owner": "gone 1 abc", "expires": time.time() - 1}).encode())
    with RemoteLock(url, ttl=0.3) as lock:
        first = json.loads(bucket.cat_file(key))
        assert first["owner"] == lock.owner
        time.sleep(0.4)  # the heartbeat renews it every ttl / 3
        assert json.loads(bucket.cat_file(key))["expires"] > first["expires"]
    assert names(bucket, f"{BUCKET}/locked") == []


def test_mismatching_foreign_and_half_made_prefixes(bucket):
    """A cache made differently is refused unless --overwrite, a prefix of strangers' objects is
    refused, and one holding our entries but no manifest (a creation cut short) is made again."""
    url, prefix, plan = f"s3://{BUCKET}/made", f"{BUCKET}/made", one_segment_plan()
    assert open_or_create(url, make_manifest("bf16"), plan) == set()
    with pytest.raises(UserError, match=rf"^cache {url} was made differently: codec: cache has 'bf16', this run "
                                        "has 'fp8'; pass --overwrite"):
        open_or_create(url, make_manifest("fp8"), plan)
    assert open_or_create(url, make_manifest("fp8"), plan, overwrite=True) == set()
    assert CacheReader(url).manifest.codec == "fp8"
    upload = RemoteDestination._upload

    def killed_at_the_manifest(self, directory, files, under=""):
        if files == ["manifest.json"]:
            raise Killed
        upload(self, directory, files, under)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(RemoteDestination, "_upload", killed_at_the_manifest)
        with pytest.raises(Killed):
            open_or_create(url, make_manifest("bf16"), plan, overwrite=True)
    assert names(bucket, prefix) == ["plan.parquet", "segments", "zarr.json"]  # the manifest comes last
    with pytest.raises(UserError, match="not a dflash-cache"):
        CacheReader(url)
    assert open_or_create(url, make_manifest("bf16"), plan) == set()
    assert CacheReader(url).manifest.codec == "bf16"
    bucket.pipe_file(f"{BUCKET}/foreign/notes.txt", b"mine")
    with pytest.raises(UserError, match="exists and is not a dflash-cache; choose an empty or new prefix"):
        open_or_create(f"s3://{BUCKET}/foreign", make_manifest(), plan)
    assert names(bucket, f"{BUCKET}/foreign") == ["notes.txt"]


def test_storage_errors_and_a_url_the_tee_cannot_write_are_one_line(bucket):
    with pytest.raises(UserError, match=r"^cannot write the cache at s3://no-such-bucket/x: The specified bucket "
                                        r"does not exist; check the URL .*AWS_ENDPOINT_URL"):
        open_or_create("s3://no-such-bucket/x", make_manifest(), one_segment_plan())
    r = run_cli("extract", *DEMO, "--out", "s3://no-such-bucket/x")
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1].startswith(
        "Error: cannot write the cache at s3://no-such-bucket/x: The specified bucket does not exist"), r.output
    with pytest.raises(UserError, match="install the package for that storage"):
        open_or_create("gs://bucket/x", make_manifest(), one_segment_plan())
    from dflash_cache.train.place import Place
    from dflash_cache.train.tee import CacheTee

    with pytest.raises(UserError, match="^--write-cache s3://b/x: the live run writes its cache to a local"):
        CacheTee("s3://b/x", "bf16", target=None, data=None, source_config=None, place=Place(torch.device("cpu")))


def test_dry_run_reads_the_url_and_writes_nothing(bucket, demo_run):
    demo_url = demo_run[0]
    bucket.invalidate_cache()
    before = bucket.find(f"{BUCKET}/demo", detail=True)
    r = run_cli("extract", *DEMO, "--out", demo_url, "--dry-run")
    assert r.exit_code == 0 and "7 of 7 segments already committed; 0 to extract" in r.output, r.output
    assert f"Free space for {demo_url}: object storage" in r.output
    bucket.invalidate_cache()
    assert bucket.find(f"{BUCKET}/demo", detail=True) == before


def test_training_reads_the_cache_extract_wrote(demo_run, tmp_path):
    from dflash_cache.train.trainer import Trainer
    from tools.make_demo_drafter import demo_train_config

    # batches of 512 tokens (a few samples): each sample read from the bucket is a request per array
    Trainer.build(demo_train_config(demo_run[0], tmp_path, max_steps=2, log_every=1, token_budget=512),
                  device=torch.device("cpu")).fit()
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(np.isfinite(losses))
