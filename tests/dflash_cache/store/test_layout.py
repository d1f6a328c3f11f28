"""The cache's file tree has one owner, `dflash_cache.store.layout`: its names, its helpers, and the
old import paths that code outside the store still uses."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import zarr.core.common

from dflash_cache.store import layout

STORE = Path(layout.__file__).parent
NAMES = {layout.ZARR_JSON, layout.MANIFEST_FILE, layout.PLAN_FILE, layout.INDEX_FILE, layout.CREATING_FILE,
         layout.LOCK_FILE, layout.SEGMENTS_DIR, layout.COMMITS_DIR, layout.RECORD_SUFFIX}
FILE_NAMES = {n for n in NAMES if "." in n.strip(".")}  # manifest.json, ...: never part of a message's words

# Names that code outside the store imports from the module that used to define them: each must stay
# the layout's own object until those imports switch to `dflash_cache.store.layout`.
OLD_PATHS = [
    ("dflash_cache.store.manifest", "MANIFEST_FILE"),
    ("dflash_cache.store.lock", "LOCK_FILE"),
    ("dflash_cache.store.segments", "segment_name"),
    ("dflash_cache.store.segments", "COMMITS_DIR"),
    ("dflash_cache.store.segments", "SEGMENTS_DIR"),
]


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the string constants that are docstrings (of the module, a class or a function)."""
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef | ast.FunctionDef))]
    return {id(n.body[0].value) for n in nodes
            if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_no_other_store_module_defines_a_cache_path_name():
    """No module of the store but the layout assigns a name of the tree to a constant, or spells a
    file name of it in code (docstrings and comments may)."""
    found = []
    for path in sorted(STORE.rglob("*.py")):
        if path.name == "layout.py":
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in tree.body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                found += [f"{path.name}:{node.lineno} {s!r}" for s in _strings(node.value) if s in NAMES]
        found += [f"{path.name}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
                  and any(name in n.value for name in FILE_NAMES)]
    assert found == []


@pytest.mark.parametrize(("module", "name"), OLD_PATHS)
def test_old_import_paths_give_the_layout_names(module, name):
    assert getattr(importlib.import_module(module), name) is getattr(layout, name)


def test_the_tree_is_drawn_with_every_name_and_zarr_agrees():
    assert layout.ZARR_JSON == zarr.core.common.ZARR_JSON
    assert all(name in layout.__doc__ for name in NAMES - {layout.RECORD_SUFFIX})


def test_segment_names_and_their_records():
    name = layout.segment_name(layout.MAX_UNIT, layout.MAX_BATCH)
    assert layout.is_segment_name(name) and layout.is_segment_name(layout.segment_name(0, 0))
    assert not layout.is_segment_name(layout.segment_name(layout.MAX_UNIT + 1, 0))
    assert not layout.is_segment_name(layout.segment_name(0, layout.MAX_BATCH + 1))
    rel = layout.record_rel(name)
    folder, file_name = rel.split("/")
    assert folder == layout.COMMITS_DIR and layout.record_segment(file_name) == name
    assert layout.record_path(Path("/c"), name) == Path("/c") / rel
    for stranger in (f"{file_name}.123.tmp", "u1-b1.json", f"{name}.txt", "notes.json"):
        assert layout.record_segment(stranger) is None, stranger
    assert layout.tmp_stem(f"{file_name}.123.tmp") == name and layout.tmp_stem(file_name) is None


def test_which_root_entries_are_the_caches_own():
    for ours in (*layout.CACHE_ENTRIES, f"{layout.MANIFEST_FILE}.77.tmp", f"{layout.INDEX_FILE}.8.tmp"):
        assert layout.is_cache_entry(ours), ours
    for theirs in (layout.LOCK_FILE, f"{layout.LOCK_FILE}-copy0", "mine.tmp", "notes.txt", f"{layout.MANIFEST_FILE}.bak"):
        assert not layout.is_cache_entry(theirs), theirs
    assert layout.is_lock_file(f"{layout.LOCK_FILE}-copy3") and not layout.is_lock_file(layout.CREATING_FILE)


def test_segment_dir_refuses_a_bad_name(tmp_path):
    from dflash_cache.errors import CacheCorruptError

    assert layout.segment_dir(tmp_path, "u000001-b00002") == (tmp_path / layout.SEGMENTS_DIR / "u000001-b00002").resolve()
    for bad in ("../x", "u1-b2", "u000001-b00002/../../x"):
        with pytest.raises(CacheCorruptError, match="bad segment name"):
            layout.segment_dir(tmp_path, bad)
