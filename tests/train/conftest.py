"""Session fixtures for phase 2: the demo cache, and a drafter trained on it once for all tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_cache.extract.config import ExtractConfig
from dflash_cache.extract.run import extract
from dflash_cache.extract.target import TargetSpec
from dflash_cache.store.plan import PlanConfig
from dflash_cache.train.trainer import TrainConfig, Trainer


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("demo") / "cache"
    cfg = ExtractConfig(target=TargetSpec(model="tiny"), data="demo", out=str(root), codec="bf16",
                        plan=PlanConfig(token_budget=4096, max_rows=16, unit_rows=64, bucket_bounds=(0, 128, 256)),
                        writers=2, progress=False)
    extract(cfg, "cpu", echo=lambda *_: None)
    return root


def demo_train_config(cache: Path, out: Path, **kw) -> TrainConfig:
    base = dict(cache=str(cache), target="tiny", out=str(out), block_size=8, draft_layers=2, num_anchors=16,
                token_budget=2048, lr=3e-3, log_every=1, save_every=10_000, progress=False, prefetch=2,
                read_threads=1)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="session")
def trained_demo_run(demo_cache, tmp_path_factory) -> Path:
    """200 steps on the demo cache (log every 25): the run directory, with metrics and export."""
    out = tmp_path_factory.mktemp("trained") / "run"
    Trainer.build(demo_train_config(demo_cache, out, max_steps=200, log_every=25), device=torch.device("cpu")).fit()
    return out
