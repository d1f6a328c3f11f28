"""The trainer stays made of parts: no class in train/ over MAX_CLASS_LINES lines, and no constructor
(`__init__`, or a classmethod: `build`, `from_*`...) taking more than MAX_CONSTRUCTOR_PARAMETERS
parameters (grouped into small dataclasses instead, whose fields are the grouping, so a dataclass's
generated `__init__` is not counted)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "train"
MAX_CLASS_LINES = 250
MAX_CONSTRUCTOR_PARAMETERS = 6


def _decorators(node: ast.FunctionDef | ast.ClassDef) -> set[str]:
    names = set()
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        names.add(target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", ""))
    return names


def _parameters(fn: ast.FunctionDef) -> int:
    """Parameters a caller can pass (self or cls left out; *args and **kwargs count one each)."""
    a = fn.args
    named = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
    return named - 1 + (a.vararg is not None) + (a.kwarg is not None)


def offenders(paths: list[Path], root: Path = ROOT) -> list[str]:
    """Each class over MAX_CLASS_LINES lines and each constructor over MAX_CONSTRUCTOR_PARAMETERS
    parameters in `paths`, as 'path:line what' (paths relative to `root`)."""
    found = []
    for path in paths:
        name = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_CLASS_LINES:
                found.append(f"{name}:{node.lineno} class {node.name}: {lines} lines")
            for item in node.body:
                constructor = isinstance(item, ast.FunctionDef) and (
                    item.name == "__init__" or "classmethod" in _decorators(item))
                if constructor and _parameters(item) > MAX_CONSTRUCTOR_PARAMETERS:
                    found.append(f"{name}:{item.lineno} {node.name}.{item.name}: {_parameters(item)} parameters")
    return found


def test_no_class_in_train_is_large_and_no_constructor_takes_many_parameters():
    found = offenders(sorted(TRAIN.glob("*.py")))
    print("\n".join(found) or "no offenders")
    assert not found, "\n" + "\n".join(found)


def test_the_check_finds_a_large_class_and_a_long_constructor(tmp_path):
    """The check can fail: a class one line too long, and constructors one parameter over (a
    keyword-only one, a **kwargs); one at the limit passes."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    params = ", ".join(f"p{i}" for i in range(MAX_CONSTRUCTOR_PARAMETERS))
    probe = tmp_path / "probe.py"
    probe.write_text(f"class Long:\n{body}\n\n"
                     f"class Wide:\n    def __init__(self, {params}, *, extra=None):\n        pass\n\n"
                     f"    @classmethod\n    def build(cls, {params}, **kw):\n        pass\n\n"
                     f"class Fine:\n    def __init__(self, {params}):\n        pass\n")
    found = [line.split(" ", 1)[1] for line in offenders([probe], root=tmp_path)]
    assert found == [f"class Long: {MAX_CLASS_LINES + 1} lines",
                     f"Wide.__init__: {MAX_CONSTRUCTOR_PARAMETERS + 1} parameters",
                     f"Wide.build: {MAX_CONSTRUCTOR_PARAMETERS + 1} parameters"], found
