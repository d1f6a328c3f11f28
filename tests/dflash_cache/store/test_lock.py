"""`CacheLock`: one writer at a time, one-line errors, and nothing left behind by a refused run."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from dflash_cache.errors import UserError
from dflash_cache.store.layout import LOCK_FILE
from dflash_cache.store.lock import CacheLock


class Refused(Exception):
    pass


def test_second_holder_is_refused_with_one_line(tmp_path):
    with CacheLock(tmp_path):
        with pytest.raises(UserError, match=r"is being written by pid \d+; wait for it to finish or choose "
                                            r"another --out$"):
            CacheLock(tmp_path).__enter__()
    with CacheLock(tmp_path):  # released: the next holder gets it
        pass


def test_a_refused_run_takes_back_the_lock_file_and_directory_it_made(tmp_path):
    out = tmp_path / "new"
    with pytest.raises(Refused), CacheLock(out):
        raise Refused
    assert not out.exists()
    user_dir = tmp_path / "mine"
    user_dir.mkdir()
    (user_dir / "precious.txt").write_text("keep")
    with pytest.raises(Refused), CacheLock(user_dir):
        raise Refused
    assert [p.name for p in user_dir.iterdir()] == ["precious.txt"]


def test_a_lock_file_made_by_someone_else_is_kept(tmp_path):
    (tmp_path / LOCK_FILE).write_text("")
    with pytest.raises(Refused), CacheLock(tmp_path):
        raise Refused
    assert (tmp_path / LOCK_FILE).exists()
    with CacheLock(tmp_path / "ok"):  # a run that succeeds keeps its lock file
        pass
    assert (tmp_path / "ok" / LOCK_FILE).exists()


def test_a_lock_file_removed_by_its_holder_is_locked_afresh(tmp_path):
    """After a refused run removed its lock file, the next runs lock one new file between them."""
    with pytest.raises(Refused), CacheLock(tmp_path):
        raise Refused
    with CacheLock(tmp_path):
        with pytest.raises(UserError, match="is being written"):
            CacheLock(tmp_path).__enter__()


@pytest.mark.parametrize(("err", "reason"), [(errno.EROFS, "Read-only file system"), (errno.ENOSPC, "disk full"),
                                             (errno.EACCES, "Permission denied")])
def test_unwritable_location_is_one_line(tmp_path, monkeypatch, err, reason):
    def refuse(self, *_a, **_k):
        raise OSError(err, "Read-only file system" if err == errno.EROFS else "Permission denied")

    monkeypatch.setattr(Path, "mkdir", refuse)
    out = tmp_path / "c"
    with pytest.raises(UserError) as info:
        CacheLock(out).__enter__()
    assert str(info.value) == f"cannot write to {out} ({reason}); choose a writable --out with free space"
    with pytest.raises(UserError, match=r"\); it must be writable, with free space$"):
        CacheLock(out, flag=None).__enter__()
