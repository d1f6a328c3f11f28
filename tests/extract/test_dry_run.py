"""`extract --dry-run`: plans and measures a sample without writing to --out, and predicts the cache."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from click.testing import CliRunner

from dflash_cache.cli import cli
from dflash_cache.extract.dry_run import Estimate, dry_run, report_lines, sample_batches
from dflash_cache.extract.job import open_or_create, plan_job
from dflash_cache.extract.run import extract, run_rank
from dflash_cache.store.lock import CacheLock
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.segments import read_records
from tests.conftest import extract_config
from tests.extract.test_run import SMALL

CPU = torch.device("cpu")


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root` with its size and modification time: what "untouched" compares."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def dry_run_cli(data: Path, out: Path, *extra: str):
    return CliRunner().invoke(cli, ["extract", "--data", str(data), "--out", str(out), *SMALL, "--dry-run", *extra])


def test_dry_run_prints_the_plan_size_and_time_and_writes_nothing(small_parquet, tmp_path):
    out = tmp_path / "new" / "c"
    r = dry_run_cli(small_parquet, out)
    assert r.exit_code == 0, r.output
    for text in ("Batches per epoch:", "No cache at", "Expected cache size:", "Expected extraction time:",
                 "Free space for"):
        assert text in r.output
    assert "WARNING" not in r.output
    assert not (tmp_path / "new").exists()


def test_predicted_size_is_close_to_the_real_cache(small_parquet, tmp_path):
    cfg = extract_config(small_parquet, tmp_path / "c")
    est = dry_run(cfg, [CPU], echo=lambda *_: None)
    assert not Path(cfg.out).exists()
    extract(cfg, "cpu", echo=lambda *_: None)
    real = CacheReader(cfg.out).bytes_on_disk()
    assert abs(est.total_bytes - real) / real < 0.25, (est.total_bytes, real)
    assert est.to_write_bytes == est.total_bytes and est.seconds > 0 and est.load_seconds > 0


def test_dry_run_on_a_partial_cache_reads_it_and_touches_nothing(small_parquet, tmp_path):
    cfg = extract_config(small_parquet, tmp_path / "c")
    job = plan_job(cfg)
    with CacheLock(job.root):
        run_rank(job, open_or_create(job), rank=0, world=2, device=CPU)  # about half the segments
    done = len(read_records(job.root))
    before = snapshot(job.root)
    r = dry_run_cli(small_parquet, job.root)
    assert r.exit_code == 0, r.output
    total = len(job.plan.batches)
    assert f"{done} of {total} segments already committed; {total - done} to extract" in r.output
    assert snapshot(job.root) == before  # no lock file, no .creating, no segment

    est = dry_run(cfg, [CPU], echo=lambda *_: None)
    assert 0 < est.to_write_bytes < est.total_bytes

    # what a real run refuses, a dry run refuses too, in one line after the plan (as a real run does)
    r = dry_run_cli(small_parquet, job.root, "--codec", "fp8")
    last = r.output.strip().splitlines()[-1]
    assert r.exit_code == 2 and last.startswith("Error: cache") and "was made differently: codec" in last
    assert r.output.count("Error:") == 1
    assert snapshot(job.root) == before


def test_bad_options_are_one_line_errors(small_parquet, tmp_path):
    out = tmp_path / "c"
    for extra, says in ((["--gpus", "x"], "--gpus 'x'"), (["--buckets", "5,3"], "--buckets 5,3")):
        r = dry_run_cli(small_parquet, out, *extra)
        assert r.exit_code == 2 and says in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not out.exists()


def test_a_disk_too_small_is_a_warning_line():
    est = Estimate(total_bytes=3 << 30, to_write_bytes=2 << 30, bytes_per_token=1000.0, raw_bytes_per_token=1285,
                   seconds=4000.0, load_seconds=2.0, free_bytes=1 << 30)
    lines = report_lines(est, 2, Path("/cache/q8"))
    assert any(line.startswith("WARNING: the cache needs 2.0 GiB more but only 1.0 GiB") for line in lines)
    assert "1h 06m on 2 device(s)" in lines[1] and "linear scaling" in lines[1]
    assert not any("WARNING" in line for line in report_lines(replace(est, free_bytes=3 << 30), 2, Path("/c")))


def test_the_sample_is_one_batch_per_bucket_under_the_token_bound(small_parquet, tmp_path):
    plan = plan_job(extract_config(small_parquet, tmp_path / "c")).plan
    sample = sample_batches(plan)
    assert sorted(b.bucket for b in sample) == sorted({b.bucket for b in plan.batches})
    assert len(sample_batches(plan, max_tokens=1)) == 1


def test_a_directory_that_is_not_a_cache_is_a_warning_and_stays_as_it_is(small_parquet, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    r = dry_run_cli(small_parquet, tmp_path)
    assert r.exit_code == 0 and "is not a dflash-cache: a real run would refuse it" in r.output, r.output
    assert snapshot(tmp_path) == before
