"""Phase 2 end to end on the CPU: learning, bit-exact resume, refusals."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from dflash_cache.cli import cli
from dflash_cache.extract.run import extract
from dflash_cache.profiler import StageProfiler
from dflash_cache.target.model import TargetSpec
from dflash_cache.train.anchors import sample_anchors
from dflash_cache.train.run_config import TrainConfig
from dflash_cache.train.step import StepRunner
from dflash_cache.train.trainer import Trainer, lr_factor
from tests.conftest import torchrun_cli
from tools.make_demo_drafter import demo_train_config


def _cfg(cache: Path, out: Path, **kw) -> TrainConfig:
    return demo_train_config(cache, out, **kw)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_lr_schedule():
    assert lr_factor(0, 100, 0.04) == pytest.approx(0.25)
    assert lr_factor(3, 100, 0.04) == pytest.approx(1.0)
    assert lr_factor(52, 100, 0.04) == pytest.approx(0.5, abs=0.02)
    assert lr_factor(100, 100, 0.04) == pytest.approx(0.0)


def test_training_lowers_loss_and_learns_slot_one(demo_cache, tmp_path):
    """40 fresh steps already learn: compared with the first 5 steps, the last 10 have a fifth less
    loss and predict slot 1 far above chance. (The committed 200-step demo drafter's metrics are
    checked in tests/tools; this run is what proves that the trainer as it is now still learns.)"""
    import torch

    Trainer.build(_cfg(demo_cache, tmp_path, max_steps=40, log_every=5), device=torch.device("cpu")).fit()
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(5, 41, 5))
    first = rows[0]
    loss = sum(r["loss"] for r in rows[-2:]) / 2
    slot_one = sum(r["slot_acc"][0] for r in rows[-2:]) / 2
    assert loss < 0.8 * first["loss"], (first["loss"], loss)
    # chance is 1/2048 for the tiny vocabulary; 0.06 is over a hundred times that. On this predictable
    # text the first 5 steps average ~0.04, the last 10 of 40 ~0.085 (the demo drafter's 200 reach ~0.24).
    assert slot_one > 0.06 and slot_one > first["slot_acc"][0] + 0.025, (first["slot_acc"][0], slot_one)
    assert rows[-1]["tau_hat"] > 1.05
    export = tmp_path / "export"
    assert len(load_file(export / "model.safetensors")) == 3 + 11 * 2
    assert json.loads((export / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]


def _anchor_cap_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "anchors per batch" in r.getMessage() or "anchors the batches" in r.getMessage()]


def test_metrics_rows_say_what_share_of_the_anchors_the_cap_kept(demo_cache, tmp_path, caplog):
    """A cap that binds is visible: each row's `anchors_kept`, and one warning naming the cap."""
    cpu = torch.device("cpu")
    with caplog.at_level("INFO"):
        Trainer.build(_cfg(demo_cache, tmp_path / "capped", max_steps=4, log_every=2, max_anchors=8), device=cpu).fit()
    kept = [r["anchors_kept"] for r in _rows(tmp_path / "capped")]
    assert len(kept) == 2 and all(0 < k < 0.9 for k in kept), kept
    lines = _anchor_cap_lines(caplog)
    assert [r.levelname for r in lines] == ["WARNING"], [r.getMessage() for r in lines]
    assert lines[0].getMessage().startswith("--max-anchors 8 kept"), lines[0].getMessage()


def test_the_cpu_speed_cap_is_news_not_a_warning_however_few_anchors_it_keeps(demo_cache, tmp_path, caplog,
                                                                              monkeypatch):
    """A plain CPU run caps its anchors to keep steps short, by design: the line that says how many it kept
    is news (INFO), even where it keeps a few percent (the demo's batches offer 112-176 anchors; the cap
    here keeps about 40). A warning is for a cap of the device's memory or of --max-anchors."""
    import dflash_cache.train.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "CPU_STEP_FLOPS", 0.0001e12)
    with caplog.at_level("INFO"):
        Trainer.build(_cfg(demo_cache, tmp_path, max_steps=4, log_every=2), device=torch.device("cpu")).fit()
    kept = [r["anchors_kept"] for r in _rows(tmp_path)]
    assert len(kept) == 2 and all(0 < k < 0.9 for k in kept), kept
    lines = _anchor_cap_lines(caplog)
    assert [r.levelname for r in lines] == ["INFO"], [r.getMessage() for r in lines]
    assert lines[0].getMessage().startswith("the cap of "), lines[0].getMessage()
    assert "that keeps a CPU step under" in lines[0].getMessage(), lines[0].getMessage()


