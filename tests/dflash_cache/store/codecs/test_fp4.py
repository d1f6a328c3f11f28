"""Tests for the fp4 (e2m1, group-scaled) torch reference codec."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from zarr.storage import LocalStore

from dflash_cache.store.codecs import ArraySpec, fp4, to_stored_numpy
from dflash_cache.store.codecs.fp4 import FP4_LAYOUT, Fp4Config
from dflash_cache.store.segments import write_array

CONFIGS = [
    Fp4Config(16, "e4m3"),
    Fp4Config(32, "bf16"),
    Fp4Config(16, "e4m3", outliers=4),
    Fp4Config(64, "bf16", outliers=2),
    Fp4Config(32, "e4m3", outliers=8, sign_xor=True),
    Fp4Config(32, "e4m3", outliers=8, sign_xor=True, per_layer=True),
    Fp4Config(16, "bf16", per_layer=True),
]


def _roundtrip(x: torch.Tensor, n_layers: int, cfg: Fp4Config) -> torch.Tensor:
    return fp4.dequantize_fp4(fp4.quantize_fp4(x, n_layers, cfg), n_layers, cfg)


def _residual(t: int, n_layers: int, h: int, seed: int = 0) -> torch.Tensor:
    """A residual stream: each layer adds N(0, 0.6**2) to the last, so a channel's sign mostly
    carries over (88-96% here) while every channel looks alike, like a random-weight Qwen3's."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, 1, h, generator=g) + 0.6 * torch.randn(t, n_layers, h, generator=g)).cumsum(dim=1)
    return x.reshape(t, n_layers * h).to(torch.bfloat16)


def _stored_bytes(tmp_path: Path, name: str, a: np.ndarray, spec: ArraySpec) -> int:
    """Bytes of `a`'s shard files as the segment writer stores it (Blosc, CRC32C, shard index)."""
    write_array(LocalStore(tmp_path), name, a, spec.compressors)
    return sum(p.stat().st_size for p in (tmp_path / name / "c").rglob("*") if p.is_file())


