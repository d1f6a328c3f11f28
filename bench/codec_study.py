"""Codec study: drafters trained on the same data from caches of each codec (`none`, `bf16`, `fp8`, `fp4`).

For each codec: extract the demo data with the tiny target (same plan), measure bytes/token and
the features' relative error against the `none` cache, train a drafter with the same seed and
settings, and measure real acceptance with speculative decoding over the same prompts. Decoding is
lossless, so every codec emits the same tokens per prompt and tau / bf16's tau is the ratio of the
verify forwards they needed; its 95% interval comes from resampling the prompts (paired). That is
the decoding noise; retraining a drafter with another seed varies it too. Runs on a CPU (minutes);
pass --target/--data for a real target on a GPU.

    python3 -m bench.codec_study [--steps 200] [--prompts 8] [--out /tmp/dflash-codec-study]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import torch

from dflash_cache.extract.config import ExtractConfig
from dflash_cache.extract.run import extract
from dflash_cache.logs import setup_logging
from dflash_cache.store.plan import PlanConfig
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.report import summarize
from dflash_cache.target.model import TargetSpec, describe_target, load_target
from dflash_cache.train.drafter import FrozenTargetHead
from dflash_cache.train.export import drafter_from_export
from dflash_cache.train.run_config import TrainConfig
from dflash_cache.train.speculative import evaluate, load_prompts
from dflash_cache.train.trainer import Trainer


def relative_error(reader: CacheReader, reference: CacheReader) -> float:
    """||x_hat - x|| / ||x|| over every sample's features."""
    num = den = 0.0
    for sid in reference.index.column("sample_id").to_pylist():
        x = reference.sample(sid).features.float()
        num += float((reader.sample(sid).features.float() - x).pow(2).sum())
        den += float(x.pow(2).sum())
    return (num / den) ** 0.5


def paired_ratio_interval(base_steps: list[int], steps: list[int], resamples: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of tau / base tau = sum(base steps) / sum(steps) over resampled prompts
    (the same prompts for both: each emits the same tokens under every codec)."""
    rng = np.random.default_rng(0)
    b, s = np.asarray(base_steps, float), np.asarray(steps, float)
    pick = rng.integers(0, len(b), size=(resamples, len(b)))
    ratios = b[pick].sum(1) / s[pick].sum(1)
    return float(np.quantile(ratios, 0.025)), float(np.quantile(ratios, 0.975))


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--data", default="demo")
    ap.add_argument("--codecs", default="none,bf16,fp8,fp4")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", default="/tmp/dflash-codec-study")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    setup_logging(logging.WARNING)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    desc = describe_target(TargetSpec(model=args.target, dtype="float32"))
    target = load_target(desc, device, keep=desc.identity.num_hidden_layers)
    head = FrozenTargetHead.from_target(target)
    prompts = load_prompts(args.data, args.prompts)
    rows, reference = [], None
    for codec in args.codecs.split(","):
        cache = out / f"cache-{codec}"
        extract(ExtractConfig(target=TargetSpec(model=args.target), data=args.data, out=str(cache), codec=codec,
                              plan=PlanConfig(token_budget=4096, max_rows=16, unit_rows=64), progress=False),
                "cpu" if device.type == "cpu" else "0", echo=lambda *_: None)
        reader = CacheReader(cache)
        reference = reference or reader
        summary = summarize(reader)
        run = out / f"run-{codec}"
        cfg = TrainConfig(cache=str(cache), target=args.target, out=str(run), block_size=8, draft_layers=2,
                          num_anchors=16, token_budget=2048, lr=3e-3, max_steps=args.steps, log_every=25,
                          progress=False)
        last = Trainer.build(cfg, device=device).fit()
        dcfg, drafter = drafter_from_export(run / "export")
        r = evaluate(target, drafter.to(device=device, dtype=torch.float32), head, dcfg, prompts, args.max_new_tokens)
        accepted = torch.repeat_interleave(torch.tensor(list(r.histogram)), torch.tensor(list(r.histogram.values())))
        tau_se = float(accepted.double().std() / len(accepted) ** 0.5) if len(accepted) > 1 else float("nan")
        rows.append({"codec": codec, "bytes_per_token": summary["bytes_per_token"],
                     "relative_error": relative_error(reader, reference), "final_loss": last["loss"],
                     "slot_acc": last["slot_acc"][:3], "tau_hat": last["tau_hat"], "tau": r.tau,
                     "tau_se": tau_se, "verify_steps": len(accepted), "steps_per_prompt": r.steps_per_prompt,
                     "lossless": r.lossless})
        print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["codec"] == "bf16"), rows[0])
    print("\n| codec | bytes/token | rel. feature error | final loss | acc slots 1-3 | tau_hat | tau (+- s.e.) "
          "| tau / bf16's (95% interval) |")
    print("|---|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        acc = " / ".join(f"{a:.3f}" for a in r["slot_acc"])
        lo, hi = paired_ratio_interval(base["steps_per_prompt"], r["steps_per_prompt"])
        r["tau_ratio"], r["tau_ratio_interval"] = r["tau"] / base["tau"], [lo, hi]
        print(f"| `{r['codec']}` | {r['bytes_per_token']:,.0f} | {r['relative_error']:.4f} | {r['final_loss']:.3f} | "
              f"{acc} | {r['tau_hat']:.3f} | {r['tau']:.3f} +- {r['tau_se']:.3f} | {r['tau_ratio']:.3f} "
              f"({lo:.3f}-{hi:.3f}) |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
