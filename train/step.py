"""The training step, one batch at a time: sample anchors in the packed batch -> pad it to a static
shape (compiled layers) -> build one attention mask per kind of layer -> drafter forward on
[context | blocks] -> chunked, decay-weighted cross-entropy through the target's frozen LM head ->
backward -> AdamW step under the schedule, with gradient clipping, skipped (no update) when the
gradients are not finite. `StepRunner.train_steps` prepares the next batch while a step is queued on
the device. The held-out evaluation (dflash_cache.train.validation) runs the same forward and loss.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from dflash_cache.profiler import StageProfiler
from dflash_cache.store.batch import PackedBatch
from dflash_cache.train.anchors import Blocks, sample_anchors
from dflash_cache.train.attention_kernels import choose_attention_kernels
from dflash_cache.train.compile_cache import keep_compiled_kernels_in
from dflash_cache.train.flops import step_flops
from dflash_cache.train.loss import chunked_weighted_ce, slot_accuracy
from dflash_cache.train.masks import build_masks, context_doc_pos
from dflash_cache.train.memory import FITS_MEMORY
from dflash_cache.train.optim import clipped_step
from dflash_cache.train.parts import DrafterParts, RngStates
from dflash_cache.train.place import Place
from dflash_cache.train.static_shapes import (
    PAD_DOCUMENT,
    Context,
    Shape,
    ShapeBuckets,
    ShapeRecord,
    warm_up_batch,
)

if TYPE_CHECKING:
    from dflash_cache.train.run_config import TrainConfig

log = logging.getLogger(__name__)
K = TypeVar("K")


@dataclass(frozen=True)
class StepInputs:
    """What a step takes from its batch before the drafter runs: the anchors' blocks and the context
    (both padded to `shape`, the static shape the step runs, if any) and the attention masks
    (StepRunner.prepare_step)."""

    blocks: Blocks
    context: Context
    masks: dict
    shape: Shape | None
    real_rows: int  # context rows of the batch itself, before padding


def _once(fn: Callable[[], None] | None) -> Callable[[], None] | None:
    """`fn` that runs the first time it is called and does nothing after."""
    if fn is None:
        return None
    pending = [fn]

    def call() -> None:
        if pending:
            pending.pop()()

    return call


def compiles(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether the layers (and the loss) run compiled: on GPUs, unless --no-compile."""
    return cfg.compile and device.type == "cuda"


