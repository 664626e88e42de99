"""One config tree (issue 39): every knob is declared once — its default and help written in one place — and every flag
of the entry points comes from that one declaration.

The tree is every dataclass the entry points and the lower packages configure themselves with: the serve's, the
learner's and the run's configs (with the knob sections they are composed of), and the configs the lower packages are
built from (vllm_patches/engine.py:EngineConfig, learner/step.py:TrainConfig and learner/losses.py:LossConfig with
their sections in learner/knobs.py and inflight/wire/contract.py:SamplingKnobs). A knob is *declared* where its default
or help is written: by a class whose own body has the field with a default or a help (an inherited field is its base's
declaration, reused; a required field without help is a slot its builder fills); a field generated from another
declaration (inflight/config.py:section_of, metadata `from`) is a reference, not a declaration. Two declarations of the
same knob are a duplicate: the same name in two classes, unless the two are different knobs that happen to share a
name (HOMONYMS, each with why).

The entry points' parsers are the real ones, caught when `main` first parses (nothing starts): every flag of the serve,
the learner and the run is a field of the tree with that field's default and help; every other `python -m` entry point
with flags (inflight's demos and tools, the benchmarks, the scripts) may share a name with a knob of the tree only by
reusing its declaration, or where it is its own setting (OWN_FLAGS, why).

Nothing starts; no engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
from collections.abc import Callable
from pathlib import Path

import pytest

from inflight.learn.config import LearnConfig
from inflight.run.config import RunConfig
from inflight.serve.config import ServeConfig
from learner.losses import LossConfig
from learner.step import TrainConfig
from vllm_patches.engine import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
ROOTS = (ServeConfig, LearnConfig, RunConfig, EngineConfig, TrainConfig, LossConfig)

# (class name, field) -> the knob it is, where a field's name is not its knob's name, or where two different knobs
# share a name (each says why they are different knobs).
HOMONYMS = {
    ("LossSettings", "kind"): "loss",  # the learner's --loss, under the loss function's own name
    ("PrecisionKnobs", "dtype"): "learn.dtype",  # the learner's parameter dtype; the serve's --dtype is its engine's
    ("RunDirKnobs", "seed"): "learn.seed",  # the learner's torch seed; the serve's --seed is its sampling seed
    ("RunKnobs", "dtype"): "run.dtype",  # both sides' compute precision: sets the serve's --dtype and --autocast
    ("RunKnobs", "seed"): "run.seed",  # sets the serve's --seed and --task-seed and the learner's --seed
    ("RunKnobs", "run_dir"): "run.run_dir",  # the run's directory (default: dated); the learner's is derived from it
}

# Flags of the other `python -m` entry points that share a name with a knob of the tree but are another knob: a demo's
# or a benchmark's own setting of what it measures, at the size its measurement needs (a flag that reuses the tree's
# declaration, with its help, needs no entry: scripts/task_accuracy.py builds its serve flags from ServeConfig's).
OWN_FLAGS = {
    # the engine demo samples a few groups with no learner: its own small defaults
    "inflight.demo": {"model", "group_size", "max_tokens", "temperature", "seed"},
    "inflight.run.demo": {"duration_s"},  # the training budget of each mode of the demo, not one run's limit
    # the directory of a running run, the serves it should have now and how long to wait for its driver
    "inflight.run.scale": {"run_dir", "serves", "timeout_s"},
    "benchmarks.ablate": {"duration_s"},  # per mode, as inflight.run.demo
    "benchmarks.launchers": {"duration_s"},  # per launcher
    "benchmarks.delta_updates": {"steps", "lr", "group_size", "dtype", "model"},  # learning rates swept, bf16 serve
    "benchmarks.fused_loss": {"device"},  # where the kernels are timed
    "benchmarks.gpu_learner": {"replay", "steps", "bucket_mb", "learn_args", "backend", "device"},  # a CUDA learner
    "benchmarks.head_precision": {"model", "max_tokens"},
    # the serve ranks of its one gloo world (not a run's serves) and the bucket both link designs stream through
    "benchmarks.learner_links": {"serves", "bucket_mb"},
    "benchmarks.low_commit": {"model", "dtype"},  # the checkpoint and dtype whose commit is timed
    "benchmarks.lora_swap": {"kv_cache_gib"},  # a small KV cache: the swap is measured, not generation
    "benchmarks.publish_memory": {"model", "bucket_mb", "dtype"},
    "benchmarks.routing_replay": {"dtype", "max_tokens"},
    "benchmarks.sliced_staging": {"model", "update_memory"},
    "benchmarks.step_overhead": {"model", "replay", "steps"},
    "benchmarks.tp_plan": {"gpu_memory_utilization"},
    "benchmarks.trim_policy": {"run_dir"},
    "benchmarks.weight_swap": {"dtype", "kv_cache_gib"},
    "scripts.soak": {"run_dir", "checkpoint_every"},  # the soak's own run directory and checkpoint cadence
    "scripts.task_accuracy": {"task_seed"},  # held-out problems: not the serve's training stream
}
# Options of the serve, the learner and the run that are no knob: what the tree is read from.
NOT_KNOBS = {"help", "config"}


def tree() -> list[type]:
    """Every dataclass of the tree: the roots, their bases and the dataclasses their fields hold."""
    seen: list[type] = []
    todo = list(ROOTS)
    while todo:
        cls = todo.pop(0)
        for klass in cls.__mro__:
            if dataclasses.is_dataclass(klass) and klass not in seen:
                seen.append(klass)
                todo += [s for s in map(section, dataclasses.fields(klass)) if s]
    return seen


def section(f: dataclasses.Field) -> type | None:
    """The dataclass a field holds (a section of its class, such as TrainConfig.loss), or None for a knob."""
    factory = f.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


def knob_key(klass: type, name: str) -> str:
    return HOMONYMS.get((klass.__name__, name), name)


def declarations() -> dict[str, list[str]]:
    """knob -> the `Class.field`s that declare it (their own body has it, and it is no generated reference)."""
    out: dict[str, list[str]] = {}
    for klass in tree():
        own = vars(klass).get("__annotations__", {})
        for f in dataclasses.fields(klass):
            written = f.default is not dataclasses.MISSING or "help" in f.metadata
            if f.name in own and written and "from" not in f.metadata and not section(f):
                out.setdefault(knob_key(klass, f.name), []).append(f"{klass.__name__}.{f.name}")
    return out


def duplicates() -> dict[str, list[str]]:
    return {knob: where for knob, where in sorted(declarations().items()) if len(where) > 1}


def test_every_knob_of_the_config_tree_is_declared_in_one_place():
    """35 knobs were declared twice when this test was written; the last were the engine's resolved values, now slots
    its builders fill (vllm_patches/engine.py:EngineConfig)."""
    found = duplicates()
    listing = "\n".join(f"  {knob}: {', '.join(where)}" for knob, where in found.items())
    assert not found, f"{len(found)} knobs declared in more than one place:\n{listing}"


def test_the_duplicate_finder_finds_a_knob_restated_in_a_second_class():
    @dataclasses.dataclass
    class Restating:
        max_model_len: int = 2048

    global ROOTS
    saved, ROOTS = ROOTS, (*ROOTS, Restating)
    try:
        assert "Restating.max_model_len" in duplicates()["max_model_len"]
    finally:
        ROOTS = saved


# --- the entry points' parsers ---------------------------------------------------------------------------------------


class _Caught(BaseException):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def entry_parser(main: Callable, monkeypatch) -> argparse.ArgumentParser:
    """The parser `main` builds, caught at its first parse: nothing after it runs."""

    def catch(self, *args, **kwargs):
        raise _Caught(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", catch)
    with pytest.raises(_Caught) as caught:
        main([])
    monkeypatch.undo()
    return caught.value.parser


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest not in NOT_KNOBS]


MAIN_ENTRIES = {"inflight.serve": ServeConfig, "inflight.learn": LearnConfig, "inflight.run": RunConfig}


@pytest.mark.parametrize("module", sorted(MAIN_ENTRIES))
def test_every_flag_of_the_serve_learner_and_run_is_a_knob_of_the_tree_with_its_one_default_and_help(
    module, monkeypatch
):
    parser = entry_parser(importlib.import_module(f"{module}.app").main, monkeypatch)
    fields = {f.name: f for f in dataclasses.fields(MAIN_ENTRIES[module])}
    for action in options(parser):
        assert action.dest in fields, f"{module}: {action.option_strings[0]} is declared outside the config tree"
        f = fields[action.dest]
        assert action.default == f.default, f"{module} {action.option_strings[0]}: default {action.default!r}"
        assert f.metadata["help"] in (action.help or ""), f"{module} {action.option_strings[0]}: help not the knob's"
    assert {a.dest for a in options(parser)} == set(fields), f"{module}: a knob of its config has no flag"


MAIN_MODULES = {f"{module}.app" for module in MAIN_ENTRIES}


def other_entry_points() -> list[str]:
    """Every other module with a `main` that parses flags: inflight's, the benchmarks' and the scripts'."""
    paths = [*ROOT.glob("inflight/**/*.py"), *ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py")]
    modules = []
    for path in sorted(paths):
        text = path.read_text()
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if "def main(" in text and "argparse" in text and module not in MAIN_MODULES:
            modules.append(module)
    return modules


def reuses_a_declaration(action: argparse.Action) -> bool:
    """Does the flag carry the default and help of a knob of the tree with its name (built from the one declaration)?"""
    same = [f for klass in tree() for f in dataclasses.fields(klass) if f.name == action.dest]
    return any(f.default == action.default and f.metadata.get("help", "\0") in (action.help or "") for f in same)


def test_the_walk_finds_the_other_entry_points():
    found = other_entry_points()
    assert {"inflight.demo", "inflight.run.scale", "benchmarks.weight_swap", "scripts.task_accuracy"} <= set(found)
    assert not set(found) & MAIN_MODULES


@pytest.mark.parametrize("module", other_entry_points())
def test_the_other_entry_points_declare_no_knob_of_the_tree_again(module, monkeypatch):
    main = importlib.import_module(module).main
    parser = entry_parser(main if inspect.signature(main).parameters else lambda _argv: main(), monkeypatch)
    knobs = {f.name for klass in tree() for f in dataclasses.fields(klass)}
    declared = {a.dest for a in options(parser) if a.dest in knobs and not reuses_a_declaration(a)}
    listed = OWN_FLAGS.get(module, set())
    assert declared <= listed, f"{module} declares knobs of the tree again: {sorted(declared - listed)}"
    assert listed <= declared, f"{module} no longer declares {sorted(listed - declared)}: take them off OWN_FLAGS"


def test_the_train_step_and_the_engine_are_built_from_the_knobs_their_flags_set(tmp_path):
    from inflight.config import parse_dataclass
    from inflight.learn.app import train_config
    from inflight.serve.app import engine_config

    flags = "--lr 3e-5 --grad-clip 0.5 --fused-loss off --loss ppo --tis-cap 3 --aggregation sequence --autocast none"
    learn = parse_dataclass(LearnConfig, flags.split(" "), "inflight.learn", "")
    step = train_config(learn)
    assert (step.lr, step.grad_clip, step.fused_loss) == (3e-5, 0.5, "off")
    assert (step.loss.kind, step.loss.tis_cap, step.loss.aggregation) == ("ppo", 3.0, "sequence")
    serve = ServeConfig(max_model_len=512, max_num_seqs=16, kv_cache_gib=0.25, gpu_memory_utilization=0.5, seed=7)
    engine = engine_config(serve, tmp_path, "cpu", device_bytes=0)
    sizes = ("max_model_len", "max_num_seqs", "tensor_parallel_size", "kv_cache_gib", "gpu_memory_utilization", "seed")
    assert {name: getattr(engine, name) for name in sizes} == {name: getattr(serve, name) for name in sizes}
    assert engine.max_model_len == 512 and engine.seed == 7


def test_every_homonym_names_a_field_its_class_declares():
    declared = {(k.__name__, name) for k in tree() for name in vars(k).get("__annotations__", {})}
    assert set(HOMONYMS) <= declared, sorted(set(HOMONYMS) - declared)
