"""Training data, as both phases read it: datasets and their file formats, chat rendering, the
built-in demo rows, the plan of work units and length buckets, and what `--data` becomes before
any feature is made (`dflash_cache.data.inputs`)."""