class StepRunner:
    """Takes the optimiser steps of one process: the drafter `drafter`, anchors drawn from
    `rng.generator`, at most `max_anchors` a batch, padded to `shapes` (the static shapes of compiled
    layers; None: steps run as they come). It is also a checkpoint's part for the anchor cap."""

    def __init__(self, cfg: TrainConfig, drafter: DrafterParts, rng: RngStates, place: Place, *, max_anchors: int,
                 shapes: ShapeBuckets | None) -> None:
        self.cfg, self.drafter, self.rng, self.place = cfg, drafter, rng, place
        self.device, self.profiler = place.device, place.profiler
        self.model, self.drafter_cfg = drafter.model, drafter.model.cfg
        self.max_anchors, self.shapes, self.shape_record = max_anchors, shapes, ShapeRecord()
        self.anchor_cap_reason = FITS_MEMORY  # why max_anchors, when no --max-anchors set it (trainer.anchor_cap)
        self.compiled = compiles(cfg, self.device)
        self.backend = "flex" if self.device.type == "cuda" else "dense"
        # The LM-head loss's chunk kernel (dflash_cache.train.loss.LOSS_KERNELS): with --no-compile,
        # plain torch, so that no Triton build is needed at all.
        self.loss_kernel = "triton" if self.compiled else "torch"
        self.params = drafter.params
        self.skip_run: torch.Tensor | None = None  # steps skipped in a row (gradients not finite), on the device
        self.anchors_kept = self.anchors_offered = 0  # since `take_anchor_counts` last read them
        # What FlexAttention runs on in the static-shape graph (resolved: 'triton' or 'flash').
        self.attention_kernels, self.why_not_flash = choose_attention_kernels(
            cfg.attention_kernels, self.device, compiled=self.compiled, low_precision=drafter.precision.autocast,
            head_dim=self.drafter_cfg.head_dim)
        if self.compiled:
            keep_compiled_kernels_in(Path(cfg.out))
            self.model.compile_layers(attention_kernels=self.attention_kernels)

    def state_dict(self) -> dict[str, int]:
        return {"anchor_cap": self.max_anchors}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The checkpoint's anchor cap, unless less memory is free now (or --max-anchors sets it)."""
        if self.cfg.max_anchors is None:
            self.max_anchors = min(self.max_anchors, state["anchor_cap"])

    def take_anchor_counts(self) -> tuple[int, int]:
        """(anchors kept, anchors offered) by the batches since the last call."""
        counts = self.anchors_kept, self.anchors_offered
        self.anchors_kept = self.anchors_offered = 0
        return counts

    def prepare_step(self, batch: PackedBatch) -> StepInputs:
        """The batch's anchors (from the run's generator: host work when the batch carries its host
        layout), the static shape it runs (if the layers are compiled), its context and masks."""
        cfg = self.cfg
        with self.profiler.span("dflash.anchors"):
            blocks = self.anchors(batch, self.rng.generator)
        shape = None
        if self.shapes is not None:
            shape = self.shapes.shape_for(batch.num_tokens, blocks.num_anchors)
            if shape is None:  # more anchors than any batch of the planned epochs can draw
                self.shapes = self.shapes.widened(blocks.num_anchors, cfg.block_size)
                shape = self.shapes.shape_for(batch.num_tokens, blocks.num_anchors)
                log.info("a batch of %d anchors fits no static shape: adding one of %s", blocks.num_anchors, shape)
        return self.step_inputs(batch, blocks, shape=shape, profiler=self.profiler)

    def anchors(self, batch: PackedBatch, generator: torch.Generator) -> Blocks:
        """The run's anchor draw (its block size, anchor count and cap) from `generator`."""
        return sample_anchors(batch, block_size=self.cfg.block_size, num_anchors=self.cfg.num_anchors,
                              max_anchors=self.max_anchors, mask_token_id=self.drafter_cfg.mask_token_id,
                              generator=generator)

    def step_inputs(self, batch: PackedBatch, blocks: Blocks, *, shape: Shape | None,
                    profiler: StageProfiler) -> StepInputs:
        """The context and the blocks (padded to `shape`, if any) and the masks of `blocks`."""
        stream, drafter_cfg = self._stream(), self.drafter_cfg
        ctx_doc, ctx_pos = context_doc_pos(batch)
        context = Context(features=batch.features, positions=ctx_pos, docs=ctx_doc)
        if shape is not None:
            with profiler.device_span("dflash.pad_context", stream):  # a copy of the features, not mask work
                context = context.padded_to(shape.context_rows)
                blocks = blocks.padded_to(shape.anchors, pad_document=PAD_DOCUMENT,
                                          mask_token_id=drafter_cfg.mask_token_id)
        with profiler.device_span("dflash.create_block_mask", stream):
            masks = build_masks(context.docs, context.positions, blocks, layer_types=drafter_cfg.layer_types,
                                sliding_window=drafter_cfg.sliding_window, backend=self.backend,
                                compile=self.backend == "flex")
        return StepInputs(blocks=blocks, context=context, masks=masks, shape=shape, real_rows=batch.num_tokens)

    def train_steps(self, items: Iterable[tuple[K, PackedBatch]]
                    ) -> Generator[tuple[K, PackedBatch, dict], None, None]:
        """One step per (key, batch), yielding (key, batch, the step's metrics) after each.

        While a step's forward and loss are queued on the device, the host takes the next batch,
        samples its anchors and queues its masks (`prepare_step`): host work (~20-30 ms a step at the
        bench configuration) and small kernels that the device otherwise waited for at the start of
        the next step, its launch queue having run dry (an H200's trace showed ~5 ms of idle device
        a step there). The anchors are drawn in the same order as one batch at a time; a checkpoint
        between steps keeps the generator's state from before the batch prepared ahead
        (`RngStates.rewind`), so a resume draws its anchors again. When the source is the slower side
        (a live target, say), the wait for its next batch now falls before a step's backward rather
        than after its optimizer step: the device still runs the queued forward and loss meanwhile,
        and the rate stays the source's.
        """
        items = iter(items)

        def prepare() -> tuple[K, PackedBatch, StepInputs, torch.Tensor] | None:
            item = next(items, None)
            if item is None:
                return None
            before = self.rng.generator.get_state()
            return item[0], item[1], self.prepare_step(item[1]), before

        upcoming = prepare()
        while upcoming is not None:
            key, batch, inputs, _ = upcoming
            ahead: list = []
            metrics = self.train_step(batch, inputs, while_queued=lambda ahead=ahead: ahead.append(prepare()))
            upcoming = ahead[0] if ahead else prepare()
            self.rng.rewind = upcoming[3] if upcoming is not None else None
            yield key, batch, metrics
        self.rng.rewind = None

    def train_step(self, batch: PackedBatch, inputs: StepInputs | None = None, *,
                   while_queued: Callable[[], None] | None = None) -> dict[str, torch.Tensor]:
        """One optimizer step on `batch` (prepared here unless `inputs` are given). `while_queued`
        runs on the host once the forward and the loss are launched, before the backward."""
        inputs = inputs if inputs is not None else self.prepare_step(batch)
        blocks = inputs.blocks
        if blocks.offered is not None:
            self.anchors_kept += blocks.real_anchors
            self.anchors_offered += blocks.offered
        loss, correct = self._forward_backward(inputs, net=self.drafter.net, profiler=self.profiler,
                                               while_queued=while_queued)
        if inputs.shape is not None:
            self.shape_record.count(eager=inputs.shape in self.shape_record.failed, anchors=blocks.real_anchors,
                                    anchor_padding=blocks.padding, rows=inputs.real_rows,
                                    row_padding=inputs.context.rows - inputs.real_rows)
        skipped = self._optimizer_step()
        if blocks.prefix_keys is not None:
            self.profiler.add_flops(self._step_flops(batch, blocks))
        valid = blocks.weights[:, 1:] > 0
        return {"loss": loss.detach(), "acc": slot_accuracy(correct.view(valid.shape), valid).detach(),
                "skipped": skipped}

    def _optimizer_step(self) -> torch.Tensor:
        """The clipped AdamW step and the schedule's; skipped when the gradients are not finite
        (the returned bool tensor, on the device, says so), counted in `skip_run`."""
        with self.profiler.device_span("optimizer.step", self._stream()):
            skipped = clipped_step(self.drafter.optimizer, self.params, self.cfg.grad_clip)
            self.drafter.schedule.step()
            self.drafter.optimizer.zero_grad(set_to_none=True)
        # steps skipped in a row, on the device: read at log steps only (MetricsLog)
        self.skip_run = (self.skip_run + 1) * skipped if self.skip_run is not None else skipped.long()
        return skipped

    def _step_flops(self, batch: PackedBatch, blocks: Blocks) -> float:
        """The model FLOPs of the step on `blocks` (its real anchors: padding is not counted), whose
        `prefix_keys` were counted (anchors sampled on the host)."""
        if blocks.prefix_keys is None:
            raise ValueError("_step_flops: the anchors were sampled on the device, without prefix_keys")
        return step_flops(self.drafter_cfg, context_tokens=batch.num_tokens, num_blocks=blocks.real_anchors,
                          prefix_keys=blocks.prefix_keys).total

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
        with profiler.device_span("drafter.forward", stream), self.drafter.precision.autocast_on(self.device):
            features = context.features if self.device.type == "cuda" else context.features.float()
            scored = self._scored_hidden(net, features, context.positions, blocks, inputs.masks,
                                         static=inputs.shape is not None, eager=eager)
        with profiler.device_span("dflash.chunked_loss", stream):
            return chunked_weighted_ce(scored, self.drafter.head.lm_head_weight, blocks.labels[:, 1:].reshape(-1),
                                       blocks.weights[:, 1:].reshape(-1), chunk_size=self.cfg.loss_chunk,
                                       kernel=self.loss_kernel)

    def _scored_hidden(self, net: torch.nn.Module, features: torch.Tensor, ctx_positions: torch.Tensor,
                       blocks: Blocks, masks: dict, *, static: bool, eager: bool) -> torch.Tensor:
        """The drafter's final states of the scored slots 1..B-1, [A * (B - 1), H] (slot 0 is the
        given anchor token), computed on fewer rows than the blocks hold, the same function: the block
        input's distinct rows, each anchor then the mask token that fills every other slot, and out
        only the scored ones (DFlashDrafter.forward)."""
        head = self.drafter.head
        distinct = torch.cat((blocks.input_ids[:, 0], blocks.input_ids.new_full((1,), self.drafter_cfg.mask_token_id)))
        return net(features, ctx_positions, head.embed(distinct), blocks.position_ids.reshape(-1), masks,
                   static=static, eager=eager, distinct_rows=True, scored_only=True,
                   out_dtype=head.lm_head_weight.dtype)  # the dtype the loss multiplies them in

    def warm_up(self) -> float:
        """Compile every static shape before the first step (a made-up batch of each through forward
        and backward) and return the seconds it took; a shape whose compiled step fails is logged
        and runs eagerly (`ShapeRecord`). So no step stops to compile mid-run (with several ranks,
        the others would wait for it at the next all-reduce), and the start-up reports all compiling.

        Nothing of the run changes: the bare drafter runs (no all-reduce), anchors come from a
        generator of its own, the gradients are dropped and no optimiser step is taken.
        """
        t0 = time.perf_counter()
        generator, idle = torch.Generator().manual_seed(0), StageProfiler(None)
        block_size, width = self.cfg.block_size, self.drafter_cfg.num_target_layers * self.drafter_cfg.hidden_size
        shapes = self.shapes.shapes if self.shapes is not None else []
        for i, shape in enumerate(shapes):
            t_shape = time.perf_counter()
            batch = warm_up_batch(shape, block_size=block_size, width=width, device=self.device)
            blocks = sample_anchors(batch, block_size=block_size, num_anchors=shape.anchors, max_anchors=shape.anchors,
                                    mask_token_id=self.drafter_cfg.mask_token_id, generator=generator)
            inputs = self.step_inputs(batch, blocks, shape=shape, profiler=idle)
            self.shape_record.try_compiled(
                shape, lambda inputs=inputs: self._forward_backward_once(inputs, self.model, idle, None, eager=False),
                undo=lambda: None)
            self.model.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            log.info("static shape %d of %d (%s) ready in %.1fs", i + 1, len(shapes), shape,
                     time.perf_counter() - t_shape)
        return time.perf_counter() - t0
