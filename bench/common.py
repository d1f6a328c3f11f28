"""Pieces the GPU benchmarks share: their common options and set-up, a Qwen3-shaped drafter config
and the manifest of a synthetic cache."""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch

from dflash_cache.logs import setup_logging
from dflash_cache.store.codecs import get_codec
from dflash_cache.store.manifest import Manifest, PlanParams, TargetIdentity, write_manifest
from dflash_cache.store.reader import write_index
from dflash_cache.store.segments import read_records
from dflash_cache.train.config import DrafterConfig


def add_common_args(ap: argparse.ArgumentParser, out: str) -> None:
    """--out, --small and --json, which every benchmark takes."""
    ap.add_argument("--out", default=out, help="scratch directory (replaced)")
    ap.add_argument("--small", action="store_true", help="small shapes, to check the script on a CPU")
    ap.add_argument("--json", default=None, help="also write the results here")


def start_logging_and_device() -> torch.device:
    """Timestamped INFO logging, and the GPU when there is one."""
    setup_logging()
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bench_drafter_config(*, hidden: int, inter: int, heads: int, kv: int, head_dim: int, vocab: int, layers: int,
                         block: int, layer_ids: tuple[int, ...]) -> DrafterConfig:
    """All-full-attention drafter of a 36-layer Qwen3-like target (rope theta 1e6, mask id vocab - 1)."""
    return DrafterConfig(
        hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
        vocab_size=vocab, block_size=block, mask_token_id=vocab - 1, target_layer_ids=tuple(layer_ids),
        layer_types=("full_attention",) * layers, target_num_hidden_layers=36)


def commit_synthetic_manifest(root: Path, *, codec: str, layer_ids: tuple[int, ...], hidden: int, vocab: int,
                              plan: PlanParams) -> None:
    """Manifest and index for a cache whose segments a benchmark wrote itself (synthetic target)."""
    target = TargetIdentity(name="synthetic", model_type="qwen3", config_hash="synthetic", dtype="bfloat16",
                            num_hidden_layers=36, hidden_size=hidden, vocab_size=vocab)
    write_manifest(root, Manifest(target=target, layer_ids=tuple(layer_ids), hidden_size=hidden, codec=codec,
                                  codec_layout=get_codec(codec).layout, dataset_fingerprint="synthetic", dataset_description="synthetic", plan=plan))
    write_index(root, read_records(root))


def timed(fn, device: torch.device, reps: int, during: contextlib.AbstractContextManager | None = None) -> float:
    """Mean seconds per call after two warm-up calls (compiles); `during` (e.g. a
    `gpu_clocks.ClockSampler`) is entered for the timed calls only."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with during or contextlib.nullcontext():
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / reps
