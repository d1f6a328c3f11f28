"""Command-line options declared once: on the fields of the config dataclasses.

A field made with `option(...)` carries its flag's help, its range or choices and, if the default
name does not fit, its flag. `config_options` turns a config class, and the configs nested in it,
into click options; `build_config` makes the config from what click parsed; `check_options` runs
the same range and choice checks in `__post_init__`, so configs built in code (tests, benchmarks)
are held to what the command line enforces. Adding an option is adding a field.

Field types decide the option's kind: int, float and str take a value; bool is a flag (`--name`,
or `--no-name` when it defaults to True); `tuple[int, ...]` is a comma list like 1,9,17 (never
blank); `X | None` is optional. A nested config field becomes its fields' options, flat; a nested
`Config | None` field with `option(None, help=...)` becomes a flag (like `--live`) that turns that
config on.

Every `ConfigCommand` also takes `--config FILE` (`dflash_cache.config_files`): the file's keys are
the command's option names without the dashes (a flag's field also by its name, so `progress: false`
is `no-progress: true`), its values fill what the command line leaves out (click's default map), and
they go through the options' own types and checks.
"""

from __future__ import annotations

import difflib
import importlib
import math
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from typing import Any, Literal

import click

from dflash_cache.errors import UserError

_METADATA_KEY = "dflash_cache.option"
_NESTED = "__"  # joins field names into click parameter names: live__data is LiveConfig.data under `live`


@dataclass(frozen=True)
class OptionSpec:
    """What a config field says about its command-line option (kept in the field's metadata)."""

    help: str
    flag: str | None = None  # default: --field-name, or --no-field-name for a bool that defaults to True
    min: float | None = None
    max: float | None = None
    min_open: bool = False  # refuse `min` itself (a learning rate must be > 0)
    choices: tuple[str, ...] | None = None
    path: Literal["any", "dir"] | None = None  # a path (shown as PATH; "dir": an existing file is refused)
    cli: bool = True  # False: set in code only, never on the command line

    def check(self, name: str, value: Any) -> None:
        """Raise a one-line UserError naming `name` if `value` is outside the declared choices or range."""
        if self.choices is not None and value not in self.choices:
            raise UserError(f"{name} {value!r} is not one of: {', '.join(self.choices)}")
        if self.min is None and self.max is None:
            return
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, float) and not math.isfinite(v):
                raise UserError(f"{name} must be a finite number, got {v}")
            if self.min is not None and (v < self.min or (self.min_open and v == self.min)):
                raise UserError(f"{name} must be {'greater than' if self.min_open else 'at least'} {self.min}, "
                                f"got {v}")
            if self.max is not None and v > self.max:
                raise UserError(f"{name} must be at most {self.max}, got {v}")


def option(default: Any = MISSING, *, help: str = "", flag: str | None = None, min: float | None = None,
           max: float | None = None, min_open: bool = False, choices: tuple[str, ...] | None = None,
           path: Literal["any", "dir"] | None = None, cli: bool = True) -> Any:
    """A dataclass field that is also a command-line option; no default makes the option required."""
    if cli and not help:
        raise TypeError("a command-line option needs help text (or cli=False)")
    spec = OptionSpec(help=help, flag=flag, min=min, max=max, min_open=min_open,
                      choices=tuple(choices) if choices is not None else None, path=path, cli=cli)
    return field(default=default, metadata={_METADATA_KEY: spec})


def flag_of(f: Field) -> str:
    """The flag of an option field, or the field's name if it has none (then code alone sets it)."""
    spec = f.metadata.get(_METADATA_KEY)
    if spec is None or not spec.cli:
        return f.name
    if spec.flag:
        return spec.flag
    stem = f.name.replace("_", "-")
    return f"--no-{stem}" if f.default is True else f"--{stem}"


def check_options(config: Any) -> None:
    """The declared range and choice checks of `config`'s own fields; call it from `__post_init__`."""
    for f in fields(config):
        spec = f.metadata.get(_METADATA_KEY)
        value = getattr(config, f.name)
        if spec is not None and value is not None:
            spec.check(flag_of(f), value)


