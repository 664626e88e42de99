"""Interruption-granularity ablation: the same task, seed and wall-clock budget in each weight-update mode.

    python -m benchmarks.ablate [--duration-s 300] [--out benchmarks/results/ablate] [--modes all] [--target 0.5]
                                [--reuse] [-- RUN FLAGS]

Each mode is one full `python -m inflight.run` (SmolLM2 + arithmetic, the demo's flags; serve on core 0, learner on
core 1) in `<out>/<mode>/`; then one table (`<out>/ABLATION.md`, also printed) and overlay plots
(`ablate-reward.png`, `ablate-lag.png`, `ablate-throughput.png`). Modes:

- never-stop    weights staged while decoding continues; committed between two forward passes (the engine thread
                blocks only for the commit itself)
- keep-pause    vLLM pause(mode="keep"): running requests are frozen (KV kept) while weights arrive and commit
- drain         vLLM pause(mode="wait"): no new tokens for new work; running requests finish first, then update
- abort-resume  vLLM pause(mode="abort"): running requests are aborted, resubmitted with prompt + partial tokens
- blocking      conventional synchronous RL: generate one step's groups, wait for the learner, update while idle

Columns: time to target (first time the moving mean of the batch reward over 5 steps reaches `--target`, seconds
since both sides were ready; "—" if never), reward at the budget (mean over the last 20% of steps), learner steps,
generated tokens/s (serve), serve idle fraction (starved + stalled by updates), learner idle fraction (waiting for
rollouts), commit stall mean / p99, token lag distribution (fraction of trained tokens at lag 0, 1, 2+), the same for
the KV lag (learner version − version of the oldest KV a token attended to: older than the token's own version after
a commit with kv="keep"), requests resubmitted and tokens prefilled again by abort-resume, lag-0 logprob mismatch
(learner vs behaviour).

kv="keep" vs kv="recompute" under never-stop: one run each, e.g.

    python -m benchmarks.ablate --modes never-stop --out benchmarks/results/ablate-kv/recompute \\
        -- --serve-args "--kv recompute"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import RESULTS
from inflight.run.report import lag_tokens, progress_lines, ready_time
from inflight.serve.config import MODES
from inflight.wire.records import read_steps


def time_to_target(run_dir: Path, target: float, window: int = 5) -> float:
    """Seconds since ready until the moving mean of the batch reward over `window` steps first reaches `target`."""
    steps = read_steps(run_dir / "metrics.jsonl")
    t0 = ready_time(run_dir) or steps[0].time
    for i in range(window - 1, len(steps)):
        if sum(s.reward for s in steps[i - window + 1 : i + 1]) / window >= target:
            return steps[i].time - t0
    return float("nan")


def kv_lag_tokens(run_dir: Path) -> dict[int, int]:
    """Tokens per KV lag over all steps ({} for a run from before KV ages were recorded)."""
    total: dict[int, int] = {}
    for s in read_steps(run_dir / "metrics.jsonl"):
        for lag, n in (s.kv_lag_histogram or {}).items():
            total[lag] = total.get(lag, 0) + n
    return total


def lag_shares(histogram: dict) -> str:
    """'share at 0 / 1 / 2+' of a lag histogram; '—' when empty."""
    h = {int(k): v for k, v in histogram.items()}
    total = sum(h.values())
    if not total:
        return "—"
    old = sum(v for k, v in h.items() if k >= 2)
    return f"{h.get(0, 0) / total:.2f} / {h.get(1, 0) / total:.2f} / {old / total:.2f}"


def table(rows: list[dict], target: float) -> str:
    head = (
        f"| mode | time to reward {target:g} (s) | reward at budget | steps | gen tok/s | serve idle | learner idle "
        "| stall ms mean / p99 | lag 0 / 1 / 2+ | kv lag 0 / 1 / 2+ | resubmitted / recomputed tok | mismatch lag0 |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lag, kv = lag_shares(r["lag_histogram"]), lag_shares(r.get("kv_lag_histogram", {}))
        ttt = "—" if r["time_to_target_s"] != r["time_to_target_s"] else f"{r['time_to_target_s']:.0f}"
        lines.append(
            f"| {r['mode']} | {ttt} | {r['reward_last']:.3f} ± {r['reward_last_se']:.3f} | {r['steps']} "
            f"| {r['gen_tokens_per_s']:.1f} | {r['serve_idle_fraction']:.2f} | {r['learner_wait_fraction']:.2f} "
            f"| {1e3 * r['stall_mean_s']:.0f} / {1e3 * r['stall_p99_s']:.0f} | {lag} | {kv} "
            f"| {r['resubmitted']} / {r['recomputed_tokens']} | {r['mismatch_lag0']:.2e} |"
        )
    episodes = [(r["mode"], r["episodes"]) for r in rows if r.get("episodes", {}).get("turns_per_episode", 1) > 1]
    if episodes:  # multi-turn runs (--env): what the episodes looked like in each mode
        lines += ["", "| mode | episodes | turns / episode | env token share | env s / episode | env errors |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {m} | {e['episodes']} | {e['turns_per_episode']:.2f} | {e['env_token_share']:.2f} "
                  f"| {e['env_s_per_episode']:.3f} | {e['env_errors']} |" for m, e in episodes]  # fmt: skip
    return "\n".join(lines)


def plots(out: Path, modes: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from inflight.run.report import load_run

    runs = {m: load_run(out / m) for m in modes if (out / m / "metrics.jsonl").exists()}
    t0s = {m: ready_time(out / m) or run["steps"][0].time for m, run in runs.items()}

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for m, run in runs.items():
        r = [s.reward for s in run["steps"]]
        smooth = [sum(r[max(0, i - 4) : i + 1]) / len(r[max(0, i - 4) : i + 1]) for i in range(len(r))]
        ax.plot([s.time - t0s[m] for s in run["steps"]], smooth, "-", label=m)
    ax.set_xlabel("seconds since both sides were ready")
    ax.set_ylabel("batch reward (moving mean, 5 steps)")
    ax.set_title("reward vs wall clock, one run per update mode")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ablate-reward.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(len(runs), 1)
    for i, (m, run) in enumerate(runs.items()):
        hist = lag_tokens(run["steps"])
        total = sum(hist.values()) or 1
        xs = sorted(hist)
        ax.bar([x + i * width for x in xs], [hist[x] / total for x in xs], width=width, label=m)
    lags = sorted({lag for run in runs.values() for lag in lag_tokens(run["steps"])})
    ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in lags], [str(x) for x in lags])  # one label per lag
    ax.set_xlabel("token lag (versions)")
    ax.set_ylabel("fraction of trained tokens")
    ax.set_title("per-token lag by update mode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ablate-lag.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for m, run in runs.items():
        progress = progress_lines(run["serve"])
        ax.plot([e.time - t0s[m] for e in progress], [e.tokens for e in progress], "-", label=m)
    ax.set_xlabel("seconds since both sides were ready")
    ax.set_ylabel("tokens generated (cumulative)")
    ax.set_title("serve generation by update mode")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ablate-throughput.png", dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from inflight.run.demo import split_run_flags

    argv, extra = split_run_flags(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ablate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=300.0, help="training budget per mode (default 300)")
    parser.add_argument("--out", default=str(RESULTS / "ablate"), help="parent of the per-mode run directories")
    parser.add_argument("--modes", default="all", help=f"'all' or a comma-separated subset of {', '.join(MODES)}")
    parser.add_argument("--target", type=float, default=0.5, help="reward for the time-to-target column")
    parser.add_argument("--reuse", action="store_true", help="report finished runs with the same flags, not re-run")
    args = parser.parse_args(argv)
    modes = list(MODES) if args.modes == "all" else [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes is {args.modes!r}: expected 'all' or a comma-separated subset of {', '.join(MODES)}")

    from inflight.run.demo import run_modes

    out = Path(args.out)
    codes, summaries = run_modes(modes, args.duration_s, out, extra, reuse=args.reuse, tag="ablate")
    for s in summaries:
        s["time_to_target_s"] = time_to_target(Path(s["run_dir"]), args.target)
        s["kv_lag_histogram"] = {str(k): v for k, v in sorted(kv_lag_tokens(Path(s["run_dir"])).items())}
    result = table(summaries, args.target)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ABLATION.md").write_text(result + "\n")
    (out / "ablation.json").write_text(json.dumps(summaries, indent=2) + "\n")
    plots(out, modes)
    print("\n" + result + "\n", flush=True)
    return max(codes.values(), default=1)


if __name__ == "__main__":
    sys.exit(main())
