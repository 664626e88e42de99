"""Where a learner step's time goes next to a plain torch step, in one process, on the same batches (a GPU check).

    python -m benchmarks.step_overhead --replay runs/gpu-rec [--model DIR | --random-config config.json] [--steps 12]

Every step's batch comes from the journal exactly as the learner builds it (inflight/learn/samples.py). Per step, in
turn: the plain loop of benchmarks/gpu_learner.py; `learner/step.py:train_step` as the learner runs it (fused loss
where it is on, the lag-0 probe); without the probe; with the fused loss off. Medians after two warm-up steps, then
torch.profiler's top CPU-side ops for one step of each, and the number of host-device synchronisations per step
(`torch.cuda.set_sync_debug_mode`). `--random-config` builds a randomly initialised model of that config (speed does
not depend on the values), so no checkpoint has to travel to the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path


def batches(replay: Path, groups_per_step: int, max_lag: int, steps: int) -> list:
    from inflight.learn.replay import JournalReplay
    from inflight.learn.samples import build_samples
    from inflight.learn.store import RolloutBuffer
    from learner.step import Sample, make_batch

    source, buffer, out = JournalReplay(replay), RolloutBuffer(), []
    for version in range(steps):
        source.fill(buffer, groups_per_step)
        groups = buffer.take(groups_per_step)
        if groups is None:
            break
        samples, _ = build_samples(groups, version, max_lag)
        train = [Sample(s.prompt_ids, s.completion_ids, s.behaviour_logprobs, s.advantage, s.token_mask)
                 for s in samples]  # fmt: skip
        fresh = [t._replace(token_mask=s.on_policy_prefix) for t, s in zip(train, samples, strict=True)]
        batch = make_batch(train, pad_id=0)
        out.append((batch, make_batch(fresh, pad_id=0).mask & batch.mask))
    return out


def model_dir(args) -> Path:
    if args.model:
        from inflight.models import resolve_model

        return resolve_model(args.model)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.random_config)
    out = Path(tempfile.mkdtemp(prefix="step-overhead-"))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


class _Steps:
    """The plain model and the learner's policy side by side on one device, each step callable by name."""

    def __init__(self, path: Path, recorded: dict, device):
        import torch
        from transformers import AutoModelForCausalLM

        from learner.losses import LossConfig
        from learner.model import load_policy
        from learner.step import TrainConfig, make_optimizer

        self.device, self.recorded = device, recorded
        self.plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
        self.plain_opt = torch.optim.AdamW(self.plain.parameters(), lr=recorded["lr"])
        self.policy = load_policy(path, device=device)
        loss = LossConfig(kind=recorded["loss"], tis_cap=recorded["tis_cap"], aggregation=recorded["aggregation"])
        self.variants = {fused: TrainConfig(lr=recorded["lr"], loss=loss, fused_loss=fused)
                         for fused in ("auto", "off")}  # fmt: skip
        self.opts = {fused: make_optimizer(self.policy, cfg) for fused, cfg in self.variants.items()}
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(self, name: str, batch, probe) -> None:
        import torch

        from benchmarks.gpu_learner import _plain_step
        from learner.step import train_step

        bf16 = torch.bfloat16  # the decoder under bf16 autocast on every side, as the CUDA learner runs
        if name == "plain":
            _plain_step(self.plain, self.plain_opt, batch.to(self.device), self.recorded, bf16)
        elif name == "learner (as run)":
            train_step(self.policy, self.opts["auto"], batch, self.variants["auto"], probe_mask=probe, autocast=bf16)
        elif name == "learner, fused off":
            train_step(self.policy, self.opts["off"], batch, self.variants["off"], probe_mask=probe, autocast=bf16)
        else:  # "learner, no probe"
            train_step(self.policy, self.opts["auto"], batch, self.variants["auto"], autocast=bf16)

    def timed(self, name: str, batch, probe) -> float:
        self.sync()
        start = time.perf_counter()
        self.run(name, batch, probe)
        self.sync()
        return time.perf_counter() - start


NAMES = ("plain", "learner (as run)", "learner, fused off", "learner, no probe")


def profile(steps: _Steps, batch, probe) -> dict[str, list[str]]:
    """For one step of the plain loop and of the learner: where it synchronises with the GPU (file:line), and
    torch.profiler's top CPU-side ops, printed; the synchronisation points returned."""
    import torch

    syncs = {}
    for name in NAMES[:2]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if steps.device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            steps.run(name, batch, probe)
            if steps.device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        syncs[name] = [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
        print(f"{name}: {len(syncs[name])} host-device synchronisations", *syncs[name][:12], sep="\n  ")
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            steps.run(name, batch, probe)
            steps.sync()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    return syncs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replay", type=Path, required=True)
    parser.add_argument("--model", default="")
    parser.add_argument("--random-config", default="", help="a config.json directory: random weights of that shape")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    recorded = json.loads((args.replay / "learn-config.json").read_text())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a dry run of this script
    batches_ = batches(args.replay, recorded["groups_per_step"], recorded["max_lag"], args.steps)
    steps = _Steps(model_dir(args), recorded, device)
    times: dict[str, list[float]] = {name: [] for name in NAMES}
    for batch, probe in batches_:  # each variant in turn on every batch: drift in the machine hits them alike
        for name in NAMES:
            times[name].append(steps.timed(name, batch, probe))
    tokens = statistics.median(int(b.mask.sum()) for b, _ in batches_[2:])
    result = {name: statistics.median(t[2:]) for name, t in times.items()}
    where = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU dry run"
    print(f"\n{where}; {len(batches_)} steps, median {tokens} trained tokens per step")
    print("| step | median ms | vs plain |")
    print("|---|---|---|")
    for name, seconds in result.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {result['plain'] / seconds:.2f} |")
    syncs = profile(steps, *batches_[-1])
    if args.json:
        args.json.write_text(json.dumps({"median_s": result, "tokens": tokens, "syncs": syncs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