class IntList(click.ParamType):
    """Comma-separated integers like 1,9,17, as a tuple. Blank is refused, not read as 'not given':
    `--layers "$LAYERS"` with LAYERS unset would otherwise quietly fall back to the default."""

    name = "integers"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value is None or isinstance(value, tuple):
            return value
        parts = [p for p in str(value).split(",") if p.strip()]
        if not parts:
            self.fail(f"{value!r} is empty; give comma-separated integers like 1,9,17, or leave the option out",
                      param, ctx)
        try:
            return tuple(int(p) for p in parts)
        except ValueError:
            self.fail(f"{value!r}: expected comma-separated integers like 1,9,17", param, ctx)


@dataclass(frozen=True)
class _Entry:
    """One field of a config class, classified: a nested config, a gate (optional nested config), an
    option, or an internal field (cli=False)."""

    field: Field
    kind: Literal["nested", "gate", "option", "internal"]
    type: Any  # the field's type without `| None`
    optional: bool


def _strip_none(hint: Any) -> tuple[Any, bool]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
    return hint, False


def _entries(cls: type) -> Iterator[_Entry]:
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if not f.init:
            continue
        base, optional = _strip_none(hints[f.name])
        spec = f.metadata.get(_METADATA_KEY)
        if is_dataclass(base):
            if optional and spec is None:
                raise TypeError(f"{cls.__name__}.{f.name}: an optional nested config needs option(None, help=...), "
                                "its on/off flag")
            yield _Entry(f, "gate" if optional else "nested", base, optional)
        elif spec is None:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with option(); give it help text, or "
                            "cli=False if the command line must not set it")
        else:
            yield _Entry(f, "option" if spec.cli else "internal", base, optional)


def _has_default(f: Field) -> bool:
    return f.default is not MISSING or f.default_factory is not MISSING


def _click_type(entry: _Entry) -> click.ParamType:
    spec, t = entry.field.metadata[_METADATA_KEY], entry.type
    if t == tuple[int, ...]:
        return IntList()
    if t is int or t is float:
        if spec.min is None and spec.max is None:
            return click.INT if t is int else click.FLOAT
        kind = click.IntRange if t is int else click.FloatRange
        return kind(min=spec.min, max=spec.max, min_open=spec.min_open)
    if t is str:
        if spec.choices is not None:
            return click.Choice(spec.choices)
        if spec.path is not None:
            return click.Path(file_okay=spec.path != "dir")
        return click.STRING
    raise TypeError(f"field {entry.field.name}: no command-line form for type {t!r}")


def _click_option(entry: _Entry, name: str, gate: str | None) -> click.Option:
    f = entry.field
    spec: OptionSpec = f.metadata[_METADATA_KEY]
    text = f"{gate}: {spec.help}" if gate else spec.help
    decls = [flag_of(f), name]
    if entry.kind == "gate":
        return click.Option(decls, is_flag=True, default=False, help=text)
    if entry.type is bool:
        if f.default is True:  # --no-progress sets progress=False
            return click.Option(decls, is_flag=True, flag_value=False, default=True, help=text)
        return click.Option(decls, is_flag=True, default=False, help=text)
    kw: dict[str, Any] = {"type": _click_type(entry), "help": text}
    if not _has_default(f):
        kw.update(required=gate is None)  # under a gate, its absence is reported when the gate is on
    else:
        default = f.default if f.default_factory is MISSING else f.default_factory()
        if isinstance(default, tuple):
            default = ",".join(map(str, default))
        kw.update(default=default, show_default=default is not None)
    return click.Option(decls, **kw)


def config_options(cls: type, prefix: tuple[str, ...] = (), gate: str | None = None) -> list[click.Option]:
    """The click options of `cls` and of the configs nested in it, in field order.

    A gate's options get their help prefixed with the gate's flag (`--live: ...`). Raises TypeError
    on a field without `option()` and on two fields with one flag: mistakes in the code, not input.
    """
    out: list[click.Option] = []
    for entry in _entries(cls):
        path = (*prefix, entry.field.name)
        if entry.kind == "nested":
            out += config_options(entry.type, path, gate)
        elif entry.kind == "gate":
            out.append(_click_option(entry, _NESTED.join(path), gate))
            out += config_options(entry.type, path, flag_of(entry.field))
        elif entry.kind == "option":
            out.append(_click_option(entry, _NESTED.join(path), gate))
    flags = [o for opt in out for o in opt.opts]
    twice = sorted({o for o in flags if flags.count(o) > 1})
    if twice:
        raise TypeError(f"{cls.__name__}: flags declared by more than one field: {', '.join(twice)}")
    return out


