"""`python -m inflight.run --launcher ray`: the same run as the local launcher, its sides as Ray actors on a cluster.

Called by inflight/run/app.py:main (the driver process), imported only when `--launcher ray` is asked for, so `--help`
and the local launcher never import Ray. The cluster is the one Ray's own `ray.init()` would join
(RAY_ADDRESS, set by `ray job submit` too; unset, a `ray start` cluster on this machine), else a local Ray started here
and stopped at the end (find_cluster).

Placement: one placement group for the learner, its ranks packed (`--learn-gpus` / `--learn-procs` bundles, one GPU
or one CPU each); one for the serves, `--serves` bundles spread over the nodes, each holding one serve's GPUs
(`--serve-gpus` counts them), and one more group per serve added later (inflight/run/scale.py). `--ray-learn-resource`
/ `--ray-serve-resource` pin a role to the nodes advertising that custom resource. Each actor
(inflight/run/ray_actor.py:ProcessHost) runs today's entry point as its child: rank 0's actor picks the learner's ports
on its node, the learner binds that node's routable address (unless `--host` was given), and every serve is handed
those addresses. Several learner ranks get torchrun's variables from the driver (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR = rank 0's node, MASTER_PORT = a free port there) instead of torchrun.

Faults: a serve's actor is restarted by Ray (`--serve-restarts`) and its new serve joins the learner's group at the
current version (the learner catches up a late joiner); the learner ending (or its actor dying) ends the job at once,
naming the actor, its node and why. Every stop (end, Ctrl-C, `ray job stop`'s SIGTERM, a failure) stops the learner,
then the serves, then kills the actors and removes the placement groups; a local Ray is shut down.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from inflight.config import parse_dataclass
from inflight.run.config import RunConfig, parse_gpus
from inflight.run.config_file import SIDE_CONFIGS
from inflight.run.launch import side_commands, side_env
from inflight.serve.config import ServeConfig

RUN_SECRET = "socket-secret"  # in the run directory: see with_run_secret
INSTALL = "pip install 'inflight[ray]' (make setup installs it)"
ROLE_RESOURCE = 0.001  # how much of --ray-*-resource each bundle asks: a marker, however many units a node advertises


class LaunchError(Exception):
    """A run that cannot start or go on under Ray: one line for the user (the flag or variable, and the fix)."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise LaunchError(f"--launcher ray needs Ray, which is not installed: {INSTALL}") from None
    return ray


def learn_bundles(cfg: RunConfig) -> list[dict[str, float]]:
    """One bundle per learner rank: a GPU each with --learn-gpus, else a CPU each (--learn-procs)."""
    gpus = parse_gpus(cfg.learn_gpus)
    ranks = len(gpus) or cfg.learn_procs
    bundle: dict[str, float] = {"CPU": 1.0} | ({"GPU": 1.0} if gpus else {})
    if cfg.ray_learn_resource:
        bundle[cfg.ray_learn_resource] = ROLE_RESOURCE
    return [dict(bundle) for _ in range(ranks)]


def serve_bundle(cfg: RunConfig) -> dict[str, float]:
    """One serve's bundle: a CPU, and its tensor-parallel GPUs (as many as --serve-gpus names)."""
    gpus = len(parse_gpus(cfg.serve_gpus))
    bundle: dict[str, float] = {"CPU": 1.0} | ({"GPU": float(gpus)} if gpus else {})
    if cfg.ray_serve_resource:
        bundle[cfg.ray_serve_resource] = ROLE_RESOURCE
    return bundle


def demand(cfg: RunConfig, serves: int) -> dict[str, float]:
    """Everything the run asks of the cluster, by resource."""
    total: dict[str, float] = {}
    for bundle in [*learn_bundles(cfg), *[serve_bundle(cfg)] * serves]:
        for name, amount in bundle.items():
            total[name] = total.get(name, 0.0) + amount
    return total


