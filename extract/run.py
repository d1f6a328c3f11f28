"""Running an extraction: one process per GPU, or torchrun ranks, or the CPU.

`extract(cfg, gpus)` validates and plans once, takes the cache lock, creates or reopens the
cache, then runs the missing segments: in this process (CPU or one GPU) or in one worker process
per GPU (`python -m dflash_cache.extract.worker`, one CUDA device each). Under torchrun every rank runs this
same function; rank 0 plans and commits the manifest while the others wait at a barrier.
Whichever way it ran, the index is rewritten at the end from the commits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dflash_cache.errors import UserError
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.extract.job import Job, open_data, open_or_create, plan_job
from dflash_cache.extract.pipeline import RankExtractor
from dflash_cache.extract.target import describe_target, load_target
from dflash_cache.profiler import StageProfiler, interval_from_env
from dflash_cache.store.lock import CacheLock
from dflash_cache.store.manifest import read_manifest
from dflash_cache.store.plan import read_plan
from dflash_cache.store.reader import write_index
from dflash_cache.store.segments import read_records, segment_name

log = logging.getLogger(__name__)
WORKER_CONFIG_ENV = "DFLASH_EXTRACT_CONFIG"


def parse_gpus(spec: str, flag: str = "--gpus") -> list[int] | None:
    """'cpu' -> None; 'all' -> every visible GPU (None if there is none); '0,2,3' -> [0, 2, 3]."""
    spec = spec.strip().lower()
    if spec == "cpu":
        return None
    if spec == "all":
        n = torch.cuda.device_count()
        if n == 0:
            log.warning("%s all: no CUDA device visible, running on the CPU", flag)
            return None
        return list(range(n))
    try:
        ids = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} {spec!r}: expected 'all', 'cpu' or comma-separated GPU indices like 0,2,3") from None
    n = torch.cuda.device_count()
    if n == 0:
        raise UserError(f"{flag} {spec!r}: no CUDA device is visible; use {flag} cpu")
    bad = [i for i in ids if not 0 <= i < n]
    if not ids or bad:
        raise UserError(f"{flag} {spec!r}: {n} CUDA device(s) visible, so valid indices are 0..{n - 1}")
    return ids


def torchrun_env() -> tuple[int, int] | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def extract(cfg: ExtractConfig, gpus: str = "all", echo: Callable[[str], None] = log.info) -> None:
    """The whole job. `echo` shows the plan and the result (logged by default; the CLI passes click.echo)."""
    dist = torchrun_env()
    if dist is not None and dist[1] > 1:
        return _extract_torchrun(cfg, *dist, echo=echo)
    devices = parse_gpus(gpus)
    job = plan_job(cfg)
    echo(job.plan.summary())
    with CacheLock(job.root):
        committed = open_or_create(job)
        todo = sum(segment_name(b.unit, b.batch) not in committed for b in job.plan.batches)
        echo(f"{len(committed)} of {len(job.plan.batches)} segments already committed; {todo} to extract")
        t0 = time.perf_counter()
        if devices is None or len(devices) == 1:
            device = torch.device("cpu") if devices is None else torch.device("cuda", devices[0])
            run_rank(job, committed, rank=0, world=1, device=device)
        else:
            _spawn_workers(cfg, devices)
        finish_cache(job.root, echo, time.perf_counter() - t0)


def run_rank(job: Job, committed: set[str], *, rank: int, world: int, device: torch.device) -> None:
    cfg = job.config
    batches = [b for b in job.plan.for_rank(rank, world) if segment_name(b.unit, b.batch) not in committed]
    if not batches:
        log.info("rank %d: nothing to do", rank)
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = load_target(job.target, device)
    profiler = StageProfiler(interval_from_env(cfg.profile_interval), prefix=f"[rank {rank}] ")
    extractor = RankExtractor(
        root=job.root, dataset=job.dataset, model=model, layer_ids=job.target.layer_ids, codec=cfg.codec,
        device=device, rank=rank, writers=cfg.writers, prefetch=cfg.prefetch, unit_rows=cfg.plan.unit_rows,
        max_len=cfg.max_len, overlong=cfg.overlong, profiler=profiler, progress=cfg.progress and rank == 0,
    )
    result = extractor.run(batches)
    log.info("rank %d: %d segments, %d tokens in %.1fs (%.0f tok/s)", rank, result.segments, result.tokens,
             result.seconds, result.tokens / max(result.seconds, 1e-9))


def worker_job(cfg: ExtractConfig) -> Job:
    """The job as a worker sees it: the plan comes from the cache the parent created."""
    root = Path(cfg.out)
    manifest = read_manifest(root)
    return Job(cfg, describe_target(cfg.target), open_data(cfg.data, cfg.limit), None, read_plan(root, manifest), manifest)


def _spawn_workers(cfg: ExtractConfig, devices: list[int]) -> None:
    procs = []
    for rank, gpu in enumerate(devices):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), WORKER_CONFIG_ENV: cfg.to_json(),
               "DFLASH_RANK": str(rank), "DFLASH_WORLD_SIZE": str(len(devices))}
        procs.append(subprocess.Popen([sys.executable, "-m", "dflash_cache.extract.worker"], env=env))
    failed = None
    try:
        while any(p.poll() is None for p in procs):
            for rank, p in enumerate(procs):
                if p.poll() not in (None, 0) and failed is None:
                    failed = (rank, p.returncode)
                    for q in procs:
                        q.poll() is None and q.terminate()
            time.sleep(0.2)
        for rank, p in enumerate(procs):
            if p.returncode != 0 and failed is None:
                failed = (rank, p.returncode)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if failed:
        rank, code = failed
        raise UserError(f"extraction worker for GPU {devices[rank]} (rank {rank}) failed with exit status "
                        f"{code}; see its message above; run again to resume")


def _extract_torchrun(cfg: ExtractConfig, rank: int, world: int, echo) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    with contextlib.ExitStack() as stack:  # unwinds with the exception, so a refused run's lock file goes
        stack.callback(dist.destroy_process_group)
        error = None
        if rank == 0:
            try:
                job = plan_job(cfg)
                echo(job.plan.summary())
                stack.enter_context(CacheLock(Path(cfg.out)))
                open_or_create(job)
            except UserError as e:
                error = str(e)
        msg = [error]
        dist.broadcast_object_list(msg, src=0)
        if msg[0] is not None:
            raise UserError(msg[0])
        job = worker_job(cfg)
        committed = {r.name for r in read_records(job.root)}
        t0 = time.perf_counter()
        run_rank(job, committed, rank=rank, world=world, device=device)
        dist.barrier()
        if rank == 0:
            finish_cache(job.root, echo, time.perf_counter() - t0)


def finish_cache(root: Path, echo: Callable[[str], None], seconds: float) -> None:
    """Rewrite the index from the commits and report how complete the cache is."""
    records = read_records(root)
    write_index(root, records)
    manifest = read_manifest(root)
    tokens = sum(r.num_tokens for r in records)
    done = len(records) == manifest.plan.num_segments
    echo(f"{'complete' if done else 'INCOMPLETE'}: {len(records)}/{manifest.plan.num_segments} segments, "
         f"{tokens:,} tokens committed; this run took {seconds:.1f}s")
