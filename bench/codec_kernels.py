"""Which kernel strategy the lossy codecs should settle on: Triton kernels or torch.compile of the torch reference.

`dflash_cache/store/codecs/dispatch.py` is where that choice is made, and it asks for both measured on
an NVIDIA H200. On one device, at the target's batch shapes (token counts 4,096, 16,384, 65,536 and a
ragged 12,345; 5 layers of hidden 4,096; bf16 standard-normal features), this times every candidate:

  * fp8 encode and decode: the hand-written Triton kernels (`quantize_fp8_triton`, `dequantize_fp8_triton`),
    torch.compile of the torch reference (`quantize_fp8_torch`, `dequantize_fp8_torch`) and that reference
    eagerly, the baseline;
  * fp4 encode and decode (`FP4_LAYOUT`): compiled (what ships for encode) and eager. fp4 has no Triton
    kernels; the output says so rather than timing any.

Compiled candidates are built the way fp4 builds its shipped encoder: `torch.compile` with default options,
the token count (dim 0 of every tensor argument) marked dynamic per call, layers and width static. No
library helper does that for an arbitrary function, so `compile_over_tokens` here does.

Per candidate and token count: the median seconds per call over `--repeats` timed calls after `--warmup`
calls (CUDA events around each call on a GPU, perf_counter on a CPU), ns per token, and GB/s of the bytes
the call must read and write (its input and output arrays; intermediates not counted); whether its output
is bit-identical to the eager reference's on this device (decode candidates all decode the reference's
encoding). Per candidate: the first call's wall time, in a process whose compiler is already started
(`compiler_startup_s`, one trivial compile), after `torch._dynamo.reset()` and with empty inductor and
Triton cache directories, i.e. what a run pays at start on a fresh machine ("cold"); the same again
after another reset with those caches filled ("warm cache", what a later run on the machine pays, in
this process); and the compilations the rest of the token-count sweep triggered (dynamo graphs for
compiled candidates, kernel specialisations for Triton). It prints a table and ends with a "suggests:"
line that only compares those numbers.

Run on an NVIDIA H200 from the repository root (the results note of the same name must then name both files):
    python3 -m bench.codec_kernels --json bench/results/$(date +%F)-h200-codec-kernels.json 2>&1 | tee bench/results/$(date +%F)-h200-codec-kernels.log
`--small` uses tiny shapes so the script can be checked on a CPU; there the Triton candidates run only under
the Triton interpreter (TRITON_INTERPRET=1 set before the process starts) and are skipped otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import start_logging_and_device
from dflash_cache.errors import one_line
from dflash_cache.store.codecs import fp4, fp8
from dflash_cache.triton_support import triton_available, triton_interpreted

TOKENS = (4096, 16384, 65536, 12345)
SMALL_TOKENS = (64, 256, 100)
N_LAYERS = 5
HIDDEN = 4096
SMALL_HIDDEN = 128

Encoded = Any  # a codec's encoding: fp8's (q, scales) or fp4's dict of arrays


# ----------------------------------------------------------------------------------------------
# the candidates


def compile_over_tokens(fn: Callable) -> Callable:
    """`torch.compile(fn)` called as fp4's shipped encoder is (`fp4.quantize_fp4_layout`): only the token
    count varies, so dim 0 of every tensor argument (and of the tensors of a dict argument) is marked
    dynamic per call; the layer count and width stay static."""
    compiled = torch.compile(fn)

    def call(*args):
        for a in args:
            for t in a.values() if isinstance(a, dict) else a if isinstance(a, tuple) else (a,):
                if isinstance(t, torch.Tensor):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(*args)

    return call


def _fp8_decode_torch(q: torch.Tensor, scales: torch.Tensor, n_layers: int) -> torch.Tensor:
    return fp8.dequantize_fp8_torch(q, scales, n_layers)


def _fp4_encode(x: torch.Tensor, n_layers: int) -> dict[str, torch.Tensor]:
    return fp4.quantize_fp4(x, n_layers, fp4.FP4_LAYOUT)


def _fp4_decode(arrays: dict[str, torch.Tensor], n_layers: int) -> torch.Tensor:
    return fp4.dequantize_fp4(arrays, n_layers, fp4.FP4_LAYOUT)


@dataclass
class Candidate:
    """One implementation of one codec operation. `make` builds the callable afresh (a new compiled
    object, new Triton kernels) and `forget` drops what it compiled, so the first call can be timed
    again; `compilations` counts what it has compiled so far (None where that is not known)."""

    codec: str
    op: str  # "encode" (bf16 -> arrays) or "decode" (arrays -> bf16)
    impl: str  # "triton", "compiled" or "eager"
    make: Callable[[], Callable] | None
    skipped: str | None = None

    @property
    def name(self) -> str:
        return f"{self.codec} {self.op} {self.impl}"

    def forget(self) -> None:
        if self.impl == "compiled":
            torch._dynamo.reset()
        elif self.impl == "triton":
            fp8._build_kernels.cache_clear()  # new JITFunctions: nothing compiled in memory

    def compilations(self) -> int | None:
        if self.impl == "compiled":
            return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        if self.impl == "triton":
            kernel = fp8._kernels()[1 if self.op == "encode" else 2]
            caches = getattr(kernel, "device_caches", None)  # absent in the interpreter: nothing compiles
            return None if caches is None else sum(len(c[0]) for c in caches.values())
        return None


def triton_skip_reason(device: torch.device) -> str | None:
    """Why the fp8 Triton kernels cannot run here, or None when they can."""
    if device.type == "cuda":
        return None if triton_available() else "skipped: triton is not importable"
    if device.type == "cpu" and triton_interpreted("bench.codec_kernels"):
        return None
    return "skipped: no GPU (on a CPU they run only with TRITON_INTERPRET=1 set before the process starts)"


def fp4_triton_functions() -> list[str]:
    """fp4's Triton entry points, found by name (none today)."""
    return [name for name in fp4.__all__ if "triton" in name.lower()]


