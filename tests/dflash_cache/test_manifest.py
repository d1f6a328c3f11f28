"""Manifest JSON round trip, mismatch reporting, and refusal of foreign or future formats."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from dflash_cache.errors import CacheCorruptError
from dflash_cache.manifest import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    Manifest,
    mismatches,
    read_manifest,
    write_manifest,
)
from tests.dflash_cache._util import make_manifest


def test_json_round_trip_in_memory_and_on_disk(tmp_path):
    m = replace(make_manifest("fp8", layer_ids=(1, 5, 9)), extra={"note": "x", "n": 3})
    obj = m.to_json()
    assert obj["format"] == "dflash-cache" and obj["format_version"] == FORMAT_VERSION
    assert obj["layer_ids"] == (1, 5, 9) or obj["layer_ids"] == [1, 5, 9]
    back = Manifest.from_json(json.loads(json.dumps(obj)))
    assert back == m
    assert back.plan.bucket_bounds == (0, 770) and back.layer_ids == (1, 5, 9)
    assert back.n_layers == 3 and back.feature_width == 3 * 32
    write_manifest(tmp_path, m)
    assert read_manifest(tmp_path) == m
    assert not list(tmp_path.glob("*.tmp"))
    assert mismatches(m, back) == []


def test_mismatches_names_differing_fields():
    a = make_manifest("bf16", layer_ids=(1, 3))
    b = replace(a, codec="fp8", layer_ids=(1, 4), target=replace(a.target, config_hash="zzz"))
    diffs = mismatches(a, b)
    assert diffs == [
        ("codec", "bf16", "fp8"),
        ("layer_ids", (1, 3), (1, 4)),
        ("target.config_hash", "abc123", "zzz"),
    ]


def test_mismatches_ignores_volatile_fields_but_not_plan():
    a = make_manifest()
    b = replace(a, tool_version="99.0", extra={"x": 1}, dataset_description="other words")
    assert mismatches(a, b) == []
    c = replace(a, plan=replace(a.plan, token_budget=4096), dataset_fingerprint="0" * 64)
    assert [k for k, _, _ in mismatches(a, c)] == ["dataset_fingerprint", "plan.token_budget"]


@pytest.mark.parametrize("version", [0, 2, "1", None])
def test_unsupported_format_version_refused(tmp_path, version):
    obj = make_manifest().to_json()
    obj["format_version"] = version
    with pytest.raises(CacheCorruptError, match="format version"):
        Manifest.from_json(obj)
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(obj))
    with pytest.raises(CacheCorruptError, match=f"format version {version} is not supported"):
        read_manifest(tmp_path)


def test_foreign_format_refused():
    obj = make_manifest().to_json() | {"format": "something-else"}
    with pytest.raises(CacheCorruptError, match="not a dflash-cache manifest"):
        Manifest.from_json(obj)


@pytest.mark.parametrize("mutate", [
    lambda o: o.pop("codec"),
    lambda o: o["target"].pop("config_hash"),
    lambda o: o["target"].update(unknown_field=1),
    lambda o: o.update(layer_ids=["a"]),
    lambda o: o.update(plan=None),
    lambda o: o.update(target=[1, 2]),
])
def test_malformed_manifest_refused(mutate):
    obj = json.loads(json.dumps(make_manifest().to_json()))
    mutate(obj)
    with pytest.raises(CacheCorruptError, match="manifest is malformed"):
        Manifest.from_json(obj)


@pytest.mark.parametrize("text", ["[]", "null", "3", '"manifest"', "{not json", ""])
def test_non_object_or_broken_manifest_file_refused(tmp_path, text):
    (tmp_path / MANIFEST_FILE).write_text(text)
    with pytest.raises(CacheCorruptError):
        read_manifest(tmp_path)


def test_missing_manifest_says_not_a_cache(tmp_path):
    with pytest.raises(CacheCorruptError, match="is not a dflash-cache"):
        read_manifest(tmp_path)
