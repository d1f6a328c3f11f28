"""Session-scoped real caches (tiny model, demo data, CPU), built once per codec on first use."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

_BUILT: dict[str, Path] = {}


def build_cache(out: Path, codec: str) -> Path:
    from dflash_cache.extract.config import ExtractConfig
    from dflash_cache.extract.run import extract
    from dflash_cache.extract.target import TargetSpec
    from dflash_cache.store.plan import PlanConfig

    cfg = ExtractConfig(
        target=TargetSpec(model="tiny"), data="demo", out=str(out), codec=codec,
        plan=PlanConfig(token_budget=2048, max_rows=16, unit_rows=64), progress=False,
    )
    extract(cfg, "cpu", echo=lambda *a, **k: None)
    return out


@pytest.fixture(scope="session")
def demo_tokens() -> int:
    """Tokens in the demo dataset: not a constant, it changes whenever the tiny target is retrained."""
    from dflash_cache.extract.demo import demo_table

    return sum(len(ids) for ids in demo_table().column("input_ids").to_pylist())


@pytest.fixture(scope="session")
def real_cache(tmp_path_factory):
    """real_cache(codec) -> path of a pristine cache (do not modify; copy it with `cache_copy`)."""

    def get(codec: str = "bf16") -> Path:
        if codec not in _BUILT:
            _BUILT[codec] = build_cache(tmp_path_factory.mktemp(f"cache_{codec}") / "cache", codec)
        return _BUILT[codec]

    return get


@pytest.fixture
def cache_copy(real_cache, tmp_path):
    """cache_copy(codec) -> a private copy of the real cache, safe to damage."""

    def get(codec: str = "bf16") -> Path:
        dst = tmp_path / f"cache_{codec}"
        shutil.copytree(real_cache(codec), dst, symlinks=True)
        return dst

    return get
