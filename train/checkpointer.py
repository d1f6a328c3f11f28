"""Checkpoints of a run made of parts: `Checkpointer` saves and restores the stateful parts of a
trainer (each an object with `state_dict`/`load_state_dict`) in the format dflash_cache.train.checkpoint
writes and reads (safetensors, and state.json with its fields as they always were):

    drafter      model, optimizer (and masters)  drafter.safetensors, optimizer.safetensors; optimizer_hparams
    schedule     the learning-rate schedule      scheduler, total_steps
    source       the data position               epoch, batch
    progress     steps and tokens trained        step, tokens_seen
    steps        the step runner's anchor cap    anchor_cap
    rng          every process's random states   rng.safetensors

and, beside them, what the run is (its identity, options and process count), which a resume must match.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash_cache.errors import UserError
from dflash_cache.options import cli_values
from dflash_cache.train.checkpoint import (
    TrainerState,
    UnreadableCheckpoint,
    last_checkpoint,
    list_checkpoints,
    read_state,
    read_tensors,
    save_files,
)
from dflash_cache.train.parts import DrafterParts, Progress, RngStates, Schedule
from dflash_cache.train.place import Place
from dflash_cache.train.run_directory import CHECKPOINTS_DIR
from dflash_cache.train.source import Source

if TYPE_CHECKING:
    from dflash_cache.train.run_config import TrainConfig
    from dflash_cache.train.step import StepRunner

log = logging.getLogger(__name__)

# Options a resume refuses to change (run_identity), those the schedule says itself, --resume, and
# --out (a run directory may be moved).
SAID_ELSEWHERE = ("--seed", "--token-budget", "--num-anchors", "--max-anchors", "--block-size", "--draft-layers",
                  "--sliding-window", "--lr", "--max-steps", "--epochs", "--resume", "--out")


def options_json(cfg: TrainConfig) -> dict[str, Any]:
    """The run's command-line options by flag, as JSON gives them back."""
    return json.loads(json.dumps(cli_values(cfg)))


def run_identity(cfg: TrainConfig, drafter: DrafterParts, source: Source) -> dict[str, Any]:
    """What decides the epoch plan and the model: a resume must match it (`check_same_run`).
    Keys are the options a user changes; values are JSON-normalised so they compare after a round trip."""
    ident = {"--seed": cfg.seed, "--token-budget": cfg.token_budget, "--num-anchors": cfg.num_anchors,
             "--max-anchors": cfg.max_anchors, "--block-size": cfg.block_size,
             "--draft-layers": cfg.draft_layers, "--sliding-window": cfg.sliding_window,
             "--target (drafter shape)": asdict(drafter.model.cfg), "--cache/--data": source.identity()}
    return json.loads(json.dumps(ident))


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


@dataclass
class CheckpointParts:
    """The stateful parts a checkpoint holds (see the module's table)."""

    drafter: DrafterParts
    schedule: Schedule
    source: Source
    progress: Progress
    steps: StepRunner
    rng: RngStates


