"""The end of a run: `summary.json`, `summary.md` and PNG plots from the run directory's metrics, and one table for
several runs side by side.

    python -m inflight.run.report runs/demo-never-stop runs/demo-blocking     # (re)write reports, print one table

Figures, all from the metrics files (nothing is re-measured), read as the records of inflight/wire/records.py:
- reward: mean reward of the learner's batch per step; "first/last 20%" are the means over the first and last fifth
  of the steps, ± their standard error across steps; `rise_se` is (last − first) / sqrt(se_first² + se_last²).
- updates, stall: the serve's committed updates and the generation stall of each (time between the last forward pass
  on the old weights and the first on the new ones, as the engine measured it).
- lag: per-token lag (learner version at training time − the version that generated the token), token-weighted over
  the whole run; `gated` is the fraction of tokens masked by the staleness gate.
- mismatch: mean |learner logprob − behaviour logprob| over lag-0 tokens whose whole completion prefix is lag 0 too
  (so the engine's KV for them came from the same weights); ESS: effective sample size of the token
  importance weights, mean over steps.
- gen tok/s: the serve's generated tokens per second of the run's wall clock (from its cumulative token counter).
- serve idle: fraction of the serve's wall clock with nothing to generate (starved by the learner gate or waiting in
  blocking mode) plus generation stalled by updates; learner wait: fraction of the learner's wall clock spent waiting
  for rollouts after its first step; resubmitted / recomputed: requests an abort-resume update aborted and the prompt
  + partial tokens their resubmission prefilled again.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from inflight.wire.records import EvalResult, ServeProgress, StepMetrics, UpdateEvent, read_serve_events, read_steps


def _read_jsonl(path: Path) -> list[dict]:
    """The launcher's events.jsonl (plain dicts: it has no record of its own)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a kill: the rest still counts
    return out


def _mean_se(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var / len(values))


def ready_time(run_dir: Path) -> float | None:
    """When both sides of the run were ready (the launcher's `ready` event), or None."""
    ready = [e["time"] for e in _read_jsonl(run_dir / "events.jsonl") if e.get("event") == "ready"]
    return ready[0] if ready else None


def load_run(run_dir: Path) -> dict:
    """steps: [StepMetrics], serve: [ServeProgress | UpdateEvent], config: run-config.json as a dict.
    A metrics line that does not match its record raises RecordError naming the file, line and field."""
    steps = read_steps(run_dir / "metrics.jsonl")
    serve = read_serve_events(run_dir / "serve-metrics.jsonl")
    config = json.loads((run_dir / "run-config.json").read_text()) if (run_dir / "run-config.json").exists() else {}
    return {"steps": steps, "serve": serve, "config": config}


def progress_lines(serve: list) -> list[ServeProgress]:
    return [e for e in serve if isinstance(e, ServeProgress)]


def eval_results(serve: list) -> list[EvalResult]:
    """The serve's held-out evals (`--eval-task`, `--eval-every`), in the order they finished."""
    return [e for e in serve if isinstance(e, EvalResult)]


def committed_updates(serve: list) -> list[UpdateEvent]:
    return [e for e in serve if isinstance(e, UpdateEvent) and e.ok]


def lag_tokens(steps: list[StepMetrics]) -> dict[int, int]:
    """Tokens per lag over all steps, gated ones included, by lag."""
    total: dict[int, int] = {}
    for s in steps:
        for lag, n in s.lag_histogram.items():
            total[lag] = total.get(lag, 0) + n
    return dict(sorted(total.items()))


def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else value  # None: the step's value was not finite (NaN or ±inf)