def candidates(device: torch.device) -> list[Candidate]:
    skip = triton_skip_reason(device)
    fp4_triton = fp4_triton_functions()
    return [
        Candidate("fp8", "encode", "eager", lambda: fp8.quantize_fp8_torch),
        Candidate("fp8", "encode", "triton", lambda: fp8.quantize_fp8_triton, skip),
        Candidate("fp8", "encode", "compiled", lambda: compile_over_tokens(fp8.quantize_fp8_torch)),
        Candidate("fp8", "decode", "eager", lambda: _fp8_decode_torch),
        Candidate("fp8", "decode", "triton", lambda: fp8.dequantize_fp8_triton, skip),
        Candidate("fp8", "decode", "compiled", lambda: compile_over_tokens(_fp8_decode_torch)),
        Candidate("fp4", "encode", "eager", lambda: _fp4_encode),
        Candidate("fp4", "encode", "compiled", lambda: compile_over_tokens(_fp4_encode)),
        Candidate("fp4", "decode", "eager", lambda: _fp4_decode),
        Candidate("fp4", "decode", "compiled", lambda: compile_over_tokens(_fp4_decode)),
        *([] if fp4_triton else [Candidate("fp4", op, "triton", None, "skipped: fp4 has no Triton kernels")
                                 for op in ("encode", "decode")]),
    ]


# ----------------------------------------------------------------------------------------------
# inputs, references, equality


@dataclass
class Workload:
    """One token count's input and the eager reference's encoding and decoding of it."""

    tokens: int
    x: torch.Tensor
    encoded: Encoded
    decoded: torch.Tensor


def reference(codec: str) -> tuple[Callable, Callable]:
    return (fp8.quantize_fp8_torch, _fp8_decode_torch) if codec == "fp8" else (_fp4_encode, _fp4_decode)


def workload(codec: str, tokens: int, width: int, n_layers: int, device: torch.device) -> Workload:
    g = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, width, generator=g, device=device, dtype=torch.bfloat16)
    encode, decode = reference(codec)
    encoded = encode(x, n_layers)
    return Workload(tokens, x, encoded, decode(*_as_args(encoded), n_layers))


def _as_args(encoded: Encoded) -> tuple:
    return tuple(encoded) if isinstance(encoded, tuple) else (encoded,)


