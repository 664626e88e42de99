"""`--report-to tensorboard|wandb` (inflight/learn/tracking.py): what the trackers write reads back, with the trackers'
own readers, as the step metrics of metrics.jsonl; a failing tracker never stops training; a real learner run writes
TensorBoard event files with every step, the serve's progress and the samples table."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from record_factories import a_progress, a_step, an_eval, an_update, write_lines
from test_learn_torchrun import rollouts
from test_serve import free_port

from inflight.config import parse_dataclass
from inflight.learn import tracking
from inflight.learn.config import LearnConfig
from inflight.learn.tracking import (
    Reporting,
    SampleRow,
    ServeMetricsTail,
    TensorBoardTracker,
    Tracker,
    sample_rows,
    serve_scalars,
    step_scalars,
)
from inflight.run.config import RunConfig
from inflight.run.launch import side_commands
from inflight.wire.records import encode_line, read_steps

STEPS = [a_step(1), a_step(2, publish_s=0.5, publish_bytes=1000, rejected={"duplicate": 2}, loss=None,
                           kv_lag_histogram={1: 3, 2: 7})]  # fmt: skip
# What the serve appends to serve-metrics.jsonl, per-reward means included (a dict, flattened for the trackers).
SERVE_LINES = [a_progress(tokens_per_s=42.0, time=101.5, reward_means={"gsm_reward": 0.25, "format": 1.0}),
               an_eval(version=2, reward_means={"gsm_reward": 0.5}, time=101.6)]  # fmt: skip
# The dict-valued metrics as the trackers must show them: one scalar per key, at the step the line was logged.
FLATTENED = {"train/lag_histogram/0": 6.0, "train/lag_histogram/1": 4.0, "train/kv_lag_histogram/1": 3.0,
             "train/kv_lag_histogram/2": 7.0, "serve/reward_means/gsm_reward": 0.25, "serve/reward_means/format": 1.0,
             "eval/reward_means/gsm_reward": 0.5}  # fmt: skip
ROWS = [SampleRow("What is 2 + 3?", "5 | five\nok", 1.0, 0.5, "0,1")]


def tensorboard_events(log_dir: Path):
    """tensorboard's own reader over every event file of `log_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def test_step_scalars_are_every_numeric_field_of_the_record_namespaced():
    values = step_scalars(STEPS[1])
    numeric = {f"train/{name}" for name in STEPS[1].__struct_fields__ if name != "time"
               and isinstance(getattr(STEPS[1], name), int | float)}  # fmt: skip
    assert numeric <= set(values) and "train/loss" not in values  # None: not finite, left out
    assert values["train/publish_bytes"] == 1000 and values["train/rejected/duplicate"] == 2
    assert values["train/lag_mean"] == pytest.approx(0.4)  # {0: 6, 1: 4}
    assert serve_scalars(an_update(ok=False))["update/ok"] == 0.0


def test_dict_valued_metrics_are_flattened_to_one_scalar_per_key():
    values = step_scalars(STEPS[1]) | serve_scalars(SERVE_LINES[0]) | serve_scalars(SERVE_LINES[1])
    assert {tag: values.get(tag) for tag in FLATTENED} == FLATTENED
    assert "train/kv_lag_histogram/1" not in step_scalars(STEPS[0])  # absent (None): no keys, no error