def compute_summary(run_dir: Path) -> dict:
    run = load_run(run_dir)
    steps, serve = run["steps"], run["serve"]
    rewards = [s.reward for s in steps]
    fifth = max(1, len(rewards) // 5)
    first, first_se = _mean_se(rewards[:fifth])
    last, last_se = _mean_se(rewards[-fifth:])
    se = math.sqrt(first_se**2 + last_se**2) if len(rewards) >= 2 * fifth and fifth >= 2 else float("nan")
    updates = committed_updates(serve)
    stalls = sorted(e.stall_s for e in updates)
    lags = lag_tokens(steps)
    total_tokens = sum(lags.values())
    progress = progress_lines(serve)
    gen_rate = serve_idle = resubmitted = recomputed = float("nan")
    if len(progress) >= 2 and progress[-1].time > progress[0].time:
        a, b = progress[0], progress[-1]
        gen_rate = (b.tokens - a.tokens) / (b.time - a.time)
        serve_idle = (b.idle_s - a.idle_s + b.stalled_s - a.stalled_s) / (b.time - a.time)
        resubmitted, recomputed = b.resubmitted, b.recomputed_tokens
    mismatch = [s.mismatch_lag0 for s in steps if s.mismatch_lag0 is not None]
    ess = [_nan_if_none(s.ess) for s in steps]
    # The step's own token count, gated ones included, is its lag histogram's sum (`tokens` is trained tokens only).
    gated = sum(s.gated_fraction * sum(s.lag_histogram.values()) for s in steps)
    wall = steps[-1].time - steps[0].time + steps[0].step_s if steps else 0.0
    summary = {
        "run_dir": str(run_dir),
        "mode": run["config"].get("mode", "?"),
        "model": run["config"].get("model", "?"),
        "steps": len(steps),
        "wall_s": wall,
        "reward_first": first,
        "reward_first_se": first_se,
        "reward_last": last,
        "reward_last_se": last_se,
        "rise_se": (last - first) / se if se and se == se and se > 0 else float("nan"),
        "updates": len(updates),
        "stall_mean_s": sum(stalls) / len(stalls) if stalls else float("nan"),
        "stall_p99_s": stalls[min(len(stalls) - 1, math.ceil(0.99 * len(stalls)) - 1)] if stalls else float("nan"),
        "lag_mean": sum(k * v for k, v in lags.items()) / total_tokens if total_tokens else float("nan"),
        "lag_histogram": {str(k): v for k, v in lags.items()},
        "gated_fraction": gated / total_tokens if total_tokens else float("nan"),
        "mismatch_lag0": sum(mismatch) / len(mismatch) if mismatch else float("nan"),
        "ess": sum(ess) / len(ess) if ess else float("nan"),
        "gen_tokens_per_s": gen_rate,
        "serve_idle_fraction": serve_idle,
        "resubmitted": resubmitted,
        "recomputed_tokens": recomputed,
        "learner_wait_fraction": sum(s.wait_s for s in steps[1:]) / max(wall, 1e-9) if steps else 0.0,
    }
    evals = eval_results(serve)
    if evals:  # only runs with --eval-every get the key: the committed summaries of older runs stay what they were
        summary["evals"] = [
            {"version": e.version, "mean_reward": e.mean_reward, "accuracy": e.accuracy, "n": e.n} for e in evals
        ]
    return summary | _episodes_and_why(steps, progress[-1] if progress else None)


def _episodes_and_why(steps: list[StepMetrics], last: ServeProgress | None) -> dict:
    """`episodes` from serves that count episodes (older runs' summaries stay what they were), `reward_errors` when a
    reward failed; `no_step_trained` when no step trained."""
    out = {}
    if last is not None and (last.turns or last.env_errors or last.groups_dropped):
        out["episodes"] = episode_summary(last)
    if last is not None and last.reward_errors:  # each scored 0.0: a run that learned nothing may say why here
        out["reward_errors"] = last.reward_errors
    if not steps:
        out["no_step_trained"] = why_no_step(last)
    return out


def why_no_step(last: ServeProgress | None) -> str:
    """Why a run trained no step, from the serve's last progress line (its counters are cumulative)."""
    if last is None:
        return "the serve wrote no progress line (it never started generating: see serve.log)"
    if last.rollouts_sent:
        return f"the serve sent {last.rollouts_sent} rollouts, not yet a whole step's groups (see learn.log)"
    if last.groups_failed:
        return f"the serve sent no rollout: {last.groups_failed} groups failed, the last with {last.last_failure}"
    if last.groups_dropped:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(last.env_error_kinds.items(), key=lambda kv: -kv[1]))
        return (
            f"the serve sent no rollout: it dropped all {last.groups_dropped} groups it ran, "
            f"{last.untrained_episodes} episodes ended with no sampled token"
            + (f" (environment errors: {kinds})" if kinds else "")
        )
    return f"the serve sent no rollout ({last.groups_admitted} groups admitted, {last.tokens} tokens generated)"


def episode_summary(last) -> dict:
    """Turns per episode, the environment tokens' share, environment time and errors, from a serve's last
    `ServeProgress` (its counters are cumulative)."""
    made = max(last.rollouts_made, 1)
    share = last.env_tokens / max(last.env_tokens + last.policy_tokens, 1)
    return {
        "episodes": last.rollouts_made,
        "turns_per_episode": last.turns / made,
        "env_token_share": share,
        "env_s_per_episode": last.env_s / made,
        "env_errors": last.env_errors,
        "env_error_kinds": dict(last.env_error_kinds),
        "tool_errors": last.tool_errors,
        "groups_dropped": last.groups_dropped,
        "untrained_episodes": last.untrained_episodes,
    }


def summarize(summaries: list[dict], by_run: bool = False) -> str:
    """One markdown table, a row per run; `by_run`: each row starts with the run's directory (runs of one mode, a
    sweep, read alike otherwise)."""
    head = (
        "| mode | steps | wall s | reward first 20% | reward last 20% | rise (SE) | updates | stall ms (mean/p99) "
        "| lag mean | gated | mismatch lag0 | ESS | gen tok/s |"
    )
    head = "| run " + head if by_run else head
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summaries:
        lead = f"| {s['run_dir']} " if by_run else ""
        if not s["steps"]:
            rows.append(f"{lead}| {s['mode']} | 0 | no step trained: {s.get('no_step_trained', '?')} |")
            continue
        f = _figure
        rows.append(
            f"{lead}| {s['mode']} | {s['steps']} | {f(s['wall_s'], '.0f')} | {f(s['reward_first'], '.3f')} ± "
            f"{f(s['reward_first_se'], '.3f')} | {f(s['reward_last'], '.3f')} ± {f(s['reward_last_se'], '.3f')} "
            f"| {f(s['rise_se'], '+.1f')} | {s['updates']} | {f(1e3 * s['stall_mean_s'], '.0f')} / "
            f"{f(1e3 * s['stall_p99_s'], '.0f')} | {f(s['lag_mean'], '.2f')} | {f(s['gated_fraction'], '.3f')} "
            f"| {f(s['mismatch_lag0'], '.2e')} | {f(s['ess'], '.3f')} | {f(s['gen_tokens_per_s'], '.0f')} |"
        )
    return "\n".join(rows)