class Checkpointer:
    """Saves `parts` into OUT/checkpoints (every process calls `save`; rank 0 writes) and restores
    them from the newest readable checkpoint of the same run."""

    def __init__(self, cfg: TrainConfig, parts: CheckpointParts, place: Place) -> None:
        self.cfg, self.parts, self.place = cfg, parts, place
        self.directory = Path(cfg.out) / CHECKPOINTS_DIR

    @cached_property
    def identity(self) -> dict[str, Any]:
        """The run's identity, fixed for the run: computed once (it hashes every sample of the source)."""
        return run_identity(self.cfg, self.parts.drafter, self.parts.source)

    @cached_property
    def options(self) -> dict[str, Any]:
        return options_json(self.cfg)

    def save(self) -> Path | None:
        """Checkpoint the parts; a UserError instead of writing weights that are not finite (a run
        that diverged). A collective call with several processes."""
        parts = self.parts
        if not parts.drafter.finite():
            raise UserError(f"at step {parts.progress.step} the drafter's weights are not finite (the run diverged), "
                            f"so they are neither checkpointed nor exported; {last_checkpoint(self.directory)}: "
                            "train again with a lower --lr")
        rng = parts.rng.state_dict()
        path = None
        if self.place.rank == 0:
            tensors = parts.drafter.state_dict()
            hparams = tensors.pop("optimizer_hparams")
            schedule = parts.schedule.state_dict()
            state = TrainerState(**parts.progress.state_dict(), **parts.source.state_dict(), world=self.place.world,
                                 run=self.identity,
                                 **parts.steps.state_dict(), total_steps=schedule["total_steps"],
                                 options=self.options, scheduler=schedule["scheduler"],
                                 optimizer_hparams=hparams)
            path = save_files(self.directory, {**tensors, "rng.safetensors": rng}, state=state,
                              keep=self.cfg.keep_checkpoints)
            log.info("checkpoint %s", path)
        if self.place.world > 1:
            torch.distributed.barrier()
        return path

    def restore(self) -> bool:
        """Load the newest readable checkpoint (falling back past unreadable ones, and saying so);
        False if there is none. A checkpoint of a differently configured run is refused."""
        candidates = list_checkpoints(self.directory)
        current = self.identity
        for path in candidates:
            try:
                state = read_state(path)
                check_same_run(state.run, current, path, target=self.cfg.target)
                tensors = read_tensors(path)
                self.parts.drafter.load_state_dict({**tensors, "optimizer_hparams": state.optimizer_hparams})
            except UnreadableCheckpoint as e:
                log.warning("checkpoint %s cannot be used (%s); falling back to the one before it", path.name, e)
                continue
            self._load(path, state, tensors["rng.safetensors"])
            return True
        if candidates:
            raise UserError(f"no checkpoint in {self.directory} is readable (see the warnings above); "
                            "start a new run with another --out")
        return False

    def _load(self, path: Path, state: TrainerState, rng: dict[str, torch.Tensor]) -> None:
        """The other parts' states. With another process count the batch order continues exactly
        from the global position; the anchor draws are re-seeded and, unless --max-steps fixes it,
        the schedule's end is where this count's epochs end."""
        parts, world = self.parts, self.place.world
        same_world = state.world == world
        parts.schedule.load_state_dict({"scheduler": state.scheduler,
                                        "total_steps": state.total_steps if same_world else None})
        self._say_changed_options(state)
        parts.steps.load_state_dict({"anchor_cap": state.anchor_cap})
        parts.progress.load_state_dict({"step": state.step, "tokens_seen": state.tokens_seen})
        parts.source.load_state_dict({"epoch": state.epoch, "batch": state.batch})
        if same_world:
            parts.rng.load_state_dict(rng)
        else:
            parts.rng.reseed(state.step)
            if self.cfg.max_steps is None:
                parts.schedule.total_steps = state.step + parts.source.batches_left(self.cfg.epochs)
            log.warning("resuming a run of %d process(es) with %d: the batch order continues where it stopped; "
                        "anchors are re-seeded and the schedule now ends at step %d", state.world, world,
                        parts.schedule.total_steps)
        log.info("resumed from %s (step %d, epoch %d, batch %d of all ranks)", path, state.step, state.epoch,
                 state.batch)

    def _say_changed_options(self, state: TrainerState) -> None:
        """The other options given anew on a resume apply as given; one line names each that changed
        since the checkpoint's run, so none changes without a word."""
        if state.options is None or self.place.rank != 0:
            return
        now = self.options
        changed = [f"{flag} {_shown(now.get(flag))} (was {_shown(state.options.get(flag))})"
                   for flag in sorted(set(now) | set(state.options))
                   if flag not in SAID_ELSEWHERE and now.get(flag) != state.options.get(flag)]
        if changed:
            log.info("--resume: options changed since the checkpoint's run, applied from step %d: %s", state.step,
                     "; ".join(changed))
