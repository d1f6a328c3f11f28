"""The command line starts however it is launched, from a directory of the user's own scripts."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from dflash_cache.cli import cli

CLI_FILE = Path(__file__).resolve().parents[2] / "dflash_cache" / "cli.py"
SHADOWS = ("train", "extract", "inspect")  # the phases' old top-level names, and a standard-library module


def _console_script() -> str | None:
    beside = Path(sys.executable).parent / "dflash-cache"
    return str(beside) if beside.is_file() else shutil.which("dflash-cache")


def _launchers() -> dict[str, list[str]]:
    launchers = {"python -m": [sys.executable, "-m", "dflash_cache.cli"], "python cli.py": [sys.executable,
                                                                                             str(CLI_FILE)]}
    script = _console_script()
    if script is not None:
        launchers["console script"] = [script]
    return launchers


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    for name in SHADOWS:
        (tmp_path / f"{name}.py").write_text('raise SystemExit("shadowed")\n')
    return tmp_path


def test_help_from_a_directory_of_shadowing_scripts(user_dir):
    assert _console_script() is not None, "the dflash-cache console script is not installed"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    runs = [(name, [*argv, *args]) for name, argv in _launchers().items()
            for args in (["--help"], ["extract", "--help"], ["train", "--help"])]

    def run(argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=user_dir, env=env, capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(len(runs)) as pool:
        results = list(pool.map(run, [argv for _, argv in runs]))
    for (name, argv), r in zip(runs, results, strict=True):
        assert r.returncode == 0 and "Usage:" in r.stdout, (name, argv[-2:], r.stderr[-2000:])
        assert "shadowed" not in r.stdout + r.stderr


def test_top_level_help_loads_no_phase():
    """The options of extract and train come from their configs, imported only when those commands run."""
    code = ("import sys; from dflash_cache.cli import cli\n"
            "for args in (['--help'], ['inspect', '--help']):\n"
            "    cli(args, standalone_mode=False)\n"
            "assert 'torch' not in sys.modules and 'dflash_cache.extract' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_no_commands_help_loads_torch():
    """--help answers at once: each command's options are declared in modules that load no torch (the
    configs, `dflash_cache.target.spec`, the manifest's codec names), 0.2-0.7 s against 1.7 s before."""
    code = ("import sys; from dflash_cache.cli import cli\n"
            "for name in sorted(cli.commands):\n"
            "    cli([name, '--help'], standalone_mode=False)\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('dflash_cache'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def test_every_option_of_every_command_has_help():
    for name, command in cli.commands.items():
        ctx = click.Context(command, info_name=name)
        for param in command.get_params(ctx):
            if isinstance(param, click.Option):
                assert param.help, (name, param.opts)


def test_ctrl_c_in_extract_is_one_line_and_exit_130(tmp_path, monkeypatch):
    """As `train` does: not click's bare `Aborted!` with exit status 1."""
    import dflash_cache.extract.run as run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "extract", interrupted)
    r = CliRunner().invoke(cli, ["extract", "--model", "tiny", "--data", "demo", "--out", str(tmp_path / "c")])
    assert r.exit_code == 130, r.output
    assert r.output.strip() == ("Interrupted: the committed segments are kept; run the same command again to finish "
                                "the rest."), r.output


# --- one-line errors: exit status 2, one 'Error:' line on stderr naming the problem and the fix, no
# traceback, and nothing half-written left behind -------------------------------------------------------

LIVE = ["--target", "tiny", "--device", "cpu", "--max-steps", "1", "--no-progress", "--live"]


def assert_refused(r, *needles: str) -> str:
    """`r` (a CliRunner result or a finished subprocess) was refused the way every user mistake is: exit
    status 2, its stderr ending in one 'Error:' line (the log lines before it aside) that holds each of
    `needles`, and no traceback; returns that line."""
    status = r.exit_code if hasattr(r, "exit_code") else r.returncode
    stderr = r.stderr
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert status == 2 and len(errors) == 1 and stderr.rstrip().endswith(errors[0]), (status, stderr)
    assert "Traceback" not in stderr and all(n in errors[0] for n in needles), stderr
    return errors[0]


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


_KEPT_FILESYSTEMS: list = []  # as fsspec keeps them, for the process: one collected logs an unclosed session


@pytest.fixture
def dead_s3(tmp_path, monkeypatch):
    """The environment of an S3 endpoint that does not answer (a local port bound but never listening:
    a connection is refused at once), test credentials (delete them to have none), one attempt per
    request (botocore retries a refused connection for seconds) and no credentials from this
    machine's files or its cloud's metadata service. fsspec keeps the filesystems it made, keyed by
    their arguments, not the environment: those made for other tests' S3 server are set aside
    meanwhile, and those made here are kept out of later tests' way."""
    import socket

    s3fs = pytest.importorskip("s3fs")
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    cache = s3fs.S3FileSystem._cache  # fsspec's instances of the class (clear_instance_cache empties it)
    saved = dict(cache)
    cache.clear()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        env = dict(AWS_ENDPOINT_URL=f"http://127.0.0.1:{sock.getsockname()[1]}", AWS_DEFAULT_REGION="us-east-1",
                   AWS_MAX_ATTEMPTS="1", AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=str(tmp_path / "none"),
                   AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_ACCESS_KEY_ID="test",
                   AWS_SECRET_ACCESS_KEY="test")
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        try:
            yield monkeypatch
        finally:
            _KEPT_FILESYSTEMS.extend(cache.values())
            cache.clear()
            cache.update(saved)


