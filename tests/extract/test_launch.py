"""Extraction's ranks on the CPU: started by the launcher (dflash_cache.launch) with gloo, as on GPUs.

Functions a launched rank runs are defined at module level: a rank (forked or spawned) imports them by name.
"""

from __future__ import annotations

import errno
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from dflash_cache.cli import cli
from dflash_cache.errors import UserError
from dflash_cache.extract import run
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.launch import RankFailed, launch
from dflash_cache.store.layout import segment_name
from dflash_cache.store.manifest import read_manifest
from dflash_cache.store.plan import deal, read_plan
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.report import verify
from dflash_cache.store.segments import read_records
from dflash_cache.target.model import TargetSpec
from tests.conftest import extract_config, wait_for_commits
from tests.dflash_cache.test_launch import TWO_CPUS, Echo

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("preloaded_ranks")  # ranks fork from one server holding their modules


def sample_ids(root: Path) -> list[int]:
    return sorted(s for r in read_records(root) for s in r.sample_ids)


def rank_1_out_of_disk(cfg: ExtractConfig, *, device: torch.device, echo: Echo) -> None:
    """An extraction rank whose disk fills after its first segment on rank 1."""
    if os.environ["RANK"] == "1":
        import dflash_cache.store.writer as writer

        real, calls = writer.write_array, itertools.count()

        def failing(*args, **kwargs):
            if next(calls) >= 6:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(*args, **kwargs)

        writer.write_array = failing
    run.extract_rank(cfg, device=device, echo=echo)


def test_two_launched_cpu_ranks_extract_the_exact_cache(small_parquet, tmp_path):
    out = tmp_path / "c"
    said = []
    run.extract_on(extract_config(small_parquet, out), TWO_CPUS, echo=said.append)
    assert said[0].startswith("Batches per epoch: 9")
    assert said[1] == "0 of 9 segments already committed; 9 to extract on 2 ranks"
    assert said[2].startswith("complete: 9/9 segments") and len(said) == 3
    records = read_records(out)
    plan = read_plan(out, read_manifest(out))
    dealt = {segment_name(b.unit, b.batch): rank for rank, share in enumerate(deal(plan.batches, 2)) for b in share}
    assert {r.rank for r in records} == {0, 1} and all(dealt[r.name] == r.rank for r in records)
    assert sample_ids(out) == list(range(48))
    reader = CacheReader(out)
    assert reader.complete and not verify(reader)


def extract_rank_saying_its_shard(cfg: ExtractConfig, *, device: torch.device, echo: Echo) -> None:
    """An extraction rank that says how the target it extracts with holds one MLP matrix."""
    real = run.load_target

    def load_target(*args, **kwargs):
        model = real(*args, **kwargs)
        w = model.model.layers[0].mlp.up_proj.weight
        echo(f"{tuple(w.to_local().shape)} of {tuple(w.shape)}")
        return model

    run.load_target = load_target
    run.extract_rank(cfg, device=device, echo=echo)


def test_two_copies_of_a_target_one_split_over_two_ranks_extract_what_one_process_does(small_parquet, tmp_path,
                                                                                        monkeypatch):
    """--gpus-per-target 2: both ranks hold half of every weight matrix (transformers' tp_plan, over
    gloo here) and run every batch of their copy's share; rank 0 writes. --copy 0/2 so split, then
    1/2 in one process (copies need not be alike): copy 0 leaves exactly its share, copy 1 the
    rest. Same samples as a one-process cache, features equal but for rounding (the partial sums
    meet in another order; float32 compute, bf16 stored), verify clean."""
    single, split = tmp_path / "single", tmp_path / "split"
    fp32 = TargetSpec(model="tiny", dtype="float32")
    run.extract_on(extract_config(small_parquet, single, target=fp32), [torch.device("cpu")], echo=lambda _: None)
    said = []
    first = extract_config(small_parquet, split, target=fp32, gpus_per_target=2, copy="0/2")
    with monkeypatch.context() as m:  # the ranks run the function extract_on finds here
        m.setattr(run, "extract_rank", extract_rank_saying_its_shard)
        run.extract_on(first, TWO_CPUS, echo=said.append)
    assert said.count("(192, 128) of (384, 128)") == 2, "each rank holds half of the MLP's rows"
    share = first.copy_share.names(read_plan(split, read_manifest(split)))
    assert {r.name for r in read_records(split)} == share and 0 < len(share) < 9
    assert said[-1].startswith(f"INCOMPLETE: {len(share)}/9 segments")
    run.extract_on(extract_config(small_parquet, split, target=fp32, copy="1/2"), [torch.device("cpu")],
                   echo=said.append)
    assert f"0 of 9 segments already committed; {len(share)} to extract as copy 0 of 2 on 2 ranks" in said
    assert f"{len(share)} of 9 segments already committed; {9 - len(share)} to extract as copy 1 of 2" in said
    assert said[-1].startswith("complete: 9/9 segments")
    assert {r.rank for r in read_records(split)} == {0}
    a, b = CacheReader(single), CacheReader(split)
    assert b.complete and not verify(b) and sample_ids(split) == sample_ids(single) == list(range(48))
    for sid in (0, 17, 47):
        x, y = a.sample(sid).features.float(), b.sample(sid).features.float()
        assert float((y - x).norm() / x.norm()) < 1e-3


