# dflash-cache recipes. `just --list` shows them.

demo_out := "demo-out"

# Install the package and its dev tools into the active environment (CPU torch from the local pin).
setup:
    python3 -m pip install torch==2.13.0 -e '.[dev]'

# The whole test suite (CPU only; Triton kernels run under the interpreter in subprocesses; one worker
# per core, as pyproject.toml's pytest options say: `just test -n 0` runs it in one process).
test *args:
    python3 -m pytest tests {{args}}

# The GPU tests (an NVIDIA GPU), in two parts that each finish within 10 minutes on a fresh H200.
# One process, since xdist's workers would all compile on the one GPU at once (`-k` picks a part).
test-gpu *args: (test-gpu-unit args) (test-gpu-cli args)

# Part 1: compiled masks, kernels and layers, short training runs, GPU extraction (6-9 minutes, mostly compiling).
test-gpu-unit *args:
    python3 -m pytest -n 0 tests/train/test_cuda.py tests/extract/test_cuda.py {{args}}

# Part 2: the whole job through the CLI with default options on mixed-length data and a 1.7B-shaped target,
# in two tests that each fit one 10-minute GPU call (`just test-gpu-cli -k offline`, `just test-gpu-cli -k live`).
test-gpu-cli *args:
    python3 -m pytest -n 0 -s tests/dflash_cache/test_cli_cuda.py {{args}}

# The two-phase job on the built-in tiny target and demo data: extract, inspect + verify, train.
# Run it twice: the second run resumes both phases and finds nothing left to do.
demo:
    dflash-cache extract --model tiny --data demo --out {{demo_out}}/cache --gpus all --codec fp8 \
        --token-budget 4096 --max-rows 16 --unit-rows 64 --buckets 0,128,192,256
    dflash-cache inspect {{demo_out}}/cache --verify --sample 0
    dflash-cache train --cache {{demo_out}}/cache --target tiny --out {{demo_out}}/run --resume \
        --block-size 8 --draft-layers 2 --num-anchors 16 --token-budget 2048 --lr 3e-3 --max-steps 200 --log-every 25

lint:
    ruff check .

# GPU benchmark of phase 1 (an NVIDIA GPU; see python3 -m bench.extract --help).
bench-extract *args:
    python3 -m bench.extract {{args}}

# GPU benchmark of phase 2 (an NVIDIA GPU; see python3 -m bench.train --help).
bench-train *args:
    python3 -m bench.train {{args}}

# GPU benchmark of train --live against each half alone and against offline (see python3 -m bench.live --help).
bench-live *args:
    python3 -m bench.live {{args}}

# Retrain the built-in tiny target (an NVIDIA GPU: ~2 minutes; see python -m tools.tiny_pretrain --help).
pretrain-tiny *args:
    python3 -m tools.tiny_pretrain --out dflash_cache/target/tiny_target --tokenizer dflash_cache/target/tiny_target/tokenizer.json {{args}}

# Rebuild the shipped demo rows (dflash_cache/target/tiny_target/demo_rows.parquet) after retraining the tiny target.
demo-rows:
    python3 -m dflash_cache.data.demo

# GPU benchmark of phase 2's memory model against measured peaks (an NVIDIA GPU; see python3 -m bench.memory --help).
bench-memory *args:
    python3 -m bench.memory {{args}}

# GPU benchmark over every GPU of one host: extract, DDP train and live against one GPU (see python3 -m bench.multi_gpu --help).
bench-multi *args:
    python3 -m bench.multi_gpu {{args}}