def test_the_anchor_cap_is_said_once_and_only_when_it_binds(demo_cache, tmp_path, caplog):
    """The demo cache's first four batches offer 112, 160, 160 and 176 anchors. A cap that no batch
    reaches (the memory's default, or 176) says nothing, at start or at any step; a cap of 170 binds
    in the second window only (330 of its 336 anchors kept): one line, there, not a warning."""
    cpu = torch.device("cpu")
    for name, cap in (("memory", None), ("at-most", 176)):
        caplog.clear()
        with caplog.at_level("INFO"):
            Trainer.build(_cfg(demo_cache, tmp_path / name, max_steps=4, log_every=2, max_anchors=cap),
                          device=cpu).fit()
        assert [r["anchors_kept"] for r in _rows(tmp_path / name)] == [1.0, 1.0]
        assert not _anchor_cap_lines(caplog), [r.getMessage() for r in _anchor_cap_lines(caplog)]
    caplog.clear()
    with caplog.at_level("INFO"):
        Trainer.build(_cfg(demo_cache, tmp_path / "binds", max_steps=4, log_every=2, max_anchors=170),
                      device=cpu).fit()
    assert [r["anchors_kept"] for r in _rows(tmp_path / "binds")] == [1.0, pytest.approx(330 / 336, abs=1e-4)]
    lines = _anchor_cap_lines(caplog)
    assert [r.levelname for r in lines] == ["INFO"], [r.getMessage() for r in lines]
    assert lines[0].getMessage().startswith("--max-anchors 170 kept 98% of"), lines[0].getMessage()


# The interrupted and crashed runs' length: two or three steps trained after each resume (a wrong RNG,
# weight or optimizer moment shows in the first), and two past the crash test's checkpoint at step 4.
STRAIGHT_STEPS = 8


def _metrics(out: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["slot_acc"]) for r in _rows(out)]


@pytest.fixture(scope="module")
def straight_dir(demo_cache, tmp_path_factory) -> Path:
    """An uninterrupted run of STRAIGHT_STEPS steps, a row each and its one checkpoint at the end.
    Read-only: a test that resumes it copies it first."""
    out = tmp_path_factory.mktemp("straight") / "run"
    Trainer.build(_cfg(demo_cache, out, max_steps=STRAIGHT_STEPS), device=torch.device("cpu")).fit()
    return out


@pytest.fixture(scope="module")
def straight_run(straight_dir) -> list[tuple]:
    """Metrics of the uninterrupted run, the reference every resumed run must reproduce."""
    return _metrics(straight_dir)


# Where the sixth call of each lands a Ctrl-C, and the step then finished and saved: the sixth
# batch's anchors and masks are prepared ahead, during step 5 (after its loss, before its backward:
# the RNG has advanced for a batch not yet trained on); inside step 6's loss; between step 6's
# gradient clip and its optimizer step (weights not yet updated).
INTERRUPT_POINTS = {
    "anchors": ("dflash_cache.train.step.sample_anchors", 5),
    "masks": ("dflash_cache.train.step.build_masks", 5),
    "loss": ("dflash_cache.train.step.chunked_weighted_ce", 6),
    "optimizer": ("torch.nn.utils.clip_grad_norm_", 6),
}


@pytest.mark.parametrize("where", sorted(INTERRUPT_POINTS))
def test_ctrl_c_inside_a_step_then_resume_is_bit_exact(demo_cache, tmp_path, monkeypatch, straight_run, where):
    import signal

    import torch

    from dflash_cache.train.interrupt import TrainingInterrupted

    target, saved_step = INTERRUPT_POINTS[where]
    module_name, attr = target.rsplit(".", 1)
    module = __import__(module_name, fromlist=[attr])
    real = getattr(module, attr)
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:
            signal.raise_signal(signal.SIGINT)  # the handler runs here, in the middle of a step
        return real(*args, **kwargs)

    monkeypatch.setattr(module, attr, interrupted)
    before = signal.getsignal(signal.SIGINT)  # Python's default, or ignored under a background shell
    with pytest.raises(TrainingInterrupted) as info:
        Trainer.build(_cfg(demo_cache, tmp_path, max_steps=STRAIGHT_STEPS), device=torch.device("cpu")).fit()
    assert info.value.step == saved_step, "the step in flight is finished, then saved"
    assert signal.getsignal(signal.SIGINT) is before, "the handler is restored"
    monkeypatch.setattr(module, attr, real)
    Trainer.build(_cfg(demo_cache, tmp_path, max_steps=STRAIGHT_STEPS, resume=True), device=torch.device("cpu")).fit()
    assert _metrics(tmp_path) == straight_run, "same losses and accuracies, each step logged once"


# A run a few CPU seconds long, through the CLI on one process.
SHORT_RUN = ["--target", "tiny", "--block-size", "8", "--draft-layers", "1", "--num-anchors", "8", "--token-budget",
             "1024", "--max-steps", "2", "--no-progress", "--device", "cpu"]


