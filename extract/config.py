"""The extraction job's configuration: one frozen dataclass, serialisable for worker processes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from dflash_cache.errors import UserError
from dflash_cache.extract.target import TargetSpec
from dflash_cache.store.codecs import get_codec
from dflash_cache.store.plan import PlanConfig


@dataclass(frozen=True, kw_only=True)
class ExtractConfig:
    target: TargetSpec
    data: str
    out: str
    codec: str = "bf16"
    limit: int | None = None
    max_len: int | None = None
    overlong: str = "truncate"
    plan: PlanConfig = field(default_factory=PlanConfig)
    overwrite: bool = False
    writers: int = 4          # threads compressing and writing segments
    prefetch: int = 2         # host batches read ahead of the forward
    profile_interval: float | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        get_codec(self.codec)
        if self.writers < 1 or self.prefetch < 1:
            raise UserError("--writers and --prefetch must be at least 1")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ExtractConfig:
        d = json.loads(text)
        t = d.pop("target")
        t["layers"] = tuple(t["layers"]) if t["layers"] else None
        p = d.pop("plan")
        p["bucket_bounds"] = tuple(p["bucket_bounds"])
        return cls(target=TargetSpec(**t), plan=PlanConfig(**p), **d)
