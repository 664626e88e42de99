"""The metrics records (inflight/wire/records.py) between their writers (the learner's `_log`, the serve's progress
reporter) and their readers (the run report, the benchmarks): the real writers' lines decode as the records, the
committed benchmark runs still load and give their committed summaries, and a field renamed on either side fails
here, naming the file, the line and the field."""

from __future__ import annotations

import collections
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from record_factories import a_step, an_update, write_lines

from inflight.run.report import compute_summary
from inflight.tasks.rewards import RewardMeans
from inflight.wire.records import (
    RecordError,
    ServeProgress,
    StepMetrics,
    UpdateEvent,
    encode_line,
    read_records,
    read_serve_events,
    read_steps,
    to_record,
)

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = sorted(p.parent for p in (ROOT / "benchmarks" / "results" / "ablate").glob("*/metrics.jsonl"))


# -- the writers ------------------------------------------------------------------------------------------------------


ROUTING_FIELDS = {"route_matches", "route_total", "probe_abs_logratio_sum_unreplayed", "routing_agreement",
                  "mismatch_lag0_unreplayed", "route_bytes_per_token"}  # fmt: skip


def learner_step_lines(model_dirs, tmp_path, model_name: str = "tiny-llama", routes=None):
    """The learner's own `_train`, its sender's `publish` and `_log` and its service's `write_step` (sockets and the
    publisher stubbed, a real train_step on `model_name`): (the first line as written, both lines as StepMetrics)."""

    from inflight.learn.adapter import counted_parameters
    from inflight.learn.app import Learner
    from inflight.learn.publisher import PublishReport, RankSender
    from inflight.learn.samples import build_samples
    from inflight.learn.service import LearnerService, RolloutIntake
    from inflight.wire.rollouts import Sampling, Times, make_rollout
    from learner.model import load_policy
    from learner.routing_replay import RoutingReplay
    from learner.step import TrainConfig, make_optimizer

    model = load_policy(model_dirs[model_name])
    rollouts = [make_rollout(prompt_ids=[1, 2], completion_ids=[3, 4, 5], logprobs=[-1.0] * 3, versions=[0, 0, 0],
                             rollout_id=f"s-g0-{i}", group_id="s-g0", group_size=2, index=i, server_id="s@1",
                             model=model_name, reward=float(i), finish_reason="length", sampling=Sampling(1.0),
                             times=Times(0.0, 0.0, 0.0), routes=routes) for i in range(2)]  # fmt: skip
    samples, gate = build_samples([rollouts], 0, max_lag=1)

    class Socketless(LearnerService):  # the real write_step over a stubbed buffer and receiver
        def __init__(self, metrics_file):
            self.metrics_file = metrics_file
            self.intake = RolloutIntake.__new__(RolloutIntake)  # the real `rejected` over a stubbed buffer, receiver
            self.intake.buffer = SimpleNamespace(rejected=collections.Counter(duplicate=2), consumed_by_server={})
            self.intake.receiver = SimpleNamespace(rejected={"size": 1})

    report = PublishReport(1, serves=1, bytes=64, seconds=0.5)
    # the streamed publish of a full update (the default): it walks the learner's pieces
    publisher = SimpleNamespace(publish_stream=lambda pieces, v: (list(pieces), report)[1])
    world = SimpleNamespace(rank=0, size=1, weights_device="cpu", device="cpu")
    sender = RankSender(model, world, adapter=False, full_every=1)
    sender.publisher = publisher

    with (tmp_path / "metrics.jsonl").open("a") as metrics_file:
        learner = SimpleNamespace(rank=0, world=1, step=1, version=1, model=model, train_cfg=TrainConfig(),
                                  service=Socketless(metrics_file), param_counts=counted_parameters(model),
                                  replay=RoutingReplay(model.hf) if routes else None, autocast=None)  # fmt: skip
        learner.optimizer = make_optimizer(model, learner.train_cfg)
        metrics = Learner._train(learner, samples)
        Learner._log(learner, gate, metrics, sender.publish(1), 0.5, 2.0, [3, 3])
        learner.step = learner.version = 2  # a step that did not publish
        Learner._log(learner, gate, Learner._train(learner, samples), {}, 0.5, 2.0, [3, 3])
    written = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    return written, read_steps(tmp_path / "metrics.jsonl")


def test_the_learners_step_line_is_a_step_metrics_record_with_every_field_it_writes(model_dirs, tmp_path):
    """A metric train_step or the publish report gains, loses or renames without StepMetrics fails here."""
    import time

    written, (published, quiet) = learner_step_lines(model_dirs, tmp_path)
    # a publishing step with lag-0 tokens: every field but the episode ones, written only for batches with environment
    # tokens (tests/inflight/test_run.py's calculator run reads them)
    episode_fields = {"env_tokens", "turns_mean", "turns", "env_lengths"}
    # and the GPU's publish peak, written only by a CUDA learner publishing over gloo (benchmarks/results/gpu: the H100
    # runs' metrics lines carry it)
    gpu_fields = {"publish_device_peak_bytes"}
    # and the routing replay ones, written only with --routing-replay on (the next test)
    assert set(written) == set(StepMetrics.__struct_fields__) - episode_fields - gpu_fields - ROUTING_FIELDS
    assert published.lag_histogram == {0: 6} and published.tokens == published.probe_tokens == 6
    assert published.rejected == {"duplicate": 2, "wire:size": 1} and published.publish_bytes_per_s == 128
    assert published.time <= time.time() and published.mismatch_lag0 >= 0
    assert quiet.publish_s is None and "publish_s" not in (tmp_path / "metrics.jsonl").read_text().splitlines()[1]


