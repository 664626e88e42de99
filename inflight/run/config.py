"""`RunConfig`: what `python -m inflight.run` launches — one serve and one learner on split pools, and where the run
directory goes. The knobs both sides must agree on (inflight/wire/contract.py:SharedKnobs, and the dtype) are set once
here and passed to both (the learner refuses a serve whose contract differs); a few knobs of one side are forwarded
under the same name (their declaration is the side's: `knob_of`); anything else reaches a side verbatim through
`--serve-args` / `--learn-args` or a run file's tables (inflight/run/config_file.py)."""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass

from inflight.config import knob, knob_of, require
from inflight.learn.config import EndpointKnobs, LossKnobs, RunDirKnobs
from inflight.serve.config import AdmissionKnobs, EnvKnobs, ServeConfig, TaskKnobs
from inflight.wire.contract import SharedKnobs


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
class RunConfig(SharedKnobs):
    """The run's own knobs, the shared ones (inherited) and the side knobs it forwards (`knob_of`: the side's default
    and help, declared once there)."""

    run_dir: str = knob("", "run directory; empty = runs/<date>-<time>-<mode>")
    task: str = knob_of(TaskKnobs, "task", "the serve's --task")
    env: str = knob_of(EnvKnobs, "env", "the serve's --env (--env-args and --max-turns go in --serve-args or [serve])")
    reward: str = knob_of(TaskKnobs, "reward", "the serve's --reward")
    dtype: str = knob(
        "auto",
        "compute precision of both sides: the serve's engine dtype and the learner's decoder autocast (master "
        "weights, LM head and optimizer stay fp32); auto = bfloat16 where the machine computes it natively (CUDA; a "
        "CPU with AMX or avx512_bf16), float32 elsewhere",
        choices=("auto", "float32", "bfloat16"),
    )
    http_port: int = knob_of(ServeConfig, "http_port", "the serve's --http-port")
    mode: str = knob_of(AdmissionKnobs, "mode", "the serve's --mode")
    max_tokens: int = knob_of(AdmissionKnobs, "max_tokens", "the serve's --max-tokens")
    lr: float = knob_of(LossKnobs, "lr", "the learner's --lr")
    max_lag: int = knob_of(LossKnobs, "max_lag", "the learner's --max-lag")
    admit_lag: int = knob_of(AdmissionKnobs, "admit_lag", "the serve's --admit-lag")
    steps: int = knob_of(RunDirKnobs, "steps", "the learner's --steps")
    duration_s: float = knob(
        0.0, "stop after this many seconds, counted from when both sides are ready; 0 = no time limit"
    )
    seed: int = knob(0, "task, sampling and torch seed")
    serve_cores: str = knob(
        "",
        "CPU cores of the serve (affinity + vLLM OMP binding); empty = core 0 on a CPU serve, unpinned with "
        "--serve-gpus",
    )
    learn_cores: str = knob(
        "", "CPU cores of the learner (affinity + OMP threads); empty = core 1 on CPU, unpinned with --learn-gpus"
    )
    serve_gpus: str = knob("", "GPUs of the serve (CUDA_VISIBLE_DEVICES); empty = CPU")
    learn_gpus: str = knob("", "GPUs of the learner, one torchrun rank each (NCCL); empty = CPU")
    learn_procs: int = knob(1, "learner ranks on CPU (torchrun + gloo when > 1)")
    host: str = knob_of(EndpointKnobs, "host", "the learner's --host, which the serve connects to")
    port_base: int = knob(0, "rollouts, control and weights ports are base, base+1, base+2; 0 = three free ports")
    serve_args: str = knob("", "extra flags for inflight.serve, e.g. '--max-inflight 32'")
    learn_args: str = knob("", "extra flags for inflight.learn, e.g. '--loss ppo'")
    start_timeout_s: float = knob(300.0, "seconds each side may take to become ready")
    stop_timeout_s: float = knob(180.0, "seconds each side may take to exit after SIGTERM")
    echo: str = knob(
        "progress",
        "children's output on this terminal (always complete in the logs)",
        choices=("all", "progress", "none"),
    )
    plots: bool = knob(True, "write PNG plots and the summary at the end")
    report_to: str = knob_of(RunDirKnobs, "report_to", "the learner's --report-to (metrics.jsonl stays the record)")
    launcher: str = knob(
        "local",
        "where the sides run: local = child processes of this command; ray = Ray actors on the cluster RAY_ADDRESS "
        "names, or a local Ray started here when it is unset (docs/multi-node.md; pip install 'inflight[ray]')",
        choices=("local", "ray"),
    )
    serves: int = knob(1, "serves to run (several need --launcher ray; raise it later with inflight.run.scale)")
    serve_restarts: int = knob(3, "--launcher ray: times Ray restarts a serve that died (-1 = no limit)")
    ray_learn_resource: str = knob(
        "", "--launcher ray: a custom resource the learner's nodes advertise (`ray start --resources`); '' = any node"
    )
    ray_serve_resource: str = knob(
        "", "--launcher ray: a custom resource the serves' nodes advertise (`ray start --resources`); '' = any node"
    )

    def validate(self) -> None:
        self.validate_shared()
        require(self.steps >= 0, "steps", self.steps, ">= 0")
        require(self.duration_s >= 0, "duration_s", self.duration_s, ">= 0 seconds")
        require(0 <= self.http_port < 65536, "http_port", self.http_port, "0 (off) or a TCP port")
        require(self.learn_procs >= 1, "learn_procs", self.learn_procs, ">= 1")
        require(self.serves >= 1, "serves", self.serves, ">= 1")
        require(self.serves == 1 or self.launcher == "ray", "serves", self.serves, "1 with --launcher local")
        require(self.serve_restarts >= -1, "serve_restarts", self.serve_restarts, ">= 0, or -1 = no limit")
        require(0 <= self.port_base < 65534, "port_base", self.port_base, "0 (free ports) or a TCP port below 65534")
        for name in ("serve_cores", "learn_cores"):
            if getattr(self, name):  # empty: the side's default (inflight/run/launch.py:side_cores)
                _check_cores(name, getattr(self, name))
        for name in ("serve_gpus", "learn_gpus"):
            _flag_error(name, parse_gpus, getattr(self, name))
        for name in ("serve_args", "learn_args"):
            _flag_error(name, shlex.split, getattr(self, name), "is not a valid command line")

    def resolved_run_dir(self) -> str:
        return self.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-{self.mode}")


def _flag_error(name: str, parse: Callable[[str], object], value: str, what: str = "") -> None:
    """`parse(value)`, its ValueError restated with the flag's name."""
    try:
        parse(value)
    except ValueError as exc:
        flag = f"--{name.replace('_', '-')}"
        raise ValueError(f"{flag} {what} ({exc})" if what else f"{flag}: {exc}") from None


def _check_cores(name: str, spec: str) -> None:
    _flag_error(name, parse_cores, spec)
    available = os.sched_getaffinity(0)
    missing = sorted(set(parse_cores(spec)) - available)
    require(not missing, name, spec, f"cores this process may use ({sorted(available)})")