def test_a_stop_while_the_export_is_written_lets_it_finish_and_says_so(demo_cache, tmp_path, monkeypatch, caplog):
    """A Ctrl-C that lands while the export is written (the last checkpoint already is) lets the export
    finish: the run says that its last checkpoint and its export are written, and ends as done, not
    'stopped without saving'."""
    import signal

    from dflash_cache.train import trainer as trainer_module
    from dflash_cache.train.export import read_export

    real = trainer_module.export_drafter

    def stopped_during(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)  # a Ctrl-C, here and now: its handler runs before the export goes on
        real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "export_drafter", stopped_during)
    out, before = tmp_path / "run", signal.getsignal(signal.SIGINT)
    with caplog.at_level("INFO", logger="dflash_cache.train"):
        r = CliRunner().invoke(cli, ["train", "--cache", str(demo_cache), "--out", str(out), *SHORT_RUN])
    assert r.exit_code == 0 and "Stopped without saving" not in r.output, r.output
    assert f"done: step 2, loss {_rows(out)[-1]['loss']:.4f}" in r.output, r.output
    checkpoint, export = out / "checkpoints" / "step_0000002", out / "export"
    assert (f"asked to stop as the run ended: its last checkpoint {checkpoint} and its export {export} are written, "
            "so it is complete") in caplog.messages, caplog.messages
    assert (checkpoint / "state.json").is_file()
    assert read_export(export).cfg.block_size == 8, "the export is complete: it reads strictly"
    assert signal.getsignal(signal.SIGINT) is before, "the handler is restored"