def test_a_routing_replay_step_line_carries_agreement_both_mismatches_and_the_routes_bytes(model_dirs, tmp_path):
    import numpy as np

    from inflight.wire.rollouts import Routes

    ids = np.tile(np.array([0, 1], dtype=np.uint8), 4 * 2)  # 4 positions (2 + 3 − 1) × 2 MoE layers × top-2
    written, (published, _) = learner_step_lines(model_dirs, tmp_path, "tiny-moe", Routes(ids.tobytes(), 2, 2, "uint8"))
    assert set(written) >= ROUTING_FIELDS
    assert 0 <= published.routing_agreement <= 1 and published.route_total == 2 * 4 * 2
    assert published.mismatch_lag0 >= 0 and published.mismatch_lag0_unreplayed >= 0
    # 16 id bytes + msgpack's 'routes' key, Routes map and its field names, over 2 × 5 prompt + completion tokens
    assert 16 / 5 < published.route_bytes_per_token < 100 / 5


def test_the_serves_progress_and_update_lines_are_their_records(tmp_path):
    from inflight.serve.progress import ProgressReporter
    from inflight.wire.control import UpdateDone

    engine = SimpleNamespace(tokens_generated=40, version=3, idle_s=1.5, stalled_s=0.25, resubmitted=1,
                             recomputed_tokens=7, updates_refused=1)  # fmt: skip
    stream = SimpleNamespace(outbox=[b"r"], retained_records=4, resent=0, sent=12)
    stats = SimpleNamespace(rollouts_made=8, requests_inflight=2, groups_admitted=3, rewards_sum=2.0, reward_errors=1,
                            reward_means=RewardMeans(), turns=11, env_s=2.5, env_errors=1, tool_errors=2,
                            env_tokens=30, policy_tokens=90, groups_dropped=1, untrained_episodes=2,
                            groups_failed=1, last_failure="ValueError: out of vocabulary",
                            env_error_kinds={"timeout before the first model call": 3})  # fmt: skip
    driver = SimpleNamespace(engine=engine, server_id="s@1", groups_consumed=2, stream=stream, stats=stats)
    reporter = ProgressReporter(driver, str(tmp_path / "serve.jsonl"), 5.0)
    reporter.write(reporter.snapshot())
    reporter.update_event(UpdateDone(server_id="s@1", version=4, total_s=0.5, stall_s=0.02, commit_s=0.02))
    progress, update = read_serve_events(tmp_path / "serve.jsonl")
    assert isinstance(progress, ServeProgress) and isinstance(update, UpdateEvent)
    assert progress.tokens == 40 and progress.outbox == 1 and progress.mean_reward == 0.25 and progress.version == 3
    assert (progress.turns, progress.env_tokens, progress.env_errors, progress.tool_errors) == (11, 30, 1, 2)
    assert (progress.groups_dropped, progress.untrained_episodes) == (1, 2)
    assert (progress.groups_failed, progress.last_failure) == (1, "ValueError: out of vocabulary")
    assert progress.env_error_kinds == {"timeout before the first model call": 3}
    assert update == an_update(time=update.time, server_id="s@1", version=4, receive_s=0.0)
    events = [json.loads(line)["event"] for line in (tmp_path / "serve.jsonl").read_text().splitlines()]
    assert events == ["progress", "update"]  # the tag is the `event` key the lines always had


def test_a_step_written_and_read_back_is_the_same_record_and_non_finite_values_become_none(tmp_path):
    steps = [a_step(1), a_step(2, loss=math.nan, grad_norm=math.inf, mismatch_lag0=None, publish_failed=["s"])]
    back = read_steps(write_lines(tmp_path / "metrics.jsonl", steps))
    assert back[0] == steps[0]
    assert back[1].loss is None and back[1].grad_norm is None and back[1].publish_failed == ["s"]
    assert "mismatch_lag0" not in (tmp_path / "metrics.jsonl").read_text().splitlines()[1]  # absent, as before


def test_a_writer_value_the_record_does_not_know_is_refused_naming_it():
    values = msgspec.structs.asdict(a_step()) | {"entropy": 2.0}
    with pytest.raises(RecordError, match=r"unknown field `entropy`.*add or rename the field in StepMetrics"):
        to_record(values, StepMetrics)


