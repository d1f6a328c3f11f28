"""Session fixtures for phase 2: the demo cache, and the committed demo drafter trained on it.

Both follow the recipe in tools/make_demo_drafter.py, which also owns `demo_train_config` (re-exported
here for the tests that import it from this module)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from dflash_cache.extract.run import extract
from tools.make_demo_drafter import ASSET_DIR, demo_extract_config
from tools.make_demo_drafter import demo_train_config as demo_train_config


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch ops of the block on one intra-op thread. The tiny models' ops last microseconds to
    milliseconds, too short to gain from a second thread, while OpenMP threads spin waiting for work:
    with anything else busy on a 2-core machine (the pipeline's own reader and writer threads, another
    process) they run ten to twenty times slower than on one thread, which is as fast when alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory) -> Path:
    """The demo rows through the tiny target (a second or two on the CPU)."""
    root = tmp_path_factory.mktemp("demo") / "cache"
    with one_torch_thread():
        extract(demo_extract_config(root), "cpu", echo=lambda *_: None)
    return root


@pytest.fixture(scope="session")
def demo_drafter() -> Path:
    """The committed drafter trained 200 steps on the demo cache: an export directory (config.json,
    model.safetensors, dflash.py) that also holds the run's metrics.jsonl. Read-only: tests must not
    write into it. tests/tools/test_make_demo_drafter.py refuses a stale one."""
    return ASSET_DIR
