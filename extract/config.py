"""The extraction job's configuration: one frozen dataclass whose fields are the `extract` options."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_cache.errors import UserError
from dflash_cache.extract.dataset import OVERLONG_POLICIES
from dflash_cache.extract.target import TargetSpec
from dflash_cache.options import check_options, option
from dflash_cache.profiler import INTERVAL_HELP
from dflash_cache.store.codecs import CODECS
from dflash_cache.store.plan import PlanConfig


@dataclass(frozen=True, kw_only=True)
class ExtractConfig:
    """One extraction job; its fields (and those of `target` and `plan`) are `dflash-cache extract`'s options."""

    target: TargetSpec
    data: str = option(help="HF datasets dir, Parquet file/dir, JSONL file/dir, or 'demo'.")
    chat_template: str | None = option(None, path="any", help="Jinja chat template for a chat dataset (messages "
                                                              "rows), overriding the target tokenizer's.")
    out: str = option(path="dir", help="Cache directory to create or resume, or a URL such as "
                                       "s3://bucket/prefix.")
    codec: str = option("bf16", choices=tuple(CODECS), help="none: raw bf16; bf16: lossless zstd; fp8: e4m3 + "
                                                            "per-token scales (~2.4x smaller); fp4: e2m1 + "
                                                            "scales per 32 values and 8 bf16 outlier channels "
                                                            "(~4x smaller).")
    limit: int | None = option(None, min=1, help="Use only the first N rows.")
    max_len: int | None = option(None, min=1, help="Longest row kept; see --overlong.")
    overlong: str = option("truncate", choices=OVERLONG_POLICIES,
                           help="What --max-len does to longer rows (both are counted and reported).")
    plan: PlanConfig = field(default_factory=PlanConfig)
    overwrite: bool = option(False, help="Delete an existing cache at --out and start over.")
    dry_run: bool = option(False, help="Write nothing to --out: print the plan, the committed segments, the expected "
                                       "cache size and time (measured by extracting a few planned batches into a "
                                       "temporary directory on one device) and --out's free space.")
    gpus_per_target: int = option(1, min=1, help="Run one copy of the target split over this many GPUs with tensor "
                                                 "parallelism (transformers' tp_plan), for targets one GPU cannot "
                                                 "hold. For now it must equal the number of GPUs (--gpus or "
                                                 "torchrun's ranks): one copy over all of them.")
    writers: int = option(4, min=1, help="Threads compressing and writing segments.")
    prefetch: int = option(2, min=1, help="Batches read ahead of the forward.")
    profile_interval: float | None = option(None, min=0, min_open=True, help=INTERVAL_HELP)
    progress: bool = option(True, help="Hide the progress bar.")

    def __post_init__(self) -> None:
        check_options(self)
        if self.dry_run and self.gpus_per_target > 1:
            raise UserError("--dry-run measures the target on one device; it cannot measure --gpus-per-target "
                            f"{self.gpus_per_target} yet: drop one of them")
