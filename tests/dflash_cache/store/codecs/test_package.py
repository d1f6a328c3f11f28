"""The codecs package: imports that flow one way (no cycle broken only by import order), the names
code outside the store imports, and the one place that picks each codec's implementation on a GPU."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest
import torch

from dflash_cache.store import codecs
from dflash_cache.store.codecs import dispatch, fp4, fp8

PACKAGE = Path(codecs.__file__).parent
PREFIX = "dflash_cache.store"
# What each module of the package may import from the store: the leaves nothing, each codec the leaves.
LEAVES = {"base", "dispatch"}
ALLOWED = {"base": set(), "dispatch": set(), "bf16": LEAVES, "fp8": LEAVES, "fp4": LEAVES}


def _store_imports(path: Path) -> set[str]:
    """The store modules a file imports, as dotted names (`from pkg import mod` counts as pkg.mod)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(PREFIX)}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PREFIX):
            subs = {f"{node.module}.{a.name}" for a in node.names}
            modules = {s for s in subs if importlib.util.find_spec(s) is not None} if node.module == f"{PREFIX}.codecs" \
                else set()
            found |= modules or {node.module}
    return found


def test_imports_flow_from_the_leaves_to_the_registry():
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert modules == set(ALLOWED)
    for name in modules:
        imported = {m.removeprefix(f"{PREFIX}.codecs.") for m in _store_imports(PACKAGE / f"{name}.py")}
        assert imported <= ALLOWED[name], f"codecs/{name}.py imports {sorted(imported - ALLOWED[name])}"


def test_store_modules_use_the_package_not_the_old_fp4_fp8_paths():
    """No store module reaches a codec but through the package."""
    for path in PACKAGE.parent.rglob("*.py"):
        assert not {f"{PREFIX}.fp4", f"{PREFIX}.fp8"} & _store_imports(path), path


@pytest.mark.parametrize("name", ["CODECS", "TOKEN_ARRAYS", "ArraySpec", "get_codec", "numpy_to_torch",
                                  "to_stored_numpy"])
def test_the_registry_keeps_the_names_imported_from_outside(name):
    assert hasattr(codecs, name)


@pytest.mark.parametrize("module", ["fp4", "fp8"])
def test_the_codecs_live_only_in_the_package(module):
    """One home per codec: the old `dflash_cache.store.fp4`/`.fp8` modules are gone, not re-exported."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"{PREFIX}.{module}")


def test_dispatch_picks_the_gpu_path_of_each_codec(monkeypatch):
    """Off a GPU every codec runs its torch reference; what `dispatch` answers is what runs."""
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert not dispatch.fp8_runs_triton(x) and not dispatch.fp4_encode_compiled(x)
    monkeypatch.setattr(dispatch, "fp8_runs_triton", lambda t: True)
    monkeypatch.setattr(fp8, "quantize_fp8_triton", lambda *a: "triton")
    monkeypatch.setattr(fp8, "dequantize_fp8_triton", lambda *a: "triton")
    q, s = fp8.quantize_fp8_torch(x, 1)
    assert fp8.quantize_fp8(x, 1) == "triton" and fp8.dequantize_fp8(q, s, 1) == "triton"
    monkeypatch.setattr(dispatch, "fp4_encode_compiled", lambda t: True)
    monkeypatch.setattr(fp4, "_compiled_quantize_layout", lambda: lambda *a: "compiled")
    assert fp4.quantize_fp4_layout(x, 1) == "compiled"


def test_every_package_is_in_the_wheel():
    """pyproject.toml's package search finds every package under dflash_cache (through the phase
    links too): a subpackage it missed (the codecs) would import from a checkout and be absent from
    every install."""
    import os
    import tomllib

    from setuptools import find_packages

    repo = PACKAGE.parents[2]
    include = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    found = set(find_packages(str(repo), include=include))
    packages = {".".join(Path(d).relative_to(repo).parts) for d, _, files in os.walk(repo / "dflash_cache", followlinks=True)
                if "__init__.py" in files}
    assert "dflash_cache.store.codecs" in packages and packages - found == set()
