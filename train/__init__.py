"""Phase 2: the DFlash drafter, its loss and its trainer, fed packed batches by a source (the cache
or the live target)."""