def test_tensorboard_event_files_read_back_with_tensorboards_reader_hold_every_step_metric(tmp_path):
    tracker = TensorBoardTracker(tmp_path)
    for record in STEPS:
        tracker.log_step(record)
    for line in SERVE_LINES:
        tracker.log_serve(line, 2)
    tracker.log_samples(ROWS, 2)
    tracker.close()
    events = tensorboard_events(tmp_path / "tensorboard")
    for record in STEPS:
        for tag, value in step_scalars(record).items():
            [point] = [p for p in events.Scalars(tag) if p.step == record.step]
            assert point.value == pytest.approx(value, rel=1e-6) and point.wall_time == record.time, tag
    assert [(p.step, p.value) for p in events.Scalars("serve/tokens_per_s")] == [(2, 42.0)]
    for tag, value in FLATTENED.items():  # the histograms and per-reward means, named, not only "whatever was sent"
        assert [p.value for p in events.Scalars(tag) if p.step == 2] == [pytest.approx(value)], tag
    [text] = events.Tensors("samples/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert "| prompt | completion | reward | advantage | versions |" in table and "5 \\| five<br>ok" in table


def wandb_records(path: Path) -> list:
    """The records of an offline run's `.wandb` file: a LevelDB-style log (a 7-byte header, then 32 KiB blocks of
    records, each with a 7-byte header: CRC32, length, type full/first/middle/last) of wandb's own protobuf
    `Record`s."""
    from wandb.proto import wandb_internal_pb2

    data, pos, chunk, records = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # still being written
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last: a whole record
            records.append(wandb_internal_pb2.Record())
            records[-1].ParseFromString(chunk)
            chunk = b""
    return records


def wandb_history(run_dir: Path, timeout_s: float = 30.0) -> list[dict[str, str]]:
    """The history records of the offline run under `run_dir`, once its `exit` record is in: wandb's service process
    writes the file after `run.finish()` returns (seen: in 2 runs of 100, a read right after it found only the 7-byte
    header; 2 s later, the whole run)."""
    [path] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while "exit" not in (kinds := [r.WhichOneof("record_type") for r in wandb_records(path)]):
        assert time.monotonic() < deadline, f"no exit record in {path} after {timeout_s}s: {kinds}"
        time.sleep(0.1)
    return [{item.key or "/".join(item.nested_key): item.value_json for item in r.history.item}
            for r in wandb_records(path) if r.WhichOneof("record_type") == "history"]  # fmt: skip


def test_a_wandb_offline_run_directory_is_created_with_the_same_keys(tmp_path, monkeypatch):
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR", "HOME"):
        monkeypatch.setenv(name, str(tmp_path / "home"))  # nothing of the user's, nothing in the user's home
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for key in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_PROJECT"):
        monkeypatch.delenv(key, raising=False)
    run_dir = tmp_path / "run"
    reporting = Reporting("wandb", run_dir, {"lr": 1e-5}, "tiny-llama", samples_every=2)
    assert reporting.active, "wandb failed to open"
    reporting.step(STEPS[0])
    write_lines(run_dir / "serve-metrics.jsonl", SERVE_LINES)  # as a serve appends them between two steps
    reporting.step(STEPS[1])
    reporting.tracker.log_samples(ROWS, 2)
    reporting.close()
    assert reporting.failures == 0
    history = wandb_history(run_dir)
    by_step = {int(h["_step"]): h for h in history}
    for record in STEPS:
        want = step_scalars(record)
        assert set(want) <= set(by_step[record.step]), set(want) - set(by_step[record.step])
        assert all(float(by_step[record.step][k]) == pytest.approx(v) for k, v in want.items())
    assert {tag: float(by_step[2][tag]) for tag in FLATTENED} == pytest.approx(FLATTENED)
    assert by_step[2]["samples/_type"] == '"table-file"' and by_step[2]["samples/nrows"] == "1"
    assert not (tmp_path / "home" / ".netrc").exists()


class Broken(Tracker):
    def scalars(self, values, step, wall_time):
        raise OSError("disk full")


def test_a_failing_tracker_is_logged_and_counted_and_never_raises(tmp_path, caplog):
    reporting = Reporting("none", tmp_path, {}, "tiny-llama", samples_every=1)
    reporting.tracker, reporting.active = Broken(), True
    for record in STEPS:
        reporting.step(record)
    reporting.close()
    assert reporting.failures == 2
    assert "tracking: step metrics failed (1 so far): OSError('disk full')" in caplog.text
    assert "tracking: 2 failures (metrics.jsonl is complete)" in caplog.text


def test_a_missing_tracker_package_is_refused_naming_the_install_command(monkeypatch):
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None)
    LearnConfig(report_to="none").validate()
    for kind in ("tensorboard", "wandb"):
        with pytest.raises(ValueError, match=rf"--report-to {kind} needs the {kind} package.*pip install "
                                             r"'inflight\[track\]'"):  # fmt: skip
            LearnConfig(report_to=kind).validate()


