"""Options generated from config fields: kinds, ranges, flags, comma lists, nesting, and the real configs."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any

import click
import pytest

from dflash_cache.errors import UserError
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.options import ConfigCommand, check_options, config_options, flag_of, option
from dflash_cache.store.plan import PlanConfig
from dflash_cache.target.model import TargetSpec
from dflash_cache.train.run_config import LiveConfig, TrainConfig


@dataclass(frozen=True, kw_only=True)
class Inner:
    data: str = option(help="the data.")
    depth: int = option(3, min=1, flag="--inner-depth", help="how deep.")


@dataclass(frozen=True)
class Grid:
    size: int = option(8, min=1, max=64, help="Cells per side.")
    bounds: tuple[int, ...] = option((0, 5, 9), flag="--bounds", help="Lower bounds.")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True, kw_only=True)
class Toy:
    name: str = option(help="A required name.")
    grid: Grid = field(default_factory=Grid)
    ids: tuple[int, ...] | None = option(None, help="Optional ids.")
    rate: float = option(0.5, min=0, min_open=True, help="A positive rate.")
    cap: int | None = option(None, min=1, help="An optional cap.")
    mode: str = option("fast", choices=("fast", "slow"), help="How.")
    loud: bool = option(False, help="Shout.")
    progress: bool = option(True, help="Hide the bar.")
    extra: Inner | None = option(None, help="Turn the extra part on.")
    secret: int = option(7, min=0, cli=False)

    def __post_init__(self) -> None:
        check_options(self)


def _command(config: type | str) -> click.Command:
    return ConfigCommand("toy", config=config, callback=lambda cfg: cfg)


def parse(config: type | str, *args: str) -> Any:
    """The config a command built from `args` (what its callback received)."""
    return _command(config).main(list(args), standalone_mode=False)


def usage_error(config: type, *args: str) -> str:
    with pytest.raises(click.UsageError) as info:
        parse(config, *args)
    return info.value.format_message()


def test_defaults_kinds_and_internal_fields():
    assert parse(Toy, "--name", "n") == Toy(name="n")
    cfg = parse(Toy, "--name", "n", "--size", "16", "--bounds", "0, 3,10", "--ids", "1,9,17", "--rate", "2",
                "--cap", "4", "--mode", "slow", "--loud", "--no-progress")
    assert cfg == Toy(name="n", grid=Grid(size=16, bounds=(0, 3, 10)), ids=(1, 9, 17), rate=2.0, cap=4,
                      mode="slow", loud=True, progress=False)
    assert {o.name for o in config_options(Toy)}.isdisjoint({"secret"})  # cli=False: code alone sets it


def test_ranges_choices_and_lists_are_usage_errors():
    assert "--size" in usage_error(Toy, "--name", "n", "--size", "0")
    assert "--size" in usage_error(Toy, "--name", "n", "--size", "65")
    assert "--rate" in usage_error(Toy, "--name", "n", "--rate", "0")
    assert "--mode" in usage_error(Toy, "--name", "n", "--mode", "medium")
    assert "comma-separated integers" in usage_error(Toy, "--name", "n", "--ids", "1,x")
    assert "--name" in usage_error(Toy)
    for blank in ("", " ", ","):  # never read as 'not given': `--ids "$IDS"` with IDS unset is a mistake
        assert "is empty; give comma-separated integers like 1,9,17" in usage_error(Toy, "--name", "n", "--ids", blank)


def test_gate_builds_its_config_only_when_on():
    assert parse(Toy, "--name", "n").extra is None
    for given, flag in ((("--data", "d"), "--data"), (("--inner-depth", "2"), "--inner-depth")):
        with pytest.raises(UserError, match=f"^{flag} applies only with --extra: add --extra or leave it out$"):
            parse(Toy, "--name", "n", *given)
    cfg = parse(Toy, "--name", "n", "--extra", "--data", "d", "--inner-depth", "2")
    assert cfg.extra == Inner(data="d", depth=2)
    with pytest.raises(UserError, match="^--extra needs --data$"):
        parse(Toy, "--name", "n", "--extra")
    help_of = {o.name: o.help for o in config_options(Toy)}
    assert help_of["extra__data"] == "--extra: the data."


def test_seed_range_is_checked_when_parsed():
    """A seed past 32 bits would overflow torch's seeds (the trainer multiplies it) deep inside a run."""
    with pytest.raises(click.BadParameter, match="0<=x<=4294967295"):
        parse(TrainConfig, "--cache", "c", "--target", "tiny", "--out", "o", "--seed", str(2**70))
    with pytest.raises(UserError, match="^--seed must be at most 4294967295"):
        TrainConfig(cache="c", target="tiny", out="o", seed=2**32)


def test_code_is_held_to_the_same_checks_naming_the_flag():
    for kw, flag in [(dict(rate=0.0), "--rate"), (dict(rate=math.nan), "--rate"), (dict(cap=0), "--cap"),
                     (dict(mode="medium"), "--mode"), (dict(secret=-1), "secret")]:
        with pytest.raises(UserError, match=f"^{flag} "):
            Toy(name="n", **kw)
    with pytest.raises(UserError, match="^--size must be at most 64, got 65$"):
        Grid(size=65)


