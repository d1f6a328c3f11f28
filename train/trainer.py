"""The phase-2 trainer: the DFlash drafter on packed batches from a source.

One step: sample anchors in the packed batch -> build one attention mask per kind of layer ->
drafter forward on [context | blocks] -> chunked, decay-weighted cross-entropy through the
target's frozen LM head -> AdamW step under a warmup + cosine schedule with gradient clipping.
Metrics stay on the device and are read only on logging steps (no per-step host sync).
State that resume needs is small: the step, the source position (epoch, batches consumed), the
scheduler and optimizer state, and the RNG states; the source recomputes its plan from those.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_cache.errors import UserError
from dflash_cache.profiler import StageProfiler, interval_from_env
from train.anchors import sample_anchors
from train.batch import PackedBatch
from train.cache_source import CacheSource
from train.checkpoint import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    optimizer_hparams,
    save_checkpoint,
)
from train.config import DrafterConfig
from train.drafter import DFlashDrafter, FrozenTargetHead, init_drafter
from train.epochs import Position
from train.export import export_drafter
from train.live_source import LiveSource
from train.loss import chunked_weighted_ce, slot_accuracy, tau_hat
from train.masks import build_masks, context_doc_pos

log = logging.getLogger(__name__)
Source = CacheSource | LiveSource


@dataclass(frozen=True, kw_only=True)
class LiveConfig:
    """`train --live`: the target runs beside the drafter instead of a cache feeding it."""

    data: str
    limit: int | None = None
    max_len: int | None = None
    overlong: str = "truncate"
    target_gpus: str = "same"   # 'same' (the drafter's device), 'cpu', or GPU indices like 0,1
    num_target_layers: int = 5
    layers: tuple[int, ...] | None = None
    dtype: str = "bfloat16"
    queue_depth: int = 60
    forward_token_budget: int = 49152  # the target's forward batches, planned as extraction plans them
    forward_max_rows: int = 64
    write_cache: str | None = None
    write_codec: str = "bf16"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    target: str
    out: str
    cache: str | None = None
    live: LiveConfig | None = None
    block_size: int = 16
    draft_layers: int = 5
    num_anchors: int = 512
    max_anchors: int | None = None  # per packed batch; bounds drafter memory on batches of short samples
    epochs: int = 6
    max_steps: int | None = None
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    token_budget: int = 32768
    seed: int = 0
    save_every: int = 500
    log_every: int = 10
    resume: bool = False
    sliding_window: int | None = None
    mask_token_id: int | None = None
    loss_chunk: int = 4096
    prefetch: int = 4
    read_threads: int = 4
    trust_remote_code: bool = False
    profile_interval: float | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if (self.cache is None) == (self.live is None):
            raise UserError("give either --cache DIR or --live with --data")
        if self.epochs < 1 and self.max_steps is None:
            raise UserError("--epochs must be at least 1 (or give --max-steps)")
        if self.block_size < 2 or self.num_anchors < 1 or self.draft_layers < 1:
            raise UserError("--block-size must be >= 2, --num-anchors and --draft-layers >= 1")
        if self.max_anchors is not None and self.max_anchors < 1:
            raise UserError(f"--max-anchors must be >= 1, got {self.max_anchors}")


def lr_factor(step: int, total: int, warmup_ratio: float) -> float:
    """Linear warmup over warmup_ratio * total steps, then cosine decay to 0 at `total`."""
    warmup = max(1, int(round(warmup_ratio * total)))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class Trainer:
    """Owns the drafter, optimiser, schedule and source of one rank. `Trainer.build` makes one from a
    config (loading the target's embedding and LM head and checking the cache against it); the
    constructor takes those pieces ready-made, which is what benchmarks with synthetic targets use."""

    @classmethod
    def build(cls, cfg: TrainConfig, *, device: torch.device, rank: int = 0, world: int = 1) -> Trainer:
        from train.sources import cache_parts, live_parts

        t0 = time.perf_counter()
        profiler = StageProfiler(interval_from_env(cfg.profile_interval), prefix=f"[rank {rank}] ")
        parts = (cache_parts if cfg.cache is not None else live_parts)(cfg, device, rank, world, profiler)
        trainer = cls(cfg, source=parts.source, drafter_cfg=parts.drafter_cfg, head=parts.head, device=device,
                      rank=rank, world=world, profiler=profiler)
        trainer.build_seconds = time.perf_counter() - t0
        return trainer

    def __init__(self, cfg: TrainConfig, *, source: Source, drafter_cfg: DrafterConfig, head: FrozenTargetHead,
                 device: torch.device, rank: int = 0, world: int = 1, profiler: StageProfiler | None = None) -> None:
        self.cfg, self.device, self.rank, self.world = cfg, device, rank, world
        self.out = Path(cfg.out)
        self.source, self.drafter_cfg = source, drafter_cfg
        head_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.head = head.to(device=device, dtype=head_dtype)
        self.model: DFlashDrafter = init_drafter(self.drafter_cfg, cfg.seed).to(device)
        # DDP wraps the forward/backward; checkpoints and export use the bare module.
        self.net = torch.nn.parallel.DistributedDataParallel(self.model) if world > 1 else self.model
        decay, no_decay = [], []
        for p in self.model.parameters():
            (no_decay if p.ndim < 2 else decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda",
        )
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
        self.backend = "flex" if device.type == "cuda" else "dense"
        self.step, self.position, self.tokens_seen = 0, Position(0, 0), 0
        self.build_seconds: float | None = None  # set by build(): source, target head and drafter set-up
        log.info("drafter: %d layers, block %d, %.1fM parameters; %d batches/epoch, %d steps",
                 cfg.draft_layers, cfg.block_size, sum(p.numel() for p in self.model.parameters()) / 1e6,
                 per_epoch, self.total_steps)

    # --- checkpoints ---------------------------------------------------------------------
    def _rng_state(self) -> dict[str, torch.Tensor]:
        """Every rank's RNG states, keyed by rank (a collective call when world > 1)."""
        own = {"torch_cpu": torch.get_rng_state(), "anchors": self.generator.get_state()}
        if self.device.type == "cuda":
            own["torch_cuda"] = torch.cuda.get_rng_state(self.device)
        per_rank = [own]
        if self.world > 1:
            per_rank = [None] * self.world
            torch.distributed.all_gather_object(per_rank, own)
        return {f"{k}.rank{r}": v for r, states in enumerate(per_rank) for k, v in states.items()}

    def save(self) -> Path | None:
        """Checkpoint (all ranks call it; rank 0 writes)."""
        rng = self._rng_state()
        path = None
        if self.rank == 0:
            state = TrainerState(step=self.step, epoch=self.position.epoch, batch=self.position.batch,
                                 tokens_seen=self.tokens_seen, scheduler=self.scheduler.state_dict(),
                                 optimizer_hparams=optimizer_hparams(self.optimizer))
            path = save_checkpoint(self.out / "checkpoints", model=self.model, optimizer=self.optimizer,
                                   state=state, rng=rng)
            log.info("checkpoint %s", path)
        if self.world > 1:
            torch.distributed.barrier()
        return path

    def restore(self) -> bool:
        path = latest_checkpoint(self.out / "checkpoints")
        if path is None:
            return False
        state, rng = load_checkpoint(path, model=self.model, optimizer=self.optimizer)
        saved_world = sum(k.startswith("anchors.rank") for k in rng)
        if saved_world != self.world:
            raise UserError(f"checkpoint {path} was written by {saved_world} process(es); resume it with the "
                            f"same number (this run has {self.world})")
        self.scheduler.load_state_dict(state.scheduler)
        torch.set_rng_state(rng[f"torch_cpu.rank{self.rank}"])
        self.generator.set_state(rng[f"anchors.rank{self.rank}"])
        if f"torch_cuda.rank{self.rank}" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng[f"torch_cuda.rank{self.rank}"], self.device)
        self.step, self.position, self.tokens_seen = state.step, Position(state.epoch, state.batch), state.tokens_seen
        log.info("resumed from %s (step %d, epoch %d, batch %d)", path, self.step, state.epoch, state.batch)
        return True

    # --- the step ------------------------------------------------------------------------
    def train_step(self, batch: PackedBatch) -> dict[str, torch.Tensor]:
        cfg, dcfg = self.cfg, self.drafter_cfg
        with self.profiler.span("dflash.anchors"):
            blocks = sample_anchors(batch, block_size=cfg.block_size, num_anchors=cfg.num_anchors,
                                    max_anchors=cfg.max_anchors,
                                    mask_token_id=dcfg.mask_token_id, generator=self.generator)
        with self.profiler.span("dflash.create_block_mask"):
            ctx_doc, ctx_pos = context_doc_pos(batch)
            masks = build_masks(ctx_doc, ctx_pos, blocks, layer_types=dcfg.layer_types,
                                sliding_window=dcfg.sliding_window, backend=self.backend,
                                compile=self.backend == "flex")
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")
        with self.profiler.span("drafter.forward"), autocast:
            features = batch.features if self.device.type == "cuda" else batch.features.float()
            embeds = self.head.embed(blocks.input_ids.reshape(-1))
            hidden = self.net(features, batch.position_ids, embeds, blocks.position_ids.reshape(-1), masks)
        with self.profiler.span("dflash.chunked_loss"):
            loss, correct = chunked_weighted_ce(hidden, self.head.lm_head_weight, blocks.labels.reshape(-1),
                                                blocks.weights.reshape(-1), chunk_size=cfg.loss_chunk)
        with self.profiler.span("drafter.backward"):
            loss.backward()
        with self.profiler.span("optimizer.step"):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        valid = blocks.weights > 0
        return {"loss": loss.detach(), "acc": slot_accuracy(correct.reshape(valid.shape), valid).detach()}

    def fit(self) -> dict[str, float]:
        """Train until max_steps or the epochs are done; checkpoint, export and return the last metrics."""
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        if cfg.resume and not self.restore():
            log.info("--resume: no checkpoint in %s, starting fresh", self.out / "checkpoints")
        elif not cfg.resume and latest_checkpoint(self.out / "checkpoints") is not None:
            raise UserError(f"{self.out} already holds checkpoints; pass --resume to continue or choose another --out")
        metrics_path = self.out / "metrics.jsonl"
        bar = tqdm(total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True,
                   disable=not (cfg.progress and self.rank == 0))
        last: dict[str, float] = {}
        window: list[dict[str, torch.Tensor]] = []
        t_window, tok_window = time.perf_counter(), 0
        t_start, first_step = time.perf_counter(), True
        try:
            for position, batch in self.source.iterate(self.position, epochs=None if cfg.max_steps else cfg.epochs):
                if self.step >= self.total_steps:
                    break
                if first_step:
                    t_batch = time.perf_counter()
                window.append(self.train_step(batch))
                if first_step:
                    self._log_startup(t_start, t_batch)
                    first_step = False
                self.step, self.position = self.step + 1, position
                self.tokens_seen += batch.num_tokens
                tok_window += batch.num_tokens
                self.profiler.add_tokens(batch.num_tokens)
                self.profiler.maybe_report()
                bar.update(1)
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    last = self._log(window, time.perf_counter() - t_window, tok_window, metrics_path)
                    bar.set_postfix(loss=f"{last['loss']:.3f}", tau=f"{last['tau_hat']:.2f}")
                    window, t_window, tok_window = [], time.perf_counter(), 0
                if self.step % cfg.save_every == 0:
                    self.save()
        except KeyboardInterrupt:
            log.warning("interrupted at step %d: saving a checkpoint", self.step)
            self.save()
            raise
        finally:
            bar.close()
            self.source.close()
        if window:
            last = self._log(window, time.perf_counter() - t_window, tok_window, metrics_path)
        self.save()
        if self.rank == 0:
            export_drafter(self.model, self.drafter_cfg, self.out / "export")
        return last

    def _log_startup(self, t_start: float, t_batch: float) -> None:
        """Where start-up went: it can take minutes at scale (loading, the first read, compiling)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        build = f"set-up {self.build_seconds:.1f}s, " if self.build_seconds is not None else ""
        log.info("start-up: %sfirst batch %.1fs, first step %.1fs (compilation included)", build,
                 t_batch - t_start, now - t_batch)

    def _log(self, window: list[dict[str, torch.Tensor]], seconds: float, tokens: int, path: Path) -> dict[str, float]:
        """Average the window's metrics (over ranks too: one collective per log step) and record them."""
        stats = torch.cat([torch.stack([w["loss"] for w in window]).mean()[None],
                           torch.stack([w["acc"] for w in window]).mean(0)])
        if self.world > 1:
            torch.distributed.all_reduce(stats)
            stats /= self.world
            tokens *= self.world
        stats = stats.cpu()
        loss, acc = float(stats[0]), stats[2:]
        row = {"step": self.step, "epoch": self.position.epoch, "loss": loss, "lr": self.scheduler.get_last_lr()[0],
               "tau_hat": tau_hat(acc), "slot_acc": [round(float(a), 4) for a in acc],
               "tokens_per_s": tokens / max(seconds, 1e-9), "tokens_seen": self.tokens_seen}
        if self.rank == 0:
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            log.info("step %d  loss %.4f  tau_hat %.3f  acc@1 %.3f  lr %.2e  %.0f tok/s", self.step, loss,
                     row["tau_hat"], row["slot_acc"][0], row["lr"], row["tokens_per_s"])
        return row


def train(cfg: TrainConfig, device: str = "auto") -> dict[str, float]:
    """Single process, or one rank under torchrun (NCCL on GPUs, gloo on CPUs)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available() and device != "cpu"
    if world > 1:
        local = int(os.environ.get("LOCAL_RANK", 0))
        dev = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(dev)
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    else:
        dev = torch.device("cuda" if cuda else "cpu") if device == "auto" else torch.device(device)
    try:
        return Trainer.build(cfg, device=dev, rank=rank, world=world).fit()
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()


__all__ = ["TrainConfig", "Trainer", "lr_factor", "train"]
