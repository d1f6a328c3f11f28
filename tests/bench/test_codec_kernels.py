"""bench/codec_kernels.py on a CPU: every candidate is in its JSON, timed or skipped with the reason, and
torch.compile of the fp8 reference stores the reference's bits (compiled code could change them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from bench import codec_kernels
from bench.codec_kernels import bit_identical, suggestion

EXPECTED = {("fp8", "encode", "eager"), ("fp8", "decode", "eager")}


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def test_small_run_measures_what_it_is_asked(tmp_path: Path) -> None:
    out = tmp_path / "codec-kernels.json"
    # fp8's eager candidates alone: compiling takes 10-20 s on a CPU with a cold cache (a CI machine's); the
    # compiled and Triton candidates run, and are compared bit for bit, where the benchmark is run (a GPU)
    codec_kernels.main(["--small", "--codecs", "fp8", "--impls", "eager", "--reuse-compile-cache", "--tokens", "16,37",
                        "--repeats", "1", "--warmup", "0", "--json", str(out)])
    res = json.loads(out.read_text())
    assert {"date", "machine", "torch", "command"} <= res.keys()
    assert res["command"].startswith("python3 -m bench.codec_kernels --small")
    rows = {(r["codec"], r["op"], r["impl"]): r for r in res["candidates"]}
    assert set(rows) == EXPECTED
    for key, r in rows.items():
        assert r["error"] is None, (key, r["error"])
        assert _finite(r["first_call_s"]), key
        assert [s["tokens"] for s in r["shapes"]] == [16, 37], key
        for s in r["shapes"]:
            assert _finite(s["median_s"]) and _finite(s["ns_per_token"]) and _finite(s["gb_s"]), (key, s)
            assert s["bit_identical"] is True  # the reference against itself: the comparison runs
    assert res["suggests"].startswith("suggests: ") and "\n" not in res["suggests"]


def test_bit_identical_compares_bits() -> None:
    a = torch.tensor([0.0, 1.5], dtype=torch.bfloat16)
    assert bit_identical(a, a.clone())
    assert not bit_identical(a, torch.tensor([-0.0, 1.5], dtype=torch.bfloat16))  # equal as numbers
    q = torch.tensor([[1, 2]], dtype=torch.uint8)
    assert bit_identical({"q": q, "s": a}, {"s": a.clone(), "q": q.clone()})
    assert not bit_identical({"q": q, "s": a}, {"q": q ^ 1, "s": a})
    assert not bit_identical((q, a), (q, a.float()))


def _row(codec: str, op: str, impl: str, seconds: float, identical: bool = True) -> dict:
    return {"codec": codec, "op": op, "impl": impl, "skipped": None, "error": None, "first_call_s": 1.0,
            "shapes": [{"tokens": 8, "median_s": seconds, "bit_identical": identical}]}


def test_suggestion_compares_the_measured_times() -> None:
    def fp8(triton: float, compiled: float, identical: bool = True) -> list[dict]:
        return [_row("fp8", op, impl, s, identical or impl != "compiled")
                for op in ("encode", "decode") for impl, s in (("triton", triton), ("compiled", compiled))]

    assert "triton faster by 50%" in suggestion(fp8(1.0, 1.5), 0.05)
    assert "compiled faster by 100%" in suggestion(fp8(2.0, 1.0), 0.05)
    assert "triton and compiled within 5%" in suggestion(fp8(1.0, 1.04), 0.05)
    assert "NOT bit-identical to the reference: fp8 encode compiled at 8" in suggestion(fp8(1.0, 1.0, False), 0.05)
    skipped = [{**r, "skipped": "skipped: no GPU", "shapes": []} if r["impl"] == "triton" else r for r in fp8(1, 1)]
    assert "not compared here (skipped: no GPU)" in suggestion(skipped, 0.05)
