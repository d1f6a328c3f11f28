"""dflash-cache: an offline-cached two-phase trainer for DFlash drafters.

Phase 1 (`extract`) writes target hidden states to a chunked zarr store; phase 2 (`train`) streams
that store into the drafter. This package holds the store, its codecs, inspection and the CLI.
"""

__version__ = "0.1.0"
