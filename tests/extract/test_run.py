"""End-to-end extraction on the CPU: resume, crashes, refusals, bad input."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from dflash_cache.cli import cli
from dflash_cache.extract.job import open_or_create, plan_job
from dflash_cache.extract.run import extract, run_rank
from dflash_cache.store.layout import segment_name
from dflash_cache.store.lock import CacheLock
from dflash_cache.store.manifest import read_manifest
from dflash_cache.store.plan import deal, read_plan
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.report import verify
from dflash_cache.store.segments import read_records
from tests.conftest import REPO, extract_config, random_rows, torchrun_cli, wait_for_commits

if TYPE_CHECKING:
    from click.testing import Result

SMALL = ["--model", "tiny", "--gpus", "cpu", "--token-budget", "1024", "--max-rows", "8", "--unit-rows", "16",
         "--buckets", "0,32,64", "--no-progress", "--writers", "2"]


def run_cli(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def sample_ids(root: Path) -> list[int]:
    return sorted(s for r in read_records(root) for s in r.sample_ids)


def assert_nothing_written(out: Path) -> None:
    """A refused run leaves `out` as it found it: missing, or holding at most the lock file that the
    test itself held (no manifest, no commits, no directory or file of its own)."""
    from dflash_cache.store.layout import LOCK_FILE

    left = sorted(str(p.relative_to(out)) for p in out.rglob("*")) if out.exists() else []
    assert left in ([], [LOCK_FILE]), f"the refused run wrote {left}"


@pytest.fixture(scope="module")
def extracted(small_parquet: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Result]:
    """small_parquet extracted once by the CLI with SMALL, and what it said: shared by the tests that
    only read that cache or resume it as a no-op (which that test asserts), one extraction for all."""
    out = tmp_path_factory.mktemp("extracted") / "c"
    return out, run_cli("extract", "--data", str(small_parquet), "--out", str(out), *SMALL)


@pytest.fixture
def few_rows(tmp_path: Path) -> Path:
    """8 rows (3 segments under SMALL): for tests whose assertions hold for any data, so that the
    extractions they run to the end are short."""
    path = tmp_path / "few.parquet"
    pq.write_table(random_rows(8), path)
    return path


def test_extract_then_resume_is_a_no_op(small_parquet, extracted):
    out, r = extracted
    assert r.exit_code == 0, r.output
    assert "Batches per epoch:" in r.output and "complete:" in r.output
    first = {p.name: p.stat().st_mtime_ns for p in (out / "commits").iterdir()}
    r = run_cli("extract", "--data", str(small_parquet), "--out", str(out), *SMALL)
    assert r.exit_code == 0 and f"{len(first)} of {len(first)} segments already committed; 0 to extract" in r.output
    assert {p.name: p.stat().st_mtime_ns for p in (out / "commits").iterdir()} == first
    assert sample_ids(out) == list(range(48))


@pytest.fixture(scope="module")
def half_extracted(small_parquet: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cache a 2-way run on small_parquet leaves when rank 0 finishes and rank 1 never runs (as a
    killed run would): made once, each test resumes a copy of its own."""
    job = plan_job(extract_config(small_parquet, tmp_path_factory.mktemp("half") / "c"))
    with CacheLock(job.root):
        committed = open_or_create(job)
        run_rank(job, committed, rank=0, world=2, device=torch.device("cpu"))
    return job.root


def test_resume_with_another_rank_count(small_parquet, tmp_path, half_extracted):
    """Rank 0 of a 2-way run finishes, rank 1 never runs; a 1-way resume does exactly the rest."""
    cfg = extract_config(small_parquet, shutil.copytree(half_extracted, tmp_path / "c"))
    job = plan_job(cfg)
    half = sample_ids(job.root)
    assert 0 < len(half) < 48
    assert {r.name for r in read_records(job.root)} == {segment_name(b.unit, b.batch)
                                                        for b in deal(job.plan.batches, 2)[0]}
    extract(cfg, "cpu", echo=lambda *_: None)
    assert sample_ids(job.root) == list(range(48))
    assert not verify(CacheReader(job.root))


# `dflash-cache ARGS` whose array writes crawl (0.5 s each) once 5 segments are committed: a test
# waiting for those 5 always finds the run going, however starved of CPU, and kills it mid-segment.
SLOW_AFTER_5 = """
import sys, time
from pathlib import Path
import dflash_cache.store.writer as writer
real, commits = writer.write_array, Path(sys.argv[sys.argv.index("--out") + 1]) / "commits"
def slow(*args, **kwargs):
    time.sleep(0.5 if len(list(commits.glob("*.json"))) >= 5 else 0)
    return real(*args, **kwargs)
writer.write_array = slow
from dflash_cache.cli import cli
cli(sys.argv[1:])
"""


