"""Session fixtures for phase 2: the demo cache, and the committed demo drafter trained on it.

Both follow the recipe in tools/make_demo_drafter.py, which also owns `demo_train_config` (re-exported
here for the tests that import it from this module)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_cache.extract.run import extract
from tools.make_demo_drafter import ASSET_DIR, demo_extract_config
from tools.make_demo_drafter import demo_train_config as demo_train_config


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory) -> Path:
    """The demo rows through the tiny target (a second or two on the CPU)."""
    root = tmp_path_factory.mktemp("demo") / "cache"
    extract(demo_extract_config(root), "cpu", echo=lambda *_: None)
    return root


@pytest.fixture(scope="session")
def demo_drafter() -> Path:
    """The committed drafter trained 200 steps on the demo cache: an export directory (config.json,
    model.safetensors, dflash.py) that also holds the run's metrics.jsonl. Read-only: tests must not
    write into it. tests/tools/test_make_demo_drafter.py refuses a stale one."""
    return ASSET_DIR
