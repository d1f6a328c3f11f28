"""The optimizer stage alone: the clip's gradient norm and TritonAdamW's step on the bench drafter.

The bench configuration's drafter (5 layers, hidden 4096, intermediate 12288, 32/8 heads of 128;
1.05B trained parameters), its linear weights bf16 with float32 masters as the trainer holds them
on a GPU, random bf16 gradients. Times, in one process: the gradient norm as the trainer takes it
(`total_grad_norm`, one float32 norm per tensor) and by torch's multi-tensor norm; and the AdamW
step at several launch settings (elements and warps per program), each with the bandwidth over
the bytes it must move (28 a parameter). `--small` runs a shrunken drafter on a CPU under
TRITON_INTERPRET=1 to check the script.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import bench_drafter_config, start_logging_and_device, timed
from bench.variants import LaunchedAdamW
from dflash_cache.train.adamw_kernel import BLOCK, NUM_WARPS
from dflash_cache.train.drafter import init_drafter
from dflash_cache.train.optim import BETAS, EPS, param_groups, total_grad_norm
from dflash_cache.train.precision import linear_weights

LAUNCHES = [(BLOCK, NUM_WARPS), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]


def multi_tensor_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The same total norm by torch's multi-tensor kernel (private API: what the trainer took before)."""
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)  # pyright: ignore[reportPrivateImportUsage] (on purpose)
    return torch.linalg.vector_norm(torch.stack(norms))


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="a shrunken drafter on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    device = start_logging_and_device()
    shape = dict(hidden=64, inter=192, heads=4, kv=2, head_dim=16) if args.small else \
        dict(hidden=4096, inter=12288, heads=32, kv=8, head_dim=128)
    cfg = bench_drafter_config(**shape, vocab=151936, layers=5, block=16, layer_ids=(1, 9, 17, 25, 33))
    model = init_drafter(cfg, seed=0).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    print(f"{device}: {len(params)} parameters, {n / 1e9:.3f}B elements", flush=True)
    opt = LaunchedAdamW(param_groups(model, 0.01), lr=1e-4, betas=BETAS, eps=EPS)
    opt.lower_precision(linear_weights(model))
    g = torch.Generator(device=device).manual_seed(0)
    grads = []
    for p in params:
        p.grad = grad = (torch.randn(p.shape, generator=g, device=device) * 1e-3).to(p.dtype)
        grads.append(grad)
    reps = 2 if args.small else args.reps
    for name, fn in (("total_grad_norm (one norm per tensor, trainer)", total_grad_norm),
                     ("multi-tensor norm", multi_tensor_norm)):
        t = timed(lambda f=fn: f(grads), device, reps)
        gb = sum(x.numel() * x.element_size() for x in grads) / 1e9
        print(f"| {name} | {1e3 * t:.3f} ms | {gb / t / 1e3:.2f} TB/s |", flush=True)
    print(f"norms agree: {float(total_grad_norm(grads)):.6f} {float(multi_tensor_norm(grads)):.6f}")
    print("| block | warps | AdamW step ms | TB/s (28 bytes a parameter) |\n|---:|---:|---:|---:|")
    for block, warps in LAUNCHES if not args.small else LAUNCHES[:2]:
        opt.block, opt.num_warps = block, warps  # the same parameters, masters and moments for each
        t = timed(opt.step, device, reps)
        print(f"| {block} | {warps} | {1e3 * t:.3f} | {28 * n / t / 1e12:.2f} |", flush=True)

if __name__ == "__main__":
    main()