def check_capacity(cfg: RunConfig, have: dict[str, float]) -> None:
    """LaunchError naming the flags when the cluster cannot hold the run at all (more GPUs than it has, a role
    resource no node advertises); fragmentation is caught later, by the placement groups' timeout."""
    need = demand(cfg, cfg.serves)
    if need.get("GPU", 0) > have.get("GPU", 0):
        raise LaunchError(
            f"--learn-gpus {cfg.learn_gpus!r} and --serve-gpus {cfg.serve_gpus!r} (x --serves {cfg.serves}) ask for "
            f"{need['GPU']:g} GPUs; the Ray cluster has {have.get('GPU', 0):g}: ask for fewer, or add GPU nodes "
            "(`ray status` lists what the cluster has)"
        )
    roles = (("--ray-learn-resource", cfg.ray_learn_resource), ("--ray-serve-resource", cfg.ray_serve_resource))
    for flag, name in roles:
        if name and name not in have:
            raise LaunchError(
                f"{flag} {name!r}: no node of the Ray cluster advertises it: start those nodes with "
                f"`ray start --resources '{{\"{name}\": 1}}'`, or drop the flag"
            )
    if need["CPU"] > have.get("CPU", 0):
        raise LaunchError(
            f"--serves {cfg.serves} and --learn-procs {cfg.learn_procs} ask for {need['CPU']:g} CPUs (one per serve "
            f"and per learner rank); the Ray cluster has {have.get('CPU', 0):g}: ask for fewer, or add nodes"
        )


def _check_answers(address: str, named: str, timeout_s: float = 5.0) -> None:
    """LaunchError unless something listens at `address` (ray.init would retry for a minute before saying so);
    `named` says where the address came from, for the message."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise LaunchError(
            f"{named}={address!r} is not HOST:PORT: set RAY_ADDRESS to the head node's address (e.g. 10.0.0.1:6379), "
            "or to `local` to start a Ray for this run"
        )
    try:
        socket.create_connection((host, int(port)), timeout_s).close()
    except OSError as exc:
        fix = "start the cluster there (`ray start --head`), fix the address"
        if named != "RAY_ADDRESS":  # found on this machine: a `ray start` whose cluster has since died
            fix = "`ray stop` clears it"
        raise LaunchError(
            f"{named}={address!r} does not answer ({exc.strerror or exc}): {fix}, "
            "or set RAY_ADDRESS=local to start a Ray for this run"
        ) from None


def find_cluster(address: str) -> str | None:
    """The cluster Ray's own `ray.init()` would join for RAY_ADDRESS=`address`, or None to start a local Ray.

    As Ray itself resolves it (its `canonicalize_bootstrap_address`, ray==2.60 pinned): an address is that cluster;
    unset, the cluster `ray start` left running on this machine, if any; `auto`, that or any Ray running here, else
    a refusal; `local`, none (a Ray of this run's own, even beside a running one)."""
    if address and address not in ("auto", "local"):
        return address
    if address == "local":
        return None
    from ray._private.services import canonicalize_bootstrap_address

    try:
        return canonicalize_bootstrap_address(address or None)
    except ConnectionError:
        raise LaunchError(
            "RAY_ADDRESS=auto, and no Ray runs on this machine: start one (`ray start --head`), set RAY_ADDRESS to "
            "the head node's HOST:PORT, or unset it to start a local Ray for this run"
        ) from None


def connect(ray, cfg: RunConfig) -> str:
    """`ray.init` on the cluster `find_cluster` names, else on a local Ray started here (stopped by `ray.shutdown()`
    at the end); the line saying which, for the run's log."""
    address = os.environ.get("RAY_ADDRESS", "")
    namespace = f"inflight-{uuid.uuid4().hex[:8]}"
    common = {"namespace": namespace, "log_to_driver": False, "configure_logging": False}
    found = find_cluster(address)
    if found is not None:
        _check_answers(found, "RAY_ADDRESS" if found == address else "the Ray cluster `ray start` left on this machine")
        try:
            # a found cluster is joined as Ray finds it (None/"auto"): only then does Ray take up the token a
            # `ray start` of 2.60 enabled from ~/.ray/auth_token; an explicit address is passed as it is
            explicit = found == address
            ray.init(address=found if explicit else address or None, **common)
        except Exception as exc:  # a token refused, a version mismatch: Ray's own words, after ours
            raise LaunchError(
                f"the Ray cluster at {found!r} refused the connection ({exc}); a cluster with token authentication "
                "(Ray 2.60's default) is joined at an explicit address only with RAY_AUTH_MODE=token and its token "
                "(~/.ray/auth_token from the head, or RAY_AUTH_TOKEN)"
            ) from None
        return f"Ray: joined the cluster at {found}"
    cpus = max(os.cpu_count() or 1, int(demand(cfg, cfg.serves)["CPU"]))  # logical CPUs: placement, not pinning
    mine = sorted(os.sched_getaffinity(0))
    idle = may_leave_idle_class()
    system = ray_system_cores(mine, side_env(cfg, "serve")[1], idle)
    # The GCS, the raylet and every worker the raylet forks inherit the affinity and the scheduling class of the thread
    # that starts them (ray_system_cores says where and why). Each side's process then pins itself to its own cores,
    # and each actor puts its side back in the normal class (inflight/run/ray_actor.py:normal_priority).
    os.sched_setaffinity(0, system)
    # its workers, which host the sides, at normal priority (Ray's default is nice 15: inflight/run/ray_actor.py:
    # normal_priority says what that costs a serve)
    os.environ.setdefault("RAY_worker_niceness", "0")
    try:
        # "local": a new Ray, never a cluster that appeared since find_cluster looked (num_cpus would be refused).
        # Started in the normal class and moved to the idle one once up: Ray gives its raylet a fixed 30 s to
        # register, which an idle-class start on busy cores missed (ray/_private/node.py, "timed out during startup").
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, **common)
    finally:
        os.sched_setaffinity(0, mine)
    moved = into_idle_class(psutil_children(os.getpid())) if idle else 0
    idle_class = f"; {moved} threads of its processes in the idle class" if idle else ""
    return f"Ray: started a local Ray for this run ({cpus} CPUs{idle_class}), stopped with it"


