"""The bookkeeping around each step of `Trainer.fit`: the metrics rows (dflash_cache.train.metrics_log)
every --log-every steps, the progress bar, the start-up line, the anchor cap's news, and the stop a
run of skipped steps (gradients not finite) calls for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from dflash_cache.errors import UserError
from dflash_cache.logs import run_level
from dflash_cache.train.checkpoint import last_checkpoint
from dflash_cache.train.memory import FITS_MEMORY
from dflash_cache.train.metrics_log import MetricsLog
from dflash_cache.train.run_directory import CHECKPOINTS_DIR, METRICS_FILE

if TYPE_CHECKING:
    from dflash_cache.train.checkpointer import CheckpointParts
    from dflash_cache.train.place import Place
    from dflash_cache.train.run_config import TrainConfig

log = logging.getLogger(__name__)
# The run says once that the anchor cap binds, the first time it does: as a warning when it kept less
# than this share of the anchors the batches offered.
ANCHORS_KEPT_WARNING = 0.9


class Bookkeeper:
    """Per-step bookkeeping of one process's run over `parts` (its progress, source position,
    schedule and step runner), from the step it starts at; rank 0 writes the rows."""

    def __init__(self, cfg: TrainConfig, parts: CheckpointParts, place: Place, *,
                 row_sink: Callable[[dict[str, Any]], None] | None, build_seconds: float | None) -> None:
        """`row_sink` gets each row rank 0 writes (trackers); `build_seconds`: the set-up's, if known."""
        self.cfg, self.parts, self.place, self.build_seconds = cfg, parts, place, build_seconds
        step = parts.progress.step
        self.bar = tqdm(total=parts.schedule.total_steps, initial=step, unit="step", dynamic_ncols=True,
                        disable=not (cfg.progress and place.rank == 0))
        self.metrics = MetricsLog(Path(cfg.out) / METRICS_FILE, place.device, slots=cfg.block_size - 1,
                                  rank=place.rank, world=place.world, sinks=[row_sink] if row_sink is not None else [])
        self.window: list[dict[str, torch.Tensor]] = []
        self.tokens = 0  # in the window
        self.first_step = True
        self.window_timed = True  # False while the window is the run's first step alone
        self.said_anchor_cap = False
        self.t_start = self.t_batch = 0.0
        self.warm_up: float | None = None

    def start(self, warm_up: float | None) -> None:
        """Training starts now, after `warm_up` seconds of compiling (None: no static shapes)."""
        self.warm_up = warm_up
        self.metrics.start()
        self.t_start = time.perf_counter()

    def first_read(self) -> None:
        """The first batch is read."""
        self.t_batch = time.perf_counter()

    def ends_window(self, step: int) -> bool:
        """A row at every multiple of --log-every and at the last step: a resumed run's rows fall on the
        steps an uninterrupted run's do, as its checkpoints do (its first window may be shorter)."""
        return step % self.cfg.log_every == 0 or step == self.parts.schedule.total_steps

    def after_step(self, tokens: int, step_metrics: dict[str, torch.Tensor], stop_requested: bool) -> bool:
        """Account for the step just taken (`tokens` context tokens); True when the run is to stop at
        this step: the last log step's row, now that the device has finished it, says some rank asked
        (with several ranks its flag is the only one: every rank writes it at the same step)."""
        step, metrics = self.parts.progress.step, self.metrics
        self.window.append(step_metrics)
        self.tokens += tokens
        if self.first_step:
            self._say_startup()
            self.first_step = False
            if not self.ends_window(step):
                # Start-up (the first read, compiling) is no part of the rate: the first window is
                # timed from the end of its first step, unless that step is all it holds (a resume
                # one step before a log step, or --log-every 1): then that row has no rate.
                metrics.start()
                self.tokens = 0
            else:
                self.window_timed = False
        self.place.profiler.add_tokens(tokens)
        self.place.profiler.maybe_report()
        self.bar.update(1)
        shown = metrics.last
        stop = metrics.write() or (stop_requested and self.place.world == 1)
        if metrics.last is not shown and metrics.last["loss"] is not None:
            self.bar.set_postfix(loss=f"{metrics.last['loss']:.3f}", tau=f"{metrics.last['tau_hat']:.2f}")
        self.stop_if_diverged()
        if self.ends_window(step):
            self._queue(stop_requested)
        return stop

    def finish(self) -> None:
        """After the last step: its window's row, written."""
        if self.window:
            self._queue(False)
        self.metrics.write()
        self.stop_if_diverged()

    def _queue(self, stop_requested: bool) -> None:
        self.metrics.queue(self.window, self.tokens, stop_requested, self._window_fields(),
                           self.parts.steps.skip_run, timed=self.window_timed)
        self.window_timed = True
        self.window, self.tokens = [], 0

    def stop_if_diverged(self) -> None:
        """A UserError when the newest row says --nonfinite-limit steps in a row were skipped."""
        row = self.metrics.last
        if row.get("skip_run", 0) >= self.cfg.nonfinite_limit:
            last = last_checkpoint(Path(self.cfg.out) / CHECKPOINTS_DIR)
            raise UserError(f"{row['skip_run']} steps in a row up to step {row['step']} had gradients that are not "
                            f"finite (each skipped); {last}: check the data (`dflash-cache inspect --verify`), or "
                            "train again with a lower --lr")

    def _say_startup(self) -> None:
        """Where start-up went: it can take minutes at scale (loading, the first read, compiling)."""
        device, shapes = self.place.device, self.parts.steps.shapes
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        build = f"set-up {self.build_seconds:.1f}s, " if self.build_seconds is not None else ""
        warm = ""
        if self.warm_up is not None:  # the static shapes were compiled
            if shapes is None:
                raise RuntimeError("Bookkeeper: a warm-up was timed for a run without static shapes")
            warm = f"{len(shapes.anchors)} static shapes ({shapes.describe()}) compiled in {self.warm_up:.1f}s, "
        log.log(run_level(logging.INFO, self.place.rank), "start-up: %s%sfirst batch %.1fs, first step %.1fs "
                "(compilation included)", build, warm, self.t_batch - self.t_start, now - self.t_batch)

    def _window_fields(self) -> dict[str, Any]:
        """A metrics row's fields the host knows at the log step (MetricsLog adds the device's).
        `anchors_kept`: the share of the anchors this rank's batches offered since the last row
        that the anchor cap kept. Rank 0 writes the row and, the first time the cap binds (a batch
        offered more anchors than it), says so once: a warning below ANCHORS_KEPT_WARNING of them
        kept, else news; always news for the cap a CPU run has by default (its steps' speed)."""
        parts = self.parts
        fields = {"step": parts.progress.step, "epoch": parts.source.position.epoch, "lr": parts.schedule.last_lr(),
                  "tokens_seen": parts.progress.tokens_seen, **parts.steps.shape_record.window_fields()}
        kept, offered = parts.steps.take_anchor_counts()
        if offered:
            fields["anchors_kept"] = round(kept / offered, 4)
            if kept < offered and self.place.rank == 0 and not self.said_anchor_cap:
                self.said_anchor_cap = True
                cap = (f"--max-anchors {parts.steps.max_anchors}" if self.cfg.max_anchors is not None
                       else f"the cap of {parts.steps.max_anchors} anchors per batch {parts.steps.anchor_cap_reason}")
                # the CPU's speed cap (the one reason but memory `anchor_cap` gives, never with --max-anchors)
                # is the defaults' choice there, said as news; a cap of the device's memory or of
                # --max-anchors that keeps few anchors says the batches are too big for it
                for_speed = parts.steps.anchor_cap_reason != FITS_MEMORY
                level = logging.WARNING if kept < ANCHORS_KEPT_WARNING * offered and not for_speed else logging.INFO
                log.log(level, "%s kept %d%% of the anchors the batches offered (--num-anchors %d per sample; "
                        "metrics.jsonl's anchors_kept tells each row's share): each sample trains on fewer blocks; "
                        "a smaller --token-budget keeps more of each sample's", cap, 100 * kept // offered,
                        self.cfg.num_anchors)
        return fields
