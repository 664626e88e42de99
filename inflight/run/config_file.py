"""`python -m inflight.run --config run.toml`: a run's knobs in one TOML file; the resolved copy in the run directory.

    steps = 20                 # top level: RunConfig fields (hyphens or underscores), as the run's flags
    mode = "blocking"
    [serve]                    # that side's own flags (ServeConfig fields), handed to inflight.serve
    max_inflight = 32
    [learn]                    # LearnConfig fields, handed to inflight.learn
    loss = "ppo"

Precedence, lowest first: the dataclass defaults, the file, the command line. A table's entries become that side's
argv after the knobs the run sets itself and before `serve_args` / `learn_args`, so a pass-through string still
overrides the file. A table may not set a knob the run sets from its own keys (`[learn] lr`): the two sides would
disagree, or the top-level key would silently lose; the error names the top-level key to use instead.

`main` writes `<run_dir>/config.toml`: every RunConfig field as resolved (the run directory included) plus the
tables, which `--config` reads again to the same configs (tests/inflight/test_run_config_file.py). The TOML writer is
our own: flat scalars, strings, lists of them, and the two tables are all a run needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import sys
from pathlib import Path
from typing import Any

from inflight.config import add_dataclass_args
from inflight.learn.config import LearnConfig
from inflight.run.config import FORWARDED, RUN_DERIVES, RunConfig
from inflight.serve.config import ServeConfig
from inflight.wire.contract import SharedKnobs

SIDES = ("serve", "learn")
SIDE_ARGS = ("--serve-args", "--learn-args")
# side field -> the top-level key the run sets it from: the shared knobs (inflight/wire/contract.py:SharedKnobs) and the
# forwarded ones under their own names, the derived ones from theirs (inflight/run/config.py: FORWARDED, RUN_DERIVES)
RUN_SETS = {
    side: {f.name: f.name for f in dataclasses.fields(SharedKnobs)}
    | {name: name for name in FORWARDED[side]}
    | RUN_DERIVES[side]
    for side in SIDES
}
# the sides' configs, by the name a run file's table has
SIDE_CONFIGS: dict[str, type] = {"serve": ServeConfig, "learn": LearnConfig}


class ConfigFileError(ValueError):
    """A run file that cannot be used: the message names the file, the table and the key."""


# -- reading ---------------------------------------------------------------------------------------------------------


def load_run_file(path: str | Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Read a run file: (top-level RunConfig values, {"serve": {...}, "learn": {...}}), every key a field name with
    underscores and every value of its field's type. ConfigFileError names the file, the table and the key of an
    unknown key, a value of the wrong type, an unknown table or a table key the run sets itself."""
    path = Path(path)
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise ConfigFileError(f"--config {path}: reading TOML needs Python >= 3.11 (tomllib)") from None
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigFileError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"--config {path}: not TOML ({exc})") from None
    tables = {side: raw.pop(side, {}) for side in SIDES}
    for name, value in raw.items():
        if isinstance(value, dict):
            raise ConfigFileError(f"{path}: unknown table [{name}]; a run file has [serve] and [learn] only")
    top = _typed_values(path, "top level", raw, RunConfig)
    sides = {}
    for side in SIDES:
        sides[side] = _typed_values(path, f"[{side}]", tables[side], SIDE_CONFIGS[side])
        for key in sides[side]:
            if key in RUN_SETS[side]:
                raise ConfigFileError(
                    f"{path}: [{side}] {key} is set by the run from its top-level key "
                    f"'{RUN_SETS[side][key]}': set that instead, at the top of the file"
                )
    return top, sides


