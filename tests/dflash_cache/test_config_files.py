"""`--config FILE`: options from a YAML, TOML or JSON file, the command line over it; and the
config.yaml a training run writes, which runs it again."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from dflash_cache.cli import cli
from dflash_cache.config_files import RUN_CONFIG_FILE, write_run_config
from dflash_cache.errors import UserError
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.extract.regenerate import RegenerateConfig
from dflash_cache.options import ConfigCommand, config_options
from dflash_cache.train.run_config import LiveConfig, TrainConfig
from tests.dflash_cache.test_cli import assert_refused
from tests.dflash_cache.test_options import Grid, Inner, Toy, parse
from tests.train.conftest import demo_cache  # noqa: F401  (a fixture)

TOY = Toy(name="n", grid=Grid(size=16, bounds=(0, 3, 10)), ids=(1, 9, 17), rate=1e-10, mode="slow", loud=True,
          progress=False, extra=Inner(data="d", depth=2))
TOY_TEXT = {
    ".yaml": "name: n\nsize: 16\nbounds: 0,3,10\nids: [1, 9, 17]\nrate: 1e-10\nmode: slow\nloud: true\n"
             "no_progress: true\nextra: true\ndata: d\ninner-depth: 2\n",
    ".toml": 'name = "n"\nsize = 16\nbounds = "0,3,10"\nids = [1, 9, 17]\nrate = 1e-10\nmode = "slow"\nloud = true\n'
             'no_progress = true\nextra = true\ndata = "d"\ninner-depth = 2\n',
    ".json": json.dumps({"name": "n", "size": 16, "bounds": "0,3,10", "ids": [1, 9, 17], "rate": 1e-10,
                         "mode": "slow", "loud": True, "no_progress": True, "extra": True, "data": "d",
                         "inner-depth": 2}),
}


def parse_train(*args: str) -> tuple[TrainConfig, str]:
    """What `train` would run from `args`: its config and its --device."""
    command = ConfigCommand("train", config=TrainConfig, params=[click.Option(["--device"], default="auto")],
                            callback=lambda cfg, device: (cfg, device))
    return command.main(list(args), standalone_mode=False)


def _file(tmp_path: Path, text: str, suffix: str = ".yaml") -> str:
    path = tmp_path / f"options{suffix}"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("suffix", sorted(TOY_TEXT))
def test_a_file_fills_every_kind_of_option(tmp_path, suffix):
    """Values, comma lists (as text or as a list), flags (--no-x too), a gate and its options; a
    required option given only in the file is given."""
    assert parse(Toy, "--config", _file(tmp_path, TOY_TEXT[suffix], suffix)) == TOY


def test_the_command_line_overrides_the_file_and_the_file_the_defaults(tmp_path):
    path = _file(tmp_path, "name: n\nsize: 16\nmode: slow\n")
    assert parse(Toy, "--size", "32", "--config", path, "--name", "m") == Toy(name="m", grid=Grid(size=32),
                                                                              mode="slow")
    assert parse(Toy, "--config", _file(tmp_path, "name: n\ncap: null\n")) == Toy(name="n")  # null: the default


@pytest.mark.parametrize("text, says", [
    ("name: n\nsise: 3\n", "no option 'sise' here; did you mean 'size'?"),
    ("name: n\nprogres: false\n", "did you mean 'progress'?"),  # a flag's field name is a key too
    ("name: n\nprogress: false\nno-progress: true\n", "'no-progress' is given twice (as 'progress' and 'no-progress')"),
    ("name: n\nsecret: 3\n", "no option 'secret' here; the keys are the options of"),  # cli=False is not an option
    ("name: n\nsize: 3\nsize_: 4\n", "no option 'size_'"),
    ("name: n\ninner_depth: 3\ninner-depth: 4\n", "'inner-depth' is given twice"),
])
def test_an_unknown_key_is_refused_naming_it_and_the_file(tmp_path, text, says):
    path = _file(tmp_path, text)
    with pytest.raises(UserError, match=f"^{path}: ") as info:
        parse(Toy, "--config", path)
    assert says in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("text, says", [
    ("size: 0", "invalid value for 'size' in {path}: 0 is not in the range 1<=x<=64"),
    ("size: abc", "'abc' is not a valid integer"),
    ("size: 3.5", "'3.5' is not a valid integer"),  # not quietly 3
    ("size: true", "'size' takes a value, not true or false"),
    ("mode: medium", "'medium' is not one of 'fast', 'slow'"),
    ("ids: [1, x]", "expected comma-separated integers like 1,9,17"),
    ("ids: ''", "is empty"),
    ("loud: 3", "'loud' is a flag: give true or false"),
    ("progress: 'no'", "'progress' is a flag: give true or false, not 'no'"),  # by its field's name, as by its flag
    ("rate: {a: 1}", "'rate' takes a value"),
])
def test_a_bad_value_is_the_command_line_s_error_naming_the_file(tmp_path, text, says):
    path = _file(tmp_path, f"name: n\n{text}\n")
    with pytest.raises(UserError) as info:
        parse(Toy, "--config", path)
    message = str(info.value)
    assert path in message and says.format(path=path).lower() in message.lower() and "\n" not in message


@pytest.mark.parametrize("name, text, says", [
    ("options.ini", "size = 3\n", "is not a .yaml, .yml, .toml or .json file"),
    ("missing.yaml", None, "cannot read it"),
    ("options.yaml", "name: [n\n", "not valid YAML"),
    ("options.toml", "name = \n", "not valid TOML"),
    ("options.json", "{name: 1}", "not valid JSON"),
    ("options.yaml", "- name\n- n\n", "holds a list, not a mapping of option names to values"),
])
def test_a_file_that_cannot_be_read_is_one_line(tmp_path, name, text, says):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(UserError, match=f"^--config {path}[: ]") as info:
        parse(Toy, "--config", str(path))
    assert says in str(info.value) and "\n" not in str(info.value)


SWITCHED = {  # config classes with the options every parse of them needs
    "toy": (Toy, ("--name", "n")),
    "extract": (ExtractConfig, ("--model", "tiny", "--data", "d", "--out", "o")),
    "regenerate": (RegenerateConfig, ("--model", "tiny", "--data", "d", "--out", "o")),
    "train": (TrainConfig, ("--target", "t", "--out", "o", "--cache", "c")),
}


def _value(cfg: object, option: click.Option) -> object:
    return functools.reduce(getattr, option.name.split("__"), cfg)


@pytest.mark.parametrize("command", sorted(SWITCHED))
def test_every_boolean_option_takes_true_or_false_by_its_name_or_by_its_flag(tmp_path, command):
    """`progress: false` is `--no-progress` and `resume: true` is `--resume` (the field's value); a
    flag's own key (`no-progress: true`) says whether the flag is given; a flag on the command line wins
    over the file; anything but true or false is refused in one line naming the key."""
    config, needed = SWITCHED[command]
    default = parse(config, *needed)
    switches = [o for o in config_options(config) if o.is_flag and isinstance(_value(default, o), bool)]
    assert any(o.default is True for o in switches) and any(o.default is False for o in switches)
    for option in switches:
        flag, name = option.opts[0], option.name.rsplit("__", 1)[-1]
        off, on = _value(default, option), _value(parse(config, *needed, flag), option)
        assert on is not off
        for key, value, want in ((name, True, True), (name, False, False), (flag[2:], True, on),
                                 (flag[2:], False, off)):
            path = _file(tmp_path, f"{key}: {str(value).lower()}\n")
            assert _value(parse(config, *needed, "--config", path), option) is want, (key, value)
        path = _file(tmp_path, f"{name}: {str(off).lower()}\n")
        assert _value(parse(config, *needed, "--config", path, flag), option) is on  # the command line wins
        path = _file(tmp_path, f"{name}: maybe\n")
        with pytest.raises(UserError) as info:
            parse(config, *needed, "--config", path)
        assert str(info.value) == f"{path}: {name!r} is a flag: give true or false, not 'maybe'"


def test_yaml_without_pyyaml_says_how_to_get_it_or_what_else_works(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(UserError, match=r"needs PyYAML: pip install pyyaml, or write it as \.toml or \.json$"):
        parse(Toy, "--config", _file(tmp_path, "name: n\n"))
    assert parse(Toy, "--config", _file(tmp_path, '{"name": "n"}', ".json")) == Toy(name="n")


# --- the real commands ------------------------------------------------------------------------
def test_live_options_from_a_file_and_the_live_only_check(tmp_path):
    path = _file(tmp_path, "target: t\nout: o\nlive: true\ndata: d\ntarget-token-budget: 1024\nlayers: [1, 2]\n")
    assert parse(TrainConfig, "--config", path, "--limit", "5") == TrainConfig(
        target="t", out="o", live=LiveConfig(data="d", forward_token_budget=1024, layers=(1, 2), limit=5))
    path = _file(tmp_path, "target: t\nout: o\ncache: c\nwrite-cache: w\n")
    with pytest.raises(UserError, match="^--write-cache applies only with --live"):
        parse(TrainConfig, "--config", path)
    path = _file(tmp_path, "target: t\nout: o\ndata: d\n")  # the gate on the command line, its option in the file
    assert parse(TrainConfig, "--config", path, "--live").live == LiveConfig(data="d")


def test_the_cli_refuses_a_bad_file_in_one_line_exit_2(tmp_path):
    for text, needles in (("token_budgt: 4\n", ("no option 'token_budgt' here; did you mean 'token-budget'?",)),
                          ("token-budget: abc\n", ("'token-budget'", "not a valid integer")),
                          ("compile: 1\n", ("'compile' is a flag: give true or false, not 1",))):
        path = _file(tmp_path, text)
        r = CliRunner().invoke(cli, ["train", "--target", "tiny", "--out", str(tmp_path / "run"), "--config", path])
        assert_refused(r, path, *needles)
    path = _file(tmp_path, "model: tiny\ndata: demo\nout: o\ngpus: nine\ncodec: zip\n")  # extract reads it too
    assert_refused(CliRunner().invoke(cli, ["extract", "--config", path]), path, "'zip' is not one of")


@pytest.mark.parametrize("cfg", [
    TrainConfig(cache="c", target="tiny", out="o"),
    TrainConfig(cache="s3://b/c", target="t", out="o", lr=1e-10, max_steps=3, progress=False, compile=False,
                resume=True, attention_kernels="triton", profile_interval=0.5, seed=2**32 - 1),
    TrainConfig(target="1", out="yes", live=LiveConfig(data="null", layers=(1, 9, 17), target_gpus="0,1",
                                                       write_cache="w", limit=2)),
])
def test_the_written_config_reads_back_as_the_same_config(tmp_path, cfg):
    """Strings YAML would read as numbers, booleans or null stay strings; floats keep every bit."""
    path = write_run_config(tmp_path, "train", cfg, device="cpu")
    assert path == tmp_path / RUN_CONFIG_FILE
    assert parse_train("--config", str(path)) == (cfg, "cpu")


def test_a_train_run_writes_its_config_and_the_file_runs_it_again(demo_cache, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    args = ["--cache", str(demo_cache), "--target", "tiny", "--out", str(out), "--no-compile", "--max-steps", "1",
            "--block-size", "8", "--draft-layers", "1", "--num-anchors", "8", "--token-budget", "1024",
            "--no-progress"]
    r = CliRunner().invoke(cli, ["train", *args, "--device", "cpu"])
    assert r.exit_code == 0, r.output
    written = out / RUN_CONFIG_FILE
    text = written.read_text()
    assert text.startswith("# ") and "dflash-cache 0.1.0" in text and "torch " in text and "python " in text
    assert parse_train("--config", str(written)) == parse_train(*args, "--device", "cpu")
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]

    # A refused resume (another block size) leaves the record of the run that was trained.
    r = CliRunner().invoke(cli, ["train", "--config", str(written), "--resume", "--block-size", "4"])
    assert_refused(r, "--block-size")
    assert written.read_text() == text
    # A run refused in a directory of its own takes it back: no config.yaml keeps it there.
    new = tmp_path / "new"
    r = CliRunner().invoke(cli, ["train", "--config", str(written), "--out", str(new), "--cache", str(tmp_path)])
    assert_refused(r, str(tmp_path))
    assert not new.exists()
    # The file runs the run again; a resume rewrites it with the options it ran with.
    r = CliRunner().invoke(cli, ["train", "--config", str(written), "--resume", "--max-steps", "2"])
    assert r.exit_code == 0 and "done: step 2" in r.output, r.output
    assert parse_train("--config", str(written)) == parse_train(*args, "--device", "cpu", "--resume", "--max-steps",
                                                                "2")
