"""Errors a user can cause and fix.

Library code raises `UserError` for bad input; the CLI turns it into one line on stderr and exit
status 2. Anything else is a bug and keeps its traceback.
"""

import errno


class UserError(Exception):
    """A mistake in the user's input: the message names the problem and the fix, on one line."""

    exit_code = 2


class CacheCorruptError(UserError):
    """A cache on disk does not match what its commit records promise."""


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type if it has none), to quote inside a UserError."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def compile_failure(exc: BaseException) -> str:
    """'Type: first line' of what stopped torch.compile (its inner exception when it wraps one),
    for the UserError that names the way out."""
    cause = getattr(exc, "inner_exception", None) or exc
    return f"{type(cause).__name__}: {one_line(cause)}"


def write_error(exc: OSError, doing: str, then: str) -> UserError:
    """One line for a write of ours that failed: a full disk (free space, then `then`), or what else
    the system said about the path."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return UserError(f"disk full while {doing}; free space, then {then}")
    return UserError(f"cannot finish {doing}: {exc.strerror or one_line(exc)}; check the path and its permissions, "
                     f"then {then}")
