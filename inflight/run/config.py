"""`RunConfig`: what `python -m inflight.run` launches — one serve and one learner on split pools, and where the run
directory goes. Read by the launcher's process (inflight/run/app.py) from its flags and a run file's top level.

Its sections mirror the run file: the run's own keys (`RunKnobs`), the knobs both sides must agree on
(inflight/wire/contract.py:SharedKnobs, given to both alike), and the side knobs the run sets under their own names
(`FORWARDED`: `ServeForwards`, `LearnForwards`, generated from the sides' declarations by `section_of`, so a side's
default and help are written once, there). `RUN_DERIVES` names the side knobs the run computes from its own keys
(inflight/run/launch.py builds each side's argv from these three); anything else reaches a side verbatim through
`--serve-args` / `--learn-args` or a run file's tables (inflight/run/config_file.py)."""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass

from inflight.config import knob, require, section_of
from inflight.learn.config import LearnConfig
from inflight.serve.config import ServeConfig
from inflight.wire.contract import SharedKnobs

# side -> its knobs the run sets from its own keys of the same name (a run file's top level, the run's flags)
FORWARDED = {
    "serve": ("task", "env", "reward", "http_port", "mode", "max_tokens", "admit_lag"),
    "learn": ("lr", "max_lag", "steps", "host", "report_to"),
}
# side -> {its knob: the run's keys it is computed from} (inflight/run/launch.py:serve_flags, learn_flags)
RUN_DERIVES = {
    "serve": {
        "dtype": "dtype",
        "task_seed": "seed",
        "seed": "seed",
        "rollouts": "host / port_base",
        "control": "host / port_base",
        "metrics": "run_dir",
    },
    "learn": {
        "rollouts_port": "port_base",
        "control_port": "port_base",
        "weights_port": "port_base",
        "seed": "seed",
        "run_dir": "run_dir",
        "autocast": "dtype",
        "backend": "learn_gpus",
    },
}
ServeForwards = section_of(
    "ServeForwards",
    "The serve's knobs the run sets from its keys of the same name (a run file's [serve] table may not set them).",
    ServeConfig,
    FORWARDED["serve"],
    __name__,
    "the serve's {flag}: ",
)
LearnForwards = section_of(
    "LearnForwards",
    "The learner's knobs the run sets from its keys of the same name (a run file's [learn] table may not set them).",
    LearnConfig,
    FORWARDED["learn"],
    __name__,
    "the learner's {flag}: ",
)


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
class RunKnobs:
    """The run's own keys: its directory, precision, seeds, pools, ports, launcher and what it shows."""

    run_dir: str = knob("", "run directory; empty = runs/<date>-<time>-<mode>")
    dtype: str = knob(
        "auto",
        "compute precision of both sides: the serve's engine dtype and the learner's decoder autocast (master "
        "weights, LM head and optimizer stay fp32); auto = bfloat16 where the machine computes it natively (CUDA; a "
        "CPU with AMX or avx512_bf16), float32 elsewhere",
        choices=("auto", "float32", "bfloat16"),
    )
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


@dataclass
class RunConfig(RunKnobs, LearnForwards, ServeForwards, SharedKnobs):  # type: ignore[misc,valid-type]
    """The run's keys: its own, the learner's and the serve's it forwards, and the shared ones (listed last to first,
    so `--help` starts with the shared ones)."""

    def validate(self) -> None:
        self.validate_shared()
        require(self.steps >= 0, "steps", self.steps, ">= 0")
        require(self.duration_s >= 0, "duration_s", self.duration_s, ">= 0 seconds")
        require(0 <= self.http_port < 65536, "http_port", self.http_port, "0 (off) or a TCP port")
        require(self.learn_procs >= 1, "learn_procs", self.learn_procs, ">= 1")
        require(self.serves >= 1, "serves", self.serves, ">= 1")
        require(
            self.serves == 1 or self.launcher == "ray",
            "serves",
            self.serves,
            "1 with --launcher local (several serves run under --launcher ray)",
        )
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
