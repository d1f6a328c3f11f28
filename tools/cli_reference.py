"""Write the command-line reference, docs/cli.md, from the command line itself:

    python -m tools.cli_reference > docs/cli.md

The page is click's own description of `dflash_cache.cli.cli`: every command (in click's order, by
name), its arguments and options (in declaration order) with type, default and help. Generated, so
it cannot drift from the flags a field or a decorator declares; tests/tools/test_cli_reference.py
fails when the committed page differs from this output.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from dflash_cache.cli import cli

REGENERATE = "python -m tools.cli_reference > docs/cli.md"
PROG = "dflash-cache"


def _cell(text: str) -> str:
    """One markdown table cell: whitespace collapsed, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _range(t: click.IntRange | click.FloatRange) -> str:
    low = None if t.min is None else f"{'>' if t.min_open else '>='} {t.min}"
    high = None if t.max is None else f"{'<' if t.max_open else '<='} {t.max}"
    return ", ".join(b for b in (low, high) if b)


def type_text(param: click.Parameter) -> str:
    """What a value must be, in words: flag, one of a fixed set, a number in a range, text, a path."""
    if isinstance(param, click.Option) and param.is_flag:
        return "flag"
    t = param.type
    if isinstance(t, click.Choice):
        return "one of " + ", ".join(f"`{c}`" for c in t.choices)
    if isinstance(t, (click.IntRange, click.FloatRange)):
        bounds = _range(t)
        base = "integer" if isinstance(t, click.IntRange) else "number"
        return f"{base} {bounds}" if bounds else base
    return {"text": "text", "integer": "integer", "float": "number",
            "integers": "integers, comma-separated"}.get(t.name, t.name)


def _is_unset(value: Any) -> bool:
    return value is None or type(value).__name__ == "Sentinel"  # click 8.2+ marks "no default" with UNSET


def default_text(param: click.Parameter) -> str:
    """The value a run gets without the option: 'off' for a flag not given, 'required', or the default."""
    if isinstance(param, click.Option) and param.is_flag:  # click 8.3 leaves both UNSET until a value is parsed
        given = True if _is_unset(param.flag_value) else param.flag_value
        default = False if _is_unset(param.default) else param.default
        return "on" if default == given else "off"
    if param.required:
        return "required"
    if _is_unset(param.default):
        return "—"
    value = param.default
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    return f"`{value}`"


def _names(param: click.Parameter) -> str:
    if isinstance(param, click.Argument):
        return f"`{param.human_readable_name}` (argument)"
    return ", ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])


def _params_table(params: list[click.Parameter]) -> list[str]:
    rows = [p for p in params if "--help" not in p.opts]  # every command has it; click names it privately
    if not rows:
        return []
    lines = ["| option | type | default | description |", "|---|---|---|---|"]
    for p in rows:
        help_text = getattr(p, "help", None) or ""
        lines.append(f"| {_names(p)} | {_cell(type_text(p))} | {_cell(default_text(p))} | {_cell(help_text)} |")
    return lines


def _usage(command: click.Command, ctx: click.Context) -> str:
    return " ".join([ctx.command_path, *command.collect_usage_pieces(ctx)])


def render(group: click.Group = cli) -> str:
    """The whole page, as markdown ending in one newline."""
    root = click.Context(group, info_name=PROG)
    names = group.list_commands(root)
    out = [
        "# Command-line reference",
        "",
        f"<!-- Generated from dflash_cache.cli by `{REGENERATE}`: edit the options' help, not this page. -->",
        "",
        "Every command, and each option's type, default and help, as `--help` prints them. What the "
        "commands are for, with an example each: [README](../README.md).",
        "",
        "Commands: " + ", ".join(f"[`{n}`](#{PROG}-{n})" for n in names) + ".",
        "",
        f"## `{PROG}`",
        "",
        f"`{_usage(group, root)}`",
        "",
        _cell(group.help or ""),
        "",
        *_params_table(group.get_params(root)),
    ]
    for name in names:
        command = group.get_command(root, name)
        assert command is not None, name
        ctx = click.Context(command, info_name=name, parent=root)
        out += ["", f"## `{PROG} {name}`", "", f"`{_usage(command, ctx)}`", "", _cell(command.help or ""), "",
                *_params_table(command.get_params(ctx))]
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
