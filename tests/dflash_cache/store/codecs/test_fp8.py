"""Tests for the fp8 codec: torch reference path, error bound, and the Triton kernels (interpreter)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dflash_cache.store.codecs import fp8

REPO_ROOT = Path(__file__).resolve().parents[4]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _roundtrip(x: torch.Tensor, n_layers: int) -> torch.Tensor:
    q, s = fp8.quantize_fp8(x, n_layers)
    return fp8.dequantize_fp8(q, s, n_layers)


def _assert_within_bound(x: torch.Tensor, n_layers: int) -> torch.Tensor:
    x_hat = _roundtrip(x, n_layers)
    assert x_hat.dtype == torch.bfloat16 and x_hat.shape == x.shape
    assert torch.isfinite(x_hat).all()
    err = (x_hat.float() - x.float()).abs()
    bound = fp8.fp8_error_bound(x, n_layers)
    excess = (err - bound).max().item()
    assert excess <= 0, f"error exceeds documented bound by {excess}"
    return x_hat


# ---------------------------------------------------------------------------------- torch path


def test_shapes_and_dtypes():
    x = torch.randn(7, 5 * 96).to(torch.bfloat16)
    q, s = fp8.quantize_fp8(x, 5)
    assert q.dtype == torch.uint8 and q.shape == (7, 480) and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (7, 5) and s.is_contiguous()
    expect = x.float().reshape(7, 5, 96).abs().amax(-1) / 448.0
    torch.testing.assert_close(s, expect, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(1, 1, 64), (7, 5, 96), (64, 5, 96), (16, 2, 5120)])
def test_roundtrip_normal_within_bound(shape):
    t, n_layers, h = shape
    torch.manual_seed(1)
    x = torch.randn(t, n_layers * h).to(torch.bfloat16)
    x_hat = _assert_within_bound(x, n_layers)
    rel = ((x_hat.float() - x.float()).norm() / x.float().norm()).item()
    assert 0.015 < rel < 0.035


def test_relative_frobenius_error_on_standard_normal():
    torch.manual_seed(2)
    x = torch.randn(256, 2 * 4096).to(torch.bfloat16)
    x_hat = _roundtrip(x, 2)
    rel = ((x_hat.float() - x.float()).norm() / x.float().norm()).item()
    assert 0.02 < rel < 0.03, rel


def test_bound_is_tight_ish():
    # the worst relative error seen on random data should be close to the documented constant
    torch.manual_seed(3)
    x = torch.randn(256, 4096).to(torch.bfloat16)
    x_hat = _assert_within_bound(x, 1)
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    ratio = ((x_hat.float() - xf).abs() - fp8.FP8_AMAX_ERROR_BOUND * amax) / xf.abs()
    worst = ratio.nan_to_num(0.0).max().item()
    assert 0.8 * fp8.FP8_RELATIVE_ERROR_BOUND < worst <= fp8.FP8_RELATIVE_ERROR_BOUND


def test_outliers_within_bound():
    torch.manual_seed(4)
    x = torch.randn(32, 3 * 96)
    idx = torch.randint(0, x.numel(), (40,))
    x.view(-1)[idx] *= 100.0
    _assert_within_bound(x.to(torch.bfloat16), 3)


def test_zero_rows_and_zero_layers():
    x = torch.randn(6, 4 * 64).to(torch.bfloat16)
    x[2] = 0
    x[4, 64:128] = 0
    q, s = fp8.quantize_fp8(x, 4)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert (q[2] == 0).all() and (q[4, 64:128] == 0).all()
    x_hat = fp8.dequantize_fp8(q, s, 4)
    assert (x_hat[2] == 0).all() and (x_hat[4, 64:128] == 0).all()
    _assert_within_bound(x, 4)


def test_tiny_layer_no_nan():
    torch.manual_seed(5)
    x = torch.randn(8, 3 * 96)
    mag = 10.0 ** torch.empty(8, 96).uniform_(-30, -20)
    x[:, 96:192] = mag * torch.sign(torch.randn(8, 96))
    x = x.to(torch.bfloat16)
    q, s = fp8.quantize_fp8(x, 3)
    assert torch.isfinite(s).all() and (s > 0).all()
    x_hat = _assert_within_bound(x, 3)
    assert (x_hat[:, 96:192] != 0).any()


def test_negative_zero_and_out_param():
    x = torch.randn(3, 2 * 64).to(torch.bfloat16)
    x[0, 5] = -0.0
    q, s = fp8.quantize_fp8(x, 2)
    assert q[0, 5].item() == 0x80
    out = torch.full((3, 128), 7.0, dtype=torch.bfloat16)
    res = fp8.dequantize_fp8(q, s, 2, out=out)
    assert res is out
    assert torch.equal(_bits(out), _bits(fp8.dequantize_fp8_torch(q, s, 2)))


def test_empty_batch():
    x = torch.empty(0, 2 * 64, dtype=torch.bfloat16)
    q, s = fp8.quantize_fp8(x, 2)
    assert q.shape == (0, 128) and s.shape == (0, 2)
    assert fp8.dequantize_fp8(q, s, 2).shape == (0, 128)


def test_bad_inputs_raise_value_error():
    x = torch.randn(4, 128)
    with pytest.raises(ValueError, match="bfloat16"):
        fp8.quantize_fp8(x, 2)
    with pytest.raises(ValueError, match="bfloat16"):
        fp8.quantize_fp8(x.half(), 2)
    xb = x.to(torch.bfloat16)
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize_fp8(xb.reshape(4, 2, 64), 2)
    with pytest.raises(ValueError, match="multiple"):
        fp8.quantize_fp8(xb, 3)
    with pytest.raises(ValueError, match="n_layers"):
        fp8.quantize_fp8(xb, 0)
    q, s = fp8.quantize_fp8(xb, 2)
    with pytest.raises(ValueError, match="uint8"):
        fp8.dequantize_fp8(q.to(torch.int8), s, 2)
    with pytest.raises(ValueError, match="float32"):
        fp8.dequantize_fp8(q, s.double(), 2)
    with pytest.raises(ValueError, match="shape"):
        fp8.dequantize_fp8(q, s[:, :1], 2)
    with pytest.raises(ValueError, match="out"):
        fp8.dequantize_fp8(q, s, 2, out=torch.empty(4, 128))
    with pytest.raises(ValueError, match="out"):
        fp8.dequantize_fp8(q, s, 2, out=torch.empty(4, 64, dtype=torch.bfloat16))
    for fn in (fp8.quantize_fp8_torch, fp8.quantize_fp8_triton):
        with pytest.raises(ValueError):
            fn(x, 2)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not importable here")
def test_triton_on_cpu_without_interpreter_is_refused():
    # in a subprocess: this pytest process must not import triton (other tests may want the
    # interpreter, which has to be chosen before triton's import)
    code = textwrap.dedent(
        """
        import os
        import torch
        from dflash_cache.store.codecs import fp8
        x = torch.zeros(1, 64, dtype=torch.bfloat16)
        for env in ("0", "1"):  # unset, then changed after triton's import: both refused
            os.environ["TRITON_INTERPRET"] = env
            try:
                fp8.quantize_fp8_triton(x, 1)
            except RuntimeError as e:
                assert "TRITON_INTERPRET" in str(e), e
            else:
                raise AssertionError("expected RuntimeError")
        print("ok")
        """
    )
    res = _run_python(code, {"TRITON_INTERPRET": "0"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("ok")


def test_import_without_triton():
    # importing the module and using the dispatchers must not need triton (e.g. macOS)
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch
        from dflash_cache.store.codecs import fp8
        assert not fp8.triton_available()
        x = torch.randn(3, 128).to(torch.bfloat16)
        q, s = fp8.quantize_fp8(x, 2)
        fp8.dequantize_fp8(q, s, 2)
        try:
            fp8.quantize_fp8_triton(x, 2)
        except RuntimeError as e:
            assert "triton" in str(e)
        else:
            raise AssertionError("expected RuntimeError")
        print("ok")
        """
    )
    res = _run_python(code, {})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("ok")


