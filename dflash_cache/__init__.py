"""dflash-cache: an offline-cached two-phase trainer for DFlash drafters.

Phase 1 (`dflash_cache.extract`) writes the target's hidden states to a chunked zarr store
(`dflash_cache.store`); phase 2 (`dflash_cache.train`) streams that store into the drafter. The
packed batch (`dflash_cache.store.batch`) is the one contract the writer, the reader, the live
source and the trainer share. What both phases use lives beside them, never inside either: the
target (`dflash_cache.target`: loading, hidden-state capture, the built-in tiny target), the data
(`dflash_cache.data`: datasets, chat rendering, the demo rows, planning), devices and ranks
(`dflash_cache.devices`) and the launcher that starts one rank per device (`dflash_cache.launch`).
"""

__version__ = "0.1.0"
