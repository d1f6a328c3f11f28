"""Entry point of one per-GPU extraction worker (spawned by `dflash_cache.extract.run`, not run by hand)."""

from __future__ import annotations

import logging
import os
import sys

import torch

from dflash_cache.errors import UserError
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.extract.run import WORKER_CONFIG_ENV, run_rank, worker_job
from dflash_cache.store.segments import read_records


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = ExtractConfig.from_json(os.environ[WORKER_CONFIG_ENV])
    rank, world = int(os.environ["DFLASH_RANK"]), int(os.environ["DFLASH_WORLD_SIZE"])
    try:
        job = worker_job(cfg)
        committed = {r.name for r in read_records(job.root)}
        run_rank(job, committed, rank=rank, world=world, device=torch.device("cuda", 0))
    except UserError as e:
        print(f"Error (rank {rank}): {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
