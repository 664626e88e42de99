"""A discrete-event simulator of synchronous vs asynchronous RL with in-flight weight updates, for N accelerators.

    python -m benchmarks.simulate probe  [--model smollm2] [--core 0] [--out benchmarks/results/decode-probe.json]
    python -m benchmarks.simulate predict --runs benchmarks/results/ablate [--probe ...json] [--sizes 8,64,512]

`probe` measures the decode cost of one inference worker: a real vLLM engine (pinned like the serve) decodes batches
of b fixed-length requests; a least-squares fit gives seconds per decode step = d0 + d1 · b.

`predict` calibrates the rest from a finished ablation (or demo) directory — learner seconds per trained token and per
step (fit of train_s over tokens), publish seconds, each mode's commit stall and update time as the serve measured
them, and the completion lengths the learner trained on — then simulates the same 1 + 1 worker set-up and prints the
predicted speedup of never-stop over blocking (learner steps per second) next to the measured one. Then the scale
table: N accelerators, 3/4 inference workers and 1/4 learner (data-parallel, perfect scaling assumed), 32 samples per
inference worker per step, with (a) the measured lengths, (b) a long-tailed lognormal length distribution, (c) (b)
plus a lognormal tool-call latency per sample; the synchronous step ends with its slowest worker.

The model, per inference worker: a batch of running sequences advances one token per decode step of d0 + d1·b
seconds; finished sequences (after an optional tool latency, holding no batch slot) complete their group; at most
`max_inflight` run at once. Learner: a step takes `groups_per_step` complete groups, trains t0 + t1·tokens / N_learn
seconds, publishes (p seconds, learner busy); every worker then updates:
- blocking    the pool generates exactly one step's groups, waits for training + publish, updates while idle
- never-stop  generation continues; each worker stalls `commit` seconds at the commit
- keep-pause  running sequences freeze for receive + commit
- drain       admission stops, running sequences finish, then receive + commit
- abort-resume running sequences are aborted and re-prefilled (prompt + partial tokens, at the prefill cost) after
              receive + commit
The asynchronous modes admit a group only while admitted − consumed < (admit_lag + 1) · groups_per_step.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks import RESULTS
from inflight.wire.records import UpdateEvent, read_serve_events, read_steps

MODES = ("never-stop", "keep-pause", "drain", "abort-resume", "blocking")


@dataclass
class Calibration:
    d0: float = 0.02  # seconds per decode step, fixed part
    d1: float = 0.002  # seconds per decode step, per running sequence
    prefill_per_token: float = 0.0005  # seconds per re-prefilled token (abort-resume)
    train_t0: float = 1.0  # learner seconds per step, fixed part
    train_t1: float = 0.02  # learner seconds per trained token (one learner worker)
    publish_s: float = 1.0  # learner seconds to publish an update
    commit_s: dict = field(default_factory=lambda: dict.fromkeys(MODES, 0.05))  # serve stall per update, by mode
    receive_s: float = 0.5  # serve seconds to receive an update (paused modes stall for it)
    lengths: list = field(default_factory=lambda: [30])  # policy tokens of each measured sample, to resample
    turns: list = field(default_factory=list)  # policy turns of the same samples (empty: one turn each)
    tool: str = ""  # the measured run's --tool-latency (after every turn), "" = none
    prompt_tokens: int = 40
    group_size: int = 8
    groups_per_step: int = 4
    max_inflight: int = 64
    admit_lag: int = 1


@dataclass
class Scenario:
    workers: int = 1  # inference workers
    learners: int = 1  # learner workers (data parallel)
    samples_per_worker: int = 32  # per learner step, per inference worker
    lengths: str = "empirical"  # or "lognormal:MEDIAN,SIGMA,CAP"
    tool: str = ""  # "" or "lognormal:MEDIAN_S,SIGMA"


def _sampler(spec: str, empirical: list[int], rng: random.Random):
    if spec == "empirical":
        return lambda: rng.choice(empirical)
    kind, _, args = spec.partition(":")
    if kind != "lognormal":
        raise ValueError(f"length/tool spec {spec!r}: expected 'empirical' or 'lognormal:MEDIAN,SIGMA[,CAP]'")
    vals = [float(v) for v in args.split(",")]
    median, sigma, cap = vals[0], vals[1], (vals[2] if len(vals) > 2 else math.inf)
    return lambda: min(cap, rng.lognormvariate(math.log(median), sigma))


def _episodes(spec: str, cal: Calibration, rng: random.Random):
    """A sampler of one sample's turn lengths: a measured sample (its policy tokens split evenly over its turns), or
    one turn of a lognormal length."""
    if spec != "empirical":
        length_of = _sampler(spec, [], rng)
        return lambda: [max(1, int(round(length_of())))]

    def measured() -> list[int]:
        i = rng.randrange(len(cal.lengths))
        turns = cal.turns[i] if cal.turns else 1
        return [max(1, cal.lengths[i] // turns)] * turns

    return measured


def simulate(cal: Calibration, mode: str, sc: Scenario, steps: int = 60, seed: int = 0) -> dict:
    """Learner steps/s, samples/s and idle fractions of one mode in one scenario (event-driven). A sample is one or
    more turns; after each turn its tool latency (if any) passes without a batch slot, then its next turn queues."""
    return _Simulation(cal, mode, sc, seed).run(steps)


class _Simulation:
    """The state of one simulated run and a handler per event kind (see the module docstring for the model)."""

    def __init__(self, cal: Calibration, mode: str, sc: Scenario, seed: int):
        rng = random.Random(seed)
        self.cal, self.mode, self.sc = cal, mode, sc
        self.turns_of = _episodes(sc.lengths, cal, rng)
        self.tool_of = _sampler(sc.tool, [], rng) if sc.tool else (lambda: 0.0)
        self.group_size = cal.group_size
        self.groups_per_step = max(1, sc.workers * sc.samples_per_worker // self.group_size)
        self.sync = mode == "blocking"
        self.max_inflight = max(cal.max_inflight, sc.samples_per_worker)
        self.t, self.seq = 0.0, 0
        self.events: list = []  # (time, seq, kind, payload)
        self.running = [dict() for _ in range(sc.workers)]  # worker -> {sample_id: [remaining, group, later turns]}
        self.produced = [dict() for _ in range(sc.workers)]  # worker -> {sample_id: tokens produced so far}
        self.queue: list = []  # turns waiting for a worker slot: (sample_id, group, [this turn's length, later ...])
        self.made: dict[int, int] = {}  # sample_id -> tokens of its finished turns
        self.group_left: dict[int, int] = {}
        self.complete_groups: list[tuple[int, int]] = []  # (group, tokens)
        self.group_tokens: dict[int, int] = {}
        self.admitted = self.consumed = self.next_group = 0
        self.stepping = [False] * sc.workers
        self.paused_until = [0.0] * sc.workers
        self.draining = [False] * sc.workers
        self.busy = [0.0] * sc.workers
        self.learner_wait = self.learner_idle_since = 0.0
        self.steps_done = 0
        self.step_times: list[float] = []
        self.allowed_version_groups = self.groups_per_step if self.sync else math.inf
        self.learner_training = False

    def push(self, at, kind, payload=None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, payload))

    def run(self, steps: int) -> dict:
        self.admit()
        self.fill_all()
        handlers = {"decode": self.on_decode, "next_turn": self.on_next_turn, "tool_done": self.on_tool_done,
                    "published": self.on_published, "drained": self.on_drained}  # fmt: skip
        while self.events and self.steps_done < steps:
            self.t, _, kind, payload = heapq.heappop(self.events)
            handlers[kind](payload)
        return self.result()

    def admit(self) -> None:
        while True:
            if self.sync:
                if self.admitted >= self.allowed_version_groups:
                    return
            elif self.admitted - self.consumed >= (self.cal.admit_lag + 1) * self.groups_per_step:
                return
            g = self.next_group
            self.next_group += 1
            self.admitted += 1
            self.group_left[g], self.group_tokens[g] = self.group_size, 0
            for k in range(self.group_size):
                self.queue.append((g * self.group_size + k, g, self.turns_of()))

    def fill(self, w: int) -> None:
        running = self.running[w]
        while self.queue and len(running) < self.max_inflight and not self.draining[w]:
            sid, g, turn_lengths = self.queue.pop(0)
            running[sid] = [turn_lengths[0], g, turn_lengths[1:]]
            self.produced[w][sid] = self.made.pop(sid, 0)
        if running and not self.stepping[w]:
            self.stepping[w] = True
            start = max(self.t, self.paused_until[w])
            self.push(start + self.cal.d0 + self.cal.d1 * len(running), "decode", (w, start))

    def fill_all(self) -> None:
        for w in range(self.sc.workers):
            self.fill(w)

    def finish(self, g: int, n: int) -> None:
        self.group_tokens[g] += n
        self.group_left[g] -= 1
        if self.group_left[g] == 0:
            self.complete_groups.append((g, self.group_tokens[g]))
            self.try_train()

    def try_train(self) -> None:
        if self.learner_training or len(self.complete_groups) < self.groups_per_step:
            return
        take = [self.complete_groups.pop(0) for _ in range(self.groups_per_step)]
        self.consumed += self.groups_per_step
        tokens = sum(n for _, n in take)
        self.learner_training = True
        self.learner_wait += max(0.0, self.t - self.learner_idle_since)
        cal = self.cal
        self.push(self.t + cal.train_t0 + cal.train_t1 * tokens / self.sc.learners + cal.publish_s, "published")
        if not self.sync:
            self.admit()
            self.fill_all()

    def on_decode(self, payload) -> None:
        w, started = payload
        self.stepping[w] = False
        self.busy[w] += self.t - started
        done = []
        for sid, entry in self.running[w].items():
            entry[0] -= 1
            self.produced[w][sid] += 1
            if entry[0] <= 0:
                done.append(sid)
        for sid in done:
            _, g, later = self.running[w].pop(sid)
            tokens = self.produced[w].pop(sid)
            latency = self.tool_of()
            if later:  # the tool answers, then the next turn queues (holding no slot meanwhile)
                self.made[sid] = tokens
                self.push(self.t + latency, "next_turn", (sid, g, later))
            elif latency > 0:
                self.push(self.t + latency, "tool_done", (sid, g, tokens))
            else:
                self.finish(g, tokens)
        if self.draining[w] and not self.running[w]:
            self.push(self.t, "drained", w)
        self.fill(w)

    def on_next_turn(self, payload) -> None:
        self.queue.append(payload)
        self.fill_all()

    def on_tool_done(self, payload) -> None:
        _, g, tokens = payload
        self.finish(g, tokens)
        self.fill_all()

    def on_published(self, _payload) -> None:
        self.steps_done += 1
        self.step_times.append(self.t)
        self.learner_training = False
        self.learner_idle_since = self.t
        for w in range(self.sc.workers):
            _update(self.cal, self.mode, w, self.t, self.running, self.produced, self.paused_until, self.draining,
                    self.push)  # fmt: skip
        if self.sync:
            self.allowed_version_groups += self.groups_per_step
        self.admit()
        self.try_train()
        self.fill_all()

    def on_drained(self, w: int) -> None:
        if self.draining[w]:
            self.draining[w] = False
            self.paused_until[w] = self.t + self.cal.receive_s + self.cal.commit_s["drain"]
            self.fill(w)

    def result(self) -> dict:
        times, t = self.step_times, self.t
        span = times[-1] - times[min(4, len(times) - 1)] if len(times) > 5 else float("nan")
        n = len(times) - 1 - min(4, len(times) - 1)
        rate = n / span if span and span == span and span > 0 else float("nan")
        return {
            "mode": self.mode,
            "steps_per_s": rate,
            "samples_per_s": rate * self.groups_per_step * self.group_size,
            "worker_busy": sum(self.busy) / (self.sc.workers * t) if t else 0.0,
            "learner_wait": self.learner_wait / t if t else 0.0,
        }


def _update(cal, mode, w, t, running, produced, paused_until, draining, push):
    stall = cal.commit_s.get(mode, 0.0)
    if mode in ("never-stop", "blocking"):
        paused_until[w] = max(paused_until[w], t + stall)
    elif mode == "keep-pause":
        paused_until[w] = max(paused_until[w], t + cal.receive_s + stall)
    elif mode == "abort-resume":
        recompute = sum(cal.prompt_tokens + produced[w][sid] for sid in running[w]) * cal.prefill_per_token
        paused_until[w] = max(paused_until[w], t + cal.receive_s + stall + recompute)
    elif mode == "drain":
        if running[w]:
            draining[w] = True
        else:
            paused_until[w] = max(paused_until[w], t + cal.receive_s + stall)


# -- calibration ------------------------------------------------------------------------------------------------------


def calibrate(runs: Path, probe: Path | None) -> Calibration:
    cal = Calibration()
    if probe is not None and probe.exists():
        p = json.loads(probe.read_text())
        cal.d0, cal.d1, cal.prefill_per_token = p["d0"], p["d1"], p["prefill_per_token"]
    steps, lengths, turns = [], [], []
    for mode in MODES:
        run = runs / mode
        m = read_steps(run / "metrics.jsonl")
        if not m:
            continue
        steps += m[1:]  # the first step includes start-up
        for s in m:  # policy tokens and turns of each sample (environment tokens are prefilled, not decoded)
            env = s.env_lengths or [0] * len(s.lengths)
            lengths += [n - e for n, e in zip(s.lengths, env, strict=True)]
            turns += s.turns or [1] * len(s.lengths)
        updates = [e for e in read_serve_events(run / "serve-metrics.jsonl") if isinstance(e, UpdateEvent) and e.ok]
        if updates:
            cal.commit_s[mode] = sum(e.commit_s for e in updates) / len(updates)
            cal.receive_s = sum(e.receive_s for e in updates) / len(updates)
        config = json.loads((run / "run-config.json").read_text())
        cal.group_size, cal.groups_per_step = config["group_size"], config["groups_per_step"]
        cal.admit_lag = config["admit_lag"]
        cal.tool = _tool_latency(config.get("serve_args", ""))
    if not steps:
        raise SystemExit(f"no learner metrics under {runs}/<mode>/metrics.jsonl: run benchmarks.ablate first")
    # least squares train_s = t0 + t1 * tokens
    xs, ys = [s.tokens for s in steps], [s.train_s for s in steps]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    cal.train_t1 = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else my / max(mx, 1)
    cal.train_t1 = max(cal.train_t1, 0.0)
    cal.train_t0 = max(my - cal.train_t1 * mx, 0.0)
    cal.publish_s = sum(s.publish_s or 0.0 for s in steps) / len(steps)  # None: a step that did not publish
    if lengths:
        cal.lengths, cal.turns = lengths, turns
    return cal


def _tool_latency(serve_args: str) -> str:
    """The `--tool-latency` a run's serve was given ('' = none); only the lognormal form is simulated."""
    import shlex

    words = shlex.split(serve_args)
    spec = next((w.split("=", 1)[1] for w in words if w.startswith("--tool-latency=")), "")
    if "--tool-latency" in words and words.index("--tool-latency") + 1 < len(words):
        spec = words[words.index("--tool-latency") + 1]
    if spec and not spec.startswith("lognormal:"):
        raise SystemExit(f"--tool-latency {spec!r}: the simulator models 'lognormal:MEDIAN_S,SIGMA' only")
    return spec


