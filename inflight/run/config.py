"""`RunConfig`: what `python -m inflight.run` launches — one serve and one learner on split pools, and where the run
directory goes. The knobs both sides must agree on (model, group shape, temperature, dtype, mode) are set once here and
passed to both (the learner refuses a serve whose contract differs: inflight/wire/contract.py); anything else reaches a
side verbatim through `--serve-args` / `--learn-args`."""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import dataclass, field

from inflight.config import require
from inflight.learn.tracking import REPORT_TO
from inflight.serve.config import MODES
from inflight.wire.contract import GROUP_SIZE, MIN_P, TEMPERATURE, TOP_K, TOP_P


def _h(text: str, **kw) -> dict:
    return {"help": text, **kw}


def parse_cores(spec: str) -> list[int]:
    """'0', '0-3', '0,2-3' → sorted core ids; a ValueError names the bad part."""
    cores: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"core list {spec!r} has {part!r}: expected ids and ranges such as '0', '0-3', '0,2-3'")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cores)


def parse_gpus(spec: str) -> list[str]:
    """'0,1' → ['0', '1'] (CUDA_VISIBLE_DEVICES entries); '' → []."""
    gpus = [g.strip() for g in spec.split(",") if g.strip()]
    bad = [g for g in gpus if not g.isdigit()]
    if bad:
        raise ValueError(f"GPU list {spec!r} has {bad[0]!r}: expected device indices such as '0' or '0,1'")
    return gpus


