"""Building a trainer's source and the pieces that depend on the target, for each way of feeding it.

`cache_parts` checks a cache against the target before anything else is loaded; `live_parts`
validates the dataset, loads one cut target per target device and (with `--write-cache`) opens
the tee. Both load only the target's embedding and LM head for the drafter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dflash_cache.data.chat import ChatSpec
from dflash_cache.data.inputs import check_context, open_data
from dflash_cache.devices import parse_gpus
from dflash_cache.errors import UserError
from dflash_cache.store.manifest import TargetIdentity
from dflash_cache.store.plan import DEFAULT_BUCKETS, PlanConfig
from dflash_cache.store.reader import CacheReader
from dflash_cache.target.capture import HiddenStateCapture
from dflash_cache.target.model import TargetDescription, describe_target, load_target
from dflash_cache.target.spec import TargetSpec
from dflash_cache.train.cache_source import CacheSource, check_manifest
from dflash_cache.train.config import DrafterConfig
from dflash_cache.train.drafter import FrozenTargetHead
from dflash_cache.train.epoch_plan import SourceConfig
from dflash_cache.train.live_source import LiveData, LiveSource, LiveTargets, live_sample_table
from dflash_cache.train.place import Place

if TYPE_CHECKING:
    from dflash_cache.train.run_config import LiveConfig, TrainConfig

log = logging.getLogger(__name__)


@dataclass
class Parts:
    """What a trainer is built from: its source, the drafter's shape and the target's frozen head."""

    source: CacheSource | LiveSource
    drafter_cfg: DrafterConfig
    head: FrozenTargetHead
    target: TargetIdentity | None = None  # what the drafter is trained for (its export records it)


def source_config(cfg: TrainConfig) -> SourceConfig:
    return SourceConfig(token_budget=cfg.token_budget, min_supervised=2 * cfg.block_size, seed=cfg.seed,
                        prefetch=cfg.prefetch, read_threads=cfg.read_threads)


def _drafter_and_head(cfg: TrainConfig, target: TargetDescription, device: torch.device
                      ) -> tuple[DrafterConfig, FrozenTargetHead]:
    """The drafter's config (--sliding-window W makes every layer sliding-window, as the seeds trained
    and as vLLM serves without mixed cache groups) and the target's frozen embedding and LM head."""
    drafter_cfg = DrafterConfig.from_target(
        target.config, tuple(target.layer_ids), num_layers=cfg.draft_layers, block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id, sliding_window=cfg.sliding_window,
    )
    return drafter_cfg, FrozenTargetHead.from_target(load_target(target, device, keep=0))


def open_cache(location: str, *, allow_incomplete: bool) -> CacheReader:
    """A cache to train or evaluate on: one whose extraction has not finished is refused unless
    --allow-incomplete (then its committed segments are used, with a warning)."""
    reader = CacheReader(location)
    m = reader.manifest
    if not reader.complete:
        message = (f"cache {location} is incomplete: {len(reader.records)} of {m.plan.num_segments} planned "
                   "segments are committed")
        if not allow_incomplete:
            raise UserError(f"{message}; run the same `dflash-cache extract` again to finish it, or pass "
                            "--allow-incomplete to train on what is there")
        log.warning("%s; training on those (--allow-incomplete)", message)
    return reader


def cache_parts(cfg: TrainConfig, place: Place) -> Parts:
    if cfg.cache is None:
        raise ValueError("cache_parts: this run trains live (TrainConfig.live), not from a cache")
    reader = open_cache(cfg.cache, allow_incomplete=cfg.allow_incomplete)
    m = reader.manifest
    target = describe_target(TargetSpec(model=cfg.target, layers=tuple(m.layer_ids),
                                        trust_remote_code=cfg.trust_remote_code))
    check_manifest(m, target=target.identity, layer_ids=tuple(target.layer_ids), hidden_size=target.hidden_size)
    source = CacheSource(reader, source_config(cfg), place)
    return Parts(source, *_drafter_and_head(cfg, target, place.device), target.identity)


def target_devices(spec: str, drafter: torch.device, rank: int = 0, world: int = 1) -> list[torch.device]:
    """--target-gpus: 'same' -> the drafter's device; 'cpu'; or GPU indices like 0,1, which the
    ranks of a torchrun job share out (rank r takes every world-th index from the r-th on)."""
    if spec == "same":
        return [drafter]
    ids = parse_gpus(spec, flag="--target-gpus")
    if ids is None:
        return [torch.device("cpu")]
    mine = ids[rank::world]
    if not mine:
        raise UserError(f"--target-gpus {spec} names {len(ids)} GPU(s) for {world} processes; give at least "
                        "one per process, or 'same' to run each target on its drafter's GPU")
    return [torch.device("cuda", i) for i in mine]


def _live(cfg: TrainConfig) -> LiveConfig:
    """The live options of a run that trains live (a TrainConfig holds them or a cache)."""
    if cfg.live is None:
        raise ValueError("this run trains from a cache (TrainConfig.cache), not live")
    return cfg.live


def live_dataset(cfg: TrainConfig, data: str, limit: int | None, *, vocab_size: int,
                 max_context: int | None) -> LiveData:
    """A dataset the live target runs on (--data, or a held-out --eval-data): its rows under --max-len,
    checked against the target's context, and the sample table a cache of it would hold."""
    live = _live(cfg)
    dataset = open_data(data, limit, ChatSpec(cfg.target, live.chat_template, cfg.trust_remote_code))
    scan = dataset.scan(vocab_size=vocab_size, max_len=live.max_len, overlong=live.overlong)
    check_context(scan.lengths, max_context, dataset)
    return LiveData(dataset, live_sample_table(scan, DEFAULT_BUCKETS), DEFAULT_BUCKETS, max_len=live.max_len,
                    overlong=live.overlong)


def live_parts(cfg: TrainConfig, place: Place) -> Parts:
    live = _live(cfg)
    target = describe_target(TargetSpec(model=cfg.target, dtype=live.dtype, num_layers=live.num_target_layers,
                                        layers=live.layers, trust_remote_code=cfg.trust_remote_code))
    data = live_dataset(cfg, live.data, live.limit, vocab_size=target.identity.vocab_size,
                        max_context=target.max_context)
    devices = target_devices(live.target_gpus, place.device, place.rank, place.world)
    captures = [HiddenStateCapture(load_target(target, d), target.layer_ids) for d in devices]
    tee = None
    if live.write_cache:
        from dflash_cache.train.tee import CacheTee

        tee = CacheTee(live.write_cache, live.write_codec, target=target, data=data, source_config=source_config(cfg),
                       place=place)
    targets = LiveTargets(captures, devices, queue_depth=live.queue_depth,
                          forward_plan=PlanConfig(token_budget=live.forward_token_budget,
                                                  max_rows=live.forward_max_rows))
    source = LiveSource(data, source_config(cfg), targets, place, tee=tee)
    return Parts(source, *_drafter_and_head(cfg, target, place.device), target.identity)
