"""Manifest JSON round trip, mismatch reporting, and refusal of foreign or future formats."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from dflash_cache.errors import CacheCorruptError
from dflash_cache.store.layout import MANIFEST_FILE
from dflash_cache.store.manifest import (
    FORMAT_VERSION,
    Manifest,
    mismatches,
    read_manifest,
    write_manifest,
)
from tests.dflash_cache.store._util import make_manifest


def test_json_round_trip_in_memory_and_on_disk(tmp_path):
    m = replace(make_manifest("fp8", layer_ids=(1, 5, 9)), extra={"note": "x", "n": 3})
    obj = m.to_json()
    assert obj["format"] == "dflash-cache" and obj["format_version"] == FORMAT_VERSION
    assert obj["layer_ids"] == (1, 5, 9)  # the dataclass as it is; json.dumps writes the tuple as an array
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


def _nested(depth: int) -> dict:
    obj: dict = {}
    for _ in range(depth):
        obj = {"a": obj}
    return obj


@pytest.mark.parametrize("mutate, message", [
    # issue 16.10: strings and other types are never coerced
    (lambda o: o["plan"].update(bucket_bounds="0,770"), "plan.bucket_bounds must be a list of integers"),
    (lambda o: o["plan"].update(num_segments="5"), "plan.num_segments must be an integer"),
    (lambda o: o.update(layer_ids="12345"), "manifest.layer_ids must be a list of integers"),  # was [1,2,3,4,5]
    (lambda o: o.update(layer_ids=[1.0, 3]), "layer_ids must hold integers"),
    (lambda o: o.update(hidden_size="32"), "manifest.hidden_size must be an integer"),
    (lambda o: o.update(hidden_size=32.0), "manifest.hidden_size must be an integer"),
    (lambda o: o.update(hidden_size=True), "manifest.hidden_size must be an integer"),
    (lambda o: o["plan"].update(max_len="100"), "plan.max_len must be an integer"),
    (lambda o: o.update(codec=["bf16"]), "manifest.codec must be a string"),
    (lambda o: o.update(dataset_fingerprint=None), "dataset_fingerprint must be a string"),
    (lambda o: o["target"].update(name=7), "target.name must be a string"),
    (lambda o: o.update(extra=[1]), "manifest.extra must be an object"),
    (lambda o: o.update(surprise=1), "unknown field 'surprise'"),
    # ranges: sizes a reader would allocate by
    (lambda o: o.update(hidden_size=128000), r"hidden_size must be an integer in \[1, 65536\], not 128000"),
    (lambda o: o.update(hidden_size=0), r"hidden_size must be an integer in \[1, 65536\]"),
    (lambda o: o["target"].update(num_hidden_layers=0), "num_hidden_layers must be an integer"),
    (lambda o: o["target"].update(vocab_size=-1), "vocab_size must be an integer"),
    (lambda o: o.update(layer_ids=[-1]), "layer_ids must hold integers in"),
    (lambda o: o.update(layer_ids=list(range(300))), "layer_ids must name 1 to 256 layers, not 300"),
    (lambda o: o.update(layer_ids=[]), "layer_ids must name 1 to 256 layers, not 0"),
    (lambda o: o.update(layer_ids=list(range(32)), hidden_size=65536), "exceed 1048576 feature columns"),
    (lambda o: o["plan"].update(bucket_bounds=[770, 0]), "bucket_bounds must be a non-empty increasing list"),
    (lambda o: o["plan"].update(bucket_bounds=[]), "bucket_bounds must be a non-empty increasing list"),
    (lambda o: o["plan"].update(token_budget=0), "plan.token_budget must be an integer"),
    (lambda o: o["plan"].update(num_tokens=-5), "plan.num_tokens must be an integer"),
    # free-form `extra` is bounded in depth: later code recurses into it (asdict, mismatches)
    (lambda o: o.update(extra=_nested(900)), "extra must be an object nested at most 16 deep"),
])
def test_manifest_field_types_and_ranges_are_checked(mutate, message):
    obj = json.loads(json.dumps(make_manifest().to_json()))
    mutate(obj)
    with pytest.raises(CacheCorruptError, match=f"manifest is malformed .*{message}") as ei:
        Manifest.from_json(obj)
    assert "\n" not in str(ei.value)


def test_manifest_optional_fields_may_be_absent():
    """Fields with defaults (added over time) may be missing from older manifests."""
    obj = json.loads(json.dumps(make_manifest().to_json()))
    for key in ("extra", "features", "tool_version"):
        del obj[key]
    del obj["target"]["weights_fingerprint"]
    m = Manifest.from_json(obj)
    assert m.extra == {} and m.target.weights_fingerprint == "" and m.plan.max_len is None


def test_bool_format_version_refused():
    obj = make_manifest().to_json() | {"format_version": True}  # True == 1 in Python
    with pytest.raises(CacheCorruptError, match="format version True is not supported"):
        Manifest.from_json(obj)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000])
def test_deeply_nested_manifest_file_is_one_line_error(tmp_path, text):
    (tmp_path / MANIFEST_FILE).write_text(text)
    with pytest.raises(CacheCorruptError, match="nested too deeply") as ei:
        read_manifest(tmp_path)
    assert "\n" not in str(ei.value)


def test_oversized_manifest_file_is_refused_before_reading(tmp_path):
    (tmp_path / MANIFEST_FILE).write_text(" " * (2 << 20) + "{}")
    with pytest.raises(CacheCorruptError, match="more than the 1048576"):
        read_manifest(tmp_path)