def psutil_children(pid: int) -> list[int]:
    """Every descendant of `pid` (a local Ray's GCS, raylet, agents and prestarted workers: the sides start later)."""
    import psutil  # a dependency of Ray's own

    return [child.pid for child in psutil.Process(pid).children(recursive=True)]


def into_idle_class(pids: list[int]) -> int:
    """Move every thread of `pids` into the idle scheduling class (Linux applies a policy per thread, and the threads
    and processes they start later inherit it); how many threads moved. One that exited meanwhile is skipped."""
    moved = 0
    for pid in pids:
        try:
            threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
        except FileNotFoundError:
            continue
        for tid in threads:
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                moved += 1
            except (ProcessLookupError, PermissionError):
                pass
    return moved


def ray_system_cores(mine: list[int], serve_cores: list[int] | None, idle_class: bool) -> list[int]:
    """The cores a local Ray's own processes run on. In the idle scheduling class (SCHED_IDLE: a thread that runs only
    where nothing else wants the core and never preempts one that does): the serve's cores, where the engine leaves
    time idle while it waits for the learner at its lag bound; beside the learner they preempted it ~440 times a
    second against ~80 locally and slowed its training 6% per token (2 cores, BENCHMARKS.md). In the normal class
    (the idle class is refused): this process's cores less the serve's, where any remain, since a normal-class daemon
    woken between two decode steps delays the commit (on 2 cores it tripled the stall)."""
    if idle_class:
        return [core for core in mine if core in (serve_cores or [])] or mine
    rest = [core for core in mine if core not in (serve_cores or [])]
    return rest or mine


def may_leave_idle_class() -> bool:
    """Whether a thread of this process may return from the idle scheduling class to the normal one (root,
    CAP_SYS_NICE, or RLIMIT_NICE 20: Linux's rule for leaving SCHED_IDLE); tried on a thread of its own."""
    allowed: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            allowed.append(True)
        except (PermissionError, AttributeError):  # AttributeError: not Linux
            pass

    thread = threading.Thread(target=probe, name="idle-class-probe")
    thread.start()
    thread.join()
    return bool(allowed)


