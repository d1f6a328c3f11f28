"""AdamW's update as one Triton kernel per parameter: a candidate for the trainer's optimizer step.

torch's fused AdamW takes the gradient clip as its `grad_scale` (`dflash_cache.train.optim.clipped_step`)
but then writes every unscaled gradient back, for mixed-precision loss scaling: 32 bytes of traffic
per float32 parameter where the update needs 28 (read the parameter, gradient and both moments,
write the parameter and both moments). On an H200 that kernel took 10.2 ms of a drafter step
(1.05B parameters, 33.6 GB: 3.3 TB/s). `TritonAdamW` reads the clip's divisor and writes nothing
else. It is not the trainer's default: `bench/train.py --optimizers triton` times it side by side.

The update is torch's AdamW (decoupled weight decay, bias correction, eps outside the square root),
in float32, with the step count kept on the host as torch's non-fused AdamW keeps it (no device
sync), and the state dict is torch's AdamW's, so checkpoints load either way.
"""

from __future__ import annotations

import functools

import torch

from dflash_cache.triton_support import check_triton_device, on_device_of, require_triton

_WHO = "AdamW kernel"
BLOCK = 4096  # elements per program
tl = None  # triton.language, bound on first kernel build (the import is lazy)


@functools.cache
def _build_kernel(interpret: bool):
    # `interpret` only keys the cache (see dflash_cache.triton_support); kernels resolve names through
    # this module's globals, hence `global tl`.
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, divisor_ptr, n, lr, beta1, beta2, eps, decay, step_size,
                      bias_correction2_sqrt, HAS_DIVISOR: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < n
        g = tl.load(g_ptr + offs, mask=keep, other=0.0).to(tl.float32)
        if HAS_DIVISOR:
            g = g / tl.load(divisor_ptr)
        p = tl.load(p_ptr + offs, mask=keep, other=0.0)
        m = tl.load(m_ptr + offs, mask=keep, other=0.0)
        v = tl.load(v_ptr + offs, mask=keep, other=0.0)
        p = p * (1.0 - lr * decay)
        m = m + (1.0 - beta1) * (g - m)  # torch's lerp
        v = v * beta2 + (1.0 - beta2) * g * g
        p = p - step_size * (m / (tl.sqrt(v) / bias_correction2_sqrt + eps))
        tl.store(p_ptr + offs, p, mask=keep)
        tl.store(m_ptr + offs, m, mask=keep)
        tl.store(v_ptr + offs, v, mask=keep)

    return _adamw_kernel


class TritonAdamW(torch.optim.AdamW):
    """torch's AdamW, stepped by `_adamw_kernel`: float32 parameters on a CUDA device (or on the CPU
    under TRITON_INTERPRET=1). A `grad_scale` attribute set before `step` divides every gradient as
    it is read (what `clipped_step` sets for the clip), as torch's fused AdamW divides by it."""

    _step_supports_amp_scaling = True  # step() honours grad_scale (clipped_step asks this)

    def __init__(self, params, **kwargs) -> None:
        if kwargs.get("amsgrad") or kwargs.get("maximize"):
            raise ValueError("TritonAdamW implements plain AdamW (no amsgrad, no maximize)")
        super().__init__(params, **{**kwargs, "foreach": False, "fused": False})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        interpret = require_triton(_WHO, "use torch.optim.AdamW")
        divisor = getattr(self, "grad_scale", None)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype != torch.float32 or p.grad.dtype != torch.float32 or not p.is_contiguous() \
                        or not p.grad.is_contiguous():
                    raise ValueError(f"{_WHO}: needs contiguous float32 parameters and gradients, got "
                                     f"{p.dtype} / {p.grad.dtype}")
                check_triton_device(p, _WHO)
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                if state["step"].device.type != "cpu":  # a fused AdamW's state: once, on the first step
                    state["step"] = state["step"].cpu()
                state["step"] += 1
                t = float(state["step"])
                with on_device_of(p):
                    _build_kernel(interpret)[(triton_cdiv(p.numel(), BLOCK),)](
                        p, p.grad, state["exp_avg"], state["exp_avg_sq"], divisor if divisor is not None else p,
                        p.numel(), group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                        group["lr"] / (1 - beta1 ** t), (1 - beta2 ** t) ** 0.5,
                        HAS_DIVISOR=divisor is not None, BLOCK=BLOCK)
        return loss


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