def test_sigkill_then_resume_gives_exact_sample_set(tmp_path):
    """32 rows, 12 segments: the run is killed after 5, the resume (in this process) does the rest."""
    data = tmp_path / "big.parquet"
    pq.write_table(random_rows(32, seed=1, lo=8, hi=64), data, row_group_size=20)
    out = tmp_path / "c"
    args = ["extract", "--data", str(data), "--out", str(out), *SMALL, "--token-budget", "128", "--writers", "1"]
    proc = subprocess.Popen([sys.executable, "-c", SLOW_AFTER_5, *args], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_for_commits(proc, out, 5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = sample_ids(out)
    assert 0 < len(partial) < 32 and len(partial) == len(set(partial))
    assert not verify(CacheReader(out)), "a killed run must leave only whole, committed segments visible"
    done = CliRunner().invoke(cli, args)  # the resume in this process: one interpreter start less
    assert done.exit_code == 0, done.output
    assert sample_ids(out) == list(range(32))
    reader = CacheReader(out)
    assert reader.complete and not verify(reader)


def _bad(tmp_path: Path, table: pa.Table) -> Path:
    path = tmp_path / "bad.parquet"
    pq.write_table(table, path)
    return path


BAD_INPUTS = {
    "missing loss_mask": (pa.table({"input_ids": [[1, 2, 3]]}), "loss_mask"),
    "unknown columns": (pa.table({"tokens": [[1, 2]], "text": ["x"]}), "input_ids"),
    "wrong type": (pa.table({"input_ids": [["a", "b"]], "loss_mask": [[0, 1]]}), "input_ids"),
    "empty row": (pa.table({"input_ids": [[1, 2], []], "loss_mask": [[0, 1], []]}), "empty"),
    "length mismatch": (pa.table({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1]]}), "length"),
    "id outside vocab": (pa.table({"input_ids": [[1, 5000]], "loss_mask": [[0, 1]]}), "5000"),
    "no supervised token": (pa.table({"input_ids": [[1, 2], [3]], "labels": [[-100, -100], [-100]]}),
                            "no supervised token in any row (every label is -100)"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, case):
    table, needle = BAD_INPUTS[case]
    out = tmp_path / "c"
    r = CliRunner().invoke(cli, ["extract", "--data", str(_bad(tmp_path, table)), "--out", str(out), *SMALL])
    assert r.exit_code == 2, r.output
    error_lines = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(error_lines) == 1 and needle in error_lines[0], r.output
    assert "Traceback" not in r.output
    assert_nothing_written(out)


def test_unreadable_path_exits_2(tmp_path):
    r = CliRunner().invoke(cli, ["extract", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "c"), *SMALL])
    assert r.exit_code == 2 and "does not exist" in r.output


def test_existing_cache_made_differently_is_refused(few_rows, tmp_path):
    out = tmp_path / "c"
    assert run_cli("extract", "--data", str(few_rows), "--out", str(out), *SMALL).exit_code == 0
    for extra, field in ((["--codec", "fp8"], "codec"), (["--layers", "1,2"], "layer_ids"),
                         (["--dtype", "float32"], "target.dtype")):
        r = CliRunner().invoke(cli, ["extract", "--data", str(few_rows), "--out", str(out), *SMALL, *extra])
        assert r.exit_code == 2 and field in r.output and "--overwrite" in r.output, r.output
    r = run_cli("extract", "--data", str(few_rows), "--out", str(out), *SMALL, "--codec", "fp8", "--overwrite")
    assert r.exit_code == 0
    assert json.loads((out / "manifest.json").read_text())["codec"] == "fp8"
    assert sample_ids(out) == list(range(8))


