"""The checkout's file tree is the import tree: extract/ and train/ are dflash_cache.extract and
dflash_cache.train through the links dflash_cache/extract and dflash_cache/train, so a regular wheel
install, the repository root (which shadows an installed package) and static tools agree."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("extract", "train")


def test_the_phase_folders_are_linked_into_the_package():
    for phase in PHASES:
        link = ROOT / "dflash_cache" / phase
        assert link.is_symlink() and os.readlink(link) == f"../{phase}", link
        assert link.resolve() == (ROOT / phase).resolve()


def test_a_wheel_holds_the_phases_and_the_repository_root_imports_them(tmp_path):
    """Build a regular (non-editable) wheel, put only it on the path, and look the phases up from the
    repository root the way `python -c` there does (the checkout's dflash_cache comes first)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, cwd=tmp_path)
    wheel = next(tmp_path.glob("dflash_cache-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"dflash_cache/extract/run.py", "dflash_cache/train/trainer.py",
            "dflash_cache/train/remote_code/dflash.py", "dflash_cache/target/tiny_target/config.json"} <= names
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    find = ("import importlib.util as u; "
            "print(u.find_spec('dflash_cache.extract.run').origin); print(u.find_spec('dflash_cache.train.trainer').origin)")
    # -S: no site-packages, so no editable install answers instead; find_spec imports only the packages'
    # light __init__ files.
    out = subprocess.run([sys.executable, "-S", "-c", find], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(unpacked)},
                         check=True, capture_output=True, text=True).stdout.split()
    assert out == [str(ROOT / "dflash_cache" / "extract" / "run.py"), str(ROOT / "dflash_cache" / "train" / "trainer.py")]
