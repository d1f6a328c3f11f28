"""The extraction job's configuration: one frozen dataclass whose fields are the `extract` options."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_cache.data.dataset import OVERLONG_POLICIES
from dflash_cache.errors import UserError
from dflash_cache.options import check_options, option
from dflash_cache.profiler import INTERVAL_HELP
from dflash_cache.store.layout import LOCK_FILE, segment_name
from dflash_cache.store.manifest import CODEC_NAMES
from dflash_cache.store.plan import Plan, PlanConfig, deal
from dflash_cache.target.spec import TargetSpec


@dataclass(frozen=True)
class CopyShare:
    """`--copy K/C`: this run is copy K (from 0) of C runs of the target that extract one cache
    together, each over its own GPUs (one torchrun, or one --gpus list, per copy; several hosts
    too), each taking a fixed share of the plan's batches as ranks do. Why: transformers' tensor
    parallelism spans a whole process group, so C copies of an N-GPU target are C groups."""

    index: int
    count: int

    @classmethod
    def parse(cls, spec: str) -> CopyShare:
        try:
            index, count = (int(x) for x in spec.split("/"))
        except ValueError:
            raise UserError(f"--copy {spec!r}: expected K/C, e.g. 0/2 for the first of two copies") from None
        if not 0 <= index < count:
            raise UserError(f"--copy {spec!r}: K must be in 0..C-1 (copies are numbered from 0)")
        return cls(index, count)

    @property
    def lock_name(self) -> str:
        """Each copy holds its own lock: copies run at once, but never one copy twice."""
        return f"{LOCK_FILE}-copy{self.index}"

    def names(self, plan: Plan) -> set[str]:
        """The segments this copy extracts: its share of the whole plan (`deal`), the same in every
        run of the copy whatever is committed, so copies started at different times never overlap."""
        return {segment_name(b.unit, b.batch) for b in deal(plan.batches, self.count)[self.index]}


@dataclass(frozen=True, kw_only=True)
class ExtractConfig:
    """One extraction job; its fields (and those of `target` and `plan`) are `dflash-cache extract`'s options."""

    target: TargetSpec
    data: str = option(help="HF datasets dir, Parquet file/dir, JSONL file/dir, or 'demo'.")
    chat_template: str | None = option(None, path="any", help="Jinja chat template for a chat dataset (messages "
                                                              "rows), overriding the target tokenizer's.")
    out: str = option(path="dir", help="Cache directory to create or resume, or a URL such as "
                                       "s3://bucket/prefix.")
    codec: str = option("bf16", choices=CODEC_NAMES, help="none: raw bf16; bf16: lossless zstd; fp8: e4m3 + "
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
                                                 "hold. It must equal the number of GPUs (--gpus or torchrun's "
                                                 "ranks) of this run; run more copies with --copy.")
    copy: str | None = option(None, help="K/C: this run is copy K (from 0) of C runs of the target extracting "
                                         "this cache together, each on its own GPUs (e.g. C torchruns of "
                                         "--gpus-per-target GPUs each, or C hosts); each takes a fixed share of "
                                         "the batches. Copy 0 creates the cache; start it first.")
    writers: int = option(4, min=1, help="Threads compressing and writing segments.")
    prefetch: int = option(2, min=1, help="Batches read ahead of the forward.")
    profile_interval: float | None = option(None, min=0, min_open=True, help=INTERVAL_HELP)
    progress: bool = option(True, help="Hide the progress bar.")

    def __post_init__(self) -> None:
        check_options(self)
        share = self.copy_share
        if share is not None and share.index > 0 and self.overwrite:
            raise UserError(f"--overwrite with --copy {self.copy}: only copy 0 (which creates the cache) may start it "
                            "over; drop --overwrite here")
        if self.dry_run and self.gpus_per_target > 1:
            raise UserError("--dry-run measures the target on one device; it cannot measure --gpus-per-target "
                            f"{self.gpus_per_target} yet: drop one of them")

    @property
    def copy_share(self) -> CopyShare | None:
        return None if self.copy is None else CopyShare.parse(self.copy)
