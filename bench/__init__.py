"""GPU benchmarks and studies, each a module run from the repository root: `python3 -m bench.train --help`.

Not installed with the package: `python3 -m` puts the working directory on the import path, so run
them from the repository root (or with it on PYTHONPATH).
"""