def _typed_values(path: Path, where: str, table: dict, cls: type) -> dict[str, Any]:
    """`table` with hyphens made underscores, each key checked against `cls`'s fields and each value against the type
    of the field's default."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        renamed = getattr(cls, "RENAMED_FLAGS", {}).get(f"--{name.replace('_', '-')}")
        if renamed:
            raise ConfigFileError(f"{path}: {where} {key} was renamed: {renamed}")
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; known keys: {', '.join(fields)}"
            raise ConfigFileError(
                f"{path}: unknown key '{key}' in the {where} ({cls.__name__} has no field {name}){hint}"
            )
        out[name] = _typed(path, where, key, value, fields[name])
    return out


def _typed(path: Path, where: str, key: str, value: Any, f: dataclasses.Field) -> Any:
    kind = type(f.default)
    if kind is float and type(value) is int:  # TOML `lr = 1` is an integer; the field is a float
        value = float(value)
    choices = f.metadata.get("choices") or ()
    if kind is str and type(value) is bool and "true" in choices:  # `enforce_eager = false`: a tri-state knob's bool
        value = "true" if value else "false"
    if type(value) is not kind:
        raise ConfigFileError(
            f"{path}: {where} {key} = {value!r} is a {type(value).__name__}, expected a "
            f"{kind.__name__} (default {f.default!r})"
        )
    if choices and value not in choices:
        raise ConfigFileError(f"{path}: {where} {key} = {value!r}, expected one of {', '.join(map(str, choices))}")
    return value


def table_argv(table: dict[str, Any]) -> list[str]:
    """A side's table as its flags: `{"max_inflight": 32, "resume": True}` -> `--max-inflight=32 --resume=true` (one
    word each, so a value that starts with `-` is not taken for an option)."""
    return [f"--{name.replace('_', '-')}={_flag_text(value)}" for name, value in table.items()]


def _flag_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)  # repr: every digit of a float


# -- the command line ------------------------------------------------------------------------------------------------


def glue_side_args(argv: list[str]) -> list[str]:
    """`--learn-args --resume` -> `--learn-args=--resume`: argparse would read a value that starts with `--` as an
    option of its own and refuse it; the value of a pass-through flag is always the next word."""
    out, words = [], iter(argv)
    for word in words:
        if word in SIDE_ARGS:
            value = next(words, None)
            out.append(word if value is None else f"{word}={value}")  # a missing value: argparse says so
        else:
            out.append(word)
    return out


def run_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--config",
        default="",
        help="a run file (TOML): top-level keys are this command's "
        "flags, [serve] and [learn] tables the sides' own; flags given here override it "
        "(default '')",
    )
    add_dataclass_args(parser, RunConfig)
    return parser


def parse_run_args(argv: list[str] | None, prog: str, description: str) -> tuple[RunConfig, dict[str, dict]]:
    """The launcher's command line (and its `--config` file) as a validated RunConfig and the side tables. A bad flag,
    file or value exits 2 with argparse's usage and a message naming it."""
    argv = glue_side_args(sys.argv[1:] if argv is None else list(argv))
    parser = run_parser(prog, description)
    ns = vars(parser.parse_args(argv))
    config = ns.pop("config")
    tables: dict[str, dict] = {side: {} for side in SIDES}
    if config:
        try:
            top, tables = load_run_file(config)
        except ConfigFileError as exc:
            parser.error(str(exc))
        parser.set_defaults(**top)  # the file's values replace the defaults; what the command line gives still wins
        ns = vars(parser.parse_args(argv))
        ns.pop("config")
    cfg = RunConfig(**ns)
    try:
        cfg.validate()
    except ValueError as exc:
        parser.error(str(exc))
    return cfg, tables


# -- writing ---------------------------------------------------------------------------------------------------------


def toml_value(value: Any) -> str:
    """One TOML value: a bool, int, float (inf and nan included), string or list of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string (same escapes, \uXXXX included)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as a TOML value")


def dump_run_toml(top: dict[str, Any], tables: dict[str, dict[str, Any]]) -> str:
    """`top` as `key = value` lines, then each non-empty table; keys must be bare (letters, digits, _ and -)."""
    lines = [f"{key} = {toml_value(value)}" for key, value in top.items()]
    for side in SIDES:
        if tables.get(side):
            lines += ["", f"[{side}]", *(f"{key} = {toml_value(v)}" for key, v in tables[side].items())]
    return "\n".join(lines) + "\n"


def write_run_toml(cfg: RunConfig, tables: dict[str, dict[str, Any]], run_dir: Path) -> Path:
    """`<run_dir>/config.toml`: the resolved run (its directory filled in) that `--config` reads back."""
    top = dataclasses.asdict(cfg) | {"run_dir": str(run_dir)}
    path = Path(run_dir) / "config.toml"
    path.write_text(
        "# the resolved config of this run: python -m inflight.run --config "
        + str(path)
        + "\n"
        + dump_run_toml(top, tables)
    )
    return path
