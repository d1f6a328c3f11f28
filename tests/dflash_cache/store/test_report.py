"""`summarize`, `verify` and the `dflash-cache inspect` command on a real small cache."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from dflash_cache.cli import cli
from dflash_cache.store.codecs import get_codec
from dflash_cache.store.layout import COMMITS_DIR, INDEX_FILE, MANIFEST_FILE, PLAN_FILE, SEGMENTS_DIR
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.report import describe_sample, format_summary, summarize, verify
from dflash_cache.store.segments import read_records
from tests.dflash_cache.store._util import flip_byte

KEYS = {"samples", "tokens", "segments", "codec", "layer_ids", "hidden_size", "bytes_on_disk", "bytes_per_token",
        "complete"}


def run_inspect(*args: str):
    return CliRunner().invoke(cli, ["inspect", *map(str, args)], catch_exceptions=False)


def _expected(root):
    records = read_records(root)
    meta = sum((root / f).stat().st_size for f in (MANIFEST_FILE, PLAN_FILE, INDEX_FILE))
    return records, sum(sum(r.files.values()) for r in records) + meta


def test_summary_names_the_codec_layout(real_cache):
    """A codec whose stored arrays have had several layouts is shown with the one the cache holds."""
    s = summarize(CacheReader(real_cache("fp4")))
    assert s["codec_layout"] == get_codec("fp4").layout != ""
    assert f"codec            fp4  ({s['codec_layout']})" in format_summary(s).splitlines()
    s = summarize(CacheReader(real_cache("bf16")))
    assert s["codec_layout"] == "" and "codec            bf16" in format_summary(s).splitlines()


def test_summarize_matches_records(real_cache, demo_tokens):
    root = real_cache("bf16")
    records, on_disk = _expected(root)
    s = summarize(CacheReader(root))
    assert KEYS <= set(s)
    assert s["samples"] == sum(r.num_samples for r in records) == 128
    assert s["tokens"] == sum(sum(r.lengths) for r in records) == demo_tokens
    assert s["supervised_tokens"] == sum(sum(r.supervised) for r in records)
    assert s["segments"] == len(records) == s["segments_planned"] > 1
    assert s["codec"] == "bf16" and s["layer_ids"] == [1, 2, 3, 4, 5] and s["hidden_size"] == 128
    assert s["bytes_on_disk"] == on_disk
    assert s["bytes_per_token"] == pytest.approx(on_disk / demo_tokens)
    assert s["raw_bf16_bytes_per_token"] == 5 * 128 * 2
    assert s["complete"] is True and s["missing_units"] == []
    assert sum(s["bucket_segments"]) == len(records)


def test_summarize_incomplete_cache_lists_missing_units(cache_copy):
    root = cache_copy("bf16")
    records = read_records(root)
    victim = records[-1]
    (root / COMMITS_DIR / f"{victim.name}.json").unlink()
    s = summarize(CacheReader(root))
    assert s["complete"] is False
    assert s["segments"] == len(records) - 1 and s["missing_units"] == [victim.unit]
    assert s["samples"] == 128 - victim.num_samples


def test_cli_json_prints_one_object(real_cache, demo_tokens):
    root = real_cache("bf16")
    records, on_disk = _expected(root)
    res = run_inspect(root, "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)  # the whole of stdout is one JSON object
    assert isinstance(out, dict) and KEYS <= set(out)
    assert out["samples"] == 128 and out["tokens"] == demo_tokens and out["segments"] == len(records)
    assert out["codec"] == "bf16" and out["layer_ids"] == [1, 2, 3, 4, 5] and out["hidden_size"] == 128
    assert out["bytes_on_disk"] == on_disk and out["complete"] is True
    assert "verify" not in out and "sample" not in out


def test_cli_text_summary(real_cache, demo_tokens):
    res = run_inspect(real_cache("bf16"))
    assert res.exit_code == 0
    assert "(complete)" in res.output and f"{demo_tokens:,}" in res.output and "missing units    none" in res.output


def test_verify_clean_cache(real_cache):
    root = real_cache("fp8")
    assert verify(CacheReader(root)) == []
    res = run_inspect(root, "--verify")
    assert res.exit_code == 0, res.output
    assert "verify: OK" in res.output
    res = run_inspect(root, "--verify", "--json")
    assert res.exit_code == 0
    assert json.loads(res.stdout)["verify"] == {"ok": True, "problems": [], "damaged_segments": []}


def _features_shard(root, name):
    return root / SEGMENTS_DIR / name / "features" / "c" / "0" / "0"


@pytest.mark.parametrize("damage", ["flip", "delete_shard", "delete_segment"])
def test_verify_names_damaged_segment(cache_copy, damage):
    root = cache_copy("bf16")
    records = read_records(root)
    name = records[3].name
    if damage == "flip":
        flip_byte(_features_shard(root, name))
    elif damage == "delete_shard":
        _features_shard(root, name).unlink()
    else:
        shutil.rmtree(root / SEGMENTS_DIR / name)
    problems = verify(CacheReader(root))
    assert len(problems) == 1 and name in problems[0], problems
    if damage == "delete_shard":
        assert problems[0] == f"segment {name} is damaged: features/c/0/0 is missing"
    res = run_inspect(root, "--verify")
    assert res.exit_code == 1
    assert "verify: 1 problem(s)" in res.output and f"segment {name}" in res.output
    others = {r.name for r in records} - {name}
    assert not any(o in res.output for o in others)
    res = run_inspect(root, "--verify", "--json")
    assert res.exit_code == 1
    v = json.loads(res.stdout)["verify"]
    assert v["ok"] is False and len(v["problems"]) == 1 and name in v["problems"][0]


def test_verify_finds_record_disagreeing_with_data(cache_copy):
    """A record edited to claim different supervised counts (files untouched) is caught."""
    root = cache_copy("none")
    path = root / COMMITS_DIR / f"{read_records(root)[0].name}.json"
    obj = json.loads(path.read_text())
    obj["supervised"][0] -= 1
    path.write_text(json.dumps(obj))
    problems = verify(CacheReader(root))
    assert any("loss mask disagrees" in p and obj["name"] in p for p in problems), problems
    # the index digest covers segment names only, so the old index is still used; verify flags it
    assert any(p.startswith(f"{INDEX_FILE} disagrees") for p in problems), problems
    assert len(problems) == 2


def test_cli_sample(real_cache):
    root = real_cache("bf16")
    r = CacheReader(root)
    loc = r.locate(7)
    res = run_inspect(root, "--sample", "7", "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)["sample"]
    assert d["sample_id"] == 7 and d["segment"] == loc["segment"] and d["length"] == loc["length"]
    assert d["supervised"] == loc["supervised"]
    assert list(d["layer_norms"]) == ["1", "2", "3", "4", "5"]
    s = r.sample(7)
    feats = s.features.float().view(loc["length"], 5, 128)
    expected = feats.norm(dim=-1).mean(dim=0).tolist()
    assert [d["layer_norms"][k] for k in ("1", "2", "3", "4", "5")] == pytest.approx(expected)
    assert all(v > 0 for v in expected)
    assert describe_sample(r, 7) == d
    text = run_inspect(root, "--sample", "7")
    assert text.exit_code == 0
    assert f"sample 7 in segment {loc['segment']}" in text.output
    assert f"length         {loc['length']}" in text.output
    assert "layer   5:" in text.output


def test_cli_unknown_sample_exits_2(real_cache):
    res = run_inspect(real_cache("bf16"), "--sample", "999999")
    assert res.exit_code == 2
    assert "sample 999999 is not in this cache" in res.stderr


@pytest.mark.parametrize("kind", ["empty_dir", "missing", "file"])
def test_cli_not_a_cache_exits_2_with_one_line(tmp_path, kind):
    target = tmp_path / "thing"
    if kind == "empty_dir":
        target.mkdir()
    elif kind == "file":
        target.write_text("hello")
    res = run_inspect(target)
    assert res.exit_code == 2
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and str(target) in lines[0], res.stderr
    assert "Traceback" not in res.output


def test_verify_fails_on_an_incomplete_cache(cache_copy):
    """A missing commit record used to pass --verify with exit 0."""
    root = cache_copy("bf16")
    records = read_records(root)
    victim = records[-1]
    (root / COMMITS_DIR / f"{victim.name}.json").unlink()
    res = run_inspect(root, "--verify")
    assert res.exit_code == 1
    assert (f"  incomplete: {len(records) - 1} of {len(records)} planned segments are committed (missing units: "
            f"{victim.unit}); run the extract command that made it again to finish it") in res.output
    assert "to repair" not in res.output  # nothing is damaged
    v = json.loads(run_inspect(root, "--verify", "--json").stdout)["verify"]
    assert v["ok"] is False and v["damaged_segments"] == [] and len(v["problems"]) == 1


def test_a_plan_linked_out_of_the_cache_is_refused_not_skipped(cache_copy, tmp_path):
    root = cache_copy()
    (root / "plan.parquet").unlink()
    (root / "plan.parquet").symlink_to(tmp_path / "not-there.parquet")  # dangling: not a missing plan
    r = run_inspect(str(root))
    assert r.exit_code == 2 and "outside" in r.output and "Traceback" not in r.output, r.output
