"""The committed demo drafter (tests/assets/demo_drafter/): current, small, trained; and the tool making it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from dflash_cache.target.model import weights_fingerprint
from dflash_cache.target.tiny import TINY
from dflash_cache.train.export import drafter_from_export
from tools import make_demo_drafter as tool
from tools.make_demo_drafter import (
    ASSET_DIR,
    MADE_FROM_FILE,
    METRICS_FILE,
    REBUILD,
    made_from,
    make_demo_drafter,
)

ASSET_FILES = sorted(["config.json", "model.safetensors", METRICS_FILE, MADE_FROM_FILE])
MAX_ASSET_BYTES = 3 << 19  # 1.5 MiB; the 2-layer bf16 drafter is ~0.95 MB
FIX = f"rebuild it with `{REBUILD}` and commit tests/assets/demo_drafter/"


def _made_from(asset: Path) -> dict[str, Any]:
    return json.loads((asset / MADE_FROM_FILE).read_text())


def _metrics(asset: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (asset / METRICS_FILE).read_text().splitlines()]


def test_committed_drafter_was_trained_against_the_shipped_tiny_target():
    recorded, shipped = _made_from(ASSET_DIR)["tiny_weights"], weights_fingerprint(TINY)
    assert recorded == shipped, (f"the committed demo drafter was trained against tiny-target weights {recorded}, "
                                 f"not the shipped ones ({shipped}); {FIX}")


def test_committed_drafter_follows_the_tools_recipe():
    recorded, recipe = _made_from(ASSET_DIR), made_from()
    changed = sorted(k for k in recipe if k != "tiny_weights" and recorded.get(k) != recipe[k])
    assert not changed, f"tools/make_demo_drafter.py's {changed} changed since the committed drafter was made; {FIX}"


def test_committed_drafter_is_small_complete_and_trained():
    assert sorted(p.name for p in ASSET_DIR.iterdir()) == ASSET_FILES
    size = sum(p.stat().st_size for p in ASSET_DIR.iterdir())
    assert size < MAX_ASSET_BYTES, f"the committed drafter grew to {size} bytes; keep the test assets small"
    train = made_from()["train"]
    cfg, _ = drafter_from_export(ASSET_DIR)
    assert (cfg.num_layers, cfg.block_size) == (train["draft_layers"], train["block_size"])
    rows = _metrics(ASSET_DIR)
    every = train["log_every"]
    assert [r["step"] for r in rows] == list(range(every, train["max_steps"] + 1, every))
    first, last = rows[0], rows[-1]
    # The 200-step run learned well beyond the fresh 40-step run of test_trainer: chance is 1/2048.
    assert last["loss"] < 0.8 * first["loss"], (first["loss"], last["loss"])
    assert last["slot_acc"][0] > 0.15 and last["slot_acc"][0] > first["slot_acc"][0] + 0.1, (first, last)
    assert last["tau_hat"] > 1.2


def test_the_tool_replaces_the_asset_directory_with_its_run(tmp_path, monkeypatch):
    """Two steps on the first 8 demo rows instead of 200 on all 128: the cache is extracted, the run
    exported, and the destination's files replaced (a file the export no longer writes does not linger)."""
    recipe = tool.demo_extract_config
    monkeypatch.setattr(tool, "demo_extract_config", lambda out: replace(recipe(out), limit=8))
    dest = tmp_path / "demo_drafter"
    dest.mkdir()
    (dest / "from_an_older_export.bin").write_bytes(b"stale")
    last = make_demo_drafter(dest, max_steps=2, log_every=1)
    assert sorted(p.name for p in dest.iterdir()) == ASSET_FILES
    assert last["step"] == 2 and [r["step"] for r in _metrics(dest)] == [1, 2]
    recorded = _made_from(dest)
    assert recorded.pop("torch")
    assert recorded == made_from(max_steps=2, log_every=1)
    assert recorded["tiny_weights"] == weights_fingerprint(TINY) and recorded["train"]["max_steps"] == 2
    drafter_from_export(dest)  # a strict load: every tensor present, every shape right
