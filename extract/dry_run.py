"""`extract --dry-run`: whether the disk and the time budget hold, before the first segment is written.

Nothing is guessed and nothing is written to --out. The job is planned as a real run plans it
(`plan_job`), an existing cache at --out is only read, and the real pipeline (`RankExtractor`,
which commits through the store's writer) extracts a small sample of the planned batches, one per
length bucket under a token bound, into a temporary cache (under $TMPDIR). The sample's measured
bytes per token (features + token arrays, per bucket) scale to the plan's tokens; its measured
forward-and-write time per padded token scales to the work left, divided over the devices. So
short a run barely overlaps its writes with the forward, as a long one does: the time leans high.
An --out on object storage is read the same way; the sample still writes a local disk, so its time
leaves out the uploads.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_cache.extract.config import ExtractConfig
from dflash_cache.extract.job import Job, plan_job
from dflash_cache.extract.pipeline import RankExtractor
from dflash_cache.profiler import StageProfiler
from dflash_cache.store import writer
from dflash_cache.store.codecs import TOKEN_ARRAYS, get_codec
from dflash_cache.store.destination import open_destination
from dflash_cache.store.layout import MANIFEST_FILE
from dflash_cache.store.location import is_url
from dflash_cache.store.plan import Plan, PlannedBatch
from dflash_cache.store.segments import SegmentRecord, read_records
from dflash_cache.target.model import load_target

log = logging.getLogger(__name__)
SAMPLE_TOKENS = 1 << 17  # the sample's bound (its first batch is always taken); a few seconds of an 8B target


@dataclass(frozen=True)
class Estimate:
    """What a dry run measured and predicts; the numbers the CLI prints."""

    total_bytes: int      # the whole cache's segments (features + token arrays)
    to_write_bytes: int   # the segments not yet committed
    bytes_per_token: float
    raw_bytes_per_token: int  # the codec's arrays and the token ids and mask, uncompressed
    seconds: float        # extracting what is left on all the devices, model load excluded
    load_seconds: float   # loading the target on one device
    free_bytes: int | None  # on --out's file system; None for object storage


def dry_run(cfg: ExtractConfig, devices: list[torch.device], echo: Callable[[str], None] = log.info) -> Estimate:
    """Plan, sample on `devices[0]`, print the estimate, and return it; writes nothing to --out."""
    job = plan_job(cfg)
    echo(f"Dry run: nothing will be written to {job.root}.")
    echo(job.plan.summary())
    committed = _committed(job, echo)
    missing = job.todo({r.name for r in committed})
    sample = sample_batches(job.plan)
    with tempfile.TemporaryDirectory(prefix="dflash-dry-run-") as tmp:
        records, seconds, load_seconds = _extract_sample(job, sample, devices[0], Path(tmp))
    to_write = _predict(missing, _bytes_per_token(records))
    total = to_write + sum(sum(r.files.values()) for r in committed)  # committed segments: as they are
    est = Estimate(
        total_bytes=total, to_write_bytes=to_write, bytes_per_token=total / max(1, job.plan.num_tokens),
        raw_bytes_per_token=_raw_bytes_per_token(job),
        seconds=sum(b.padded_tokens for b in missing) * seconds / sum(b.padded_tokens for b in sample) / len(devices),
        load_seconds=load_seconds,
        free_bytes=None if is_url(job.root) else shutil.disk_usage(_existing_parent(job.root)).free,
    )
    tokens = sum(b.num_tokens for b in sample)
    echo(f"Sample: {len(sample)} batch{'es' if len(sample) != 1 else ''} ({tokens:,} tokens, buckets "
         f"{','.join(sorted(str(b.bucket) for b in sample))}) extracted on {devices[0]} into a temporary cache in "
         f"{seconds:.1f}s ({tokens / max(seconds, 1e-9):,.0f} tok/s)")
    for line in report_lines(est, len(devices), job.root):
        echo(line)
    return est


def report_lines(est: Estimate, n_devices: int, root: Path | str) -> list[str]:
    """The estimate as printed: size, time, free space, and a warning when the disk is too small."""
    lines = [
        f"Expected cache size: {_size(est.total_bytes)} ({est.bytes_per_token:,.1f} B/token measured; the codec's "
        f"raw form is {est.raw_bytes_per_token:,} B/token); still to write: {_size(est.to_write_bytes)}",
        f"Expected extraction time: {_duration(est.seconds)} on {n_devices} device(s) (the sample's rate, assuming "
        f"linear scaling over devices), plus loading the target: {est.load_seconds:.1f}s",
    ]
    if est.free_bytes is None:
        lines.append(f"Free space for {root}: object storage, no local disk to fill (each segment is staged in "
                     f"{tempfile.gettempdir()} while it uploads)")
        return lines
    lines.append(f"Free space for {root}: {_size(est.free_bytes)} (on the file system of {_existing_parent(root)})")
    if est.to_write_bytes > est.free_bytes:
        lines.append(f"WARNING: the cache needs {_size(est.to_write_bytes)} more but only {_size(est.free_bytes)} "
                     f"is free at {root}; free space or choose another --out (or --codec fp8)")
    return lines


def sample_batches(plan: Plan, max_tokens: int = SAMPLE_TOKENS) -> list[PlannedBatch]:
    """One batch of median size per bucket, the buckets holding the most tokens first, while the
    sample stays under `max_tokens` (the first is always taken); in plan order."""
    by_bucket: dict[int, list[PlannedBatch]] = {}
    for b in plan.batches:
        by_bucket.setdefault(b.bucket, []).append(b)
    order = sorted(by_bucket.values(), key=lambda bs: -sum(b.num_tokens for b in bs))
    picked: list[PlannedBatch] = []
    for batches in order:
        median = sorted(batches, key=lambda b: b.num_tokens)[len(batches) // 2]
        if picked and sum(b.num_tokens for b in picked) + median.num_tokens > max_tokens:
            continue
        picked.append(median)
    return sorted(picked, key=lambda b: (b.unit, b.batch))


def _committed(job: Job, echo: Callable[[str], None]) -> list[SegmentRecord]:
    """The commit records of an existing cache at --out (a directory or a URL), read without the
    lock (a dry run takes none); a cache that a real run would refuse (made differently) is
    refused here too, with the writer's own message."""
    dest = open_destination(job.root)
    with dest.guard():
        if not dest.has(MANIFEST_FILE):
            if not dest.is_half_made() and dest.foreign_entries():
                echo(f"WARNING: --out {dest} exists and is not a dflash-cache: a real run would refuse it")
            else:
                echo(f"No cache at {dest} yet: {len(job.plan.batches)} segments to extract")
            return []
        if job.config.overwrite:
            echo(f"--overwrite: the cache at {dest} would be deleted; {len(job.plan.batches)} segments to extract")
            return []
        writer.check_matches(dest, job.manifest)  # the writer's own refusal, read-only
        committed = dest.records()
    echo(f"{len(committed)} of {len(job.plan.batches)} segments already committed; "
         f"{len(job.todo({r.name for r in committed}))} to extract")
    return committed


