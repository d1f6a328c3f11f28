"""Job set-up shared by every rank: validate the input, plan the work, create or reopen the cache.

The whole dataset is validated before the first byte is written, so bad input never leaves a
half-made cache. An existing cache is reopened only if its manifest matches this run field by
field (same target, layers, codec, dataset and plan); otherwise the run is refused unless
`--overwrite`. Crash leftovers (segments without a commit) are removed here, under the lock.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zarr
from zarr.storage import LocalStore

from dflash_cache.codecs import get_codec
from dflash_cache.errors import UserError
from dflash_cache.jsonio import write_bytes_atomic
from dflash_cache.manifest import (
    MANIFEST_FILE,
    PLAN_FILE,
    Manifest,
    PlanParams,
    mismatches,
    read_manifest,
    write_manifest,
)
from dflash_cache.reader import INDEX_FILE
from dflash_cache.segments import COMMITS_DIR, SEGMENTS_DIR, read_records, remove_uncommitted
from extract.config import ExtractConfig
from extract.dataset import DatasetScan, TokenizedDataset, from_table, open_dataset
from extract.planning import PLAN_COLUMNS, Plan, PlanConfig, make_plan, plan_from_columns
from extract.target import TargetDescription, describe_target

log = logging.getLogger(__name__)
_CACHE_ENTRIES = (MANIFEST_FILE, PLAN_FILE, INDEX_FILE, SEGMENTS_DIR, COMMITS_DIR, "zarr.json")


@dataclass
class Job:
    config: ExtractConfig
    target: TargetDescription
    dataset: TokenizedDataset
    scan: DatasetScan | None  # None in workers, which take the plan from the cache
    plan: Plan
    manifest: Manifest

    @property
    def root(self) -> Path:
        return Path(self.config.out)


def open_data(data: str, limit: int | None = None) -> TokenizedDataset:
    """`--data`: a dataset path, or 'demo' for the built-in demo set."""
    if data == "demo":
        from extract.demo import demo_table

        table = demo_table()
        if limit is not None:
            if limit <= 0:
                raise UserError(f"--limit must be positive, got {limit}")
            table = table.slice(0, limit)
        return from_table(table, name="demo")
    return open_dataset(data, limit=limit)


def build_manifest(cfg: ExtractConfig, target: TargetDescription, dataset: TokenizedDataset, plan: Plan) -> Manifest:
    c = plan.config
    return Manifest(
        target=target.identity,
        layer_ids=tuple(target.layer_ids),
        hidden_size=target.hidden_size,
        codec=get_codec(cfg.codec).name,
        dataset_fingerprint=dataset.fingerprint,
        dataset_description=dataset.description,
        plan=PlanParams(
            unit_rows=c.unit_rows, token_budget=c.token_budget, max_rows=c.max_rows,
            bucket_bounds=tuple(c.bucket_bounds), max_len=cfg.max_len, overlong=cfg.overlong,
            num_rows=plan.num_rows, num_units=plan.num_units, num_segments=len(plan.batches),
            num_samples=plan.num_samples, num_tokens=plan.num_tokens,
        ),
    )


def plan_job(cfg: ExtractConfig) -> Job:
    """Validate everything and compute the plan; writes nothing."""
    target = describe_target(cfg.target)
    dataset = open_data(cfg.data, cfg.limit)
    scan = dataset.scan(vocab_size=target.identity.vocab_size, max_len=cfg.max_len, overlong=cfg.overlong)
    plan = make_plan(scan.lengths, scan.keep, cfg.plan)
    if not plan.batches:
        raise UserError(f"{cfg.data}: no rows left to extract (all {dataset.num_rows} were skipped by --max-len)")
    if scan.truncated or scan.skipped:
        log.warning("--max-len %s: %d rows truncated, %d rows skipped (--overlong %s)",
                    cfg.max_len, scan.truncated, scan.skipped, cfg.overlong)
    return Job(cfg, target, dataset, scan, plan, build_manifest(cfg, target, dataset, plan))


def _describe_mismatch(field: str, old: object, new: object) -> str:
    return f"{field}: cache has {old!r}, this run has {new!r}"


def open_or_create(job: Job) -> set[str]:
    """Create the cache, or reopen a matching one; returns the committed segment names. Hold the lock."""
    root = job.root
    if (root / MANIFEST_FILE).is_file():
        if job.config.overwrite:
            for name in _CACHE_ENTRIES:
                path = root / name
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        else:
            diff = mismatches(read_manifest(root), job.manifest)
            if diff:
                shown = "; ".join(_describe_mismatch(*d) for d in diff[:3])
                more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
                raise UserError(
                    f"cache {root} was made differently: {shown}{more}; pass --overwrite to start over "
                    "or choose another --out"
                )
    elif root.exists() and any(not p.name.startswith(".lock") for p in root.iterdir()):
        raise UserError(f"--out {root} exists and is not a dflash-cache; choose an empty or new directory")
    if not (root / MANIFEST_FILE).is_file():
        root.mkdir(parents=True, exist_ok=True)
        zarr.create_group(store=LocalStore(root), attributes={"dflash_cache": "see manifest.json"})
        (root / SEGMENTS_DIR).mkdir(exist_ok=True)
        (root / COMMITS_DIR).mkdir(exist_ok=True)
        write_plan_table(root, job.plan)
        write_manifest(root, job.manifest)  # last: its presence marks a usable cache
    committed = {r.name for r in read_records(root)}
    removed = remove_uncommitted(root, committed)
    if removed:
        log.info("removed %d uncommitted segment(s) left by an interrupted run", removed)
    return committed


def write_plan_table(root: Path, plan: Plan) -> None:
    """The plan, one row per sample in plan order, so workers and `inspect` need neither data nor planner."""
    parts = {"row": [], "unit": [], "batch": [], "bucket": [], "length": []}
    for b in plan.batches:
        n = len(b.rows)
        parts["row"].append(b.rows)
        parts["unit"].append(np.full(n, b.unit, np.int32))
        parts["batch"].append(np.full(n, b.batch, np.int32))
        parts["bucket"].append(np.full(n, b.bucket, np.int16))
        parts["length"].append(b.lengths)
    table = pa.table({k: np.concatenate(v) for k, v in parts.items()})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    write_bytes_atomic(root / PLAN_FILE, sink.getvalue().to_pybytes())


def read_plan(root: Path, manifest: Manifest) -> Plan:
    """The plan a cache was made with, from plan.parquet and the manifest."""
    t = pq.read_table(root / PLAN_FILE)
    p = manifest.plan
    config = PlanConfig(token_budget=p.token_budget, max_rows=p.max_rows, unit_rows=p.unit_rows,
                        bucket_bounds=tuple(p.bucket_bounds))
    return plan_from_columns(config, p.num_rows, *(t.column(c).to_numpy() for c in PLAN_COLUMNS))