@dataclass
class RunConfig:
    run_dir: str = field(default="", metadata=_h("run directory; empty = runs/<date>-<time>-<mode>"))
    model: str = field(default="smollm2", metadata=_h("prepared model name or HF dir, served and trained"))
    task: str = field(
        default="arithmetic",
        metadata=_h(
            "'arithmetic', 'jsonl:<path>', 'parquet:<path>' or "
            "'hf:<saved dir or dataset name>[@split]' (the serve's "
            "--task)"
        ),
    )
    env: str = field(
        default="single-turn",
        metadata=_h(
            "the serve's environment: 'single-turn', 'calculator' or "
            "module:Class (its --env; --env-args and --max-turns go in "
            "--serve-args or the [serve] table)"
        ),
    )
    reward: str = field(
        default="",
        metadata=_h(
            "the serve's reward as module:function (sync or async, f(text, problem) -> float); empty = the task's own"
        ),
    )
    dtype: str = field(
        default="auto",
        metadata=_h(
            "compute precision of both sides: the serve's engine dtype and the "
            "learner's decoder autocast (master weights, LM head and optimizer "
            "stay fp32); auto = bfloat16 where the machine computes it natively "
            "(CUDA; a CPU with AMX or avx512_bf16), float32 elsewhere",
            choices=("auto", "float32", "bfloat16"),
        ),
    )
    http_port: int = field(default=0, metadata=_h("the serve also answers vLLM's OpenAI API on this port; 0 = off"))
    mode: str = field(default="never-stop", metadata=_h("how weight updates interrupt generation", choices=MODES))
    group_size: int = field(default=GROUP_SIZE, metadata=_h("completions per prompt"))
    groups_per_step: int = field(default=4, metadata=_h("groups per optimizer step"))
    max_tokens: int = field(default=48, metadata=_h("completion budget per sample"))
    temperature: float = field(
        default=TEMPERATURE, metadata=_h("sampling temperature (the learner computes logprobs at it)")
    )
    top_p: float = field(
        default=TOP_P,
        metadata=_h(
            "nucleus sampling, 1.0 = off; the learner computes its logprobs "
            "under the same truncation (learner/truncation.py)"
        ),
    )
    top_k: int = field(default=TOP_K, metadata=_h("top-k sampling, 0 = off; both sides get it"))
    min_p: float = field(default=MIN_P, metadata=_h("min-p sampling, 0.0 = off; both sides get it"))
    lr: float = field(default=1e-5, metadata=_h("AdamW learning rate"))
    max_lag: int = field(default=4, metadata=_h("learner staleness gate: tokens older than this are masked"))
    admit_lag: int = field(
        default=1,
        metadata=_h(
            "serve admits a group only while admitted - consumed < (admit_lag+1) * groups_per_step; -1 = no gate"
        ),
    )
    steps: int = field(default=0, metadata=_h("stop after this many learner steps; 0 = no step limit"))
    duration_s: float = field(
        default=0.0,
        metadata=_h("stop after this many seconds, counted from when both sides are ready; 0 = no time limit"),
    )
    seed: int = field(default=0, metadata=_h("task, sampling and torch seed"))
    serve_cores: str = field(
        default="",
        metadata=_h(
            "CPU cores of the serve (affinity + vLLM OMP binding); empty = "
            "core 0 on a CPU serve, unpinned with --serve-gpus"
        ),
    )
    learn_cores: str = field(
        default="",
        metadata=_h(
            "CPU cores of the learner (affinity + OMP threads); empty = core 1 on CPU, unpinned with --learn-gpus"
        ),
    )
    serve_gpus: str = field(default="", metadata=_h("GPUs of the serve (CUDA_VISIBLE_DEVICES); empty = CPU"))
    learn_gpus: str = field(default="", metadata=_h("GPUs of the learner, one torchrun rank each (NCCL); empty = CPU"))
    learn_procs: int = field(default=1, metadata=_h("learner ranks on CPU (torchrun + gloo when > 1)"))
    host: str = field(default="127.0.0.1", metadata=_h("address the learner binds and the serve connects to"))
    port_base: int = field(
        default=0, metadata=_h("rollouts, control and weights ports are base, base+1, base+2; 0 = three free ports")
    )
    serve_args: str = field(default="", metadata=_h("extra flags for inflight.serve, e.g. '--max-inflight 32'"))
    learn_args: str = field(default="", metadata=_h("extra flags for inflight.learn, e.g. '--loss ppo'"))
    start_timeout_s: float = field(default=300.0, metadata=_h("seconds each side may take to become ready"))
    stop_timeout_s: float = field(default=180.0, metadata=_h("seconds each side may take to exit after SIGTERM"))
    echo: str = field(
        default="progress",
        metadata=_h(
            "children's output on this terminal (always complete in the logs)", choices=("all", "progress", "none")
        ),
    )
    plots: bool = field(default=True, metadata=_h("write PNG plots and the summary at the end"))
    report_to: str = field(
        default="none",
        metadata=_h(
            "the learner mirrors its metrics, the serve's progress and "
            "sample completions to this tracker (inflight/learn/"
            "tracking.py; metrics.jsonl stays the record)",
            choices=REPORT_TO,
        ),
    )

    def validate(self) -> None:
        require(self.group_size >= 1, "group_size", self.group_size, ">= 1")
        require(self.groups_per_step >= 1, "groups_per_step", self.groups_per_step, ">= 1")
        require(self.steps >= 0, "steps", self.steps, ">= 0")
        require(self.duration_s >= 0, "duration_s", self.duration_s, ">= 0 seconds")
        require(0 <= self.http_port < 65536, "http_port", self.http_port, "0 (off) or a TCP port")
        require(self.learn_procs >= 1, "learn_procs", self.learn_procs, ">= 1")
        require(0 <= self.port_base < 65534, "port_base", self.port_base, "0 (free ports) or a TCP port below 65534")
        for name in ("serve_cores", "learn_cores"):
            if not getattr(self, name):
                continue  # the side's default (inflight/run/launch.py:side_cores)
            try:
                cores = parse_cores(getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"--{name.replace('_', '-')}: {exc}") from None
            available = os.sched_getaffinity(0)
            missing = sorted(set(cores) - available)
            require(not missing, name, getattr(self, name), f"cores this process may use ({sorted(available)})")
        for name in ("serve_gpus", "learn_gpus"):
            try:
                parse_gpus(getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"--{name.replace('_', '-')}: {exc}") from None
        for name in ("serve_args", "learn_args"):
            try:
                shlex.split(getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"--{name.replace('_', '-')} is not a valid command line ({exc})") from None

    def resolved_run_dir(self) -> str:
        return self.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-{self.mode}")
