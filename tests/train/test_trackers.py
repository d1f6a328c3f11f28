"""`train --report-to`: TensorBoard's event files and W&B's offline run hold the rows metrics.jsonl
holds (and the profiler's reports); a wrong tracker name is one line before anything runs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_cache.cli import cli
from dflash_cache.errors import UserError
from dflash_cache.train.trackers import parse_report_to, scalars


def _train(cache: Path, out: Path, *extra: str):
    args = ["train", "--cache", str(cache), "--target", "tiny", "--out", str(out), "--block-size", "8",
            "--draft-layers", "1", "--num-anchors", "8", "--token-budget", "1024", "--max-steps", "3",
            "--log-every", "1", "--device", "cpu", "--no-progress", "--no-compile", *extra]
    return CliRunner().invoke(cli, args)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_report_to_names_are_checked_in_one_line():
    assert parse_report_to("tensorboard, wandb,tensorboard") == ("tensorboard", "wandb")
    assert parse_report_to(None) == parse_report_to("none") == ()
    with pytest.raises(UserError, match=r"^--report-to tensorbord: unknown tracker 'tensorbord'; choose from "
                                        r"tensorboard, wandb \(comma-separated\), or none$"):
        parse_report_to("tensorbord")


def test_a_row_becomes_tagged_scalars():
    step, values = scalars({"step": 7, "loss": 2.5, "tau_hat": 1.25, "slot_acc": [0.5, None], "lr": 1e-3,
                            "skipped_steps": 1, "epoch": 0})
    assert step == 7 and values == {"train/loss": 2.5, "train/tau_hat": 1.25, "train/slot_acc/1": 0.5,
                                    "train/lr": 1e-3, "train/skipped_steps": 1.0, "train/epoch": 0.0}
    assert scalars({"step": 9, "split": "eval", "eval_loss": 3.0, "eval_tau_hat": None}) == (9, {"eval/loss": 3.0})


def test_tensorboard_event_files_hold_the_metrics_rows_and_the_profiler(demo_cache, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    r = _train(demo_cache, out, "--report-to", "tensorboard", "--profile-interval", "0.001")
    assert r.exit_code == 0, r.output
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    rows = _rows(out)
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (row["step"], pytest.approx(row["loss"], rel=1e-6)) for row in rows]
    assert [e.step for e in events.Scalars("train/tau_hat")] == [1, 2, 3]
    assert "profile/tok_s" in tags and any(t.endswith("_avg_ms") for t in tags), tags


def _wandb_history(path: Path) -> list[dict]:
    """The history rows of an offline W&B run file: a 7-byte header, then LevelDB-log style records
    (crc32 4, length 2 LE, type 1: full, first, middle, last) in 32 KiB blocks, each a protobuf Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, parts, rows = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0 and length == 0:
            break
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item} | {"_step": record.history.step.num})
    return rows


def test_wandb_offline_run_holds_the_last_row_and_a_resume_continues_it(demo_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    r = _train(demo_cache, out, "--report-to", "wandb")
    assert r.exit_code == 0, r.output
    run_id = (out / "wandb_run_id").read_text().strip()
    runs = list((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1, list((out / "wandb").iterdir())
    rows = _rows(out)
    # W&B's own service process writes the run file: on a loaded machine its last records may land a
    # moment after `finish` returned
    deadline = time.monotonic() + 30
    while len(history := _wandb_history(next(runs[0].glob("run-*.wandb")))) < len(rows) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [(h["_step"], h["train/loss"]) for h in history] == [(r["step"], pytest.approx(r["loss"])) for r in rows]

    r = _train(demo_cache, out, "--report-to", "wandb", "--resume", "--max-steps", "4")
    assert r.exit_code == 0, r.output
    assert (out / "wandb_run_id").read_text().strip() == run_id, "the resumed run reports to the same W&B run"


def test_a_refused_run_opens_no_tracker(demo_cache, tmp_path):
    """Trackers open once the run passed its checks: a run refused over existing checkpoints writes no
    tracker files (and would start no W&B run)."""
    out = tmp_path / "run"
    assert _train(demo_cache, out).exit_code == 0
    r = _train(demo_cache, out, "--report-to", "tensorboard")  # no --resume: refused
    assert r.exit_code == 2 and "already holds checkpoints" in r.output, r.output
    assert not (out / "tensorboard").exists()