def main(cfg: RunConfig, tables: dict[str, dict], run_dir: Path, interrupted: list[int]) -> int:
    """The run under Ray (inflight/run/app.py:main writes the config before and the report after); the exit code."""
    try:
        ray = import_ray()
        print(f"[run] {connect(ray, cfg)}", file=sys.stderr, flush=True)
    except LaunchError as exc:
        print(f"[run] {exc}", file=sys.stderr, flush=True)
        return 1
    from inflight.run.ray_run import RayRun  # Ray's own imports: only once Ray is there

    run = None
    try:
        check_capacity(cfg, ray.cluster_resources())
        run = RayRun(ray, cfg, tables, run_dir, interrupted)
        return run.run()
    except LaunchError as exc:
        print(f"[run] {exc}", file=sys.stderr, flush=True)
        return 130 if interrupted else 1
    finally:
        if run is not None:
            run.stop_all()
        ray.shutdown()  # a local Ray stops with it (`started_here`); a cluster's driver only disconnects


def learner_commands(cfg: RunConfig, run_dir: Path, host: str, ports: list[int], tables) -> dict[str, list[str]]:
    """Both sides' argv (inflight/run/launch.py:side_commands) with the learner at `host` on `ports`, and the run's
    socket secret (`with_run_secret`)."""
    commands = side_commands(dataclasses.replace(cfg, host=host), run_dir, tuple(ports[:3]), tables)  # type: ignore[arg-type]
    return with_run_secret(commands, run_dir)


def with_run_secret(commands: dict[str, list[str]], run_dir: Path) -> dict[str, list[str]]:
    """Both sides given a secret made for this run (`--socket-secret-file`, ZeroMQ CURVE on the learner's rollout and
    control sockets) unless either side was given one: under Ray the learner binds a cluster address, where only this
    run's serves may reach it. The file lies in the run directory, which every node sees, readable by its owner only.
    CURVE only: --secret-file's keyed weight tags cost ~1 s per GB on the host, so they stay the user's choice."""
    given = [parse_dataclass(SIDE_CONFIGS[side], argv[2:], f"--{side}-args", "") for side, argv in commands.items()]
    if any(c.secret_file or c.socket_secret_file for c in given):
        return commands
    path = run_dir / RUN_SECRET
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # a file left by an earlier run keeps its mode through O_TRUNC
        f.write(secrets.token_hex(32) + "\n")
    return {side: [*argv, "--socket-secret-file", str(path)] for side, argv in commands.items()}


def serve_argv(base: list[str], cfg: RunConfig, run_dir: Path, index: int) -> list[str]:
    """Serve `index`'s argv: the first is the local launcher's serve exactly; the others get their own metrics file,
    task/sampling seed (two serves on one seed would generate the same prompts) and OpenAI API port (`--http-port` +
    index: serves may share a node, and the second could not bind the first's port)."""
    if index == 0:
        return base
    seed = str(cfg.seed + index)
    argv = [*base, "--metrics", str(run_dir / f"serve-{index}-metrics.jsonl"), "--task-seed", seed, "--seed", seed]
    http_port = parse_dataclass(ServeConfig, base[2:], "inflight.serve", "").http_port  # as the serve reads it
    return argv + ["--http-port", str(http_port + index)] if http_port else argv


def rank_env(rank: int, world: int, local_rank: int, local_world: int, master: tuple[str, int]) -> dict[str, str]:
    """torchrun's variables for one learner rank (learner/world.py:start_world reads them)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        "MASTER_ADDR": master[0],
        "MASTER_PORT": str(master[1]),
    }


def env_overrides(cfg: RunConfig, side: str) -> tuple[dict[str, str], list[int] | None]:
    """What the local launcher would set for `side` (inflight/run/launch.py:side_env), as changes to the actor's own
    environment (the driver's PATH and friends are not the node's), and the side's cores."""
    env, cores = side_env(cfg, side)
    env.pop("CUDA_VISIBLE_DEVICES")  # --*-gpus count GPUs under Ray; which ones is Ray's (ProcessHost.launch)
    return {k: v for k, v in env.items() if os.environ.get(k) != v}, cores


def write_event(run_dir: Path, event: str, **fields) -> None:
    with (run_dir / "events.jsonl").open("a") as f:
        f.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