def test_resume_after_a_crash_rewinds_the_metrics(demo_cache, tmp_path, monkeypatch, straight_run):
    """A crash after the last checkpoint (step 4) leaves metric rows of steps (5 and 6) that the resume redoes."""
    real_step = StepRunner.train_step
    calls = {"n": 0}

    def crashing(self, batch, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 7:
            raise RuntimeError("simulated crash")
        return real_step(self, batch, *args, **kwargs)

    monkeypatch.setattr(StepRunner, "train_step", crashing)
    with pytest.raises(RuntimeError):
        Trainer.build(_cfg(demo_cache, tmp_path, max_steps=STRAIGHT_STEPS, save_every=4),
                      device=torch.device("cpu")).fit()
    assert [r["step"] for r in _rows(tmp_path)] == list(range(1, 7))
    monkeypatch.setattr(StepRunner, "train_step", real_step)
    Trainer.build(_cfg(demo_cache, tmp_path, max_steps=STRAIGHT_STEPS, save_every=4, resume=True),
                  device=torch.device("cpu")).fit()
    assert _metrics(tmp_path) == straight_run


def test_rows_after_a_resume_fall_on_the_uninterrupted_runs_steps(demo_cache, tmp_path):
    """Resumed at step 2 with --log-every 3, the next row comes at step 3 (over one step), as in a run
    never stopped, and not at step 5: step numbers line up across resumes in a tracker. That row holds
    the resumed run's first step alone, start-up in it: it gives no rate rather than a wrong one."""
    cpu = torch.device("cpu")
    Trainer.build(_cfg(demo_cache, tmp_path, max_steps=2, log_every=3), device=cpu).fit()
    Trainer.build(_cfg(demo_cache, tmp_path, max_steps=7, log_every=3, resume=True), device=cpu).fit()
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [2, 3, 6, 7]
    assert [r["tokens_per_s"] is None for r in rows] == [False, True, False, False], rows


def test_the_first_windows_rate_leaves_out_start_up(demo_cache, tmp_path, monkeypatch):
    """A run's first step carries its start-up (the first read, compiling): 100 s spent there, in a
    fresh run and in a resumed one, do not show in the tokens/s of the window it starts."""
    import functools
    import time

    from dflash_cache.train import bookkeeping
    from dflash_cache.train.metrics_log import MetricsLog

    late = {"s": 0.0}
    monkeypatch.setattr(bookkeeping, "MetricsLog",
                        functools.partial(MetricsLog, clock=lambda: time.perf_counter() + late["s"]))
    real_step, started = StepRunner.train_step, set()

    def slow_first(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        if id(self) not in started:
            started.add(id(self))
            late["s"] += 100.0
        return out

    monkeypatch.setattr(StepRunner, "train_step", slow_first)
    cpu = torch.device("cpu")
    Trainer.build(_cfg(demo_cache, tmp_path, max_steps=4, log_every=2), device=cpu).fit()
    Trainer.build(_cfg(demo_cache, tmp_path, max_steps=8, log_every=2, resume=True), device=cpu).fit()
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [2, 4, 6, 8]
    for before, row in ((None, rows[0]), (rows[1], rows[2])):
        tokens = row["tokens_seen"] - (before["tokens_seen"] if before else 0)
        assert row["tokens_per_s"] > tokens / 50, (row, tokens)  # 100 s counted: under tokens / 100


def test_existing_run_needs_resume(demo_cache, tmp_path, caplog):
    import logging

    import torch

    with caplog.at_level(logging.INFO, logger="dflash_cache.train"):
        Trainer.build(_cfg(demo_cache, tmp_path / "r", max_steps=2), device=torch.device("cpu")).fit()
    assert any(m.startswith("start-up: set-up ") for m in caplog.messages), "start-up is reported"
    r = CliRunner().invoke(cli, ["train", "--cache", str(demo_cache), "--target", "tiny", "--out", str(tmp_path / "r"),
                                 "--max-steps", "2", "--device", "cpu", "--no-progress"])
    assert r.exit_code == 2 and "--resume" in r.output


def test_cache_for_another_target_is_refused(demo_cache, tmp_path):
    from transformers import Qwen3ForCausalLM

    from dflash_cache.target.tiny import tiny_config

    config = tiny_config()
    config.vocab_size = 4096
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "other")
    r = CliRunner().invoke(cli, ["train", "--cache", str(demo_cache), "--target", str(tmp_path / "other"),
                                 "--out", str(tmp_path / "run"), "--max-steps", "2", "--device", "cpu"])
    assert r.exit_code == 2, r.output
    assert "target.vocab_size" in r.output and "Traceback" not in r.output


TWO_RANK_RUN = ["--target", "tiny", "--block-size", "8", "--draft-layers", "1", "--num-anchors", "8",
                "--token-budget", "1024", "--max-steps", "4", "--log-every", "2", "--no-progress", "--eval-batches", "3"]


def test_torchrun_two_cpu_ranks_train_with_ddp(demo_cache, tmp_path):
    out = tmp_path / "ddp"
    done = torchrun_cli("train", "--cache", str(demo_cache), "--out", str(out), *TWO_RANK_RUN, "--device", "cpu",
                        "--eval-data", str(demo_cache), timeout=300)
    _check_two_rank_run(demo_cache, out)
    assert [line for line in done.stdout.splitlines() if line.startswith("done:")] == [
        f"done: step 4, loss {_rows(out)[1]['loss']:.4f}, tau_hat {_rows(out)[1]['tau_hat']:.3f}; exported to "
        f"{out / 'export'}"], "rank 0 alone says the result"


def test_train_gpus_launches_one_ddp_rank_per_device_as_torchrun_does(demo_cache, tmp_path, monkeypatch, capfd,
                                                                       caplog, preloaded_ranks):
    """`train --gpus`: one rank per device through the launcher extract uses (two CPU ranks here, as
    `--gpus all` would give two GPUs), the same run the torchrun test checks; rank 0 says the result
    line here, and OUT/config.yaml records --gpus, so `--config` starts the ranks again. What the
    ranks share is said once, by rank 0: the CPU threads each takes, the drafter they train, the target
    head they load and their start-up."""
    from dflash_cache.train import ranks

    monkeypatch.setattr(ranks, "gpu_devices", lambda _spec: [torch.device("cpu")] * 2)
    out = tmp_path / "ddp"
    with caplog.at_level("INFO"):  # the ranks log at this process's level, to the stderr they inherit
        r = CliRunner().invoke(cli, ["train", "--cache", str(demo_cache), "--out", str(out), *TWO_RANK_RUN, "--gpus",
                                     "all", "--eval-data", str(demo_cache)])
    assert r.exit_code == 0, r.output
    said = capfd.readouterr().err.splitlines()
    threads = [line for line in said if "dflash_cache.cpu_threads: CPU work on" in line]
    assert len(threads) == 1 and threads[0].startswith("[rank 0] ") and " per process (" in threads[0], said
    for what in ("dflash_cache.train.trainer: drafter: ", "embedding and LM head loaded", "bookkeeping: start-up: "):
        assert [line[:9] for line in said if what in line] == ["[rank 0] "], (what, said)
    assert [line for line in r.output.splitlines() if line.startswith("done:")] == [
        f"done: step 4, loss {_rows(out)[1]['loss']:.4f}, tau_hat {_rows(out)[1]['tau_hat']:.3f}; exported to "
        f"{out / 'export'}"]
    _check_two_rank_run(demo_cache, out)
    recorded = (out / "config.yaml").read_text()
    assert "\ngpus: all\n" in recorded and "\ndevice:" not in recorded


@pytest.mark.parametrize(("args", "env", "says"), [
    (["--gpus", "cpu", "--device", "cpu"], {}, "--gpus cpu and --device cpu both say where to train"),
    (["--gpus", "cpu"], {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost"}, "torchrun started this one"),
])
def test_train_gpus_with_device_or_under_torchrun_is_one_line(demo_cache, tmp_path, monkeypatch, args, env, says):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    r = CliRunner().invoke(cli, ["train", "--cache", str(demo_cache), "--out", str(out), *TWO_RANK_RUN, *args])
    assert r.exit_code == 2 and says in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not out.exists()


def _check_two_rank_run(demo_cache: Path, out: Path) -> None:
    """What two DDP ranks on the CPU made of TWO_RANK_RUN with three held-out batches."""
    from safetensors.torch import load_file as load

    rows = _rows(out)
    assert [(r["step"], r.get("split")) for r in rows] == [(2, None), (4, None), (4, "eval")]
    # the ranks' shares of the held-out batches (2 and 1), all-reduced, are what one process finds
    one = Trainer.build(TrainConfig(cache=str(demo_cache), target="tiny", out=str(out), block_size=8, draft_layers=1,
                                    num_anchors=8, token_budget=1024, progress=False, eval_data=str(demo_cache),
                                    eval_batches=3), device=torch.device("cpu"))
    assert one.checkpointer.restore()
    assert one.validation.run(one.runner, one.step).loss == pytest.approx(rows[-1]["eval_loss"], rel=1e-9)
    rng = load(out / "checkpoints" / "step_0000004" / "rng.safetensors")
    assert {"anchors.rank0", "anchors.rank1"} <= set(rng)
    assert not torch_equal(rng["anchors.rank0"], rng["anchors.rank1"]), "ranks draw their own anchors"
    assert (out / "export" / "model.safetensors").is_file()


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_cache_from_another_checkpoint_of_the_same_architecture_is_refused(tmp_path, small_parquet):
    import torch
    from transformers import Qwen3ForCausalLM

    from dflash_cache.target.tiny import tiny_config
    from tests.conftest import extract_config

    for seed, name in ((0, "a"), (1, "b")):
        torch.manual_seed(seed)
        Qwen3ForCausalLM(tiny_config()).save_pretrained(tmp_path / name)
    cache = tmp_path / "cache"
    extract(extract_config(small_parquet, cache, target=TargetSpec(model=str(tmp_path / "a"))), "cpu")
    r = CliRunner().invoke(cli, ["train", "--cache", str(cache), "--target", str(tmp_path / "b"),
                                 "--out", str(tmp_path / "run"), "--max-steps", "1", "--device", "cpu"])
    assert r.exit_code == 2 and "target.weights_fingerprint" in r.output, r.output


@pytest.mark.parametrize(("args", "says"), [
    (["--save-every", "0"], "--save-every"),
    (["--log-every", "0"], "--log-every"),
    (["--lr", "-1"], "--lr"),
    (["--sliding-window", "-3"], "--sliding-window"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints"),
    (["--device", "banana"], "--device"),
    (["--device", "cuda"], "--device"),
])
def test_bad_train_options_are_one_line_exit_2(demo_cache, tmp_path, args, says):
    import torch

    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    r = CliRunner().invoke(cli, ["train", "--cache", str(demo_cache), "--target", "tiny", "--out",
                                 str(tmp_path / "run"), "--max-steps", "1", "--no-progress", *args])
    assert r.exit_code == 2, r.output
    assert says in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir()), "nothing written"


def test_unwritable_out_fails_before_set_up(demo_cache, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = CliRunner().invoke(cli, ["train", "--cache", str(demo_cache), "--target", "tiny", "--out",
                                 str(blocker / "run"), "--max-steps", "1", "--device", "cpu", "--no-progress"])
    assert r.exit_code == 2 and "cannot write to" in r.output and "choose a writable --out" in r.output, r.output


def test_a_run_shorter_than_the_profile_interval_still_reports_its_stages(demo_cache, tmp_path, caplog):
    cfg = demo_train_config(demo_cache, tmp_path / "run", max_steps=2, profile_interval=3600.0)
    with caplog.at_level("INFO", logger="dflash_cache.profiler"):
        Trainer.build(cfg, device=torch.device("cpu")).fit()
    reports = [m for m in caplog.messages if "drafter.forward" in m]
    assert len(reports) == 1 and "n=2" in reports[0], caplog.messages


def test_a_compiler_that_cannot_build_kernels_is_one_line_naming_no_compile(demo_cache, tmp_path, monkeypatch):
    """On a machine where torch.compile fails (no C compiler, a GPU its Triton does not support) the
    run stops with one line and exit status 2 that says to pass --no-compile, not a traceback."""
    from torch._dynamo.exc import BackendCompilerFailed

    def no_compiler(self, batch, *args, **kwargs):
        raise BackendCompilerFailed(None, RuntimeError("Failed to find C compiler.\nPlease specify via CC"), None)

    monkeypatch.setattr(StepRunner, "train_step", no_compiler)
    r = CliRunner().invoke(cli, ["train", "--cache", str(demo_cache), "--target", "tiny", "--out", str(tmp_path / "r"),
                                 "--max-steps", "2", "--no-progress"])
    assert r.exit_code == 2, r.output
    assert r.output.strip() == ("Error: torch.compile could not build the drafter's kernels here (RuntimeError: Failed "
                                "to find C compiler.); run again with --no-compile (and --resume to continue from "
                                "the last checkpoint)"), r.output


def _with_static_shapes(trainer: Trainer) -> Trainer:
    """`trainer` padding its steps to the static shapes a GPU run would (its layers still eager here)."""
    trainer.runner.shapes = trainer.plan_shapes()
    return trainer


def test_warm_up_leaves_no_trace(demo_cache, tmp_path):
    """The compile warm-up runs forward and backward on made-up batches (one per static shape) but
    changes nothing of the run: weights, gradients, optimiser state, RNG states and the profiler's
    counts are as before."""
    trainer = _with_static_shapes(Trainer.build(_cfg(demo_cache, tmp_path, max_steps=2, static_shapes=2),
                                                device=torch.device("cpu")))
    assert len(trainer.runner.shapes.anchors) == 2
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    rng, anchors = torch.get_rng_state(), trainer.rng.generator.get_state()
    forwards, had_grads, zero_grad = [], [], trainer.model.zero_grad
    trainer.model.register_forward_hook(lambda *_: forwards.append(True))

    def recording_zero_grad(**kw):
        had_grads.append(all(p.grad is not None for p in trainer.model.parameters()))
        zero_grad(**kw)

    trainer.model.zero_grad = recording_zero_grad
    assert trainer.runner.warm_up() >= 0 and len(forwards) == 2 and had_grads == [True, True]
    assert all(torch.equal(v, weights[k]) for k, v in trainer.model.state_dict().items())
    assert all(p.grad is None for p in trainer.model.parameters()) and not trainer.drafter.optimizer.state
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(trainer.rng.generator.get_state(), anchors)
    assert trainer.step == 0 and trainer.runner.shape_record.compiled_steps == 0


def test_the_step_on_fewer_rows_is_the_step_on_every_row(demo_cache, tmp_path):
    """The trainer's forward on the block input's distinct rows and the scored rows only (the default)
    takes the step that running every row takes (bench.variants.use_every_row, what bench/train.py
    compares): the same loss, accuracy and parameter gradients."""
    from bench.variants import use_every_row

    trainer = Trainer.build(_cfg(demo_cache, tmp_path, max_steps=1), device=torch.device("cpu"))
    runner = trainer.runner
    _, batch = next(iter(trainer.source.iterate(trainer.source.position, epochs=1)))
    trainer.source.close()
    blocks = sample_anchors(batch, block_size=trainer.cfg.block_size, num_anchors=trainer.cfg.num_anchors,
                            mask_token_id=runner.drafter_cfg.mask_token_id, generator=torch.Generator().manual_seed(0))
    runs = []
    for fewer in (True, False):
        use_every_row(runner, not fewer)
        trainer.model.zero_grad(set_to_none=True)
        inputs = runner.step_inputs(batch, blocks, shape=None, profiler=StageProfiler(None))
        loss, correct = runner._forward_backward(inputs, net=trainer.model, profiler=StageProfiler(None))
        runs.append((loss.detach(), correct, [p.grad.clone() for p in trainer.model.parameters()]))
    (loss_f, correct_f, grads_f), (loss_a, correct_a, grads_a) = runs
    assert blocks.num_anchors > 0
    torch.testing.assert_close(loss_f, loss_a, rtol=1e-5, atol=1e-6)
    assert torch.equal(correct_f, correct_a)
    for got, want in zip(grads_f, grads_a, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_sampling_ahead_takes_the_same_steps_and_checkpoints_the_same_rng(demo_cache, tmp_path):
    """train_steps samples the next batch's anchors while a step is queued on the device: the same
    anchors, hence the same losses, as one batch at a time; and between steps the anchor RNG state a
    checkpoint would hold is the one-at-a-time run's, so a resume draws the batch ahead again."""
    import itertools

    runs = []
    for ahead in (False, True):
        trainer = Trainer.build(_cfg(demo_cache, tmp_path / f"ahead-{ahead}", max_steps=4), device=torch.device("cpu"))
        batches = [b for _, b in itertools.islice(trainer.source.iterate(trainer.source.position, epochs=1), 4)]
        trainer.source.close()
        runner = trainer.runner
        if ahead:
            steps = ((m, trainer.rng.state_dict()["anchors.rank0"]) for _, _, m in
                     runner.train_steps((None, b) for b in batches))
        else:
            steps = ((runner.train_step(b), trainer.rng.state_dict()["anchors.rank0"]) for b in batches)
        runs.append([(float(m["loss"]), state.clone()) for m, state in steps])
    assert len(runs[1]) == 4
    for (loss_one, state_one), (loss_ahead, state_ahead) in zip(*runs, strict=True):
        assert loss_ahead == loss_one
        assert torch.equal(state_ahead, state_one)


def test_static_shapes_take_the_steps_unpadded_batches_take(demo_cache, tmp_path):
    """Every step padded to a static shape (context rows and blocks no query sees, weighing 0) takes
    the step the batch itself takes: the same losses; the rows report what was padding."""
    runs = []
    for static in (False, True):
        trainer = Trainer.build(_cfg(demo_cache, tmp_path / f"static-{static}", max_steps=6, log_every=3,
                                     static_shapes=2), device=torch.device("cpu"))
        if static:
            _with_static_shapes(trainer)
        trainer.fit()
        runs.append(_rows(tmp_path / f"static-{static}"))
    plain, padded = runs
    torch.testing.assert_close(torch.tensor([r["loss"] for r in padded]), torch.tensor([r["loss"] for r in plain]),
                               rtol=1e-5, atol=0.0)
    assert all("anchor_padding" not in r for r in plain)
    assert all(0 <= r["anchor_padding"] < 0.5 and 0 < r["context_padding"] < 1 and r["eager_steps"] == 0
               for r in padded), padded


def test_a_shape_whose_compiled_step_fails_runs_eagerly(demo_cache, tmp_path, caplog):
    """A static shape whose compiled step raises (as torch 2.11's dynamic graph did in its backward)
    is said once, with the torch version, and runs eagerly: the run goes on to its checkpoint and
    export, and the metrics count the eager steps."""
    trainer = _with_static_shapes(Trainer.build(_cfg(demo_cache, tmp_path, max_steps=4, log_every=2,
                                                     static_shapes=1), device=torch.device("cpu")))
    (shape,) = trainer.runner.shapes.shapes
    once = trainer.runner._forward_backward_once
    compiled_calls = []

    def failing_compiled_step(inputs, net, profiler, while_queued, *, eager):
        if not eager:
            compiled_calls.append(inputs.shape)
            if len(compiled_calls) == 2:  # the forward ran, the backward fails
                once(inputs, net, profiler, while_queued, eager=eager)
                raise RuntimeError("shape '[10161, 128]' is invalid for input of size 8193")
        return once(inputs, net, profiler, while_queued, eager=eager)

    trainer.runner._forward_backward_once = failing_compiled_step
    with caplog.at_level("WARNING"):
        trainer.fit()
    rows = _rows(tmp_path)
    # the warm-up compiled the shape; step 1's compiled attempt failed in its backward and ran eagerly
    assert [r["step"] for r in rows] == [2, 4] and [r["eager_steps"] for r in rows] == [2, 4]
    assert compiled_calls == [shape, shape] and trainer.runner.shape_record.failed.keys() == {shape}
    warned = [m for m in caplog.messages if "failed under torch" in m]
    assert len(warned) == 1 and str(shape) in warned[0] and torch.__version__ in warned[0], caplog.messages
    assert (tmp_path / "export" / "model.safetensors").is_file()


def test_gpu_sized_defaults_on_a_cpu_cap_the_anchors_by_compute_and_the_demo_is_not_capped(demo_cache, tmp_path,
                                                                                           caplog):
    """With no tuning flags a CPU step would take minutes (GPU-sized defaults over long rows): the anchor
    cap keeps it under CPU_STEP_FLOPS instead, and says why when it binds; --max-anchors lifts it; the
    demo's settings are not capped, and nothing warns."""
    from dflash_cache.train.flops import step_flops
    from dflash_cache.train.static_shapes import planned_batches
    from dflash_cache.train.trainer import CPU_STEP_FLOPS

    cpu = torch.device("cpu")
    with caplog.at_level("WARNING", logger="dflash_cache.train"):
        demo = Trainer.build(_cfg(demo_cache, tmp_path / "demo", max_steps=1), device=cpu)
        defaults = Trainer.build(TrainConfig(cache=str(demo_cache), target="tiny", out=str(tmp_path / "defaults")),
                                 device=cpu)
    assert not caplog.messages, caplog.messages
    _, offered = planned_batches(demo.source.table, demo.source.config, epochs=1, block_size=demo.cfg.block_size,
                                 num_anchors=demo.cfg.num_anchors, max_anchors=10**9)
    assert offered.max() < demo.runner.max_anchors, "no batch of the demo's reaches its cap"
    cap = defaults.runner.max_anchors
    assert defaults.runner.anchor_cap_reason == "that keeps a CPU step under ~0.05 TFLOP (--max-anchors lifts it)"
    context = defaults.cfg.token_budget
    assert step_flops(defaults.runner.drafter_cfg, context_tokens=context, num_blocks=cap, prefix_keys=0).total \
        <= CPU_STEP_FLOPS < step_flops(defaults.runner.drafter_cfg, context_tokens=context, num_blocks=cap + 1,
                                       prefix_keys=0).total
    lifted = Trainer.build(TrainConfig(cache=str(demo_cache), target="tiny", out=str(tmp_path / "lifted"),
                                       max_anchors=4 * cap), device=cpu)
    assert lifted.runner.max_anchors == 4 * cap


def _strict_rows(out: Path) -> list[dict]:
    """metrics.jsonl as strict JSON: a bare NaN or Infinity is an error."""
    def refuse(constant):
        raise ValueError(f"{constant} in metrics.jsonl")
    return [json.loads(line, parse_constant=refuse) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_batch_with_nan_features_is_a_skipped_step_not_a_nan_run(demo_cache, tmp_path):
    """One batch's features hold a NaN (a damaged cache): its step is skipped (no update) and
    counted, the rows average the other steps, and the run goes on to its export."""
    trainer = Trainer.build(_cfg(demo_cache, tmp_path, max_steps=4, log_every=2), device=torch.device("cpu"))
    iterate = trainer.source.iterate

    def with_a_nan(*args, **kwargs):
        for i, (position, batch) in enumerate(iterate(*args, **kwargs)):
            if i == 1:
                batch.features[5, 3] = float("nan")
            yield position, batch

    trainer.source.iterate = with_a_nan
    trainer.fit()
    rows = _strict_rows(tmp_path)
    assert [(r["step"], r.get("skipped_steps", 0)) for r in rows] == [(2, 1), (4, 0)], rows
    assert all(r["loss"] is not None and r["loss"] > 0 for r in rows)
    weights = load_file(tmp_path / "export" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_a_diverging_run_stops_in_one_line_and_never_saves_weights_that_are_not_finite(demo_cache, tmp_path):
    """--lr 1e6 blows the weights up within a few steps: the run stops with exit status 2 and one
    line naming the step and the last good checkpoint; no checkpoint or export holds non-finite
    weights, and metrics.jsonl stays strict JSON."""
    r = CliRunner().invoke(cli, ["train", "--cache", str(demo_cache), "--target", "tiny", "--out", str(tmp_path),
                                 "--block-size", "8", "--draft-layers", "2", "--num-anchors", "16",
                                 "--token-budget", "2048", "--lr", "1e6", "--max-steps", "60", "--log-every", "2",
                                 "--save-every", "2", "--nonfinite-limit", "4", "--no-progress", "--device", "cpu"])
    assert r.exit_code == 2, r.output
    message = r.output.strip().splitlines()[-1]
    assert message.startswith("Error: ") and ("not finite" in message) and "checkpoint" in message, r.output
    _strict_rows(tmp_path)
    for ckpt in (tmp_path / "checkpoints").glob("step_*"):
        for f in ckpt.glob("*.safetensors"):
            assert all(torch.isfinite(t).all() for t in load_file(f).values()), f
    assert not (tmp_path / "export").exists()


def test_two_runs_into_one_out_are_refused_in_one_line(demo_cache, tmp_path):
    """While one `train` holds its run directory, a second into the same --out (a double --resume)
    is refused at once with exit status 2, and writes nothing there."""
    from dflash_cache.store.lock import CacheLock

    out = tmp_path / "run"
    with CacheLock(out, what="run directory"):  # what a running `train` holds
        r = CliRunner().invoke(cli, ["train", "--cache", str(demo_cache), "--target", "tiny", "--out", str(out),
                                     "--max-steps", "2", "--resume", "--no-progress", "--device", "cpu"])
    assert r.exit_code == 2, r.output
    assert f"run directory {out} is being written by pid" in r.output and "Traceback" not in r.output, r.output
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


def test_a_refused_run_leaves_no_out_directory(demo_cache, tmp_path):
    out = tmp_path / "run"
    r = CliRunner().invoke(cli, ["train", "--cache", str(demo_cache), "--target", "tiny", "--out", str(out),
                                 "--max-steps", "2", "--block-size", "1000", "--no-progress", "--device", "cpu"])
    assert r.exit_code == 2 and not out.exists(), r.output


def test_a_refused_or_stopped_start_never_touches_config_yaml(demo_cache, tmp_path, monkeypatch):
    """OUT/config.yaml is written once the run has passed its checks: a resume refused for another
    --block-size leaves the file itself as it was (not rewritten, then put back), and a Ctrl-C while a
    resume is set up (loading the target) leaves it recording the run that trained, not the options
    of one that never started."""
    from dflash_cache.train import assemble

    out = tmp_path / "run"
    args = ["train", "--cache", str(demo_cache), "--out", str(out), *SHORT_RUN]
    assert CliRunner().invoke(cli, args).exit_code == 0
    config = out / "config.yaml"
    before = config.read_bytes(), config.stat().st_ino, config.stat().st_mtime_ns
    r = CliRunner().invoke(cli, [*args, "--resume", "--max-steps", "3", "--block-size", "4"])
    assert r.exit_code == 2 and "--block-size" in r.output, r.output
    assert (config.read_bytes(), config.stat().st_ino, config.stat().st_mtime_ns) == before

    def ctrl_c(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(assemble, "cache_parts", ctrl_c)
    r = CliRunner().invoke(cli, [*args, "--resume", "--max-steps", "3", "--lr", "1e-5"])
    assert r.exit_code == 130, r.output
    assert config.read_bytes() == before[0]


def test_options_changed_on_resume_are_applied_and_said(demo_cache, tmp_path, caplog, straight_dir):
    """`--resume --lr X` trains on at X from the step it resumes (the schedule's shape kept), and a
    changed --max-steps moves the schedule's end; each says so in one line, none is dropped. (The run
    resumed is a copy of the uninterrupted one the resume tests share, STRAIGHT_STEPS long.)"""
    end = STRAIGHT_STEPS + 4
    shutil.copytree(straight_dir, tmp_path, dirs_exist_ok=True)
    before = _rows(tmp_path)[3]  # step 4, at the first run's own peak's schedule
    with caplog.at_level("INFO", logger="dflash_cache.train"):
        trainer = Trainer.build(_cfg(demo_cache, tmp_path, max_steps=end, lr=1e-5, resume=True),
                                device=torch.device("cpu"))
        trainer.fit()
    lines = [m for m in caplog.messages if "on resume" in m]
    assert any("--lr 1e-05" in m and "0.003" in m for m in lines), caplog.messages
    assert any(f"ends at step {end}" in m and str(STRAIGHT_STEPS) in m for m in lines), caplog.messages
    first = next(r for r in _rows(tmp_path) if r["step"] > STRAIGHT_STEPS)
    expected = 1e-5 * lr_factor(first["step"], end, trainer.cfg.warmup_ratio)
    assert first["lr"] == pytest.approx(expected, rel=1e-6) and before["lr"] > 1e-4
