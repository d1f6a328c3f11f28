"""Phase 2: the DFlash drafter and its trainer (not yet implemented; the cache reader API in
`dflash_cache.reader` is what it will build on)."""
