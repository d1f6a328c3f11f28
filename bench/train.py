"""Phase-2 benchmark: drafter training fed from caches on local disk against the same batches
already resident on the GPU, side by side in one process.

A Qwen3-8B-shaped drafter (5 layers, hidden 4096, intermediate 12288, 32/8 heads, vocab 151936,
block 16, 512 anchors per sequence, all-full attention) with a random frozen embedding and LM
head. Synthetic caches (`fp8`, `bf16`) of ~3072-token sequences with random bf16 features are
written to --out first (not timed). Then, after warm-up steps (FlexAttention compile), it times N
optimiser steps for each source:

  * cache `fp8` and cache `bf16`: CacheSource reading, decompressing, H2D and dequantising in the
    background, the page cache dropped first when the OS allows it (reported);
  * resident: the same batches, decoded, held on the GPU (no I/O at all).

One trainer steps through the sources in interleaved rounds (resident, then each cache), so drift
in clocks or allocator state hits all of them alike. Each cache run first takes 2 untimed steps
(its reader pool filling the prefetch window, reported) and is then timed in steady state: every
measurement runs one untimed lead-in step and times the next N on the device (`timed_steps`), so
the pipeline fill after a synchronisation, which a training run pays once, is left out; the
sync-to-sync rate with it is printed beside. Prints tok/s (sequence tokens) per round, each cache's ratio to the resident run of the same
round, peak GPU memory and the profiler's stage breakdown. `--small` shrinks everything so the
script can be checked on a CPU.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import itertools
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import flex_attention

from bench.common import (
    add_common_args,
    bench_drafter_config,
    commit_synthetic_manifest,
    start_logging_and_device,
)
from bench.gpu_clocks import ClockSampler, describe
from bench.seeds_mix import prompt_lengths, seeds_mix_lengths
from bench.variants import (
    compile_with_options,
    compiled_state,
    every_row_flops,
    register_loss_kernels,
    set_compiled_state,
    use_every_row,
)
from dflash_cache.profiler import StageProfiler
from dflash_cache.store.batch import HostBatch
from dflash_cache.store.codecs import get_codec
from dflash_cache.store.layout import COMMITS_DIR, SEGMENTS_DIR
from dflash_cache.store.manifest import PlanParams
from dflash_cache.store.plan import PlannedBatch
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.writer import commit_segment
from dflash_cache.train.anchors import sample_anchors
from dflash_cache.train.assemble import Parts, source_config
from dflash_cache.train.attention_kernels import flash_flex_attention
from dflash_cache.train.cache_source import CacheSource
from dflash_cache.train.drafter import FrozenTargetHead
from dflash_cache.train.epoch_plan import Position
from dflash_cache.train.flops import StepFlops, step_flops
from dflash_cache.train.memory import ALLOC_CONF_VARS, prefer_expandable_segments
from dflash_cache.train.optim import drafter_optimizer, load_optimizer_state
from dflash_cache.train.place import Place
from dflash_cache.train.precision import Precision
from dflash_cache.train.run_config import TrainConfig
from dflash_cache.train.step import StepRunner
from dflash_cache.train.trainer import Trainer

LAYER_IDS = (1, 9, 17, 25, 33)
SEEDS_TOKENS_PER_EXTRACT_BATCH = 43_500  # the seeds' mix under the default extraction plan (bench/seeds_mix.py)


def prescaled_flex_attention(q, k, v, **kwargs):
    """FlexAttention whose kernels scale q by the softmax scale (and the change of base to 2) once as
    they load it, instead of every score: fewer multiplies, other roundings."""
    return flex_attention(q, k, v, kernel_options={"PRESCALE_QK": True}, **kwargs)


# What the static-shape graph's attention can be switched to, side by side with the trainer's choice
# (`--attention-kernels`, auto by default: flash-attention 4's kernels when installed).
ATTENTION_FNS = {"flash": flash_flex_attention, "triton": flex_attention, "prescale": prescaled_flex_attention}


# The drafters the benchmarks train: 5 layers as wide as the target, with its heads and vocabulary
# (DrafterConfig.from_target), on 3,072-token sequences. qwen3-8b is the configuration the public
# DFlash trainers were compared on; qwen3.5-27b is the width, heads (head_dim 256) and vocabulary of
# the production target family.
DRAFTER_SHAPES = {
    "qwen3-8b": dict(hidden=4096, inter=12288, heads=32, kv=8, head_dim=128, vocab=151936, seq=3072, layers=5),
    "qwen3.5-27b": dict(hidden=5120, inter=17408, heads=24, kv=4, head_dim=256, vocab=248320, seq=3072, layers=5),
}
SMALL_SHAPES = dict(hidden=128, inter=384, heads=4, kv=2, head_dim=32, vocab=2048, seq=256, layers=2)


def shapes(small: bool, drafter: str = "qwen3-8b") -> dict:
    return SMALL_SHAPES if small else DRAFTER_SHAPES[drafter]


def add_drafter_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--drafter", choices=sorted(DRAFTER_SHAPES), default="qwen3-8b",
                    help="the drafter's shape (--small replaces it with a tiny one)")


def write_cache(root: Path, codec: str, *, tokens: int, seq: int, hidden: int, vocab: int, device,
                min_seq: int | None = None, lengths: str = "uniform") -> None:
    """A cache of random sequences with random bf16 features: every sequence `seq` tokens long (10%
    prompt), or with `min_seq`, lengths drawn uniformly from [min_seq, seq]; or with lengths
    "seeds", the seeds' length mix (bench/seeds_mix.py: extraction batches of the default plan, as
    `extract` would write them, 10-30% prompt). Segments are compressed and written by 16 threads."""
    from concurrent.futures import ThreadPoolExecutor

    from dflash_cache.data.planning import make_plan
    from dflash_cache.store.plan import PlanConfig

    shutil.rmtree(root, ignore_errors=True)
    (root / SEGMENTS_DIR).mkdir(parents=True)
    (root / COMMITS_DIR).mkdir()
    c = get_codec(codec)
    specs = c.arrays(len(LAYER_IDS), hidden)
    rng = np.random.default_rng(0)
    if lengths == "seeds":
        all_lengths = seeds_mix_lengths(max(1, round(tokens / SEEDS_TOKENS_PER_EXTRACT_BATCH)))
        prompts = prompt_lengths(all_lengths)
        config = PlanConfig()
        planned = list(make_plan(all_lengths, np.ones(len(all_lengths), bool), config).batches)
    else:
        per_segment = max(1, 16384 // seq)
        n_seq = max(per_segment, tokens // seq)
        all_lengths = np.full(n_seq, seq) if min_seq is None else rng.integers(min_seq, seq + 1, size=n_seq)
        prompts = all_lengths // 10
        config = PlanConfig(token_budget=16384, max_rows=per_segment, unit_rows=n_seq, bucket_bounds=(0,))
        planned = [PlannedBatch(unit=0, batch=s, bucket=0, rows=rows, lengths=all_lengths[rows].astype(np.int32))
                   for s, rows in enumerate(np.array_split(np.arange(n_seq), -(-n_seq // per_segment)))]
    with ThreadPoolExecutor(16) as pool:
        pending = []
        for batch in planned:
            lens = all_lengths[batch.rows]
            feats = torch.randn(int(lens.sum()), len(LAYER_IDS) * hidden, device=device, dtype=torch.bfloat16)
            encoded = {k: v.cpu() for k, v in c.encode(feats, len(LAYER_IDS)).items()}
            masks = [np.r_[np.zeros(p, np.uint8), np.ones(n - p, np.uint8)] for n, p in zip(lens, prompts[batch.rows],
                                                                                          strict=True)]
            packed = HostBatch.pack([rng.integers(0, vocab, size=n) for n in lens], masks, batch.rows)
            pending.append(pool.submit(commit_segment, root, batch, packed, encoded, specs=specs, rank=0))
            while len(pending) > 32:  # bounded host memory: encoded segments wait for their writer
                pending.pop(0).result()
        for fut in pending:
            fut.result()
    n = len(all_lengths)
    commit_synthetic_manifest(root, codec=codec, layer_ids=LAYER_IDS, hidden=hidden, vocab=vocab, plan=PlanParams(
        unit_rows=config.unit_rows, token_budget=config.token_budget, max_rows=config.max_rows,
        bucket_bounds=tuple(config.bucket_bounds), max_len=None, overlong="truncate", num_rows=n,
        num_units=-(-n // config.unit_rows), num_segments=len(planned), num_samples=n,
        num_tokens=int(all_lengths.sum())))


def mean_step_flops(cfg, batches: list, *, num_anchors: int, max_anchors: int | None,
                    every_row: bool = False) -> StepFlops:
    """The model FLOPs of a step averaged over `batches`, with anchors drawn as the trainer draws them
    (other draws: the same counts, slightly other positions); `every_row`: of the drafter on every
    row (bench.variants.use_every_row)."""
    g = torch.Generator().manual_seed(0)
    parts = []
    for batch in batches:
        blocks = sample_anchors(batch, block_size=cfg.block_size, num_anchors=num_anchors, max_anchors=max_anchors,
                                mask_token_id=cfg.mask_token_id, generator=g)
        if blocks.prefix_keys is None:  # not reached: anchors sampled on the host count them
            raise RuntimeError("anchors sampled on the host without their prefix keys")
        parts.append((every_row_flops if every_row else step_flops)(
            cfg, context_tokens=batch.num_tokens, num_blocks=blocks.num_anchors, prefix_keys=blocks.prefix_keys))
    return StepFlops(*(sum(getattr(f, k) for f in parts) / len(parts) for k in ("linears", "attention", "lm_head")))


def set_precision(trainer: Trainer, precision: Precision) -> bool:
    """Carry on training `trainer`'s drafter at `precision`: the same weights (bf16 ones from their masters) and
    AdamW state, the other optimizer (torch's fused AdamW over float32 weights, or TritonAdamW with
    masters). The compiled graphs compile again (~45 s): their guards do not see a parameter's dtype
    change, so dynamo is reset. The bench runs this variant last in each round."""
    drafter = trainer.drafter  # what the step runner steps
    if precision == drafter.precision:
        return False
    torch._dynamo.reset()
    old = drafter.optimizer
    with torch.no_grad():
        for p, master in getattr(old, "master_weights", dict)().items():
            p.data = master.clone()  # float32 again, the master's value
    hparams = dict(lr=old.defaults["lr"], weight_decay=old.defaults["weight_decay"], device=trainer.place.device)
    new = drafter_optimizer(drafter.model, **hparams, precision=precision)  # lowers the weights for masters
    load_optimizer_state(new, old.state_dict())  # moments, step counts, learning rates
    drafter.optimizer = drafter.schedule.scheduler.optimizer = new
    drafter.precision = precision
    return True


def drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(runner: StepRunner, batches, steps: int, device) -> None:
    """`steps` untimed steps (compiles, a reader pool filling its prefetch window), then a sync."""
    for _ in stepping(runner, itertools.islice(batches, steps)):
        pass
    sync(device)


def stepping(runner: StepRunner, batches, lookahead: bool = True):
    """Each batch's step, as `dflash-cache train` takes them (StepRunner.train_steps: the next batch's
    anchors and masks prepared while a step is queued on the device), yielding the batch after its
    step; without `lookahead`, one batch at a time (train_step prepares its own first), as before
    2026-12-04."""
    if lookahead:
        yield from (batch for _, batch, _ in runner.train_steps((None, b) for b in batches))
        return
    for batch in batches:
        runner.train_step(batch)
        yield batch


@dataclasses.dataclass(frozen=True)
class Timing:
    seconds: float  # the timed steps, in steady state
    tokens: int
    with_fill_seconds: float  # sync to sync, the lead-in step included
    with_fill_tokens: int
    flops: float = 0.0  # model FLOPs of the timed steps (their real anchors: padding is not counted)


def count_flops(runner: StepRunner) -> list[float]:
    """The model FLOPs of every step the runner takes from now on, appended to the returned list."""
    log, add = [], runner.profiler.add_flops

    def counting(n: float) -> None:
        log.append(n)
        add(n)

    runner.profiler.add_flops = counting
    return log


def timed_steps(runner: StepRunner, batches, steps: int, device, sync_every: int = 0,
                lookahead: bool = True, flop_log: list[float] | None = None) -> Timing:
    """`steps` steps after one untimed lead-in step, with no synchronisation in between.

    The host prepares each step (the batch's fetch and copy, the anchors, the launches) while the
    device runs the one before. After a synchronisation the device instead waits for all of the
    first step's preparation: a pipeline fill that a training run pays once, not every `steps`
    steps, and a cache source's is longer than resident batches'. So the time is taken on the
    device, between CUDA events on the training stream after the lead-in step and after the last
    step: device idle time within the timed steps (a host that falls behind) still counts.
    `with_fill_seconds` runs from a synchronisation before the lead-in step to one after the last,
    as this script timed every step before 2026-12-02. `sync_every` K > 0 waits for the device
    after every K-th timed step, as `dflash-cache train` did at each log step before 2026-12-02;
    `lookahead` as in `stepping`."""
    sync(device)
    t0 = time.perf_counter()
    steps_run = stepping(runner, itertools.islice(batches, steps + 1), lookahead)
    lead_in = next(steps_run)
    counted = len(flop_log) if flop_log is not None else 0
    runner.profiler.add_tokens(lead_in.num_tokens)  # the profile's rate is host time, the fill included
    cuda = device.type == "cuda"
    start = torch.cuda.Event(enable_timing=True) if cuda else None
    if start is not None:
        start.record()
    t1, tokens = time.perf_counter(), 0
    for i, batch in enumerate(steps_run, start=1):
        runner.profiler.add_tokens(batch.num_tokens)
        tokens += batch.num_tokens
        if sync_every and i % sync_every == 0 and i < steps:
            sync(device)
    end = torch.cuda.Event(enable_timing=True) if cuda else None
    if end is not None:
        end.record()
    sync(device)
    t2 = time.perf_counter()
    seconds = start.elapsed_time(end) / 1e3 if start is not None and end is not None else t2 - t1  # a CPU runs each step before returning
    flops = sum(flop_log[counted:]) if flop_log is not None else 0.0
    return Timing(seconds, tokens, t2 - t0, tokens + lead_in.num_tokens, flops)


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=300_000, help="tokens in each synthetic cache")
    ap.add_argument("--steps", type=int, default=24, help="timed optimiser steps per measurement")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (resident, each cache), interleaved")
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps first (FlexAttention compiles)")
    ap.add_argument("--token-budget", type=int, default=12288)
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--codecs", default="fp8,bf16")
    ap.add_argument("--lengths", default="uniform",
                    help="the caches' sequence lengths, comma-separated: 'uniform' (all the bench length) and/or "
                         "'seeds' (the seeds' length mix, bench/seeds_mix.py); with both, each codec gets a cache "
                         "of each, timed side by side, and the static shapes are planned from the seeds' cache")
    ap.add_argument("--no-resident", action="store_true",
                    help="time the caches only (the resident batches of a large token budget fill the GPU)")
    ap.add_argument("--epoch-steps", action="store_true",
                    help="time as many steps as the (first) seeds' cache has batches per epoch, so the timed "
                         "batches hold the mix in its shares; --steps still sets the other sources' steps")
    add_drafter_arg(ap)
    ap.add_argument("--min-seq", type=int, default=None,
                    help="sequence lengths uniform in [MIN_SEQ, the bench length] instead of all equal: batches "
                         "of varying shapes, as training sees (compiled kernels are then dynamic-shape ones)")
    ap.add_argument("--no-compile", action="store_true", help="eager drafter layers and loss (train --no-compile)")
    ap.add_argument("--max-autotune", action="store_true",
                    help="an experiment the trainer does not run: inductor benchmarks Triton matrix-multiply "
                         "templates against cuBLAS for every shape and may fuse element-wise work into them "
                         "(compiling takes minutes; FlexAttention keeps its default kernel settings)")
    ap.add_argument("--loss-chunks", default="",
                    help="also time the resident batches with these LM-head loss chunk sizes (comma-separated "
                         "rows; the trainer's is 4096): fewer, larger products against more logits memory")
    ap.add_argument("--loss-kernels", default="",
                    help="also time the resident batches with these LM-head loss chunk kernels (comma-separated "
                         "names from dflash_cache.train.loss.LOSS_KERNELS, or bench/variants.py's inductor and "
                         "one-read: bench/one_read_loss.py; the trainer's is triton)")
    ap.add_argument("--attention-kernels", default="",
                    help="also time the resident batches with the static graph's FlexAttention lowered another "
                         "way: 'triton' (inductor's template), 'flash' (flash-attention 4's kernels; needs the "
                         "flash-attn-4 package), 'prescale' (Triton's with PRESCALE_QK). The default is the "
                         "trainer's (train --attention-kernels auto)")
    ap.add_argument("--compile-options", default="",
                    help="also time the resident batches through layers compiled with these inductor settings "
                         "(comma-separated NAME=VALUE, VALUE a Python literal, e.g. prologue_fusion=False)")
    ap.add_argument("--blas", default="", help="also time the resident batches with matrix products through this "
                    "BLAS library (torch.backends.cuda.preferred_blas_library: cublaslt; the default is cublas)")
    ap.add_argument("--compare-no-lookahead", action="store_true",
                    help="also time the resident batches and the first cache one batch at a time: each step's "
                         "anchors and masks prepared at its start, not while the step before is queued on the device")
    ap.add_argument("--compare-full-rows", action="store_true",
                    help="also time the resident batches with the drafter on every row (the trainer runs the "
                         "first layer's projections on the distinct block rows and the last layer's output "
                         "projection and MLP on the scored rows; the MFU column counts that work)")
    ap.add_argument("--compare-sync-every", type=int, default=0, metavar="K",
                    help="also time resident batches and the first cache with a wait for the device after "
                         "every K-th step (what `train` did at each log step, every 10 by default, before "
                         "2026-12-02)")
    ap.add_argument("--compare-fp32-weights", action="store_true",
                    help="also time the resident batches with float32 linear weights under autocast and torch's "
                         "fused AdamW (the trainer holds them in bf16 with float32 masters in TritonAdamW on a GPU)")
    ap.add_argument("--compare-dynamic", action="store_true",
                    help="also time the resident batches through the dynamic-shape graph alone (compiled)")
    ap.add_argument("--trace", type=int, default=0, metavar="N",
                    help="then trace N resident steps with torch.profiler: top kernels, host syncs, GPU busy share")
    ap.add_argument("--trace-source", default="resident", metavar="NAME",
                    help="what --trace steps through: 'resident' or a codec of --codecs (that cache, its page "
                         "cache dropped and 2 untimed steps first; reader threads' CUDA calls are traced too)")
    add_common_args(ap, "/tmp/dflash-bench-train")
    args = ap.parse_args()
    prefer_expandable_segments()  # as `dflash-cache train` does, before the first CUDA allocation
    device = start_logging_and_device()
    if args.max_autotune:
        import torch._inductor.config as inductor_config

        # Matrix multiplies and element-wise kernels only. `max_autotune` itself (what
        # mode="max-autotune-no-cudagraphs" sets) also autotunes FlexAttention's kernels, whose
        # lowering failed on torch 2.11 (bench/results/2026-12-01-h200-train-max-autotune-failed.log),
        # and whose settings bench/attention.py found none better than the default.
        inductor_config.max_autotune_gemm = True
        inductor_config.max_autotune_pointwise = True
    s = shapes(args.small, args.drafter)
    out = Path(args.out)
    codecs = args.codecs.split(",")

    cfg_kw: dict[str, Any] = dict(  # TrainConfig's keywords
        target="synthetic", block_size=16 if not args.small else 8, draft_layers=s["layers"],
        num_anchors=args.num_anchors, token_budget=args.token_budget, max_steps=10**9,
        progress=False, profile_interval=10**9, prefetch=4, read_threads=4, compile=not args.no_compile)
    drafter_cfg = bench_drafter_config(hidden=s["hidden"], inter=s["inter"], heads=s["heads"], kv=s["kv"],
                                       head_dim=s["head_dim"], vocab=s["vocab"], layers=s["layers"],
                                       block=cfg_kw["block_size"], layer_ids=LAYER_IDS)
    g = torch.Generator().manual_seed(0)
    head = FrozenTargetHead(torch.randn(s["vocab"], s["hidden"], generator=g) * 0.02,
                            torch.randn(s["vocab"], s["hidden"], generator=g) * 0.02)

    sources, source_steps = {}, {}
    kinds = args.lengths.split(",")
    for kind, codec in itertools.product(sorted(kinds, key=lambda k: k != "seeds"), codecs):
        name = codec if len(kinds) == 1 else f"{kind}-{codec}"
        root = out / f"cache-{name}"
        t0 = time.perf_counter()
        # a uniform cache beside the seeds' one needs only the batches it is timed on
        tokens = args.tokens if len(kinds) == 1 or kind == "seeds" else \
            min(args.tokens, (args.steps + 4) * args.token_budget)
        write_cache(root, codec, tokens=tokens, seq=s["seq"], hidden=s["hidden"], vocab=s["vocab"], device=device,
                    min_seq=args.min_seq, lengths=kind)
        print(f"wrote {name} cache in {time.perf_counter() - t0:.1f}s", flush=True)
        cfg = TrainConfig(cache=str(root), out=str(out / f"run-{name}"), **cfg_kw)
        sources[name] = CacheSource(CacheReader(root), source_config(cfg), Place(device))
        source_steps[name] = sources[name].batches_per_epoch() if args.epoch_steps and kind == "seeds" else args.steps
    # One trainer (one drafter, one optimiser) steps through every source in turn, so the
    # measurements differ only in where the batches come from; its static shapes are planned from the
    # first source's batches (the seeds' mix when there is one).
    first_name = next(iter(sources))
    profiler = StageProfiler(10**9)  # the trainer sets its peak FLOP/s: reports give MFU
    trainer = Trainer(TrainConfig(cache=str(out / f"cache-{first_name}"), out=str(out / "run"), **cfg_kw),
                      Parts(sources[first_name], drafter_cfg, head), Place(device, profiler=profiler))
    runner = trainer.runner  # the step, which every measurement times
    for source in sources.values():
        source.profiler = profiler
    flop_log = count_flops(runner)
    first = sources[first_name]
    t0 = time.perf_counter()
    compile_s = runner.warm_up()
    planned = runner.shapes.describe() if runner.shapes is not None else None
    print(f"start-up: static shapes ({planned}) compiled in {compile_s:.1f}s", flush=True)
    run_steps(runner, (b for _, b in first.iterate(Position(0, 0))), args.warmup, device)
    print(f"warm-up ({args.warmup} steps after the start-up): {time.perf_counter() - t0:.1f}s", flush=True)
    # the batches the cache runs see, decoded and held on the GPU (no I/O at all)
    # (one more than the timed steps: the lead-in of timed_steps)
    resident = [] if args.no_resident else \
        [b for _, b in itertools.islice(first.iterate(Position(0, 0)), args.steps + 1)]
    measured = resident[1:] or [b for _, b in itertools.islice(first.iterate(Position(0, 0)), 8)]
    flops = mean_step_flops(drafter_cfg, measured, num_anchors=args.num_anchors, max_anchors=runner.max_anchors)
    all_rows_flops = mean_step_flops(drafter_cfg, measured, num_anchors=args.num_anchors,
                                     max_anchors=runner.max_anchors, every_row=True)
    print(f"model FLOPs per step, mean of the timed batches: {flops.total / 1e12:.1f} T (linears "
          f"{flops.linears / 1e12:.1f}, attention {flops.attention / 1e12:.1f}, LM head {flops.lm_head / 1e12:.1f}; "
          f"{all_rows_flops.total / 1e12:.1f} T on every row); peak {(profiler.peak_flops or 0) / 1e12:.0f} TFLOP/s; "
          f"compiled: {runner.compiled}; attention kernels: {runner.attention_kernels}", flush=True)

    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "drafter": "small" if args.small else args.drafter, "steps": args.steps,
                     "token_budget": args.token_budget, "compiled": runner.compiled,
                     "attention_kernels": runner.attention_kernels,
                     "max_autotune": args.max_autotune, "compile_options": args.compile_options,
                     "alloc_conf": {v: os.environ[v] for v in ALLOC_CONF_VARS if v in os.environ},
                     "step_tflops": flops.total / 1e12, "step_tflops_every_row": all_rows_flops.total / 1e12,
                     "lengths": args.lengths, "startup_s": compile_s, "static_shapes": planned, "runs": {}}
    static_shapes = runner.shapes
    compare = args.compare_dynamic and static_shapes is not None
    if compare:
        runner.shapes = None
        t0 = time.perf_counter()
        run_steps(runner, iter(resident), 3, device)
        print(f"warm-up of the dynamic-shape graph: {time.perf_counter() - t0:.1f}s", flush=True)
    default_cfg, default_kernel = runner.cfg, runner.loss_kernel
    chunk_runs = {f"resident-loss-chunk-{n}": int(n) for n in args.loss_chunks.split(",") if n}
    kernel_runs = {f"resident-loss-{k}": k for k in args.loss_kernels.split(",") if k}
    register_loss_kernels()  # "inductor" and "one-read", by the names the runner takes
    attention_runs = {f"resident-attention-{k}": ATTENTION_FNS[k] for k in args.attention_kernels.split(",") if k}
    model = runner.model
    default_attention = model.static_flex_attention_fn
    runners = {"default": compiled_state(model)}
    option_runs = {}
    blas_runs = {f"resident-{args.blas}": args.blas} if args.blas else {}
    row_runs = {"resident-full-rows": True} if args.compare_full_rows else {}
    one_at_a_time = {f"{src}-no-lookahead" for src in ("resident", first_name)} if args.compare_no_lookahead else set()
    k = args.compare_sync_every
    sync_runs = {f"{src}-sync-every-{k}": src for src in ("resident", first_name)} if k else {}
    precision_runs = {"resident-fp32-weights": Precision(autocast=True, master_weights=False)} \
        if args.compare_fp32_weights else {}
    default_precision = trainer.drafter.precision
    default_blas = torch.backends.cuda.preferred_blas_library() if device.type == "cuda" else None
    if args.compile_options and runner.compiled:
        compile_with_options(model, {k: ast.literal_eval(v) for k, v in
                                     (kv.split("=", 1) for kv in args.compile_options.split(","))})
        option_runs["resident-compile-options"] = compiled_state(model)
        set_compiled_state(model, runners["default"])
    resident_runs = [] if args.no_resident else \
        ["resident", *(["resident-dynamic"] if compare else []), *chunk_runs, *kernel_runs, *attention_runs,
         *option_runs, *blas_runs, *row_runs]
    for rnd in range(args.rounds):
        for name in [*resident_runs, *sources, *sync_runs, *sorted(one_at_a_time), *precision_runs]:
            runner.shapes = None if name == "resident-dynamic" else static_shapes
            runner.cfg = dataclasses.replace(default_cfg, loss_chunk=chunk_runs[name]) if name in chunk_runs \
                else default_cfg
            runner.loss_kernel = kernel_runs.get(name, default_kernel)
            model.static_flex_attention_fn = attention_runs.get(name, default_attention)
            set_compiled_state(model, option_runs.get(name, runners["default"]))
            use_every_row(runner, row_runs.get(name, False))
            switched = set_precision(trainer, precision_runs.get(name, default_precision))
            if default_blas is not None:
                torch.backends.cuda.preferred_blas_library(blas_runs.get(name, default_blas))
            source = sync_runs.get(name, name.removesuffix("-no-lookahead") if name in one_at_a_time else name)
            if source.startswith("resident"):
                if switched or name in {**chunk_runs, **kernel_runs, **attention_runs, **option_runs,
                                        **row_runs, **precision_runs} and rnd == 0:
                    # compiles: not timed
                    run_steps(runner, iter(resident), 2, device)
                    print(f"{name}: {counters['stats']['unique_graphs']} graphs compiled so far", flush=True)
                batches, startup, dropped = iter(resident), 0.0, None
            else:
                dropped = drop_page_cache()
                batches = (b for _, b in sources[source].iterate(Position(0, 0)))
                t0 = time.perf_counter()
                run_steps(runner, batches, 2, device)  # the reader pool fills its prefetch window
                startup = time.perf_counter() - t0
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            profiler.maybe_report(force=True)  # a fresh window for this measurement
            steps = source_steps.get(source, args.steps)
            static_before = runner.shape_record.compiled_steps
            runner.shape_record.window_fields()  # padding counted from here
            with ClockSampler(device) as clocks:
                timing = timed_steps(runner, batches, steps, device, sync_every=k if name in sync_runs else 0,
                                     lookahead=name not in one_at_a_time, flop_log=flop_log)
            padding = runner.shape_record.window_fields()
            sec, tok = timing.seconds, timing.tokens
            report = profiler.maybe_report(force=True)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
            reserved = torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else 0.0
            static = runner.shape_record.compiled_steps - static_before
            peak_flops = profiler.peak_flops
            run = {"tok_s": tok / sec, "s_per_step": sec / steps, "steps": steps,
                   "mfu": timing.flops / sec / peak_flops if peak_flops else None, "padding": padding,
                   "tok_s_with_fill": timing.with_fill_tokens / timing.with_fill_seconds,
                   "s_per_step_with_fill": timing.with_fill_seconds / (steps + 1),
                   "peak_gib": peak, "peak_reserved_gib": reserved, "first_2_steps_s": startup,
                   "page_cache_dropped": dropped, "static_shape_steps": static, "profile": report,
                   "clocks": clocks.summary()}
            results["runs"].setdefault(name, []).append(run)
            print(f"round {rnd} {name}: {tok / sec:,.0f} tok/s ({run['tok_s_with_fill']:,.0f} with the pipeline "
                  f"fill); first 2 steps {startup:.1f}s; peak GPU {peak:.1f} GiB "
                  f"({reserved:.1f} reserved);"
                  f" page cache dropped: {dropped}; static-shape steps {static} of {steps + 1} (the lead-in one too); padding {padding}; MFU "
                  f"{run['mfu'] or 0:.1%}; {describe(run['clocks'])}", flush=True)
            print(report, flush=True)
    base_name = next(iter(results["runs"]))  # the resident batches, or the first cache
    base = [r["tok_s"] for r in results["runs"][base_name]]
    print(f"\n{results['device']}, {args.rounds} rounds, token budget {args.token_budget}; ratios against "
          f"{base_name}; MFU counts the real anchors' work (padding is not)")
    peak_flops = profiler.peak_flops
    print("tok/s and s/step in steady state (device time after a lead-in step); 'with fill': sync to sync, the "
          "lead-in step and its pipeline fill included")
    print(f"| source | steps | tok/s per round | s/step | MFU | anchor padding | ratio vs {base_name} (same round) | "
          "tok/s with fill | ratio with fill | peak GPU GiB (reserved) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, runs in results["runs"].items():
        rates = " / ".join(f"{r['tok_s']:,.0f}" for r in runs)
        steps = " / ".join(f"{r['s_per_step']:.3f}" for r in runs)
        run_flops = all_rows_flops if name in row_runs else flops  # each path's MFU counts its own work
        mfu = " / ".join(f"{(r['mfu'] if r['mfu'] else run_flops.total / r['s_per_step'] / peak_flops):.1%}"
                         if peak_flops else "-" for r in runs)
        pads = " / ".join(f"{r['padding'].get('anchor_padding', 0):.1%}" for r in runs)
        ratios = " / ".join(f"{r['tok_s'] / b:.3f}" for r, b in zip(runs, base, strict=True))
        fill_rates = " / ".join(f"{r['tok_s_with_fill']:,.0f}" for r in runs)
        fill_ratios = " / ".join(f"{r['tok_s_with_fill'] / b['tok_s_with_fill']:.3f}"
                                 for r, b in zip(runs, results["runs"][base_name], strict=True))
        print(f"| {name} | {runs[0]['steps']} | {rates} | {steps} | {mfu} | {pads} | {ratios} | {fill_rates} | {fill_ratios} | "
              f"{max(r['peak_gib'] for r in runs):.1f} "
              f"({max(r['peak_reserved_gib'] for r in runs):.1f}) |")
    if args.trace:
        if set_precision(trainer, default_precision):
            run_steps(runner, iter(resident), 2, device)  # compiles: not traced
        if args.trace_source == "resident":
            traced = resident[:args.trace]
        else:
            drop_page_cache()
            batches = (b for _, b in sources[args.trace_source].iterate(Position(0, 0)))
            run_steps(runner, batches, 2, device)  # the reader pool fills its prefetch window
            traced = batches
        results["trace"] = trace_steps(runner, itertools.islice(traced, args.trace), device)
        results["trace"]["source"] = args.trace_source
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def trace_steps(runner: StepRunner, batches, device) -> dict:
    """Kernel-level view of a few steps: where device time goes, which host calls wait for the
    device, and how busy the device is between the first and the last kernel."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    retries0 = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0
    steps = 0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        t0 = time.perf_counter()
        for batch in batches:
            runner.train_step(batch)
            steps += 1
        sync(device)
        wall_ms = (time.perf_counter() - t0) * 1e3
    events = prof.events()
    if events is None:  # not reached: the profiler has run
        raise RuntimeError("the profiler recorded no events")
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    idle_us, gaps = device_gaps(kernels)
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    span_us = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) if kernels else 0
    waits = {}
    for e in events:
        if any(w in e.name for w in ("Synchronize", "cudaFree", "cudaMalloc", "cudaHostAlloc", "cudaHostRegister",
                                     "EventSynchronize")):
            n, us = waits.get(e.name, (0, 0))
            waits[e.name] = (n + 1, us + e.cpu_time_total)
    stats = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
    out = {"steps": steps, "wall_ms": wall_ms, "device_busy_ms": busy_us / 1e3, "device_span_ms": span_us / 1e3,
           "busy_share": busy_us / max(span_us, 1), "idle_ms_per_step": idle_us / 1e3 / max(steps, 1),
           "largest_idle_gaps": gaps, "host_waits": {k: {"calls": n, "ms": us / 1e3}
                                                                   for k, (n, us) in waits.items()},
           "alloc_retries": stats.get("num_alloc_retries", 0) - retries0,
           "reserved_peak_gib": stats.get("reserved_bytes.all.peak", 0) / 2**30,
           "kernels": prof.key_averages().table(sort_by="self_device_time_total", row_limit=45),
           "host_ops": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25),
           "kernel_names": kernel_times(prof, steps),
           "matmuls": matmul_rates(prof, steps)}
    print(out["kernels"])
    print(out["host_ops"])
    print("| matrix product [M, K] x [K, N] | calls/step | ms/step | TFLOP/s |\n|---|---:|---:|---:|")
    for r in out["matmuls"]:
        print(f"| {r['shapes']} | {r['calls_per_step']:g} | {r['ms_per_step']:.1f} | {r['tflops']:.0f} |")
    print({k: v for k, v in out.items() if k not in ("kernels", "host_ops", "kernel_names", "matmuls",
                                                      "largest_idle_gaps")}, flush=True)
    print("| device idle ms | at ms | after | before |\n|---:|---:|---|---|")
    for g in gaps:
        print(f"| {g['ms']:.2f} | {g['at_ms']:.1f} | {g['after'][:70]} | {g['before'][:70]} |")
    return out


