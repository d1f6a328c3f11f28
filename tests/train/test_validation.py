"""Held-out evaluation during training (--eval-data): its rows, that training does not change, refusals."""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from dflash_cache.cli import cli
from dflash_cache.train.metrics_log import MetricsLog
from dflash_cache.train.run_config import LiveConfig, TrainConfig
from dflash_cache.train.step import StepRunner
from dflash_cache.train.trainer import Trainer
from tools.make_demo_drafter import demo_train_config

CPU = torch.device("cpu")
LINE = re.compile(r"^eval step (\d+): loss \d+\.\d+ tau_hat \d+\.\d+ over (\d+) batches \((\d+) tokens\)$")


def _rows(out: Path) -> list[dict]:
    """metrics.jsonl as strict JSON: a bare NaN or Infinity is an error."""
    def refuse(constant: str):
        raise ValueError(f"{constant} in metrics.jsonl")

    return [json.loads(line, parse_constant=refuse) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _split(out: Path) -> tuple[list[dict], list[dict]]:
    rows = _rows(out)
    return [r for r in rows if "split" not in r], [r for r in rows if r.get("split") == "eval"]


def _training(rows: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss"], r["slot_acc"], r["lr"], r["tokens_seen"]) for r in rows]


def _fit(demo_cache: Path, out: Path, **kw) -> dict:
    torch.manual_seed(0)  # the global RNG state a checkpoint holds: the same at the start of every run
    return Trainer.build(demo_train_config(demo_cache, out, **kw), device=CPU).fit()


@pytest.fixture(scope="module")
def straight(demo_cache, tmp_path_factory) -> Path:
    """4 steps without evaluating, a row each: the run every evaluating one must train exactly."""
    out = tmp_path_factory.mktemp("straight") / "run"
    _fit(demo_cache, out, max_steps=4, save_every=2)
    return out


def test_eval_rows_follow_their_steps_and_the_end(demo_cache, tmp_path, caplog):
    """--eval-every 2 over 5 steps: evaluations at steps 2 and 4 and at the end, each row right after
    that step's training row, finite, over the same --eval-batches batches, said in one line each."""
    with caplog.at_level(logging.INFO):
        _fit(demo_cache, tmp_path, max_steps=5, log_every=2, eval_data=str(demo_cache), eval_every=2, eval_batches=3)
    rows = _rows(tmp_path)
    assert [(r["step"], r.get("split")) for r in rows] == [(2, None), (2, "eval"), (4, None), (4, "eval"),
                                                           (5, None), (5, "eval")]
    evals = [r for r in rows if r.get("split") == "eval"]
    for r in evals:
        assert set(r) == {"step", "split", "eval_loss", "eval_tau_hat", "eval_slot_acc", "eval_batches",
                          "eval_tokens", "eval_seconds"}
        assert math.isfinite(r["eval_loss"]) and 0 < r["eval_loss"] < 20 and 1.0 <= r["eval_tau_hat"] < 8
        assert len(r["eval_slot_acc"]) == 7 and r["eval_batches"] == 3
    assert len({r["eval_tokens"] for r in evals}) == 1 and evals[0]["eval_tokens"] > 0, "the same batches each time"
    lines = [m for m in caplog.messages if m.startswith("eval step")]
    assert [LINE.match(m).groups() for m in lines] == [(str(r["step"]), "3", str(r["eval_tokens"])) for r in evals]
    assert any(m.startswith(f"evaluation: 3 held-out batches of {demo_cache} every 2 steps") for m in caplog.messages)


def test_training_is_bit_identical_with_and_without_evaluating(demo_cache, tmp_path, straight):
    """An evaluation after every step changes no training row, weight, optimizer moment or RNG state."""
    _fit(demo_cache, tmp_path, max_steps=4, save_every=2, eval_data=str(demo_cache), eval_every=1, eval_batches=2)
    trained, evals = _split(tmp_path)
    assert _training(trained) == _training(_split(straight)[0])
    assert [r["step"] for r in evals] == [1, 2, 3, 4]
    for name in ("drafter.safetensors", "optimizer.safetensors", "rng.safetensors"):
        ours, theirs = (load_file(run / "checkpoints" / "step_0000004" / name) for run in (tmp_path, straight))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), name


def test_an_evaluation_scores_the_same_blocks_and_leaves_the_trainer_as_it_was(demo_cache, tmp_path):
    """Two evaluations of the same weights agree exactly; the trainer's generators, the global RNG and
    the drafter's train mode are as they were."""
    trainer = Trainer.build(demo_train_config(demo_cache, tmp_path, eval_data=str(demo_cache), eval_batches=2),
                            device=CPU)
    generator, global_rng = trainer.rng.generator.get_state(), torch.get_rng_state()
    first, second = [trainer.validation.run(trainer.runner, trainer.step) for _ in range(2)]
    assert first.row() | {"eval_seconds": 0} == second.row() | {"eval_seconds": 0}
    assert first.batches == 2 and first.loss is not None
    assert torch.equal(trainer.rng.generator.get_state(), generator) and torch.equal(torch.get_rng_state(), global_rng)
    assert trainer.model.training and trainer.step == 0


def test_eval_every_defaults_to_save_every(demo_cache, tmp_path):
    _fit(demo_cache, tmp_path, max_steps=4, log_every=4, save_every=2, eval_data=str(demo_cache), eval_batches=1)
    assert [r["step"] for r in _split(tmp_path)[1]] == [2, 4], "at the checkpoints; the last step's is the end's"


def test_resume_redoes_the_evaluations_after_the_checkpoint_once(demo_cache, tmp_path, monkeypatch, straight):
    """A crash at step 4 leaves evaluation rows past the step-2 checkpoint; the resume rewinds them
    with the training rows, and trains what an uninterrupted run trains."""
    real_step = StepRunner.train_step
    calls = {"n": 0}

    def crashing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("simulated crash")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(StepRunner, "train_step", crashing)
    kw = dict(max_steps=4, save_every=2, eval_data=str(demo_cache), eval_every=1, eval_batches=1)
    with pytest.raises(RuntimeError):
        _fit(demo_cache, tmp_path, **kw)
    assert [(r["step"], r.get("split")) for r in _rows(tmp_path)][-2:] == [(3, None), (3, "eval")]
    monkeypatch.setattr(StepRunner, "train_step", real_step)
    _fit(demo_cache, tmp_path, resume=True, **kw)
    trained, evals = _split(tmp_path)
    assert _training(trained) == _training(_split(straight)[0])
    assert [r["step"] for r in evals] == [1, 2, 3, 4]


def test_eval_data_given_on_resume_is_said_and_used(demo_cache, tmp_path, caplog, straight):
    """A run that never evaluated (a copy of `straight`) resumed with --eval-data evaluates at its end."""
    shutil.copytree(straight, tmp_path, dirs_exist_ok=True)
    with caplog.at_level(logging.INFO):
        _fit(demo_cache, tmp_path, max_steps=5, save_every=2, resume=True, eval_data=str(demo_cache), eval_batches=1)
    assert any(m.startswith("evaluation: 1 held-out batches of ") and str(demo_cache) in m for m in caplog.messages)
    assert [(r["step"], r.get("split")) for r in _rows(tmp_path)] == [(1, None), (2, None), (3, None), (4, None),
                                                                    (5, None), (5, "eval")]


def test_a_live_run_evaluates_a_dataset_through_its_target(tmp_path):
    cfg = TrainConfig(target="tiny", out=str(tmp_path), live=LiveConfig(data="demo", limit=40, queue_depth=2),
                      block_size=8, draft_layers=1, num_anchors=8, token_budget=1024, max_steps=2, progress=False,
                      eval_data="demo", eval_batches=2)
    Trainer.build(cfg, device=CPU).fit()
    (row,) = _split(tmp_path)[1]
    assert row["step"] == 2 and row["eval_batches"] == 2 and math.isfinite(row["eval_loss"])


def _train_cli(demo_cache: Path, out: Path, *args: str):
    return CliRunner().invoke(cli, ["train", "--cache", str(demo_cache), "--target", "tiny", "--out", str(out),
                                    "--max-steps", "1", "--device", "cpu", "--no-progress", *args])


def _error_line(result) -> str:
    """The CLI's one line for a UserError (log lines may come before it)."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.output
    (line,) = [m for m in result.output.splitlines() if m.startswith("Error:")]
    return line


@pytest.mark.parametrize("held_out", ["demo", "a directory"])
def test_a_dataset_with_cache_is_refused_in_one_line(demo_cache, tmp_path, held_out):
    data = "demo" if held_out == "demo" else str(tmp_path / "rows")
    (tmp_path / "rows").mkdir()
    line = _error_line(_train_cli(demo_cache, tmp_path / "run", "--eval-data", data))
    assert f"--eval-data {data} is a dataset" in line and "dflash-cache extract" in line and "--live" in line, line


def test_a_held_out_cache_of_another_target_is_refused_naming_both(demo_cache, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(demo_cache, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["target"] |= {"name": "other-model", "config_hash": "0123456789abcdef"}
    (other / "manifest.json").write_text(json.dumps(manifest))
    line = _error_line(_train_cli(demo_cache, tmp_path / "run", "--eval-data", str(other)))
    assert "--eval-data" in line and "target.config_hash" in line, line
    assert "other-model" in line and "--target tiny" in line, line


def test_eval_every_without_eval_data_is_refused(demo_cache, tmp_path):
    line = _error_line(_train_cli(demo_cache, tmp_path / "run", "--eval-every", "5"))
    assert "--eval-every" in line and "--eval-data" in line, line


def test_an_evaluation_row_follows_the_queued_training_row_and_its_time_is_left_out(tmp_path):
    """MetricsLog.add: written after the training row still queued (or at once when none is), never
    `last`; leave_out: seconds of the window not counted in its rate."""
    now = {"t": 0.0}
    log = MetricsLog(tmp_path / "metrics.jsonl", CPU, slots=1, clock=lambda: now["t"])
    log.start()
    now["t"] = 4.0
    log.leave_out(3.0)  # of the 4 s, 3 went to an evaluation
    log.queue([{"loss": torch.tensor(1.0), "acc": torch.tensor([0.5])}], tokens=100, stop_requested=False,
              row={"step": 1, "epoch": 0, "lr": 1e-3, "tokens_seen": 100})
    log.add({"step": 1, "split": "eval"}, "eval step 1: ...")
    assert not (tmp_path / "metrics.jsonl").exists(), "the evaluation waits for the training row"
    log.write()
    log.add({"step": 2, "split": "eval"})
    rows = _rows(tmp_path)
    assert [(r["step"], r.get("split")) for r in rows] == [(1, None), (1, "eval"), (2, "eval")]
    assert rows[0]["tokens_per_s"] == pytest.approx(100.0) and log.last["step"] == 1 and "split" not in log.last
    other = MetricsLog(tmp_path / "other.jsonl", CPU, slots=1, rank=1)
    other.add({"step": 1, "split": "eval"})
    assert not (tmp_path / "other.jsonl").exists(), "rank 0 writes the rows"
