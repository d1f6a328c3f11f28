"""Options kept in a file: what `--config FILE` reads, and the config.yaml a training run writes.

A file is a mapping of option names, as on the command line without the dashes
(`token-budget: 4096`, or `token_budget`; a flag true or false, and a `--no-x` flag also as
`x: false`), to values; YAML (.yaml, .yml: with PyYAML, which transformers already installs),
TOML (.toml) or JSON (.json), told apart by the suffix. Which keys a command takes, and what their
values may be, is the command's business (`dflash_cache.options.ConfigCommand`): this module only
reads and writes files.
"""

from __future__ import annotations

import contextlib
import json
import platform
import tomllib
from collections.abc import Callable, Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from dflash_cache import __version__
from dflash_cache.errors import UserError, write_error
from dflash_cache.files import write_bytes_atomic

RUN_CONFIG_FILE = "config.yaml"  # in a training run's directory: its resolved options
FORMATS = {".yaml": "YAML", ".yml": "YAML", ".toml": "TOML", ".json": "JSON"}
_VERSIONS_OF = ("torch", "transformers")


def _parse(kind: str, text: str) -> Any:
    if kind == "TOML":
        return tomllib.loads(text)
    if kind == "JSON":
        return json.loads(text)
    import yaml  # ImportError: the caller says how to do without

    return yaml.safe_load(text)


def read_config_file(path: str) -> dict[str, Any]:
    """The mapping `path` holds; a file that is missing, of another format, malformed or not a
    mapping is a one-line UserError naming it."""
    where = f"--config {path}"
    kind = FORMATS.get(Path(path).suffix.lower())
    if kind is None:
        raise UserError(f"{where} is not a .yaml, .yml, .toml or .json file; write the options in one of those "
                        "formats and name the file so")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else "not UTF-8 text"
        raise UserError(f"{where}: cannot read it ({reason}); check the path") from None
    try:
        data = _parse(kind, text)
    except ImportError:
        raise UserError(f"{where}: reading YAML needs PyYAML: pip install pyyaml, or write it as .toml or .json") \
            from None
    except Exception as e:  # each parser has its own error class; all of them mean a malformed file
        raise UserError(f"{where}: not valid {kind}: {' '.join(str(e).split())}; fix the file") from None
    if data is None:  # an empty YAML file
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{where} holds a {type(data).__name__}, not a mapping of option names to values; write "
                        "one `name: value` per option")
    return data


def _versions() -> str:
    """What made a run, for someone repeating it: this package, Python, torch and transformers."""
    out = [f"dflash-cache {__version__}", f"python {platform.python_version()}"]
    for name in _VERSIONS_OF:
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} not installed")
    return ", ".join(out)


def write_run_config(directory: Path, command: str, config: Any, **command_options: Any) -> Path:
    """Write `config`'s options (and the command's own, like `device`) to `directory`/config.yaml,
    atomically, as `--config` reads them: `dflash-cache COMMAND --config FILE` runs them again. The
    versions that ran them are comments, which `--config` ignores."""
    import yaml

    from dflash_cache.options import file_values

    path = directory / RUN_CONFIG_FILE
    header = (f"# dflash-cache {command} --config {RUN_CONFIG_FILE} runs these options again; flags given with it "
              f"override them.\n# Written by {_versions()}.\n")
    body = yaml.safe_dump({**file_values(config), **command_options}, sort_keys=False, width=1 << 16)
    try:
        write_bytes_atomic(path, (header + body).encode())
    except OSError as e:
        raise write_error(e, f"writing {path}", "run the command again") from None
    return path


@contextlib.contextmanager
def run_config_written(directory: Path, command: str, config: Any, *, progress: Callable[[], Any],
                       **command_options: Any) -> Iterator[Path]:
    """`write_run_config` for the run inside the block. `progress()` says what a run keeps in
    `directory` (its newest checkpoint): if a UserError ends the block with that unchanged, the run
    was refused (a --resume with other options) or left nothing to continue, so the record of what
    the directory holds is put back (or, in a directory of no earlier run, removed)."""
    path = directory / RUN_CONFIG_FILE
    try:
        previous: bytes | None = path.read_bytes()
    except OSError:  # none yet (anything else that is in the way, the write below reports)
        previous = None
    before = progress()
    write_run_config(directory, command, config, **command_options)
    try:
        yield path
    except UserError:
        if progress() == before:
            with contextlib.suppress(OSError):  # the error that ended the run is the one to report
                if previous is None:
                    path.unlink(missing_ok=True)
                else:
                    write_bytes_atomic(path, previous)
        raise
