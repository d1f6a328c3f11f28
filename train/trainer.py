"""The phase-2 trainer: the DFlash drafter on packed batches from a source.

One step: sample anchors in the packed batch -> build one attention mask per kind of layer ->
drafter forward on [context | blocks] -> chunked, decay-weighted cross-entropy through the
target's frozen LM head -> AdamW step under a warmup + cosine schedule with gradient clipping.
Metrics stay on the device and are read only on logging steps (no per-step host sync).
State that resume needs is small: the step, the source position (epoch, batches consumed), the
scheduler and optimizer state, and the RNG states; the source recomputes its plan from those.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from tqdm import tqdm

from dflash_cache.config_files import run_config_written
from dflash_cache.cpu_threads import use_free_cores
from dflash_cache.devices import resolve_device
from dflash_cache.errors import UserError, compile_failure, write_error
from dflash_cache.files import write_bytes_atomic
from dflash_cache.options import cli_values
from dflash_cache.profiler import StageProfiler, interval_from_env
from dflash_cache.store.batch import PackedBatch
from dflash_cache.store.lock import CacheLock
from dflash_cache.store.manifest import TargetIdentity
from dflash_cache.train.anchors import Blocks, sample_anchors
from dflash_cache.train.attention_kernels import choose_attention_kernels
from dflash_cache.train.cache_source import CacheSource
from dflash_cache.train.checkpoint import (
    TrainerState,
    UnreadableCheckpoint,
    apply_tensors,
    list_checkpoints,
    optimizer_hparams,
    read_state,
    read_tensors,
    save_checkpoint,
)
from dflash_cache.train.compile_cache import keep_compiled_kernels_in
from dflash_cache.train.config import DrafterConfig
from dflash_cache.train.drafter import DFlashDrafter, FrozenTargetHead, init_drafter, scored_rows
from dflash_cache.train.epoch_plan import Position
from dflash_cache.train.export import export_drafter
from dflash_cache.train.flops import device_peak_flops, step_flops
from dflash_cache.train.interrupt import DeferredInterrupt, TrainingInterrupted
from dflash_cache.train.live_source import LiveSource
from dflash_cache.train.loss import chunked_weighted_ce, slot_accuracy
from dflash_cache.train.masks import build_masks, context_doc_pos
from dflash_cache.train.memory import fit_max_anchors
from dflash_cache.train.metrics_log import MetricsLog
from dflash_cache.train.optim import clipped_step, drafter_optimizer, warmup_cosine
from dflash_cache.train.precision import Precision, fp32_allreduce_hook
from dflash_cache.train.run_config import TrainConfig
from dflash_cache.train.run_directory import tidy as tidy_run_directory
from dflash_cache.train.static_shapes import (
    PAD_DOCUMENT,
    Context,
    Shape,
    ShapeBuckets,
    ShapeRecord,
    planned_batches,
    warm_up_batch,
)
from dflash_cache.train.trackers import Trackers, parse_report_to
from dflash_cache.train.validation import Validation, check_eval_data

log = logging.getLogger(__name__)
# The run says once that the anchor cap binds, the first time it does: as a warning when it kept less
# than this share of the anchors the batches offered.
ANCHORS_KEPT_WARNING = 0.9
# Epochs whose batches choose the static shapes; a batch of a later epoch that fits none adds one.
PLANNED_EPOCHS = 8
# Above this many model FLOPs in an average step, a CPU run says at start that its steps take minutes
# (a 2-core CPU trains the demo's 0.005 TFLOP steps in a fraction of a second, the defaults' ~0.5 in minutes).
CPU_SLOW_STEP_FLOPS = 0.05e12
Source = CacheSource | LiveSource
T = TypeVar("T")
K = TypeVar("K")


@dataclass(frozen=True)
class StepInputs:
    """What a step takes from its batch before the drafter runs: the anchors' blocks and the context
    (both padded to `shape`, the static shape the step runs, if any) and the attention masks
    (Trainer.prepare_step)."""

    blocks: Blocks
    context: Context
    masks: dict
    shape: Shape | None
    real_rows: int  # context rows of the batch itself, before padding


def lr_factor(step: int, total: int, warmup_ratio: float) -> float:
    """Linear warmup over warmup_ratio * total steps, then cosine decay to 0 at `total`."""
    return warmup_cosine(step, total, warmup=max(1, int(round(warmup_ratio * total))))


class Trainer:
    """Owns the drafter, optimiser, schedule and source of one rank. `Trainer.build` makes one from a
    config (loading the target's embedding and LM head and checking the cache against it); the
    constructor takes those pieces ready-made, which is what benchmarks with synthetic targets use."""

    @classmethod
    def build(cls, cfg: TrainConfig, *, device: torch.device, rank: int = 0, world: int = 1,
              precision: Precision | None = None) -> Trainer:
        from dflash_cache.train.assemble import cache_parts, live_parts

        t0 = time.perf_counter()
        check_eval_data(cfg)
        profiler = StageProfiler(interval_from_env(cfg.profile_interval), prefix=f"[rank {rank}] ")
        parts = (cache_parts if cfg.cache is not None else live_parts)(cfg, device, rank, world, profiler)
        validation = Validation.build(cfg, train_source=parts.source, drafter_cfg=parts.drafter_cfg,
                                      target=parts.target, device=device, rank=rank, world=world)
        trainer = cls(cfg, source=parts.source, drafter_cfg=parts.drafter_cfg, head=parts.head, device=device,
                      rank=rank, world=world, profiler=profiler, precision=precision)
        trainer.build_seconds = time.perf_counter() - t0
        trainer.target = parts.target
        trainer.validation = validation
        return trainer

    def __init__(self, cfg: TrainConfig, *, source: Source, drafter_cfg: DrafterConfig, head: FrozenTargetHead,
                 device: torch.device, rank: int = 0, world: int = 1, profiler: StageProfiler | None = None,
                 precision: Precision | None = None) -> None:
        """`precision`: Precision.for_device(device) unless given (tests run the GPU's on a CPU)."""
        self.cfg, self.device, self.rank, self.world = cfg, device, rank, world
        self.precision = precision or Precision.for_device(device)
        self.out = Path(cfg.out)
        self.source, self.drafter_cfg = source, drafter_cfg
        self.compiled = cfg.compile and device.type == "cuda"
        # Before the drafter is allocated: the free memory it is measured against still includes it.
        self.max_anchors = fit_max_anchors(drafter_cfg, device, max_anchors=cfg.max_anchors,
                                           context_tokens=max(cfg.token_budget, source.longest_sample()),
                                           compiled=self.compiled)
        head_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.head = head.to(device=device, dtype=head_dtype)
        self.model: DFlashDrafter = init_drafter(self.drafter_cfg, cfg.seed).to(device)
        # Before DDP: with master weights it lowers the linear weights to bf16.
        self.optimizer = drafter_optimizer(self.model, lr=cfg.lr, weight_decay=cfg.weight_decay, device=device,
                                           precision=self.precision)
        # DDP wraps the forward/backward; checkpoints and export use the bare module. Gradients live
        # in DDP's buckets rather than beside them: no second gradient-sized copy for the memory
        # model (which counts one) to miss.
        self.net = self.model
        if world > 1:
            self.net = torch.nn.parallel.DistributedDataParallel(self.model, gradient_as_bucket_view=True)
            if self.precision.master_weights:
                self.net.register_comm_hook(None, fp32_allreduce_hook)
        self.params = list(self.model.parameters())
        self.profiler = profiler or StageProfiler(None)
        per_epoch = self.source.batches_per_epoch()
        if per_epoch == 0:
            raise UserError(f"{cfg.cache or cfg.live.data} yields no training batch: no sample has >= "
                            f"{2 * cfg.block_size} supervised tokens (DFlash drops shorter ones); lower "
                            "--block-size or add data")
        self.total_steps = per_epoch * cfg.epochs if cfg.max_steps is None else cfg.max_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, self.total_steps, cfg.warmup_ratio))
        self.generator = torch.Generator().manual_seed(cfg.seed * 1000003 + rank)
        # The generator's state before the anchors of a batch sampled ahead but not yet trained on
        # (train_steps): what a checkpoint holds, so that a resume draws them again.
        self._anchors_rewind: torch.Tensor | None = None
        # Anchors kept and offered over the steps since the last metrics row (`_window_fields`).
        self._anchors_kept = self._anchors_offered = 0
        self._said_anchor_cap = False
        self.skip_run: torch.Tensor | None = None  # steps skipped in a row (gradients not finite), on the device
        self.backend = "flex" if device.type == "cuda" else "dense"
        # The shapes every step is padded to when the layers are compiled (None: steps run as they come).
        self.shapes = self._plan_shapes() if self.compiled else None
        self.shape_record = ShapeRecord()
        if device.type == "cpu" and rank == 0:
            self._say_if_slow_on_cpu()
        # The LM-head loss's chunk kernel (dflash_cache.train.loss.LOSS_KERNELS): with --no-compile,
        # plain torch, so that no Triton build is needed at all.
        self.loss_kernel = "triton" if self.compiled else "torch"
        self.fewer_rows = True  # see _scored_hidden
        # What FlexAttention runs on in the static-shape graph (resolved: 'triton' or 'flash').
        self.attention_kernels, why_not_flash = choose_attention_kernels(
            cfg.attention_kernels, device, compiled=self.compiled, low_precision=self.precision.autocast,
            head_dim=drafter_cfg.head_dim)
        if self.compiled:
            keep_compiled_kernels_in(self.out)
            self.model.compile_layers(attention_kernels=self.attention_kernels)
        self.profiler.peak_flops = device_peak_flops(device)
        self.step, self.position, self.tokens_seen = 0, Position(0, 0), 0
        self._metrics: MetricsLog | None = None  # fit's; save() writes its queued row first
        self.build_seconds: float | None = None  # set by build(): source, target head and drafter set-up
        self.target: TargetIdentity | None = None  # set by build(): the export records it
        self.validation: Validation | None = None  # set by build() with --eval-data
        log.info("drafter: %d layers, block %d, %.1fM parameters; %d batches/epoch, %d steps",
                 cfg.draft_layers, cfg.block_size, sum(p.numel() for p in self.model.parameters()) / 1e6,
                 per_epoch, self.total_steps)
        if self.attention_kernels == "flash":
            log.info("attention: flash-attention 4's kernels in the static-shape graph, Triton's in the dynamic one")
        elif self.compiled and why_not_flash is not None:
            log.info("attention: Triton's kernels (flash-attention 4's do not run here: %s)", why_not_flash)

    def _plan_shapes(self) -> ShapeBuckets:
        """The static shapes of this run, from the batches of the epochs it will train (all ranks')."""
        cfg, source = self.cfg, self.source
        per_epoch = max(1, len(source.table.epoch(source.config, 0, 0, 1)))
        epochs = min(PLANNED_EPOCHS, -(-self.total_steps * self.world // per_epoch) + 1)
        tokens, anchors = planned_batches(source.table, source.config, epochs=epochs, block_size=cfg.block_size,
                                          num_anchors=cfg.num_anchors, max_anchors=self.max_anchors)
        return ShapeBuckets.from_plan(batch_tokens=tokens, batch_anchors=anchors, block_size=cfg.block_size,
                                      largest_batch=max(cfg.token_budget, source.longest_sample()),
                                      max_shapes=cfg.static_shapes)

    def _say_if_slow_on_cpu(self) -> None:
        """One line at start when the settings make CPU steps take minutes: the defaults are sized for GPUs."""
        cfg, source = self.cfg, self.source
        tokens, anchors = planned_batches(source.table, source.config, epochs=1, block_size=cfg.block_size,
                                          num_anchors=cfg.num_anchors, max_anchors=self.max_anchors)
        if len(tokens) == 0:
            return
        flops = step_flops(self.drafter_cfg, context_tokens=int(tokens.mean()), num_blocks=int(anchors.mean()),
                           prefix_keys=0).total
        if flops > CPU_SLOW_STEP_FLOPS:
            log.warning("a step here averages %d anchors over %d context tokens (~%.2f TFLOP): minutes each on a CPU, "
                        "as the defaults are sized for GPUs; for a quick CPU run pass --token-budget 2048 "
                        "--num-anchors 16 --draft-layers 2 --block-size 8, as `just demo` does",
                        int(anchors.mean()), int(tokens.mean()), flops / 1e12)

    @property
    def static_steps(self) -> int:
        """Steps of this process that ran a static shape's compiled graphs."""
        return self.shape_record.compiled_steps

    # --- checkpoints ---------------------------------------------------------------------
    def _rng_state(self) -> dict[str, torch.Tensor]:
        """Every rank's RNG states, keyed by rank (a collective call when world > 1)."""
        anchors = self._anchors_rewind if self._anchors_rewind is not None else self.generator.get_state()
        own = {"torch_cpu": torch.get_rng_state(), "anchors": anchors}
        if self.device.type == "cuda":
            own["torch_cuda"] = torch.cuda.get_rng_state(self.device)
        per_rank = [own]
        if self.world > 1:
            per_rank = [None] * self.world
            torch.distributed.all_gather_object(per_rank, own)
        return {f"{k}.rank{r}": v for r, states in enumerate(per_rank) for k, v in states.items()}

    def run_identity(self) -> dict[str, Any]:
        """What decides the epoch plan and the model: a resume must match it (checked by `restore`).
        Keys are the options a user changes; values are JSON-normalised so they compare after a round trip."""
        cfg = self.cfg
        ident = {"--seed": cfg.seed, "--token-budget": cfg.token_budget, "--num-anchors": cfg.num_anchors,
                 "--max-anchors": cfg.max_anchors, "--block-size": cfg.block_size,
                 "--draft-layers": cfg.draft_layers, "--sliding-window": cfg.sliding_window,
                 "--target (drafter shape)": asdict(self.drafter_cfg), "--cache/--data": self.source.identity()}
        return json.loads(json.dumps(ident))

    def save(self) -> Path | None:
        """Checkpoint (all ranks call it; rank 0 writes), with every metrics row up to this step written."""
        if self._metrics is not None:
            self._metrics.write()
        self._check_finite_weights()
        rng = self._rng_state()
        path = None
        if self.rank == 0:
            state = TrainerState(step=self.step, epoch=self.position.epoch, batch=self.position.batch,
                                 tokens_seen=self.tokens_seen, world=self.world, run=self.run_identity(),
                                 anchor_cap=self.max_anchors, total_steps=self.total_steps,
                                 options=json.loads(json.dumps(cli_values(self.cfg))),
                                 scheduler=self.scheduler.state_dict(),
                                 optimizer_hparams=optimizer_hparams(self.optimizer))
            path = save_checkpoint(self.out / "checkpoints", model=self.model, optimizer=self.optimizer,
                                   state=state, rng=rng, keep=self.cfg.keep_checkpoints)
            log.info("checkpoint %s", path)
        if self.world > 1:
            torch.distributed.barrier()
        return path

    def restore(self) -> bool:
        """Load the newest readable checkpoint (falling back past unreadable ones, and saying so);
        False if there is none. A checkpoint of a differently configured run is refused."""
        candidates = list_checkpoints(self.out / "checkpoints")
        for path in candidates:
            try:
                state = read_state(path)
                check_same_run(state.run, self.run_identity(), path, target=self.cfg.target)
                tensors = read_tensors(path)
                rng = apply_tensors(tensors, state, model=self.model, optimizer=self.optimizer)
            except UnreadableCheckpoint as e:
                log.warning("checkpoint %s cannot be used (%s); falling back to the one before it", path.name, e)
                continue
            self._restore_from(path, state, rng)
            return True
        if candidates:
            raise UserError(f"no checkpoint in {self.out / 'checkpoints'} is readable (see the warnings above); "
                            "start a new run with another --out")
        return False

    def _restore_from(self, path: Path, state: TrainerState, rng: dict[str, torch.Tensor]) -> None:
        self.scheduler.load_state_dict(state.scheduler)
        self._apply_changed_schedule(state)
        self._say_changed_options(state)
        if self.cfg.max_anchors is None:  # the cap found at the start, unless less memory is free now
            self.max_anchors = min(self.max_anchors, state.anchor_cap)
        self.step, self.position, self.tokens_seen = state.step, Position(state.epoch, state.batch), state.tokens_seen
        if state.world == self.world:
            torch.set_rng_state(rng[f"torch_cpu.rank{self.rank}"])
            self.generator.set_state(rng[f"anchors.rank{self.rank}"])
            self._anchors_rewind = None
            if f"torch_cuda.rank{self.rank}" in rng and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng[f"torch_cuda.rank{self.rank}"], self.device)
        else:
            # Another process count: the batch order continues exactly from the global position; anchor
            # draws cannot (they were per rank), so each rank re-seeds from (seed, step, rank).
            self.generator.manual_seed((self.cfg.seed * 1000003 + self.step) * 1009 + self.rank)
            self._anchors_rewind = None
            if self.cfg.max_steps is None:
                self.total_steps = self.step + self._remaining_steps()
            log.warning("resuming a run of %d process(es) with %d: the batch order continues where it stopped; "
                        "anchors are re-seeded and the schedule now ends at step %d", state.world, self.world,
                        self.total_steps)
        log.info("resumed from %s (step %d, epoch %d, batch %d of all ranks)", path, self.step, state.epoch,
                 state.batch)

    def _apply_changed_schedule(self, state: TrainerState) -> None:
        """Options of the schedule given anew on a resume take effect from the step it resumes, each
        with a line saying so: a new --lr is the schedule's new peak (its shape kept), a new
        --max-steps or --epochs its new end (self.total_steps, from this run's options)."""
        old_lr = self.scheduler.base_lrs[0]
        if old_lr != self.cfg.lr:
            self.scheduler.base_lrs = [self.cfg.lr] * len(self.scheduler.base_lrs)
            for group, factor in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas, strict=True):
                group["initial_lr"], group["lr"] = self.cfg.lr, self.cfg.lr * factor(self.scheduler.last_epoch)
            self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
            log.info("--lr %g applied on resume (the checkpoint's run had %g): from step %d the schedule "
                     "continues with the new peak", self.cfg.lr, old_lr, state.step)
        if state.total_steps is not None and state.total_steps != self.total_steps and state.world == self.world:
            log.info("--max-steps/--epochs changed on resume: the schedule now ends at step %d (it ended at %d)",
                     self.total_steps, state.total_steps)

    # Options a resume refuses to change (run_identity), those the schedule says itself, --resume, and
    # --out (a run directory may be moved).
    _SAID_ELSEWHERE = ("--seed", "--token-budget", "--num-anchors", "--max-anchors", "--block-size", "--draft-layers",
                       "--sliding-window", "--lr", "--max-steps", "--epochs", "--resume", "--out")

    def _say_changed_options(self, state: TrainerState) -> None:
        """The other options given anew on a resume apply as given; one line names each that changed
        since the checkpoint's run, so none changes without a word."""
        if state.options is None or self.rank != 0:
            return
        now = json.loads(json.dumps(cli_values(self.cfg)))
        changed = [f"{flag} {_shown(now.get(flag))} (was {_shown(state.options.get(flag))})"
                   for flag in sorted(set(now) | set(state.options))
                   if flag not in self._SAID_ELSEWHERE and now.get(flag) != state.options.get(flag)]
        if changed:
            log.info("--resume: options changed since the checkpoint's run, applied from step %d: %s", state.step,
                     "; ".join(changed))

    def _remaining_steps(self) -> int:
        """This rank's steps from the current position to the end of the last epoch."""
        per_epoch = self.source.batches_per_epoch()
        rest = len(self.source.epoch_batches(self.position.epoch, self.position.batch))
        return rest + per_epoch * max(0, self.cfg.epochs - self.position.epoch - 1)

    # --- the step ------------------------------------------------------------------------
    def prepare_step(self, batch: PackedBatch) -> StepInputs:
        """The batch's anchors (from the trainer's generator: host work when the batch carries its
        host layout), the static shape it runs (if the layers are compiled), its context and masks."""
        cfg = self.cfg
        with self.profiler.span("dflash.anchors"):
            blocks = sample_anchors(batch, block_size=cfg.block_size, num_anchors=cfg.num_anchors,
                                    max_anchors=self.max_anchors, mask_token_id=self.drafter_cfg.mask_token_id,
                                    generator=self.generator)
        shape = None
        if self.shapes is not None:
            shape = self.shapes.shape_for(batch.num_tokens, blocks.num_anchors)
            if shape is None:  # more anchors than any batch of the planned epochs can draw
                self.shapes = self.shapes.widened(blocks.num_anchors, cfg.block_size)
                shape = self.shapes.shape_for(batch.num_tokens, blocks.num_anchors)
                log.info("a batch of %d anchors fits no static shape: adding one of %s", blocks.num_anchors, shape)
        return self.step_inputs(batch, blocks, shape=shape, profiler=self.profiler)

    def step_inputs(self, batch: PackedBatch, blocks: Blocks, *, shape: Shape | None,
                    profiler: StageProfiler) -> StepInputs:
        """The context and the blocks (padded to `shape`, if any) and the masks of `blocks`."""
        stream = self._stream()
        ctx_doc, ctx_pos = context_doc_pos(batch)
        context = Context(features=batch.features, positions=ctx_pos, docs=ctx_doc)
        if shape is not None:
            with profiler.device_span("dflash.pad_context", stream):  # a copy of the features, not mask work
                context = context.padded_to(shape.context_rows)
                blocks = blocks.padded_to(shape.anchors, pad_document=PAD_DOCUMENT,
                                          mask_token_id=self.drafter_cfg.mask_token_id)
        with profiler.device_span("dflash.create_block_mask", stream):
            masks = build_masks(context.docs, context.positions, blocks, layer_types=self.drafter_cfg.layer_types,
                                sliding_window=self.drafter_cfg.sliding_window, backend=self.backend,
                                compile=self.backend == "flex")
        return StepInputs(blocks=blocks, context=context, masks=masks, shape=shape, real_rows=batch.num_tokens)

    def train_steps(self, items: Iterable[tuple[K, PackedBatch]]) -> Iterator[tuple[K, PackedBatch, dict]]:
        """One step per (key, batch), yielding (key, batch, the step's metrics) after each.

        While a step's forward and loss are queued on the device, the host takes the next batch,
        samples its anchors and queues its masks (`prepare_step`): host work (~20-30 ms a step at the
        bench configuration) and small kernels that the device otherwise waited for at the start of
        the next step, its launch queue having run dry (an H200's trace showed ~5 ms of idle device
        a step there). The anchors are drawn in the same order as one batch at a time; a checkpoint
        between steps keeps the generator's state from before the batch prepared ahead
        (`_anchors_rewind`), so a resume draws its anchors again. When the source is the slower side
        (a live target, say), the wait for its next batch now falls before a step's backward rather
        than after its optimizer step: the device still runs the queued forward and loss meanwhile,
        and the rate stays the source's.
        """
        items = iter(items)

        def prepare() -> tuple[K, PackedBatch, StepInputs, torch.Tensor] | None:
            item = next(items, None)
            if item is None:
                return None
            before = self.generator.get_state()
            return item[0], item[1], self.prepare_step(item[1]), before

        upcoming = prepare()
        while upcoming is not None:
            key, batch, inputs, _ = upcoming
            ahead: list = []
            metrics = self.train_step(batch, inputs, while_queued=lambda ahead=ahead: ahead.append(prepare()))
            upcoming = ahead[0] if ahead else prepare()
            self._anchors_rewind = upcoming[3] if upcoming is not None else None
            yield key, batch, metrics
        self._anchors_rewind = None

    def train_step(self, batch: PackedBatch, inputs: StepInputs | None = None, *,
                   while_queued: Callable[[], None] | None = None) -> dict[str, torch.Tensor]:
        """One optimizer step on `batch` (prepared here unless `inputs` are given). `while_queued`
        runs on the host once the forward and the loss are launched, before the backward."""
        cfg = self.cfg
        inputs = inputs if inputs is not None else self.prepare_step(batch)
        blocks = inputs.blocks
        if blocks.offered is not None:
            self._anchors_kept += blocks.real_anchors
            self._anchors_offered += blocks.offered
        loss, correct = self._forward_backward(inputs, net=self.net, profiler=self.profiler,
                                               while_queued=while_queued)
        if inputs.shape is not None:
            self.shape_record.count(eager=inputs.shape in self.shape_record.failed, anchors=blocks.real_anchors,
                                    anchor_padding=blocks.padding, rows=inputs.real_rows,
                                    row_padding=inputs.context.rows - inputs.real_rows)
        with self.profiler.device_span("optimizer.step", self._stream()):
            skipped = clipped_step(self.optimizer, self.params, cfg.grad_clip)
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        # steps skipped in a row, on the device: read at log steps only (MetricsLog)
        self.skip_run = (self.skip_run + 1) * skipped if self.skip_run is not None else skipped.long()
        if blocks.prefix_keys is not None:
            self.profiler.add_flops(step_flops(self.drafter_cfg, context_tokens=batch.num_tokens,
                                               num_blocks=blocks.real_anchors, prefix_keys=blocks.prefix_keys,
                                               fewer_rows=self.fewer_rows).total)
        valid = blocks.weights[:, 1:] > 0
        return {"loss": loss.detach(), "acc": slot_accuracy(correct.view(valid.shape), valid).detach(),
                "skipped": skipped}

    def _stream(self) -> torch.cuda.Stream | None:
        # Device stages are timed on the device: the host runs ahead of the GPU, so host time would
        # land on whichever stage happens to wait for a free launch slot.
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def _forward_backward(self, inputs: StepInputs, *, net: torch.nn.Module, profiler: StageProfiler,
                          while_queued: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafter forward, loss and backward of one step: (loss, correct [A * (B - 1)]);
        `while_queued` runs once, between the loss and the backward (see train_steps). A static
        shape runs its compiled graphs, or eagerly once they have failed (`ShapeRecord`)."""
        shape = inputs.shape
        while_queued = _once(while_queued)  # a retry must not prepare the next batch again
        if shape is not None and shape not in self.shape_record.failed:
            done = self.shape_record.try_compiled(
                shape, lambda: self._forward_backward_once(inputs, net, profiler, while_queued, eager=False),
                undo=lambda: self.model.zero_grad(set_to_none=True))
            if done is not None:
                return done
        return self._forward_backward_once(inputs, net, profiler, while_queued, eager=shape is not None)

    def _forward_backward_once(self, inputs: StepInputs, net: torch.nn.Module, profiler: StageProfiler,
                               while_queued: Callable[[], None] | None, *,
                               eager: bool) -> tuple[torch.Tensor, torch.Tensor]:
        loss, correct = self.forward_loss(inputs, net, profiler, eager=eager)
        if while_queued is not None:
            while_queued()
        with profiler.device_span("drafter.backward", self._stream()):
            loss.backward()
        return loss, correct

    def forward_loss(self, inputs: StepInputs, net: torch.nn.Module, profiler: StageProfiler, *,
                     eager: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafter forward and loss of a step, (loss, correct [A * (B - 1)]): a training step's first
        half, and all of a held-out batch's evaluation (dflash_cache.train.validation)."""
        stream, blocks, context = self._stream(), inputs.blocks, inputs.context
        with profiler.device_span("drafter.forward", stream), self.precision.autocast_on(self.device):
            features = context.features if self.device.type == "cuda" else context.features.float()
            scored = self._scored_hidden(net, features, context.positions, blocks, inputs.masks,
                                         static=inputs.shape is not None, eager=eager)
        with profiler.device_span("dflash.chunked_loss", stream):
            return chunked_weighted_ce(scored, self.head.lm_head_weight, blocks.labels[:, 1:].reshape(-1),
                                       blocks.weights[:, 1:].reshape(-1), chunk_size=self.cfg.loss_chunk,
                                       kernel=self.loss_kernel)

    def _scored_hidden(self, net: torch.nn.Module, features: torch.Tensor, ctx_positions: torch.Tensor,
                       blocks: Blocks, masks: dict, *, static: bool, eager: bool) -> torch.Tensor:
        """The drafter's final states of the scored slots 1..B-1, [A * (B - 1), H] (slot 0 is the
        given anchor token). With `fewer_rows` (the default) computed on fewer rows, the same
        function: the block input's distinct rows, each anchor then the mask token that fills every
        other slot, and out only the scored ones (DFlashDrafter.forward); without, on every row
        (what bench/train.py compares against)."""
        positions = blocks.position_ids.reshape(-1)
        out_dtype = self.head.lm_head_weight.dtype  # what the loss multiplies them in
        if self.fewer_rows:
            distinct = torch.cat((blocks.input_ids[:, 0],
                                  blocks.input_ids.new_full((1,), self.drafter_cfg.mask_token_id)))
            return net(features, ctx_positions, self.head.embed(distinct), positions, masks, static=static,
                       eager=eager, distinct_rows=True, scored_only=True, out_dtype=out_dtype)
        hidden = net(features, ctx_positions, self.head.embed(blocks.input_ids.reshape(-1)), positions, masks,
                     static=static, eager=eager, out_dtype=out_dtype)
        return scored_rows(hidden, self.cfg.block_size)

    def warm_up(self) -> float:
        """Compile every static shape before the first step (a made-up batch of each through forward
        and backward) and return the seconds it took; a shape whose compiled step fails is logged
        and runs eagerly (`ShapeRecord`). So no step stops to compile mid-run (with several ranks,
        the others would wait for it at the next all-reduce), and the start-up reports all compiling.

        Nothing of the run changes: the bare drafter runs (no all-reduce), anchors come from a
        generator of its own, the gradients are dropped and no optimiser step is taken.
        """
        t0 = time.perf_counter()
        generator = torch.Generator().manual_seed(0)
        idle = StageProfiler(None)
        width = self.drafter_cfg.num_target_layers * self.drafter_cfg.hidden_size
        for i, shape in enumerate(self.shapes.shapes if self.shapes is not None else []):
            t_shape = time.perf_counter()
            batch = warm_up_batch(shape, block_size=self.cfg.block_size, width=width, device=self.device)
            blocks = sample_anchors(batch, block_size=self.cfg.block_size, num_anchors=shape.anchors,
                                    max_anchors=shape.anchors, mask_token_id=self.drafter_cfg.mask_token_id,
                                    generator=generator)
            inputs = self.step_inputs(batch, blocks, shape=shape, profiler=idle)
            self.shape_record.try_compiled(
                shape, lambda inputs=inputs: self._forward_backward_once(inputs, self.model, idle, None, eager=False),
                undo=lambda: None)
            self.model.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            log.info("static shape %d of %d (%s) ready in %.1fs", i + 1, len(self.shapes.anchors), shape,
                     time.perf_counter() - t_shape)
        return time.perf_counter() - t0

    def _explaining_compile_failures(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, with a compiler that cannot build kernels on this machine (no C compiler, a
        GPU its Triton does not support) reported as one line naming the way out."""
        try:
            return fn(*args)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            way_out = "--attention-kernels triton or --no-compile" if self.attention_kernels == "flash" \
                else "--no-compile"
            raise UserError(f"torch.compile could not build the drafter's kernels here ({compile_failure(e)}); "
                            f"run again with {way_out} (and --resume to continue from the "
                            "last checkpoint)") from e

    def fit(self) -> dict[str, float]:
        """Train until max_steps or the epochs are done; checkpoint, export and return the last metrics.

        A SIGINT/SIGTERM stops the run at the next step boundary (every step with one process, at the
        next logging step with several, where the ranks agree on it) with a checkpoint, raising
        `TrainingInterrupted`; `--resume` then continues bit for bit (with flash attention kernels, up
        to their atomic adds' rounding: dflash_cache.train.attention_kernels).
        """
        names = parse_report_to(self.cfg.report_to) if self.rank == 0 else ()
        self.trackers = Trackers(names, self.out, json.loads(json.dumps(cli_values(self.cfg))))
        if names:
            self.profiler.listeners.append(self.trackers.report)
        try:
            return self._fit()
        finally:
            self.trackers.close()

    def _fit(self) -> dict[str, float]:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        if cfg.resume and not self.restore():
            log.info("--resume: no checkpoint in %s, starting fresh", self.out / "checkpoints")
        elif not cfg.resume and list_checkpoints(self.out / "checkpoints"):
            raise UserError(f"{self.out} already holds checkpoints; pass --resume to continue or choose another --out")
        metrics_path = self.out / "metrics.jsonl"
        if self.rank == 0:
            truncate_metrics(metrics_path, self.step)
            if self.validation is not None:
                log.info("evaluation: %s", self.validation.describe())
        bar = tqdm(total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True,
                   disable=not (cfg.progress and self.rank == 0))
        metrics = MetricsLog(metrics_path, self.device, slots=cfg.block_size - 1, rank=self.rank, world=self.world,
                             sinks=[self.trackers.row])
        self._metrics = metrics
        window: list[dict[str, torch.Tensor]] = []
        warm_up = self._explaining_compile_failures(self.warm_up) if self.shapes is not None else None
        metrics.start()
        tok_window = 0
        t_start, first_step = time.perf_counter(), True
        log_from = self.step  # a row every --log-every steps from here: after a resume too, whole windows
        fit_from = self.step

        def ends_window(step: int) -> bool:
            return (step - log_from) % cfg.log_every == 0 or step == self.total_steps

        steps = batches = None
        try:
            with DeferredInterrupt() as interrupt:
                batches = self.source.iterate(self.position, epochs=None if cfg.max_steps else cfg.epochs)
                remaining = max(0, self.total_steps - self.step)
                first = list(itertools.islice(batches, min(1, remaining)))  # the first read, timed on its own
                t_batch = time.perf_counter()
                steps = self.train_steps(itertools.islice(itertools.chain(first, batches), remaining))
                while True:
                    stepped = self._explaining_compile_failures(next, steps, None)
                    if stepped is None:
                        break
                    position, batch, step_metrics = stepped
                    window.append(step_metrics)
                    self.step, self.position = self.step + 1, position
                    self.tokens_seen += batch.num_tokens
                    tok_window += batch.num_tokens
                    if first_step:
                        self._log_startup(t_start, t_batch, warm_up)
                        first_step = False
                        if not ends_window(self.step):
                            # Start-up (the first read, compiling) is no part of the rate: the first window
                            # is timed from the end of its first step, unless that step is all it holds.
                            metrics.start()
                            tok_window = 0
                    self.profiler.add_tokens(batch.num_tokens)
                    self.profiler.maybe_report()
                    bar.update(1)
                    shown = metrics.last
                    # The last log step's row, now that the device has finished it; with several
                    # ranks its stop flag is the only one (every rank writes it at the same step).
                    stop = metrics.write() or (interrupt.requested and self.world == 1)
                    if metrics.last is not shown and metrics.last["loss"] is not None:
                        bar.set_postfix(loss=f"{metrics.last['loss']:.3f}", tau=f"{metrics.last['tau_hat']:.2f}")
                    self._stop_if_diverged(metrics.last)
                    if ends_window(self.step):
                        metrics.queue(window, tok_window, interrupt.requested, self._window_fields(), self.skip_run)
                        window, tok_window = [], 0
                    if stop:
                        path = self.save()
                        raise TrainingInterrupted(self.step, str(path) if path else None)
                    if self.step % cfg.save_every == 0:
                        self.save()
                    if self.validation is not None and self.validation.due(self.step):
                        self._evaluate(metrics)
        except TrainingInterrupted:
            log.warning("stopped at step %d with a checkpoint; continue with --resume", self.step)
            raise
        except KeyboardInterrupt:
            log.warning("stopped at once: no checkpoint for the steps since the last one; --resume continues "
                        "from that one")
            raise
        finally:
            bar.close()
            for generator in (steps, batches):  # the batch prepared ahead is dropped; the source's readers stop
                if generator is not None:
                    generator.close()
            self.source.close()
            metrics.write_finishing()  # the queued step did complete, however the run ends
        if window:
            metrics.queue(window, tok_window, False, self._window_fields(), self.skip_run)
        metrics.write()
        self._stop_if_diverged(metrics.last)
        if self.validation is not None and self.step > fit_from and not self.validation.due(self.step):
            self._evaluate(metrics)  # the end's, unless the last step's was one
        self.profiler.maybe_report(force=True)  # the last interval, or a run shorter than one
        if self.shapes is not None:
            record = self.shape_record
            log.info("static shapes (%s): %d steps compiled, %d eager%s", self.shapes.describe(),
                     record.compiled_steps, record.eager_steps,
                     f" (failed to compile: {', '.join(map(str, record.failed))})" if record.failed else "")
        self.save()
        if self.rank == 0:
            try:
                export_drafter(self.model, self.drafter_cfg, self.out / "export", target=self.target)
            except OSError as e:  # a full disk: the checkpoint just saved holds the same weights
                raise write_error(e, f"writing the export to {self.out / 'export'}",
                                  "run the same command with --resume to export again") from None
        return metrics.last

    def _evaluate(self, metrics: MetricsLog) -> None:
        """Evaluate the drafter on the held-out batches (`Validation.run`): its row and line follow the
        step's training row, and its time is left out of the training rate."""
        result = self._explaining_compile_failures(self.validation.run, self)
        metrics.add(result.row(), result.line())
        metrics.leave_out(result.seconds)

    def _last_checkpoint(self) -> str:
        found = list_checkpoints(self.out / "checkpoints")
        return f"the last checkpoint is {found[0]}" if found else "no checkpoint was written yet"

    def _stop_if_diverged(self, row: dict[str, Any]) -> None:
        """A UserError when the newest metrics row says --nonfinite-limit steps in a row were skipped."""
        if row.get("skip_run", 0) >= self.cfg.nonfinite_limit:
            raise UserError(f"{row['skip_run']} steps in a row up to step {row['step']} had gradients that are not "
                            f"finite (each skipped); {self._last_checkpoint()}: check the data (`dflash-cache "
                            "inspect --verify`), or train again with a lower --lr")

    def _check_finite_weights(self) -> None:
        """A UserError instead of writing weights that are not finite (a run that diverged)."""
        values = [*self.model.parameters(), *getattr(self.optimizer, "master_weights", dict)().values()]
        if not bool(torch.stack([torch.isfinite(v).all() for v in values]).all()):
            raise UserError(f"at step {self.step} the drafter's weights are not finite (the run diverged), so they "
                            f"are neither checkpointed nor exported; {self._last_checkpoint()}: train again with a "
                            "lower --lr")

    def _log_startup(self, t_start: float, t_batch: float, warm_up: float | None) -> None:
        """Where start-up went: it can take minutes at scale (loading, the first read, compiling)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        build = f"set-up {self.build_seconds:.1f}s, " if self.build_seconds is not None else ""
        warm = (f"{len(self.shapes.anchors)} static shapes ({self.shapes.describe()}) compiled in {warm_up:.1f}s, "
                if warm_up is not None else "")
        log.info("start-up: %s%sfirst batch %.1fs, first step %.1fs (compilation included)", build, warm,
                 t_batch - t_start, now - t_batch)

    def _window_fields(self) -> dict[str, Any]:
        """A metrics row's fields the host knows at the log step (MetricsLog adds the device's).
        `anchors_kept`: the share of the anchors this rank's batches offered since the last row
        that the anchor cap kept; the count starts again. Rank 0 writes the row and, the first time
        the cap binds (a batch offered more anchors than it), says so once: a warning below
        ANCHORS_KEPT_WARNING of them kept, else news."""
        fields = {"step": self.step, "epoch": self.position.epoch, "lr": self.scheduler.get_last_lr()[0],
                  "tokens_seen": self.tokens_seen, **self.shape_record.window_fields()}
        kept, offered = self._anchors_kept, self._anchors_offered
        self._anchors_kept = self._anchors_offered = 0
        if offered:
            fields["anchors_kept"] = round(kept / offered, 4)
            if kept < offered and self.rank == 0 and not self._said_anchor_cap:
                self._said_anchor_cap = True
                cap = (f"--max-anchors {self.max_anchors}" if self.cfg.max_anchors is not None
                       else f"the cap of {self.max_anchors} anchors per batch that fits this device's memory")
                level = logging.WARNING if kept < ANCHORS_KEPT_WARNING * offered else logging.INFO
                log.log(level, "%s kept %d%% of the anchors the batches offered (--num-anchors %d per sample; "
                        "metrics.jsonl's anchors_kept tells each row's share): each sample trains on fewer blocks; "
                        "a smaller --token-budget keeps more of each sample's", cap, 100 * kept // offered,
                        self.cfg.num_anchors)
        return fields


def _once(fn: Callable[[], None] | None) -> Callable[[], None] | None:
    """`fn` that runs the first time it is called and does nothing after."""
    if fn is None:
        return None
    pending = [fn]

    def call() -> None:
        if pending:
            pending.pop()()

    return call


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


def _shown(value: Any) -> str:
    """An option's value as `cli_values` records it: a flag given or not, else its value."""
    if isinstance(value, bool):
        return "given" if value else "not given"
    return "unset" if value is None else str(value)


def _first_difference(saved: Any, current: Any, key: str) -> tuple[str, Any, Any]:
    """The innermost field where two JSON values differ, as (dotted name, saved, current)."""
    if isinstance(saved, dict) and isinstance(current, dict):
        for k in sorted(set(saved) | set(current)):
            if saved.get(k) != current.get(k):
                return _first_difference(saved.get(k), current.get(k), f"{key} {k}")
    return key, saved, current


def check_same_run(saved: dict[str, Any], current: dict[str, Any], path: Path, target: str | None = None) -> None:
    """Refuse to resume a checkpoint whose plan- or model-deciding settings differ, naming the option
    (and, for a difference the target makes, this run's `target`)."""
    for option in sorted(set(saved) | set(current)):
        if saved.get(option) != current.get(option):
            name, old, new = _first_difference(saved.get(option), current.get(option), option)
            this = f"this run's --target {target}" if target and option.startswith("--target") else "this run"
            raise UserError(f"--resume: {path.name} was trained with {name} = {old!r}, {this} has {new!r}; "
                            f"resume with the same {option.split()[0]}, or train into another --out")


def train(cfg: TrainConfig, device: str = "auto", gpus: str | None = None) -> dict[str, float]:
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
            # OUT/config.yaml: what `train --config` runs again (a refused run puts back the one before).
            where = {"device": device} if gpus is None else {"gpus": gpus}
            record = run_config_written(Path(cfg.out), "train", cfg, **where,
                                        progress=lambda: list_checkpoints(Path(cfg.out) / "checkpoints")[:1])
            with record if rank == 0 else contextlib.nullcontext():
                return Trainer.build(cfg, device=dev, rank=rank, world=world).fit()
        finally:
            if world > 1:
                torch.distributed.destroy_process_group()


__all__ = ["Trainer", "lr_factor", "train"]