def device_gaps(kernels: list, top: int = 12) -> tuple[float, list[dict]]:
    """Microseconds no kernel or copy ran on the device (any stream) between the first and the last,
    and the `top` longest such gaps with the work on either side and their start from the first
    kernel (`at_ms`): what the device waited for, and whether in the first step's pipeline fill.
    The compiled graphs' own "## Call" ranges span their kernels and are left out."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in kernels if not e.name.startswith("## "))
    if not spans:
        return 0.0, []
    gaps, (first, end, last) = [], spans[0]
    for start, stop, name in spans[1:]:
        if start > end:
            gaps.append((start - end, end - first, last, name))
        if stop > end:
            end, last = stop, name
    gaps.sort(key=lambda g: -g[0])
    return sum(g[0] for g in gaps), [{"ms": us / 1e3, "at_ms": at / 1e3, "after": a, "before": b}
                                     for us, at, a, b in gaps[:top]]


def kernel_times(prof, steps: int) -> list[dict]:
    """Every device kernel by device time per step, with its whole name (the table cuts them): an
    inductor kernel's name lists the operations it fused, and the small ones add up."""
    rows = [{"name": e.key, "calls_per_step": e.count / steps, "ms_per_step": e.self_device_time_total / 1e3 / steps}
            for e in prof.key_averages() if e.self_device_time_total > 0 and e.device_type.name == "CUDA"]
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def matmul_rates(prof, steps: int) -> list[dict]:
    """Device time and FLOP rate of each matrix-product shape in the trace (aten::mm, which the
    compiled graphs call too), most device time first: which products run below the rest. The time
    is the op's self device time, its kernels alone: its total also holds the profiler's "Command
    Buffer Full" waits, which made some rows' rates look far lower than they are."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key != "aten::mm" or len(e.input_shapes) < 2 or not all(e.input_shapes[:2]):
            continue
        (m, k), (_, n) = e.input_shapes[0][:2], e.input_shapes[1][:2]
        us = e.self_device_time_total
        rows.append({"shapes": f"[{m}, {k}] x [{k}, {n}]", "calls_per_step": e.count / steps,
                     "ms_per_step": us / 1e3 / steps, "tflops": 2 * m * k * n * e.count / us / 1e6 if us else 0.0})
    return sorted(rows, key=lambda r: -r["ms_per_step"])


if __name__ == "__main__":
    main()
