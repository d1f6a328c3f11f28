"""The shared optimiser and schedule (dflash_cache.train.optim)."""

from __future__ import annotations

import pytest
import torch

from dflash_cache.train.optim import adamw, warmup_cosine


def test_warmup_then_cosine_to_the_floor():
    assert [warmup_cosine(s, 100, 4) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert warmup_cosine(4, 100, 4) == pytest.approx(1.0)
    assert warmup_cosine(52, 100, 4) == pytest.approx(0.5)
    assert warmup_cosine(100, 100, 4) == pytest.approx(0.0)
    assert warmup_cosine(100, 100, 4, floor=0.1) == pytest.approx(0.1)
    assert warmup_cosine(52, 100, 4, floor=0.1) == pytest.approx(0.55)
    assert warmup_cosine(500, 100, 4) == pytest.approx(0.0), "past the end it stays at the floor"


def test_only_matrices_are_decayed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = adamw(model, lr=1e-3, weight_decay=0.1, fused=False)
    decayed, free = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and [p.shape for p in decayed["params"]] == [(4, 4)]
    assert free["weight_decay"] == 0.0 and len(free["params"]) == 3  # linear bias, norm weight and bias
