"""Live-mode benchmark: target and drafter sharing one GPU, against each half alone and against
offline (extract once, then train), all measured in one process.

Qwen3-8B-shaped target (random bf16 weights, cut after layer 33) and Qwen3-8B-shaped drafter (as in
bench/train.py) on one GPU; synthetic rows of 1024-4096 tokens. Measured, over the same planned
batches:

  * target only: the live source producing batches with nothing consuming them but a stream wait;
  * drafter only: optimiser steps on those batches already resident on the GPU;
  * live: the trainer fed by the live source (both halves on the GPU, own streams);
  * offline: extraction of the whole dataset to an `fp8` cache (timed), then training from it.

Then epoch times for 1 and 3 epochs: live = epochs x tokens / live rate; offline = extraction time
+ epochs x tokens / cache-fed rate (rates from the timed steps, extraction timed in full).
`--small` shrinks everything so the script can be checked on a CPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import time
from pathlib import Path
from typing import Any, cast

import torch

from bench.common import (
    add_common_args,
    bench_drafter_config,
    commit_synthetic_manifest,
    start_logging_and_device,
)
from bench.extract import build_model, qwen3_8b_config, synthetic_rows
from bench.train import LAYER_IDS, Timing, shapes, sync, timed_steps
from dflash_cache.data.dataset import from_table
from dflash_cache.data.planning import make_plan
from dflash_cache.extract.pipeline import RankExtractor
from dflash_cache.profiler import StageProfiler
from dflash_cache.store.layout import COMMITS_DIR, SEGMENTS_DIR
from dflash_cache.store.manifest import PlanParams
from dflash_cache.store.plan import DEFAULT_BUCKETS, PlanConfig
from dflash_cache.store.reader import CacheReader
from dflash_cache.target.capture import HiddenStateCapture
from dflash_cache.target.model import decoder_of
from dflash_cache.train.assemble import Parts, source_config
from dflash_cache.train.cache_source import CacheSource
from dflash_cache.train.drafter import FrozenTargetHead
from dflash_cache.train.epoch_plan import Position
from dflash_cache.train.live_source import LiveData, LiveSource, LiveTargets, live_sample_table
from dflash_cache.train.place import Place
from dflash_cache.train.run_config import TrainConfig
from dflash_cache.train.trainer import Trainer


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=400_000, help="dataset size")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per measurement")
    ap.add_argument("--token-budget", type=int, default=12288)
    ap.add_argument("--max-anchors", type=int, default=2048,
                    help="anchors per batch at most: 512 per 3072 tokens, the density of DFlash's cost model; "
                         "batches of short samples would otherwise hold several times more")
    ap.add_argument("--queue-depth", type=int, default=16,
                    help="live queue depth (each queued batch holds its features on the GPU: ~0.5 GB here)")
    add_common_args(ap, "/tmp/dflash-bench-live")
    args = ap.parse_args()
    device = start_logging_and_device()
    s = shapes(args.small)
    tcfg = qwen3_8b_config(args.small)
    layer_ids: list[int] = list(LAYER_IDS) if not args.small else [1, 3, 5, 7, 9]
    target = build_model(tcfg, device)
    decoder = decoder_of(target)
    # as decoder_of checked (nn.Module types the attributes it does not declare as Tensor | Module)
    decoder.layers = cast(torch.nn.ModuleList, decoder.layers)[: layer_ids[-1] + 1]
    capture = HiddenStateCapture(target, layer_ids)

    table_rows = synthetic_rows(args.tokens, tcfg.vocab_size)
    data = from_table(table_rows, name="synthetic")
    scan = data.scan(vocab_size=tcfg.vocab_size, max_len=None)
    table = live_sample_table(scan, DEFAULT_BUCKETS)
    tokens = int(table.lengths.sum())

    block = 16 if not args.small else 8
    cfg_kw: dict[str, Any] = dict(  # TrainConfig's keywords
        target="synthetic", block_size=block, draft_layers=s["layers"], num_anchors=512 if not args.small else 16,
        token_budget=args.token_budget, max_anchors=args.max_anchors, max_steps=10**9, progress=False, prefetch=4,
        read_threads=4)
    if tcfg.num_key_value_heads is None:  # not reached: Qwen3Config sets it
        raise RuntimeError("the target config has no num_key_value_heads")
    drafter_cfg = bench_drafter_config(  # the drafter takes the target's sizes
        hidden=tcfg.hidden_size, inter=tcfg.intermediate_size, heads=tcfg.num_attention_heads,
        kv=tcfg.num_key_value_heads, head_dim=tcfg.head_dim, vocab=tcfg.vocab_size, layers=s["layers"], block=block,
        layer_ids=tuple(layer_ids))
    # an HF model's methods (nn.Module types the attributes it does not declare as Tensor | Module)
    head = FrozenTargetHead(target.get_input_embeddings().weight,  # pyright: ignore[reportCallIssue]
                            target.get_output_embeddings().weight)  # pyright: ignore[reportCallIssue]
    out = Path(args.out)
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "tokens": tokens, "rates": {}}

    def live_source(profiler: StageProfiler) -> LiveSource:
        cfg = TrainConfig(cache="x", out=str(out / "live"), **cfg_kw)
        return LiveSource(LiveData(data, table, DEFAULT_BUCKETS), source_config(cfg),
                          LiveTargets([capture], [device], queue_depth=args.queue_depth),
                          Place(device, profiler=profiler))

    # target only
    src = live_source(StageProfiler(None))
    batches = src.iterate(Position(0, 0))
    for _ in itertools.islice(batches, 2):  # warm-up
        pass
    sync(device)
    t0, n = time.perf_counter(), 0
    for _, b in itertools.islice(batches, args.steps):
        n += b.num_tokens
    sync(device)
    results["rates"]["target_only"] = n / (time.perf_counter() - t0)
    batches.close()
    release_cached(device)

    # drafter only, on batches resident on the GPU
    resident = [b for _, b in itertools.islice(live_source(StageProfiler(None)).iterate(Position(0, 0)), args.steps)]
    profiler = StageProfiler(10**9)
    trainer = Trainer(TrainConfig(cache="x", out=str(out / "resident"), **cfg_kw),
                      Parts(live_source(profiler), drafter_cfg, head), Place(device, profiler=profiler))
    timed_steps(trainer.runner, iter(resident[:2]), 2, device)  # warm-up (FlexAttention compile)
    sec, tok = _rate(timed_steps(trainer.runner, iter(resident), args.steps, device))
    results["rates"]["drafter_only"] = tok / sec
    del resident
    release_cached(device)

    # live: the same trainer fed by the live source
    live_batches = (b for _, b in trainer.source.iterate(Position(0, 0)))
    timed_steps(trainer.runner, live_batches, 2, device)
    profiler.maybe_report(force=True)
    sec, tok = _rate(timed_steps(trainer.runner, live_batches, args.steps, device))
    results["rates"]["live"] = tok / sec
    results["live_profile"] = profiler.maybe_report(force=True)
    live_batches.close()  # stops the target worker before extraction takes the GPU
    del trainer, live_batches
    release_cached(device)

    # offline: extract everything (timed), then train from the cache
    root = out / "cache"
    shutil.rmtree(root, ignore_errors=True)
    (root / SEGMENTS_DIR).mkdir(parents=True)
    (root / COMMITS_DIR).mkdir()
    plan = make_plan(scan.lengths, scan.keep, PlanConfig())
    capture.remove()
    extractor = RankExtractor(root=root, dataset=data, model=target, layer_ids=layer_ids, codec="fp8", device=device,
                              rank=0, writers=8, prefetch=4, unit_rows=PlanConfig().unit_rows, max_len=None,
                              overlong="truncate", profiler=StageProfiler(None), progress=False)
    extractor.prepare(list(plan.batches))
    res = extractor.run(list(plan.batches))
    extractor.capture.remove()
    results["extract_seconds"] = res.seconds
    results["rates"]["offline_train"] = _train_from_cache(root, plan, layer_ids, tcfg, cfg_kw, drafter_cfg, head,
                                                          device, out, args.steps)
    for epochs in (1, 3):
        results[f"live_{epochs}ep_s"] = epochs * tokens / results["rates"]["live"]
        results[f"offline_{epochs}ep_s"] = res.seconds + epochs * tokens / results["rates"]["offline_train"]

    print("\n| measurement | tok/s |\n|---|---:|")
    for name, rate in results["rates"].items():
        print(f"| {name} | {rate:,.0f} |")
    print(f"\nextract (fp8, whole dataset): {res.seconds:.1f}s for {tokens:,} tokens")
    print("| epochs | live | offline (extract + train) |\n|---:|---:|---:|")
    for epochs in (1, 3):
        print(f"| {epochs} | {results[f'live_{epochs}ep_s']:.1f}s | {results[f'offline_{epochs}ep_s']:.1f}s |")
    print(results["live_profile"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def release_cached(device: torch.device) -> None:
    """Hand cached blocks back between phases: each phase's target worker allocates on its own
    stream, and the allocator keeps a separate cache per stream that no other stream can use."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _train_from_cache(root, plan, layer_ids, tcfg, cfg_kw, drafter_cfg, head, device, out, steps) -> float:
    """Cache-fed training rate on the cache just extracted (a manifest is written for the reader)."""
    c = plan.config
    commit_synthetic_manifest(root, codec="fp8", layer_ids=tuple(layer_ids), hidden=tcfg.hidden_size,
                              vocab=tcfg.vocab_size, plan=PlanParams(
        unit_rows=c.unit_rows, token_budget=c.token_budget, max_rows=c.max_rows, bucket_bounds=tuple(c.bucket_bounds),
        max_len=None, overlong="truncate", num_rows=plan.num_rows, num_units=plan.num_units,
        num_segments=len(plan.batches), num_samples=plan.num_samples, num_tokens=plan.num_tokens))
    cfg = TrainConfig(cache=str(root), out=str(out / "offline"), **cfg_kw)
    profiler = StageProfiler(None)
    place = Place(device, profiler=profiler)
    source = CacheSource(CacheReader(root), source_config(cfg), place)
    trainer = Trainer(cfg, Parts(source, drafter_cfg, head), place)
    batches = (b for _, b in source.iterate(Position(0, 0)))
    timed_steps(trainer.runner, batches, 2, device)
    sec, tok = _rate(timed_steps(trainer.runner, batches, steps, device))
    return tok / sec


def _rate(timing: Timing) -> tuple[float, int]:
    """(seconds, tokens) of timed steps, in steady state."""
    return timing.seconds, timing.tokens


if __name__ == "__main__":
    main()
