"""JSON checked field by field against the dataclass it should become.

A cache's records come from disk that anyone may have edited, so a string where a list belongs
must be an error naming the field, not a list of characters; integers are range-checked too.
"""

from __future__ import annotations

from dataclasses import MISSING, fields, is_dataclass
from typing import Any, get_type_hints

INT64_MAX = (1 << 63) - 1
MAX_NESTING = 16  # depth of free-form JSON (a manifest's `extra`) that later code may recurse into


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def json_int(value: Any, what: str, lo: int = 0, hi: int = INT64_MAX) -> int:
    """`value` if it is a JSON integer in [lo, hi] (not a bool, float or string)."""
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"{what} must be an integer in [{lo}, {hi}], not {_short(value)}")
    return value


def json_ints(value: Any, what: str, lo: int = 0, hi: int = INT64_MAX) -> tuple[int, ...]:
    """`value` as a tuple if it is a JSON list of integers in [lo, hi]."""
    if not isinstance(value, list | tuple):
        raise ValueError(f"{what} must be a list of integers, not {_short(value)}")
    if not all(type(v) is int for v in value) or (value and not lo <= min(value) <= max(value) <= hi):
        raise ValueError(f"{what} must hold integers in [{lo}, {hi}] only")
    return tuple(value)


def nesting_depth(value: Any) -> int:
    """How deeply lists and objects nest in `value` (0 for a scalar); iterative, any size."""
    depth, level = 0, [(value, 0)]
    while level:
        item, d = level.pop()
        if isinstance(item, dict | list):
            depth = max(depth, d + 1)
            level.extend((v, d + 1) for v in (item.values() if isinstance(item, dict) else item))
    return depth


def _load_value(hint: Any, value: Any, what: str, limits: tuple[int, int], bounds: dict[str, tuple[int, int]]) -> Any:
    """One field checked against its type hint; integers must lie in `limits`."""
    lo, hi = limits
    if isinstance(hint, type) and is_dataclass(hint):  # a dataclass (a hint is never an instance of one)
        return load_dataclass(hint, value, what, bounds)
    if hint is int:
        return json_int(value, what, lo, hi)
    if hint == int | None:
        return None if value is None else json_int(value, what, lo, hi)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{what} must be a string, not {_short(value)}")
        return value
    if hint == tuple[int, ...]:
        return json_ints(value, what, lo, hi)
    if hint == dict[str, int]:
        if not isinstance(value, dict):
            raise ValueError(f"{what} must be an object, not {_short(value)}")
        return {k: json_int(v, f"{what}[{_short(k)}]", lo, hi) for k, v in value.items()}
    if hint == dict[str, Any] | None and value is None:
        return None
    if hint in (dict[str, Any], dict[str, Any] | None):
        if not isinstance(value, dict) or nesting_depth(value) > MAX_NESTING:
            raise ValueError(f"{what} must be an object nested at most {MAX_NESTING} deep")
        return value
    if hint == list[dict[str, Any]]:
        if not isinstance(value, list):
            raise ValueError(f"{what} must be a list of objects, not {_short(value)}")
        return [_load_value(dict[str, Any], v, f"{what}[{i}]", limits, bounds) for i, v in enumerate(value)]
    raise TypeError(f"no JSON loader for {hint}")  # a new field type: a bug here, not bad input


def load_dataclass(cls: type, obj: Any, what: str, bounds: dict[str, tuple[int, int]] | None = None) -> Any:
    """Build dataclass `cls` from JSON object `obj`, checking every field's type (and integer
    ranges from `bounds`, default [0, 2**63)). Unknown or missing fields are refused. Raises
    ValueError naming the field (`what` prefixes it)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{what} must be an object, not {_short(obj)}")
    hints = get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(obj) - set(known), key=str)
    if unknown:
        raise ValueError(f"{what} has unknown field {_short(unknown[0])}")
    missing = [n for n, f in known.items() if n not in obj and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"{what} lacks field {missing[0]!r}")
    bounds = bounds or {}
    kwargs = {
        name: _load_value(hints[name], value, f"{what}.{name}", bounds.get(name, (0, INT64_MAX)), bounds)
        for name, value in obj.items()
    }
    return cls(**kwargs)

