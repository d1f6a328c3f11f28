"""Checkpoints: safetensors for tensors, JSON for everything else, no pickle.

    out/checkpoints/step_000500/
        drafter.safetensors     fp32 weights (the optimizer's masters of bf16 ones)
        optimizer.safetensors   AdamW moments, flattened by parameter name
        rng.safetensors         torch CPU (and CUDA) RNG states and the anchor generator's state, per rank
        state.json              format version, step, global source position, world size, the run's
                                identity (what decides the plan and the model), scheduler, optimizer
                                hyper-parameters; written last: a checkpoint without it does not count

A checkpoint is written under a temporary name, every file fsynced, then renamed into place; only
then are checkpoints beyond the newest `keep` deleted, so the last good one is never removed before
its successor is complete. A checkpoint that cannot be read (truncated file, malformed state) is
reported as `UnreadableCheckpoint` so the trainer can fall back to the one before it.

A kill can leave work half done: a `.tmp_step_N` being written, a `.old_step_N` being replaced, a
`.stale_step_N` being deleted. `tidy_checkpoints` (run under the run directory's lock) finishes or
undoes each, so only whole `step_N` checkpoints remain.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash_cache.errors import write_error
from dflash_cache.files import fsync_path, read_json, write_json_atomic
from dflash_cache.train.optim import load_optimizer_state
from dflash_cache.typed_json import INT64_MAX, load_dataclass

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
STATE_VERSION = 2
TENSOR_FILES = ("drafter.safetensors", "optimizer.safetensors", "rng.safetensors")
_PREFIX, _TMP_PREFIX, _OLD_PREFIX, _STALE_PREFIX = "step_", ".tmp_step_", ".old_step_", ".stale_step_"


class UnreadableCheckpoint(Exception):
    """A checkpoint directory whose files are missing, truncated or malformed."""


@dataclass(frozen=True, slots=True)
class TrainerState:
    step: int
    epoch: int          # source position: epoch ...
    batch: int          # ... and global batches of it consumed (all ranks together)
    tokens_seen: int
    world: int          # processes that wrote it (a resume may use another number)
    run: dict[str, Any]  # what decides the plan and the model; a resume must match it (see Trainer)
    anchor_cap: int     # anchors per batch at most, as resolved from --max-anchors or the memory at hand
    scheduler: dict[str, Any]
    optimizer_hparams: list[dict[str, Any]]
    version: int = STATE_VERSION
    total_steps: int | None = None  # where the run's schedule ends (None: a checkpoint from before it was kept)
    options: dict[str, Any] | None = None  # the run's command-line options by flag (None: from before they were kept)

    @classmethod
    def from_json(cls, obj: Any, *, where: Path) -> TrainerState:
        """The state, or UnreadableCheckpoint naming what is wrong (types checked: it comes from disk)."""
        if not isinstance(obj, dict):
            raise UnreadableCheckpoint(f"{where} is not a JSON object")
        if obj.get("version") != STATE_VERSION:
            raise UnreadableCheckpoint(f"{where} has state version {obj.get('version')!r}; this dflash-cache "
                                       f"reads version {STATE_VERSION}")
        try:
            return load_dataclass(cls, obj, str(where), {"world": (1, INT64_MAX)})
        except ValueError as e:
            raise UnreadableCheckpoint(str(e)) from None


def _names_in_optimizer_order(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the order the optimizer's state dict numbers them (group by group)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for g in optimizer.param_groups for p in g["params"]]


def _optimizer_tensors(opt: torch.optim.Optimizer, names: list[str]) -> dict[str, torch.Tensor]:
    state = opt.state_dict()["state"]
    out = {}
    for idx, name in enumerate(names):
        for key, value in state.get(idx, {}).items():
            out[f"{name}::{key}"] = value.detach().cpu().contiguous() if torch.is_tensor(value) else torch.tensor(value)
    return out


def _full_precision_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The model's state dict with each parameter the optimizer holds a float32 master of (bf16
    linear weights: dflash_cache.train.precision) as that master: checkpoints keep float32 weights."""
    masters = getattr(optimizer, "master_weights", dict)()
    by_id = {id(p): master for p, master in masters.items()}
    named = dict(model.named_parameters())
    return {k: by_id.get(id(named[k]), v) if k in named else v for k, v in model.state_dict().items()}


