"""The GPU's SM clock, power draw and clock-limit reasons while a benchmark runs, sampled by
`nvidia-smi` in a child process: a kernel that runs slower inside the training step than alone
may be running at a lower clock there (an H200 caps its power, and so its clock, under load).

    with ClockSampler(device) as clocks:
        ...  # the timed work
    clocks.summary()  # {"sm_mhz_median": ..., "power_w_median": ..., ...} or None without nvidia-smi
"""

from __future__ import annotations

import logging
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# (field, short name); the reasons are "Active"/"Not Active" (the first newer drivers' names, then older ones)
_BASE_FIELDS = (("clocks.sm", "sm_mhz"), ("clocks.mem", "mem_mhz"), ("power.draw", "power_w"),
                ("enforced.power.limit", "power_limit_w"), ("temperature.gpu", "temp_c"))
_REASON_FIELDS = ({"clocks_event_reasons.sw_power_cap": "power_cap",
                   "clocks_event_reasons.hw_slowdown": "hw_slowdown",
                   "clocks_event_reasons.sw_thermal_slowdown": "thermal"},
                  {"clocks_throttle_reasons.sw_power_cap": "power_cap",
                   "clocks_throttle_reasons.hw_slowdown": "hw_slowdown",
                   "clocks_throttle_reasons.sw_thermal_slowdown": "thermal"})


def _query(device_id: str, fields: list[str]) -> bool:
    """Whether this nvidia-smi knows all `fields` (one query, no loop)."""
    try:
        subprocess.run(["nvidia-smi", "-i", device_id, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                       check=True, capture_output=True, timeout=30)
        return True
    except (subprocess.SubprocessError, OSError):
        return False


class ClockSampler:
    """Samples every `interval_ms` between __enter__ and __exit__; a no-op without a CUDA device or
    nvidia-smi (summary() is then None)."""

    def __init__(self, device: torch.device, interval_ms: int = 50, *, gpu_id: str | None = None) -> None:
        """`gpu_id`: nvidia-smi's name of the GPU; by default the CUDA device's UUID (the CUDA index
        and nvidia-smi's may differ under CUDA_VISIBLE_DEVICES)."""
        self.interval_ms = interval_ms
        self.device_id: str | None = None
        if shutil.which("nvidia-smi") and (gpu_id is not None or device.type == "cuda"):
            self.device_id = gpu_id or f"GPU-{torch.cuda.get_device_properties(device).uuid}"
        self.fields: list[tuple[str, str]] = []
        self._proc: subprocess.Popen | None = None
        self._out: Path | None = None
        self._rows: list[dict[str, str]] = []

    def _choose_fields(self, device_id: str) -> list[tuple[str, str]]:
        base = [f for f, _ in _BASE_FIELDS]
        for reasons in _REASON_FIELDS:
            if _query(device_id, base + list(reasons)):
                return [*_BASE_FIELDS, *reasons.items()]
        return list(_BASE_FIELDS) if _query(device_id, base) else []

    def __enter__(self) -> ClockSampler:
        device_id = self.device_id
        if device_id is None:
            return self
        if not self.fields:
            self.fields = self._choose_fields(device_id)
        if not self.fields:
            log.warning("nvidia-smi cannot report clocks here: no clock samples")
            self.device_id = None
            return self
        fd, name = tempfile.mkstemp(prefix="clocks-", suffix=".csv")
        self._out = Path(name)
        with open(fd, "w") as out:
            self._proc = subprocess.Popen(
                ["nvidia-smi", "-i", device_id, f"--query-gpu={','.join(f for f, _ in self.fields)}",
                 "--format=csv,noheader,nounits", f"-lms={self.interval_ms}"], stdout=out, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        out = self._out
        if out is None:  # not reached: __enter__ names the file before it starts the process
            raise RuntimeError("ClockSampler: nvidia-smi ran without an output file")
        self._proc.terminate()
        self._proc.wait(timeout=30)
        names = [n for _, n in self.fields]
        for line in out.read_text().splitlines():
            values = [v.strip() for v in line.split(",")]
            if len(values) == len(names):
                self._rows.append(dict(zip(names, values, strict=True)))
        out.unlink()
        self._proc = None

    def summary(self) -> dict | None:
        """Medians and extremes of the samples, and the share of samples under each clock limit."""
        if not self._rows:
            return None

        def numbers(name: str) -> list[float]:
            out = []
            for row in self._rows:
                try:
                    out.append(float(row[name]))
                except (KeyError, ValueError):  # "[N/A]"
                    pass
            return out

        result: dict[str, float | int] = {"samples": len(self._rows)}
        for name in ("sm_mhz", "mem_mhz", "power_w", "temp_c"):
            values = numbers(name)
            if values:
                result[f"{name}_median"] = statistics.median(values)
                result[f"{name}_min"], result[f"{name}_max"] = min(values), max(values)
        limits = numbers("power_limit_w")
        if limits:
            result["power_limit_w"] = max(limits)
        for _, name in self.fields[len(_BASE_FIELDS):]:
            result[f"{name}_share"] = sum(row.get(name) == "Active" for row in self._rows) / len(self._rows)
        return result


def describe(summary: dict | None) -> str:
    """One line for a log: SM clock, power against its limit, the share of samples at the power cap."""
    if not summary or "sm_mhz_median" not in summary:
        return "clocks: not sampled"
    text = (f"SM clock {summary['sm_mhz_median']:.0f} MHz (min {summary['sm_mhz_min']:.0f}, max "
            f"{summary['sm_mhz_max']:.0f})")
    if "power_w_median" in summary:
        text += f", power {summary['power_w_median']:.0f} W (max {summary['power_w_max']:.0f}"
        text += f" of {summary['power_limit_w']:.0f})" if "power_limit_w" in summary else ")"
    if "power_cap_share" in summary:
        text += f", at the power cap in {summary['power_cap_share']:.0%} of {summary['samples']} samples"
    return text
