"""The phase-2 trainer: the DFlash drafter on packed batches from a source, made of parts.

    source       batches and the data position        dflash_cache.train.source (cache or live)
    drafter      model, optimiser, schedule           dflash_cache.train.parts
    runner       the step: anchors, shapes, masks,    dflash_cache.train.step
                 forward, loss, backward, update
    checkpointer saves and restores the stateful      dflash_cache.train.checkpointer
                 parts (the source's position too)
    bookkeeper   metrics rows, progress, start-up     dflash_cache.train.bookkeeping

`Trainer.fit` runs the steps and, between them, the checkpoints and held-out evaluations; at the end
it saves and exports. Metrics stay on the device and are read only on logging steps (no per-step
host sync). State that resume needs is small: the step, the source position (epoch, batches
consumed), the scheduler and optimizer state, and the RNG states; the source recomputes its plan.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from dflash_cache.config_files import run_config_written
from dflash_cache.cpu_threads import use_free_cores
from dflash_cache.devices import resolve_device
from dflash_cache.errors import UserError, compile_failure, write_error
from dflash_cache.files import write_bytes_atomic
from dflash_cache.logs import run_level
from dflash_cache.profiler import StageProfiler, interval_from_env
from dflash_cache.store.batch import PackedBatch
from dflash_cache.store.lock import CacheLock
from dflash_cache.train.assemble import Parts
from dflash_cache.train.bookkeeping import Bookkeeper
from dflash_cache.train.checkpoint import list_checkpoints
from dflash_cache.train.checkpointer import Checkpointer, CheckpointParts, check_same_run, options_json
from dflash_cache.train.config import DrafterConfig
from dflash_cache.train.drafter import DFlashDrafter
from dflash_cache.train.epoch_plan import Position
from dflash_cache.train.export import export_drafter
from dflash_cache.train.flops import anchors_within, device_peak_flops, step_flops
from dflash_cache.train.interrupt import DeferredInterrupt, TrainingInterrupted
from dflash_cache.train.memory import FITS_MEMORY, fit_max_anchors
from dflash_cache.train.metrics_log import MetricsLog
from dflash_cache.train.parts import Progress, RngStates, drafter_parts, lr_factor
from dflash_cache.train.place import Place
from dflash_cache.train.precision import Precision
from dflash_cache.train.run_config import TrainConfig
from dflash_cache.train.run_directory import CHECKPOINTS_DIR, EXPORT_DIR, METRICS_FILE
from dflash_cache.train.run_directory import tidy as tidy_run_directory
from dflash_cache.train.source import Source
from dflash_cache.train.static_shapes import ShapeBuckets, planned_batches
from dflash_cache.train.step import StepRunner, compiles
from dflash_cache.train.trackers import Trackers, parse_report_to
from dflash_cache.train.validation import Validation, check_eval_data

log = logging.getLogger(__name__)
# Epochs whose batches choose the static shapes; a batch of a later epoch that fits none adds one.
PLANNED_EPOCHS = 8
# Above this many model FLOPs in an average step, a CPU run says at start that its steps take minutes
# (a 2-core CPU trains the demo's 0.005 TFLOP steps in a fraction of a second, the defaults' ~0.5 in minutes).
# What a CPU step may cost with the default anchor cap (seconds on a few cores; the defaults' steps over
# long rows took minutes): --max-anchors lifts it.
CPU_STEP_FLOPS = 0.05e12
T = TypeVar("T")


class Trainer:
    """One process's training run, made of parts (see the module). `Trainer.build` makes one from a
    config (loading the target's embedding and LM head and checking the cache against it); the
    constructor takes the `Parts` ready-made, which is what benchmarks with synthetic targets use."""

    @classmethod
    def build(cls, cfg: TrainConfig, *, device: torch.device, rank: int = 0, world: int = 1,
              precision: Precision | None = None) -> Trainer:
        from dflash_cache.train.assemble import cache_parts, live_parts

        t0 = time.perf_counter()
        check_eval_data(cfg)
        profiler = StageProfiler(interval_from_env(cfg.profile_interval), prefix=f"[rank {rank}] ")
        place = Place(device, rank, world, profiler)
        parts = (cache_parts if cfg.cache is not None else live_parts)(cfg, place)
        validation = Validation.build(cfg, parts, place)
        trainer = cls(cfg, parts, place, precision)
        trainer.build_seconds = time.perf_counter() - t0
        trainer.validation = validation
        return trainer

    def __init__(self, cfg: TrainConfig, parts: Parts, place: Place, precision: Precision | None = None) -> None:
        """`precision`: Precision.for_device(place.device) unless given (tests run the GPU's on a CPU)."""
        self.cfg, self.place, self.out = cfg, place, Path(cfg.out)
        self.source: Source = parts.source
        self.target = parts.target  # the export records it
        device = place.device
        # Before the drafter is allocated: the free memory it is measured against still includes it.
        max_anchors, cap_reason = anchor_cap(cfg, parts.drafter_cfg, device,
                                             context_tokens=max(cfg.token_budget, self.source.longest_sample()))
        per_epoch = self.source.batches_per_epoch()
        if per_epoch == 0:
            data = cfg.cache if cfg.live is None else cfg.live.data  # a TrainConfig holds one of them
            raise UserError(f"{data} yields no training batch: no sample has >= "
                            f"{2 * cfg.block_size} supervised tokens (DFlash drops shorter ones); lower "
                            "--block-size or add data")
        total_steps = per_epoch * cfg.epochs if cfg.max_steps is None else cfg.max_steps
        self.drafter = drafter_parts(cfg, parts.drafter_cfg, parts.head, place=place, total_steps=total_steps,
                                     precision=precision or Precision.for_device(device))
        self.rng, self.progress = RngStates(cfg.seed, place), Progress()
        shapes = plan_shapes(cfg, self.source, max_anchors, total_steps, place.world) if compiles(cfg, device) \
            else None  # the shapes every step is padded to when the layers are compiled
        if device.type == "cpu" and place.rank == 0:
            say_if_slow_on_cpu(cfg, self.source, parts.drafter_cfg, max_anchors)
        self.runner = StepRunner(cfg, self.drafter, self.rng, place, max_anchors=max_anchors, shapes=shapes)
        self.runner.anchor_cap_reason = cap_reason
        self.checkpointer = Checkpointer(cfg, CheckpointParts(drafter=self.drafter, schedule=self.drafter.schedule,
                                                              source=self.source, progress=self.progress,
                                                              steps=self.runner, rng=self.rng), place)
        place.profiler.peak_flops = device_peak_flops(device)
        self._metrics: MetricsLog | None = None  # fit's; save() writes its queued row first
        self.build_seconds: float | None = None  # set by build(): source, target head and drafter set-up
        self.validation: Validation | None = None  # set by build() with --eval-data
        self._say(logging.INFO, "drafter: %d layers, block %d, %.1fM parameters; %d batches/epoch, %d steps",
                  cfg.draft_layers, cfg.block_size, sum(p.numel() for p in self.model.parameters()) / 1e6, per_epoch,
                  total_steps)
        if self.runner.attention_kernels == "flash":
            log.info("attention: flash-attention 4's kernels in the static-shape graph, Triton's in the dynamic one")
        elif self.runner.compiled and self.runner.why_not_flash is not None:
            log.info("attention: Triton's kernels (flash-attention 4's do not run here: %s)", self.runner.why_not_flash)

    def _say(self, level: int, message: str, *args: Any) -> None:
        """Log what the run does: rank 0 says it for every rank; another rank's line is debug logging."""
        log.log(run_level(level, self.place.rank), message, *args)

    @property
    def model(self) -> DFlashDrafter:
        return self.drafter.model

    @property
    def step(self) -> int:
        return self.progress.step

    def plan_shapes(self) -> ShapeBuckets:
        """The static shapes this run's steps are padded to when its layers are compiled."""
        return plan_shapes(self.cfg, self.source, self.runner.max_anchors, self.drafter.schedule.total_steps,
                           self.place.world)

    def save(self) -> Path | None:
        """Checkpoint (all ranks call it; rank 0 writes), with every metrics row up to this step written."""
        if self._metrics is not None:
            self._metrics.write()
        return self.checkpointer.save()

    def fit(self, record: Callable[[], AbstractContextManager[Any]] | None = None) -> dict[str, Any]:
        """Train until max_steps or the epochs are done; checkpoint, export and return the last metrics.

        A SIGINT/SIGTERM stops the run at the next step boundary (every step with one process, at the
        next logging step with several, where the ranks agree on it) with a checkpoint, raising
        `TrainingInterrupted`; `--resume` then continues bit for bit (with flash attention kernels, up
        to their atomic adds' rounding: dflash_cache.train.attention_kernels). One that comes while
        the last checkpoint and the export are written lets them finish: the run is then complete.

        `record`: what rank 0 enters once the run has passed its checks (resuming, or refusing to
        train over checkpoints) and keeps while it runs: `train`'s OUT/config.yaml, so that a refused
        run never touches it.
        """
        with self._tracking(), contextlib.ExitStack() as running:
            self._resume_or_refuse()
            if record is not None and self.place.rank == 0:
                running.enter_context(record())
            book, fit_from, steps, batches = self._start(), self.step, None, None
            try:
                with DeferredInterrupt(say=self.place.rank == 0) as interrupt:
                    batches = self.source.iterate(self.source.position,
                                                  epochs=None if self.cfg.max_steps else self.cfg.epochs)
                    steps = self.runner.train_steps(self._first_read_timed(batches, book))
                    for position, batch, step_metrics in self._explained(steps):
                        self.source.advance(position)
                        self.progress.advance(batch.num_tokens)
                        if book.after_step(batch.num_tokens, step_metrics, interrupt.requested):
                            path = self.save()
                            raise TrainingInterrupted(self.step, str(path) if path else None)
                        self._between_steps(book)
            except TrainingInterrupted:
                self._say(logging.WARNING, "stopped at step %d with a checkpoint; continue with --resume", self.step)
                raise
            except KeyboardInterrupt:
                self._say(logging.WARNING, "stopped at once: no checkpoint for the steps since the last one; --resume "
                          "continues from that one")
                raise
            finally:
                book.bar.close()
                for generator in (steps, batches):  # the batch prepared ahead is dropped; the source's readers stop
                    if generator is not None:
                        generator.close()
                self.source.close()
                book.metrics.write_finishing()  # the queued step did complete, however the run ends
            return self._end(book, fit_from)

    @contextlib.contextmanager
    def _tracking(self) -> Iterator[None]:
        """The run's trackers (--report-to, rank 0), closed however the run ends."""
        self.trackers = Trackers((), self.out, {})  # none until the run passed its checks (`_open_trackers`)
        try:
            yield
        finally:
            self.trackers.close()
            if self.trackers.report in self.place.profiler.listeners:
                self.place.profiler.listeners.remove(self.trackers.report)

    def _open_trackers(self) -> None:
        """Open --report-to's trackers (rank 0) once the run is known to go ahead: a refused run starts
        no W&B run and writes no tracker files."""
        names = parse_report_to(self.cfg.report_to) if self.place.rank == 0 else ()
        if names:
            self.trackers = Trackers(names, self.out, options_json(self.cfg))
            self.place.profiler.listeners.append(self.trackers.report)

    def _resume_or_refuse(self) -> None:
        """Resume from the newest checkpoint (refusing one of another run), or refuse to train over
        checkpoints without --resume: the last of the run's checks."""
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        planned_for = (self.runner.max_anchors, self.drafter.schedule.total_steps)
        if cfg.resume and not self.checkpointer.restore():
            self._say(logging.INFO, "--resume: no checkpoint in %s, starting fresh", self.checkpointer.directory)
        elif not cfg.resume and list_checkpoints(self.checkpointer.directory):
            raise UserError(f"{self.out} already holds checkpoints; pass --resume to continue or choose another --out")
        if self.runner.shapes is not None and (self.runner.max_anchors, self.drafter.schedule.total_steps) != planned_for:
            # the checkpoint lowered the anchor cap or moved the schedule's end: the shapes compiled next
            # are those this run's batches take from here
            self.runner.shapes = self.plan_shapes()

    def _start(self) -> Bookkeeper:
        """Once the run goes ahead: open the trackers, rewind the metrics to the step resumed, and
        compile the static shapes; the bookkeeping starts the clock after that."""
        cfg = self.cfg
        self._open_trackers()
        if self.place.rank == 0:
            truncate_metrics(self.out / METRICS_FILE, self.step)
            if self.validation is not None:
                log.info("evaluation: %s", self.validation.describe())
        book = Bookkeeper(cfg, self.checkpointer.parts, self.place,
                          row_sink=self.trackers.row if self.trackers.active else None, build_seconds=self.build_seconds)
        self._metrics = book.metrics
        book.start(self._explaining_compile_failures(self.runner.warm_up) if self.runner.shapes is not None else None)
        return book

    def _first_read_timed(self, batches: Iterator[tuple[Position, PackedBatch]],
                          book: Bookkeeper) -> Iterable[tuple[Position, PackedBatch]]:
        """The batches of the steps left, the first read at once (start-up reports it on its own)."""
        remaining = max(0, self.drafter.schedule.total_steps - self.step)
        first = list(itertools.islice(batches, min(1, remaining)))
        book.first_read()
        return itertools.islice(itertools.chain(first, batches), remaining)

    def _explained(self, steps: Iterator[T]) -> Iterator[T]:
        """`steps`, each explained as `_explaining_compile_failures` explains a compiler failure."""
        while (item := self._explaining_compile_failures(partial(next, steps, None))) is not None:
            yield item

    def _between_steps(self, book: Bookkeeper) -> None:
        """The checkpoint and the held-out evaluation the step just taken is due for."""
        if self.step % self.cfg.save_every == 0:
            self.save()
        if self.validation is not None and self.validation.due(self.step):
            self._evaluate(self.validation, book.metrics)

    def _end(self, book: Bookkeeper, fit_from: int) -> dict[str, Any]:
        """The last row, the end's evaluation, the last checkpoint and the export."""
        book.finish()
        if self.validation is not None and self.step > fit_from and not self.validation.due(self.step):
            self._evaluate(self.validation, book.metrics)  # the end's, unless the last step's was one
        self.place.profiler.maybe_report(force=True)  # the last interval, or a run shorter than one
        if self.runner.shapes is not None:
            record = self.runner.shape_record
            log.info("static shapes (%s): %d steps compiled, %d eager%s", self.runner.shapes.describe(),
                     record.compiled_steps, record.eager_steps,
                     f" (failed to compile: {', '.join(map(str, record.failed))})" if record.failed else "")
        # A stop asked for from here lets the last checkpoint and the export finish (seconds): the run
        # ends complete. The barrier keeps the other ranks deferring it until rank 0 has exported (one
        # interrupted meanwhile would have the launcher stop rank 0 mid-export).
        with DeferredInterrupt("finishing the last checkpoint and the export", say=self.place.rank == 0) as interrupt:
            path = self.save()
            if self.place.rank == 0:
                try:
                    export_drafter(self.model, self.model.cfg, self.out / EXPORT_DIR, target=self.target)
                except OSError as e:  # a full disk: the checkpoint just saved holds the same weights
                    raise write_error(e, f"writing the export to {self.out / 'export'}",
                                      "run the same command with --resume to export again") from None
            if self.place.world > 1:
                torch.distributed.barrier()
        if interrupt.requested:
            self._say(logging.WARNING, "asked to stop as the run ended: its last checkpoint %s and its export %s are "
                      "written, so it is complete", path, self.out / EXPORT_DIR)
        return book.metrics.last

    def _evaluate(self, validation: Validation, metrics: MetricsLog) -> None:
        """Evaluate the drafter on the held-out batches (`validation.run`, the run's): its row and line
        follow the step's training row, and its time is left out of the training rate."""
        result = self._explaining_compile_failures(validation.run, self.runner, self.step)
        metrics.add(result.row(), result.line())
        metrics.leave_out(result.seconds)

    def _explaining_compile_failures(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, with a compiler that cannot build kernels on this machine (no C compiler, a
        GPU its Triton does not support) reported as one line naming the way out."""
        try:
            return fn(*args)
        # torch._dynamo imports its submodule exc without naming it, so type checkers miss it
        except torch._dynamo.exc.BackendCompilerFailed as e:  # pyright: ignore[reportAttributeAccessIssue]
            way_out = "--attention-kernels triton or --no-compile" if self.runner.attention_kernels == "flash" \
                else "--no-compile"
            raise UserError(f"torch.compile could not build the drafter's kernels here ({compile_failure(e)}); "
                            f"run again with {way_out} (and --resume to continue from the "
                            "last checkpoint)") from e


def anchor_cap(cfg: TrainConfig, drafter_cfg: DrafterConfig, device: torch.device, *,
               context_tokens: int) -> tuple[int, str]:
    """The run's anchors-per-batch cap and why it is that (unless --max-anchors set it): the most that
    fit the device's memory, and on a CPU, which has the memory for the GPU-sized defaults but not the
    speed (steps of minutes each over long rows), the most that keep a step under CPU_STEP_FLOPS."""
    cap = fit_max_anchors(drafter_cfg, device, max_anchors=cfg.max_anchors, context_tokens=context_tokens,
                          compiled=compiles(cfg, device))
    if device.type == "cpu" and cfg.max_anchors is None:
        within = anchors_within(drafter_cfg, context_tokens=context_tokens, flops=CPU_STEP_FLOPS)
        if within < cap:
            return within, f"that keeps a CPU step under ~{CPU_STEP_FLOPS / 1e12:g} TFLOP (--max-anchors lifts it)"
    return cap, FITS_MEMORY


def plan_shapes(cfg: TrainConfig, source: Source, max_anchors: int, total_steps: int, world: int) -> ShapeBuckets:
    """The static shapes of a run, from the batches of the epochs it will train (all ranks')."""
    per_epoch = max(1, len(source.table.epoch(source.config, 0, 0, 1)))
    epochs = min(PLANNED_EPOCHS, -(-total_steps * world // per_epoch) + 1)
    tokens, anchors = planned_batches(source.table, source.config, epochs=epochs, block_size=cfg.block_size,
                                      num_anchors=cfg.num_anchors, max_anchors=max_anchors)
    return ShapeBuckets.from_plan(batch_tokens=tokens, batch_anchors=anchors, block_size=cfg.block_size,
                                  largest_batch=max(cfg.token_budget, source.longest_sample()),
                                  max_shapes=cfg.static_shapes)


def say_if_slow_on_cpu(cfg: TrainConfig, source: Source, drafter_cfg: DrafterConfig, max_anchors: int) -> None:
    """One line at start when the settings make CPU steps take minutes: the defaults are sized for GPUs."""
    tokens, anchors = planned_batches(source.table, source.config, epochs=1, block_size=cfg.block_size,
                                      num_anchors=cfg.num_anchors, max_anchors=max_anchors)
    if len(tokens) == 0:
        return
    flops = step_flops(drafter_cfg, context_tokens=int(tokens.mean()), num_blocks=int(anchors.mean()),
                       prefix_keys=0).total
    if flops > CPU_STEP_FLOPS:
        log.warning("a step here averages %d anchors over %d context tokens (~%.2f TFLOP): minutes each on a CPU, "
                    "as the defaults are sized for GPUs; for a quick CPU run pass --token-budget 2048 "
                    "--num-anchors 16 --draft-layers 2 --block-size 8, as `just demo` does",
                    int(anchors.mean()), int(tokens.mean()), flops / 1e12)


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric rows after `step` (those of steps a resume will redo), atomically."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line from a killed run
    if len(kept) != len(lines):
        write_bytes_atomic(path, "".join(f"{line}\n" for line in kept).encode())


def train(cfg: TrainConfig, device: str = "auto", gpus: str | None = None) -> dict[str, Any]:
    """Single process, or one rank under torchrun or `train --gpus` (NCCL on GPUs, gloo on CPUs);
    `gpus`, the --gpus that started it, is what OUT/config.yaml records in place of --device."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dev = resolve_device(device, int(os.environ.get("LOCAL_RANK", 0)) if world > 1 else 0)
    use_free_cores(dev, share=int(os.environ.get("LOCAL_WORLD_SIZE", world)))  # a host's CPU ranks split its cores
    interval_from_env(cfg.profile_interval)  # a bad DFLASH_PROFILE_INTERVAL stops the run before it writes
    # One run writes a run directory at a time; taking the lock fails in a second, not after minutes of
    # set-up, when --out cannot be written, and a run refused before it wrote anything takes back the
    # directory it made.
    with CacheLock(Path(cfg.out), what="run directory") if rank == 0 else contextlib.nullcontext():
        if rank == 0:
            tidy_run_directory(Path(cfg.out))
        if world > 1:
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            torch.distributed.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        try:
            # OUT/config.yaml: what `train --config` runs again, written once the run passed its checks
            # (one that then ends in a UserError having saved nothing puts back the one before).
            where = {"device": device} if gpus is None else {"gpus": gpus}
            record = partial(run_config_written, Path(cfg.out), "train", cfg, **where,
                             progress=lambda: list_checkpoints(Path(cfg.out) / CHECKPOINTS_DIR)[:1])
            return Trainer.build(cfg, device=dev, rank=rank, world=world).fit(record=record)
        finally:
            if world > 1:
                torch.distributed.destroy_process_group()


__all__ = ["Trainer", "check_same_run", "lr_factor", "train"]
