"""Train the small demo drafter that the tests load instead of training one in every session.

Tests that need *a trained* drafter (speculative decoding, `eval`, the shipped model code) read the
committed `tests/assets/demo_drafter/`: the export of a 200-step CPU run on the demo cache (config.json and
model.safetensors; its dflash.py ships with the package), that run's metrics.jsonl, and made_from.json, which records the recipe
below and the fingerprint of the tiny-target weights it was trained against. The tests refuse a stale
one; after retraining the tiny target, or changing the recipe here, rebuild it (a minute or two of CPU):

    python -m tools.make_demo_drafter

The recipe lives here, not in the tests: the tests' `demo_cache` fixture and `demo_train_config` use
these same settings, so the committed drafter is exactly what those fixtures would train.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from dflash_cache.data.demo import DEMO
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.extract.run import extract
from dflash_cache.logs import setup_logging
from dflash_cache.store.plan import PlanConfig
from dflash_cache.target.model import TargetSpec, weights_fingerprint
from dflash_cache.target.tiny import TINY
from dflash_cache.train.export import MODEL_CODE_NAME
from dflash_cache.train.run_config import TrainConfig
from dflash_cache.train.trainer import Trainer

log = logging.getLogger(__name__)

REBUILD = "python -m tools.make_demo_drafter"
ASSET_DIR = Path(__file__).resolve().parents[1] / "tests" / "assets" / "demo_drafter"
EXPORT_DIR, METRICS_FILE, MADE_FROM_FILE = "export", "metrics.jsonl", "made_from.json"

# The demo cache: the shipped demo rows through the tiny target, small batches so that there are many.
DEMO_CODEC = "bf16"
DEMO_PLAN = PlanConfig(token_budget=4096, max_rows=16, unit_rows=64, bucket_bounds=(0, 128, 256))
# Phase 2 on the CPU: a 2-layer drafter, small blocks and batches, a high learning rate so that it learns fast.
DEMO_TRAIN: dict[str, Any] = dict(block_size=8, draft_layers=2, num_anchors=16, token_budget=2048, lr=3e-3,
                                  log_every=1, save_every=10_000, progress=False, prefetch=2, read_threads=1)
# The committed run on top of DEMO_TRAIN.
ASSET_RUN: dict[str, Any] = dict(max_steps=200, log_every=25)


def demo_extract_config(out: Path) -> ExtractConfig:
    """The demo cache's extraction, written to `out`."""
    return ExtractConfig(target=TargetSpec(model=TINY), data=DEMO, out=str(out), codec=DEMO_CODEC, plan=DEMO_PLAN,
                         writers=2, progress=False)


def demo_train_config(cache: Path, out: Path, **overrides: Any) -> TrainConfig:
    """DEMO_TRAIN on `cache`, writing the run to `out`; `overrides` replace any of its settings."""
    return TrainConfig(**{"cache": str(cache), "target": TINY, "out": str(out), **DEMO_TRAIN, **overrides})


def made_from(**overrides: Any) -> dict[str, Any]:
    """What the drafter depends on, as JSON: the tiny-target weights and the recipe (with `overrides`)."""
    recipe = {
        "rebuild": REBUILD,
        "tiny_weights": weights_fingerprint(TINY),
        "extract": {"data": DEMO, "codec": DEMO_CODEC, "plan": asdict(DEMO_PLAN)},
        "train": {**DEMO_TRAIN, **ASSET_RUN, **overrides},
        "device": "cpu",
    }
    return json.loads(json.dumps(recipe))  # tuples as lists, as read back from the file


def make_demo_drafter(dest: Path, *, cache: Path | None = None, **overrides: Any) -> dict[str, float]:
    """Train the demo drafter (ASSET_RUN, then `overrides`) and make `dest` hold exactly its assets.

    Extracts the demo cache first unless `cache` names one made by `demo_extract_config`. Returns the
    run's last metrics."""
    with tempfile.TemporaryDirectory(prefix="demo_drafter_") as tmp:
        work = Path(tmp)
        if cache is None:
            cache = work / "cache"
            extract(demo_extract_config(cache), "cpu", echo=log.info)
        run = work / "run"
        cfg = demo_train_config(cache, run, **{**ASSET_RUN, **overrides})
        metrics = Trainer.build(cfg, device=torch.device("cpu")).fit()
        staged = work / "asset"
        # The model code is left out: it ships with the package, and a copy here would only go stale.
        shutil.copytree(run / EXPORT_DIR, staged, ignore=shutil.ignore_patterns(MODEL_CODE_NAME))
        shutil.copy2(run / METRICS_FILE, staged / METRICS_FILE)
        recipe = {**made_from(**overrides), "torch": torch.__version__}
        (staged / MADE_FROM_FILE).write_text(json.dumps(recipe, indent=1) + "\n")
        if dest.exists():  # replace, never merge: a file the export no longer writes must not linger
            shutil.rmtree(dest)
        shutil.copytree(staged, dest)
    return metrics


def main(argv: list[str] | None = None) -> None:
    """Rebuild tests/assets/demo_drafter/ from the tiny target now in dflash_cache/target/tiny_target/."""
    ap = argparse.ArgumentParser(description=f"Rebuild {ASSET_DIR} (a minute or two of CPU).")
    ap.add_argument("--out", type=Path, default=ASSET_DIR, help="the asset directory to (re)write")
    args = ap.parse_args(argv)
    setup_logging()
    t0 = time.perf_counter()
    metrics = make_demo_drafter(args.out)
    size = sum(p.stat().st_size for p in args.out.iterdir())
    log.info("wrote %s (%d files, %d bytes) in %.0fs; last metrics %s", args.out, len(list(args.out.iterdir())),
             size, time.perf_counter() - t0, metrics)


if __name__ == "__main__":
    main()
