"""The optimiser and learning-rate schedule every trainer in the project uses (the drafter's, and
the tiny target's pretraining in tools/): AdamW with weight decay on matrices only, and a linear
warm-up followed by a cosine decay."""

from __future__ import annotations

import math

import torch


def adamw(model: torch.nn.Module, *, lr: float, weight_decay: float, fused: bool) -> torch.optim.AdamW:
    """AdamW (betas 0.9/0.95) decaying the weight matrices only: norm gains and biases stay free."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def warmup_cosine(step: int, total: int, warmup: int, floor: float = 0.0) -> float:
    """The learning-rate factor at `step`: linear from 1/warmup to 1 over `warmup` steps, then a
    cosine from 1 down to `floor` at step `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
