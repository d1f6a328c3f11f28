"""Phase-2 memory benchmark: the step-memory model (train/memory.py) against the measured peak.

A Qwen3-8B-shaped drafter (as in bench/train.py; `--drafter qwen3.5-27b` for the production target
family's width, heads and vocabulary) trains a few steps on batches of ~3072-token
sequences from a synthetic fp8 cache, for several (token budget, anchors per batch) points. For each
it prints the peak GPU memory allocated, the model's prediction and their ratio. Then it emulates
an 80 GB GPU (torch.cuda.set_per_process_memory_fraction) and trains with the plain defaults
(token budget 32768, 512 anchors per sequence, no --max-anchors): the anchor cap the trainer picks,
and whether the steps fit. `--small` checks the script on a CPU (no memory figures).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
from pathlib import Path
from unittest import mock

import torch

import dflash_cache.train.step
from bench.common import add_common_args, bench_drafter_config, start_logging_and_device
from bench.train import LAYER_IDS, add_drafter_arg, shapes, stepping, write_cache
from dflash_cache.store.reader import CacheReader
from dflash_cache.train.assemble import Parts, source_config
from dflash_cache.train.cache_source import CacheSource
from dflash_cache.train.drafter import FrozenTargetHead
from dflash_cache.train.epoch_plan import Position
from dflash_cache.train.memory import GIB, step_memory
from dflash_cache.train.place import Place
from dflash_cache.train.run_config import TrainConfig
from dflash_cache.train.trainer import Trainer

# (token budget, anchors per batch); the last has few anchors for its context, where the features of
# the batch and of the one prepared ahead weigh most.
POINTS = ((12288, 1024), (12288, 2048), (24576, 1024), (32768, 1536), (32768, 256))


def make_trainer(cache: Path, out: Path, drafter_cfg, head, device, **kw) -> Trainer:
    cfg = TrainConfig(cache=str(cache), out=str(out), target="synthetic", block_size=drafter_cfg.block_size,
                      draft_layers=drafter_cfg.num_layers, max_steps=10**9, progress=False, **kw)
    source = CacheSource(CacheReader(cache), source_config(cfg), Place(device))
    return Trainer(cfg, Parts(source, drafter_cfg, head), Place(device))


def peak_of_steps(trainer: Trainer, steps: int, device) -> tuple[float, int, int]:
    """(peak GiB, anchors, context tokens) over `steps` steps of the trainer's own source."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    anchors = tokens = 0
    real_sample = dflash_cache.train.step.sample_anchors

    def counting(batch, **kw):
        nonlocal anchors, tokens
        blocks = real_sample(batch, **kw)
        anchors, tokens = max(anchors, blocks.num_anchors), max(tokens, batch.num_tokens)
        return blocks

    batches = (batch for _, batch in itertools.islice(trainer.source.iterate(Position(0, 0)), steps))
    with mock.patch("dflash_cache.train.step.sample_anchors", counting):  # the largest step the points reached
        for _ in stepping(trainer.runner, batches):  # as `train` steps: the next batch prepared during a step
            pass
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / GIB, anchors, tokens
    return 0.0, anchors, tokens


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="steps per point (the first compiles)")
    ap.add_argument("--emulate-gib", type=float, default=80.0, help="GPU size the defaults run is limited to")
    ap.add_argument("--skip-points", action="store_true", help="only the defaults run")
    add_drafter_arg(ap)
    add_common_args(ap, "/tmp/dflash-bench-memory")
    args = ap.parse_args()
    device = start_logging_and_device()
    s = shapes(args.small, args.drafter)
    out = Path(args.out)
    block = 8 if args.small else 16
    drafter_cfg = bench_drafter_config(hidden=s["hidden"], inter=s["inter"], heads=s["heads"], kv=s["kv"],
                                       head_dim=s["head_dim"], vocab=s["vocab"], layers=s["layers"], block=block,
                                       layer_ids=LAYER_IDS)
    g = torch.Generator().manual_seed(0)
    head = FrozenTargetHead(torch.randn(s["vocab"], s["hidden"], generator=g) * 0.02,
                            torch.randn(s["vocab"], s["hidden"], generator=g) * 0.02)
    cache = out / "cache-fp8"
    write_cache(cache, "fp8", tokens=40 * s["seq"], seq=s["seq"], hidden=s["hidden"], vocab=s["vocab"],
                device=device)
    points = ((2 * s["seq"], 64), (4 * s["seq"], 128)) if args.small else POINTS
    points = () if args.skip_points else points
    rows = []
    for budget, anchors in points:
        trainer = make_trainer(cache, out / "run", drafter_cfg, head, device, token_budget=budget,
                               max_anchors=anchors)
        peak, used, tokens = peak_of_steps(trainer, args.steps, device)
        model = step_memory(drafter_cfg, device, compiled=trainer.runner.compiled)
        predicted = model.bytes(used, block, tokens) / GIB
        rows.append({"token_budget": budget, "anchors": used, "context_tokens": tokens, "peak_gib": peak,
                     "predicted_gib": predicted, "ratio": peak / predicted if peak else None})
        print(f"budget {budget} anchors {used} tokens {tokens}: peak {peak:.1f} GiB, model {predicted:.1f} GiB",
              flush=True)
        del trainer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    defaults = {}
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.emulate_gib * GIB / total),
                                                   torch.cuda.current_device())
        trainer = make_trainer(cache, out / "run-defaults", drafter_cfg, head, device)
        try:
            peak, used, tokens = peak_of_steps(trainer, args.steps + 2, device)
            defaults = {"fits": True, "peak_gib": peak, "anchor_cap": trainer.runner.max_anchors, "anchors": used,
                        "context_tokens": tokens}
        except torch.OutOfMemoryError as e:
            defaults = {"fits": False, "anchor_cap": trainer.runner.max_anchors, "error": str(e).splitlines()[0]}
        print(f"defaults on an emulated {args.emulate_gib:.0f} GiB GPU: {defaults}", flush=True)
    print("\n| token budget | anchors | context tokens | peak GiB | model GiB | peak / model |\n|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] else "-"
        print(f"| {r['token_budget']} | {r['anchors']} | {r['context_tokens']} | {r['peak_gib']:.1f} | "
              f"{r['predicted_gib']:.1f} | {ratio} |")
    if args.json:
        drafter = "small" if args.small else args.drafter
        Path(args.json).write_text(json.dumps({"drafter": drafter, "points": rows, "defaults": defaults}, indent=1))


if __name__ == "__main__":
    main()
