"""Job set-up shared by every rank: validate the input, plan the work, describe the cache to make.

The whole dataset is validated before the first byte is written, so bad input never leaves a
half-made cache. Creating, reopening and committing into the cache is the store's writer
(`dflash_cache.store.writer`); this module only hands it the job's manifest and plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from dflash_cache.data.chat import ChatSpec
from dflash_cache.data.dataset import DatasetScan, TokenizedDataset
from dflash_cache.data.inputs import build_manifest, check_context, open_data
from dflash_cache.data.planning import make_plan
from dflash_cache.errors import UserError
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.profiler import interval_from_env
from dflash_cache.store import writer
from dflash_cache.store.codecs import get_codec
from dflash_cache.store.layout import LOCK_FILE, segment_name
from dflash_cache.store.location import is_url
from dflash_cache.store.manifest import Manifest
from dflash_cache.store.plan import Plan, PlannedBatch
from dflash_cache.target.model import TargetDescription, describe_target

log = logging.getLogger(__name__)


@dataclass
class Job:
    config: ExtractConfig
    target: TargetDescription
    dataset: TokenizedDataset
    scan: DatasetScan | None  # None on ranks other than 0, which take the plan from the cache
    plan: Plan
    manifest: Manifest

    @property
    def root(self) -> Path | str:
        """--out: a directory, or a URL (kept a string: a Path would fold its '//')."""
        out = self.config.out
        return out if is_url(out) else Path(out)

    @property
    def lock_name(self) -> str:
        share = self.config.copy_share
        return LOCK_FILE if share is None else share.lock_name

    def todo(self, committed: set[str]) -> list[PlannedBatch]:
        """The missing batches this run extracts, in plan order: all of them, or its copy's share."""
        missing = self.plan.missing(committed)
        share = self.config.copy_share
        if share is None:
            return missing
        mine = share.names(self.plan)
        return [b for b in missing if segment_name(b.unit, b.batch) in mine]


def chat_spec(cfg: ExtractConfig) -> ChatSpec:
    """Where a chat dataset's tokenizer comes from: the job's target."""
    return ChatSpec(cfg.target.model, cfg.chat_template, cfg.target.trust_remote_code)


def plan_job(cfg: ExtractConfig) -> Job:
    """Validate everything and compute the plan; writes nothing."""
    interval_from_env(cfg.profile_interval)
    target = describe_target(cfg.target)
    get_codec(cfg.codec).check(target.hidden_size)  # before minutes of scanning the data
    dataset = open_data(cfg.data, cfg.limit, chat_spec(cfg))
    scan = dataset.scan(vocab_size=target.identity.vocab_size, max_len=cfg.max_len, overlong=cfg.overlong)
    check_context(scan.lengths, target.max_context, dataset)
    plan = make_plan(scan.lengths, scan.keep, cfg.plan)
    if not plan.batches:
        raise UserError(f"{cfg.data}: no rows left to extract (all {dataset.num_rows} were skipped by --max-len)")
    if scan.dropped:
        log.warning("%d of %d chat rows dropped (no usable assistant turn)", scan.dropped, dataset.num_rows)
    if scan.truncated or scan.skipped:
        log.warning("--max-len %s: %d rows truncated, %d rows skipped (--overlong %s)",
                    cfg.max_len, scan.truncated, scan.skipped, cfg.overlong)
    manifest = build_manifest(target, dataset, plan, codec=cfg.codec, max_len=cfg.max_len, overlong=cfg.overlong)
    return Job(cfg, target, dataset, scan, plan, manifest)


def open_or_create(job: Job) -> set[str]:
    """The job's cache, created or reopened by the store's writer; returns the committed segment
    names. Hold the lock. A copy (`--copy K/C`) tidies only its own share's leftovers, and copies
    other than 0 only reopen the cache copy 0 created."""
    share = job.config.copy_share
    return writer.open_or_create(job.root, job.manifest, job.plan, overwrite=job.config.overwrite,
                                 owned=None if share is None else share.names(job.plan).__contains__,
                                 created_by=None if share is None or share.index == 0 else f"--copy 0/{share.count}")
