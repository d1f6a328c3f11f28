"""A drafter layer's paired projections as two matrix products or one over concatenated weights.

The MLP's gate and up projections read the same normed rows, and so do the key and value
projections (over the context rows and the block rows). Concatenating each pair's weights makes
one product of twice the width in the forward, one input-gradient product in the backward (where
two products and an add run now), and one weight-gradient product. This times both forms of each
pair, forward and backward products only (no autograd), at the bench configuration's shapes
(32,768 block rows, 12,288 context rows, hidden 4096, intermediate 12,288, 8 KV heads of 128), in
one process: what fusing the pairs in the drafter could save per layer. `--small` checks the script
on a CPU with small shapes.

On an NVIDIA H200 (2026-12-02, `bench/results/2026-12-02-h200-projections.*`): gate + up 28.88 ms as
two products, 30.06 as one; key + value 3.55 as two, 3.27 as one. In the training step one key/value
product made no measurable difference (README, "2026-12-02, later"), so the drafter keeps two.
"""

# The timed products are statements whose results are dropped on purpose (only their time counts).
# pyright: reportUnusedExpression=false

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.common import start_logging_and_device, timed
from bench.gpu_clocks import ClockSampler, describe


def pair_steps(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor) -> dict:
    """name -> a call running one form's forward and backward products for the pair (w1, w2)."""
    w = torch.cat((w1, w2))
    g = torch.cat((g1, g2), dim=1)

    def separate():
        x @ w1.T, x @ w2.T  # forward
        g1 @ w1 + g2 @ w2  # input gradient
        g1.T @ x, g2.T @ x  # weight gradients

    def fused():
        x @ w.T
        g @ w
        g.T @ x

    return {"two products": separate, "one product": fused}


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="small shapes on the CPU (checks the script)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = start_logging_and_device()
    if args.small:
        device, dtype, rows, ctx, hidden, inter, kv = torch.device("cpu"), torch.float32, 256, 96, 64, 192, 16
    else:
        dtype, rows, ctx, hidden, inter, kv = torch.bfloat16, 32768, 12288, 4096, 12288, 1024
    pairs = {"gate + up": (rows, inter), "key + value": (rows + ctx, kv)}
    results = []
    print(f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}\n"
          "| pair | rows x hidden -> 2 x width | form | ms (fwd + bwd products) | clocks |\n|---|---|---|---:|---|")
    for pair, (m, n) in pairs.items():
        x = torch.randn(m, hidden, device=device, dtype=dtype)
        w1, w2 = (torch.randn(n, hidden, device=device, dtype=dtype) * 0.02 for _ in range(2))
        g1, g2 = (torch.randn(m, n, device=device, dtype=dtype) * 1e-3 for _ in range(2))
        for form, fn in pair_steps(x, w1, w2, g1, g2).items():
            clocks = ClockSampler(device)
            ms = timed(fn, device, args.reps, during=clocks) * 1e3
            results.append({"pair": pair, "rows": m, "width": n, "form": form, "ms": ms, "clocks": clocks.summary()})
            print(f"| {pair} | {m} x {hidden} -> 2 x {n} | {form} | {ms:.2f} | {describe(clocks.summary())} |",
                  flush=True)
        del x, w1, w2, g1, g2
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "results": results}, indent=1))


if __name__ == "__main__":
    main()
