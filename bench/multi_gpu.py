"""Multi-GPU benchmark (several GPUs of one host), run through the CLI exactly as a user would.

Each stage can run on its own (`--stage extract|train|live|tp`, reusing --out and --json), a few
minutes each; `train` and `live` need the cache `extract` made.

1. `extract --gpus 0` against `extract --gpus all` (N launched ranks) on the same data:
   throughput of the extraction itself (each rank logs its tokens and seconds, model loading
   excluded; the N-GPU rate is all tokens over the slowest rank's time), the two caches' sample
   sets compared, both verified. Goal: >= 0.95 x N.
2. `train` from the N-GPU cache in one process against `torchrun --nproc-per-node N` (DDP): the
   last logged window's tokens/s (all ranks), after the compile-bearing first window. Goal >= 0.9 x N.
3. `train --live` with the target on GPUs 0..N-2 and the drafter on GPU N-1, against offline
   (the N-GPU extraction's time plus epochs x tokens at the torchrun training rate), with its
   wall time to the last step (start-up and compilation included).
4. `extract --gpus-per-target N`: one copy of the target split over the N GPUs (tensor
   parallelism), against one GPU on the same data; sample set compared, cache verified.

A Qwen3-8B-shaped target with random bf16 weights is saved to --out first (not timed), with
synthetic rows over the default length buckets. `--small` uses a small Qwen3 and 2 CPU processes
(gloo) everywhere, so the script can be checked on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from bench.common import add_common_args
from bench.extract import build_model, qwen3_8b_config, synthetic_rows
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.report import verify

RANK_LINE = re.compile(r"rank (\d+): \d+ segments, (\d+) tokens in ([\d.]+)s")
CLI = [sys.executable, "-m", "dflash_cache.cli"]
STAGES = ("extract", "train", "live", "tp")


def run(cmd: list[str], log: Path) -> str:
    """Run a command, keeping its whole output in `log`; a failure stops the benchmark with its tail."""
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}) after {time.perf_counter() - t0:.0f}s:\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout + done.stderr


def torchrun(n: int) -> list[str]:
    port = 29500 + os.getpid() % 1000
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port", str(port),
            "-m", "dflash_cache.cli"]


def extraction_rate(output: str) -> tuple[float, int]:
    """(tokens/s over the slowest rank's extraction time, ranks seen) from the ranks' log lines."""
    ranks = {int(r): (int(t), float(s)) for r, t, s in RANK_LINE.findall(output)}
    if not ranks:
        sys.exit("no 'rank N: ... tokens in Xs' lines in the extraction output")
    return sum(t for t, _ in ranks.values()) / max(s for _, s in ranks.values()), len(ranks)


def windows(run_dir: Path) -> dict[str, float]:
    """Tokens/s of each logged window ('steps 4-6': ...), from the run's metrics.jsonl: a window
    holding a stall (a rank compiling a new shape, say) shows against the steady ones."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out, first = {}, 1
    for row in rows:
        if row.get("tokens_per_s") is not None:  # null: a run's first step alone, start-up in it
            out[f"steps {first}-{row['step']}"] = round(float(row["tokens_per_s"]))
        first = row["step"] + 1
    return out


def last_rate(run_dir: Path) -> float:
    return float(list(windows(run_dir).values())[-1])


def prepare(out: Path, small: bool, tokens: int) -> tuple[Path, Path]:
    """The random-weight target and the synthetic rows, written once per --out (not timed)."""
    config = qwen3_8b_config(small)
    model_dir, data = out / "model", out / "data.parquet"
    if not (model_dir / "config.json").is_file():
        model = build_model(config, torch.device("cpu" if small else "cuda"))
        model.save_pretrained(model_dir)  # pyright: ignore[reportCallIssue] (an HF model's: nn.Module types the attributes it does not declare as Tensor | Module)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # this process's cached blocks would sit on GPU 0 under the ranks
    if not data.is_file():
        pq.write_table(synthetic_rows(tokens, config.vocab_size), data)
    return model_dir, data


def extract_args(model_dir: Path, data: Path, small: bool) -> list[str]:
    common = ["extract", "--model", str(model_dir), "--data", str(data), "--codec", "fp8", "--no-progress"]
    return common + (["--token-budget", "8192", "--max-rows", "8"] if small else [])


def one_device_extraction(out: Path, model_dir: Path, data: Path, small: bool) -> float:
    """`extract --gpus 0` (a CPU with --small) into out/cache-1: its tokens/s."""
    device = ["--gpus", "cpu" if small else "0"]
    shutil.rmtree(out / "cache-1", ignore_errors=True)
    output = run(CLI + extract_args(model_dir, data, small) + ["--out", str(out / "cache-1"), *device],
                 out / "extract-1.log")
    return extraction_rate(output)[0]


def extract_stage(out: Path, model_dir: Path, data: Path, n: int, small: bool) -> dict:
    """`extract --gpus 0` against `extract --gpus all` on the same data, both caches checked."""
    rate_1 = one_device_extraction(out, model_dir, data, small)
    cmd = extract_args(model_dir, data, small) + ["--out", str(out / "cache-n")]
    many = run(torchrun(n) + cmd if small else CLI + cmd + ["--gpus", "all"], out / "extract-n.log")
    rate_n, ranks = extraction_rate(many)
    readers = [CacheReader(out / "cache-1"), CacheReader(out / "cache-n")]
    same = [sorted(r.index.column("sample_id").to_pylist()) for r in readers]
    problems = [verify(r) for r in readers]
    return {"one_tok_s": rate_1, "all_tok_s": rate_n, "ranks": ranks, "scaling": rate_n / rate_1 / n,
            "same_samples": same[0] == same[1], "verify_problems": sum(len(p) for p in problems),
            "tokens": readers[1].num_tokens, "complete": all(r.complete for r in readers)}


def tp_stage(out: Path, model_dir: Path, data: Path, n: int, small: bool, one_tok_s: float | None) -> dict:
    """`extract --gpus-per-target N`: one copy of the target split over the N GPUs (tensor
    parallelism; every rank runs every batch, rank 0 writes), against one GPU on the same data
    (the extract stage's rate when it ran, else measured here). The cache is checked against the
    one-GPU cache's sample set and verified."""
    if one_tok_s is None or not (out / "cache-1" / "index.parquet").is_file():
        one_tok_s = one_device_extraction(out, model_dir, data, small)
    shutil.rmtree(out / "cache-tp", ignore_errors=True)
    cmd = extract_args(model_dir, data, small) + ["--out", str(out / "cache-tp"), "--gpus-per-target", str(n)]
    output = run(torchrun(n) + cmd if small else CLI + cmd + ["--gpus", "all"], out / "extract-tp.log")
    ranks = {int(r): (int(t), float(sec)) for r, t, sec in RANK_LINE.findall(output)}
    if 0 not in ranks:
        sys.exit("no 'rank 0: ... tokens in Xs' line in the tensor-parallel extraction output")
    # Every rank runs every batch: the copy's rate is rank 0's tokens over the slowest rank's time.
    rate = ranks[0][0] / max(sec for _, sec in ranks.values())
    readers = [CacheReader(out / "cache-1"), CacheReader(out / "cache-tp")]
    same = [sorted(r.index.column("sample_id").to_pylist()) for r in readers]
    return {"one_tok_s": one_tok_s, "tp_tok_s": rate, "gpus_per_target": n, "speedup": rate / one_tok_s,
            "per_gpu": rate / one_tok_s / n, "same_samples": same[0] == same[1],
            "verify_problems": len(verify(readers[1])), "complete": readers[1].complete}


def train_args(small: bool, steps: int, log_every: int | None = None) -> list[str]:
    args = ["--max-steps", str(steps), "--log-every", str(log_every or max(1, steps // 3)), "--no-progress"]
    if small:
        args += ["--device", "cpu", "--block-size", "8", "--draft-layers", "1", "--num-anchors", "16",
                 "--token-budget", "2048"]
    return args


def train_stage(out: Path, model_dir: Path, n: int, small: bool, steps: int, log_every: int | None = None) -> dict:
    """Training from the N-GPU cache in one process against torchrun with N processes (DDP)."""
    if not (out / "cache-n" / "index.parquet").is_file():
        sys.exit(f"no cache at {out / 'cache-n'}: run --stage extract first (same --out)")
    train = ["train", "--cache", str(out / "cache-n"), "--target", str(model_dir), *train_args(small, steps, log_every)]
    for name in ("train-1", "train-n"):
        shutil.rmtree(out / name, ignore_errors=True)
    run(CLI + train + ["--out", str(out / "train-1")], out / "train-1.log")
    run(torchrun(n) + train + ["--out", str(out / "train-n")], out / "train-n.log")
    train_1, train_n = last_rate(out / "train-1"), last_rate(out / "train-n")
    return {"one_tok_s": train_1, "all_tok_s": train_n, "scaling": train_n / train_1 / n,
            "windows_tok_s": {"one_gpu": windows(out / "train-1"), "ddp": windows(out / "train-n")}}


def live_stage(out: Path, model_dir: Path, data: Path, n: int, small: bool, steps: int) -> dict:
    """`train --live` with the target on GPUs 0..N-2 and the drafter on GPU N-1."""
    shutil.rmtree(out / "live", ignore_errors=True)
    live = ["train", "--live", "--target", str(model_dir), "--data", str(data), "--out", str(out / "live"),
            *train_args(small, steps), "--queue-depth", "16"]
    if small:
        live += ["--target-gpus", "cpu"]
    else:
        live += ["--target-gpus", ",".join(str(i) for i in range(n - 1)), "--device", f"cuda:{n - 1}"]
    t0 = time.perf_counter()
    run(CLI + live, out / "live.log")
    return {"tok_s": last_rate(out / "live"), "wall_s": time.perf_counter() - t0, "steps": steps}


def report(results: dict) -> None:
    n = results["gpus"]
    print(f"\n{results['device']} x {n}")
    print("| step | 1 GPU tok/s | N GPUs tok/s | scaling (N GPUs / (N x 1 GPU)) |\n|---|---:|---:|---:|")
    for key, name in (("extract", "extract fp8"), ("train", "train from the cache")):
        if key in results:
            r = results[key]
            print(f"| {name} | {r['one_tok_s']:,.0f} | {r['all_tok_s']:,.0f} | {r['scaling']:.3f} |")
    if "extract" in results:
        e = results["extract"]
        print(f"extract: {e['tokens']:,} tokens, same sample set {e['same_samples']}, complete {e['complete']}, "
              f"verify problems {e['verify_problems']}")
    if "tp" in results:
        tp = results["tp"]
        print(f"extract --gpus-per-target {tp['gpus_per_target']} (one target over {n} GPUs): {tp['tp_tok_s']:,.0f} tok/s "
              f"against {tp['one_tok_s']:,.0f} on one GPU: {tp['speedup']:.2f}x, {tp['per_gpu']:.2f} per GPU; same sample "
              f"set {tp['same_samples']}, complete {tp['complete']}, verify problems {tp['verify_problems']}")
    if "live" in results:
        live = results["live"]
        print(f"live ({n - 1} target GPUs, 1 drafter GPU): {live['tok_s']:,.0f} tok/s, "
              f"{live['steps']} steps in {live['wall_s']:.0f}s")
        if "extract" in results and "train" in results:
            tokens = results["extract"]["tokens"]
            t_extract = tokens / results["extract"]["all_tok_s"]
            for ep in (1, 3):
                print(f"  {ep} epoch(s): live {ep * tokens / live['tok_s']:.1f}s, offline (extract on {n} + "
                      f"train on {n}) {t_extract + ep * tokens / results['train']['all_tok_s']:.1f}s")


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=800_000)
    ap.add_argument("--steps", type=int, default=30, help="training steps per run (logged in 3 windows)")
    ap.add_argument("--log-every", type=int, default=None, help="train stage: steps per logged window (default: a third)")
    ap.add_argument("--stage", choices=["all", *STAGES], default="all",
                    help="run one stage (later stages reuse --out and --json)")
    add_common_args(ap, "/tmp/dflash-bench-multi")
    args = ap.parse_args()
    out = Path(args.out)
    if args.stage in ("all", "extract"):
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    n = 2 if args.small else torch.cuda.device_count()
    if n < 2:
        sys.exit("needs at least 2 CUDA GPUs (or --small for a CPU check)")
    json_path = Path(args.json) if args.json else None
    results = json.loads(json_path.read_text()) if json_path and json_path.is_file() and args.stage != "all" else {}
    results.update(gpus=n, device="cpu" if args.small else torch.cuda.get_device_name(0))
    model_dir, data = prepare(out, args.small, args.tokens)
    stages = STAGES if args.stage == "all" else (args.stage,)
    needs_cache = {"train", "live"} & set(stages) and not (out / "cache-n" / "index.parquet").is_file()
    if "extract" in stages or needs_cache:
        results["extract"] = extract_stage(out, model_dir, data, n, args.small)
    if "train" in stages:
        results["train"] = train_stage(out, model_dir, n, args.small, args.steps, args.log_every)
    if "live" in stages:
        results["live"] = live_stage(out, model_dir, data, n, args.small, args.steps)
    if "tp" in stages:
        results["tp"] = tp_stage(out, model_dir, data, n, args.small, results.get("extract", {}).get("one_tok_s"))
    report(results)
    if json_path:
        json_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