def _extract_sample(job: Job, sample: list[PlannedBatch], device: torch.device,
                    tmp: Path) -> tuple[list[SegmentRecord], float, float]:
    """Extract `sample` into a temporary cache at `tmp` with the real pipeline; returns its commit
    records, the extraction's seconds (pinning and, on CUDA, a warm-up batch excluded) and the
    seconds the target took to load."""
    cfg = job.config
    root = tmp / "cache"
    writer.open_or_create(root, job.manifest, job.plan)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    t0 = time.perf_counter()
    model = load_target(job.target, device)
    load_seconds = time.perf_counter() - t0
    extractor = RankExtractor(
        root=root, dataset=job.dataset, model=model, layer_ids=job.target.layer_ids, codec=cfg.codec,
        device=device, rank=0, writers=cfg.writers, prefetch=cfg.prefetch, unit_rows=cfg.plan.unit_rows,
        max_len=cfg.max_len, overlong=cfg.overlong, profiler=StageProfiler(None), progress=False,
    )
    extractor.prepare(sample)
    if device.type == "cuda":  # kernels compile and libraries initialise on the first batch
        extractor.run([min(sample, key=lambda b: b.num_tokens)])
    result = extractor.run(sample)
    return read_records(root), result.seconds, load_seconds


def _bytes_per_token(records: list[SegmentRecord]) -> dict[int | None, float]:
    """Measured bytes per token by bucket, and over the whole sample (key None)."""
    sums: dict[int | None, list[int]] = {None: [0, 0]}
    for r in records:
        for key in (r.bucket, None):
            acc = sums.setdefault(key, [0, 0])
            acc[0] += sum(r.files.values())
            acc[1] += r.num_tokens
    return {k: size / max(1, tokens) for k, (size, tokens) in sums.items()}


def _predict(batches: list[PlannedBatch] | tuple[PlannedBatch, ...], per_token: dict[int | None, float]) -> int:
    """The bytes `batches` take: each at its bucket's measured rate, or the sample's where unsampled."""
    return round(sum(b.num_tokens * per_token.get(b.bucket, per_token[None]) for b in batches))


def _raw_bytes_per_token(job: Job) -> int:
    specs = get_codec(job.config.codec).arrays(len(job.target.layer_ids), job.target.hidden_size)
    per_token = ("input_ids", "loss_mask")
    return (sum(s.dtype.itemsize * s.columns for s in specs.values())
            + sum(TOKEN_ARRAYS[k].itemsize for k in per_token))


def _existing_parent(local: Path | str) -> Path:
    """The local path `local`, or its nearest parent that exists: where its free space is measured."""
    path = Path(local).absolute()
    while not path.exists():
        path = path.parent
    return path


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m" if h else f"{m}m {s:02d}s"
