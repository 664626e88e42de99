"""Typed dataclass configs turned into argparse flags, and written into run directories as resolved JSON.

Each entry point (`inflight.serve`, `inflight.learn`, `inflight.run`) has one dataclass, composed by inheritance of
small dataclasses grouped by concern; every field is declared with `knob` (its default and help, once) and
`parse_dataclass` makes one `--flag` per field with the field's default, so `--help` lists every knob and the
defaults are what runs the embedded demo. A knob both sides share is declared once, in inflight/wire/contract.py;
a run flag that only forwards a side's knob takes that knob's default and help with `knob_of`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def knob(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A config field: its default and the help its `--flag` shows (with the default appended)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def knob_of(cls: type, name: str, who: str) -> Any:
    """`cls`'s field `name` declared again by reference: the same default, choices and help, the help prefixed with
    `who` (the side it reaches), so a run flag that forwards a side's knob cannot drift from it."""
    source = {f.name: f for f in dataclasses.fields(cls)}[name]
    return knob(source.default, f"{who}: {source.metadata['help']}", source.metadata.get("choices"))


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def declaring_class(cls: type, name: str) -> type:
    """The class in `cls`'s composition that declares field `name` (its knob section)."""
    return next(k for k in cls.__mro__ if name in vars(k).get("__annotations__", {}))


def section_title(klass: type) -> str:
    """A knob section's `--help` heading: the class name and its docstring's first sentence."""
    doc = " ".join((klass.__doc__ or "").strip().split("\n\n")[0].split())
    return f"{klass.__name__}: {doc.split('. ')[0].rstrip('.:')}" if doc else klass.__name__


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """One `--flag` per field, grouped in `--help` by the knob class that declares it (its section)."""
    groups: dict[type, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(cls):
        klass = declaring_class(cls, f.name)
        if klass not in groups:
            groups[klass] = parser.add_argument_group(section_title(klass))
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        kind = type(default)
        # A bool flag alone means true (`--resume`); `--resume true|false` still works.
        flag = {"nargs": "?", "const": True} if kind is bool else {}
        groups[klass].add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f.name,
            type=_parse_bool if kind is bool else kind,
            default=default,
            choices=f.metadata.get("choices"),
            help=f"{f.metadata.get('help', '')} (default {default!r})",
            **flag,
        )


def refuse_renamed(parser: argparse.ArgumentParser, argv: list[str], renamed: dict[str, str]) -> None:
    """A usage error for a flag that was renamed (old flag -> what to pass now): the old name meant something else on
    another side, so it is refused, not taken as an alias."""
    for word in argv:
        old = word.split("=", 1)[0]
        if old in renamed:
            parser.error(f"{old} was renamed: {renamed[old]}")


class _OneLineErrors(argparse.ArgumentParser):
    """A parser whose error is its one line, without the usage text: for flags forwarded by another command
    (`inflight.run --serve-args`), whose user did not type this parser's command and would look for the error under
    a usage text not theirs."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_dataclass(
    cls: type[T], argv: list[str] | None, prog: str, description: str, one_line_errors: bool = False
) -> T:
    """Parse `argv` into `cls`; a `validate()` method on the config turns its ValueError into a usage error, and a
    `RENAMED_FLAGS` dict on it refuses old flag names with their new spelling. `one_line_errors`: an error prints only
    `prog: error: ...` (`prog` names the forwarding flag), not the usage text."""
    parser = (_OneLineErrors if one_line_errors else argparse.ArgumentParser)(prog=prog, description=description)
    add_dataclass_args(parser, cls)
    argv = sys.argv[1:] if argv is None else list(argv)
    refuse_renamed(parser, argv, getattr(cls, "RENAMED_FLAGS", {}))
    ns = parser.parse_args(argv)
    cfg = cls(**vars(ns))
    try:
        getattr(cfg, "validate", lambda: None)()
    except ValueError as exc:
        parser.error(str(exc))
    return cfg


def write_resolved(cfg: Any, path: Path) -> None:
    """Write the resolved config as JSON (one file per run side)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(cfg), indent=2, sort_keys=True) + "\n")


def require(cond: bool, field: str, value: Any, expected: str) -> None:
    """Raise a ValueError naming the flag, the value seen and what is expected."""
    if not cond:
        raise ValueError(f"--{field.replace('_', '-')} is {value!r}, expected {expected}")


def setup_logging(name: str = "inflight") -> None:
    """INFO lines of our own loggers on stderr, whatever vLLM or torch did to the root logger before."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
