# dflash-cache recipes. `just --list` shows them.

demo_out := "demo-out"

# Install the package and its dev tools into the active environment (CPU torch from the local pin).
setup:
    python3 -m pip install torch==2.13.0 -e '.[dev]'

# The whole test suite (CPU only; Triton kernels run under the interpreter in subprocesses).
test *args:
    python3 -m pytest tests {{args}}

# Phase 1 on the built-in tiny target and demo data, then inspect and verify the cache.
# Run it twice: the second run resumes and finds nothing left to do.
demo:
    dflash-cache extract --model tiny --data demo --out {{demo_out}}/cache --gpus all --codec fp8 \
        --token-budget 4096 --max-rows 16 --unit-rows 64 --buckets 0,128,192,256
    dflash-cache inspect {{demo_out}}/cache --verify --sample 0

lint:
    ruff check .

# GPU benchmark of phase 1 (an NVIDIA GPU; see bench/extract.py --help).
bench-extract *args:
    python3 bench/extract.py {{args}}