def build_config(cls: type, values: Mapping[str, Any], prefix: tuple[str, ...] = (), gate: str | None = None) -> Any:
    """The config `cls` from click's parsed values (keyed as `config_options` names them); internal
    fields keep their defaults, and a gated config is built only when its flag is given."""
    kwargs: dict[str, Any] = {}
    for entry in _entries(cls):
        f = entry.field
        path = (*prefix, f.name)
        name = _NESTED.join(path)
        if entry.kind == "nested":
            kwargs[f.name] = build_config(entry.type, values, path, gate)
        elif entry.kind == "gate":
            if values[name]:
                kwargs[f.name] = build_config(entry.type, values, path, flag_of(f))
            else:
                given = _given(entry.type, values, path)
                if given:
                    raise UserError(f"{given[0]} applies only with {flag_of(f)}: add {flag_of(f)} or leave it out")
                kwargs[f.name] = None
        elif entry.kind == "option":
            if gate is not None and values[name] is None and not _has_default(f):
                raise UserError(f"{gate} needs {flag_of(f)}")
            kwargs[f.name] = values[name]
    return cls(**kwargs)


def _given(cls: type, values: Mapping[str, Any], prefix: tuple[str, ...]) -> list[str]:
    """The flags of `cls`'s options (nested ones included) whose values differ from their defaults."""
    given = []
    for entry in _entries(cls):
        path = (*prefix, entry.field.name)
        if entry.kind in ("nested", "gate"):
            given += _given(entry.type, values, path)
        elif entry.kind == "option":
            f = entry.field
            default = f.default if f.default is not MISSING else None
            if values[_NESTED.join(path)] != default:
                given.append(flag_of(f))
    return given


CONFIG_FLAG = "--config"


def _options_from_file(ctx: click.Context, param: click.Parameter, path: str | None) -> None:
    """--config's callback (eager, so it runs before the other options are read): the file's values
    become the defaults of the options the command line leaves out, checked here by each option's
    own type so that a mistake names the file."""
    if path is None or ctx.resilient_parsing:
        return
    from dflash_cache.config_files import read_config_file

    by_key = _file_keys(ctx)
    values: dict[str, Any] = {}
    keys: dict[str, str] = {}  # the key each option was given by
    for key, value in read_config_file(path).items():
        key = str(key)
        found = by_key.get(key.replace("_", "-"))
        if found is None:
            close = difflib.get_close_matches(key.replace("_", "-"), by_key, n=1)
            hint = f"did you mean {close[0]!r}?" if close else \
                f"the keys are the options of `{ctx.command_path} --help` without their leading dashes"
            raise UserError(f"{path}: no option {key!r} here; {hint}")
        option, is_field = found
        if option.name in keys:
            raise UserError(f"{path}: {option.opts[0][2:]!r} is given twice (as {keys[option.name]!r} and {key!r}); "
                            "keep one")
        keys[option.name] = key
        values[option.name] = _file_value(ctx, option, key, value, path, is_field=is_field)
    ctx.default_map = {**(ctx.default_map or {}), **{k: v for k, v in values.items() if v is not None}}


def _file_keys(ctx: click.Context) -> dict[str, tuple[click.Option, bool]]:
    """The keys a file may use, each with its option and whether the key is the name of a boolean
    field rather than its flag: the flags without their dashes, and each flag's field by its name
    where that differs, so that `progress: false` says what `--no-progress` (or
    `no-progress: true`) says. Where a field's name is another option's flag, the flag keeps it."""
    params = [p for p in ctx.command.get_params(ctx) if isinstance(p, click.Option) and p.expose_value]
    keys = {o[2:]: (p, False) for p in params for o in p.opts if o.startswith("--")}
    for p in params:
        if p.is_flag and p.name:
            keys.setdefault(p.name.rsplit(_NESTED, 1)[-1].replace("_", "-"), (p, True))
    return keys


