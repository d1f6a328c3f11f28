"""Experiment trackers beside metrics.jsonl: `train --report-to tensorboard,wandb`.

Each tracker gets the rows metrics.jsonl gets (training rows, and evaluation rows under `eval/`) and,
with `--profile-interval`, the profiler's reports (stage times, tokens/s, TFLOP/s and MFU under
`profile/`). Nothing changes for a run that names none: metrics.jsonl stays the record, and the
trackers are optional extras (`pip install 'dflash-cache[tensorboard]'` or `[wandb]`), imported only
when named. W&B is configured as HF Trainer users know it, by its own environment (WANDB_PROJECT,
WANDB_MODE=offline, WANDB_DIR, ...); a resumed run continues the W&B run it started (its id is kept
in the run directory).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from pathlib import Path
from typing import Any, Protocol

from dflash_cache.errors import UserError
from dflash_cache.files import write_bytes_atomic

log = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "wandb")
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"


class Tracker(Protocol):
    def log(self, values: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def parse_report_to(value: str | None) -> tuple[str, ...]:
    """`--report-to` as a tuple of tracker names ('none' or nothing: none); a wrong one is a UserError."""
    names = tuple(n.strip() for n in (value or "").split(",") if n.strip() and n.strip() != "none")
    wrong = [n for n in names if n not in TRACKERS]
    if wrong:
        raise UserError(f"--report-to {value}: unknown tracker {wrong[0]!r}; choose from {', '.join(TRACKERS)} "
                        "(comma-separated), or none")
    return tuple(dict.fromkeys(names))


def scalars(row: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """A metrics.jsonl row as (step, {tag: value}): training fields under `train/`, an evaluation
    row's (`split: eval`, fields `eval_*`) under `eval/`, per-slot accuracies as `.../slot_acc/k`;
    nulls (a window whose steps were all skipped) are left out."""
    group = "eval" if row.get("split") == "eval" else "train"
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in ("step", "split") or value is None or isinstance(value, str):
            continue
        name = key.removeprefix("eval_") if group == "eval" else key
        if isinstance(value, list):
            out.update({f"{group}/{name}/{k}": float(v) for k, v in enumerate(value, start=1) if v is not None})
        elif isinstance(value, bool | int | float) and math.isfinite(float(value)):
            out[f"{group}/{name}"] = float(value)
    return int(row["step"]), out


class _TensorBoard:
    def __init__(self, out: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("--report-to tensorboard needs the tensorboard package: pip install "
                            "'dflash-cache[tensorboard]'") from None
        self.writer = SummaryWriter(log_dir=str(out / TENSORBOARD_DIR))

    def log(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise UserError("--report-to wandb needs the wandb package: pip install 'dflash-cache[wandb]'") from None
        id_file = out / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        self.run = wandb.init(id=run_id, resume="allow", name=out.resolve().name, config=config,
                              project=os.environ.get("WANDB_PROJECT", "dflash-cache"),
                              dir=os.environ.get("WANDB_DIR", str(out)))
        write_bytes_atomic(id_file, f"{run_id}\n".encode())

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The trackers a run reports to (rank 0 only); `row` and `report` feed them, `close` ends them."""

    def __init__(self, names: tuple[str, ...], out: Path, config: dict[str, Any]) -> None:
        self._open: list[Tracker] = []
        try:
            for name in names:
                self._open.append(_TensorBoard(out) if name == "tensorboard" else _WandB(out, config))
        except BaseException:
            self.close()
            raise
        if names:
            log.info("reporting to %s", ", ".join(names))
        self._step = 0

    @property
    def active(self) -> bool:
        """Whether any tracker is open (else rows need not be turned into scalars)."""
        return bool(self._open)

    def row(self, row: dict[str, Any]) -> None:
        """A metrics.jsonl row (what MetricsLog writes)."""
        step, values = scalars(row)
        self._step = max(self._step, step)
        self._log(values, step)

    def report(self, values: dict[str, float]) -> None:
        """A profiler report (dflash_cache.profiler.StageProfiler's `report_values`), at the newest step."""
        self._log({f"profile/{k}": v for k, v in values.items()}, self._step)

    def _log(self, values: dict[str, float], step: int) -> None:
        for tracker in self._open:
            tracker.log(values, step)

    def close(self) -> None:
        for tracker in self._open:
            try:
                tracker.close()
            except Exception as e:  # a tracker that cannot finish must not hide how the run ended
                log.warning("a tracker could not be closed: %s", e)
        self._open = []
