"""Model code that `dflash_cache.train.export` ships next to an exported drafter's config.json.

The modules here are copied verbatim into export directories and imported by transformers'
`trust_remote_code` loader, so each must stay self-contained (torch and transformers only).
"""
