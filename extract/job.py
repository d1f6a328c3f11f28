"""Job set-up shared by every rank: validate the input, plan the work, create or reopen the cache.

The whole dataset is validated before the first byte is written, so bad input never leaves a
half-made cache. An existing cache is reopened only if its manifest matches this run field by
field (same target, layers, codec, dataset and plan); otherwise the run is refused unless
`--overwrite`. Crash leftovers (segments without a commit) are removed here, under the lock.
A cache killed or refused a disk while being created is recognised by its `.creating` marker
(`dflash_cache.store.repair`) and made again by the next run; a failed creation removes what it wrote.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zarr
from zarr.core.common import ZARR_JSON
from zarr.storage import LocalStore

from dflash_cache.errors import UserError
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.extract.dataset import DatasetScan, TokenizedDataset, from_table, open_dataset
from dflash_cache.extract.pipeline import disk_error
from dflash_cache.extract.planning import make_plan
from dflash_cache.extract.target import TargetDescription, describe_target
from dflash_cache.files import TMP_SUFFIX, fsync_path
from dflash_cache.profiler import interval_from_env
from dflash_cache.store.codecs import get_codec
from dflash_cache.store.lock import LOCK_FILE
from dflash_cache.store.manifest import (
    MANIFEST_FILE,
    Manifest,
    PlanParams,
    mismatches,
    read_manifest,
    write_manifest,
)
from dflash_cache.store.plan import PLAN_FILE, Plan, write_plan_table
from dflash_cache.store.reader import INDEX_FILE
from dflash_cache.store.repair import CREATING_FILE, is_half_made, remove_uncommitted_segments
from dflash_cache.store.segments import COMMITS_DIR, SEGMENTS_DIR, read_records

log = logging.getLogger(__name__)
_CACHE_ENTRIES = (MANIFEST_FILE, PLAN_FILE, INDEX_FILE, SEGMENTS_DIR, COMMITS_DIR, ZARR_JSON, CREATING_FILE)
_CACHE_STEMS = {name.split(".")[0] for name in _CACHE_ENTRIES if not name.startswith(".")}


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
        from dflash_cache.extract.demo import demo_table

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
    interval_from_env(cfg.profile_interval)
    target = describe_target(cfg.target)
    dataset = open_data(cfg.data, cfg.limit)
    scan = dataset.scan(vocab_size=target.identity.vocab_size, max_len=cfg.max_len, overlong=cfg.overlong)
    check_context(scan.lengths, target.max_context, dataset)
    plan = make_plan(scan.lengths, scan.keep, cfg.plan)
    if not plan.batches:
        raise UserError(f"{cfg.data}: no rows left to extract (all {dataset.num_rows} were skipped by --max-len)")
    if scan.truncated or scan.skipped:
        log.warning("--max-len %s: %d rows truncated, %d rows skipped (--overlong %s)",
                    cfg.max_len, scan.truncated, scan.skipped, cfg.overlong)
    return Job(cfg, target, dataset, scan, plan, build_manifest(cfg, target, dataset, plan))


def check_context(lengths: np.ndarray, context: int | None, dataset: TokenizedDataset) -> None:
    """Refuse rows longer than the target's context (after --max-len): their features past the
    context are out of distribution, which a drafter would learn silently. Lengths are at hand."""
    if context is None:
        return
    over = np.flatnonzero(lengths > context)
    if over.size:
        row = int(over[0])
        others = f" (and {over.size - 1} more rows)" if over.size > 1 else ""
        raise UserError(
            f"row {row} of {dataset.description} has {int(lengths[row]):,} tokens, more than the target's context "
            f"of {context:,} (max_position_embeddings){others}; pass --max-len {context} with --overlong "
            "truncate or skip"
        )


def _describe_mismatch(field: str, old: object, new: object) -> str:
    return f"{field}: cache has {old!r}, this run has {new!r}"


def _check_matches(root: Path, wanted: Manifest) -> None:
    diff = mismatches(read_manifest(root), wanted)
    if diff:
        shown = "; ".join(_describe_mismatch(*d) for d in diff[:3])
        more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
        raise UserError(
            f"cache {root} was made differently: {shown}{more}; pass --overwrite to start over "
            "or choose another --out"
        )


def _ours(name: str) -> bool:
    """Entries a cache's creation writes (or its temporary files); lock files are not among them."""
    return name in _CACHE_ENTRIES or (name.endswith(TMP_SUFFIX) and name.split(".")[0] in _CACHE_STEMS)