def _tensors(value: Encoded | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(value, dict):
        return [value[k] for k in sorted(value)]
    return list(value) if isinstance(value, tuple) else [value]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers, so that -0.0 differs from 0.0 and NaN equals itself."""
    views = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(views[t.element_size()]) if t.is_floating_point() else t


def bit_identical(a: Encoded | torch.Tensor, b: Encoded | torch.Tensor) -> bool:
    if isinstance(a, dict) != isinstance(b, dict) or (isinstance(a, dict) and sorted(a) != sorted(b)):
        return False
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y))
                                      for x, y in zip(ta, tb, strict=True))


def nbytes(value: Encoded | torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


# ----------------------------------------------------------------------------------------------
# timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_call_s(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one call until its device work is done: compilation is host time, so no events."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def call_times_s(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls after `warmup` calls: CUDA events around each call on a GPU
    (device time, launches queued back to back), perf_counter on a CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        sync(device)
        return [start.elapsed_time(end) / 1e3 for start, end in events]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


@contextlib.contextmanager
def compile_caches(fresh: bool) -> Iterator[str]:
    """Empty inductor and Triton cache directories for the whole run (set before anything compiles:
    inductor's compile workers inherit the environment they start with), or the machine's own."""
    if not fresh:
        yield "the machine's own (first calls may hit it)"
        return
    keys = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    saved = {k: os.environ.get(k) for k in keys}
    root = tempfile.mkdtemp(prefix="codec-kernels-compile-cache-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
    try:
        yield "empty at the start of the run"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(root, ignore_errors=True)


def compiler_startup_s(device: torch.device) -> float:
    """One trivial compile, so that no candidate's first call pays the compiler's one-off start
    (imports, worker pool, Triton's driver stubs); a run pays it once, whatever it compiles."""
    torch._dynamo.reset()
    x = torch.ones(8, device=device)
    return first_call_s(lambda: torch.compile(lambda t: t * 2 + 1)(x), device)


# ----------------------------------------------------------------------------------------------
# measuring


def measure(cand: Candidate, loads: list[Workload], n_layers: int, device: torch.device, warmup: int,
            repeats: int) -> dict:
    """Everything measured of one candidate over the token-count sweep (see the module docstring)."""
    row: dict = {"codec": cand.codec, "op": cand.op, "impl": cand.impl, "skipped": cand.skipped, "error": None,
                 "first_call_s": None, "first_call_warm_cache_s": None, "compiles_after_first_call": None,
                 "shapes": []}
    if cand.skipped:
        return row
    make = cand.make
    if make is None:  # not reached: a candidate that cannot be made is skipped
        raise RuntimeError(f"{cand.name}: neither made nor skipped")

    def call_on(fn: Callable, load: Workload) -> Callable[[], object]:
        if cand.op == "encode":
            return lambda: fn(load.x, n_layers)
        args = _as_args(load.encoded)
        return lambda: fn(*args, n_layers)

    try:
        cand.forget()
        fn = make()
        row["first_call_s"] = first_call_s(call_on(fn, loads[0]), device)
        compiled_after_first = cand.compilations()
        for load in loads:
            run = call_on(fn, load)
            median = statistics.median(call_times_s(run, device, warmup, repeats))
            expected = load.encoded if cand.op == "encode" else load.decoded
            moved = nbytes(load.x) + nbytes(load.encoded) if cand.op == "encode" else \
                nbytes(load.encoded) + nbytes(load.decoded)
            row["shapes"].append({"tokens": load.tokens, "median_s": median, "ns_per_token": median * 1e9 / load.tokens,
                                  "bytes": moved, "gb_s": moved / median / 1e9,
                                  "bit_identical": bit_identical(run(), expected)})
        compiled_now = cand.compilations()
        if compiled_after_first is not None and compiled_now is not None:
            row["compiles_after_first_call"] = compiled_now - compiled_after_first
        if cand.impl != "eager":
            cand.forget()
            row["first_call_warm_cache_s"] = first_call_s(call_on(make(), loads[0]), device)
    except Exception as e:  # one candidate that cannot run (a compiler failure, memory) must not lose the others
        row["error"] = f"{type(e).__name__}: {one_line(e)}"
        print(f"{cand.name}: {row['error']}", flush=True)
    finally:
        cand.forget()
    return row


# ----------------------------------------------------------------------------------------------
# report


def _label(row: dict) -> str:
    return f"{row['codec']} {row['op']} {row['impl']}"


def _total_s(rows: list[dict], codec: str, impl: str) -> float | None:
    """Encode + decode median seconds summed over the sweep, None unless both ran at every shape."""
    picked = [r for r in rows if r["codec"] == codec and r["impl"] == impl]
    if len(picked) != 2 or any(r["skipped"] or r["error"] or not r["shapes"] for r in picked):
        return None
    return sum(s["median_s"] for r in picked for s in r["shapes"])


def _first_calls_s(rows: list[dict], codec: str, impl: str, key: str) -> float | None:
    values = [r[key] for r in rows if r["codec"] == codec and r["impl"] == impl]
    return sum(values) if values and all(v is not None for v in values) else None


def _compare(name_a: str, a: float, name_b: str, b: float, tolerance: float) -> str:
    ratio = b / a
    if ratio > 1 + tolerance:
        return f"{name_a} faster by {ratio - 1:.0%}"
    if ratio < 1 / (1 + tolerance):
        return f"{name_b} faster by {1 / ratio - 1:.0%}"
    return f"{name_a} and {name_b} within {tolerance:.0%} ({name_b}/{name_a} = {ratio:.3f})"


def suggestion(rows: list[dict], tolerance: float, triton_interpreted: bool = False) -> str:
    """One line comparing the measured numbers; it draws no conclusion the numbers do not carry."""
    parts = ["Triton ran in its interpreter, so its times say nothing of the kernels"] if triton_interpreted else []
    triton, compiled, eager = (_total_s(rows, "fp8", impl) for impl in ("triton", "compiled", "eager"))
    if triton is not None and compiled is not None:
        part = (f"fp8 encode+decode over the sweep: {_compare('triton', triton, 'compiled', compiled, tolerance)} "
                f"(triton {triton * 1e3:.3g} ms, compiled {compiled * 1e3:.3g} ms")
        if eager is not None:
            part += f", eager {eager * 1e3:.3g} ms"
        cold = [_first_calls_s(rows, "fp8", impl, "first_call_s") for impl in ("triton", "compiled")]
        if None not in cold:
            part += f"); first calls: triton {cold[0]:.2f} s, compiled {cold[1]:.2f} s"
        else:
            part += ")"
        parts.append(part)
    else:
        why = next((r["skipped"] or r["error"] for r in rows
                    if r["codec"] == "fp8" and r["impl"] == "triton" and (r["skipped"] or r["error"])), "incomplete")
        parts.append(f"fp8: triton vs compiled not compared here ({why})")
    if not any(r["codec"] == "fp4" and r["impl"] == "triton" and not r["skipped"] for r in rows):
        parts.append("fp4 has no Triton kernels (Triton for both codecs would need them written)")
    fp4_compiled, fp4_eager = _total_s(rows, "fp4", "compiled"), _total_s(rows, "fp4", "eager")
    if fp4_compiled is not None and fp4_eager is not None:
        cold = _first_calls_s(rows, "fp4", "compiled", "first_call_s")
        parts.append(f"fp4 encode+decode: {_compare('compiled', fp4_compiled, 'eager', fp4_eager, tolerance)}"
                     + (f", compiled first calls {cold:.2f} s" if cold is not None else ""))
    differ = [f"{_label(r)} at {s['tokens']}" for r in rows for s in r["shapes"] if not s["bit_identical"]]
    parts.append(f"NOT bit-identical to the reference: {', '.join(differ)}" if differ
                 else "every candidate that ran is bit-identical to the reference at every shape")
    failed = [_label(r) for r in rows if r["error"]]
    if failed:
        parts.append(f"failed: {', '.join(failed)}")
    return "suggests: " + "; ".join(parts)


def _cell(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def print_table(rows: list[dict], tokens: list[int]) -> None:
    largest = max(tokens)
    print("\n| candidate | " + " | ".join(f"ns/token @{t:,}" for t in tokens) + f" | GB/s @{largest:,} | bit-identical "
          "| first call s | first call warm cache s | compiles after first |")
    print("|---|" + "---:|" * (len(tokens) + 1) + ":---:|---:|---:|---:|")
    for r in rows:
        if r["skipped"] or r["error"]:
            print(f"| {_label(r)} | {r['skipped'] or r['error']} |")
            continue
        by_t = {s["tokens"]: s for s in r["shapes"]}
        identical = "yes" if all(s["bit_identical"] for s in r["shapes"]) else "NO"
        print(f"| {_label(r)} | " + " | ".join(f"{by_t[t]['ns_per_token']:,.2f}" for t in tokens)
              + f" | {by_t[largest]['gb_s']:,.1f} | {identical} | {_cell(r['first_call_s'], '.3f')} | "
              f"{_cell(r['first_call_warm_cache_s'], '.3f')} | {_cell(r['compiles_after_first_call'], 'd')} |")


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive token counts, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=_positive_ints, default=None,
                    help=f"token counts of the sweep (default {','.join(map(str, TOKENS))}; "
                         f"--small {','.join(map(str, SMALL_TOKENS))})")
    ap.add_argument("--n-layers", type=int, default=N_LAYERS, help="captured layers")
    ap.add_argument("--hidden", type=int, default=None, help=f"hidden size (default {HIDDEN}; --small {SMALL_HIDDEN})")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per shape (default 20; --small 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls before them (default 3; --small 1)")
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="relative difference under which the suggests line calls two times equal")
    ap.add_argument("--reuse-compile-cache", action="store_true",
                    help="compile with the machine's inductor and Triton caches, not empty ones (faster; the "
                         "'cold' first calls then may not be cold)")
    ap.add_argument("--codecs", default="fp8,fp4", help="which codecs' candidates to measure (default fp8,fp4)")
    ap.add_argument("--impls", default="eager,triton,compiled",
                    help="which implementations to measure (default eager,triton,compiled)")
    ap.add_argument("--small", action="store_true", help="tiny shapes, to check the script on a CPU")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    tokens: list[int] = args.tokens or list(SMALL_TOKENS if args.small else TOKENS)
    hidden = args.hidden or (SMALL_HIDDEN if args.small else HIDDEN)
    repeats = args.repeats or (3 if args.small else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.small else 3)
    codecs = args.codecs.split(",")
    impls = args.impls.split(",")
    if not set(codecs) <= {"fp8", "fp4"} or not set(impls) <= {"eager", "triton", "compiled"}:
        ap.error(f"--codecs takes fp8 and/or fp4, --impls eager, triton and/or compiled; not {args.codecs!r}, "
                 f"{args.impls!r}")
    if args.n_layers < 1 or repeats < 1 or warmup < 0:
        ap.error("--n-layers and --repeats must be positive and --warmup not negative")
    try:
        fp4.FP4_LAYOUT.check(hidden)
    except ValueError as e:
        ap.error(f"--hidden {hidden} does not suit the fp4 layout ({e}); use a multiple of "
                 f"{fp4.FP4_LAYOUT.group_size}, e.g. {HIDDEN}")

    device = start_logging_and_device()
    width = args.n_layers * hidden
    cuda = device.type == "cuda"
    results: dict = {
        "date": datetime.date.today().isoformat(),
        "machine": torch.cuda.get_device_name(device) if cuda else f"cpu ({platform.machine()})",
        "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
        "triton": _triton_version(),
        "triton_interpret": device.type == "cpu" and triton_skip_reason(device) is None,
        "command": " ".join(["python3", "-m", __spec__.name, *(sys.argv[1:] if argv is None else argv)]),
        "tokens": tokens, "n_layers": args.n_layers, "hidden": hidden, "input": "bf16 standard normal",
        "repeats": repeats, "warmup": warmup, "tolerance": args.tolerance,
        "fp4_triton_functions": fp4_triton_functions(),
    }
    print(f"{results['machine']}, torch {results['torch']}, triton {results['triton']}; tokens {tokens}, "
          f"{args.n_layers} x {hidden}", flush=True)
    rows = []
    with compile_caches(not args.reuse_compile_cache) as cache_note:
        results["compile_cache"] = cache_note
        try:
            results["compiler_startup_s"] = compiler_startup_s(device) if "compiled" in impls else None
            for codec in codecs:
                loads = [workload(codec, t, width, args.n_layers, device) for t in tokens]
                for cand in candidates(device):
                    if cand.codec == codec and cand.impl in impls:
                        rows.append(measure(cand, loads, args.n_layers, device, warmup, repeats))
                        print(f"{cand.name}: {_brief(rows[-1])}", flush=True)
                del loads
        finally:
            torch._dynamo.reset()
    results["candidates"] = rows
    print_table(rows, tokens)
    results["suggests"] = suggestion(rows, args.tolerance, results["triton_interpret"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print("\n" + results["suggests"], flush=True)
    return results


def _brief(row: dict) -> str:
    if row["skipped"] or row["error"]:
        return row["skipped"] or row["error"]
    times = ", ".join(f"{s['tokens']}: {s['median_s'] * 1e3:.3f} ms" for s in row["shapes"])
    return f"first call {row['first_call_s']:.3f} s; {times}"


def _triton_version() -> str | None:
    if not triton_available():
        return None
    import triton

    return triton.__version__


if __name__ == "__main__":
    main()