def _heavy(t: int, n_layers: int, h: int, seed: int = 0) -> torch.Tensor:
    """Normal data with per-channel scales (e**N(0,1)) and two huge fixed channels per layer."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n_layers, h, generator=g) * torch.exp(torch.randn(n_layers, h, generator=g))
    x[:, :, 3] = 3000.0
    x[:, :, h - 1] = -1500.0
    return x.reshape(t, n_layers * h).to(torch.bfloat16)


@pytest.mark.parametrize("scale_format", ["e4m3", "bf16"])
def test_e2m1_grid_roundtrips_exactly(scale_format: str) -> None:
    grid = torch.tensor(fp4.E2M1_GRID)
    row = torch.cat([grid, -grid, grid.flip(0), -grid.flip(0)])  # amax 6 in every group of 16
    x = torch.stack([row, 2.5 * row, 2.0**-20 * row]).to(torch.bfloat16)
    cfg = Fp4Config(16, scale_format)
    assert torch.equal(_roundtrip(x, 1, cfg).view(torch.int16), x.view(torch.int16))


@pytest.mark.parametrize("scale", [1.0, 0.375, 2.0**-20])
def test_ties_round_to_even_code_and_beyond_6_to_6(scale: float) -> None:
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0, 7.0, -100.0, -0.0, 0.0]) * scale
    codes = fp4._e2m1_codes(x, torch.tensor(scale))
    got = fp4._grid(torch.device("cpu"))[codes.long()]
    assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0, 6.0, -6.0, -0.0, 0.0]
    assert codes[-2] == 8 and codes[-1] == 0  # the sign of zero is kept
    assert not fp4._e2m1_codes(x, torch.tensor(0.0)).any()  # a zero scale stores zeros


def test_row_scales_are_the_least_power_of_two_that_keeps_scales_in_e4m3() -> None:
    amax = torch.tensor([2688.0, 2688.5, 1.0, 3.0e-30, 0.0, 6e4])
    row, inverse = fp4._row_scales(amax)
    assert torch.equal(row * inverse, torch.ones_like(row))
    assert row.tolist()[:2] == [1.0, 2.0] and row[4] == 1.0
    k = torch.log2(row[[0, 1, 2, 3, 5]])
    assert torch.equal(k, k.round())  # powers of two
    lo = amax[[0, 1, 2, 3, 5]] / (fp4.E2M1_MAX * fp4.E4M3_MAX)
    assert bool((row[[0, 1, 2, 3, 5]] >= lo).all() and (row[[0, 1, 2, 3, 5]] / 2 < lo).all())


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_shapes_and_dtypes(cfg: Fp4Config) -> None:
    t, n_layers, h = 3, 5, 128
    x = torch.randn(t, n_layers * h).to(torch.bfloat16)
    enc = fp4.quantize_fp4(x, n_layers, cfg)
    specs = fp4.fp4_arrays(cfg, n_layers, h)
    assert set(enc) == set(specs)
    for name, a in to_stored_numpy(enc).items():
        assert a.dtype == specs[name].dtype and a.shape == (t, specs[name].columns), name
    out = fp4.dequantize_fp4(enc, n_layers, cfg)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    # the reader hands back unsigned numpy arrays; decoding them gives the same bits
    stored = {k: torch.from_numpy(v.copy()) for k, v in to_stored_numpy(enc).items()}
    assert torch.equal(fp4.dequantize_fp4(stored, n_layers, cfg).view(torch.int16), out.view(torch.int16))


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_error_within_bound(cfg: Fp4Config) -> None:
    for x in (torch.randn(64, 3 * 256).to(torch.bfloat16), _heavy(16, 3, 256)):
        err = (_roundtrip(x, 3, cfg).float() - x.float()).abs()
        assert (err - fp4.fp4_error_bound(x, 3, cfg)).max().item() <= 0


def test_relative_error_on_normal_data() -> None:
    x = torch.randn(64, 4 * 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x_hat = _roundtrip(x, 4, Fp4Config(16, "e4m3"))
    rel = ((x_hat.float() - x.float()).norm() / x.float().norm()).item()
    assert 0.05 < rel < 0.12


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.outliers], ids=str)
def test_outlier_channels_exact(cfg: Fp4Config) -> None:
    n_layers, h = 3, 256
    x = _heavy(8, n_layers, h)
    x_hat = _roundtrip(x, n_layers, cfg).reshape(8, n_layers, h)
    xr = x.reshape(8, n_layers, h)
    for ch in (3, h - 1):  # the two planted channels are always among the top-k
        assert torch.equal(x_hat[:, :, ch].view(torch.int16), xr[:, :, ch].view(torch.int16))
    idx = fp4.quantize_fp4(x, n_layers, cfg)["outlier_idx"].reshape(8, n_layers, -1).long()
    assert torch.equal(x_hat.gather(-1, idx).view(torch.int16), xr.gather(-1, idx).view(torch.int16))


def test_outliers_restore_body_precision() -> None:
    """One scale per layer row: without outliers the huge channels flatten the body to zero."""
    x = _heavy(16, 2, 128)
    rest = torch.ones(2 * 128, dtype=torch.bool)
    rest[[3, 127, 128 + 3, 255]] = False
    norm = x.float()[:, rest].norm().item()
    errs = [
        (_roundtrip(x, 2, Fp4Config(128, "bf16", k)).float() - x.float())[:, rest].norm().item()
        for k in (0, 2)
    ]
    assert errs[0] / norm > 0.9 and errs[1] / norm < 0.25


def test_packing_positions() -> None:
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = fp4.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert torch.equal(fp4.unpack_nibbles(packed), codes)
    # one value at an odd position lands in the high nibble only
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    x[0, 5] = -6.0
    enc = fp4.quantize_fp4(x, 1, Fp4Config(16, "bf16"))
    assert enc["codes"][0].tolist() == [0, 0, 0xF0, 0, 0, 0, 0, 0]
    assert _roundtrip(x, 1, Fp4Config(16, "bf16"))[0, 5].item() == -6.0


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_all_zero_row(cfg: Fp4Config) -> None:
    x = torch.zeros(2, 2 * 128, dtype=torch.bfloat16)
    x[1, :128] = torch.randn(128).to(torch.bfloat16)  # a silent layer beside a loud one
    x_hat = _roundtrip(x, 2, cfg)
    assert torch.isfinite(x_hat).all()
    assert not x_hat[0].any() and not x_hat[1, 128:].any()


@pytest.mark.parametrize("make", [_heavy, _residual])
def test_sign_xor_is_lossless(make) -> None:
    """Signs stored relative to the previous layer decode to the very bits of the plain layout;
    only the sign bits of layers 1.. differ in the stored codes."""
    n_layers, h = 4, 256
    x = make(16, n_layers, h)
    plain, chained = Fp4Config(32, "e4m3", outliers=8), Fp4Config(32, "e4m3", outliers=8, sign_xor=True)
    assert chained.sign_xor and chained.codes_key != plain.codes_key  # one layout's reader cannot take the other's
    enc, enc_x = fp4.quantize_fp4(x, n_layers, plain), fp4.quantize_fp4(x, n_layers, chained)
    assert torch.equal(fp4.dequantize_fp4(enc_x, n_layers, chained).view(torch.int16),
                       fp4.dequantize_fp4(enc, n_layers, plain).view(torch.int16))
    codes, codes_x = enc.pop(plain.codes_key), enc_x.pop(chained.codes_key)
    diff = (fp4.unpack_nibbles(codes) ^ fp4.unpack_nibbles(codes_x)).reshape(16, n_layers, h)
    assert not diff[:, 0].any() and not (diff & 7).any() and diff.any()
    assert enc.keys() == enc_x.keys() and all(torch.equal(enc[k], enc_x[k]) for k in enc)


@pytest.mark.parametrize("scale_format", ["e4m3", "bf16"])
def test_per_layer_arrays_are_the_joined_columns(scale_format: str) -> None:
    """One array per layer stores exactly layer l's columns of the joined codes and scales, under
    names the joined layout never uses, and decodes to the same bits."""
    n_layers, h = 3, 128
    x = _residual(8, n_layers, h)
    joined = Fp4Config(32, scale_format, outliers=4, sign_xor=True)
    split = Fp4Config(32, scale_format, outliers=4, sign_xor=True, per_layer=True)
    enc, enc_s = fp4.quantize_fp4(x, n_layers, joined), fp4.quantize_fp4(x, n_layers, split)
    assert enc_s.keys() == fp4.fp4_arrays(split, n_layers, h).keys()
    assert not enc.keys() & {*split.split_keys(split.codes_key, n_layers), *split.split_keys("scales", n_layers)}
    for key in (joined.codes_key, "scales"):
        parts = split.split_keys(key, n_layers)
        assert all(enc_s[k].is_contiguous() for k in parts)
        assert torch.equal(torch.cat([enc_s[k] for k in parts], dim=1), enc.pop(key))
        for k in parts:
            assert fp4.fp4_arrays(split, n_layers, h)[k].columns == enc_s.pop(k).shape[1]
    assert enc.keys() == enc_s.keys() and all(torch.equal(enc[k], enc_s[k]) for k in enc)
    assert torch.equal(fp4.dequantize_fp4(fp4.quantize_fp4(x, n_layers, split), n_layers, split).view(torch.int16),
                       fp4.dequantize_fp4(fp4.quantize_fp4(x, n_layers, joined), n_layers, joined).view(torch.int16))


def test_per_layer_arrays_compress(tmp_path: Path) -> None:
    """On a residual stream with signs XOR the previous layer's, the first layer's codes (raw signs)
    and the others' (mostly 0) want different Huffman tables: one array per layer stores the codes
    and scales in fewer bytes than one array of all layers."""
    t, n_layers, h = 256, 5, 1024
    x = _residual(t, n_layers, h)
    sizes = []
    for i, cfg in enumerate((Fp4Config(32, "e4m3", 8, sign_xor=True), FP4_LAYOUT)):
        assert cfg.per_layer == bool(i)
        arrays, specs = to_stored_numpy(fp4.quantize_fp4(x, n_layers, cfg)), fp4.fp4_arrays(cfg, n_layers, h)
        keys = [*cfg.split_keys(cfg.codes_key, n_layers), *cfg.split_keys("scales", n_layers)]
        sizes.append(sum(_stored_bytes(tmp_path / f"{i}-{k}", k, arrays[k], specs[k]) for k in keys))
    assert sizes[1] <= 0.98 * sizes[0], sizes


def test_xor_layer_signs_inverts() -> None:
    codes = torch.randint(0, 16, (3, 5, 7), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(fp4.unxor_layer_signs(fp4.xor_layer_signs(codes)), codes)
    assert fp4.xor_layer_signs(torch.tensor([[[8], [8], [0], [9]]], dtype=torch.uint8)).flatten().tolist() == [8, 0, 8, 9]


def test_sign_xor_codes_compress(tmp_path: Path) -> None:
    """On a residual stream zstd leaves the plain codes ~raw (their order-0 gain is below its 1/64
    threshold) but takes >= 5% off the codes with signs relative to the previous layer."""
    t, n_layers, h = 256, 5, 1024
    x = _residual(t, n_layers, h)
    raw = t * n_layers * h // 2
    sizes = []
    for i, cfg in enumerate((Fp4Config(32, "e4m3", outliers=8), Fp4Config(32, "e4m3", outliers=8, sign_xor=True))):
        key = cfg.codes_key
        codes = to_stored_numpy(fp4.quantize_fp4(x, n_layers, cfg))[key]
        sizes.append(_stored_bytes(tmp_path / str(i), key, codes, fp4.fp4_arrays(cfg, n_layers, h)[key]))
    assert sizes[0] >= 0.98 * raw and sizes[1] <= 0.95 * raw, (sizes, raw)


@pytest.mark.parametrize(
    "cfg",
    [Fp4Config(12, "e4m3"), Fp4Config(15, "e4m3"), Fp4Config(16, "fp8"), Fp4Config(16, "e4m3", -1),
     Fp4Config(16, "e4m3", 0, 1), Fp4Config(16, "e4m3", 0, False, 1)],
)
def test_rejects_bad_config(cfg: Fp4Config) -> None:
    with pytest.raises(ValueError):
        fp4.quantize_fp4(torch.zeros(1, 64, dtype=torch.bfloat16), 1, cfg)


def test_rejects_non_bf16() -> None:
    with pytest.raises(ValueError):
        fp4.quantize_fp4(torch.zeros(1, 64), 1, Fp4Config())
    assert np.dtype(np.uint8) == fp4.fp4_arrays(Fp4Config(), 1, 64)["codes"].dtype


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_quantisation_on_the_gpu_stores_what_eager_does() -> None:
    """What `--codec fp4` runs on a GPU (compiled, dynamic shapes) stores the very arrays of the
    eager reference, for batches of several sizes, and decodes within the error bound."""
    n_layers, h = 5, 512
    for t in (1, 37, 3000):
        x = _heavy(t, n_layers, h).cuda()
        got, want = fp4.quantize_fp4_layout(x, n_layers), fp4.quantize_fp4(x, n_layers, FP4_LAYOUT)
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (t, k)
        err = (fp4.dequantize_fp4(got, n_layers, FP4_LAYOUT).float() - x.float()).abs()
        assert bool((err <= fp4.fp4_error_bound(x, n_layers, FP4_LAYOUT) + 1e-12).all())
