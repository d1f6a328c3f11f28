"""Caches read from object storage: a real S3-compatible server (moto's, started here; the bytes go
over HTTP through s3fs) holding copies of a real cache. inspect's summary, samples, verify and a
training run read it as they read the local directory; damage there is found and named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dflash_cache.cli import cli
from dflash_cache.errors import CacheCorruptError, UserError
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.extract.run import extract
from dflash_cache.store.plan import PlanConfig
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.report import summarize, verify
from dflash_cache.target.model import TargetSpec

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

BUCKET = "caches"
# All 128 demo rows in 5 segments, not the 14 of the session's real_cache: every object is a request
# to the server, in the upload, each copy a test damages, each listing, verify and training's reads,
# and the tests need 4 segments (records[0] to records[3]).
PLAN = PlanConfig(token_budget=8192, max_rows=32, unit_rows=128)


@pytest.fixture(scope="module")
def s3(s3_server, tmp_path_factory):
    """The demo extracted with the fp8 codec under PLAN, copied under s3://caches/demo: (filesystem,
    local copy)."""
    fs = s3_server
    fs.mkdir(BUCKET)
    local = tmp_path_factory.mktemp("location") / "cache"
    extract(ExtractConfig(target=TargetSpec(model="tiny"), data="demo", out=str(local), codec="fp8", plan=PLAN,
                          progress=False), "cpu", echo=lambda *a, **k: None)
    assert len(CacheReader(local).records) >= 4
    fs.put(str(local) + "/", f"{BUCKET}/demo/", recursive=True)
    return fs, local


def test_a_cache_on_s3_reads_as_the_local_one(s3, monkeypatch):
    """Summary, samples and verify as on disk; verify lists each segment once (a listing is a LIST
    request per segment: the file check and the read share it)."""
    from dflash_cache.store.location import RemoteCache

    listed = []
    segment_files = RemoteCache.segment_files
    monkeypatch.setattr(RemoteCache, "segment_files", lambda self, name: listed.append(name) or segment_files(self, name))
    fs, local = s3
    remote, here = CacheReader(f"s3://{BUCKET}/demo"), CacheReader(local)
    assert remote.root is None and str(remote.location) == f"s3://{BUCKET}/demo"
    a, b = summarize(remote), summarize(here)
    assert a.pop("cache") == f"s3://{BUCKET}/demo" and b.pop("cache") == str(local)
    assert a == b
    for sid in (0, 40, 100):
        x, y = remote.sample(sid), here.sample(sid)
        assert torch.equal(x.features, y.features) and (x.input_ids == y.input_ids).all()
    listed.clear()
    assert remote.index_problem is None and verify(CacheReader(f"s3://{BUCKET}/demo")) == []
    assert sorted(listed) == sorted(r.name for r in remote.records)


def test_damage_on_s3_is_found_and_named(s3):
    """A shard object changed (checksum), and one deleted (zarr would read zeros): both are named by
    verify, and a read of the changed one fails naming its segment."""
    fs, local = s3
    fs.copy(f"{BUCKET}/demo", f"{BUCKET}/damaged", recursive=True)
    reader = CacheReader(f"s3://{BUCKET}/damaged")
    first, second = reader.records[0].name, reader.records[1].name
    shard = f"{BUCKET}/damaged/segments/{first}/features/c/0/0"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0xFF
    fs.pipe(shard, bytes(data))
    fs.rm(f"{BUCKET}/damaged/segments/{second}/scales/c/0/0")
    reader = CacheReader(f"s3://{BUCKET}/damaged")
    problems = verify(reader)
    assert len(problems) == 2 and problems[0].startswith(f"segment {first}") and second in problems[1], problems
    with pytest.raises(CacheCorruptError, match=first):
        reader.read_segment(first)


def test_a_segment_on_s3_is_fetched_whole_in_one_round_of_requests(s3, monkeypatch):
    """read_segment (what phase 2's prefetch calls) fetches the arrays' metadata and then every object
    the record lists, each in one concurrent `cat`, and never reads through zarr's per-chunk store; the arrays equal the local
    read. An object of another size than the record says is named."""
    from dflash_cache.store.location import RemoteCache

    fs, local = s3
    remote, here = CacheReader(f"s3://{BUCKET}/demo"), CacheReader(local)
    name = remote.records[3].name
    calls = []
    fetch = RemoteCache.fetch_segment
    monkeypatch.setattr(RemoteCache, "fetch_segment", lambda self, *a: calls.append(a[0]) or fetch(self, *a))
    monkeypatch.setattr(RemoteCache, "zarr_store", lambda self, name: pytest.fail("read through zarr's store"))
    # nor one object at a time (a size request, then a read), as the arrays' metadata once was
    monkeypatch.setattr(RemoteCache, "_read", lambda self, *a: pytest.fail("a sequential single-object read"))
    got, want = remote.read_segment(name), here.read_segment(name)
    assert calls == [name] and got.keys() == want.keys()
    assert all((got[k] == want[k]).all() for k in want)
    monkeypatch.undo()
    fs.copy(f"{BUCKET}/demo", f"{BUCKET}/grown", recursive=True)
    shard = f"{BUCKET}/grown/segments/{name}/input_ids/c/0"
    fs.pipe(shard, fs.cat_file(shard) + b"x")
    reader = CacheReader(f"s3://{BUCKET}/grown", check_segment_files=False)
    with pytest.raises(CacheCorruptError, match=f"segment {name}: input_ids/c/0 is .* its record says"):
        reader.read_segment(name)


def test_inspect_and_train_from_s3(s3, tmp_path):
    """The CLI takes the URL where it takes a directory: inspect --verify is clean, --repair is
    refused (read-only), and training reads it to the same losses as from the local copy."""
    from dflash_cache.train.trainer import Trainer
    from tools.make_demo_drafter import demo_train_config

    fs, local = s3
    url = f"s3://{BUCKET}/demo"
    r = CliRunner().invoke(cli, ["inspect", url, "--verify", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["verify"]["ok"], r.output
    r = CliRunner().invoke(cli, ["inspect", url, "--verify", "--repair"])
    assert r.exit_code == 2 and "read-only here" in r.output, r.output
    losses = []
    # batches of 512 tokens (a few samples): each sample read from the bucket is a request per array
    for source, out in ((url, tmp_path / "remote"), (str(local), tmp_path / "local")):
        Trainer.build(demo_train_config(Path(source) if source == str(local) else source, out, max_steps=3,
                                        log_every=1, token_budget=512), device=torch.device("cpu")).fit()
        losses.append([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()])
    assert losses[0] == losses[1] and len(losses[0]) == 3


def test_a_missing_storage_package_or_cache_is_one_line(s3):
    with pytest.raises(UserError, match="does not exist"):
        CacheReader(f"s3://{BUCKET}/nothing-here")
    with pytest.raises(UserError, match="install the package for that storage"):
        CacheReader("gs://bucket/cache")


def test_an_unreadable_commit_record_on_s3_is_named(s3):
    """Records are fetched together; one that is not JSON still stops the reader naming it."""
    fs, _ = s3
    fs.copy(f"{BUCKET}/demo", f"{BUCKET}/bad-record", recursive=True)
    victim = sorted(fs.ls(f"{BUCKET}/bad-record/commits"))[1]
    fs.pipe(victim, b"{not json")
    with pytest.raises(CacheCorruptError, match=f"commit record {victim.rsplit('/', 1)[-1]} is unreadable"):
        CacheReader(f"s3://{BUCKET}/bad-record")


def test_a_request_that_fails_mid_read_is_one_line(s3, monkeypatch):
    """An endpoint lost while training reads (here: every later request refused) stops the read with
    one line naming the URL and what to check, not botocore's traceback; a local file in the place
    of a cache directory is named as a file."""
    from botocore.exceptions import EndpointConnectionError

    url = f"s3://{BUCKET}/demo"
    reader = CacheReader(url)
    name = reader.records[0].name

    def refused(*args, **kwargs):
        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9/caches/demo")

    for method in ("find", "cat", "cat_file", "ls", "exists", "size"):
        monkeypatch.setattr(reader.location.fs, method, refused)
    with pytest.raises(UserError, match=rf"^cannot read the cache at {url}: Could not connect to the endpoint URL: "
                                        r"\"http://127.0.0.1:9/caches/demo\"; check the URL .*AWS_ENDPOINT_URL"):
        reader.read_segment(name)
    _, local = s3
    with pytest.raises(UserError, match=r"manifest.json is a file, not a cache directory; pass the directory"):
        CacheReader(local / "manifest.json")


def test_a_damaged_parquet_on_object_storage_is_damage_not_a_storage_failure():
    """Only fetching is a request: a file that arrives whole but does not parse must reach the
    callers that name it as damaged (and rebuild the index), not the 'check the URL' line."""
    import fsspec
    import pyarrow as pa

    from dflash_cache.store.location import RemoteCache

    damaged = b"PAR1" + b"\x07" * 20 + (10).to_bytes(4, "little") + b"PAR1"  # a footer that does not parse: OSError
    fsspec.filesystem("memory").pipe("/damaged-bucket/c/index.parquet", damaged)
    location = RemoteCache("memory://damaged-bucket/c")
    with pytest.raises((OSError, pa.ArrowException)) as e:
        location.parquet("index.parquet", 1 << 20)
    assert not isinstance(e.value, UserError), e.value
    assert location.parquet("plan.parquet", 1 << 20) is None


def _failing_requests(monkeypatch, key_end: str, failure: BaseException) -> None:
    """Every request for an object whose key ends with `key_end` fails with `failure` (the rest reach
    the server): how s3fs reports a timeout, a refused connection, a refusal or a 5xx after its retries."""
    import s3fs

    fetch = s3fs.S3FileSystem._cat_file

    async def cat_file(self, path, *args, **kwargs):
        if path.endswith(key_end):
            raise failure
        return await fetch(self, path, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_cat_file", cat_file)


FAILED_REQUESTS = {
    "timeout": TimeoutError("Read timeout on endpoint URL"),
    "refused": ConnectionRefusedError(111, "Connection refused"),
    "forbidden": PermissionError("Access Denied"),
    "server error": OSError(5, "We encountered an internal error. Please try again."),
}


@pytest.mark.parametrize("failure", FAILED_REQUESTS.values(), ids=FAILED_REQUESTS.keys())
def test_an_object_that_cannot_be_fetched_is_a_storage_failure_not_damage(s3, monkeypatch, failure):
    """One shard object whose request fails: reading the segment (as verify does) stops with the
    storage's one line, not CacheCorruptError; `inspect --verify` exits 2 with that line and reports
    no damage, so it sends nobody to repair a sound cache."""
    url = f"s3://{BUCKET}/demo"
    name = CacheReader(url).records[2].name
    _failing_requests(monkeypatch, f"/segments/{name}/features/c/0/0", failure)
    storage_line = rf"^cannot read the cache at {url}: .+; check the URL .*AWS_ENDPOINT_URL\), then run the same"
    for read in (lambda: CacheReader(url).read_segment(name), lambda: verify(CacheReader(url))):
        with pytest.raises(UserError, match=storage_line) as e:
            read()
        assert not isinstance(e.value, CacheCorruptError) and "\n" not in str(e.value)
    r = CliRunner().invoke(cli, ["inspect", url, "--verify"])
    assert r.exit_code == 2, r.output
    assert r.output.splitlines()[-1].startswith(f"Error: cannot read the cache at {url}: "), r.output
    assert "damaged" not in r.output and "repair" not in r.output, r.output


def test_an_object_gone_when_fetched_is_still_damage(s3, monkeypatch):
    """The other side of the line: an object listed but missing when fetched (NoSuchKey) is damage,
    named with its segment, and verify reports it as such."""
    url = f"s3://{BUCKET}/demo"
    name = CacheReader(url).records[2].name
    _failing_requests(monkeypatch, f"/segments/{name}/features/c/0/0", FileNotFoundError("The specified key does "
                                                                                           "not exist."))
    with pytest.raises(CacheCorruptError, match=rf"segment {name}: features/c/0/0 cannot be read"):
        CacheReader(url).read_segment(name)
    problems = verify(CacheReader(url))
    assert len(problems) == 1 and problems[0].startswith(f"segment {name}"), problems


@pytest.mark.parametrize("key", ["commits/{name}.json", "segments/{name}/features/zarr.json"])
def test_a_record_or_array_metadata_that_cannot_be_fetched_is_a_storage_failure(s3, monkeypatch, key):
    """The JSON objects fetched together (commit records when the cache opens, an array's metadata
    when its segment is checked) are held to the same line: a failed request is not an 'unreadable'
    record or 'damaged' segment."""
    url = f"s3://{BUCKET}/demo"
    name = CacheReader(url).records[1].name
    _failing_requests(monkeypatch, key.format(name=name), TimeoutError("Read timeout on endpoint URL"))
    with pytest.raises(UserError, match=rf"^cannot read the cache at {url}: Read timeout") as e:
        CacheReader(url).check_segment(CacheReader(url).record(name))
    assert not isinstance(e.value, CacheCorruptError)


def test_training_stops_on_an_object_it_cannot_fetch(s3, tmp_path, monkeypatch):
    """Training from the bucket stops with the storage's line when a request fails: it neither reads on
    without the segment nor calls the cache damaged."""
    from dflash_cache.train.trainer import Trainer
    from tools.make_demo_drafter import demo_train_config

    url = f"s3://{BUCKET}/demo"
    _failing_requests(monkeypatch, "/features/zarr.json", PermissionError("Access Denied"))
    with pytest.raises(UserError, match=rf"^cannot read the cache at {url}: Access Denied") as e:
        Trainer.build(demo_train_config(url, tmp_path / "run", max_steps=3, log_every=1),
                      device=torch.device("cpu")).fit()
    assert not isinstance(e.value, CacheCorruptError)