def measured_speedup(runs: Path) -> dict[str, float]:
    """Learner steps per second of each measured mode (after its first step)."""
    out = {}
    for mode in MODES:
        m = read_steps(runs / mode / "metrics.jsonl")
        if len(m) >= 3:
            out[mode] = (len(m) - 1) / (m[-1].time - m[0].time)
    return out


def probe_decode(model: str, core: int, out: Path, dtype: str = "bfloat16") -> dict:
    """Seconds per decode step at several batch sizes on a real engine pinned to `core`, and the d0 + d1·b fit."""
    import asyncio
    import os
    import time

    os.sched_setaffinity(0, [core])
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    os.environ["OMP_NUM_THREADS"] = "1"
    from inflight.demo import import_vllm_optional_media
    from inflight.models import resolve_model
    from inflight.serve.app import standalone_engine_config
    from inflight.serve.config import ServeConfig
    from vllm_patches.engine import InflightEngine

    import_vllm_optional_media()

    async def run() -> dict:
        from vllm import SamplingParams

        engine = await InflightEngine.start(
            standalone_engine_config(ServeConfig(dtype=dtype, head_dtype="model"), resolve_model(model))
        )
        try:
            prompt = list(range(100, 140))
            points, tokens = [], 24
            for b in (1, 4, 16, 32, 64):
                params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True)
                start = time.perf_counter()
                await asyncio.gather(*(engine.generation.generate(prompt, params, f"p{b}-{i}") for i in range(b)))
                points.append((b, (time.perf_counter() - start) / tokens))
            start = time.perf_counter()
            long_prompt = list(range(100, 612))
            await engine.generation.generate(long_prompt, SamplingParams(max_tokens=1), "prefill")
            prefill = (time.perf_counter() - start) / len(long_prompt)
        finally:
            engine.shutdown()
        bs, ts = [p[0] for p in points], [p[1] for p in points]
        mb, mt = sum(bs) / len(bs), sum(ts) / len(ts)
        d1 = sum((b - mb) * (x - mt) for b, x in zip(bs, ts, strict=True)) / sum((b - mb) ** 2 for b in bs)
        return {"points": points, "d0": max(mt - d1 * mb, 0.0), "d1": max(d1, 0.0), "prefill_per_token": prefill,
                "model": model, "core": core, "dtype": dtype}  # fmt: skip

    result = asyncio.run(run())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def predict(runs: Path, probe: Path | None, sizes: list[int], steps: int) -> str:
    cal = calibrate(runs, probe)
    fitted = {k: v for k, v in asdict(cal).items() if k not in ("lengths", "turns")}
    lines = ["## Calibration", "", "```", json.dumps(fitted), "```",
             f"completion lengths: {len(cal.lengths)} samples, mean {sum(cal.lengths) / len(cal.lengths):.1f}, "
             f"max {max(cal.lengths)}"
             + (f"; turns per sample mean {sum(cal.turns) / len(cal.turns):.2f}" if cal.turns else "")
             + (f"; tool latency {cal.tool} after every turn" if cal.tool else ""), ""]  # fmt: skip
    measured = measured_speedup(runs)
    lines += ["## This machine: 1 inference worker + 1 learner (learner steps/s)", "",
              "| mode | simulated steps/s | measured steps/s | simulated speedup | measured speedup | error |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    base = Scenario(workers=1, learners=1, samples_per_worker=cal.group_size * cal.groups_per_step, tool=cal.tool)
    sim = {m: simulate(cal, m, base, steps=steps) for m in MODES}
    for m in MODES:
        s_speed = sim[m]["steps_per_s"] / sim["blocking"]["steps_per_s"]
        if m in measured and "blocking" in measured:
            m_speed = measured[m] / measured["blocking"]
            err = f"{100 * (s_speed - m_speed) / m_speed:+.0f}%"
            meas = f"{measured[m]:.4f}"
            mspeed = f"{m_speed:.2f}"
        else:
            err = meas = mspeed = "—"
        lines.append(f"| {m} | {sim[m]['steps_per_s']:.4f} | {meas} | {s_speed:.2f} | {mspeed} | {err} |")
    lines += ["", "## Scale: N accelerators (3/4 inference, 1/4 learner), 32 samples per inference worker per step",
              "", "| lengths | tool latency | N | blocking samples/s | never-stop samples/s | speedup | keep-pause | "
              "drain | abort-resume |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    tail = "lognormal:40,1.0,2048"
    for lengths, tool in (("empirical", ""), (tail, ""), (tail, "lognormal:2.0,1.0")):
        for n in sizes:
            sc = Scenario(workers=max(1, 3 * n // 4), learners=max(1, n // 4), samples_per_worker=32, lengths=lengths,
                          tool=tool)  # fmt: skip
            r = {m: simulate(cal, m, sc, steps=steps) for m in MODES}
            b = r["blocking"]["samples_per_s"]
            cells = " | ".join(f"{r[m]['samples_per_s'] / b:.2f}x" for m in ("keep-pause", "drain", "abort-resume"))
            lines.append(f"| {lengths} | {tool or 'none'} | {n} | {b:.1f} | {r['never-stop']['samples_per_s']:.1f} "
                         f"| {r['never-stop']['samples_per_s'] / b:.2f}x | {cells} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.simulate", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("probe", help="measure decode cost on a real engine")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--core", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "decode-probe.json"))
    p.add_argument("--dtype", default="bfloat16", help="the serve's dtype (the ablation serves bf16)")
    q = sub.add_parser("predict", help="calibrate from runs and simulate")
    q.add_argument("--runs", default=str(RESULTS / "ablate"))
    q.add_argument("--probe", default=str(RESULTS / "decode-probe.json"))
    q.add_argument("--sizes", default="8,64,512")
    q.add_argument("--steps", type=int, default=40)
    q.add_argument("--out", default="", help="also write the report here (markdown)")
    args = parser.parse_args(argv)
    if args.command == "probe":
        print(json.dumps(probe_decode(args.model, args.core, Path(args.out), args.dtype), indent=2))
        return 0
    report = predict(Path(args.runs), Path(args.probe), [int(s) for s in args.sizes.split(",")], args.steps)
    if args.out:
        Path(args.out).write_text(report + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
