"""An exclusive, advisory lock on a cache, so two extractions never write one cache at once."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from dflash_cache.errors import UserError

LOCK_FILE = ".lock"


class CacheLock:
    """`with CacheLock(root):` holds an flock on root/.lock; a second holder fails at once."""

    def __init__(self, root: Path, name: str = LOCK_FILE) -> None:
        self.path = root / name
        self._fd: int | None = None

    def __enter__(self) -> CacheLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = self.path.read_text().strip() or "another process"
            raise UserError(
                f"cache {self.path.parent} is being written by {holder}; wait for it to finish "
                "or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}".encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