def _load_masters(model: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor]) -> None:
    """Set the optimizer's masters from the checkpoint's float32 weights (load_state_dict rounded them
    into the bf16 parameters)."""
    if not hasattr(optimizer, "master_weights"):
        return
    # an optimizer that keeps masters (TritonAdamW), whose methods torch's Optimizer type lacks
    lowered = {id(p) for p in optimizer.master_weights()}  # pyright: ignore[reportAttributeAccessIssue]
    optimizer.load_masters(  # pyright: ignore[reportAttributeAccessIssue]
        {p: weights[n] for n, p in model.named_parameters() if id(p) in lowered})


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (those with a state file), newest first."""
    if not directory.is_dir():
        return []
    done = [p for p in directory.glob(f"{_PREFIX}*") if p.is_dir() and (p / STATE_FILE).is_file()]
    return sorted(done, key=lambda p: p.name, reverse=True)


def last_checkpoint(directory: Path) -> str:
    """Which checkpoint a run stopped with an error can go back to, as a message says it."""
    found = list_checkpoints(directory)
    return f"the last checkpoint is {found[0]}" if found else "no checkpoint was written yet"


def save_checkpoint(directory: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: TrainerState, rng: dict[str, torch.Tensor], keep: int = 2) -> Path:
    """`save_files` with the drafter's and the optimizer's tensors (`drafter_tensors`) and `rng`."""
    return save_files(directory, {**drafter_tensors(model, optimizer), "rng.safetensors": rng}, state=state, keep=keep)


def save_files(directory: Path, tensors: dict[str, dict[str, torch.Tensor]], *, state: TrainerState,
               keep: int = 2) -> Path:
    """Write the TENSOR_FILES (`tensors`, by file name) and the state file, fsync and rename the
    checkpoint into place, then keep only the newest `keep`. A write that fails (a full disk) removes
    what it wrote and is a UserError; the checkpoints before stay."""
    final = directory / f"{_PREFIX}{state.step:07d}"
    tmp = directory / f"{_TMP_PREFIX}{state.step:07d}"
    try:
        _write(tmp, tensors=tensors, state=state)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        found = list_checkpoints(directory)
        kept = f"--resume continues from {found[0].name}, which is kept" if found else "train again"
        raise write_error(e, f"writing checkpoint {final}", kept) from None
    if final.exists():  # the same step again (a resume that trained nothing): replace it whole
        old = directory / f"{_OLD_PREFIX}{state.step:07d}"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    fsync_path(directory)
    for stale in list_checkpoints(directory)[keep:]:
        _remove(stale, directory / f"{_STALE_PREFIX}{stale.name[len(_PREFIX):]}")
    return final


def _remove(path: Path, aside: Path) -> None:
    """Delete a checkpoint by renaming it aside first: a kill midway leaves `aside`, which
    `tidy_checkpoints` removes, never a `step_N` that is missing files."""
    path.rename(aside)
    shutil.rmtree(aside, ignore_errors=True)


def drafter_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """drafter.safetensors (float32 weights: the optimizer's masters of bf16 ones) and
    optimizer.safetensors (AdamW moments, flattened by parameter name), on the host."""
    names = _names_in_optimizer_order(model, optimizer)
    return {
        "drafter.safetensors": {k: v.detach().cpu().contiguous()
                                for k, v in _full_precision_state(model, optimizer).items()},
        "optimizer.safetensors": _optimizer_tensors(optimizer, names),
    }


def _write(tmp: Path, *, tensors: dict[str, dict[str, torch.Tensor]], state: TrainerState) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in TENSOR_FILES:
        content = {k: v.cpu().contiguous() for k, v in tensors[name].items()}
        try:
            save_file(content, tmp / name)
        except SafetensorError as e:  # its I/O errors (a full disk) are OSErrors by another name
            found = re.search(r"os error (\d+)", str(e))
            if found is None:
                raise
            raise OSError(int(found.group(1)), os.strerror(int(found.group(1)))) from e
        fsync_path(tmp / name)
    write_json_atomic(tmp / STATE_FILE, asdict(state))  # fsyncs the file and tmp/


def tidy_checkpoints(directory: Path) -> list[str]:
    """Finish or undo what a killed run left half done in `directory`; returns the names removed.

    A `.old_step_N` whose `step_N` is gone was being replaced by a checkpoint of the same step: it
    is whole (its state file is written last), so it becomes `step_N` again. Everything else that
    is not a whole `step_N` is removed: `.tmp_step_N` (never renamed into place), `.stale_step_N`
    (being deleted), a `.old_step_N` already replaced, and a `step_N` without its state file."""
    if not directory.is_dir():
        return []
    for old in sorted(directory.glob(f"{_OLD_PREFIX}*")):
        final = directory / f"{_PREFIX}{old.name[len(_OLD_PREFIX):]}"
        if old.is_dir() and (old / STATE_FILE).is_file() and not final.exists():
            old.rename(final)
            log.info("restored checkpoint %s, which a killed run was replacing", final.name)
    removed = []
    for p in sorted(directory.iterdir()):
        whole = p.name.startswith(_PREFIX) and p.is_dir() and (p / STATE_FILE).is_file()
        if not whole and p.name.startswith((_PREFIX, _TMP_PREFIX, _OLD_PREFIX, _STALE_PREFIX)):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p.name)
    if removed:
        fsync_path(directory)
    return removed


def read_state(path: Path) -> TrainerState:
    try:
        obj = read_json(path / STATE_FILE, max_bytes=64 << 20)
    except (OSError, ValueError, RecursionError) as e:
        raise UnreadableCheckpoint(f"{path / STATE_FILE} is unreadable ({type(e).__name__})") from None
    return TrainerState.from_json(obj, where=path / STATE_FILE)


def read_tensors(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """All three tensor files, read fully before anything is applied (a bad file changes nothing)."""
    out = {}
    for name in TENSOR_FILES:
        try:
            out[name] = load_file(path / name)
        except (OSError, SafetensorError, ValueError, RuntimeError) as e:
            raise UnreadableCheckpoint(f"{path / name} is unreadable ({type(e).__name__}: {e})") from None
    return out


def apply_tensors(tensors: dict[str, dict[str, torch.Tensor]], hparams: list[dict[str, Any]], *,
                  model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load model and optimizer state from `read_tensors`' result (or `drafter_tensors`') and the
    optimizer's hyper-parameters (`optimizer_hparams`)."""
    try:
        model.load_state_dict(tensors["drafter.safetensors"])
    except RuntimeError as e:
        raise UnreadableCheckpoint(f"drafter weights do not fit this drafter ({str(e).splitlines()[0]})") from None
    names = _names_in_optimizer_order(model, optimizer)
    flat = tensors["optimizer.safetensors"]
    device = next(model.parameters()).device
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for idx, name in enumerate(names):
        entries = {k.split("::", 1)[1]: v for k, v in flat.items() if k.split("::", 1)[0] == name}
        if entries:
            opt_state[idx] = {k: (v if k == "step" else v.to(device)) for k, v in entries.items()}
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else g for g in hparams]
    load_optimizer_state(optimizer, {"state": opt_state, "param_groups": groups})
    _load_masters(model, optimizer, tensors["drafter.safetensors"])


def optimizer_hparams(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The param groups' hyper-parameters as JSON-safe values (params as index lists)."""
    groups = optimizer.state_dict()["param_groups"]
    return json.loads(json.dumps(groups, default=lambda o: list(o) if isinstance(o, tuple) else str(o)))
