"""Codec round trips through commit_segment + CacheReader, chunk checksums, and compression."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_cache.errors import CacheCorruptError, UserError
from dflash_cache.store.codecs import CODECS, Fp4Codec, get_codec
from dflash_cache.store.codecs.fp8 import fp8_error_bound
from dflash_cache.store.layout import SEGMENTS_DIR
from dflash_cache.store.manifest import CODEC_NAMES
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.report import verify
from tests.dflash_cache.store._util import bf16_features, flip_byte, synthetic_cache


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def test_the_options_codec_names_are_the_registrys():
    """--codec's choices come from the manifest's torch-free list; each names a codec of that name."""
    assert tuple(CODECS) == CODEC_NAMES
    assert all(CODECS[name].name == name for name in CODEC_NAMES)


@pytest.mark.parametrize("codec", ["none", "bf16"])
def test_lossless_round_trip_is_bit_exact(tmp_path, codec):
    m, [(rec, inp)] = synthetic_cache(tmp_path, codec)
    x = inp["features"]
    bits = _bits(x)
    assert (bits == 0x8000).sum() == 13 and (bits == 0).sum() == 13  # negative and positive zeros survive setup
    r = CacheReader(tmp_path)
    assert [rr.name for rr in r.records] == ["u000000-b00000"]

    arrays = r.read_segment(rec.name)
    assert set(arrays) == {"input_ids", "loss_mask", "offsets", "sample_ids", "features"}
    assert arrays["features"].dtype == np.uint16 and arrays["features"].shape == (60, m.feature_width)
    np.testing.assert_array_equal(arrays["features"], bits)
    np.testing.assert_array_equal(arrays["input_ids"], inp["input_ids"])
    np.testing.assert_array_equal(arrays["loss_mask"], inp["loss_mask"])
    np.testing.assert_array_equal(arrays["offsets"], [0, 17, 42, 60])
    np.testing.assert_array_equal(arrays["sample_ids"], [0, 1, 2])

    decoded = r.decode_features(arrays)
    assert decoded.dtype == torch.bfloat16 and decoded.shape == x.shape
    np.testing.assert_array_equal(_bits(decoded), bits)

    for sid, (lo, hi) in zip([0, 1, 2], [(0, 17), (17, 42), (42, 60)], strict=True):
        s = r.sample(sid)
        assert s.segment == rec.name and s.sample_id == sid
        np.testing.assert_array_equal(_bits(s.features), bits[lo:hi])
        np.testing.assert_array_equal(s.input_ids, inp["input_ids"][lo:hi])
        np.testing.assert_array_equal(s.loss_mask, inp["loss_mask"][lo:hi])


def test_fp8_round_trip_within_bound(tmp_path):
    m, [(rec, inp)] = synthetic_cache(tmp_path, "fp8")
    x = inp["features"]
    r = CacheReader(tmp_path)
    arrays = r.read_segment(rec.name)
    assert set(arrays) == {"input_ids", "loss_mask", "offsets", "sample_ids", "features", "scales"}
    assert arrays["features"].dtype == np.uint8 and arrays["features"].shape == (60, m.feature_width)
    assert arrays["scales"].dtype == np.float32 and arrays["scales"].shape == (60, m.n_layers)
    np.testing.assert_array_equal(arrays["features"], inp["stored"]["features"])
    np.testing.assert_array_equal(arrays["scales"], inp["stored"]["scales"])

    bound = fp8_error_bound(x, m.n_layers)
    decoded = r.decode_features(arrays)
    assert decoded.dtype == torch.bfloat16 and decoded.shape == x.shape
    err = (decoded.float() - x.float()).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
    assert err.max().item() > 0  # it is lossy: the comparison is not vacuous
    for sid, (lo, hi) in zip([0, 1, 2], [(0, 17), (17, 42), (42, 60)], strict=True):
        f = r.sample(sid).features
        assert f.shape == (hi - lo, m.feature_width)
        assert bool(((f.float() - x[lo:hi].float()).abs() <= bound[lo:hi]).all())


def test_fp4_round_trip_within_bound(tmp_path):
    """--codec fp4 through the store: its arrays as declared, decoded within the codec's bound,
    the 8 outlier channels per token per layer exact."""
    from dflash_cache.store.codecs.fp4 import FP4_LAYOUT, fp4_error_bound

    m, [(rec, inp)] = synthetic_cache(tmp_path, "fp4")
    x = inp["features"]
    r = CacheReader(tmp_path)
    arrays = r.read_segment(rec.name)
    specs = get_codec("fp4").arrays(m.n_layers, m.hidden_size)
    assert set(arrays) == {"input_ids", "loss_mask", "offsets", "sample_ids", *specs}
    for key, spec in specs.items():
        assert arrays[key].dtype == spec.dtype and arrays[key].shape == (60, spec.columns), key
    decoded = r.decode_features(arrays)
    assert decoded.dtype == torch.bfloat16 and decoded.shape == x.shape
    err = (decoded.float() - x.float()).abs()
    assert bool((err <= fp4_error_bound(x, m.n_layers, FP4_LAYOUT)).all())
    assert int((err == 0).sum()) >= 60 * m.n_layers * FP4_LAYOUT.outliers and err.max().item() > 0
    f = r.sample(1).features
    torch.testing.assert_close(f, decoded[17:42], rtol=0, atol=0)


def test_fp4_outlier_index_outside_the_layer_is_damage_not_a_crash(tmp_path, monkeypatch):
    """A segment whose checksums hold but whose outlier indices point past the hidden size (a
    cache made by other software, or on purpose) is reported as damaged, naming it, by reads and
    by verify; decoding never sees the index (on a GPU it would be a device-side assert)."""
    real_encode = Fp4Codec.encode

    def encode_with_a_bad_index(self, features, n_layers):
        out = real_encode(self, features, n_layers)
        out["outlier_idx"][5, 3] = features.shape[1] // n_layers  # one past a layer's last channel
        return out

    monkeypatch.setattr(Fp4Codec, "encode", encode_with_a_bad_index)
    _, [(rec, _)] = synthetic_cache(tmp_path, "fp4")
    r = CacheReader(tmp_path)
    with pytest.raises(CacheCorruptError, match=f"segment {rec.name}: array outlier_idx: outlier channel 32 is "
                                                 "outside the hidden size 32"):
        r.read_segment(rec.name)
    assert r.sample(2).features.shape[0] == 18  # sample 2 is rows 42..59: its indices are fine
    [problem] = verify(r)
    assert problem.startswith(f"segment {rec.name}: array outlier_idx")


def test_a_cache_of_another_fp4_layout_is_refused_in_one_line(tmp_path, monkeypatch):
    """An fp4 cache written with another layout of the codec (here: codes and scales joined over
    the layers, as before per-layer arrays) is refused when opened, naming both layouts, rather
    than read as damaged segments; a manifest from before layouts were recorded, too."""
    import dataclasses
    import json

    from dflash_cache.store.codecs import fp4

    monkeypatch.setattr(fp4, "FP4_LAYOUT", dataclasses.replace(fp4.FP4_LAYOUT, per_layer=False))
    synthetic_cache(tmp_path, "fp4")
    monkeypatch.undo()
    with pytest.raises(UserError, match=r"stores codec fp4 in layout 'g32 e4m3 top-8 sign-xor'; this release reads "
                                        r"'g32 e4m3 top-8 sign-xor per-layer': extract it again") as info:
        CacheReader(tmp_path)
    assert "\n" not in str(info.value)
    manifest = tmp_path / "manifest.json"
    obj = json.loads(manifest.read_text())
    del obj["codec_layout"]
    manifest.write_text(json.dumps(obj))
    with pytest.raises(UserError, match="stores codec fp4 in an earlier layout"):
        CacheReader(tmp_path)


def test_fp4_refuses_a_hidden_size_it_cannot_group():
    """Groups of 32 must tile a layer's row: a target with another hidden size gets a one-line
    refusal naming the way out, before anything runs."""
    get_codec("fp4").check(4096)
    with pytest.raises(UserError, match=r"--codec fp4 cannot store .*hidden size 48.*use --codec fp8") as info:
        get_codec("fp4").check(48)
    assert "\n" not in str(info.value)
    get_codec("fp8").check(48)


def test_encode_refuses_non_bf16():
    with pytest.raises(ValueError, match="bfloat16"):
        get_codec("bf16").encode(torch.zeros(2, 4), 1)
    with pytest.raises(UserError, match="unknown codec"):
        get_codec("zstd9")


@pytest.mark.parametrize("codec", ["none", "bf16", "fp8"])
def test_flipped_byte_in_features_shard_raises_naming_segment(tmp_path, codec):
    _, [(rec, _)] = synthetic_cache(tmp_path, codec)
    shard = tmp_path / SEGMENTS_DIR / rec.name / "features" / "c" / "0" / "0"
    flip_byte(shard)
    r = CacheReader(tmp_path)
    with pytest.raises(CacheCorruptError, match=rec.name):
        r.read_segment(rec.name)
    with pytest.raises(CacheCorruptError, match=rec.name):
        r.sample(1)


def test_flipped_byte_in_real_cache_raises(cache_copy):
    root = cache_copy("bf16")
    r = CacheReader(root)
    name = r.records[0].name
    flip_byte(root / SEGMENTS_DIR / name / "features" / "c" / "0" / "0")
    with pytest.raises(CacheCorruptError, match=f"segment {name}"):
        r.read_array(name, "features")
    # the other segments still read
    other = r.records[1].name
    assert r.read_array(other, "features").shape[0] == r.records[1].num_tokens


def test_bf16_compresses_smaller_than_none(real_cache, demo_tokens):
    sizes = {}
    for codec in ("none", "bf16", "fp8"):
        r = CacheReader(real_cache(codec))
        feats = sum(size for rec in r.records for rel, size in rec.files.items() if rel.startswith("features/"))
        sizes[codec] = feats
        assert r.num_tokens == demo_tokens
    raw = demo_tokens * 5 * 128 * 2
    assert sizes["none"] >= raw  # checksummed raw bits, no compression
    assert sizes["bf16"] < 0.9 * sizes["none"], sizes
    assert sizes["fp8"] < 0.6 * sizes["none"], sizes


def test_real_caches_agree_across_codecs(real_cache):
    """The lossless codecs store identical features; fp8 and fp4 stay within their bounds of them."""
    from dflash_cache.store.codecs.fp4 import FP4_LAYOUT, fp4_error_bound

    none, bf16, fp8, fp4 = (CacheReader(real_cache(c)) for c in ("none", "bf16", "fp8", "fp4"))
    sid = int(none.index.column("sample_id")[5].as_py())
    a, b, c, d = none.sample(sid), bf16.sample(sid), fp8.sample(sid), fp4.sample(sid)
    np.testing.assert_array_equal(_bits(a.features), _bits(b.features))
    np.testing.assert_array_equal(a.input_ids, c.input_ids)
    np.testing.assert_array_equal(a.input_ids, d.input_ids)
    bound = fp8_error_bound(a.features, 5)
    assert bool(((c.features.float() - a.features.float()).abs() <= bound).all())
    bound4 = fp4_error_bound(a.features, 5, FP4_LAYOUT)
    assert bool(((d.features.float() - a.features.float()).abs() <= bound4).all())
    assert verify(fp4) == []


def test_bf16_features_helper_has_the_promised_specials():
    x = bf16_features(10, 64)
    bits = _bits(x)
    assert (bits == 0x8000).sum() == 13
    assert torch.isfinite(x).all()
