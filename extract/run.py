"""Running an extraction: in this process (the CPU or one GPU), or as one rank per GPU.

Every rank runs `extract_rank`, whoever started it: rank 0 validates and plans, takes the cache
lock, creates or reopens the cache and tells the other ranks whether that worked; then each rank
extracts its share of the missing segments (`store.plan.deal`: about the same forward work on
every rank, whatever the size of the data), and rank 0 rewrites the index from the commits.
Several runs may share one cache (`--copy K/C`, one per copy of a target split over GPUs): each
takes its copy's share of the plan first (`Job.todo`).
One device runs it in this process as the only rank. Several (`--gpus all`, `--gpus 0,2,3`) are
started as one rank each by torch's elastic launcher (`dflash_cache.launch`), which gives
them exactly the environment torchrun gives its ranks, so both run the same code. --out may be a
URL (s3://bucket/prefix): the lock is then an object there, and each rank uploads its own segments.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dflash_cache.cpu_threads import use_free_cores
from dflash_cache.data.inputs import open_data
from dflash_cache.devices import gpu_devices, torchrun_device, torchrun_env
from dflash_cache.errors import UserError
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.extract.dry_run import dry_run
from dflash_cache.extract.job import Job, chat_spec, open_or_create, plan_job
from dflash_cache.extract.pipeline import RankExtractor
from dflash_cache.launch import launch
from dflash_cache.profiler import StageProfiler, interval_from_env
from dflash_cache.store.location import open_location
from dflash_cache.store.plan import deal, read_plan
from dflash_cache.store.remote_lock import lock_for
from dflash_cache.store.writer import finish_cache
from dflash_cache.target.model import TargetDescription, describe_target, load_target

log = logging.getLogger(__name__)
RESUME_HINT = "the committed segments are kept: run the same command again to resume"
TARGET_MODULES = ("transformers.modeling_utils",)  # every target model class builds on it: loaded once for CPU ranks


def extract(cfg: ExtractConfig, gpus: str = "all", echo: Callable[[str], None] = log.info) -> None:
    """The whole job. `echo` shows the plan and the result (logged by default; the CLI passes click.echo).

    Under torchrun each rank runs its share; otherwise `gpus` picks the devices. A dry run
    (`cfg.dry_run`) measures a sample on one device and writes nothing to --out."""
    ranks = torchrun_env()
    if cfg.dry_run:
        if ranks is None or ranks[0] == 0:  # under torchrun, rank 0 answers for the world's devices
            devices = gpu_devices(gpus) if ranks is None else [torchrun_device()] * ranks[1]
            use_free_cores(devices[0])  # the sample's rate is measured on it
            dry_run(cfg, devices, echo)
        return
    if ranks is not None and ranks[1] > 1:
        extract_rank(cfg, device=torchrun_device(), echo=echo)
        return
    extract_on(cfg, gpu_devices(gpus), echo)


def extract_on(cfg: ExtractConfig, devices: list[torch.device], echo: Callable[[str], None] = log.info) -> None:
    """Extract on `devices`: one runs in this process, several as one launched rank each (the same
    device may repeat); either way `echo` is called here, in this process."""
    if len(devices) == 1:
        extract_rank(cfg, device=devices[0], echo=echo)
    else:
        launch(extract_rank, (cfg,), devices, echo=echo, crash_hint=RESUME_HINT, preload=TARGET_MODULES)


def extract_rank(cfg: ExtractConfig, *, device: torch.device, echo: Callable[[str], None]) -> None:
    """What every rank runs, as torchrun's environment (RANK, WORLD_SIZE) says; without it, the only rank."""
    rank, world = torchrun_env() or (0, 1)
    use_free_cores(device, share=int(os.environ.get("LOCAL_WORLD_SIZE", world)))  # a host's CPU ranks split its cores
    tensor_parallel = cfg.gpus_per_target > 1
    if tensor_parallel and world != cfg.gpus_per_target:
        raise UserError(f"--gpus-per-target {cfg.gpus_per_target} runs one copy of the target over all the GPUs, so it "
                        f"needs exactly {cfg.gpus_per_target} of them (--gpus or torchrun's ranks), got {world}; "
                        f"for more copies, start one run of {cfg.gpus_per_target} GPUs per copy with --copy K/C")
    with contextlib.ExitStack() as stack:  # unwinds with the exception, so a refused run's lock file goes
        if world > 1:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            # Coordination runs on gloo; a tensor-parallel target's collectives on CUDA tensors need NCCL.
            dist.init_process_group("cpu:gloo,cuda:nccl" if tensor_parallel and device.type == "cuda" else "gloo")
            stack.callback(dist.destroy_process_group)
        job, committed = _open_cache(cfg, rank, world, echo, stack)
        t0 = time.perf_counter()
        run_rank(job, committed, rank=rank, world=world, device=device)
        if world > 1:
            dist.barrier()
        if rank == 0:
            finish_cache(job.root, echo, time.perf_counter() - t0)


