"""How a training step rounds: bf16 matrix products and, on a GPU, bf16 linear weights with float32
masters.

Under autocast alone every linear weight is float32: each step casts it to bf16 for the forward
(the copy is kept for the backward) and casts its bf16 gradient back to float32, and the optimizer
then reads and writes float32 gradients: ~5 ms of an NVIDIA H200's step for the bench drafter's
1.05B parameters. With `master_weights` the linear weights *are* bf16 and `TritonAdamW` keeps their
float32 values as masters, updating each and writing its rounding in one pass. The step computes the
same function: the forward reads the bf16 weight autocast's cast would give, the backward's weight
gradient is the bf16 product's (autocast only widened it), and AdamW updates the same float32
values from the same gradients. Norm gains stay float32 parameters, as the residual stream stays
float32.

The one difference is with several processes: DDP averages the bf16 gradients in float32
(`fp32_allreduce_hook`) and the mean is rounded to bf16 once, where float32 gradients kept it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dflash_cache.triton_support import triton_available

LOW = torch.bfloat16


@dataclass(frozen=True, slots=True)
class Precision:
    """`autocast`: matrix products in bf16 (torch.autocast on the step's device). `master_weights`:
    linear weights held in bf16, their float32 masters in the optimizer (needs autocast, whose
    casts of the float32 activations feed the bf16 weights)."""

    autocast: bool
    master_weights: bool

    def __post_init__(self) -> None:
        if self.master_weights and not self.autocast:
            raise ValueError("master_weights needs autocast: the float32 activations meet bf16 weights")

    @classmethod
    def for_device(cls, device: torch.device) -> Precision:
        """bf16 with masters on a GPU (TritonAdamW needs triton, which CUDA builds of torch bring);
        float32 throughout on a CPU."""
        cuda = device.type == "cuda"
        return cls(autocast=cuda, master_weights=cuda and triton_available())

    def autocast_on(self, device: torch.device) -> torch.autocast:
        return torch.autocast(device.type, dtype=LOW, enabled=self.autocast)


def linear_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights (parameters) that master_weights holds in bf16: every nn.Linear's (the drafter has
    no biases)."""
    return [m.weight for m in model.modules() if isinstance(m, nn.Linear)]


def fp32_allreduce_hook(process_group: dist.ProcessGroup | None, bucket):
    """DDP's gradient averaging in float32 for a bucket (dist.GradBucket) of bf16 gradients: summed
    in bf16, the ranks' gradients would be rounded once per addition. Returns a Future of the bucket.
    (No annotations on `bucket` and the result: DDP compares them with its own types, and this
    module's are strings.)"""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    world = dist.get_world_size(group)
    reduced = buffer.to(torch.float32)
    work = dist.all_reduce(reduced, group=group, async_op=True)
    if work is None:  # not reached: with async_op=True it returns its Work (torch types it optional)
        raise RuntimeError("all_reduce(async_op=True) returned no Work")
    if buffer.is_cuda:  # NCCL runs the callback on this thread, ordered on the stream: the copy overlaps
        return work.get_future().then(lambda fut: buffer.copy_(fut.value()[0].div_(world)))
    # gloo would run a Python callback on its worker thread, and release it there after the step has
    # moved on. DDP keeps that thread alive until exit, so the release can meet the interpreter's
    # shutdown and abort the process. On a CPU there is no stream to overlap with: finish here.
    # (gloo's thread may still hold the work, and with it Python objects, just after this returns: a
    # group torn down at that moment, which holds the GIL while it joins that thread, can hang under
    # torch 2.13; tests/train/test_precision.py pauses before its teardown.)
    work.wait()
    buffer.copy_(reduced.div_(world))
    done = torch.futures.Future()
    done.set_result(buffer)
    return done
