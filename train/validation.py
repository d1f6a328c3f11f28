"""Held-out evaluation during training (`--eval-data`): the loss and tau_hat on fixed held-out batches.

Every evaluation scores the same blocks: the first `--eval-batches` batches of epoch 0 of the held-out
data, planned with a seed of their own (EVAL_SEED, not --seed), each batch's anchors drawn from a
generator seeded by the batch's index. So results compare across steps, resumes, runs of other seeds
and process counts; and training is bit for bit what it is without evaluating: no optimiser step, no
draw from the trainer's random generators, no move of its data position. With several processes,
global batch i is rank i % world's and the sums are all-reduced.

The loss is pooled over the batches (sum of weight x cross-entropy over the sum of weights), and
tau_hat comes from the slot accuracies pooled the same way; a training row's are means over its steps.
An evaluation costs reading `--eval-batches` batches (for a dataset under --live, the target's forwards
on them) and the drafter's forward and loss on each, shared out among the processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash_cache.errors import UserError
from dflash_cache.profiler import StageProfiler
from dflash_cache.store.batch import PackedBatch
from dflash_cache.store.layout import MANIFEST_FILE
from dflash_cache.store.location import is_url
from dflash_cache.train.cache_source import CacheSource, check_manifest
from dflash_cache.train.epoch_plan import Position
from dflash_cache.train.live_source import LiveSource
from dflash_cache.train.loss import tau_hat
from dflash_cache.train.place import Place

if TYPE_CHECKING:
    from dflash_cache.train.assemble import Parts
    from dflash_cache.train.run_config import TrainConfig
    from dflash_cache.train.step import StepRunner

log = logging.getLogger(__name__)

EVAL_SEED = 0  # plans the held-out batches (which samples, in what order), whatever --seed is
ANCHOR_SEED = 0x5EED  # plus a held-out batch's global index: the seed of its anchors' generator


def is_cache(data: str) -> bool:
    """Whether `data` names a cache (a URL, or a directory holding a manifest) rather than a dataset."""
    return is_url(data) or (Path(data).expanduser() / MANIFEST_FILE).is_file()


def check_eval_data(cfg: TrainConfig) -> None:
    """Before anything loads: refuse a dataset as --eval-data of a run from --cache (a path that does
    not exist is left to the cache reader, which says so)."""
    data = cfg.eval_data
    if data is None or cfg.live is not None or is_cache(data):
        return
    if data == "demo" or Path(data).expanduser().exists():
        raise UserError(f"--eval-data {data} is a dataset, not a cache: a run from --cache evaluates on a cache; "
                        "extract the held-out rows into one with `dflash-cache extract` (the same --target and "
                        "layers) and pass its directory, or train with --live")


@dataclass(frozen=True)
class Evaluation:
    """One evaluation's results, summed over every process."""

    step: int
    loss: float | None  # None when not finite (strict JSON)
    slot_acc: list[float] | None
    batches: int
    tokens: int  # context tokens of the held-out batches
    seconds: float

    @property
    def tau_hat(self) -> float | None:
        return tau_hat(self.slot_acc) if self.slot_acc is not None else None

    def row(self) -> dict[str, Any]:
        """Its metrics.jsonl row: `split` tells it from the training rows (which have none)."""
        return {"step": self.step, "split": "eval", "eval_loss": self.loss, "eval_tau_hat": self.tau_hat,
                "eval_slot_acc": [round(a, 4) for a in self.slot_acc] if self.slot_acc is not None else None,
                "eval_batches": self.batches, "eval_tokens": self.tokens,
                "eval_seconds": round(self.seconds, 3)}

    def line(self) -> str:
        shown = (f"loss {self.loss:.4f} tau_hat {self.tau_hat:.3f}" if self.loss is not None
                 else "loss not finite")
        return f"eval step {self.step}: {shown} over {self.batches} batches ({self.tokens} tokens)"


