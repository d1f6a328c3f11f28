"""Shared fixtures: small tokenized datasets on disk and a helper to run extraction in-process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_cache.extract.config import ExtractConfig
from dflash_cache.store.plan import PlanConfig
from dflash_cache.target.spec import TargetSpec


def pytest_configure(config: pytest.Config) -> None:
    """Torch on one intra-op thread, here and in every process the tests start (OMP_NUM_THREADS is
    inherited; set it to choose another count). The tiny models' ops last microseconds to
    milliseconds, too short to gain from a second thread, while OpenMP threads spin waiting for work:
    with anything else busy on a 2-core machine (the pipeline's own reader and writer threads, another
    process or test worker) they run ten to twenty times slower than on one thread, which is as fast
    when alone. Extraction ranks choose their own count (dflash_cache/launch.py).

    torch takes the count when it is imported, which here comes later, with the first test module:
    this file imports no torch, so that xdist's controller, which runs no test, starts its workers
    without loading it first."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:  # loaded already (a plugin): tell it
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


REPO = Path(__file__).resolve().parents[1]
SMALL_PLAN = PlanConfig(token_budget=1024, max_rows=8, unit_rows=16, bucket_bounds=(0, 32, 64))


def random_rows(n: int, seed: int = 0, vocab: int = 2048, lo: int = 8, hi: int = 96) -> pa.Table:
    rng = np.random.default_rng(seed)
    ids, masks = [], []
    for _ in range(n):
        length = int(rng.integers(lo, hi))
        ids.append(rng.integers(0, vocab, size=length).tolist())
        prompt = int(rng.integers(1, length))
        masks.append([0] * prompt + [1] * (length - prompt))
    return pa.table({"input_ids": ids, "loss_mask": masks})


@pytest.fixture(scope="session")
def small_parquet(tmp_path_factory) -> Path:
    """48 random rows of 8..95 tokens: several units, buckets and batches under SMALL_PLAN."""
    path = tmp_path_factory.mktemp("data") / "small.parquet"
    pq.write_table(random_rows(48), path, row_group_size=10)
    return path


# What the launched CPU ranks of the tests import: the trainer, the target's model code, and the
# test modules whose functions ranks run.
RANK_MODULES = ("dflash_cache.train.ranks", "dflash_cache.train.trainer", "dflash_cache.extract.run",
                "transformers.modeling_utils", "transformers.models.qwen3.modeling_qwen3",
                "tests.dflash_cache.test_launch", "tests.extract.test_launch")


@pytest.fixture(scope="session")
def preloaded_ranks() -> None:
    """This test process's server of CPU ranks, started with every module its ranks import: a worker
    runs launches of several kinds, and the server keeps what its first launch loaded, so each rank
    of a later kind would import the trainer or the target afresh (2-2.5 s of CPU each)."""
    from dflash_cache.launch import preload_cpu_ranks

    preload_cpu_ranks(RANK_MODULES)


def extract_config(data: Path | str, out: Path, **overrides) -> ExtractConfig:
    target = overrides.pop("target", TargetSpec(model="tiny"))
    base = dict(target=target, data=str(data), out=str(out), codec="bf16", plan=SMALL_PLAN, writers=2,
                progress=False)
    base.update(overrides)
    return ExtractConfig(**base)


def torchrun_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`dflash-cache ARGS` under torchrun on two CPU ranks, from the repository root; asserts that it
    succeeded, and returns it (stdout holds what the ranks' commands printed). --standalone: the
    rendezvous binds a free port of its own, so runs that overlap (test workers) can never meet on
    one, as ports derived from process ids could."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "dflash_cache.cli", *args]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def wait_for_commits(proc: subprocess.Popen, out: Path, count: int, timeout: float = 120) -> None:
    """Wait until the extraction `proc` writing `out` has committed `count` segments, and insist
    that it is still running then (a test that stops it mid-way needs it to be)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if (out / "commits").is_dir() and len(list((out / "commits").glob("*.json"))) >= count:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "extraction finished before it could be stopped; make the job bigger"
