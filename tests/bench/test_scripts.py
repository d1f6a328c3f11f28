"""The benchmark scripts run as modules of the `bench` package (`python3 -m bench.x` from the repository
root): none reaches its imports by editing the import path, and each one's --help names that command."""

from __future__ import annotations

import ast
import contextlib
import io
import runpy
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())


def test_no_bench_module_edits_the_import_path() -> None:
    edits = [f"{p.name}:{node.lineno}" for p in sorted(BENCH.glob("*.py"))
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "path"
             and isinstance(node.value, ast.Name) and node.value.id == "sys"]
    assert not edits, f"sys.path used in bench/ (run the scripts with python3 -m bench.x instead): {edits}"


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # bench modules other tests imported
@pytest.mark.parametrize("name", SCRIPTS)
def test_help_names_the_module_command(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run as `python3 -m` runs it (runpy), in this process: the imports resolve and --help prints, GPU or not."""
    monkeypatch.setattr("sys.argv", [str(BENCH / f"{name}.py"), "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        runpy.run_module(f"bench.{name}", run_name="__main__")
    assert done.value.code == 0
    assert out.getvalue().startswith(f"usage: python3 -m bench.{name} ")
