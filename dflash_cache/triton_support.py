"""What every Triton kernel here needs before it launches: is triton importable, does it run
interpreted, and may this tensor's device run it.

Triton is imported lazily: importing this module works without it (e.g. macOS). In triton 3.x
`TRITON_INTERPRET` is read when `@triton.jit` decorates a function, which for triton.language's own
helpers happens at `import triton`: the variable must be set before triton is imported, and a change
afterwards cannot take effect. `interpret_mode` detects such a change and refuses it.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    """True when `import triton` works (it is a Linux-only dependency)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def _env_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes", "y")


def interpret_mode(who: str) -> bool:
    """Whether Triton kernels run in the interpreter; call only once triton is importable.

    `who` prefixes the error raised when TRITON_INTERPRET changed after triton's import.
    """
    env = _env_interpret()
    try:
        import triton.language as tl_mod
        from triton.runtime.interpreter import InterpretedFunction

        imported_interpreted = isinstance(tl_mod.max, InterpretedFunction)
    except Exception:  # layout of a future triton: trust the variable
        return env
    if imported_interpreted != env:
        raise RuntimeError(
            f"{who}: TRITON_INTERPRET is {'set' if env else 'unset'} now but was "
            f"{'set' if imported_interpreted else 'unset'} when triton was imported; set it before "
            "anything imports triton (e.g. in the environment of the process)"
        )
    return env


def triton_interpreted(who: str) -> bool:
    """True when triton is importable and runs interpreted (kernels may then take CPU tensors)."""
    return triton_available() and interpret_mode(who)


def require_triton(who: str, fallback: str) -> bool:
    """Raise unless triton is importable; return `interpret_mode(who)` (what kernel builds are keyed on)."""
    if not triton_available():
        raise RuntimeError(f"{who}: the Triton kernels need the `triton` package, which is not importable here; "
                           f"{fallback}")
    return interpret_mode(who)


def check_triton_device(t: torch.Tensor, who: str) -> None:
    """Refuse a tensor the kernels cannot run on: CUDA always works, CPU only interpreted."""
    if t.is_cuda:
        return
    if t.device.type == "cpu" and triton_interpreted(who):
        return
    raise RuntimeError(
        f"{who}: the Triton kernels need CUDA tensors (got a {t.device} tensor); on CPU they run only under "
        "the Triton interpreter, i.e. with TRITON_INTERPRET=1 set before the first kernel call"
    )


def on_device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on `t`'s GPU (Triton launches on the current device), or nothing on CPU."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
