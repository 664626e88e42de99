"""The config tree: typed dataclass configs turned into argparse flags, read from run files, and written into run
directories as resolved JSON.

Each entry point (`inflight.serve`, `inflight.learn`, `inflight.run`) reads one dataclass, composed by inheritance of
knob sections (small dataclasses grouped by concern); `parse_dataclass` makes one `--flag` per field with the field's
default, grouped in `--help` by the section that declares it. A knob is declared once, where its default and help are
written (`knob`):
- a knob both sides share, in inflight/wire/contract.py:SharedKnobs (the run's top-level keys too);
- a knob a lower package's config is built from, in that package when the config tree may import it (learner/knobs.py:
  learner/step.py:TrainConfig's and learner/losses.py:LossConfig's), or here when a node that parses the serve's flags
  may lack it (`EngineSizing`: the serve's flags and vllm_patches/engine.py:EngineConfig; `inflight.run` on a learner
  node has no vllm_patches);
- any other in the section of the one entry point that reads it.

Another part of the tree reuses a declaration by inheriting its section or with `section_of` (the learner's loss and
step knobs, the run's forwarded keys): a section generated from it, whose fields carry metadata `from` naming the
declaration (tests/test_config_tree.py checks that no knob is declared twice). Called by the entry points' `main` in
their own process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def knob(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A config field: its default and the help its `--flag` shows (with the default appended)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def section_of(
    name: str, doc: str, source: type, names: dict[str, str] | tuple[str, ...], module: str, prefix: str = ""
) -> type:
    """A knob section generated from `source`'s declarations, for another part of the tree to reuse them: each field
    (`names`: the field names, or {new name: `source`'s field}) takes the declared default, choices and help, the help
    after `prefix` (`{flag}` in it: the flag), and metadata `from` names the declaration, so the field is a
    reference and cannot drift from it. `doc` is the section's `--help` heading (its first sentence); `module` the
    caller's `__name__`, where the section is named (for its repr and pickles)."""
    names = names if isinstance(names, dict) else {n: n for n in names}
    declared = {f.name: f for f in dataclasses.fields(source)}
    fields = []
    for new, old in names.items():
        f = declared[old]
        head = prefix.format(flag=f"--{new.replace('_', '-')}")
        meta = {**f.metadata, "help": head + f.metadata["help"], "from": f"{source.__name__}.{old}"}
        fields.append((new, f.type, dataclasses.field(default=f.default, metadata=meta)))
    return dataclasses.make_dataclass(name, fields, namespace={"__doc__": doc, "__module__": module})


def declared_values(cfg: Any, section: type) -> dict[str, Any]:
    """`cfg`'s values of a `section_of` section, under the names of the declarations they reuse: the keyword
    arguments that build the declaring config back (inflight/learn/app.py:train_config)."""
    return {f.metadata["from"].split(".")[1]: getattr(cfg, f.name) for f in dataclasses.fields(section)}


@dataclass
class EngineSizing:
    """The vLLM engine's size: its context, batch, workers, memory and sampling seed."""

    max_model_len: int = knob(1024, "engine context length")
    max_num_seqs: int = knob(256, "engine batch limit")
    tensor_parallel_size: int = knob(
        1,
        "engine workers sharing the model (vLLM's tensor parallelism); each takes its own rank in the weights group, "
        "receives every bucket and loads its shard",
    )
    kv_cache_gib: float = knob(
        1.0,
        "CPU: KV cache size in GiB (fractions allowed); allocated and zeroed at start: a "
        "smaller one starts faster. Not used on CUDA (--gpu-memory-utilization)",
    )
    gpu_memory_utilization: float = knob(
        0.9,
        "CUDA: the fraction of the GPU's memory vLLM may take, in (0, 1] "
        "(weights, activations, CUDA graphs; the KV cache gets the rest); used "
        "there in place of --kv-cache-gib. Not used on CPU",
    )
    seed: int = knob(0, "engine sampling seed")

    def sizing(self) -> dict[str, Any]:
        """These knobs' values, for building another config that holds them (vllm_patches/engine.py:EngineConfig)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineSizing)}


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
