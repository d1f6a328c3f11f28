"""One logging set-up for every entry point (the CLI, its launched ranks, tools and benchmarks), so
all of them print the same timestamped lines to stderr and keep third-party chatter down."""

from __future__ import annotations

import logging
import os

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"
NOISY_LOGGERS = ("httpx", "urllib3", "transformers", "torch")


def setup_logging(level: int = logging.INFO, prefix: str = "") -> None:
    """Log `level` and above to stderr; `prefix` (e.g. "[rank 1] ") marks lines of one process. A
    process whose root logger already has handlers (an embedding application, pytest) keeps them."""
    logging.basicConfig(level=level, format=prefix + FORMAT, datefmt=DATE_FORMAT)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def run_level(level: int, rank: int | None = None) -> int:
    """The level of a line that says what the whole run does: `level` on rank 0 (by default this
    process's torchrun RANK), debug on the others, whose copies of it would only repeat it."""
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    return level if rank == 0 else logging.DEBUG
