"""Compiled kernels kept with the run (dflash_cache.train.compile_cache)."""

from __future__ import annotations

import os

from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from dflash_cache.train.compile_cache import CACHE_ENV, keep_compiled_kernels_in


def unset(monkeypatch) -> None:
    """Unset the variable, with monkeypatch restoring whatever it was, even what the code under
    test sets directly in os.environ."""
    monkeypatch.setenv(CACHE_ENV, "placeholder")
    monkeypatch.delenv(CACHE_ENV)


def test_the_run_directory_holds_the_compile_cache_unless_one_was_chosen(tmp_path, monkeypatch):
    unset(monkeypatch)
    got = keep_compiled_kernels_in(tmp_path / "run")
    assert got == (tmp_path / "run" / "compile-cache").absolute() and os.environ[CACHE_ENV] == str(got)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert keep_compiled_kernels_in(tmp_path / "run") == tmp_path / "mine"
    assert os.environ[CACHE_ENV] == str(tmp_path / "mine")
    monkeypatch.setenv(CACHE_ENV, default_cache_dir())  # what importing torch's compiler leaves there
    assert keep_compiled_kernels_in(tmp_path / "run") == (tmp_path / "run" / "compile-cache").absolute()


def test_torch_compiles_into_the_chosen_directory(tmp_path, monkeypatch):
    """What the setting is for: torch's inductor reads it when it compiles (checked through its own
    cache-directory function, without compiling anything)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    import dflash_cache.train.trainer  # noqa: F401  (importing the trainer imports torch's compiler)
    monkeypatch.setenv(CACHE_ENV, default_cache_dir())  # which then filled the variable in with its default
    keep_compiled_kernels_in(tmp_path / "run")
    assert cache_dir() == str((tmp_path / "run" / "compile-cache").absolute())
