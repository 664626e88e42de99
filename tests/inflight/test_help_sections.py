"""`--help` of each entry point lists its flags by section: one group per knob class of the config's composition."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from inflight.config import add_dataclass_args, declaring_class
from inflight.learn.config import LearnConfig
from inflight.run.config import RunConfig
from inflight.serve.config import ServeConfig


def sections(cls: type) -> dict[str, set[str]]:
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, cls)
    return {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups if g._group_actions}


@pytest.mark.parametrize("cls", [ServeConfig, LearnConfig, RunConfig])
def test_every_flag_is_listed_under_the_section_of_the_knob_class_that_declares_it(cls):
    found = sections(cls)
    assert len(found) > 2, f"{cls.__name__}'s --help has {len(found)} sections: {sorted(found)}"
    for f in dataclasses.fields(cls):
        owner = declaring_class(cls, f.name).__name__
        titles = [title for title, dests in found.items() if f.name in dests]
        assert len(titles) == 1 and titles[0].startswith(owner), f"--{f.name} is under {titles}, expected {owner}"


def test_the_serve_help_shows_its_engine_and_task_sections_as_headings(capsys):
    from inflight.serve.app import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "EngineKnobs:" in out and "TaskKnobs:" in out and "SharedKnobs:" in out