def test_mistakes_in_the_declaration_are_type_errors():
    @dataclass(frozen=True)
    class Undeclared:
        n: int = 3

    @dataclass(frozen=True)
    class Twice:
        a: int = option(1, flag="--n", help="a")
        b: int = option(2, flag="--n", help="b")

    for cls in (Undeclared, Twice):
        with pytest.raises(TypeError):
            config_options(cls)
    with pytest.raises(TypeError, match="help"):
        option(1)


def test_config_named_by_string_is_imported_when_parsed():
    assert parse("tests.dflash_cache.test_options:Toy", "--name", "n") == Toy(name="n")


# --- the real configs -------------------------------------------------------------------------
REAL = [ExtractConfig, TrainConfig]


def _field_defaults(cls: type) -> dict[str, Any]:
    """flag -> the dataclass default of every option field of `cls` and of the configs nested in it."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        nested = [t for t in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(t)]
        if nested:
            out.update(_field_defaults(nested[0]))
        if f.metadata and f.metadata["dflash_cache.option"].cli:
            default = None if f.default is dataclasses.MISSING else f.default
            out[flag_of(f)] = ",".join(map(str, default)) if isinstance(default, tuple) else default
    return out


@pytest.mark.parametrize("cls", REAL)
def test_every_option_has_help_and_shows_the_dataclass_default(cls):
    command = _command(cls)
    ctx = command.make_context("x", ["--help"], resilient_parsing=True)
    defaults = _field_defaults(cls)
    options = config_options(cls)
    assert {o.opts[0] for o in options} == set(defaults)
    for opt in options:
        assert opt.help, opt.opts
        expected = defaults[opt.opts[0]]
        record = opt.get_help_record(ctx)[1]
        if expected is None or isinstance(expected, bool):
            assert "[default:" not in record, record
        else:
            assert f"[default: {expected}" in record.replace("\n", " "), (opt.opts, record)


def test_parsed_defaults_equal_the_dataclass_defaults():
    assert parse(ExtractConfig, "--model", "tiny", "--data", "d", "--out", "o") == ExtractConfig(
        target=TargetSpec(model="tiny"), data="d", out="o")
    assert parse(TrainConfig, "--cache", "c", "--target", "t", "--out", "o") == TrainConfig(
        cache="c", target="t", out="o")
    assert parse(TrainConfig, "--live", "--data", "d", "--target", "t", "--out", "o") == TrainConfig(
        live=LiveConfig(data="d"), target="t", out="o")


def test_flags_map_to_their_fields():
    cfg = parse(ExtractConfig, "--model", "m", "--data", "d", "--out", "o", "--buckets", "0,32,64", "--num-layers",
                "3", "--layers", "1,2", "--dtype", "float32", "--max-rows", "8", "--no-progress")
    assert cfg.plan.bucket_bounds == (0, 32, 64) and cfg.plan.max_rows == 8 and not cfg.progress
    assert cfg.target == TargetSpec(model="m", dtype="float32", num_layers=3, layers=(1, 2))
    cfg = parse(TrainConfig, "--live", "--data", "d", "--target", "t", "--out", "o", "--target-token-budget", "1024",
                "--target-max-rows", "4", "--num-target-layers", "2", "--write-cache", "w", "--write-codec", "fp8",
                "--target-gpus", "0,1", "--queue-depth", "3", "--limit", "5", "--max-len", "99",
                "--sliding-window", "64")
    assert cfg.live == LiveConfig(data="d", forward_token_budget=1024, forward_max_rows=4, num_target_layers=2,
                                  write_cache="w", write_codec="fp8", target_gpus="0,1", queue_depth=3, limit=5,
                                  max_len=99)
    assert cfg.sliding_window == 64


@pytest.mark.parametrize("make, flag", [
    (lambda: PlanConfig(token_budget=0), "--token-budget"),
    (lambda: PlanConfig(bucket_bounds=(5, 10)), "--buckets"),
    (lambda: TargetSpec(model="m", dtype="int4"), "--dtype"),
    (lambda: ExtractConfig(target=TargetSpec(model="m"), data="d", out="o", writers=0), "--writers"),
    (lambda: ExtractConfig(target=TargetSpec(model="m"), data="d", out="o", codec="zip"), "--codec"),
    (lambda: LiveConfig(data="d", forward_token_budget=0), "--target-token-budget"),
    (lambda: TrainConfig(cache="c", target="t", out="o", lr=0.0), "--lr"),
    (lambda: TrainConfig(cache="c", target="t", out="o", lr=math.inf), "--lr"),
    (lambda: TrainConfig(cache="c", target="t", out="o", block_size=1), "--block-size"),
    (lambda: TrainConfig(cache="c", target="t", out="o", sliding_window=0), "--sliding-window"),
    (lambda: TrainConfig(cache="c", target="t", out="o", loss_chunk=0), "loss_chunk"),
])
def test_real_configs_built_in_code_name_the_flag(make, flag):
    with pytest.raises(UserError, match=f"^{flag} "):
        make()


def test_live_only_options_are_refused_without_live():
    with pytest.raises(UserError, match="^--write-cache applies only with --live"):
        parse(TrainConfig, "--cache", "c", "--target", "t", "--out", "o", "--write-cache", "w")


def test_train_needs_exactly_one_source():
    with pytest.raises(UserError, match="--live needs --data"):
        parse(TrainConfig, "--live", "--target", "t", "--out", "o")
    for args in ([], ["--cache", "c", "--live", "--data", "d"]):
        with pytest.raises(UserError, match="give either --cache DIR or --live with --data"):
            parse(TrainConfig, "--target", "t", "--out", "o", *args)
