"""The loss's two vocabulary-wide matrix products alone, in the forms they could take.

In a traced training step (bench/train.py --trace) these ran at ~620 TFLOP/s on an H200 where the
drafter's own products ran at 690-800. This times each product by itself (CUDA events through
triton.testing.do_bench, median), for several chunk heights and for the operand orders that give
the same result: which form, if any, the loss should use.

  logits = hidden @ head.T        [c, H] x [H, V]
  grad   = grad_logits @ head     [c, V] x [V, H]   (or (head.T @ grad_logits.T).T)

`--kernel-configs` also times the Triton loss kernels between them (dflash_cache.train.loss_kernel)
on one chunk's bf16 logits, per launch setting: `COLUMNSxWARPS` the two-pass kernel (columns per
iteration; it reads the logits twice and writes them once), `segCOLUMNSxWARPS` the one-read
experiment (bench/one_read_loss.py; columns per program, one read and one write). GB/s is each
kernel's own traffic over its time.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

from dflash_cache.train.flops import device_peak_flops


def forms(hidden: torch.Tensor, grad_logits: torch.Tensor, head: torch.Tensor) -> dict:
    """(product, form) -> a call computing it."""
    return {
        ("logits", "hidden @ head.T"): lambda: hidden @ head.T,
        ("logits", "(head @ hidden.T).T"): lambda: (head @ hidden.T).T,
        ("grad", "grad_logits @ head"): lambda: grad_logits @ head,
        ("grad", "(head.T @ grad_logits.T).T"): lambda: (head.T @ grad_logits.T).T,
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", default="2048,3840,4096,7680,15360", help="chunk heights to time")
    ap.add_argument("--kernel-configs", default="",
                    help="also time the Triton loss kernels at these settings (e.g. 4096x8,seg16384x16)")
    ap.add_argument("--kernel-rows", type=int, default=3840, help="rows of the loss kernel's logits (one chunk)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/lm_head.py needs a CUDA device")
    from triton.testing import do_bench

    dev = torch.device("cuda")
    h, v = args.hidden, args.vocab
    head = torch.randn(v, h, device=dev, dtype=torch.bfloat16) * 0.02
    peak = device_peak_flops(dev)
    results = []
    print("| rows | product | form | ms | TFLOP/s |\n|---:|---|---|---:|---:|")
    for c in (int(r) for r in args.rows.split(",")):
        hidden = torch.randn(c, h, device=dev, dtype=torch.bfloat16)
        grad_logits = torch.randn(c, v, device=dev, dtype=torch.bfloat16) * 1e-3
        flop = 2 * c * h * v
        for (product, form), fn in forms(hidden, grad_logits, head).items():
            ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
            tflops = flop / ms / 1e9
            results.append({"rows": c, "product": product, "form": form, "ms": ms, "tflops": tflops})
            print(f"| {c} | {product} | `{form}` | {ms:.2f} | {tflops:.0f} |", flush=True)
    kernels = time_loss_kernel(args.kernel_configs, rows=args.kernel_rows, vocab=v, dev=dev, do_bench=do_bench) \
        if args.kernel_configs else []
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "peak_flops": peak,
                                               "hidden": h, "vocab": v, "results": results,
                                               "loss_kernel": kernels}, indent=1))


def time_loss_kernel(configs: str, *, rows: int, vocab: int, dev: torch.device, do_bench) -> list[dict]:
    """The Triton loss kernels on [rows, vocab] bf16 logits per setting (`BLOCKxWARPS`, two-pass;
    `segBLOCKxWARPS`, one read): median ms and GB/s over the kernel's traffic; each setting's loss,
    argmax and gradient are checked against the first's."""
    from bench.one_read_loss import logits_loss_and_grad_one_read
    from dflash_cache.train.loss_kernel import logits_loss_and_grad_triton

    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(rows, vocab, device=dev, dtype=torch.bfloat16, generator=g) * 3
    labels = torch.randint(0, vocab, (rows,), device=dev, generator=g)
    weights = torch.rand(rows, device=dev, generator=g)
    total = weights.sum()
    out, reference = [], None
    print("| kernel | columns x warps | ms | GB/s | same result |\n|---|---|---:|---:|---|")
    for config in configs.split(","):
        one_read = config.startswith("seg")
        block, warps = (int(x) for x in config.removeprefix("seg").split("x"))
        if one_read:
            run = functools.partial(logits_loss_and_grad_one_read, labels=labels, weights=weights,
                                    total_weight=total, segment=block, num_warps=warps)
        else:
            run = functools.partial(logits_loss_and_grad_triton, labels=labels, weights=weights,
                                    total_weight=total, block=block, num_warps=warps)
        traffic = (2 if one_read else 3) * logits.numel() * logits.element_size()
        loss, correct, grad = run(logits.clone())
        if grad is None:  # not reached: with a total weight the kernels return the gradient
            raise RuntimeError(f"{config}: no gradient")
        if reference is None:
            reference = (loss, correct, grad)
        same = bool(torch.allclose(loss, reference[0], rtol=1e-5) and torch.equal(correct, reference[1])
                    and torch.allclose(grad.float(), reference[2].float(), atol=1e-6, rtol=2**-7))
        identical = bool(torch.equal(loss, reference[0]) and torch.equal(grad, reference[2]))
        buf = logits.clone()  # the kernel writes its gradient over the buffer: later calls see gradients
        ms = do_bench(functools.partial(run, buf), warmup=50, rep=300, return_mode="median")
        kind = "one read" if one_read else "two-pass"
        out.append({"kernel": kind, "block": block, "num_warps": warps, "ms": ms, "gb_s": traffic / ms / 1e6,
                    "same": same, "identical": identical})
        exact = "bit for bit" if identical else "to rounding"
        print(f"| {kind} | {block} x {warps} | {ms:.3f} | {traffic / ms / 1e6:,.0f} | {same} ({exact}) |", flush=True)
    return out


if __name__ == "__main__":
    main()