# -- the readers ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("run_dir", COMMITTED, ids=lambda p: p.name)
def test_committed_benchmark_runs_load_through_the_records_and_give_their_committed_summary(run_dir):
    steps, serve = read_steps(run_dir / "metrics.jsonl"), read_serve_events(run_dir / "serve-metrics.jsonl")
    assert len(steps) == len(read_text_lines(run_dir / "metrics.jsonl")) >= 10
    assert len(serve) == len(read_text_lines(run_dir / "serve-metrics.jsonl"))
    assert all(s.publish_s is not None for s in steps) and any(isinstance(e, UpdateEvent) for e in serve)
    for path, records in ((run_dir / "metrics.jsonl", steps), (run_dir / "serve-metrics.jsonl", serve)):
        old = [json.loads(line) for line in read_text_lines(path)]
        assert [json.loads(encode_line(r)) for r in records] == old  # the writers' lines are unchanged
    committed = json.loads((run_dir / "summary.json").read_text())
    summary = compute_summary(run_dir)
    committed.pop("run_dir"), summary.pop("run_dir")  # relative or absolute, as it was called
    assert json.dumps(summary, sort_keys=True) == json.dumps(committed, sort_keys=True)


def read_text_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


def test_the_benchmarks_read_the_committed_runs(tmp_path):
    from benchmarks.ablate import plots, time_to_target
    from benchmarks.simulate import calibrate, measured_speedup
    from benchmarks.trim_policy import stalls_ms

    for run_dir in COMMITTED:
        shutil.copytree(run_dir, tmp_path / run_dir.name, ignore=shutil.ignore_patterns("*.png", "*.log"))
    modes = [p.name for p in COMMITTED]
    assert all(time_to_target(tmp_path / m, 0.0) >= 0 for m in modes)
    assert all(stalls_ms(tmp_path / m, 0.0) for m in modes)
    cal = calibrate(tmp_path, None)
    commits = [e.commit_s for e in read_serve_events(tmp_path / modes[0] / "serve-metrics.jsonl")
               if isinstance(e, UpdateEvent) and e.ok]  # fmt: skip
    assert cal.commit_s[modes[0]] == pytest.approx(sum(commits) / len(commits))
    assert cal.train_t1 > 0 and cal.publish_s > 0 and cal.lengths
    assert set(measured_speedup(tmp_path)) == set(modes)
    plots(tmp_path, modes)
    assert (tmp_path / "ablate-lag.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("name", "record", "old", "new"),
    [
        ("metrics.jsonl", a_step(), "mismatch_lag0", "mismatch_lag_0"),  # an optional field
        ("metrics.jsonl", a_step(), "reward", "batch_reward"),  # a required one
        ("serve-metrics.jsonl", an_update(), "stall_s", "stall"),
    ],
)
def test_a_field_renamed_in_a_line_fails_naming_the_file_the_line_and_the_field(tmp_path, name, record, old, new):
    path = write_lines(tmp_path / name, [record, record])
    first, second = path.read_text().splitlines()
    path.write_text(first + "\n" + second.replace(f'"{old}":', f'"{new}":') + "\n")
    with pytest.raises(RecordError, match=rf"{name}:2: .*(`{new}`|`{old}`)"):
        read_records(path, StepMetrics if name == "metrics.jsonl" else UpdateEvent | ServeProgress)


def test_a_record_field_renamed_in_the_code_fails_on_the_committed_runs():
    """A copy of StepMetrics whose `reward` became `batch_reward`: the run directories already written say so."""
    fields = [(f.encode_name if f.name != "reward" else "batch_reward", f.type, f.default)
              for f in msgspec.structs.fields(StepMetrics)]  # fmt: skip
    fields = [(n, t) if d is msgspec.NODEFAULT else (n, t, d) for n, t, d in fields]
    renamed = msgspec.defstruct("StepMetrics", fields, kw_only=True, forbid_unknown_fields=True, omit_defaults=True)
    with pytest.raises(RecordError, match=r"metrics.jsonl:1: not a StepMetrics line: .*`(reward|batch_reward)`"):
        read_records(COMMITTED[0] / "metrics.jsonl", renamed)


def test_a_cut_line_is_skipped_old_nan_tokens_are_read_and_a_wrong_type_is_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    old_nan = json.dumps(msgspec.to_builtins(a_step(2)) | {"loss": math.nan})  # json.dumps writes NaN, not null
    path.write_text(encode_line(a_step(1)) + old_nan + "\n" + '{"step": 3, "cut by a ki')
    first, second = read_steps(path)
    assert first == a_step(1) and math.isnan(second.loss)
    path.write_text(encode_line(a_step(1)).replace('"step":1', '"step":"one"'))
    with pytest.raises(RecordError, match=r"metrics.jsonl:1: .*Expected `int`, got `str` - at `\$.step`"):
        read_steps(path)


def test_the_serves_progress_line_counts_dropped_groups_and_environment_errors_by_kind():
    from record_factories import a_progress

    from inflight.serve.progress import _episodes

    kinds = {"harness bash exited 1": 1, "timeout before the first model call": 3}
    line = _episodes(a_progress(env_errors=4, env_error_kinds=kinds, groups_dropped=2, untrained_episodes=4))
    assert line == (" | env errors 4 (timeout before the first model call 3, harness bash exited 1 1)"
                    " | dropped 2 groups (4 episodes with no sampled token)")  # fmt: skip
    assert _episodes(a_progress()) == ""
