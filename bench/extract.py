"""Phase-1 benchmark: extraction throughput against the bare backbone forward, side by side.

Builds a target with random bf16 weights on one GPU: Qwen3-8B-shaped by default (36 layers,
hidden 4096, intermediate 12288, 32/8 heads), or with `--target qwen3.5-27b` a Qwen3.5-27B-shaped
hybrid (64 layers, three Gated DeltaNet linear-attention layers to each full-attention one, hidden
5120, intermediate 17408, 24/4 heads of 256, 16/48 linear heads of 128; run it with
flash-linear-attention installed, or its layers fall back to plain torch). Synthetic token rows
whose lengths follow a bucket mix are planned with the extraction planner. Then, in one process
and over the same batches, it times:

  * the bare backbone forward (no hooks, no copies, no writes) of the full 36-layer stack and of
    the stack cut after the last captured layer (what extraction runs);
  * full extraction to a local-disk cache for each codec (forward + pack + encode + D2H +
    compression + writes + commits, until the last segment is committed);
  * the cut forward again at the end, to show drift.

Reports tok/s, extract / cut-forward ratio, and bytes/token on disk. Run on a GPU machine:
    python3 -m bench.extract [--target qwen3-8b|qwen3.5-27b] [--tokens 400000] [--codecs none,bf16,fp8]
`--small` shrinks the model so the script itself can be checked on a CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import time
from pathlib import Path
from typing import cast

import numpy as np
import pyarrow as pa
import torch

from bench.common import add_common_args, start_logging_and_device
from dflash_cache.data.dataset import from_table
from dflash_cache.data.planning import make_plan
from dflash_cache.extract.pipeline import RankExtractor, layout_batch
from dflash_cache.profiler import StageProfiler
from dflash_cache.store.layout import COMMITS_DIR, SEGMENTS_DIR
from dflash_cache.store.plan import DEFAULT_BUCKETS, PlanConfig
from dflash_cache.target.capture import run_backbone
from dflash_cache.target.model import (
    HYBRID_KERNELS,
    decoder_of,
    has_linear_attention,
    select_layers,
    warn_if_slow_hybrid,
)

# Share of rows per bucket of DEFAULT_BUCKETS (last bucket capped at 8192 tokens).
BUCKET_MIX = (0.30, 0.20, 0.18, 0.14, 0.10, 0.08)
BUCKET_TOP = 8192


def qwen3_8b_config(small: bool):
    from transformers import Qwen3Config

    if small:
        return Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=12,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192)
    return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       # transformers 5 takes 4.x's rope_theta (into rope_parameters); its signature omits it
                       rope_theta=1_000_000, tie_word_embeddings=False)  # pyright: ignore[reportCallIssue]


def qwen3_5_27b_config(small: bool):
    """The text model of Qwen3.5-27B (its published text_config's sizes); the vision tower is never
    part of extraction."""
    from transformers import Qwen3_5TextConfig

    rope = {"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25}
    if small:
        return Qwen3_5TextConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=12,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                                 linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                                 max_position_embeddings=8192, rope_parameters=rope)
    return Qwen3_5TextConfig(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                             num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                             linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                             linear_conv_kernel_dim=4, max_position_embeddings=262144, rope_parameters=rope,
                             tie_word_embeddings=False)


TARGETS = {"qwen3-8b": qwen3_8b_config, "qwen3.5-27b": qwen3_5_27b_config}


def build_model(config, device: torch.device) -> torch.nn.Module:
    """Random weights, built directly on the device in bf16 (std 0.02; norms at 1)."""
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(prev)
    return model.eval().requires_grad_(False)


def synthetic_rows(total_tokens: int, vocab: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    bounds = [*DEFAULT_BUCKETS, BUCKET_TOP]
    ids, masks, n = [], [], 0
    while n < total_tokens:
        b = rng.choice(len(BUCKET_MIX), p=BUCKET_MIX)
        length = int(rng.integers(max(bounds[b], 16), bounds[b + 1]))
        ids.append(rng.integers(0, vocab, size=length, dtype=np.int32))
        prompt = int(rng.integers(1, length // 2))
        masks.append(np.r_[np.zeros(prompt, np.uint8), np.ones(length - prompt, np.uint8)])
        n += length
    return pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32())),
                     "loss_mask": pa.array(masks, type=pa.list_(pa.uint8()))})


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(decoder, host_batches, device) -> float:
    """Seconds for the bare forward over pre-built pinned batches (inputs H2D included); the same
    `run_backbone` call extraction makes, without hooks, copies or writes."""
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for h in host_batches:
            run_backbone(decoder, h.forward.input_ids.to(device, non_blocking=True),
                         h.forward.attention.to(device, non_blocking=True))
    sync(device)
    return time.perf_counter() - t0


def fresh_cache(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    (root / SEGMENTS_DIR).mkdir(parents=True)
    (root / COMMITS_DIR).mkdir()


def bytes_on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / SEGMENTS_DIR).rglob("*") if p.is_file())


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=400_000, help="tokens per timed pass")
    ap.add_argument("--codecs", default="none,bf16,fp8")
    ap.add_argument("--target", choices=sorted(TARGETS), default="qwen3-8b", help="the target's shape")
    add_common_args(ap, "/tmp/dflash-bench-cache")
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--prefetch", type=int, default=4)
    ap.add_argument("--profile-interval", type=float, default=15.0)
    ap.add_argument("--no-full-forward", action="store_true",
                    help="skip timing the uncut stack (the slowest pass; no ratio needs it but the full-forward one)")
    args = ap.parse_args()
    device = start_logging_and_device()
    config = TARGETS[args.target](args.small)
    layer_ids = select_layers(config.num_hidden_layers, 5)
    t0 = time.perf_counter()
    model = build_model(config, device)
    decoder = decoder_of(model)
    warn_if_slow_hybrid(config, device)
    print(f"model built in {time.perf_counter() - t0:.1f}s on {device}; layers {layer_ids}", flush=True)

    table = synthetic_rows(args.tokens, config.vocab_size)
    data = from_table(table, name="synthetic")
    scan = data.scan(vocab_size=config.vocab_size, max_len=None)
    plan = make_plan(scan.lengths, scan.keep, PlanConfig())
    batches = list(plan.batches)
    tokens = plan.num_tokens
    print(plan.summary(), flush=True)
    rows = {r.index: r for r in data.read_rows(0, data.num_rows, max_len=None)}
    pin = device.type == "cuda"
    host_batches = [layout_batch(b, [rows[int(i)] for i in b.rows], pin) for b in batches]

    # Warm-up: every batch shape once through the full and the cut stacks (kernels that autotune per
    # shape, as flash-linear-attention's do, would otherwise tune inside the first timed pass).
    full_layers = cast(torch.nn.ModuleList, decoder.layers)  # as decoder_of checked (nn.Module types it loosely)
    cut_layers = full_layers[: layer_ids[-1] + 1]
    one_per_shape = list({tuple(h.forward.input_ids.shape): h for h in host_batches}.values())
    for layers in (cut_layers,) if args.no_full_forward else (full_layers, cut_layers):
        decoder.layers = layers
        time_forward(decoder, one_per_shape, device)
    full_s = None
    if not args.no_full_forward:
        decoder.layers = full_layers
        full_s = time_forward(decoder, host_batches, device)
    decoder.layers = cut_layers
    cut_s = time_forward(decoder, host_batches, device)
    results = {"device": torch.cuda.get_device_name(device) if pin else "cpu", "target": args.target,
               "parameters": sum(p.numel() for p in model.parameters()), "tokens": tokens,
               "hybrid_kernels": {name: importlib.util.find_spec(name) is not None for name in HYBRID_KERNELS}
               if has_linear_attention(config) else None,
               "batches": len(batches), "forward_full_tok_s": tokens / full_s if full_s else None,
               "forward_cut_tok_s": tokens / cut_s,
               "codecs": {}}
    if full_s:
        print(f"bare forward, all {config.num_hidden_layers} layers: {tokens / full_s:10,.0f} tok/s", flush=True)
    print(f"bare forward, cut after layer {layer_ids[-1]}:   {tokens / cut_s:10,.0f} tok/s", flush=True)

    root = Path(args.out)
    for codec in args.codecs.split(","):
        profiler = StageProfiler(args.profile_interval, prefix=f"[{codec}] ")
        extractor = RankExtractor(
            root=root, dataset=data, model=model, layer_ids=layer_ids, codec=codec, device=device, rank=0,
            writers=args.writers, prefetch=args.prefetch, unit_rows=PlanConfig().unit_rows, max_len=None,
            overlong="truncate", profiler=profiler, progress=False,
        )
        fresh_cache(root)
        extractor.prepare(batches)  # pinned D2H buffers (start-up cost, logged)
        extractor.run(batches[:3])  # warm-up: codec kernels, writer threads
        fresh_cache(root)
        res = extractor.run(batches)
        extractor.capture.remove()
        size = bytes_on_disk(root)
        n_layers, hidden = len(layer_ids), config.hidden_size
        results["codecs"][codec] = {
            "tok_s": tokens / res.seconds, "ratio_vs_cut_forward": cut_s / res.seconds,
            "ratio_vs_full_forward": full_s / res.seconds if full_s else None,
            "seconds": res.seconds, "drain_seconds": res.drain_seconds,
            "bytes_per_token": size / tokens, "raw_bf16_bytes_per_token": 2 * n_layers * hidden,
        }
        print(f"extract {codec:>4}: {tokens / res.seconds:10,.0f} tok/s  ratio {cut_s / res.seconds:.3f}  "
              f"(run {res.seconds:.1f}s, of which {res.drain_seconds:.1f}s after the last batch was enqueued)  "
              f"{size / tokens:9,.0f} B/token ({2 * n_layers * hidden / (size / tokens):.2f}x vs raw bf16)", flush=True)
        if codec == args.codecs.split(",")[0]:
            from dflash_cache.store.segments import read_records
            assert len(read_records(root)) == len(batches)
        del extractor
        shutil.rmtree(root, ignore_errors=True)
    decoder.layers = cut_layers
    again = time_forward(decoder, host_batches, device)
    results["forward_cut_again_tok_s"] = tokens / again
    print(f"bare forward, cut, again:        {tokens / again:10,.0f} tok/s", flush=True)

    print("\n| pass | tok/s | ratio vs cut forward | ratio vs full forward | bytes/token |")
    print("|---|---:|---:|---:|---:|")
    if full_s:
        print(f"| bare forward, {config.num_hidden_layers} layers | {results['forward_full_tok_s']:,.0f} | | 1.000 | |")
    print(f"| bare forward, cut after layer {layer_ids[-1]} | {results['forward_cut_tok_s']:,.0f} | 1.000 | | |")
    for codec, r in results["codecs"].items():
        print(f"| extract `{codec}` | {r['tok_s']:,.0f} | {r['ratio_vs_cut_forward']:.3f} | "
              f"{_ratio(r['ratio_vs_full_forward'])} | {r['bytes_per_token']:,.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
