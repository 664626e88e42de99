"""`python -m inflight.run --config run.toml` (inflight/run/config_file.py): a run file gives the same run as the same
knobs given by flags, the run directory's resolved `config.toml` reads back to the same run, command-line flags
override the file, and a bad file fails naming the table and the key. Nothing starts: `plan` stops after every side's
own parser has checked its argv."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from inflight.config import parse_dataclass
from inflight.learn.config import LearnConfig
from inflight.run.app import plan
from inflight.run.config import RunConfig
from inflight.run.config_file import RUN_SETS, SIDE_CONFIGS, dump_run_toml, load_run_file, write_run_toml
from inflight.run.launch import side_commands
from inflight.serve.config import ServeConfig

ROOT = Path(__file__).resolve().parents[2]
RUN_FILE = """
steps = 3
mode = "blocking"
lr = 1                      # an integer where the field is a float
port-base = 6100            # hyphens as on the command line
serve_args = "--kv-cache-gib 0.25"

[serve]
max_inflight = 32
tool-latency = "lognormal:0.5,1.0"

[learn]
loss = "ppo"
resume = true
checkpoint_every = 5
"""
SAME_BY_FLAGS = ["--steps", "3", "--mode", "blocking", "--lr", "1.0", "--port-base", "6100",
                 "--serve-args", "--max-inflight 32 --tool-latency lognormal:0.5,1.0 --kv-cache-gib 0.25",
                 "--learn-args", "--loss ppo --resume --checkpoint-every 5"]  # fmt: skip


def side_configs(commands: dict[str, list[str]]) -> dict[str, dict]:
    """Each side's argv parsed by that side's own parser, as a dict: what the side would run with."""
    return {side: dataclasses.asdict(parse_dataclass(SIDE_CONFIGS[side], argv[2:], side, ""))
            for side, argv in commands.items()}  # fmt: skip


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_run_file_with_serve_and_learn_tables_gives_the_same_configs_as_the_same_run_given_by_flags(tmp_path):
    run_dir = str(tmp_path / "run")
    by_flags, _, _, flag_commands = plan(["--run-dir", run_dir, *SAME_BY_FLAGS])
    by_file, tables, _, file_commands = plan(["--run-dir", run_dir, "--config", str(write(tmp_path / "run.toml",
                                                                                           RUN_FILE))])  # fmt: skip
    assert tables == {"serve": {"max_inflight": 32, "tool_latency": "lognormal:0.5,1.0"},
                      "learn": {"loss": "ppo", "resume": True, "checkpoint_every": 5}}  # fmt: skip
    no_pass_through = {"serve_args": "", "learn_args": ""}  # the flags' run says with them what the tables say
    assert dataclasses.replace(by_file, **no_pass_through) == dataclasses.replace(by_flags, **no_pass_through)
    assert side_configs(file_commands) == side_configs(flag_commands)
    learn = side_configs(file_commands)["learn"]
    assert (learn["loss"], learn["resume"], learn["checkpoint_every"], learn["lr"]) == ("ppo", True, 5, 1.0)


def test_the_resolved_config_toml_of_a_run_directory_reads_back_to_the_same_run(tmp_path):
    first, tables, run_dir, commands = plan(["--config", str(write(tmp_path / "run.toml", RUN_FILE)),
                                             "--run-dir", str(tmp_path / "run"), "--temperature", "0.7",
                                             "--learn-args", "--aggregation sequence"])  # fmt: skip
    written = write_run_toml(first, tables, run_dir)
    again, tables_again, _, commands_again = plan(["--config", str(written)])
    assert again == first and tables_again == tables
    assert commands_again == commands  # the very same argv for both sides
    assert side_configs(commands_again)["learn"]["aggregation"] == "sequence"


def test_the_resolved_config_names_the_run_directory_even_when_the_run_chose_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, tables, run_dir, _ = plan(["--port-base", "6100"])
    assert cfg.run_dir == "" and run_dir.parent.name == "runs"
    again, _, _, _ = plan(["--config", str(write_run_toml(cfg, tables, run_dir))])
    assert again == dataclasses.replace(cfg, run_dir=str(run_dir))


def test_command_line_flags_override_the_file_and_pass_through_strings_override_its_tables(tmp_path):
    path = write(tmp_path / "run.toml", RUN_FILE)
    cfg, _, _, commands = plan(["--config", str(path), "--run-dir", str(tmp_path / "r"), "--steps", "9",
                                "--learn-args", "--loss tis", "--serve-args", "--max-inflight 8"])  # fmt: skip
    assert cfg.steps == 9 and cfg.mode == "blocking"  # the flag wins, the rest of the file stays
    sides = side_configs(commands)
    assert sides["learn"]["loss"] == "tis" and sides["learn"]["checkpoint_every"] == 5
    assert sides["serve"]["max_inflight"] == 8 and sides["serve"]["kv_cache_gib"] == 1.0  # serve_args replaced


def test_a_single_word_pass_through_that_starts_with_dashes_is_accepted(tmp_path):
    for argv in (["--learn-args", "--resume"], ["--learn-args=--resume"]):
        cfg, _, _, commands = plan(["--run-dir", str(tmp_path / "r"), "--port-base", "6100", *argv])
        assert cfg.learn_args == "--resume" and commands["learn"][-1] == "--resume"
        assert side_configs(commands)["learn"]["resume"] is True
    cfg, _, _, _ = plan(["--run-dir", str(tmp_path / "r"), "--serve-args", "--max-inflight=40", "--steps", "2"])
    assert cfg.serve_args == "--max-inflight=40" and cfg.steps == 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[learn]\nlos = 'ppo'\n", r"unknown key 'los' in the \[learn\] .*did you mean loss"),
        ("[serve]\nmax-inflite = 3\n", r"unknown key 'max-inflite' in the \[serve\] .*did you mean max_inflight"),
        ("stepz = 3\n", r"unknown key 'stepz' in the top level .*did you mean steps"),
        ("[learn]\nlr = 0.1\n", r"\[learn\] lr is set by the run from its top-level key 'lr'"),
        ("[serve]\nadmit_lag = 2\n", r"\[serve\] admit_lag is set by the run from its top-level key 'admit_lag'"),
        ("[serve]\nmax_lag = 2\n", r"\[serve\] max_lag was renamed: the serve's admission window is --admit-lag"),
        ("steps = '3'\n", r"top level steps = '3' is a str, expected a int"),
        ("[learn]\nloss = 'pppo'\n", r"\[learn\] loss = 'pppo', expected one of tis, ppo, mask"),
        ("[trainer]\nlr = 1\n", r"unknown table \[trainer\]"),
        ("steps = \n", r"not TOML"),
    ],
)
def test_a_bad_run_file_is_refused_naming_the_table_and_the_key(tmp_path, text, expected):
    with pytest.raises(ValueError, match=expected) as caught:
        load_run_file(write(tmp_path / "bad.toml", text))
    assert str(tmp_path / "bad.toml") in str(caught.value)


def test_the_launcher_exits_2_before_starting_anything_on_a_bad_key(tmp_path):
    path = write(tmp_path / "bad.toml", "steps = 2\n[learn]\nchekpoint_every = 5\n")
    proc = subprocess.run([sys.executable, "-m", "inflight.run", "--config", str(path), "--run-dir",
                           str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "unknown key 'chekpoint_every' in the [learn]" in proc.stderr and "checkpoint_every" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_toml_writer_round_trips_every_kind_of_value():
    top = {"text": 'quotes " and \\ back\nslash, tab\t, unicode é ✓', "empty": "", "int": -3, "big": 2**40,
           "float": 1e-05, "whole": 3.0, "inf": math.inf, "neg_inf": -math.inf, "yes": True, "no": False,
           "list": [1, "two", 3.5, False]}  # fmt: skip
    tables = {"serve": {"kv_cache_gib": 0.25}, "learn": {"loss": "ppo"}}
    read = tomllib.loads(dump_run_toml(top, tables))
    assert read == {**top, **tables}
    assert math.isnan(tomllib.loads(dump_run_toml({"x": math.nan}, {}))["x"])


def test_the_table_keys_the_run_refuses_are_exactly_the_flags_it_sets_itself(tmp_path):
    """RUN_SETS (what a table may not set) against the argv side_commands builds with every optional knob on."""
    cfg = RunConfig(reward="m:f", http_port=8000, learn_gpus="0")
    commands = side_commands(cfg, tmp_path, (1, 2, 3))
    for side, argv in commands.items():
        flags = {w[2:].replace("-", "_") for w in argv[2:] if w.startswith("--")}
        assert flags == set(RUN_SETS[side]), side
        fields = {f.name for f in dataclasses.fields(ServeConfig if side == "serve" else LearnConfig)}
        assert set(RUN_SETS[side]) <= fields


def guide_section() -> str:
    """The run-file section of the config guide (it was the README's until issue 39)."""
    guide = (ROOT / "docs" / "config-and-tracking.md").read_text()
    return guide.split("\n## Config files\n", 1)[1].split("\n## ", 1)[0]


def test_the_config_guides_run_file_example_loads_and_plans_the_run_it_describes(tmp_path):
    example = re.search(r"```toml\n(.*?)```", guide_section(), flags=re.DOTALL).group(1)
    path = write(tmp_path / "run.toml", example)
    top, tables = load_run_file(path)
    assert top["report_to"] == "tensorboard" and tables["serve"] and tables["learn"]
    cfg, _, _, commands = plan(["--config", str(path), "--run-dir", str(tmp_path / "run")])
    learn = side_configs(commands)["learn"]
    assert (learn["report_to"], learn["loss"], learn["lr"]) == ("tensorboard", "ppo", cfg.lr)


def test_the_error_the_config_guide_quotes_is_the_one_a_bad_key_gives(tmp_path):
    with pytest.raises(ValueError) as caught:
        load_run_file(write(tmp_path / "run.toml", "[learn]\nlos = 'ppo'\n"))
    quoted = str(caught.value).replace(str(tmp_path) + "/", "")
    assert f"`{quoted}`" in " ".join(guide_section().split())


def test_a_table_value_that_starts_with_a_dash_reaches_its_side_as_a_value(tmp_path):
    path = write(tmp_path / "run.toml", "[serve]\nserver-id = '-odd-name'\nprogress_s = 0.5\n")
    _, _, _, commands = plan(["--config", str(path), "--run-dir", str(tmp_path / "r")])
    serve = side_configs(commands)["serve"]
    assert (serve["server_id"], serve["progress_s"]) == ("-odd-name", 0.5)


def test_the_run_gives_both_sides_the_same_sampler_truncation(tmp_path):
    _, _, _, commands = plan(["--run-dir", str(tmp_path / "run"), "--top-p", "0.9", "--top-k", "20", "--min-p", "0.05"])
    configs = side_configs(commands)
    for side in ("serve", "learn"):
        assert (configs[side]["top_p"], configs[side]["top_k"], configs[side]["min_p"]) == (0.9, 20, 0.05), side


def test_a_tri_state_serve_knob_takes_a_toml_bool_or_its_words(tmp_path):
    """`enforce_eager` is auto|true|false since CUDA graphs became the GPU default: a run file written when it was a
    bool (`enforce_eager = false`) still means what it said."""
    for line, want in (
        ("enforce_eager = false", "false"),
        ("enforce_eager = true", "true"),
        ("enforce-eager = 'auto'", "auto"),
    ):
        path = write(tmp_path / "run.toml", f"[serve]\n{line}\nupdate_memory = 'low'\n")
        _, _, _, commands = plan(["--config", str(path), "--run-dir", str(tmp_path / "r")])
        assert side_configs(commands)["serve"]["enforce_eager"] == want, line


@pytest.mark.parametrize(("serve_args", "error"), [
    ("--max-tokenz 3", "--serve-args: error: unrecognized arguments: --max-tokenz 3"),
    ("--max-inflight 0", "--serve-args: error: --max-inflight is 0, expected"),
])  # fmt: skip
def test_a_forwarded_flag_the_serve_refuses_is_one_error_line_naming_it_not_the_serves_usage(
    tmp_path, capsys, serve_args, error
):
    with pytest.raises(SystemExit) as exit_:
        plan(["--run-dir", str(tmp_path / "r"), "--port-base", "6100", "--serve-args", serve_args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(error) and len(err.strip().splitlines()) == 1, err
    assert "usage:" not in err


def test_a_taskset_only_verifiers_environment_on_the_default_harness_is_planned_and_its_env_reaches_the_serve(
    tmp_path, capsys
):
    # tests/inflight/vf_taskset_only.py: no harness of its own, so verifiers' default `bash`, whose tools the serve now
    # renders with the model's chat template; a model whose template renders none is refused by the serve at start
    # (tests/inflight/test_verifiers_env.py), not here
    _, _, _, commands = plan(
        ["--run-dir", str(tmp_path / "r"), "--port-base", "6100", "--env", "verifiers:vf_taskset_only"]
    )
    assert "verifiers:vf_taskset_only" in commands["serve"]
    # a handler another test left on a closed stream prints '--- Logging error ---' and a traceback quoting the
    # serve's config source ("... is refused before the engine starts"): what the plan itself wrote comes before it
    assert "refused" not in capsys.readouterr().err.split("--- Logging error ---")[0]
