"""Atomic, durable JSON files: write to a temporary name, fsync, rename, fsync the directory.

Everything the cache commits (manifest, segment records) goes through here, so a crash leaves
either the old file, the new file, or an ignorable ``*.tmp`` — never a torn one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".tmp"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def read_json(path: Path, *, max_bytes: int = 64 << 20) -> Any:
    """Read a JSON file, refusing absurd sizes before reading (caches come from strangers)."""
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"{path} is {size} bytes, more than the {max_bytes} a record may hold")
    with open(path, "rb") as f:
        return json.loads(f.read())
