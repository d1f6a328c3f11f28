"""Compiled kernels kept with the run, so a restart on a fresh machine does not compile again.

torch.compile caches what it builds (FX graphs, Triton kernels, autotuning) in
TORCHINDUCTOR_CACHE_DIR, by default under /tmp, which a fresh container or another host does not
have. A resumed run always has its own directory (its checkpoints are there), so unless the user
chose a cache directory, the trainer points torch at `<out>/compile-cache`: the compile-bearing
first steps then take seconds instead of about a minute (on an NVIDIA H200, the bench's 4 warm-up
steps took 40.5 s with every cache empty and 8.2 s with only this one, the machine's caches deleted).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
COMPILE_CACHE = "compile-cache"


def keep_compiled_kernels_in(out: Path) -> Path:
    """Point torch's compile cache at `out/compile-cache` unless the user chose one; returns the
    directory in use. Call before the first compilation of the process. Importing torch's compiler
    already fills the variable in with its default, so that value counts as not chosen."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get(CACHE_ENV)
    if chosen is not None and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    directory = (out / COMPILE_CACHE).absolute()
    os.environ[CACHE_ENV] = str(directory)
    log.info("compiled kernels are cached in %s (set %s to choose another place)", directory, CACHE_ENV)
    return directory


__all__ = ["CACHE_ENV", "COMPILE_CACHE", "keep_compiled_kernels_in"]
