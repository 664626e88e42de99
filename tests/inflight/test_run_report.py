"""The run report (inflight/run/report.py) on hand-written metrics files (records of inflight/wire/records.py, as the
learner and the serve write them): every figure is checked against a value worked out by hand; the real-process path
is in test_run.py. Also the launcher's own argument checks."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from record_factories import a_progress, a_step, an_eval, an_update, write_lines

from inflight.run.config import RunConfig, parse_cores, parse_gpus
from inflight.run.launch import side_commands, side_env
from inflight.run.report import compute_summary, main, plot, summarize, write_report


def write_run(path, rewards, lags, serve_events):
    path.mkdir()
    (path / "run-config.json").write_text(json.dumps({"mode": "never-stop", "model": "tiny-llama"}))
    steps = [a_step(i + 1, time=100.0 + 10 * i, step_s=10.0, reward=r, lag_histogram=lag, gated_fraction=0.1,
                    mismatch_lag0=0.01 * (i + 1), ess=0.9, wait_s=1.0)
             for i, (r, lag) in enumerate(zip(rewards, lags, strict=True))]  # fmt: skip
    write_lines(path / "metrics.jsonl", steps)
    with (path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 99, "cut by a kil')  # a torn last line is skipped, not fatal
    write_lines(path / "serve-metrics.jsonl", serve_events)


def test_held_out_evals_reach_the_summary_by_version_and_the_reward_plot(tmp_path):
    events = [a_progress(time=100.0), an_eval(version=2, mean_reward=0.25), an_eval(version=4, mean_reward=0.75)]
    write_run(tmp_path / "r", [0.1, 0.2, 0.3, 0.4], [{0: 1}] * 4, events)
    s = compute_summary(tmp_path / "r")
    assert [(e["version"], e["mean_reward"]) for e in s["evals"]] == [(2, 0.25), (4, 0.75)]
    assert (tmp_path / "r" / "reward.png") in plot(tmp_path / "r")  # the eval curve is drawn, not refused


def test_summary_figures_match_hand_computation(tmp_path):
    rewards = [0.0, 0.2, 0.1, 0.5, 0.5, 0.6, 0.7, 0.9, 0.8, 1.0]
    lags = [{0: 6, 1: 4}] * 10
    events = [
        a_progress(time=100.0, tokens=0, tokens_per_s=0.0),
        an_update(time=105.0, ok=True, stall_s=0.02),
        an_update(time=115.0, ok=True, stall_s=0.04),
        an_update(time=116.0, ok=False, error="refused", stall_s=0.0),  # a failed update is not counted
        a_progress(time=150.0, tokens=5000, tokens_per_s=100.0),
    ]
    write_run(tmp_path / "r", rewards, lags, events)
    s = compute_summary(tmp_path / "r")
    assert s["steps"] == 10 and s["wall_s"] == pytest.approx(100.0)
    assert s["reward_first"] == pytest.approx(0.1) and s["reward_last"] == pytest.approx(0.9)
    se_first = math.sqrt(((0.0 - 0.1) ** 2 + (0.2 - 0.1) ** 2) / 1 / 2)
    assert s["reward_first_se"] == pytest.approx(se_first)
    assert s["rise_se"] == pytest.approx(0.8 / math.sqrt(2 * se_first**2))
    assert s["updates"] == 2 and s["stall_mean_s"] == pytest.approx(0.03) and s["stall_p99_s"] == pytest.approx(0.04)
    assert s["lag_mean"] == pytest.approx(0.4) and s["lag_histogram"] == {"0": 60, "1": 40}
    assert s["gated_fraction"] == pytest.approx(0.1)
    assert s["mismatch_lag0"] == pytest.approx(0.055) and s["ess"] == pytest.approx(0.9)
    assert s["gen_tokens_per_s"] == pytest.approx(100.0)
    table = summarize([s, s])
    assert table.count("| never-stop |") == 2 and "0.100 ± 0.100" in table


def test_a_short_runs_figures_without_data_read_n_a_and_its_reward_errors_are_in_the_summary(tmp_path):
    # five steps: each fifth is one step, whose standard error (and so the rise in SE) has no data; no update either
    write_run(tmp_path / "r", [0.0, 0.5, 0.5, 0.5, 1.0], [{0: 4}] * 5, [a_progress(time=1.0, reward_errors=7)])
    s = compute_summary(tmp_path / "r")
    assert s["reward_errors"] == 7  # rewards that failed, each scored 0.0, from the serve's last progress line
    assert math.isnan(s["reward_first_se"]) and math.isnan(s["rise_se"]) and math.isnan(s["stall_mean_s"])
    row = summarize([s]).splitlines()[-1]
    assert "nan" not in row
    assert "| 0.000 ± n/a | 1.000 ± n/a | n/a | 0 | n/a / n/a |" in row


def test_the_gated_fraction_counts_every_token_of_the_batch_not_only_the_trained_ones(tmp_path):
    # 10 tokens, 4 of them gated at lag 5: `tokens` is the 6 that trained, the batch is the lag histogram's 10.
    write_run(tmp_path / "r", [0.5], [{0: 6, 5: 4}], [])
    steps = [a_step(1, lag_histogram={0: 6, 5: 4}, tokens=6.0, gated_fraction=0.4)]
    write_lines(tmp_path / "r" / "metrics.jsonl", steps)
    assert compute_summary(tmp_path / "r")["gated_fraction"] == pytest.approx(0.4)


def test_report_writes_pngs_and_the_cli_refuses_a_non_run(tmp_path, capsys):
    write_run(tmp_path / "r", [0.1, 0.2, 0.3], [{0: 5}, {0: 3, 2: 2}, {1: 5}],
              [a_progress(time=101.0, tokens=10, tokens_per_s=5.0), an_update(time=102.0, stall_s=0.01)])  # fmt: skip
    write_report(tmp_path / "r")
    for name in ("reward.png", "lag.png", "throughput.png"):
        assert (tmp_path / "r" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(tmp_path / "r")]) == 0
    assert "| never-stop | 3 |" in capsys.readouterr().out
    assert main([str(tmp_path)]) == 2
    assert "no learner metrics" in capsys.readouterr().err


def test_the_cli_table_of_several_runs_names_each_row_by_its_run_directory(tmp_path, capsys):
    for name, rewards in (("lr-1e-5", [0.1, 0.2]), ("lr-3e-5", [0.3, 0.4])):  # a sweep: one mode, two runs
        write_run(tmp_path / name, rewards, [{0: 5}] * 2, [a_progress(time=101.0)])
    assert main([str(tmp_path / "lr-1e-5"), str(tmp_path / "lr-3e-5")]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert rows[0].startswith("| run | mode | steps |")
    assert rows[2].startswith(f"| {tmp_path / 'lr-1e-5'} | never-stop | 2 |") and "| 0.100 ± n/a |" in rows[2]
    assert rows[3].startswith(f"| {tmp_path / 'lr-3e-5'} | never-stop | 2 |") and "| 0.300 ± n/a |" in rows[3]
    assert all(row.count("|") == rows[0].count("|") for row in rows)


def test_core_and_gpu_lists_and_side_environments():
    assert parse_cores("0") == [0] and parse_cores("0,2-3") == [0, 2, 3]
    for bad in ("", "a", "3-1", "0,-1"):
        with pytest.raises(ValueError, match="core list"):
            parse_cores(bad)
    assert parse_gpus("") == [] and parse_gpus("0, 1") == ["0", "1"]
    with pytest.raises(ValueError, match="GPU list"):
        parse_gpus("cuda:0")
    cfg = RunConfig(serve_cores="0", learn_cores="1")
    env, cores = side_env(cfg, "serve")
    assert cores == [0] and env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and env["CUDA_VISIBLE_DEVICES"] == ""
    env, cores = side_env(RunConfig(), "learn")  # the CPU defaults: serve on core 0, learner on core 1
    assert cores == [1] and side_env(RunConfig(), "serve")[1] == [0]
    env, cores = side_env(RunConfig(learn_gpus="1,2"), "learn")
    assert env["CUDA_VISIBLE_DEVICES"] == "1,2"
    cfg = RunConfig(learn_gpus="1,2", temperature=0.7, learn_args="--loss ppo")
    cmds = side_commands(cfg, Path("/nonexistent-run-dir"), (1, 2, 3))
    assert cmds["learn"][-2:] == ["--loss", "ppo"] and "nccl" in cmds["learn"]
    learn, serve = cmds["learn"], cmds["serve"]
    assert learn[learn.index("--temperature") + 1] == serve[serve.index("--temperature") + 1] == "0.7"
    assert serve[serve.index("--rollouts") + 1] == "tcp://127.0.0.1:1"
    with pytest.raises(ValueError, match="--learn-cores"):
        RunConfig(learn_cores="9999").validate()


def test_a_side_on_gpus_is_not_pinned_to_one_core_unless_its_cores_are_given(monkeypatch):
    """On a GPU node the CPU demo's split (serve on core 0, learner on core 1) would put every host thread of a side —
    the serve's scheduler and staging thread, each torchrun rank's data and NCCL proxy threads — on one core."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # a user's environment (the suite's workers set one)
    available = len(os.sched_getaffinity(0))
    env, cores = side_env(RunConfig(serve_gpus="0", learn_gpus="1,2"), "serve")
    assert cores is None and "VLLM_CPU_OMP_THREADS_BIND" not in env and env["OMP_NUM_THREADS"] == str(available)
    env, cores = side_env(RunConfig(serve_gpus="0", learn_gpus="1,2"), "learn")
    assert cores is None and env["OMP_NUM_THREADS"] == str(max(1, available // 2))  # per torchrun rank
    env, cores = side_env(RunConfig(serve_gpus="0", serve_cores="0"), "serve")
    assert cores == [0] and env["VLLM_CPU_OMP_THREADS_BIND"] == "0"  # given cores still pin


def test_a_run_that_trained_no_step_says_so_and_why_from_the_serves_counts_instead_of_a_row_of_nan(tmp_path):
    kinds = {"timeout before the first model call": 5, "harness bash exited 1": 1}
    write_run(
        tmp_path / "r",
        [],
        [],
        [
            a_progress(time=100.0),
            a_progress(
                time=160.0,
                groups_admitted=3,
                env_errors=6,
                env_error_kinds=kinds,
                groups_dropped=3,
                untrained_episodes=6,
            ),
        ],
    )
    s = write_report(tmp_path / "r")
    why = ("the serve sent no rollout: it dropped all 3 groups it ran, 6 episodes ended with no sampled token "
           "(environment errors: timeout before the first model call 5, harness bash exited 1 1)")  # fmt: skip
    assert s["steps"] == 0 and s["no_step_trained"] == why
    assert s["episodes"]["groups_dropped"] == 3 and s["episodes"]["env_error_kinds"] == kinds
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["no_step_trained"] == why
    row = summarize([s]).splitlines()[-1]
    assert row == f"| never-stop | 0 | no step trained: {why} |" and "nan" not in row
    (tmp_path / "r" / "serve-metrics.jsonl").unlink()
    assert "the serve wrote no progress line" in compute_summary(tmp_path / "r")["no_step_trained"]


def test_a_run_whose_groups_the_engine_failed_says_so_with_the_last_error(tmp_path):
    error = "ValueError: Token id 1000000000 is out of vocabulary"
    write_run(tmp_path / "r", [], [], [a_progress(time=160.0, groups_admitted=4, groups_failed=4, last_failure=error)])
    why = f"the serve sent no rollout: 4 groups failed, the last with {error}"
    assert write_report(tmp_path / "r")["no_step_trained"] == why
