"""The optimiser and learning-rate schedule every trainer in the project uses (the drafter's, and
the tiny target's pretraining in tools/): AdamW with weight decay on matrices only, and a linear
warm-up followed by a cosine decay."""

from __future__ import annotations

import math

import torch

from dflash_cache.train.precision import Precision, linear_weights

BETAS, EPS = (0.9, 0.95), 1e-8


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on the weight matrices only: norm gains and biases stay free."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def adamw(model: torch.nn.Module, *, lr: float, weight_decay: float, fused: bool) -> torch.optim.AdamW:
    """torch's AdamW (betas 0.9/0.95) over `param_groups`."""
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=BETAS, eps=EPS, fused=fused)


def drafter_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, device: torch.device,
                      precision: Precision) -> torch.optim.AdamW:
    """The drafter's AdamW. With `precision.master_weights`, TritonAdamW with the linear weights
    lowered to bf16 (the model's parameters change dtype here, before anything wraps them);
    otherwise torch's AdamW, fused on a GPU. The same hyper-parameters and update either way."""
    if not precision.master_weights:
        return adamw(model, lr=lr, weight_decay=weight_decay, fused=device.type == "cuda")
    from dflash_cache.train.adamw_kernel import TritonAdamW

    optimizer = TritonAdamW(param_groups(model, weight_decay), lr=lr, betas=BETAS, eps=EPS)
    optimizer.lower_precision(linear_weights(model))
    return optimizer


IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def load_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """`optimizer.load_state_dict`, keeping this optimizer's own implementation flags. A state dict's
    param groups carry the flags of the optimizer that wrote it (a CPU run's AdamW is not fused,
    TritonAdamW's groups say neither fused nor foreach), and torch would adopt them: a fused AdamW
    would then step unfused, refusing the clip's grad_scale."""
    flags = [{k: g[k] for k in IMPLEMENTATION_FLAGS if k in g} for g in optimizer.param_groups]
    groups = [dict(g, **own) for g, own in zip(state_dict["param_groups"], flags, strict=True)]
    optimizer.load_state_dict({**state_dict, "param_groups": groups})


def total_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """clip_grad_norm_'s total 2-norm, with each tensor's norm in float32: torch's `get_total_norm`
    returns a bf16 gradient's norm in bf16, three significant digits. One public reduction per
    tensor, in order; on an H200 as fast as torch's multi-tensor norm (0.93 ms for the bench
    drafter's 1.05B bf16 gradients, bench/optimizer.py)."""
    device = grads[0].device
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).to(device)
                                                 for g in grads]))


def clipped_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """One optimiser step on the gradients clipped to a total norm of `max_norm`, as
    `clip_grad_norm_` clips them, unless the gradients are not finite: then nothing changes (weights,
    masters, moments) and the returned bool tensor is True. A fused AdamW takes the clip as its
    `grad_scale` (the divisor mixed-precision loss scaling hands it) and applies it as it reads each
    gradient, where `clip_grad_norm_` first rewrites every gradient in a pass of its own (2.3 ms of a
    drafter step's 1.05B float32 gradients on an H200; the fused kernel's write-back of the unscaled
    gradients takes back about 1.4 of it), and the skip as its `found_inf`, on the device, as loss
    scaling does: no host sync. The results agree to float32 rounding (g / (1 / c) against g * c)."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):  # not torch's fused AdamW nor TritonAdamW
        skipped = ~torch.isfinite(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if not bool(skipped):  # a host sync, on the CPU only
            optimizer.step()
        return skipped
    # clip_grad_norm_'s coefficient, max_norm / (norm + 1e-6) capped at 1, as a divisor
    norm = total_grad_norm([p.grad for p in params if p.grad is not None])
    skipped = ~torch.isfinite(norm)
    # torch's loss-scaling protocol: attributes that fused optimizers read, which its Optimizer type lacks
    optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0)  # pyright: ignore[reportAttributeAccessIssue]
    optimizer.found_inf = skipped.to(torch.float32)  # pyright: ignore[reportAttributeAccessIssue]
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf  # pyright: ignore[reportAttributeAccessIssue]
    return skipped


def warmup_cosine(step: int, total: int, warmup: int, floor: float = 0.0) -> float:
    """The learning-rate factor at `step`: linear from 1/warmup to 1 over `warmup` steps, then a
    cosine from 1 down to `floor` at step `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
