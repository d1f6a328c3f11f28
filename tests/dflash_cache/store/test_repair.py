"""`inspect --verify --repair`: un-commit damaged segments so the next extract redoes exactly those."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
from click.testing import CliRunner

from dflash_cache.cli import cli
from dflash_cache.store.layout import COMMITS_DIR, CREATING_FILE, INDEX_FILE, SEGMENTS_DIR
from dflash_cache.store.lock import CacheLock
from dflash_cache.store.reader import CacheReader, records_digest
from dflash_cache.store.repair import uncommit
from dflash_cache.store.segments import read_records
from tests.dflash_cache.store._util import flip_byte
from tests.dflash_cache.store.conftest import build_cache


def run_inspect(*args):
    return CliRunner().invoke(cli, ["inspect", *map(str, args)])


def _commit_times(root) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (root / COMMITS_DIR).glob("*.json")}


def test_damaged_segment_is_repaired_and_extract_redoes_exactly_it(real_cache, cache_copy):
    pristine, root = real_cache("bf16"), cache_copy("bf16")
    victim = read_records(root)[3]
    flip_byte(root / SEGMENTS_DIR / victim.name / "features" / "c" / "0" / "0")

    res = run_inspect(root, "--verify")
    assert res.exit_code == 1 and f"segment {victim.name}" in res.output
    assert f"to repair: `dflash-cache inspect {root} --verify --repair` un-commits the damaged segments" in res.output

    res = run_inspect(root, "--verify", "--repair")
    assert res.exit_code == 1, res.output
    assert f"repaired: un-committed 1 segment(s) ({victim.name}) and rewrote {INDEX_FILE}" in res.output
    assert not (root / COMMITS_DIR / f"{victim.name}.json").exists()
    assert not (root / SEGMENTS_DIR / victim.name).exists()
    assert (root / SEGMENTS_DIR / "zarr.json").is_file()
    records = read_records(root)
    assert pq.read_schema(root / INDEX_FILE).metadata[b"commits_digest"].decode() == records_digest(records)

    res = run_inspect(root, "--verify")
    assert res.exit_code == 1 and "verify: 1 problem(s)" in res.output
    assert f"missing units: {victim.unit})" in res.output and "to repair" not in res.output

    before = _commit_times(root)
    build_cache(root, "bf16")  # the same extract command again
    after = _commit_times(root)
    assert set(after) - set(before) == {f"{victim.name}.json"}
    assert all(after[name] == t for name, t in before.items()), "only the repaired segment is redone"
    res = run_inspect(root, "--verify")
    assert res.exit_code == 0 and "verify: OK" in res.output, res.output
    a, b = CacheReader(pristine), CacheReader(root)
    for rec in a.records:
        sa, sb = a.read_segment(rec.name), b.read_segment(rec.name)
        assert all(np.array_equal(sa[k], sb[k]) for k in sa), rec.name


def test_repair_of_an_intact_cache_changes_nothing(cache_copy):
    root = cache_copy("bf16")
    before = _commit_times(root)
    res = run_inspect(root, "--verify", "--repair", "--json")
    assert res.exit_code == 0 and '"repaired"' not in res.output
    assert _commit_times(root) == before


def test_uncommit_rewrites_the_index(cache_copy):
    root = cache_copy("bf16")
    names = [r.name for r in read_records(root)[:2]]
    with CacheLock(root):
        assert uncommit(root, names) == names
    reader = CacheReader(root)
    assert {r.name for r in reader.records}.isdisjoint(names)
    assert reader.index.num_rows == reader.num_samples


def test_repair_needs_verify_and_the_lock(cache_copy):
    root = cache_copy("bf16")
    res = run_inspect(root, "--repair")
    assert res.exit_code == 2 and "pass --verify --repair" in res.output
    with CacheLock(root):
        res = run_inspect(root, "--verify", "--repair")
    assert res.exit_code == 2 and "is being written by pid" in res.output
    assert "choose another" not in res.output


def test_half_made_cache_is_named_as_such(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    (root / CREATING_FILE).touch()
    (root / "zarr.json").write_text("{}")
    res = run_inspect(root)
    assert res.exit_code == 2
    assert res.output.strip() == (f"Error: cache {root} was interrupted while being created; run the extract "
                                  "command again to make it")


def test_leftovers_of_interrupted_runs_are_reported_by_verify_and_removed_by_the_next_extract(cache_copy):
    root = cache_copy("bf16")
    (root / f"{INDEX_FILE}.4242.tmp").write_bytes(b"torn")
    (root / COMMITS_DIR / "u0000_b0099.json.4242.tmp").write_text("{")
    (root / SEGMENTS_DIR / "u0000_b0099").mkdir()
    (root / "mine.tmp").write_text("not the cache's")

    res = run_inspect(root, "--verify")
    assert res.exit_code == 0, res.output
    assert (f"leftovers: 3 file(s) of interrupted runs, not read ({INDEX_FILE}.4242.tmp, "
            f"{COMMITS_DIR}/u0000_b0099.json.4242.tmp, {SEGMENTS_DIR}/u0000_b0099)") in res.output

    build_cache(root, "bf16")  # the extract that made it, run again: nothing to extract, leftovers tidied
    assert not (root / f"{INDEX_FILE}.4242.tmp").exists()
    assert not (root / COMMITS_DIR / "u0000_b0099.json.4242.tmp").exists()
    assert not (root / SEGMENTS_DIR / "u0000_b0099").exists()
    assert (root / "mine.tmp").exists()
    assert "of interrupted runs" not in run_inspect(root, "--verify").output
