"""AdamW's update as one Triton kernel per parameter, with float32 masters for bf16 weights.

The trainer's optimizer on a GPU (`dflash_cache.train.precision`). It does two things torch's
fused AdamW does not:
* it holds bf16 weights' float32 masters (`lower_precision`): it updates the master and writes the
  rounded bf16 weight in the same pass, so the forward reads bf16 weights with no cast, and the
  backward's bf16 weight gradients need no cast back (autocast does both every step, for every
  linear weight);
* it reads the clip's divisor (`grad_scale`, as `clipped_step` sets it) and writes nothing else,
  where torch's fused kernel writes every unscaled gradient back (mixed-precision loss scaling).

Bytes a parameter: a bf16 weight with its master 28 (read gradient 2, master and both moments 12;
write them 12 and the bf16 weight 2), a float32 one 28 (no master), against 32 for torch's fused
kernel on float32 weights and gradients.

The update is torch's AdamW (decoupled weight decay, bias correction, eps outside the square root),
in float32, with the step count kept on the host as torch's non-fused AdamW keeps it (no device
sync). The state dict is torch's AdamW's, so checkpoints load either way; the masters are not in it
(they are the model's float32 weights: `master_weights`, `load_masters`, see
dflash_cache.train.checkpoint).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from dflash_cache.triton_support import check_triton_device, on_device_of, require_triton

_WHO = "AdamW kernel"
# Elements and warps per program. On an H200 (bench/optimizer.py, 2026-12-02) the bench drafter's
# step took 7.19 ms with 1,024 elements, 7.32 with 2,048, 7.48 with 4,096 (4.08 to 3.92 TB/s over
# its 28 bytes a parameter): the smaller programs leave less of a tail at each parameter's end.
BLOCK = 1024
# Under the interpreter programs run one after another, each as numpy over its block: fewer, larger
# programs are faster (the fixtures of its CPU tests and the precision tests: 16 s against 25-30), and the
# arithmetic, element by element, is the same at any block size. The tests' larger tensors still span
# several programs and a partial last one.
INTERPRETER_BLOCK = 16384
NUM_WARPS = 4
if TYPE_CHECKING:  # as the kernels see it once built (typed as None, each tl.* in them would be an error)
    import triton.language as tl
else:
    tl = None  # triton.language, bound on first kernel build (the import is lazy)
    _round_to_bf16 = None  # the kernel's helper, bound there too


@functools.cache
def _build_kernel(interpret: bool):
    # `interpret` only keys the cache (see dflash_cache.triton_support); kernels resolve names through
    # this module's globals, hence `global`.
    global tl, _round_to_bf16
    import triton
    import triton.language as tl

    @triton.jit
    def _round_to_bf16(x):
        # fp32 -> bf16 to nearest even, spelled out: the interpreter's casts truncate (a GPU's round)
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return tl.where(x != x, 0x7FC0, bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, master_ptr, divisor_ptr, skip_ptr, n, lr, beta1, beta2, eps,
                      decay, step_size, bias_correction2_sqrt, HAS_DIVISOR: tl.constexpr, HAS_SKIP: tl.constexpr,
                      HAS_MASTER: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if HAS_SKIP:  # a step on gradients that are not finite reads and writes nothing
            n = tl.where(tl.load(skip_ptr) == 0, n, 0)
        keep = offs < n
        g = tl.load(g_ptr + offs, mask=keep, other=0.0).to(tl.float32)
        if HAS_DIVISOR:
            g = g / tl.load(divisor_ptr)
        if HAS_MASTER:
            p = tl.load(master_ptr + offs, mask=keep, other=0.0)
        else:
            p = tl.load(p_ptr + offs, mask=keep, other=0.0)
        m = tl.load(m_ptr + offs, mask=keep, other=0.0)
        v = tl.load(v_ptr + offs, mask=keep, other=0.0)
        p = p * (1.0 - lr * decay)
        m = m + (1.0 - beta1) * (g - m)  # torch's lerp
        v = v * beta2 + (1.0 - beta2) * g * g
        p = p - step_size * (m / (tl.sqrt(v) / bias_correction2_sqrt + eps))
        if HAS_MASTER:
            tl.store(master_ptr + offs, p, mask=keep)
            tl.store(p_ptr + offs, _round_to_bf16(p), mask=keep)
        else:
            tl.store(p_ptr + offs, p, mask=keep)
        tl.store(m_ptr + offs, m, mask=keep)
        tl.store(v_ptr + offs, v, mask=keep)

    return _adamw_kernel


class TritonAdamW(torch.optim.AdamW):
    """torch's AdamW, stepped by `_adamw_kernel`, on a CUDA device (or on the CPU under
    TRITON_INTERPRET=1). Weights are float32, or bf16 with a float32 master here once
    `lower_precision` made them so; gradients have the weight's dtype. A `grad_scale` attribute set
    before `step` divides every gradient as it is read (what `clipped_step` sets for the clip), as
    torch's fused AdamW divides by it, and a nonzero `found_inf` (a device tensor) makes the step
    write nothing, as there. Unlike torch's, the step count (kept on the host) still advances then.
    The kernel runs BLOCK elements a program on a GPU (INTERPRETER_BLOCK under the interpreter) with
    NUM_WARPS warps (`_launch`)."""

    _step_supports_amp_scaling = True  # step() honours grad_scale (clipped_step asks this)

    def __init__(self, params, **kwargs) -> None:
        if kwargs.get("amsgrad") or kwargs.get("maximize"):
            raise ValueError("TritonAdamW implements plain AdamW (no amsgrad, no maximize)")
        super().__init__(params, **{**kwargs, "foreach": False, "fused": False})
        self._masters: dict[torch.Tensor, torch.Tensor] = {}  # bf16 parameter -> its float32 value

    @torch.no_grad()
    def lower_precision(self, params) -> None:
        """Hold these float32 parameters of this optimizer in bf16 from now on, their float32 values
        kept here as masters that every step updates. Call it before the first backward (no gradient
        may exist yet) and before DDP wraps the model (it buckets gradients by dtype)."""
        mine = {p for g in self.param_groups for p in g["params"]}
        for p in params:
            if p not in mine or p.dtype != torch.float32 or p.grad is not None:
                raise ValueError(f"{_WHO}: lower_precision takes float32 parameters of this optimizer that have "
                                 f"no gradient yet, got a {p.dtype} one")
            self._masters[p] = p.detach().clone()
            p.data = p.data.to(torch.bfloat16)

    def master_weights(self) -> dict[torch.Tensor, torch.Tensor]:
        """The float32 value of every parameter held in lower precision (the tensors themselves)."""
        return dict(self._masters)

    @torch.no_grad()
    def load_masters(self, values: dict[torch.Tensor, torch.Tensor]) -> None:
        """Set the masters of these lowered parameters (a checkpoint's float32 weights), and the
        parameters to their rounding."""
        for p, value in values.items():
            if p not in self._masters:
                raise ValueError(f"{_WHO}: load_masters got a parameter that has no master")
            self._masters[p].copy_(value)
            p.copy_(self._masters[p])

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        # torch casts floating-point state to its parameter's dtype: a lowered parameter's moments
        # stay float32, taken again from the (unrounded) values given
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, values in state_dict["state"].items():
            p = params[idx]
            if p in self._masters:
                for key, value in values.items():
                    if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                        self.state[p][key] = value.to(device=p.device, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        interpret = require_triton(_WHO, "use torch.optim.AdamW")
        divisor = getattr(self, "grad_scale", None)
        skip = getattr(self, "found_inf", None)
        block, num_warps = self._launch(interpret)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                master = self._masters.get(p)
                if (master is None and p.dtype != torch.float32) or p.grad.dtype != p.dtype \
                        or not p.is_contiguous() or not p.grad.is_contiguous():
                    raise ValueError(f"{_WHO}: needs contiguous float32 parameters (or lowered ones with a master) "
                                     f"and gradients of their dtype, got {p.dtype} / {p.grad.dtype}")
                check_triton_device(p, _WHO)
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                if state["step"].device.type != "cpu":  # a fused AdamW's state: once, on the first step
                    state["step"] = state["step"].cpu()
                state["step"] += 1
                t = float(state["step"])
                with on_device_of(p):
                    _build_kernel(interpret)[(triton_cdiv(p.numel(), block),)](
                        p, p.grad, state["exp_avg"], state["exp_avg_sq"], p if master is None else master,
                        divisor if divisor is not None else p, skip if skip is not None else p,
                        p.numel(), group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                        group["lr"] / (1 - beta1 ** t), (1 - beta2 ** t) ** 0.5,
                        HAS_DIVISOR=divisor is not None, HAS_SKIP=skip is not None, HAS_MASTER=master is not None,
                        BLOCK=block,
                        # a launch option, which triton's typing of kernel[grid] (the kernel's own signature) lacks
                        num_warps=num_warps)  # pyright: ignore[reportCallIssue]
        return loss

    def _launch(self, interpret: bool) -> tuple[int, int]:
        """The kernel's launch settings: elements and warps per program."""
        return (INTERPRETER_BLOCK if interpret else BLOCK), NUM_WARPS


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
