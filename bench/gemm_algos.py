"""The training step's matrix products: torch's cuBLAS call against every cuBLASLt algorithm that
cuBLASLt's heuristic offers for the same product, one at a time.

The step's products (bench configuration: 32,768 block rows, hidden 4,096, intermediate 12,288, the
LM head over 3,840-row chunks of a 151,936 vocabulary) take ~75% of its device time, through torch's
heuristic choice of kernel. If another algorithm ran a shape faster, choosing it would be a lever;
this script measures whether one does, in the operand layouts the step uses (forward x @ w.T, the
input gradient dy @ w, the weight gradient dy.T @ x). Needs nvmath-python (its cuBLASLt planner) and
a GPU; every product runs on random bf16 data, timed by CUDA events, median of several loops.

On an NVIDIA H200 (2026-12-02, `...-gemm-algos.*`) the algorithms without split-K gave torch's
results bit for bit, and some looked 1-5% faster alone. Chosen per shape inside the training step
(each timed on the step's own operands, the fastest kept), they made the step 0.1-0.2% faster
(`...-train-tuned-matmuls.*`): at the step's clocks torch's own product was the fastest for most
shapes. Not adopted.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

M, H, INTER, CHUNK, VOCAB = 32768, 4096, 12288, 3840, 151936


def operands(kind: str, m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """a [m, k], b [k, n] in the layout the step hands cuBLAS for this kind of product."""
    def rand(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda") * std).to(torch.bfloat16)

    if kind == "forward":       # x [m, k] @ w[n, k].T
        return rand(m, k), rand(n, k, std=0.02).t()
    if kind == "input grad":    # dy [m, k] @ w [k, n]
        return rand(m, k), rand(k, n, std=0.02)
    if kind == "weight grad":   # dy[k, m].T @ x [k, n]
        return rand(k, m).t(), rand(k, n)
    raise ValueError(kind)


SHAPES: list[tuple[str, str, int, int, int]] = [
    ("gate/up", "forward", M, H, INTER),
    ("down", "forward", M, INTER, H),
    ("q/o", "forward", M, H, H),
    ("down", "input grad", M, H, INTER),
    ("gate/up", "input grad", M, INTER, H),
    ("q/o", "input grad", M, H, H),
    ("down", "weight grad", H, M, INTER),
    ("gate/up", "weight grad", INTER, M, H),
    ("q/o", "weight grad", H, M, H),
    ("LM head logits", "forward", CHUNK, H, VOCAB),
    ("LM head input grad", "input grad", CHUNK, VOCAB, H),
]


def median_ms(fn, loops: int, reps: int) -> float:
    """Median over `loops` of the mean time of `reps` back-to-back calls after 3 untimed ones, by CUDA
    events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(loops):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def survey(name: str, kind: str, m: int, k: int, n: int, *, limit: int, loops: int, reps: int) -> dict:
    from nvmath.linalg.advanced import Matmul  # pyright: ignore[reportMissingImports] (installed for this bench only)

    a, b = operands(kind, m, k, n)
    tflop = 2 * m * k * n / 1e12
    ref = torch.mm(a, b)
    torch_ms = median_ms(lambda: torch.mm(a, b), loops, reps)
    with Matmul(a, b) as mm:
        algorithms = mm.plan(preferences={"limit": limit})
        rows = []
        for i, algo in enumerate(algorithms):
            out = mm.execute(algorithm=algo)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            ms = median_ms(lambda algo=algo: mm.execute(algorithm=algo), loops, reps)
            rows.append({"rank": i, "ms": ms, "tflops": tflop / ms * 1e3, "rel_err": err,
                         "tile": str(algo.tile), "stages": str(algo.stages), "cluster": str(algo.cluster_shape),
                         "split_k": algo.split_k, "swizzle": algo.cta_swizzling})
    best = min(rows, key=lambda r: r["ms"])
    print(f"| {name} | {kind} | [{m}, {k}] x [{k}, {n}] | {torch_ms:.3f} ({tflop / torch_ms * 1e3:.0f}) | "
          f"{rows[0]['ms']:.3f} | {best['ms']:.3f} ({best['tflops']:.0f}) #{best['rank']} {best['tile']} "
          f"{best['cluster']} | {torch_ms / best['ms']:.3f} | {len(rows)} |", flush=True)
    return {"name": name, "kind": kind, "shape": [m, k, n], "torch_ms": torch_ms, "algorithms": rows}


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=24, help="algorithms to ask cuBLASLt's heuristic for")
    ap.add_argument("--loops", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| product | kind | shape | torch ms (TFLOP/s) | heuristic #0 ms | best ms (TFLOP/s) | torch / best "
          "| algorithms |\n|---|---|---|---:|---:|---:|---:|---:|")
    results = [survey(*s, limit=args.limit, loops=args.loops, reps=args.reps) for s in SHAPES]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
