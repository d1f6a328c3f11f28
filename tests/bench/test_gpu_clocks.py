"""bench/gpu_clocks.py against a stand-in nvidia-smi: the README's clock figures come from its parsing."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
import torch

from bench.gpu_clocks import ClockSampler, describe

# Answers a one-off query, loops on -lms; knows only the older "throttle" names of the limit reasons,
# so the sampler has to fall back to them. Every third sample is off the power cap, one has "[N/A]" power.
FAKE_SMI = """#!/bin/sh
case "$*" in *clocks_event_reasons*) echo "Field not supported" >&2; exit 2;; esac
case "$*" in
  *-lms=*)
    while true; do
      echo "1500, 3201, 690.5, 700.00, 60, Active, Not Active, Not Active"
      echo "1980, 3201, [N/A], 700.00, 60, Not Active, Not Active, Not Active"
      echo "1400, 3201, 698.0, 700.00, 61, Active, Not Active, Not Active"
      sleep 0.02
    done;;
esac
echo "345, 3201, 80.0, 700.00, 40, Not Active, Not Active, Not Active"
"""


@pytest.fixture
def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_samples_are_summarised_with_the_older_field_names(fake_smi) -> None:
    clocks = ClockSampler(torch.device("cpu"), interval_ms=20, gpu_id="GPU-test")
    with clocks:
        time.sleep(0.5)
    summary = clocks.summary()
    assert summary["samples"] >= 3
    assert (summary["sm_mhz_min"], summary["sm_mhz_max"]) == (1400, 1980)
    assert (summary["power_w_min"], summary["power_w_max"]) == (690.5, 698.0)  # "[N/A]" skipped, not read as 0
    assert summary["power_limit_w"] == 700.0
    assert 0.5 <= summary["power_cap_share"] <= 0.75  # two of every three samples
    assert summary["thermal_share"] == 0.0
    assert describe(summary).startswith("SM clock ")


def test_nothing_is_sampled_without_a_gpu() -> None:
    clocks = ClockSampler(torch.device("cpu"))
    with clocks:
        pass
    assert clocks.summary() is None
    assert describe(clocks.summary()) == "clocks: not sampled"