def test_an_s3_endpoint_that_does_not_answer_is_one_line(tmp_path, dead_s3):
    for args in (["inspect", "s3://bucket/cache"],
                 ["train", "--cache", "s3://bucket/cache", "--target", "tiny", "--out", str(tmp_path / "run")]):
        assert_refused(invoke(*args), "cannot read the cache at s3://bucket/cache: Could not connect",
                       "AWS_ENDPOINT_URL")
    assert not (tmp_path / "run").exists()


def test_s3_reads_without_credentials_say_how_to_give_them(dead_s3):
    dead_s3.delenv("AWS_ACCESS_KEY_ID")
    dead_s3.delenv("AWS_SECRET_ACCESS_KEY")
    assert_refused(invoke("inspect", "s3://bucket/cache"), "no credentials", "AWS_ACCESS_KEY_ID",
                   "AWS_SECRET_ACCESS_KEY")


def test_inspect_of_a_plain_file_says_it_is_a_file(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text("{}")
    line = assert_refused(invoke("inspect", str(path)), "is a file, not a cache directory")
    assert "does not exist" not in line


def test_data_that_is_a_fifo_or_a_device_is_one_line(tmp_path):
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    for data, kind in ((fifo, "named pipe"), ("/dev/zero", "character device")):
        out = tmp_path / "c"
        r = invoke("extract", "--model", "tiny", "--gpus", "cpu", "--data", str(data), "--out", str(out))
        assert_refused(r, f"dataset path {data} is a {kind}")
        assert not out.exists()
    assert_refused(invoke("train", "--out", str(tmp_path / "run"), *LIVE, "--data", str(fifo)), "named pipe")
    assert not (tmp_path / "run").exists()


def test_a_seed_out_of_range_is_refused_when_parsed(tmp_path):
    r = invoke("train", "--cache", str(tmp_path / "c"), "--target", "tiny", "--out", str(tmp_path / "run"),
               "--seed", str(2**70))
    assert r.exit_code == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1].startswith("Error: Invalid value for '--seed': 1180591620717411303424 is not in "
                                                "the range 0<=x<=4294967295"), r.stderr


def test_data_without_a_supervised_token_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "unsupervised.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 0, 0], [0, 0]]}), data)
    out = tmp_path / "c"
    r = invoke("extract", "--model", "tiny", "--gpus", "cpu", "--data", str(data), "--out", str(out))
    assert_refused(r, "no supervised token", "loss_mask 1")
    assert not out.exists()
    assert_refused(invoke("train", "--out", str(tmp_path / "run"), *LIVE, "--data", str(data)), "no supervised token")
    assert not (tmp_path / "run").exists()


def test_an_empty_layer_list_is_refused(tmp_path):
    out = tmp_path / "c"
    r = invoke("extract", "--model", "tiny", "--gpus", "cpu", "--data", "demo", "--out", str(out), "--layers", "")
    assert_refused(r, "--layers", "1,9,17")
    assert not out.exists()
    r = invoke("train", "--out", str(tmp_path / "run"), *LIVE, "--data", "demo", "--layers", " ")
    assert_refused(r, "--layers", "1,9,17")
    assert not (tmp_path / "run").exists()


def test_a_chat_template_with_the_demo_data_is_refused(tmp_path):
    """The demo rows are tokenized already: a template would be ignored silently."""
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    out = tmp_path / "c"
    r = invoke("extract", "--model", "tiny", "--gpus", "cpu", "--data", "demo", "--out", str(out),
               "--chat-template", str(template))
    assert_refused(r, "--chat-template", "--data demo")
    assert not out.exists()
    r = invoke("train", "--out", str(tmp_path / "run"), *LIVE, "--data", "demo", "--chat-template", str(template))
    assert_refused(r, "--chat-template", "--data demo")


def test_a_model_directory_without_weights_leaves_no_cache_and_the_rerun_works(tmp_path):
    from transformers import Qwen3ForCausalLM

    from dflash_cache.target.tiny import tiny_config

    model, out = tmp_path / "model", tmp_path / "c"
    tiny_config().save_pretrained(model)  # config.json alone
    args = ["extract", "--model", str(model), "--gpus", "cpu", "--data", "demo", "--limit", "4", "--out", str(out),
            "--no-progress"]
    assert_refused(invoke(*args), f"--model {model}", "no weight files")
    assert not out.exists()
    Qwen3ForCausalLM(tiny_config()).save_pretrained(model)
    r = invoke(*args)
    assert r.exit_code == 0, r.output