# ---------------------------------------------------------------------- Triton, interpreted

# TRITON_INTERPRET is read when @triton.jit decorates a kernel (triton 3.9); fp8.py builds its
# kernels on first use and keys them on the variable, but to be independent of whatever else the
# test session has imported or compiled, all interpreter checks run in one fresh subprocess.

_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    from dflash_cache.store.codecs import fp8

    def bits(t):
        return t.view(torch.int16)

    def check(x, n_layers):
        q1, s1 = fp8.quantize_fp8_torch(x, n_layers)
        q2, s2 = fp8.quantize_fp8_triton(x, n_layers)
        d1 = fp8.dequantize_fp8_torch(q1, s1, n_layers)
        d2 = fp8.dequantize_fp8_triton(q1, s1, n_layers)
        out = torch.empty_like(d1)
        d3 = fp8.dequantize_fp8_triton(q1, s1, n_layers, out=out)
        return {
            "q": torch.equal(q1, q2),
            "scales": torch.equal(s1, s2),
            "deq": torch.equal(bits(d1), bits(d2)),
            "out": d3 is out and torch.equal(bits(d1), bits(out)),
        }

    results = {}
    torch.manual_seed(0)
    for t in (1, 7, 64):
        for n_layers in (1, 5):
            for h in (64, 96):
                x = torch.randn(t, n_layers * h)
                x.view(-1)[torch.randint(0, x.numel(), (3,))] *= 100.0
                x = x.to(torch.bfloat16)
                results[f"T{t}_L{n_layers}_H{h}"] = check(x, n_layers)

    x = torch.randn(9, 3 * 96)
    x[4] = 0
    x[6, 96:192] = 0
    x[2, 192:] = 10.0 ** torch.empty(96).uniform_(-30, -20)
    x[0, 3] = -0.0
    results["zeros_tiny_negzero"] = check(x.to(torch.bfloat16), 3)

    # every finite bf16 value in [-448, 448] with scale 1.0: exhaustive check of the rounding,
    # ties and e4m3 subnormals included
    b = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    b = b[torch.isfinite(b) & (b.float().abs() <= 448)]
    x = torch.cat([b, torch.tensor([448.0], dtype=torch.bfloat16)])
    x = torch.cat([x, torch.zeros(-x.numel() % 3, dtype=torch.bfloat16)]).reshape(1, -1)
    results["exhaustive_bf16"] = check(x, 1)

    # random scales: x / scale hits arbitrary float32 values
    x = (torch.randn(64, 2 * 96) * torch.rand(64, 1) * 1e3).to(torch.bfloat16)
    results["random_scales"] = check(x, 2)

    # non-contiguous rows (a column slice of a wider buffer) and H = 5120
    wide = torch.randn(5, 3 * 5120 + 17).to(torch.bfloat16)
    results["strided_H5120"] = check(wide[:, : 2 * 5120], 2)

    # every e4m3 code except NaN, with random scales
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    q = q[(q & 0x7F) != 0x7F].reshape(1, -1).repeat(8, 1)
    s = torch.rand(8, 1) * 10 + 1e-3
    results["all_codes"] = {
        "deq": torch.equal(bits(fp8.dequantize_fp8_torch(q, s, 1)), bits(fp8.dequantize_fp8_triton(q, s, 1)))
    }
    print("RESULTS " + json.dumps(results))
    """
)

_INTERPRETER_CASES = [f"T{t}_L{n}_H{h}" for t in (1, 7, 64) for n in (1, 5) for h in (64, 96)] + [
    "zeros_tiny_negzero",
    "exhaustive_bf16",
    "random_scales",
    "strided_H5120",
    "all_codes",
]


def _run_python(code: str, extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**os.environ, **extra_env}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not importable here; the Triton kernels cannot be tested")
    res = _run_python(_INTERPRETER_SCRIPT, {"TRITON_INTERPRET": "1"})
    assert res.returncode == 0, f"interpreter run failed:\n{res.stdout}\n{res.stderr}"
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULTS "))
    return json.loads(line[len("RESULTS ") :])


@pytest.mark.parametrize("case", _INTERPRETER_CASES)
def test_triton_interpreter_matches_torch(interpreter_results, case):
    checks = interpreter_results[case]
    failed = [name for name, ok in checks.items() if not ok]
    assert not failed, f"{case}: triton differs from torch in {failed}"
