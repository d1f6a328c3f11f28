"""Running Triton kernels' checks under the interpreter, for the tests of those kernels.

TRITON_INTERPRET must be set before triton is imported, so a check script runs in a fresh
subprocess and prints one line `RESULTS <json>`, which the tests then assert on."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest


def run_interpreted(script: str, timeout: int = 300) -> dict:
    """`script`'s RESULTS, run by this Python with TRITON_INTERPRET=1; skips where triton is missing."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not importable here; the Triton kernel cannot be tested")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout,
                         check=False)
    assert res.returncode == 0, f"interpreter run failed:\n{res.stdout}\n{res.stderr}"
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])
