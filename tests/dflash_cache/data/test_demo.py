"""The shipped demo rows (dflash_cache/target/tiny_target/demo_rows.parquet): well-formed, reproducible, guarded."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from dflash_cache.data import demo
from dflash_cache.data.demo import (
    DEMO_ROWS_FILE,
    complete,
    completion_lengths,
    cut_at_eot,
    demo_prompts,
    demo_table,
)
from dflash_cache.data.inputs import open_data
from dflash_cache.errors import UserError
from dflash_cache.target.tiny import TINY_DIR, build_tiny_target, tiny_config

MASK_ID = tiny_config().vocab_size - 1


def _rows() -> list[tuple[list[int], list[int]]]:
    t = demo_table()
    return list(zip(t.column("input_ids").to_pylist(), t.column("loss_mask").to_pylist(), strict=True))


def test_shipped_rows_complete_their_prompts():
    """Row i is prompt i, then a completion of the seeded length (shorter only if it ended the text),
    and the loss mask covers exactly the completion."""
    prompts, lengths = demo_prompts(), completion_lengths()
    rows = _rows()
    assert len(rows) == len(prompts) == len(lengths) == 128
    assert (TINY_DIR / DEMO_ROWS_FILE).stat().st_size < 1 << 20
    for (ids, mask), prompt, n in zip(rows, prompts, lengths, strict=True):
        completion = ids[len(prompt):]
        assert ids[: len(prompt)] == prompt and len(mask) == len(ids)
        assert mask == [0] * len(prompt) + [1] * len(completion)
        assert 1 <= len(completion) <= n and (len(completion) == n or completion[-1] == 0)
        assert 0 not in completion[:-1] and MASK_ID not in completion
        assert all(0 <= t < MASK_ID for t in ids)


def test_regenerating_two_rows_reproduces_the_shipped_ones():
    """The two rows with the shortest completions, regenerated alone, equal the shipped rows."""
    prompts, lengths = demo_prompts(), completion_lengths()
    rows = _rows()
    model = build_tiny_target()
    for i in np.argsort(lengths, kind="stable")[:2].tolist():
        completion = cut_at_eot(complete(model, [prompts[i]], int(lengths[i]))[0])
        assert prompts[i] + completion.tolist() == rows[i][0], f"row {i}: rebuild with `{demo.REBUILD}`"


def test_data_demo_reads_the_shipped_file_and_is_cheap(monkeypatch):
    def no_generation(*_a, **_k):
        raise AssertionError("--data demo must not generate")

    monkeypatch.setattr(demo, "generate_demo_table", no_generation)
    monkeypatch.setattr(demo, "build_tiny_target", no_generation)
    ds = open_data("demo")
    assert ds.num_rows == 128 and ds.description == "memory: demo (128 rows)"


def test_stale_or_missing_rows_are_refused(tmp_path, monkeypatch):
    demo_table.cache_clear()
    try:
        monkeypatch.setattr(demo, "provenance", lambda: {"tiny_weights": "other", "prompts": "x", "seed": "1"})
        with pytest.raises(UserError, match="made from other tiny-target weights or prompts; rebuild it with "
                                            "`python -m dflash_cache.data.demo`"):
            demo_table()
        monkeypatch.setattr(demo, "TINY_DIR", tmp_path)
        with pytest.raises(UserError, match="demo rows are missing"):
            demo_table()
    finally:
        demo_table.cache_clear()


def test_write_demo_rows_round_trips_with_provenance(tmp_path):
    out = tmp_path / "rows.parquet"
    demo.write_demo_rows(demo_table(), out)
    meta = pq.read_schema(out).metadata
    assert {k.decode(): v.decode() for k, v in meta.items()} == demo.provenance()
    assert pq.read_table(out).cast(demo.DEMO_SCHEMA).equals(demo_table())
