"""The stateful parts a trainer is made of, each with the `state_dict`/`load_state_dict` its checkpoint
takes (dflash_cache.train.checkpointer): the drafter with its optimiser (and float32 masters), the
learning-rate schedule, the step count, and the random states. The data position is the source's
(dflash_cache.train.source); the step itself is dflash_cache.train.step's.

Each works at a `Place` (dflash_cache.train.place): the device, this process's rank, its profiler.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dflash_cache.train.checkpoint import apply_tensors, drafter_tensors, optimizer_hparams
from dflash_cache.train.config import DrafterConfig
from dflash_cache.train.drafter import DFlashDrafter, FrozenTargetHead, init_drafter
from dflash_cache.train.optim import drafter_optimizer, warmup_cosine
from dflash_cache.train.place import Place
from dflash_cache.train.precision import Precision, fp32_allreduce_hook

if TYPE_CHECKING:
    from dflash_cache.train.run_config import TrainConfig

log = logging.getLogger(__name__)


def lr_factor(step: int, total: int, warmup_ratio: float) -> float:
    """Linear warmup over warmup_ratio * total steps, then cosine decay to 0 at `total`."""
    return warmup_cosine(step, total, warmup=max(1, int(round(warmup_ratio * total))))


class Schedule:
    """The learning rate over the run: `lr_factor` of the step up to `total_steps`, which a resume
    may move (the lambda reads it at every step)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, lr: float, total_steps: int, warmup_ratio: float) -> None:
        self.lr, self.total_steps = lr, total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, self.total_steps, warmup_ratio))

    def step(self) -> None:
        self.scheduler.step()

    def last_lr(self) -> float:
        # (torch types it float | Tensor: a tensor only for a tensor lr, which the drafter's optimiser never has)
        return self.scheduler.get_last_lr()[0]  # pyright: ignore[reportReturnType]

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The checkpoint's place in the schedule. Options of the schedule given anew take effect from
        there, each with a line: a new --lr is the new peak (the shape kept); a new end
        (`total_steps`, from this run's options) is said when `state` has one that differs."""
        scheduler = self.scheduler
        scheduler.load_state_dict(state["scheduler"])
        step = scheduler.last_epoch
        old_lr = scheduler.base_lrs[0]
        if old_lr != self.lr:
            scheduler.base_lrs = [self.lr] * len(scheduler.base_lrs)
            for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas, strict=True):
                group["initial_lr"], group["lr"] = self.lr, self.lr * factor(step)
            scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]
            log.info("--lr %g applied on resume (the checkpoint's run had %g): from step %d the schedule "
                     "continues with the new peak", self.lr, old_lr, step)
        if state.get("total_steps") not in (None, self.total_steps):
            log.info("--max-steps/--epochs changed on resume: the schedule now ends at step %d (it ended at %d)",
                     self.total_steps, state["total_steps"])


@dataclass
class DrafterParts:
    """The drafter and what trains it: `model` (the bare module: checkpoints and export), `net` (what
    steps run: DDP around `model` with several processes), the target's frozen `head`, the
    `optimizer` (with float32 masters of bf16 weights under `precision.master_weights`), its
    `schedule` and the `precision` steps run at. Shared by the step runner and the checkpointer."""

    model: DFlashDrafter
    net: torch.nn.Module
    head: FrozenTargetHead
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    precision: Precision

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's drafter.safetensors (float32 weights: masters where kept) and
        optimizer.safetensors by file name, and the optimiser's hyper-parameters."""
        return {**drafter_tensors(self.model, self.optimizer), "optimizer_hparams": optimizer_hparams(self.optimizer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        apply_tensors(state, state["optimizer_hparams"], model=self.model, optimizer=self.optimizer)

    def finite(self) -> bool:
        """Whether every weight (and master) is finite."""
        values = [*self.model.parameters(), *getattr(self.optimizer, "master_weights", dict)().values()]
        return bool(torch.stack([torch.isfinite(v).all() for v in values]).all())


def drafter_parts(cfg: TrainConfig, drafter_cfg: DrafterConfig, head: FrozenTargetHead, *, place: Place,
                  precision: Precision, total_steps: int) -> DrafterParts:
    """A fresh drafter on `place.device` with its optimiser and a schedule to `total_steps`
    (DDP-wrapped with several processes)."""
    device = place.device
    head = head.to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = init_drafter(drafter_cfg, cfg.seed).to(device)
    # Before DDP: with master weights it lowers the linear weights to bf16.
    optimizer = drafter_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay, device=device,
                                  precision=precision)
    # DDP wraps the forward/backward; checkpoints and export use the bare module. Gradients live
    # in DDP's buckets rather than beside them: no second gradient-sized copy for the memory
    # model (which counts one) to miss.
    net: torch.nn.Module = model
    if place.world > 1:
        net = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        if precision.master_weights:
            net.register_comm_hook(None, fp32_allreduce_hook)
    schedule = Schedule(optimizer, lr=cfg.lr, total_steps=total_steps, warmup_ratio=cfg.warmup_ratio)
    return DrafterParts(model=model, net=net, head=head, optimizer=optimizer, schedule=schedule, precision=precision)


@dataclass
class Progress:
    """How far the run is: optimiser steps taken and context tokens trained on."""

    step: int = 0
    tokens_seen: int = 0

    def advance(self, tokens: int) -> None:
        self.step += 1
        self.tokens_seen += tokens

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]


class RngStates:
    """The random states a resume must find again: torch's global CPU (and CUDA) states and the
    generator the anchors are drawn from, of every process. `rewind`, when set, is the anchor
    generator's state before a batch that was sampled ahead but not trained on yet
    (dflash_cache.train.step): what a checkpoint holds, so that a resume draws that batch again."""

    def __init__(self, seed: int, place: Place) -> None:
        self.seed, self.place = seed, place
        self.generator = torch.Generator().manual_seed(seed * 1000003 + place.rank)
        self.rewind: torch.Tensor | None = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every process's states, keyed by rank (a collective call when world > 1)."""
        device, world = self.place.device, self.place.world
        anchors = self.rewind if self.rewind is not None else self.generator.get_state()
        own = {"torch_cpu": torch.get_rng_state(), "anchors": anchors}
        if device.type == "cuda":
            own["torch_cuda"] = torch.cuda.get_rng_state(device)
        per_rank = [own]
        if world > 1:
            gathered: list[Any] = [None] * world  # all_gather_object puts every rank's states in
            torch.distributed.all_gather_object(gathered, own)
            per_rank = gathered
        return {f"{k}.rank{r}": v for r, states in enumerate(per_rank) for k, v in states.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """This process's states from a checkpoint of as many processes."""
        rank, device = self.place.rank, self.place.device
        torch.set_rng_state(state[f"torch_cpu.rank{rank}"])
        self.generator.set_state(state[f"anchors.rank{rank}"])
        self.rewind = None
        if f"torch_cuda.rank{rank}" in state and device.type == "cuda":
            torch.cuda.set_rng_state(state[f"torch_cuda.rank{rank}"], device)

    def reseed(self, step: int) -> None:
        """After a resume with another process count: anchor draws were per rank and cannot continue,
        so each rank re-seeds from (seed, step, rank)."""
        self.generator.manual_seed((self.seed * 1000003 + step) * 1009 + self.place.rank)
        self.rewind = None
