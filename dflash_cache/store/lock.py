"""An exclusive, advisory lock on a cache, so two extractions never write one cache at once (and
on a training run's directory, so two trainings never write one run).

The lock is an flock on `root/.lock`. A run that is refused or fails leaves nothing behind: if it
created the lock file (and the directory) itself, both are removed again on the way out. Because
lock files can be removed, a holder checks after locking that the path still names the file it
locked (otherwise two processes could hold locks on two different files of one name). That also
makes it safe for a holder to remove the lock file on its way out (`keep=False`: a lock beside a
user's own file, such as `regenerate`'s, should not outlive the run). A lock file left by a killed
process never blocks: the kernel drops a dead process's flock.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from dflash_cache.errors import UserError
from dflash_cache.store.layout import LOCK_FILE


class CacheLock:
    """`with CacheLock(root):` holds an flock on root/.lock; a second holder fails at once.

    `flag` names the option that chose `root`, for the error messages (None: no option did), and
    `what` what `guards` is (the path the lock is for, `root` by default). With `keep=False` the
    lock file goes when the lock does, however the run ends."""

    def __init__(self, root: Path, name: str = LOCK_FILE, *, flag: str | None = "--out", what: str = "cache",
                 guards: Path | None = None, keep: bool = True) -> None:
        self.path = root / name
        self.flag, self.what = flag, what
        self.guards = root if guards is None else guards
        self.keep = keep
        self._fd: int | None = None
        self._made_dir = False
        self._made_file = False

    def __enter__(self) -> CacheLock:
        root = self.path.parent
        try:
            self._made_dir = not root.exists()
            root.mkdir(parents=True, exist_ok=True)
            self._fd = self._acquire()
            os.ftruncate(self._fd, 0)
            os.write(self._fd, f"pid {os.getpid()}".encode())
        except OSError as e:
            self._release(remove=True)
            raise self._cannot_write(e) from None
        except UserError:
            self._release(remove=True)
            raise
        return self

    def _cannot_write(self, exc: OSError) -> UserError:
        reason = "disk full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else (exc.strerror or str(exc))
        fix = f"choose a writable {self.flag} with free space" if self.flag else "it must be writable, with free space"
        return UserError(f"cannot write to {self.path.parent} ({reason}); {fix}")

    def _open(self) -> int:
        """Open the lock file, noting whether this call created it."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            self._made_file = True
            return fd
        except FileExistsError:
            return os.open(self.path, os.O_RDWR)

    def _acquire(self) -> int:
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self._made_file = False  # someone else's file now
                holder = self.path.read_text().strip() or "another process"
                other = f" or choose another {self.flag}" if self.flag else ""
                raise UserError(f"{self.what} {self.guards} is being written by {holder}; wait for it to "
                                f"finish{other}") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)  # the file we locked was removed by its previous holder: lock the new one
            self._made_file = False

    def _release(self, *, remove: bool) -> None:
        """Unlock; with `remove`, first delete the lock file and directory if this lock created them
        (and the lock file when it is not kept, if this lock holds it)."""
        if (remove and self._made_file) or (not self.keep and self._fd is not None):
            self.path.unlink(missing_ok=True)  # while still locked, so nobody locks it in between
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        if remove and self._made_dir:
            try:
                self.path.parent.rmdir()  # only if empty: never anything but what we made
            except OSError:
                pass
        self._made_file = self._made_dir = False

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """A failed or refused run takes back the lock file and directory it created (the lock file
        goes in any case when it is not kept)."""
        self._release(remove=exc_type is not None)