def _open_cache(cfg: ExtractConfig, rank: int, world: int, echo: Callable[[str], None],
                stack: contextlib.ExitStack) -> tuple[Job, set[str]]:
    """Rank 0 plans, locks (until `stack` closes) and creates or reopens the cache; the other ranks
    wait for its word, then read the plan from the cache. Returns the job and the committed segments."""
    if rank != 0:
        target = describe_target(cfg.target)  # meanwhile rank 0 plans, which can take a while
        error, committed = _word_of_rank_0(world, None, set())
        if error is not None:
            raise UserError(error)
        return job_from_cache(cfg, target), committed
    try:
        job = plan_job(cfg)
        echo(job.plan.summary())
        stack.enter_context(lock_for(job.root, name=job.lock_name))
        committed = open_or_create(job)
    except UserError as e:
        _word_of_rank_0(world, str(e), set())
        raise
    _word_of_rank_0(world, None, committed)
    todo = len(job.todo(committed))
    share = cfg.copy_share
    echo(f"{len(committed)} of {len(job.plan.batches)} segments already committed; {todo} to extract"
         + (f" as copy {share.index} of {share.count}" if share else "") + (f" on {world} ranks" if world > 1 else ""))
    return job, committed


def _word_of_rank_0(world: int, error: str | None, committed: set[str]) -> tuple[str | None, set[str]]:
    """Rank 0's error message (None if the cache is ready) and the segments committed when it
    opened the cache, as every rank receives them: the work is dealt from that one set, so no
    segment is given to two ranks even if a rank read the commits at another moment."""
    if world == 1:
        return error, committed
    word = [(error, sorted(committed))]
    dist.broadcast_object_list(word, src=0)
    error, names = word[0]
    return error, set(names)


def run_rank(job: Job, committed: set[str], *, rank: int, world: int, device: torch.device) -> None:
    """This rank's share of the missing segments. With --gpus-per-target every rank runs every batch
    (each holds a share of the target's weights) and rank 0 writes."""
    cfg = job.config
    tensor_parallel = cfg.gpus_per_target > 1
    batches = job.todo(committed) if tensor_parallel else deal(job.todo(committed), world)[rank]
    if not batches:
        log.info("rank %d: nothing to do", rank)
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",)) if tensor_parallel else None
    model = load_target(job.target, device, tp_mesh=mesh)
    profiler = StageProfiler(interval_from_env(cfg.profile_interval), prefix=f"[rank {rank}] ")
    extractor = RankExtractor(
        root=job.root, dataset=job.dataset, model=model, layer_ids=job.target.layer_ids, codec=cfg.codec,
        device=device, rank=rank, writers=cfg.writers, prefetch=cfg.prefetch, unit_rows=cfg.plan.unit_rows,
        max_len=cfg.max_len, overlong=cfg.overlong, profiler=profiler, progress=cfg.progress and rank == 0,
        writes=rank == 0 or not tensor_parallel,
    )
    result = extractor.run(batches)
    log.info("rank %d: %d segments, %d tokens in %.1fs (%.0f tok/s)", rank, result.segments, result.tokens,
             result.seconds, result.tokens / max(result.seconds, 1e-9))


def job_from_cache(cfg: ExtractConfig, target: TargetDescription) -> Job:
    """The job as ranks other than 0 see it: the plan comes from the cache rank 0 created (a
    directory, or a URL: each rank then reads and writes the prefix itself)."""
    location = open_location(cfg.out)
    manifest = location.manifest()
    return Job(cfg, target, open_data(cfg.data, cfg.limit, chat_spec(cfg)), None, read_plan(location, manifest),
               manifest)