def _remove_entries(root: Path) -> None:
    """Delete what a (half-made or overwritten) cache holds, leaving foreign files and locks alone."""
    for path in root.iterdir():
        if _ours(path.name) and path.name != CREATING_FILE:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)


def _create(root: Path, plan: Plan, manifest: Manifest) -> None:
    """Make a new cache. The marker goes first and leaves last, so a cache killed in between is
    recognised as half-made (and redone) by the next run; a failure here removes what it made."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / CREATING_FILE).touch()
        fsync_path(root)
    except OSError as e:  # nothing made yet, nothing removed yet
        raise disk_error(root, e, creating=True) from None
    try:
        _remove_entries(root)
        group = zarr.create_group(store=LocalStore(root), attributes={"dflash_cache": "see manifest.json"})
        _segments_group(group)
        (root / COMMITS_DIR).mkdir()
        write_plan_table(root, plan)
        write_manifest(root, manifest)  # its presence marks a usable cache
    except OSError as e:
        _undo_create(root)
        raise disk_error(root, e, creating=True) from None
    (root / CREATING_FILE).unlink()
    fsync_path(root)


def _undo_create(root: Path) -> None:
    """Best effort: what stays (a disk that refuses even deletes) still carries the marker."""
    try:
        _remove_entries(root)
        (root / CREATING_FILE).unlink(missing_ok=True)
    except OSError as e:
        log.warning("could not remove the half-made cache at %s (%s); the next run will", root, e)


def _segments_group(root_group: zarr.Group) -> None:
    """`segments/` as a zarr group, so zarr tools walking the hierarchy reach every segment."""
    root_group.create_group(SEGMENTS_DIR, attributes={"dflash_cache": "one group per segment; "
                                                      "only those with a record in commits/ are committed"})


def _reopen(root: Path) -> None:
    """Tidy a matching cache: a marker left by a kill just after the manifest was written, and the
    segments group that caches made before it existed lack."""
    (root / CREATING_FILE).unlink(missing_ok=True)
    if not (root / SEGMENTS_DIR / ZARR_JSON).is_file():
        _segments_group(zarr.open_group(store=LocalStore(root), mode="r+"))


def open_or_create(job: Job) -> set[str]:
    """Create the cache, or reopen a matching one; returns the committed segment names. Hold the lock.

    A half-made cache (killed or refused a disk while being created) holds no committed segment,
    so it is made again from the start, with or without --overwrite."""
    root = job.root
    is_cache = (root / MANIFEST_FILE).is_file()
    if is_cache and not job.config.overwrite:
        _check_matches(root, job.manifest)
        _reopen(root)
    elif is_cache or is_half_made(root) or not _foreign_entries(root):
        if is_half_made(root):
            log.info("%s: its creation was interrupted; making it again", root)
        _create(root, job.plan, job.manifest)
    else:
        raise UserError(f"--out {root} exists and is not a dflash-cache; choose an empty or new directory")
    committed = {r.name for r in read_records(root)}
    removed = remove_uncommitted_segments(root, committed)
    if removed:
        log.info("removed %d uncommitted segment(s) left by an interrupted run", removed)
    return committed


def _foreign_entries(root: Path) -> bool:
    """Whether `root` holds anything besides lock files (a new or empty directory holds nothing)."""
    return root.exists() and any(not p.name.startswith(LOCK_FILE) for p in root.iterdir())