def _figure(value: float, spec: str) -> str:
    """A table cell: `value` in `spec`, or "n/a" for NaN, a figure there is no data for (the standard error of a
    fifth of the steps that is one step, a stall without updates), where a reader would otherwise see "nan"."""
    return "n/a" if math.isnan(value) else format(value, spec)


def plot(run_dir: Path) -> list[Path]:
    """reward.png (vs wall clock and vs step), lag.png (token lag histogram), throughput.png (gen tok/s + updates)."""
    # matplotlib is an optional dependency (the `learn` extra): a serve-only install never imports it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = load_run(run_dir)
    steps = run["steps"]
    t0 = ready_time(run_dir) or (steps[0].time if steps else 0.0)
    out = []
    for name, draw in (("reward.png", _plot_reward), ("lag.png", _plot_lag), ("throughput.png", _plot_throughput)):
        fig = draw(plt, run, t0)
        fig.tight_layout()
        out.append(run_dir / name)
        fig.savefig(out[-1], dpi=100)
        plt.close(fig)
    return out


def _plot_reward(plt, run: dict, t0: float):
    steps, mode = run["steps"], run["config"].get("mode", "")
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4))
    t = [s.time - t0 for s in steps]
    r = [s.reward for s in steps]
    window = max(1, len(r) // 10)
    smooth = [sum(r[max(0, i - window + 1) : i + 1]) / len(r[max(0, i - window + 1) : i + 1]) for i in range(len(r))]
    for ax, x, label in ((ax_t, t, "seconds since both sides were ready"), (ax_s, [s.step for s in steps], "step")):
        ax.plot(x, r, ".", alpha=0.4, label="batch mean reward")
        ax.plot(x, smooth, "-", label=f"moving mean ({window} steps)")
        ax.set_xlabel(label)
        ax.set_ylabel("reward")
        ax.grid(alpha=0.3)
    evals = eval_results(run["serve"])
    if evals:  # a version is the step count that made it: held-out reward on the same axis as the training batches'
        ax_s.plot([e.version for e in evals], [e.mean_reward for e in evals], "s-", label="held-out eval (by version)")
    ax_t.set_title(f"reward vs wall clock ({mode})")
    ax_s.set_title(f"reward vs step ({mode})")
    ax_s.legend()
    return fig


def _plot_lag(plt, run: dict, t0: float):
    hist = lag_tokens(run["steps"])
    fig, ax = plt.subplots(figsize=(6, 4))
    total = sum(hist.values()) or 1
    ax.bar(list(hist), [v / total for v in hist.values()], width=0.8)
    ax.set_xlabel("token lag (learner version − generating version)")
    ax.set_ylabel("fraction of trained tokens")
    ax.set_title(f"per-token lag, {int(total)} tokens ({run['config'].get('mode', '')})")
    ax.set_xticks(sorted(hist) or [0])
    return fig


def _plot_throughput(plt, run: dict, t0: float):
    progress, updates = progress_lines(run["serve"]), committed_updates(run["serve"])
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.plot([e.time - t0 for e in progress], [e.tokens_per_s for e in progress], "-", label="generated tok/s")
    for i, e in enumerate(updates):
        ax.axvline(e.time - t0, color="tab:red", alpha=0.3, lw=0.8, label="weight update committed" if i == 0 else None)
    ax.set_xlabel("seconds since both sides were ready")
    ax.set_ylabel("generated tokens/s")
    mode = run["config"].get("mode", "")
    ax.set_title(f"serve generation throughput with weight updates ({mode}, {len(updates)} updates)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    return fig


def write_report(run_dir: Path) -> dict:
    summary = compute_summary(run_dir)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (run_dir / "summary.md").write_text(summarize([summary]) + "\n")
    plot(run_dir)
    return summary


def main(argv: list[str] | None = None) -> int:
    dirs = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    if not dirs:
        print("usage: python -m inflight.run.report RUN_DIR [RUN_DIR ...]", file=sys.stderr)
        return 2
    missing = [str(d) for d in dirs if not (d / "metrics.jsonl").exists()]
    if missing:
        print(f"no learner metrics (metrics.jsonl) in {', '.join(missing)}: is that a run directory?", file=sys.stderr)
        return 2
    print(summarize([write_report(d) for d in dirs], by_run=len(dirs) > 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
