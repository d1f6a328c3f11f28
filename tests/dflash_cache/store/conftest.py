"""Session-scoped real caches (tiny model, demo data, CPU), built once per codec on first use, and
an S3 server (moto's) for the modules that read or write caches on object storage."""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

_BUILT: dict[str, Path] = {}


def build_cache(out: Path, codec: str) -> Path:
    from dflash_cache.extract.config import ExtractConfig
    from dflash_cache.extract.run import extract
    from dflash_cache.store.plan import PlanConfig
    from dflash_cache.target.model import TargetSpec

    cfg = ExtractConfig(
        target=TargetSpec(model="tiny"), data="demo", out=str(out), codec=codec,
        plan=PlanConfig(token_budget=2048, max_rows=16, unit_rows=64), progress=False,
    )
    extract(cfg, "cpu", echo=lambda *a, **k: None)
    return out


@pytest.fixture(scope="session")
def demo_tokens() -> int:
    """Tokens in the demo dataset: not a constant, it changes whenever the tiny target is retrained."""
    from dflash_cache.data.demo import demo_table

    return sum(len(ids) for ids in demo_table().column("input_ids").to_pylist())


@pytest.fixture(scope="session")
def real_cache(tmp_path_factory):
    """real_cache(codec) -> path of a pristine cache (do not modify; copy it with `cache_copy`)."""

    def get(codec: str = "bf16") -> Path:
        if codec not in _BUILT:
            _BUILT[codec] = build_cache(tmp_path_factory.mktemp(f"cache_{codec}") / "cache", codec)
        return _BUILT[codec]

    return get


@pytest.fixture
def cache_copy(real_cache, tmp_path):
    """cache_copy(codec) -> a private copy of the real cache, safe to damage."""

    def get(codec: str = "bf16") -> Path:
        dst = tmp_path / f"cache_{codec}"
        shutil.copytree(real_cache(codec), dst, symlinks=True)
        return dst

    return get


@pytest.fixture(scope="session")
def s3_server():
    """An S3 server on a free local port; yields an s3fs filesystem on it. Credentials and the
    endpoint reach s3fs through the environment, as they would for a real bucket. One server for
    the session: fsspec keeps the filesystems it made (and their connections) for the process, so
    they must not outlive the server they talk to. Modules use buckets of their own."""
    s3fs = pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    requests = logging.getLogger("werkzeug")  # the server's line per request, captured by pytest: seconds
    level = requests.level                    # per extraction
    requests.setLevel(logging.WARNING)
    host, port, stop = _s3_app_server() or _all_services_server(moto_server)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "test")
        env.setenv("AWS_SECRET_ACCESS_KEY", "test")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        env.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        yield s3fs.S3FileSystem(skip_instance_cache=True)
    requests.setLevel(level)
    stop()


def _s3_app_server() -> tuple[str, int, Callable[[], None]] | None:
    """moto's S3 app alone on a free port: its all-services dispatcher (ThreadedMotoServer) lists
    moto's package folder and tries every service's URL patterns on each request, a third more CPU a
    request. The app lives in a moto module that is not public API: None if it has moved."""
    try:
        from moto.moto_server.werkzeug_app import MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server
    except ImportError:
        return None
    server = make_server("127.0.0.1", 0, create_backend_app("s3"), threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        thread.join()

    return *server.server_address[:2], stop


def _all_services_server(moto_server) -> tuple[str, int, Callable[[], None]]:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    return *server.get_host_and_port(), server.stop
