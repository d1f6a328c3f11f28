"""Checkpoints: a resume must match the run, unreadable checkpoints fall back, only the newest k stay."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dflash_cache.cli import cli
from dflash_cache.train.checkpoint import STATE_VERSION, TrainerState, UnreadableCheckpoint, list_checkpoints
from dflash_cache.train.trainer import Trainer
from tests.train.conftest import demo_train_config

CPU = torch.device("cpu")


def _run(cache: Path, out: Path, **kw) -> dict:
    return Trainer.build(demo_train_config(cache, out, **kw), device=CPU).fit()


def _steps(out: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in list_checkpoints(out / "checkpoints")]


@pytest.fixture(scope="module")
def two_step_run(demo_cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two") / "run"
    _run(demo_cache, out, max_steps=2)
    return out


def _cli_train(cache: Path, out: Path, *extra: str):
    args = ["train", "--cache", str(cache), "--target", "tiny", "--out", str(out), "--block-size", "8",
            "--draft-layers", "2", "--num-anchors", "16", "--token-budget", "2048", "--max-steps", "3",
            "--device", "cpu", "--no-progress", "--resume", *extra]
    return CliRunner().invoke(cli, args)


@pytest.mark.parametrize(("flag", "value", "named"), [
    ("--token-budget", "1024", "--token-budget"),
    ("--seed", "1", "--seed"),
    ("--draft-layers", "3", "--draft-layers"),
    ("--block-size", "4", "--block-size"),
    ("--num-anchors", "8", "--num-anchors"),
    ("--sliding-window", "64", "--sliding-window"),
])
def test_resume_with_a_changed_option_is_refused_naming_it(demo_cache, two_step_run, tmp_path, flag, value, named):
    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    r = CliRunner().invoke(cli, ["train", "--cache", str(demo_cache), "--target", "tiny", "--out", str(out),
                                 *_drop(_base_args(), flag), flag, value, "--resume"])
    assert r.exit_code == 2, r.output
    assert named in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert _steps(out) == [2], "nothing was trained"


def _base_args() -> list[str]:
    return ["--block-size", "8", "--draft-layers", "2", "--num-anchors", "16", "--token-budget", "2048",
            "--max-steps", "3", "--device", "cpu", "--no-progress"]


def _drop(args: list[str], flag: str) -> list[str]:
    if flag not in args:
        return args
    i = args.index(flag)
    return args[:i] + args[i + 2:]


def test_resume_against_another_cache_is_refused(demo_cache, two_step_run, tmp_path):
    other = tmp_path / "cache"
    shutil.copytree(demo_cache, other)
    first = sorted((other / "commits").iterdir())[0]
    first.unlink()  # the other cache lacks one segment: other samples, so another plan
    (other / "index.parquet").unlink()
    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    r = CliRunner().invoke(cli, ["train", "--cache", str(other), "--target", "tiny", "--out", str(out),
                                 *_base_args(), "--resume", "--allow-incomplete"])
    assert r.exit_code == 2 and "--cache/--data" in r.output, r.output


def test_an_incomplete_cache_needs_allow_incomplete(demo_cache, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(demo_cache, cache)
    sorted((cache / "commits").iterdir())[-1].unlink()
    r = CliRunner().invoke(cli, ["train", "--cache", str(cache), "--target", "tiny", "--out", str(tmp_path / "a"),
                                 *_base_args()])
    assert r.exit_code == 2 and "incomplete" in r.output and "--allow-incomplete" in r.output, r.output
    r = CliRunner().invoke(cli, ["train", "--cache", str(cache), "--target", "tiny", "--out", str(tmp_path / "b"),
                                 *_drop(_base_args(), "--max-steps"), "--max-steps", "1", "--allow-incomplete"])
    assert r.exit_code == 0, r.output


def test_only_the_newest_checkpoints_are_kept(demo_cache, tmp_path):
    _run(demo_cache, tmp_path, max_steps=5, save_every=1, keep_checkpoints=2)
    assert _steps(tmp_path) == [5, 4]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")], "no temporary left"


@pytest.fixture(scope="module")
def four_step_run(demo_cache, tmp_path_factory) -> Path:
    """4 steps saved at steps 2 and 4. Read-only: a test that damages or resumes it copies it first."""
    out = tmp_path_factory.mktemp("four") / "run"
    _run(demo_cache, out, max_steps=4, save_every=2)
    return out


@pytest.mark.parametrize("damage", ["truncated weights", "malformed state"])
def test_an_unreadable_checkpoint_falls_back_to_the_one_before(demo_cache, four_step_run, tmp_path, caplog, damage):
    shutil.copytree(four_step_run, tmp_path, dirs_exist_ok=True)
    newest = tmp_path / "checkpoints" / "step_0000004"
    if damage == "truncated weights":
        data = (newest / "drafter.safetensors").read_bytes()
        (newest / "drafter.safetensors").write_bytes(data[: len(data) // 2])
    else:
        (newest / "state.json").write_text('{"step": "four"')
    with caplog.at_level(logging.WARNING, logger="dflash_cache.train"):
        _run(demo_cache, tmp_path, max_steps=5, save_every=2, resume=True)
    assert any("step_0000004" in m and "falling back" in m for m in caplog.messages), caplog.messages
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5], "steps 3-4 were redone from step 2, each logged once"


def test_no_readable_checkpoint_is_one_line(demo_cache, two_step_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    for ckpt in (out / "checkpoints").iterdir():
        (ckpt / "state.json").write_text("[]")
    r = _cli_train(demo_cache, out)
    assert r.exit_code == 2 and "no checkpoint" in r.output and "Traceback" not in r.output, r.output


def test_resume_with_another_process_count_continues_from_the_global_position(demo_cache, tmp_path, caplog):
    _run(demo_cache, tmp_path, max_steps=3)
    state_path = tmp_path / "checkpoints" / "step_0000003" / "state.json"
    state = json.loads(state_path.read_text())
    state["world"] = 3  # as if three processes had trained: position 3 = one batch each
    state_path.write_text(json.dumps(state))
    with caplog.at_level(logging.WARNING, logger="dflash_cache.train"):
        trainer = Trainer.build(demo_train_config(demo_cache, tmp_path, resume=True, epochs=1), device=CPU)
        assert trainer.checkpointer.restore()
    assert trainer.source.position.batch == 3 and trainer.step == 3
    assert trainer.drafter.schedule.total_steps == 3 + trainer.source.batches_per_epoch() - 3
    assert any("resuming a run of 3 process(es) with 1" in m for m in caplog.messages)


def _state(**changes) -> dict:
    state = {"step": 4, "epoch": 0, "batch": 4, "tokens_seen": 100, "world": 1, "run": {"seed": 0},
             "anchor_cap": 64, "scheduler": {}, "optimizer_hparams": [{"lr": 1e-3}], "version": STATE_VERSION}
    return {**state, **changes}


def test_a_state_read_from_disk_has_every_field_checked():
    assert TrainerState.from_json(_state(), where=Path("s.json")).step == 4
    for bad, field in [({"step": "four"}, "step"), ({"world": 0}, "world"), ({"batch": -1}, "batch"),
                       ({"step": True}, "step"), ({"optimizer_hparams": {"lr": 1}}, "optimizer_hparams"),
                       ({"optimizer_hparams": [3]}, "optimizer_hparams"), ({"run": []}, "run")]:
        with pytest.raises(UnreadableCheckpoint, match=field):
            TrainerState.from_json(_state(**bad), where=Path("s.json"))
    with pytest.raises(UnreadableCheckpoint, match="version"):
        TrainerState.from_json(_state(version=1), where=Path("s.json"))
    with pytest.raises(UnreadableCheckpoint, match="unknown field"):
        TrainerState.from_json({**_state(), "extra": 1}, where=Path("s.json"))


def test_options_changed_on_resume_are_each_said_in_one_line(demo_cache, two_step_run, tmp_path, caplog):
    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    saved = json.loads((list_checkpoints(out / "checkpoints")[0] / "state.json").read_text())["options"]
    assert saved["--save-every"] == 10000 and saved["--no-compile"] is False
    with caplog.at_level(logging.INFO, logger="dflash_cache.train"):
        r = _cli_train(demo_cache, out, "--save-every", "7", "--keep-checkpoints", "3", "--no-compile")
    assert r.exit_code == 0, r.output
    said = [m for m in caplog.messages if m.startswith("--resume: options changed")]
    assert len(said) == 1, caplog.messages
    assert said[0].startswith("--resume: options changed since the checkpoint's run, applied from step 2: ")
    for part in ("--keep-checkpoints 3 (was 2)", "--no-compile given (was not given)", "--save-every 7 (was 10000)"):
        assert part in said[0], said[0]
    assert "--max-steps" not in said[0] and "--resume" not in said[0].split(": ", 1)[1] and "--out" not in said[0]


def test_a_resume_that_lowers_the_anchor_cap_plans_its_static_shapes_again(demo_cache, two_step_run, tmp_path,
                                                                            monkeypatch):
    """On a GPU the shapes are planned before the checkpoint is read; a checkpoint whose anchor cap is
    lower (less memory was free then) must not leave shapes for anchor counts no batch can reach."""
    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    state_path = list_checkpoints(out / "checkpoints")[0] / "state.json"
    state = json.loads(state_path.read_text())
    state["anchor_cap"] = 40
    state_path.write_text(json.dumps(state))
    trainer = Trainer.build(demo_train_config(demo_cache, out, max_steps=3, resume=True), device=CPU)
    trainer.runner.shapes = trainer.plan_shapes()  # what a run with compiled layers plans at build
    assert max(trainer.runner.shapes.anchors) > 40
    monkeypatch.setattr(trainer.runner, "warm_up", lambda: 0.0)
    trainer.fit()
    assert trainer.runner.max_anchors == 40 and max(trainer.runner.shapes.anchors) <= 40, trainer.runner.shapes