def test_second_extract_into_same_cache_is_refused(small_parquet, tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    with CacheLock(out):
        r = CliRunner().invoke(cli, ["extract", "--data", str(small_parquet), "--out", str(out), *SMALL])
    assert r.exit_code == 2 and "being written" in r.output
    assert_nothing_written(out)


def test_non_cache_directory_is_not_clobbered(small_parquet, tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    r = CliRunner().invoke(cli, ["extract", "--data", str(small_parquet), "--out", str(out), *SMALL, "--overwrite"])
    assert r.exit_code == 2 and "not a dflash-cache" in r.output
    assert (out / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"], "the refused run's .lock stayed behind"


def test_full_disk_exits_2_and_commits_nothing_partial(tmp_path, monkeypatch):
    """16 rows, 3 segments of 5 arrays, written in order by the one writer: 2 are committed, the
    disk fills at the third array of the last."""
    import dflash_cache.store.writer as segments

    real = segments.write_array
    calls = {"n": 0}

    def failing(store, name, data, compressors):
        calls["n"] += 1
        if calls["n"] > 12:  # a few segments succeed, then the disk fills mid-segment
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(store, name, data, compressors)

    data = tmp_path / "d.parquet"
    pq.write_table(random_rows(16, seed=3), data)
    monkeypatch.setattr(segments, "write_array", failing)
    out = tmp_path / "c"
    r = CliRunner().invoke(cli, ["extract", "--data", str(data), "--out", str(out), *SMALL, "--writers", "1"])
    assert r.exit_code == 2 and "disk full" in r.output, r.output
    committed = read_records(out)
    assert 0 < len(committed) < 12
    assert not verify(CacheReader(out))
    monkeypatch.setattr(segments, "write_array", real)
    assert run_cli("extract", "--data", str(data), "--out", str(out), *SMALL).exit_code == 0
    assert sample_ids(out) == list(range(16))


def test_torchrun_two_cpu_ranks(small_parquet, tmp_path):
    out = tmp_path / "c"
    torchrun_cli("extract", "--data", str(small_parquet), "--out", str(out), *SMALL, timeout=300)
    records = read_records(out)
    assert {r.rank for r in records} == {0, 1}
    assert sample_ids(out) == list(range(48))
    assert not verify(CacheReader(out))
    plan = read_plan(out, read_manifest(out))
    dealt = {segment_name(b.unit, b.batch): rank for rank, share in enumerate(deal(plan.batches, 2)) for b in share}
    assert all(dealt[r.name] == r.rank for r in records)


def test_packing_drops_and_adds_no_token(small_parquet, extracted):
    """Every committed sample holds exactly its dataset row: same ids, same mask, same length."""
    reader = CacheReader(extracted[0])
    table = pq.read_table(small_parquet)
    ids, masks = table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()
    assert reader.num_tokens == sum(len(x) for x in ids)
    assert reader.num_supervised == sum(sum(m) for m in masks)
    for _, arrays in reader.iter_segments():
        offsets = arrays["offsets"]
        assert len(arrays["features"]) == offsets[-1] == len(arrays["input_ids"])
        for i, sid in enumerate(arrays["sample_ids"]):
            lo, hi = offsets[i], offsets[i + 1]
            assert arrays["input_ids"][lo:hi].tolist() == ids[sid]
            assert arrays["loss_mask"][lo:hi].tolist() == masks[sid]


class Killed(BaseException):
    """Stands in for SIGKILL: nothing in the code under test catches it."""


def _same_cache(a: Path, b: Path) -> None:
    ra, rb = CacheReader(a), CacheReader(b)
    assert [r.to_json() for r in ra.records] == [r.to_json() for r in rb.records]
    for rec in ra.records:
        sa, sb = ra.read_segment(rec.name), rb.read_segment(rec.name)
        assert sa.keys() == sb.keys() and all(np.array_equal(sa[k], sb[k]) for k in sa)


def _killed_at_creation(data: Path, out: Path, monkeypatch) -> None:
    """Run extract into `out` and 'kill' it after zarr.json and plan.parquet, before manifest.json."""
    import dflash_cache.store.writer as prepare

    def killed(*_a):
        raise Killed

    with monkeypatch.context() as m:
        m.setattr(prepare, "write_manifest", killed)
        with pytest.raises(Killed):
            extract(extract_config(data, out), "cpu", echo=lambda *_: None)
    assert (out / "zarr.json").is_file() and (out / "plan.parquet").is_file() and not (out / "manifest.json").exists()


def test_killed_at_creation_then_rerun_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    """Both a plain rerun and --overwrite used to say 'exists and is not a dflash-cache', forever."""
    data = tmp_path / "d.parquet"
    pq.write_table(random_rows(16, seed=3), data)
    out = tmp_path / "c"
    _killed_at_creation(data, out, monkeypatch)
    r = run_cli("extract", "--data", str(data), "--out", str(out), *SMALL)
    assert r.exit_code == 0 and "0 of 3 segments already committed" in r.output and "complete: 3/3" in r.output, r.output
    assert sorted(p.name for p in out.iterdir()) == [".lock", "commits", "index.parquet", "manifest.json",
                                                     "plan.parquet", "segments", "zarr.json"]
    extract(extract_config(data, tmp_path / "clean"), "cpu", echo=lambda *_: None)
    _same_cache(out, tmp_path / "clean")
    _killed_at_creation(data, tmp_path / "again", monkeypatch)
    r = run_cli("extract", "--data", str(data), "--out", str(tmp_path / "again"), *SMALL, "--overwrite")
    assert r.exit_code == 0 and "complete: 3/3" in r.output, r.output


@pytest.mark.parametrize("existing", [False, True])
def test_disk_full_at_creation_leaves_nothing(few_rows, tmp_path, monkeypatch, existing):
    """ENOSPC while writing the manifest: one line, exit 2, no traceback, no stray manifest.json.PID.tmp."""
    import dflash_cache.store.writer as prepare

    def disk_full(root, _manifest):
        (root / f"manifest.json.{os.getpid()}.tmp").write_bytes(b"{")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prepare, "write_manifest", disk_full)
    out = tmp_path / "c"
    if existing:
        out.mkdir()
    r = CliRunner().invoke(cli, ["extract", "--data", str(few_rows), "--out", str(out), *SMALL])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.output.strip().splitlines()[-1] == (f"Error: disk full while creating the cache at {out}; free space and "
                                                 "run the same command again (nothing was left behind)")
    assert (list(out.iterdir()) == []) if existing else not out.exists()
    monkeypatch.undo()
    assert run_cli("extract", "--data", str(few_rows), "--out", str(out), *SMALL).exit_code == 0


def test_read_only_out_exits_2_with_one_line(small_parquet, tmp_path, monkeypatch):
    """Tests run as root, so a read-only location is simulated: creating the directory fails with EROFS."""
    real_mkdir = Path.mkdir

    def read_only(self, *a, **k):
        if self.is_relative_to(tmp_path / "ro"):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", read_only)
    out = tmp_path / "ro" / "c"
    r = CliRunner().invoke(cli, ["extract", "--data", str(small_parquet), "--out", str(out), *SMALL])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.output.strip().splitlines()[-1] == (f"Error: cannot write to {out} (Read-only file system); choose a "
                                                 "writable --out with free space")


def test_overlong_row_for_the_target_context_is_refused(tmp_path):
    """The tiny target's context is 8,192 tokens (max_position_embeddings); a 9,000-token row is refused
    without --max-len, and --max-len with --overlong takes it."""
    rows = random_rows(4)
    ids, masks = rows.column("input_ids").to_pylist(), rows.column("loss_mask").to_pylist()
    ids[2], masks[2] = [7] * 9000, [0] * 100 + [1] * 8900
    data = tmp_path / "long.parquet"
    pq.write_table(pa.table({"input_ids": ids, "loss_mask": masks}), data)
    out = tmp_path / "c"
    r = CliRunner().invoke(cli, ["extract", "--data", str(data), "--out", str(out), *SMALL])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.output.strip().splitlines()[-1] == (
        "Error: row 2 of parquet: 1 file has 9,000 tokens, more than the target's context of 8,192 "
        "(max_position_embeddings); pass --max-len 8192 with --overlong truncate or skip")
    assert not out.exists()
    for policy, kept in (("truncate", 8192), ("skip", 0)):
        job = plan_job(extract_config(data, out, max_len=8192, overlong=policy))
        assert job.scan.lengths[2] == kept and not out.exists()


@pytest.mark.parametrize("value", ["abc", "0", "-5"])
def test_bad_profile_interval_env_exits_2_before_writing(small_parquet, tmp_path, monkeypatch, value):
    monkeypatch.setenv("DFLASH_PROFILE_INTERVAL", value)
    out = tmp_path / "c"
    r = CliRunner().invoke(cli, ["extract", "--data", str(small_parquet), "--out", str(out), *SMALL])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.output.strip().splitlines()[-1].startswith(f"Error: DFLASH_PROFILE_INTERVAL='{value}'")
    assert not out.exists()


def test_rank_log_counts_every_segment(small_parquet, tmp_path, caplog):
    """The count was taken after finished writes were dropped from the in-flight list (2 for 12); here 9 are written."""
    caplog.set_level("INFO", logger="dflash_cache.extract.run")
    extract(extract_config(small_parquet, tmp_path / "c", writers=1), "cpu", echo=lambda *_: None)
    assert len(read_records(tmp_path / "c")) == 9
    assert any(m.startswith("rank 0: 9 segments,") for m in caplog.messages), caplog.messages


@pytest.mark.filterwarnings("ignore:Object at .* is not recognized as a component of a Zarr hierarchy")
def test_segments_is_a_zarr_group_and_old_caches_still_resume(small_parquet, tmp_path, half_extracted):
    import zarr
    from zarr.storage import LocalStore

    out = shutil.copytree(half_extracted, tmp_path / "c")  # half of it, as a killed run would leave it
    cfg = extract_config(small_parquet, out)
    names = {r.name for r in read_records(out)}
    found = {k for k, _ in zarr.open_group(LocalStore(out, read_only=True), mode="r").members(max_depth=None)}
    assert "segments" in found and {f"segments/{n}" for n in names} <= found
    assert {f"segments/{n}/features" for n in names} <= found
    (out / "segments" / "zarr.json").unlink()  # a cache made before segments/ was a group
    assert CacheReader(out).records
    extract(cfg, "cpu", echo=lambda *_: None)
    assert (out / "segments" / "zarr.json").is_file() and sample_ids(out) == list(range(48))
    assert not verify(CacheReader(out))