@dataclass
class Validation:
    """The held-out batches of a run (this process's share) and the steps that evaluate them."""

    data: str
    source: CacheSource | LiveSource  # capped at this process's share of the batches
    every: int
    batches: int  # global batches per evaluation: --eval-batches, or all the data holds if fewer

    @classmethod
    def build(cls, cfg: TrainConfig, parts: Parts, place: Place) -> Validation | None:
        """None without --eval-data. A held-out cache gets the training cache's checks (complete, made
        for this target and layers); a dataset (--live only) runs through the run's loaded targets
        (`parts.source`'s)."""
        from dflash_cache.train.assemble import live_dataset, open_cache, source_config

        data = cfg.eval_data
        if data is None:
            return None
        rank, world = place.rank, place.world
        share = len(range(rank, cfg.eval_batches, world))  # global batch i is rank i % world's
        config = dataclasses.replace(source_config(cfg), seed=EVAL_SEED, max_batches=share)
        drafter_cfg, target = parts.drafter_cfg, parts.target
        if target is None:
            raise ValueError("--eval-data: the run's parts name no target to check the held-out data against")
        try:
            if cfg.live is None or is_cache(data):
                reader = open_cache(data, allow_incomplete=cfg.allow_incomplete)
                check_manifest(reader.manifest, target=target, layer_ids=drafter_cfg.target_layer_ids,
                               hidden_size=drafter_cfg.hidden_size)
                source = CacheSource(reader, config, dataclasses.replace(place, profiler=StageProfiler(None)))
            else:
                live = parts.source
                if not isinstance(live, LiveSource):
                    raise ValueError("--eval-data with --live: the run's source does not run the targets")
                held_out = live_dataset(cfg, data, None, vocab_size=target.vocab_size,
                                        max_context=drafter_cfg.max_position_embeddings)
                source = live.for_dataset(held_out, config)
        except UserError as e:
            raise type(e)(f"--eval-data: {e}") from None
        planned = world * len(source.table.epoch(config, 0, rank, world))  # every process plans as many
        if planned == 0:
            processes = f", and a batch for each of the {world} processes" if world > 1 else ""
            raise UserError(f"--eval-data {data} yields no held-out batch (a sample needs >= {2 * cfg.block_size} "
                            f"supervised tokens{processes}); give more held-out rows or a smaller --block-size")
        return cls(data=data, source=source, every=cfg.eval_every or cfg.save_every,
                   batches=min(cfg.eval_batches, planned))

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def describe(self) -> str:
        return f"{self.batches} held-out batches of {self.data} every {self.every} steps and at the end"

    def run(self, runner: StepRunner, step: int) -> Evaluation:
        """Evaluate `runner`'s drafter at `step`: in eval mode and without gradients, its mode then
        restored; nothing of the training state is touched (the global random states are restored
        too, though nothing here draws from them). A collective call with several processes."""
        device, model, place = runner.device, runner.model, runner.place
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the training work queued so far is not timed as evaluation
        t0 = time.perf_counter()
        slots = runner.cfg.block_size - 1
        # [sum of weight x CE, sum of weights, right per slot..., scored per slot...]
        sums = torch.zeros(2 + 2 * slots, dtype=torch.float64, device=device)
        batches = tokens = 0
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                    contextlib.closing(self.source.iterate(Position(0, 0), epochs=1)) as held_out:
                for _, batch in held_out:
                    sums += _batch_sums(runner, batch, batches * place.world + place.rank)
                    batches, tokens = batches + 1, tokens + batch.num_tokens
        finally:
            model.train(was_training)
        sums = torch.cat((sums, torch.tensor([batches, tokens], dtype=sums.dtype).to(device)))
        if place.world > 1:
            torch.distributed.all_reduce(sums)
        loss_sum, weight, *per_slot, batches, tokens = sums.tolist()  # waits for the device
        right, scored = per_slot[:slots], per_slot[slots:]
        acc = [r / s if s else 0.0 for r, s in zip(right, scored, strict=True)]  # as slot_accuracy does
        loss = loss_sum / weight if weight else math.nan
        finite = math.isfinite(loss) and all(math.isfinite(a) for a in acc)
        return Evaluation(step=step, loss=loss if finite else None,
                          slot_acc=acc if finite else None, batches=int(batches),
                          tokens=int(tokens), seconds=time.perf_counter() - t0)


def _batch_sums(runner: StepRunner, batch: PackedBatch, index: int) -> torch.Tensor:
    """One held-out batch's part of `Validation.run`'s sums, on the device (timed by no profiler:
    the run's times training alone)."""
    blocks = runner.anchors(batch, torch.Generator().manual_seed(ANCHOR_SEED + index))
    # Padded to one of the run's static shapes where one fits, so that the masks are built for shapes the
    # run has seen; the layers run eagerly (uncompiled): their compiled graphs were built for training
    # (gradients on), and a forward under no_grad would compile every one of them again. Eager is the
    # path a static shape whose compilation failed takes; on a GPU its FlexAttention is compiled once per
    # process (`default_flex_attention`), and the loss's Triton kernel gets a variant without the gradient.
    shape = runner.shapes.shape_for(batch.num_tokens, blocks.num_anchors) if runner.shapes is not None else None
    idle = StageProfiler(None)
    inputs = runner.step_inputs(batch, blocks, shape=shape, profiler=idle)
    loss, correct = runner.forward_loss(inputs, runner.model, idle, eager=True)
    weights = inputs.blocks.weights[:, 1:]
    valid = weights > 0
    weight = weights.sum()
    return torch.cat(((loss * weight)[None], weight[None], (correct.view(valid.shape) & valid).sum(0),
                      valid.sum(0))).double()
