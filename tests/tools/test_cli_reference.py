"""docs/cli.md is the generator's output for the command line as it is now, and the generator says what
the options are: each command, each flag with its type, default and help."""

from __future__ import annotations

from pathlib import Path

import click

from tools.cli_reference import REGENERATE, default_text, render, type_text

PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_docs_cli_md_is_the_generators_output():
    assert PAGE.is_file(), f"docs/cli.md is missing; write it with `{REGENERATE}`"
    assert PAGE.read_text() == render(), (
        f"docs/cli.md differs from the command line's options; regenerate it with `{REGENERATE}` and commit it")


def test_every_command_and_option_is_listed_with_its_default():
    @click.group()
    def group() -> None:
        """The group."""

    @group.command(name="go")
    @click.argument("where", type=click.Path())
    @click.option("--count", type=click.IntRange(min=1), default=3, help="How many | at most.")
    @click.option("--mode", type=click.Choice(["a", "b"]), required=True, help="Which.")
    @click.option("--no-bar", "bar", is_flag=True, default=True, flag_value=False, help="Hide the bar.")
    def go(where: str, count: int, mode: str, bar: bool) -> None:
        """Go somewhere."""

    page = render(group)
    assert "## `dflash-cache go`" in page
    assert "`dflash-cache go [OPTIONS] WHERE`" in page
    assert "| `--count` | integer >= 1 | `3` | How many \\| at most. |" in page
    assert "| `--mode` | one of `a`, `b` | required | Which. |" in page
    assert "| `--no-bar` | flag | off | Hide the bar. |" in page
    assert "| `--help`" not in page
    assert render(group) == page  # stable


def test_types_and_defaults_in_words():
    option = click.Option(["--lr"], type=click.FloatRange(min=0, min_open=True), default=6e-4)
    assert (type_text(option), default_text(option)) == ("number > 0", "`0.0006`")
    unset = click.Option(["--limit"], type=click.IntRange(min=1, max=9))
    assert (type_text(unset), default_text(unset)) == ("integer >= 1, <= 9", "—")
