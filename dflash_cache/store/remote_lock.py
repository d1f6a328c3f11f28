"""The lock of a cache on object storage: an object naming its holder, kept alive while it writes.

An object store has no flock, so `<prefix>/.lock` holds {"owner": "host pid id", "expires": unix
time}. A run takes it when there is none or the one there has expired (its holder was killed, or
lost its network for longer than the lock lasts): it writes its own, with a conditional create
where the store supports one (S3 does), and reads it back to confirm that it won. While the run
writes, a daemon thread rewrites the expiry every third of the lock's lifetime; leaving the
`with` block deletes the object if it is still ours, so a refused or failed run leaves nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from dflash_cache.errors import UserError, one_line
from dflash_cache.files import json_bytes
from dflash_cache.store.destination import RemoteDestination
from dflash_cache.store.location import is_url
from dflash_cache.store.lock import LOCK_FILE, CacheLock

log = logging.getLogger(__name__)
LOCK_TTL = 600.0  # seconds a lock lasts without its heartbeat
MAX_LOCK_BYTES = 4096


@dataclass(frozen=True)
class Holder:
    """What a lock object says: who holds it, and until when (unix time)."""

    owner: str
    expires: float

    @classmethod
    def parse(cls, data: bytes) -> Holder:
        """ValueError unless `data` is a lock object as `RemoteLock` writes it."""
        if len(data) > MAX_LOCK_BYTES:
            raise ValueError(f"more than {MAX_LOCK_BYTES} bytes")
        try:
            obj = json.loads(data)
        except RecursionError:
            raise ValueError("nested too deeply") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("owner"), str) \
                or type(obj.get("expires")) not in (int, float):
            raise ValueError("expected an object with a string owner and a numeric expires")
        return cls(obj["owner"], float(obj["expires"]))

    @property
    def when(self) -> str:
        return datetime.fromtimestamp(self.expires).astimezone().isoformat(timespec="seconds")


class RemoteLock:
    """`with RemoteLock(url):` holds `url/.lock` (or `url/<name>`); a second holder fails at once while it lasts.

    `ttl` is how long the lock lasts unless renewed (the heartbeat renews it every ttl / 3);
    `flag` names the option that chose `url`, for the error messages (None: no option did)."""

    def __init__(self, url: str, *, ttl: float = LOCK_TTL, flag: str | None = "--out", name: str = LOCK_FILE) -> None:
        self.dest = RemoteDestination(url)
        self.name = name
        self.key = f"{self.dest.path}/{name}"
        self.ttl, self.flag = ttl, flag
        self.owner = f"{socket.gethostname()} {os.getpid()} {uuid.uuid4().hex[:12]}"
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def __enter__(self) -> RemoteLock:
        with self.dest.guard():
            try:
                self._take()
            except BaseException:
                with contextlib.suppress(UserError, *self.dest.errors):
                    self._release()  # ours if written before the failure; never another run's
                raise
        self._heartbeat = threading.Thread(target=self._keep_alive, name="dflash-cache-lock", daemon=True)
        self._heartbeat.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        try:
            self._release()
        except (UserError, *self.dest.errors) as e:
            log.warning("could not remove the lock %s (%s); it expires by itself", self._url, one_line(e))

    @property
    def _url(self) -> str:
        return f"{self.dest.url}/{self.name}"

    def _take(self) -> None:
        held = self._read()
        if held is not None and held.owner != self.owner and held.expires > time.time():
            raise self._busy(held)
        if held is not None:
            log.warning("taking over the lock on %s: %s let it expire at %s", self.dest, held.owner, held.when)
        try:
            self._write(create=held is None)  # two runs that both found none: the store lets one create it
        except FileExistsError:
            pass  # the other run's: the read below names it
        won = self._read()
        if won is None or won.owner != self.owner:
            raise self._busy(won)

    def _busy(self, held: Holder | None) -> UserError:
        other = f" or choose another {self.flag}" if self.flag else ""
        who = f"{held.owner} (lock expires at {held.when})" if held else "another run"
        return UserError(f"cache {self.dest} is being written by {who}; wait for it to finish{other}")

    def _read(self) -> Holder | None:
        try:
            data = self.dest.fs.cat_file(self.key, start=0, end=MAX_LOCK_BYTES + 1)
        except FileNotFoundError:
            return None
        try:
            return Holder.parse(data)
        except ValueError as e:
            raise UserError(f"{self._url} is not a dflash-cache lock ({e}); delete it if no run is writing the "
                            "cache") from None

    def _write(self, *, create: bool = False) -> None:
        data = json_bytes({"owner": self.owner, "expires": time.time() + self.ttl})
        self.dest.fs.pipe_file(self.key, data, mode="create" if create else "overwrite")

    def _keep_alive(self) -> None:
        """Renew the expiry every ttl / 3 while the run writes; a failed renewal is retried at the
        next beat (the lock still lasts until its expiry)."""
        while not self._stop.wait(self.ttl / 3):
            try:
                held = self._read()
                if held is None or held.owner != self.owner:
                    log.error("the lock on %s is no longer ours (%s took it after it expired); another run may "
                              "be writing this cache", self.dest, held.owner if held else "someone")
                    return
                self._write()
            except (UserError, *self.dest.errors) as e:
                log.warning("could not renew the lock on %s (%s); retrying", self.dest, one_line(e))

    def _release(self) -> None:
        """Delete the lock object if it is ours."""
        held = self._read()
        if held is not None and held.owner == self.owner:
            self.dest.fs.rm_file(self.key)


def lock_for(out: Path | str, *, flag: str | None = "--out", name: str = LOCK_FILE) -> CacheLock | RemoteLock:
    """The lock `name` of the cache at `out`: an flock for a directory, a lock object for a URL."""
    return RemoteLock(out, flag=flag, name=name) if is_url(out) else CacheLock(Path(out), name=name, flag=flag)
