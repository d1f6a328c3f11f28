"""Job set-up shared by every rank: validate the input, plan the work, describe the cache to make.

The whole dataset is validated before the first byte is written, so bad input never leaves a
half-made cache. Creating, reopening and committing into the cache is the store's writer
(`dflash_cache.store.writer`); this module only hands it the job's manifest and plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_cache.errors import UserError
from dflash_cache.extract.chat import ChatSpec
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.extract.dataset import DatasetScan, TokenizedDataset, from_table, open_dataset
from dflash_cache.extract.planning import make_plan
from dflash_cache.extract.target import TargetDescription, describe_target
from dflash_cache.profiler import interval_from_env
from dflash_cache.store import writer
from dflash_cache.store.codecs import get_codec
from dflash_cache.store.location import is_url
from dflash_cache.store.lock import LOCK_FILE
from dflash_cache.store.manifest import Manifest
from dflash_cache.store.plan import Plan, PlannedBatch
from dflash_cache.store.segments import segment_name

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


def open_data(data: str, limit: int | None = None, chat: ChatSpec | None = None) -> TokenizedDataset:
    """`--data`: a dataset path, or 'demo' for the built-in demo set; `chat` (the target's tokenizer,
    loaded only for a `messages` dataset, and --chat-template) renders chat rows."""
    if data == "demo":
        if chat is not None and chat.chat_template is not None:  # its rows are tokenized already
            raise UserError("--chat-template applies only to chat datasets, not --data demo; drop it")
        from dflash_cache.extract.demo import demo_table

        table = demo_table()
        if limit is not None:
            if limit <= 0:
                raise UserError(f"--limit must be positive, got {limit}")
            table = table.slice(0, limit)
        return from_table(table, name="demo")
    return open_dataset(data, limit=limit, chat=chat)


def chat_spec(cfg: ExtractConfig) -> ChatSpec:
    """Where a chat dataset's tokenizer comes from: the job's target."""
    return ChatSpec(cfg.target.model, cfg.chat_template, cfg.target.trust_remote_code)


def build_manifest(target: TargetDescription, dataset: TokenizedDataset, plan: Plan, *, codec: str,
                   max_len: int | None, overlong: str) -> Manifest:
    """The manifest of a cache of `dataset`'s features from `target`, made by `plan` from lengths
    taken under the --max-len policy (`max_len`, `overlong`)."""
    feature_codec = get_codec(codec)
    feature_codec.check(target.hidden_size)
    return Manifest(
        target=target.identity,
        layer_ids=tuple(target.layer_ids),
        hidden_size=target.hidden_size,
        codec=feature_codec.name,
        codec_layout=feature_codec.layout,
        dataset_fingerprint=dataset.fingerprint,
        dataset_description=dataset.description,
        plan=plan.params(max_len=max_len, overlong=overlong),
    )


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


def open_or_create(job: Job) -> set[str]:
    """The job's cache, created or reopened by the store's writer; returns the committed segment
    names. Hold the lock. A copy (`--copy K/C`) tidies only its own share's leftovers, and copies
    other than 0 only reopen the cache copy 0 created."""
    share = job.config.copy_share
    return writer.open_or_create(job.root, job.manifest, job.plan, overwrite=job.config.overwrite,
                                 owned=None if share is None else share.names(job.plan).__contains__,
                                 created_by=None if share is None or share.index == 0 else f"--copy 0/{share.count}")