def test_a_later_copy_needs_copy_0s_cache(small_parquet, tmp_path):
    """--copy 1/2 before copy 0 made the cache: one line naming copy 0, nothing left behind; a copy
    other than 0 may not --overwrite; a bad K/C is named."""
    out = tmp_path / "c"
    with pytest.raises(UserError, match=r"holds no cache yet: --copy 0/2 creates it; start that one first"):
        run.extract_on(extract_config(small_parquet, out, copy="1/2"), [torch.device("cpu")])
    assert not out.exists()
    with pytest.raises(UserError, match="only copy 0 .* may start it over"):
        extract_config(small_parquet, out, copy="1/2", overwrite=True)
    for spec in ("2/2", "x", "1/0", "-1/2"):
        with pytest.raises(UserError, match=f"--copy '{spec}'"):
            extract_config(small_parquet, out, copy=spec)


def test_gpus_per_target_needs_exactly_that_many_ranks(small_parquet, tmp_path):
    with pytest.raises(UserError, match=r"--gpus-per-target 2 runs one copy .* needs exactly 2 of them .* got 1"):
        run.extract_on(extract_config(small_parquet, tmp_path / "c", gpus_per_target=2), [torch.device("cpu")])
    with pytest.raises(UserError, match="--dry-run measures the target on one device"):
        extract_config(small_parquet, tmp_path / "c", gpus_per_target=2, dry_run=True)
    assert not (tmp_path / "c").exists()


def test_a_rank_out_of_disk_ends_the_run_in_one_line_and_a_rerun_resumes(small_parquet, tmp_path):
    out = tmp_path / "c"
    cfg = extract_config(small_parquet, out, writers=1)
    with pytest.raises(RankFailed) as failed:
        launch(rank_1_out_of_disk, (cfg,), TWO_CPUS, echo=lambda _: None, crash_hint=run.RESUME_HINT)
    assert str(failed.value).startswith("disk full while writing to") and "\n" not in str(failed.value)
    partial = sample_ids(out)
    assert 0 < len(partial) < 48 and len(partial) == len(set(partial))
    assert not verify(CacheReader(out)), "a stopped rank must leave only whole, committed segments visible"
    run.extract(cfg, "cpu", echo=lambda *_: None)
    assert sample_ids(out) == list(range(48))
    reader = CacheReader(out)
    assert reader.complete and not verify(reader)


def test_bad_data_found_by_rank_0_is_one_error_line_from_the_cli(tmp_path, monkeypatch, capfd):
    data = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1]]}), data)
    monkeypatch.setattr(run, "gpu_devices", lambda _spec: TWO_CPUS)
    out = tmp_path / "c"
    r = CliRunner().invoke(cli, ["extract", "--model", "tiny", "--data", str(data), "--out", str(out), "--gpus", "all"])
    assert r.exit_code == 2, r.output
    assert [line for line in r.output.splitlines() if line.startswith("Error:")] == [r.output.strip()]
    assert "length" in r.output
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    assert not out.exists()


def slow_extract_rank(cfg: ExtractConfig, *, device: torch.device, echo: Echo) -> None:
    """An extraction rank that can be interrupted mid-run: it writes arrays at a walk until two
    segments are committed, then at a crawl, so that a test starved of CPU while it waits for those
    two still finds the run going (CI once saw it finish all nine first), and each rank has
    segments queued behind the one it is writing."""
    import dflash_cache.store.writer as writer

    real = writer.write_array
    commits = Path(cfg.out) / "commits"

    def slow(*args, **kwargs):
        time.sleep(0.5 if len(list(commits.glob("*.json"))) >= 2 else 0.05)
        return real(*args, **kwargs)

    writer.write_array = slow
    run.extract_rank(cfg, device=device, echo=echo)


INTERRUPTIBLE = """
import signal, sys, torch
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if our runner ignores it
from dflash_cache.extract import run
from dflash_cache.extract.config import ExtractConfig
from tests.extract.test_launch import slow_extract_rank
run.gpu_devices = lambda _spec: [torch.device("cpu")] * 2
run.extract_rank = slow_extract_rank
from dflash_cache.cli import cli
cli(sys.argv[1:])
"""


def test_ctrl_c_stops_every_rank_and_a_rerun_resumes(small_parquet, tmp_path):
    out = tmp_path / "c"
    args = ["extract", "--model", "tiny", "--data", str(small_parquet), "--out", str(out), "--token-budget", "1024",
            "--max-rows", "8", "--unit-rows", "16", "--buckets", "0,32,64", "--no-progress", "--writers", "1"]
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTIBLE, *args, "--gpus", "all"], cwd=REPO,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_commits(proc, out, 2)
    before = len(list((out / "commits").glob("*.json")))
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: signal the whole foreground group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err  # as `train` ends on Ctrl-C: one line, not click's bare "Aborted!"
    assert err.rstrip().endswith("Interrupted: the committed segments are kept; run the same command again to "
                                 "finish the rest."), err
    assert "Traceback" not in err, err
    assert _group_ends(proc.pid), "a rank outlived the interrupted run"
    # Each of the 2 ranks finishes the one segment its one writer is writing; the queued ones are dropped.
    assert len(read_records(out)) <= before + 2, (before, len(read_records(out)))
    partial = sample_ids(out)
    assert 0 < len(partial) < 48 and len(partial) == len(set(partial))
    assert not verify(CacheReader(out))
    committed = len(read_records(out))
    r = CliRunner().invoke(cli, [*args, "--gpus", "cpu"], catch_exceptions=False)
    assert r.exit_code == 0 and f"{committed} of 9 segments already committed" in r.output, r.output
    assert sample_ids(out) == list(range(48))
    reader = CacheReader(out)
    assert reader.complete and not verify(reader)


def _group_ends(pgid: int, timeout: float = 10) -> bool:
    """Whether every process of the group has exited within `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False
