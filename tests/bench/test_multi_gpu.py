"""bench/multi_gpu.py's reading of a run's metrics."""

from __future__ import annotations

import json

from bench.multi_gpu import windows


def test_windows_skip_a_row_without_a_rate(tmp_path):
    """A row that holds only a run's first step has no rate (null): the table leaves it out."""
    rows = [{"step": 1, "tokens_per_s": None}, {"step": 3, "tokens_per_s": 100.4}, {"step": 5, "tokens_per_s": 90.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert windows(tmp_path) == {"steps 2-3": 100, "steps 4-5": 90}
