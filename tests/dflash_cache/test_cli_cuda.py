"""The whole job through the CLI on a GPU, as a new user runs it: default options, a target of a
1.7B-parameter model's shape (random weights) and rows of 100-2,100 tokens (lengths spanning 21x,
so batches differ in anchors and context): extract -> inspect --verify -> train (compiled, Ctrl-C,
--resume) -> eval, and train --live the same. Skipped without a CUDA device; `just test-gpu-cli`
runs both parts, each within one 10-minute GPU call (`-k offline`, `-k live`; `-k cache`
would pick both: the module path holds the word).

On 2026-12-04, before static shapes by bucket, `train` and `train --live` died in the compiled
backward on a later step of exactly this job (`shape '[10161, 128]' is invalid`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import REPO

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROWS, SHORTEST, LONGEST = 300, 100, 2100
STEPS, STOP_AFTER = 50, 10  # >= 50 steps in all; Ctrl-C once 10 are logged


def qwen3_1_7b_shaped(path: Path) -> Path:
    """A random-weight bf16 target with Qwen3-1.7B's sizes (hidden 2048, 28 layers, tied embedding)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                         rope_theta=1_000_000, tie_word_embeddings=True, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) > 1.5e9
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def mixed_rows(path: Path, vocab: int = 151936) -> Path:
    rng = np.random.default_rng(0)
    lengths = rng.integers(SHORTEST, LONGEST + 1, size=ROWS)
    ids = [rng.integers(0, vocab - 1, size=n, dtype=np.int32) for n in lengths]
    masks = [np.r_[np.zeros(n // 10, np.uint8), np.ones(n - n // 10, np.uint8)] for n in lengths]
    pq.write_table(pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32())),
                             "loss_mask": pa.array(masks, type=pa.list_(pa.uint8()))}), path)
    return path


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_cache.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=os.environ.copy())


def rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def interrupted_then_resumed(args: list[str], run: Path) -> tuple[str, str]:
    """`dflash-cache train ARGS` stopped by Ctrl-C once STOP_AFTER steps are logged, then resumed to
    STEPS: (the interrupted run's log, the resumed run's log)."""
    log = run.parent / f"{run.name}-interrupted.log"  # what the run printed, also while it runs
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "dflash_cache.cli", "train", *args, "--out", str(run),
                                 "--max-steps", str(STEPS)], cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if rows(run) and rows(run)[-1]["step"] >= STOP_AFTER:
            break
        time.sleep(0.2)
    assert proc.poll() is None, f"the run ended before Ctrl-C:\n{log.read_text()[-4000:]}"
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    first_log = log.read_text()
    assert proc.returncode == 130, first_log[-4000:]
    assert "with a checkpoint" in first_log and (run / "checkpoints").is_dir(), first_log[-4000:]
    stopped_at = rows(run)[-1]["step"]
    resumed = cli("train", *args, "--out", str(run), "--max-steps", str(STEPS), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    steps = [r["step"] for r in rows(run)]
    assert steps == list(range(10, STEPS + 1, 10)) and stopped_at < STEPS, steps
    return first_log, resumed.stderr


def check_run(run: Path, resumed_log: str) -> None:
    """Every step ran a static shape, compiled; the loss stayed finite; the export is there."""
    metrics = rows(run)
    assert all(np.isfinite(r["loss"]) for r in metrics), metrics
    assert all(r["eager_steps"] == 0 and 0 <= r["anchor_padding"] < 0.5 for r in metrics), metrics
    assert "0 eager" in resumed_log and "static shapes" in resumed_log, resumed_log[-4000:]
    assert (run / "export" / "model.safetensors").is_file() and (run / "export" / "config.json").is_file()


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the target, the rows, a scratch directory), made once for this module's tests."""
    root = tmp_path_factory.mktemp("job")
    return qwen3_1_7b_shaped(root / "target"), mixed_rows(root / "data.parquet"), root


def test_offline_extract_verify_train_resume_eval_with_default_options(job):
    """Part 1 (`just test-gpu-cli -k offline`): about 6 minutes on an H200, compiling included."""
    target, data, root = job
    cache, run = root / "cache", root / "run"
    t0 = time.perf_counter()
    done = cli("extract", "--model", str(target), "--data", str(data), "--out", str(cache), "--gpus", "all")
    assert done.returncode == 0, done.stderr[-4000:]
    verified = cli("inspect", str(cache), "--verify")
    assert verified.returncode == 0 and "OK" in verified.stdout, verified.stdout + verified.stderr
    print(f"extract + verify: {time.perf_counter() - t0:.0f}s", flush=True)

    t0 = time.perf_counter()
    first_log, resumed_log = interrupted_then_resumed(["--cache", str(cache), "--target", str(target)], run)
    check_run(run, resumed_log)
    startup = [line for line in (first_log + resumed_log).splitlines() if "start-up:" in line]
    print(f"train from the cache: {time.perf_counter() - t0:.0f}s; {startup}", flush=True)
    evaluated = cli("eval", "--target", str(target), "--drafter", str(run), "--data", str(data), "--limit", "2",
                    "--max-new-tokens", "32")
    assert evaluated.returncode == 0 and "tau" in evaluated.stdout, evaluated.stdout + evaluated.stderr


def test_train_live_resume_with_default_options(job):
    """Part 2 (`just test-gpu-cli -k live`): the target beside the drafter, no cache."""
    target, data, root = job
    live = root / "live"
    t0 = time.perf_counter()
    _, live_log = interrupted_then_resumed(["--live", "--data", str(data), "--target", str(target)], live)
    check_run(live, live_log)
    print(f"train --live: {time.perf_counter() - t0:.0f}s", flush=True)
