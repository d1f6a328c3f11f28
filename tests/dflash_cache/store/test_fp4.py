"""Tests for the fp4 (e2m1, group-scaled) torch reference codec."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_cache.store import fp4
from dflash_cache.store.codecs import to_stored_numpy
from dflash_cache.store.fp4 import Fp4Config

CONFIGS = [
    Fp4Config(16, "e4m3"),
    Fp4Config(32, "bf16"),
    Fp4Config(16, "e4m3", outliers=4),
    Fp4Config(64, "bf16", outliers=2),
]


def _roundtrip(x: torch.Tensor, n_layers: int, cfg: Fp4Config) -> torch.Tensor:
    return fp4.dequantize_fp4(fp4.quantize_fp4(x, n_layers, cfg), n_layers, cfg)


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


def test_ties_round_to_even_code() -> None:
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0])
    got = fp4._grid(torch.device("cpu"))[fp4._e2m1_codes(mids).long()]
    assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0]


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


@pytest.mark.parametrize(
    "cfg", [Fp4Config(12, "e4m3"), Fp4Config(15, "e4m3"), Fp4Config(16, "fp8"), Fp4Config(16, "e4m3", -1)]
)
def test_rejects_bad_config(cfg: Fp4Config) -> None:
    with pytest.raises(ValueError):
        fp4.quantize_fp4(torch.zeros(1, 64, dtype=torch.bfloat16), 1, cfg)


def test_rejects_non_bf16() -> None:
    with pytest.raises(ValueError):
        fp4.quantize_fp4(torch.zeros(1, 64), 1, Fp4Config())
    assert np.dtype(np.uint8) == fp4.fp4_arrays(Fp4Config(), 1, 64)["codes"].dtype