def _file_value(ctx: click.Context, option: click.Option, key: str, value: Any, path: str, *,
                is_field: bool = False) -> Any:
    """A file's value for `option` as its parsed value, or None for none (null, a flag left off): a
    flag takes true or false (by its field's name, `is_field`, the field's value: true or false
    whatever the flag's default); anything else is converted from its command-line text by the
    option's type, so that it passes exactly what the command line passes (a list for a comma list)."""
    if value is None:
        return None
    if option.is_flag:
        if not isinstance(value, bool):
            raise UserError(f"{path}: {key!r} is a flag: give true or false, not {value!r}")
        given = value != option.default if is_field else value
        return (not option.default) if given else None  # our flags: given, they flip their default
    if isinstance(value, list) and isinstance(option.type, IntList):
        value = ",".join(map(str, value))
    if isinstance(value, bool | list | dict):
        shown = "true or false" if isinstance(value, bool) else f"a {type(value).__name__}"
        raise UserError(f"{path}: {key!r} takes a value, not {shown}; give it as on the command line")
    try:
        return option.type_cast_value(ctx, str(value))
    except click.BadParameter as e:
        raise UserError(f"Invalid value for {key!r} in {path}: {e.message}") from None


class ConfigCommand(click.Command):
    """A click command whose options are generated from a config class, and whose callback receives
    the built config as `cfg` (beside any options declared on the command itself).

    `config` may be the class or "module:Class"; a string is imported only when the command parses
    its arguments or shows its help, so `dflash-cache --help` and the other commands do not pay for
    the phase's imports (torch, seconds).
    """

    def __init__(self, *args: Any, config: type | str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._config = config
        self._generated: list[click.Option] | None = None
        self.params.append(click.Option(
            [CONFIG_FLAG], metavar="FILE", is_eager=True, expose_value=False, callback=_options_from_file,
            help="Options from a YAML, TOML or JSON file: option names without the dashes as keys "
                 "(token-budget: 4096; a --no-x flag also as x: false); options given on the command line "
                 "override it."))

    def config_class(self) -> type:
        if isinstance(self._config, str):
            module, _, name = self._config.partition(":")
            return getattr(importlib.import_module(module), name)
        return self._config

    def generated_options(self) -> list[click.Option]:
        """The options made from the config class (made once, then kept on the command)."""
        if self._generated is None:
            generated = config_options(self.config_class())
            clash = {o for p in self.params for o in p.opts} & {o for p in generated for o in p.opts}
            if clash:
                raise TypeError(f"{self.name}: {', '.join(sorted(clash))} declared on the command and the config")
            self.params = [*generated, *self.params]
            self._generated = generated
        return self._generated

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        self.generated_options()
        return super().get_params(ctx)

    def invoke(self, ctx: click.Context) -> Any:
        values = {o.name: ctx.params.pop(o.name) for o in self.generated_options()}
        ctx.params["cfg"] = build_config(self.config_class(), values)
        return super().invoke(ctx)


def cli_values(config: Any) -> dict[str, Any]:
    """Every command-line option of `config` (nested configs' too) by flag, as typed: a flag's
    value (a gate's too) is whether it is given. What a run records, so that a later run can say
    which of them it changed."""
    out: dict[str, Any] = {}
    for entry in _entries(type(config)):
        value = getattr(config, entry.field.name)
        if entry.kind == "nested":
            out.update(cli_values(value))
        elif entry.kind == "gate":
            out[flag_of(entry.field)] = value is not None
            if value is not None:
                out.update(cli_values(value))
        elif entry.kind == "option":
            flag = flag_of(entry.field)
            out[flag] = (not value) if isinstance(value, bool) and flag.startswith("--no-") else value
    return out


def file_values(config: Any) -> dict[str, Any]:
    """`cli_values` as a `--config` file holds them: flags without their dashes as keys, comma lists
    as on the command line (1,9,17). What a run writes, so that the file runs it again."""
    return {flag.removeprefix("--"): ",".join(map(str, v)) if isinstance(v, tuple) else v
            for flag, v in cli_values(config).items()}