# --- eval, and the other commands that meet a target other than the one they were made for -----------------

def other_target(path: Path, **changes) -> Path:
    """A random tiny Qwen3 saved at `path`: the tiny target's config with `changes` (another target)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_cache.target.tiny import tiny_config

    config = {k: v for k, v in tiny_config().to_dict().items() if k != "layer_types"}
    Qwen3ForCausalLM(Qwen3Config(**{**config, **changes})).save_pretrained(path)
    return path


def eval_args(drafter: Path | str, *more: str, target: str = "tiny", data: str = "demo") -> list[str]:
    return ["eval", "--target", target, "--drafter", str(drafter), "--data", data, "--limit", "1",
            "--max-new-tokens", "2", "--device", "cpu", *more]


@pytest.fixture
def demo_export(tmp_path: Path) -> Path:
    """A writable copy of the committed demo drafter's export (config.json and model.safetensors)."""
    from tools.make_demo_drafter import ASSET_DIR

    out = tmp_path / "export"
    out.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(ASSET_DIR / name, out / name)
    return out


def edit_config(export: Path, edit) -> None:
    import json

    path = export / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def test_eval_refuses_a_drafter_trained_for_another_target(tmp_path, demo_export):
    """The demo drafter reads layers 1-5 of the 8-layer tiny target: a 10-layer target of the same width
    and vocabulary would run it and report a meaningless tau."""
    other = other_target(tmp_path / "other", num_hidden_layers=10)
    assert_refused(invoke(*eval_args(demo_export, target=str(other))), f"--drafter {demo_export}",
                   "config.json field target.num_hidden_layers is 8 (trained for target tiny)",
                   f"--target {other} has 10")


def test_eval_of_an_export_that_records_no_target_warns_once_and_runs(demo_export, caplog):
    edit_config(demo_export, lambda c: {k: v for k, v in c.items() if k != "target"})
    with caplog.at_level(logging.WARNING):
        r = invoke(*eval_args(demo_export))
    assert r.exit_code == 0 and "tau (tokens per target forward)" in r.output, r.output
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "cannot check" in warnings[0] and "--target tiny" in warnings[0], warnings


@pytest.mark.parametrize(("text", "says"), [
    ('{"architectures": ["DFlashDraftModel"],', "is not a readable JSON file"),
    ('{"architectures": ["DFlashDraftModel"], "hidden_size": 128}', "lacks intermediate_size"),
])
def test_eval_of_a_broken_or_incomplete_drafter_config_is_one_line(demo_export, text, says):
    (demo_export / "config.json").write_text(text)
    assert_refused(invoke(*eval_args(demo_export)), str(demo_export / "config.json"), says)


def test_eval_of_a_prompt_with_a_token_outside_the_vocabulary_is_one_line(tmp_path, demo_export):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"input_ids": [[5, 6, 7, 8], [9, 2048, 11, 12]], "loss_mask": [[0, 0, 1, 1]] * 2}), data)
    assert_refused(invoke(*eval_args(demo_export, "--limit", "2", data=str(data))), "row 1", "token id 2048",
                   "vocab size 2048")


def test_eval_and_train_refuse_a_bad_device_alike(tmp_path, demo_export):
    said = [assert_refused(invoke(*args, "--device", "gpu0"), "--device 'gpu0'")
            for args in (eval_args(demo_export), ["train", *LIVE, "--data", "demo", "--out", str(tmp_path / "run")])]
    assert said[0] == said[1]


def test_train_on_a_cache_of_another_target_names_both_targets(tmp_path):
    """The config hashes differ too, but the field named is the one a user recognises."""
    import dataclasses

    from dflash_cache.store.manifest import write_manifest
    from dflash_cache.target.model import TargetSpec, describe_target
    from tests.dflash_cache.store._util import make_manifest

    layers = (1, 2, 3, 4, 5)
    tiny = describe_target(TargetSpec(model="tiny", layers=layers)).identity
    cache = tmp_path / "cache"
    cache.mkdir()
    write_manifest(cache, dataclasses.replace(make_manifest(layer_ids=layers, hidden_size=128), target=tiny))
    other = other_target(tmp_path / "other", num_hidden_layers=10)
    r = invoke("train", "--cache", str(cache), "--allow-incomplete", "--target", str(other), "--out",
               str(tmp_path / "run"), "--device", "cpu", "--no-progress")
    assert_refused(r, "target.num_hidden_layers is 8 (extracted from target tiny)", f"--target {other} has 10")


def test_resume_with_another_target_names_this_runs_target(tmp_path):
    from dflash_cache.errors import UserError
    from dflash_cache.train.trainer import check_same_run

    shape = "--target (drafter shape)"
    with pytest.raises(UserError, match=r"target_num_hidden_layers = 8, this run's --target /models/other has 10;"):
        check_same_run({shape: {"target_num_hidden_layers": 8}}, {shape: {"target_num_hidden_layers": 10}},
                       tmp_path / "step_0000001", target="/models/other")
