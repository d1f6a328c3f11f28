"""One check of TritonAdamW's float32 masters, run on the CPU under the Triton interpreter
(tests/train/test_adamw_kernel.py) and on a GPU (tests/train/test_cuda.py)."""

from __future__ import annotations

import torch

from dflash_cache.train.adamw_kernel import TritonAdamW
from dflash_cache.train.optim import clipped_step

SHAPES = ((512, 256), (3000,), (77, 5))


def masters_against_fused_adamw(device: str) -> dict:
    """bf16 weights with float32 masters against torch's fused AdamW over float32 weights, fed the
    same bf16 gradients and the same clip (under and over it) for three steps: the masters' largest
    difference relative to the float32 weights, whether each bf16 weight is its master rounded to
    nearest even, and whether the moments stayed float32."""
    g = torch.Generator(device=device).manual_seed(3)
    ref = [torch.nn.Parameter(torch.randn(s, device=device, generator=g) * 0.02) for s in SHAPES]
    low = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    fused = torch.optim.AdamW([{"params": ref, "weight_decay": 0.1}], fused=True, **kw)
    tri = TritonAdamW([{"params": low, "weight_decay": 0.1}], **kw)
    tri.lower_precision([p for p in low if p.ndim == 2])
    for scale in (1.0, 1e3, 1e-2):
        for r, w in zip(ref, low, strict=True):
            grad = (torch.randn(r.shape, device=device, generator=g) * scale).to(w.dtype)
            w.grad, r.grad = grad, grad.to(torch.float32, copy=True)  # fused AdamW writes its gradients back
        clipped_step(fused, ref, 1.0)
        clipped_step(tri, low, 1.0)
    masters = tri.master_weights()
    return {
        "masters rel": max(float((masters.get(w, w) - r).abs().max() / r.abs().max())
                           for r, w in zip(ref, low, strict=True)),
        "masters rounded": all(w.dtype == torch.bfloat16 and bool(torch.equal(w, masters[w].to(torch.bfloat16)))
                               for w in low if w.ndim == 2),
        "moments float32": all(tri.state[w][k].dtype == torch.float32 for w in low for k in ("exp_avg", "exp_avg_sq")),
    }
