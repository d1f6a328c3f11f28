"""The cache on disk: a manifest, a plan, one zarr segment per planned batch, commit records and
an index. Writers commit segments atomically; readers check everything they open."""
