"""dflash-cache: an offline-cached two-phase trainer for DFlash drafters.

Phase 1 (`dflash_cache.extract`) writes the target's hidden states to a chunked zarr store
(`dflash_cache.store`); phase 2 (`dflash_cache.train`) streams that store into the drafter. The
packed batch (`dflash_cache.store.batch`) is the one contract the writer, the reader, the live
source and the trainer share.
"""

__version__ = "0.1.0"
