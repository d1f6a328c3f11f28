"""The lock of a cache on object storage: an object naming its holder, kept alive while it writes.

An object store has no flock, so `<prefix>/.lock` holds {"owner": "host pid id", "expires": unix
time}. A run takes it when there is none or the one there has expired (its holder was killed, or
lost its network for longer than the lock lasts). On S3 every change is a conditional write, so
two runs can never both believe they hold it:

* none there: a conditional create (`If-None-Match: *`); of two runs that both found none, the
  store lets one create it.
* an expired one: an overwrite only if the object is still the version read as expired
  (`If-Match: <its ETag>`); of two runs that both found it expired, the store lets the first one
  replace it and refuses the other, whose ETag is gone.
* the heartbeat (a daemon thread, every third of the lock's lifetime) rewrites the expiry only if
  the object is still our last write (`If-Match`), so it never clobbers a run that took the lock
  over after ours expired (renewals that failed for longer than the lock lasts); that holder
  notices instead, logs an error, and its `with` block fails when it ends.
* leaving the `with` block deletes the object only if it is still ours (`If-Match` again).

Other stores (and S3-compatible ones that answer NotImplemented to these headers, or a botocore
too old to send If-Match) get a best-effort fallback, with a warning once: the lock is overwritten and read back to confirm, and
the heartbeat reads before it rewrites, which leaves a window in which two runs that take over one
expired lock at the same moment both believe they won.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from dflash_cache.errors import UserError, one_line
from dflash_cache.files import json_bytes
from dflash_cache.store.destination import RemoteDestination
from dflash_cache.store.layout import LOCK_FILE
from dflash_cache.store.location import is_url
from dflash_cache.store.lock import CacheLock

log = logging.getLogger(__name__)
LOCK_TTL = 600.0  # seconds a lock lasts without its heartbeat
MAX_LOCK_BYTES = 4096
TAKE_ATTEMPTS = 3  # reads of the lock one `with` makes before it gives up on a lock that keeps changing
# S3's answers to a conditional request whose condition did not hold: the object changed (or
# appeared) since it was read, or another conditional write to it was in flight.
_REFUSED = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}
_UNSUPPORTED = {"NotImplemented", "501"}


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


@dataclass(frozen=True)
class Found:
    """A lock object as read, with the ETag of that very version: what a conditional write names
    to replace exactly it (None where the store has no conditional writes)."""

    holder: Holder
    etag: str | None


def _s3_code(exc: BaseException) -> str | None:
    """The S3 error code behind `exc` (s3fs translates botocore's error and keeps it as the cause)."""
    for e in (exc, exc.__cause__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            return error.get("Code") or str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")) or None
    return None


def _unsupported(exc: OSError) -> bool:
    """Whether the store refused a conditional header it does not implement (501)."""
    return exc.errno == errno.ENOSYS or _s3_code(exc) in _UNSUPPORTED


async def _get_with_etag(fs: Any, key: str, limit: int) -> tuple[bytes, str]:
    """At most `limit` bytes of `key` and their ETag, from one GET: a HEAD and a GET could pair one
    version's ETag with another version's bytes."""
    bucket, name, _ = fs.split_path(key)
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=name)
    body = resp["Body"]
    try:
        data = b""
        while len(data) < limit and (chunk := await body.read(limit - len(data))):
            data += chunk
        return data, resp["ETag"]
    finally:
        body.close()


def _why_best_effort(fs: Any) -> str | None:
    """None where `fs` sends S3's conditional headers (s3fs, with a botocore that knows If-Match:
    s3fs drops the parameters its botocore does not know, which would make a write silently
    unconditional); otherwise why the lock there is best effort."""
    s3fs = sys.modules.get("s3fs")  # loaded if `fs` is its
    if s3fs is None or not isinstance(fs, s3fs.S3FileSystem):
        return "the store has no conditional writes"
    if "IfMatch" not in fs.s3.meta.service_model.operation_model("PutObject").input_shape.members:
        return "this botocore cannot send If-Match; upgrade it"
    return None


class RemoteLock:
    """`with RemoteLock(url):` holds `url/.lock` (or `url/<name>`); a second holder fails at once while it lasts.

    `ttl` is how long the lock lasts unless renewed (the heartbeat renews it every ttl / 3);
    `flag` names the option that chose `url`, for the error messages (None: no option did).
    `lost` is set once the heartbeat finds that another run took the lock over (or it was deleted)."""

    def __init__(self, url: str, *, ttl: float = LOCK_TTL, flag: str | None = "--out", name: str = LOCK_FILE) -> None:
        self.dest = RemoteDestination(url)
        self.name = name
        self.key = f"{self.dest.path}/{name}"
        self.ttl, self.flag = ttl, flag
        self.owner = f"{socket.gethostname()} {os.getpid()} {uuid.uuid4().hex[:12]}"
        self.lost = threading.Event()
        self._conditional = False  # whether the store takes conditional writes: known once `_take` asks
        self._etag: str | None = None  # of our last write, which a renewal or release must still find there
        self._warned = False  # the best-effort warning, logged once per lock
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

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """Release the lock. A block that ran to its end after the lock was lost fails instead, since
        another run may have written the cache at the same time (the lock is left to its new holder)."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        if self.lost.is_set():
            if exc_type is None:
                raise UserError(f"the lock on {self.dest} was taken over or deleted while this run wrote, so another "
                                "run may have written the cache at the same time; once none is writing it, check "
                                f"it with `dflash-cache inspect --verify {self.dest}`")
            return
        try:
            self._release()
        except (UserError, *self.dest.errors) as e:
            log.warning("could not remove the lock %s (%s); it expires by itself", self._url, one_line(e))

    @property
    def _url(self) -> str:
        return f"{self.dest.url}/{self.name}"

    def _take(self) -> None:
        """Write our lock over none or an expired one, each write conditional on the version read;
        after a refused write, read again: the run that wrote first is named, or our own write is
        found (a request s3fs retried after the store had taken it). Without conditional writes the
        next read is the read-back that confirms ours."""
        why_best_effort = _why_best_effort(self.dest.fs)
        self._conditional = why_best_effort is None
        for _ in range(TAKE_ATTEMPTS):
            found = self._read()
            if found is not None and found.holder.owner == self.owner:
                self._etag = found.etag
                return
            if found is not None and found.holder.expires > time.time():
                raise self._busy(found.holder)
            if found is not None:
                log.warning("taking over the lock on %s: %s let it expire at %s", self.dest, found.holder.owner,
                            found.holder.when)
                if why_best_effort is not None:
                    self._warn_best_effort(why_best_effort)
            if self._put(create=found is None, etag=found.etag if found else None) and self._conditional:
                return
        raise self._busy(None)

    def _busy(self, held: Holder | None) -> UserError:
        other = f" or choose another {self.flag}" if self.flag else ""
        who = f"{held.owner} (lock expires at {held.when})" if held else "another run"
        return UserError(f"cache {self.dest} is being written by {who}; wait for it to finish{other}")

    def _read(self) -> Found | None:
        fs = self.dest.fs
        try:
            if self._conditional:
                from fsspec.asyn import sync

                # fsspec's sync is untyped (pyright infers None): it returns what _get_with_etag returns
                data, etag = cast(tuple[bytes, str],
                                  sync(fs.loop, _get_with_etag, fs, self.key, MAX_LOCK_BYTES + 1))
            else:
                data, etag = fs.cat_file(self.key, start=0, end=MAX_LOCK_BYTES + 1), None
        except FileNotFoundError:
            return None
        try:
            return Found(Holder.parse(data), etag)
        except ValueError as e:
            raise UserError(f"{self._url} is not a dflash-cache lock ({e}); delete it if no run is writing the "
                            "cache") from None

    def _put(self, *, create: bool = False, etag: str | None = None) -> bool:
        """Write our lock with a fresh expiry: with `create` only where there is none, with `etag`
        only over that version (where the store has conditional writes). False if the store
        refused because the object is no longer what was read."""
        data = json_bytes({"owner": self.owner, "expires": time.time() + self.ttl})
        condition: dict[str, str] = {"mode": "create"} if create else \
            {"IfMatch": etag} if etag is not None and self._conditional else {}
        try:
            out = self.dest.fs.pipe_file(self.key, data, **condition)
        except FileExistsError:
            return False
        except FileNotFoundError as e:
            if "IfMatch" in condition and _s3_code(e) == "NoSuchKey":
                return False  # deleted since it was read
            raise
        except OSError as e:
            if condition and _s3_code(e) in _REFUSED:
                return False
            if not condition or not _unsupported(e):
                raise
            self._conditional = False
            self._warn_best_effort(f"it refuses conditional writes: {one_line(e)}")
            out = self.dest.fs.pipe_file(self.key, data)
        self._etag = out.get("ETag") if isinstance(out, dict) else None
        return True

    def _warn_best_effort(self, why: str) -> None:
        """Once per lock: the lock there cannot keep two takers apart."""
        if not self._warned:
            self._warned = True
            log.warning("locks on %s are best effort (%s): two runs that take over an expired lock at the same "
                        "moment could both write the cache", self.dest, why)

    def _renew(self) -> None:
        """Rewrite the expiry, on S3 only over our last write; set `lost` if another run has the lock."""
        if self._conditional and self._etag is not None and self._put(etag=self._etag):
            return
        found = self._read()  # refused, or no conditional writes: whose is it now?
        if found is None or found.holder.owner != self.owner:
            self.lost.set()
            log.error("lost the lock on %s: %s; another run may be writing this cache at the same time", self.dest,
                      f"{found.holder.owner} took it over after ours expired" if found else "its object was deleted")
        elif not self._conditional or self._etag is None:
            self._put(etag=found.etag)  # over the version just read (best effort without conditional writes)
        else:
            self._etag = found.etag  # our own write, landed by a request s3fs retried: renewed already

    def _keep_alive(self) -> None:
        """Renew the expiry every ttl / 3 while the run writes; a failed renewal is retried at the
        next beat (the lock still lasts until its expiry, and past it while nobody takes it over)."""
        while not self._stop.wait(self.ttl / 3) and not self.lost.is_set():
            try:
                self._renew()
            except (UserError, *self.dest.errors) as e:
                log.warning("could not renew the lock on %s (%s); retrying", self.dest, one_line(e))

    def _release(self) -> None:
        """Delete the lock object if it is ours: on S3 only the version read as ours, so a run that
        took it over in between keeps it."""
        found = self._read()
        if found is None or found.holder.owner != self.owner:
            return
        fs = self.dest.fs
        fs.invalidate_cache(self.key)
        if self._conditional and found.etag is not None:
            bucket, name, _ = fs.split_path(self.key)
            try:
                fs.call_s3("delete_object", Bucket=bucket, Key=name, IfMatch=found.etag)
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if _s3_code(e) in _REFUSED:
                    return
                if not _unsupported(e):
                    raise
                self._warn_best_effort(f"it refuses conditional deletes: {one_line(e)}")
        fs.rm_file(self.key)


def lock_for(out: Path | str, *, flag: str | None = "--out", name: str = LOCK_FILE) -> CacheLock | RemoteLock:
    """The lock `name` of the cache at `out`: an flock for a directory, a lock object for a URL."""
    return RemoteLock(out, flag=flag, name=name) if is_url(out) else CacheLock(Path(out), name=name, flag=flag)
