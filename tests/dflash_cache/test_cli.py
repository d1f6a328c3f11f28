"""The command line starts however it is launched, from a directory of the user's own scripts."""

from __future__ import annotations

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
