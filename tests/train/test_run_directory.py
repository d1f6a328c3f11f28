"""A run directory after a kill: the next run removes (or restores) what was half written, and a
write that fails on a full disk is one line that keeps the last checkpoint."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import SafetensorError

import dflash_cache.files as files
import dflash_cache.train.checkpoint as checkpoint
import dflash_cache.train.trainer as trainer
from dflash_cache.cli import cli
from dflash_cache.errors import UserError
from dflash_cache.files import write_json_atomic
from dflash_cache.train.checkpoint import TrainerState, list_checkpoints, optimizer_hparams, save_checkpoint
from dflash_cache.train.run_directory import tidy


def _save(directory: Path, step: int, keep: int = 2) -> Path:
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    state = TrainerState(step=step, epoch=0, batch=step, tokens_seen=0, world=1, run={}, anchor_cap=1,
                         scheduler={}, optimizer_hparams=optimizer_hparams(opt))
    return save_checkpoint(directory, model=model, optimizer=opt, state=state, rng={"x": torch.zeros(1)}, keep=keep)


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_rotation_killed_midway_leaves_no_checkpoint_missing_its_state(tmp_path, monkeypatch):
    ckpt = tmp_path / "checkpoints"
    _save(ckpt, 1)
    _save(ckpt, 2)
    deleted = []

    def killed(path, ignore_errors=False):  # the kill: the rotation's delete never happens
        deleted.append(Path(path).name)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
    _save(ckpt, 3)
    monkeypatch.undo()
    assert [p.name for p in list_checkpoints(ckpt)] == ["step_0000003", "step_0000002"]
    assert _names(ckpt) == [".stale_step_0000001", "step_0000002", "step_0000003"], "the old one is set aside first"
    assert tidy(tmp_path) == ["checkpoints/.stale_step_0000001"]
    assert _names(ckpt) == ["step_0000002", "step_0000003"]


def test_tidy_removes_half_written_checkpoints_and_restores_one_being_replaced(tmp_path):
    ckpt = tmp_path / "checkpoints"
    whole = _save(ckpt, 4)
    shutil.copytree(whole, ckpt / ".tmp_step_0000005")          # killed before its rename
    shutil.copytree(whole, ckpt / "step_0000006")
    (ckpt / "step_0000006" / "state.json").unlink()              # torn: no state file
    whole.rename(ckpt / ".old_step_0000004")                     # killed while replacing step 4 by itself
    shutil.copytree(ckpt / ".old_step_0000004", ckpt / ".old_step_0000003")
    _save(ckpt, 3, keep=5)                                       # ... and a step 3 that was replaced whole
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "model.safetensors.123.tmp").write_bytes(b"x")
    (tmp_path / "metrics.jsonl.77.tmp").write_text("{")
    (tmp_path / "notes.tmp").write_text("the user's")

    removed = tidy(tmp_path)

    assert sorted(removed) == ["checkpoints/.old_step_0000003", "checkpoints/.tmp_step_0000005",
                               "checkpoints/step_0000006", "export/model.safetensors.123.tmp", "metrics.jsonl.77.tmp"]
    assert _names(ckpt) == ["step_0000003", "step_0000004"], "the checkpoint being replaced is restored"
    assert [p.name for p in list_checkpoints(ckpt)] == ["step_0000004", "step_0000003"]
    assert (tmp_path / "notes.tmp").exists(), "only our own temporary files are removed"
    assert tidy(tmp_path) == []


@pytest.mark.parametrize("failure", ["oserror", "safetensors"])
def test_a_full_disk_at_a_checkpoint_is_one_line_and_keeps_the_last_one(tmp_path, monkeypatch, failure):
    ckpt = tmp_path / "checkpoints"
    _save(ckpt, 1)
    real = checkpoint.save_file

    def full(tensors, path):
        if Path(path).name == "optimizer.safetensors":
            if failure == "oserror":
                raise OSError(errno.ENOSPC, "No space left on device")
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path)

    monkeypatch.setattr(checkpoint, "save_file", full)
    with pytest.raises(UserError) as e:
        _save(ckpt, 2)
    message = str(e.value)
    assert message.startswith("disk full while writing checkpoint") and "\n" not in message
    assert "--resume continues from step_0000001" in message
    assert _names(ckpt) == ["step_0000001"], "nothing half written stays"


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text("old\n")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(OSError):
        write_json_atomic(path, {"new": 1})
    assert _names(tmp_path) == ["metrics.jsonl"] and path.read_text() == "old\n"


def test_train_tidies_its_directory_and_a_full_disk_at_the_export_is_one_line(demo_cache, tmp_path, monkeypatch):
    out = tmp_path / "run"
    (out / "export").mkdir(parents=True)
    (out / "export" / "config.json.999.tmp").write_text("{")
    (out / "checkpoints" / ".tmp_step_0000007").mkdir(parents=True)

    def full(*_args, **_kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer, "export_drafter", full)
    args = ["train", "--cache", str(demo_cache), "--target", "tiny", "--out", str(out), "--block-size", "8",
            "--draft-layers", "1", "--num-anchors", "8", "--token-budget", "1024", "--max-steps", "1",
            "--device", "cpu", "--no-progress", "--no-compile"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines()[-1] == (
        f"Error: disk full while writing the export to {out / 'export'}; free space, then run the same command "
        "with --resume to export again")
    assert _names(out / "export") == [] and _names(out / "checkpoints") == ["step_0000001"]
