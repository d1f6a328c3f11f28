"""Checkpoints: safetensors for tensors, JSON for everything else, no pickle.

    out/checkpoints/step_000500/
        drafter.safetensors     fp32 master weights
        optimizer.safetensors   AdamW moments, flattened by parameter name
        rng.safetensors         torch CPU (and CUDA) RNG states and the anchor generator's state
        state.json              step, source position, scheduler, optimizer hyper-parameters; written
                                last, atomically: a checkpoint without it does not count
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflash_cache.jsonio import read_json, write_json_atomic

STATE_FILE = "state.json"


@dataclass(frozen=True, slots=True)
class TrainerState:
    step: int
    epoch: int          # source position: epoch ...
    batch: int          # ... and batches of it consumed
    tokens_seen: int
    scheduler: dict[str, Any]
    optimizer_hparams: list[dict[str, Any]]


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


def save_checkpoint(directory: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: TrainerState, rng: dict[str, torch.Tensor]) -> Path:
    names = _names_in_optimizer_order(model, optimizer)
    final = directory / f"step_{state.step:07d}"
    tmp = directory / f".tmp_step_{state.step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, tmp / "drafter.safetensors")
    save_file(_optimizer_tensors(optimizer, names), tmp / "optimizer.safetensors")
    save_file({k: v.cpu().contiguous() for k, v in rng.items()}, tmp / "rng.safetensors")
    write_json_atomic(tmp / STATE_FILE, asdict(state))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def latest_checkpoint(directory: Path) -> Path | None:
    done = sorted(p for p in directory.glob("step_*") if (p / STATE_FILE).is_file()) if directory.is_dir() else []
    return done[-1] if done else None


def load_checkpoint(path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer
                    ) -> tuple[TrainerState, dict[str, torch.Tensor]]:
    state = TrainerState(**read_json(path / STATE_FILE))
    model.load_state_dict(load_file(path / "drafter.safetensors"))
    names = _names_in_optimizer_order(model, optimizer)
    flat = load_file(path / "optimizer.safetensors")
    device = next(model.parameters()).device
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for idx, name in enumerate(names):
        entries = {k.split("::", 1)[1]: v for k, v in flat.items() if k.split("::", 1)[0] == name}
        if entries:
            opt_state[idx] = {k: (v if k == "step" else v.to(device)) for k, v in entries.items()}
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else g for g in state.optimizer_hparams]
    optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
    return state, load_file(path / "rng.safetensors")


def optimizer_hparams(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The param groups' hyper-parameters as JSON-safe values (params as index lists)."""
    groups = optimizer.state_dict()["param_groups"]
    return json.loads(json.dumps(groups, default=lambda o: list(o) if isinstance(o, tuple) else str(o)))