def test_the_serve_metrics_tail_returns_only_lines_appended_since_and_waits_for_a_cut_line(tmp_path):
    path = write_lines(tmp_path / "serve-metrics.jsonl", [a_progress(tokens=1)])
    tail = ServeMetricsTail(path)  # what was there before is not this learner's to log
    assert tail.read() == []
    line = encode_line(a_progress(tokens=2))
    with path.open("a") as f:
        f.write(encode_line(an_update()) + "not json\n" + line[:10])
    assert [type(e).__name__ for e in tail.read()] == ["UpdateEvent"]
    with path.open("a") as f:
        f.write(line[10:])
    assert [e.tokens for e in tail.read()] == [2]


def test_sample_rows_decode_the_completions_with_the_versions_that_sampled_them():
    from inflight.learn.samples import GatedSample

    sample = GatedSample([1, 2], [3, 4, 5], [-1.0] * 3, 0.25, [True] * 3, lags=[2, 1, 1])
    [row] = sample_rows([sample], [1.0], gate_version=5, decode=lambda ids: " ".join(map(str, ids)))
    assert row == SampleRow("1 2", "3 4 5", 1.0, 0.25, "3,4")


def test_the_launchers_report_to_reaches_the_learner(tmp_path):
    commands = side_commands(RunConfig(report_to="tensorboard"), tmp_path, (1, 2, 3))
    learn = parse_dataclass(LearnConfig, commands["learn"][2:], "learn", "")
    assert learn.report_to == "tensorboard" and learn.log_samples_every == 10


def test_the_learner_with_report_to_tensorboard_writes_every_step_serve_progress_and_samples(model_dirs, tmp_path):
    """A real learner on tiny-llama, fed recorded rollouts on its PULL socket (no engine): two steps."""
    ports = [free_port() for _ in range(3)]
    args = ["-m", "inflight.learn", "--model", str(model_dirs["tiny-llama"]), "--steps", "2", "--groups-per-step",
            "1", "--run-dir", str(tmp_path), "--rollouts-port", str(ports[0]), "--control-port", str(ports[1]),
            "--weights-port", str(ports[2]), "--wait-for-serves", "0", "--autocast", "none", "--report-to",
            "tensorboard", "--log-samples-every", "2"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, *args], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    push = zmq.Context.instance().socket(zmq.PUSH)
    try:
        seen = [next(line for line in proc.stdout if "inflight.learn ready" in line)]
        write_lines(tmp_path / "serve-metrics.jsonl", [a_progress(tokens_per_s=7.0)])  # as a serve writes it
        push.connect(f"tcp://127.0.0.1:{ports[0]}")
        for record in rollouts():
            push.send(record)
        seen.append(proc.communicate(timeout=300)[0])
    finally:
        push.close(linger=0)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(seen)[-4000:]
    steps = read_steps(tmp_path / "metrics.jsonl")
    events = tensorboard_events(tmp_path / "tensorboard")
    assert [p.step for p in events.Scalars("train/reward")] == [s.step for s in steps] == [1, 2]
    assert [p.value for p in events.Scalars("train/grad_norm")] == pytest.approx([s.grad_norm for s in steps])
    assert [(p.step, p.value) for p in events.Scalars("serve/tokens_per_s")] == [(1, 7.0)]
    [table] = events.Tensors("samples/text_summary")
    assert table.step == 2 and len(table.tensor_proto.string_val[0].decode().splitlines()) == 2 + 4  # a group


def test_a_held_out_eval_line_is_logged_under_eval_with_its_version():
    from record_factories import an_eval

    from inflight.learn.tracking import serve_scalars

    values = serve_scalars(an_eval(version=4, mean_reward=0.75, accuracy=1.0))
    assert values["eval/version"] == 4.0 and values["eval/mean_reward"] == 0.75 and values["eval/accuracy"] == 1.0
    assert not any(key.startswith(("serve/", "update/")) for key in values)
