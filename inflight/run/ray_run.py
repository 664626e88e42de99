"""`RayRun`: one `inflight.run --launcher ray` in the driver process — placement, start order, supervision, stop.

Made by inflight/run/ray_launcher.py:main once Ray is connected (the module docstring there says what runs where).
The driver follows each actor's log in the run directory for the terminal (`LogFollower`: the local launcher's
progress lines), records placement and restarts in `events.jsonl`, and reads `scale.json` (inflight/run/scale.py)
for serves to add while the run goes on.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from inflight.run.config import RunConfig
from inflight.run.launch import worth_quoting
from inflight.run.ray_actor import ProcessHost, _reason
from inflight.run.ray_launcher import (
    LaunchError,
    env_overrides,
    learn_bundles,
    learner_commands,
    rank_env,
    serve_argv,
    serve_bundle,
    write_event,
)
from inflight.run.ray_logs import LogFollower
from inflight.run.scale import requested_serves

POLL_S = 0.5
CALL_TIMEOUT_S = 30.0  # an actor method that does not answer in this long counts as the actor not answering


class RayRun:
    """The actors of one run: the learner's ranks and the serves, and their placement groups."""

    def __init__(self, ray, cfg: RunConfig, tables: dict, run_dir: Path, interrupted: list[int]):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray, self.cfg, self.tables, self.run_dir, self.interrupted = ray, cfg, tables, run_dir, interrupted
        self.strategy = PlacementGroupSchedulingStrategy
        self.host_cls = ray.remote(ProcessHost)
        self.learners: list = []
        self.serves: list[dict] = []  # {"name", "actor", "restarts"}
        self.groups: list = []
        self.follower = LogFollower(cfg.echo)
        self.serve_cmd: list[str] = []

    def _group(self, bundles: list[dict], strategy: str, what: str):
        pg = self.ray.util.placement_group(bundles, strategy=strategy)
        self.groups.append(pg)
        wait_placed(self.ray, pg, f"{what}: the Ray cluster could not place {bundles} ({strategy})", self.cfg)
        return pg

    def _actor(self, name: str, pg, index: int, bundle: dict, restarts: int, **init):
        options = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        actor = self.host_cls.options(
            name=name,
            num_cpus=bundle.get("CPU", 1.0),
            num_gpus=bundle.get("GPU", 0.0),
            resources=options or None,
            max_restarts=restarts,
            scheduling_strategy=self.strategy(placement_group=pg, placement_group_bundle_index=index),
        ).remote(name, str(self.run_dir / f"{name}.log"), **init)
        self.follower.add(name, self.run_dir / f"{name}.log")
        return actor

    def call(self, actor, method: str, *args, wait_s: float = CALL_TIMEOUT_S):
        return self.ray.get(getattr(actor, method).remote(*args), timeout=wait_s)

    def start_learner(self) -> dict[str, list[str]]:
        """Place and start every learner rank; both sides' argv (the serves' carry the learner's addresses)."""
        bundles = learn_bundles(self.cfg)
        pg = self._group(bundles, "PACK", "--learn-gpus/--learn-procs")
        names = ["learn"] + [f"learn-{r}" for r in range(1, len(bundles))]
        self.learners = [self._actor(n, pg, r, bundles[r], 0) for r, n in enumerate(names)]
        nodes = [self.call(a, "node", wait_s=self.cfg.start_timeout_s) for a in self.learners]  # processes start
        for name, node in zip(names, nodes, strict=True):
            write_event(self.run_dir, "placed", actor=name, node_id=node["node_id"], ip=node["ip"])
        host = nodes[0]["ip"] if self.cfg.host == "127.0.0.1" else self.cfg.host  # --host given: the user's choice
        ports = self.call(self.learners[0], "free_ports", 4, host)
        commands = learner_commands(self.cfg, self.run_dir, host, ports, self.tables)
        env, cores = env_overrides(self.cfg, "learn")
        for rank, actor in enumerate(self.learners):
            same_node = [i for i, n in enumerate(nodes) if n["node_id"] == nodes[rank]["node_id"]]
            extra = rank_env(rank, len(nodes), same_node.index(rank), len(same_node), (host, ports[3]))
            if nodes[rank]["gpus"]:  # cuda:LOCAL_RANK is this rank's GPU: its node's learner GPUs, in rank order
                extra["CUDA_VISIBLE_DEVICES"] = ",".join(nodes[i]["gpus"][0] for i in same_node)
            self.call(actor, "launch", commands["learn"], env | (extra if len(nodes) > 1 else {}), cores)
        (self.run_dir / "learn.cmd").write_text(" ".join(["python", *commands["learn"]]) + "\n")
        return commands

    def add_serves(self, count: int, spread: bool) -> None:
        """`count` more serves, in one placement group spread over the nodes (or one group each when scaling)."""
        bundle = serve_bundle(self.cfg)
        pg = self._group([bundle] * count, "SPREAD", "--serves/--serve-gpus") if spread else None
        env, cores = env_overrides(self.cfg, "serve")
        for k in range(count):
            index = len(self.serves)
            group = pg or self._group([bundle], "PACK", f"serve {index}")
            name = "serve" if index == 0 else f"serve-{index}"
            argv = serve_argv(self.serve_cmd, self.cfg, self.run_dir, index)
            actor = self._actor(
                name,
                group,
                k if pg else 0,
                bundle,
                self.cfg.serve_restarts,
                argv=argv,
                env=env,
                cores=cores,
                restart_on_exit=True,
            )
            self.serves.append({"name": name, "actor": actor, "restarts": 0, "ready": False})
            node = self.call(actor, "node", wait_s=self.cfg.start_timeout_s)  # its first call waits for its process
            write_event(self.run_dir, "placed", actor=name, node_id=node["node_id"], ip=node["ip"])

    def run(self) -> int:
        self.follower.start()
        commands = self.start_learner()
        wait_ready(self, self.learners[0], "learn")
        self.serve_cmd = commands["serve"]
        (self.run_dir / "serve.cmd").write_text(" ".join(["python", *self.serve_cmd]) + "\n")
        self.add_serves(self.cfg.serves, spread=True)
        for serve in self.serves:
            wait_ready(self, serve["actor"], serve["name"])
        write_event(self.run_dir, "ready")
        return self.supervise()

    def supervise(self) -> int:
        started = time.monotonic()
        while True:
            if self.interrupted:
                name = signal.Signals(self.interrupted[0]).name
                print(f"[run] {name}: stopping the learner, then the serves", file=sys.stderr, flush=True)
                return 130
            code = self.learner_alive()
            if code is not None:
                return code
            check_serves(self.run_dir, self.serves, self.cfg.serve_restarts)
            wanted = requested_serves(self.run_dir)
            if wanted > len(self.serves):
                scale_to(self, wanted)
            if self.cfg.duration_s and time.monotonic() - started > self.cfg.duration_s:
                print(
                    f"[run] {self.cfg.duration_s:.0f}s budget spent: stopping the learner, then the serves",
                    file=sys.stderr,
                    flush=True,
                )
                rc = stop_side(self, self.learners[0])
                return 0 if rc == 0 else 1
            time.sleep(POLL_S)

    def learner_alive(self) -> int | None:
        """None while every learner rank runs; else the run's exit code, the failure said in one report."""
        for rank, actor in enumerate(self.learners):
            name = "learn" if rank == 0 else f"learn-{rank}"
            try:
                state = self.call(actor, "poll")
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError) as exc:
                raise LaunchError(f"the learner's actor {name} died: {exc}") from None
            if state["code"] is None:
                continue
            if state["code"] == 0 and rank == 0:
                return 0
            report_learner(self.run_dir, name, state, self.call(actor, "node"))
            return 1
        return None

    def stop_all(self) -> None:
        """The learner first (it checkpoints and exports while the serves still answer), then every serve at once; then
        the actors are killed and the placement groups removed, whatever state they are in."""
        learners = [("learn" if r == 0 else f"learn-{r}", a) for r, a in enumerate(self.learners)]
        for batch in (learners, [(s["name"], s["actor"]) for s in self.serves]):
            stop_actors(self.ray, batch, self.cfg.stop_timeout_s)
        for actor in [*self.learners, *(s["actor"] for s in self.serves)]:
            self.ray.kill(actor, no_restart=True)
        for pg in self.groups:
            self.ray.util.remove_placement_group(pg)
        self.follower.stop()


def scale_to(run: RayRun, wanted: int) -> None:
    """Serves up to `wanted`. The request is acknowledged first (`scaling`: inflight.run.scale returns on it), since
    placing and starting an actor's process can take minutes on a busy cluster; `scaled` once each is placed."""
    print(f"[run] scale.json asks for {wanted} serves: adding {wanted - len(run.serves)}", file=sys.stderr)
    write_event(run.run_dir, "scaling", serves=wanted)
    started = time.monotonic()
    run.add_serves(wanted - len(run.serves), spread=False)
    write_event(run.run_dir, "scaled", serves=wanted, placed_s=round(time.monotonic() - started, 1))


def stop_side(run: RayRun, actor) -> int:
    """Stop one side: its actor waits up to --stop-timeout-s for the process to exit, so the answer can take that long
    (a learner finishing a 40 s step on a busy machine) and is waited for that long, plus a call's margin."""
    return run.call(actor, "stop", run.cfg.stop_timeout_s, wait_s=run.cfg.stop_timeout_s + CALL_TIMEOUT_S)


def check_serves(run_dir: Path, serves: list[dict], limit: int) -> None:
    """A serve whose actor Ray restarted is said once per restart; one dead for good ends the run (LaunchError)."""
    for serve in serves:
        restarts = serve_restarts(serve, limit)
        if restarts > serve["restarts"]:
            serve["restarts"] = restarts
            print(f"[run] {serve['name']} died; Ray restarts it (restart {restarts})", file=sys.stderr, flush=True)
            write_event(run_dir, "restarted", actor=serve["name"], restarts=restarts)


def serve_restarts(serve: dict, limit: int) -> int:
    """How often Ray restarted this serve's actor (the GCS actor table); LaunchError once it is dead for good."""
    from ray._private.state import actors  # restarting or dead, and how many restarts: not in the public API

    info = actors(serve["actor"]._actor_id.hex()) or {"State": "PENDING_CREATION", "NumRestarts": 0}
    if info["State"] == "DEAD":
        raise LaunchError(
            f"serve actor {serve['name']} is dead after {info['NumRestarts']} restarts (--serve-restarts {limit}): "
            f"{info['DeathCause']}"
        )
    return info["NumRestarts"]


def stop_actors(ray, batch: list[tuple[str, object]], timeout_s: float) -> None:
    """Stop every actor's child at once (SIGTERM, then SIGKILL after `timeout_s`); an odd exit code is said."""
    calls = [(name, actor.stop.remote(timeout_s)) for name, actor in batch]
    for name, ref in calls:
        try:
            rc = ray.get(ref, timeout=timeout_s + 30)
        except Exception as exc:  # a dead or restarting actor: nothing of it to stop
            print(f"[run] {name}: {type(exc).__name__} while stopping", file=sys.stderr)
            continue
        if rc not in (None, 0, -signal.SIGTERM, 128 + signal.SIGTERM, -signal.SIGKILL):
            print(f"[run] {name} exited with code {_reason(rc)} while stopping", file=sys.stderr)


def wait_placed(ray, pg, what: str, cfg: RunConfig) -> None:
    try:
        ray.get(pg.ready(), timeout=cfg.start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise LaunchError(
            f"{what} in {cfg.start_timeout_s:.0f}s (--start-timeout-s): not enough free CPUs/GPUs on fitting nodes "
            "(`ray status`); ask for fewer"
        ) from None


def report_learner(run_dir: Path, name: str, state: dict, node: dict) -> None:
    """A learner rank that ended: which actor, on which node, why, and its last lines (stderr and events.jsonl)."""
    print(
        f"[run] learner actor {name} (pid {state['pid']}) on node {node['ip']} ({node['node_id'][:12]}) exited with "
        f"code {_reason(state['code'])}; its last lines:\n{state['tail']}",
        file=sys.stderr,
        flush=True,
    )
    write_event(run_dir, "failed", actor=name, node_id=node["node_id"], code=state["code"])


def wait_ready(run: RayRun, actor, name: str) -> None:
    """Until `name` printed its ready line; LaunchError if it exits, the learner ends or time runs out."""
    deadline = time.monotonic() + run.cfg.start_timeout_s
    while time.monotonic() < deadline:
        if run.interrupted:
            raise LaunchError("interrupted before the run was ready")
        try:
            state = run.call(actor, "poll")
        except run.ray.exceptions.RayActorError:  # ActorUnavailableError (restarting) too
            # A serve's actor ends itself once its child exits (so that Ray restarts it): gone before its first ready
            # line, the side is said by its log, as a child that exited is.
            lines = log_tail(run.run_dir / f"{name}.log")
            raise LaunchError(f"{name} exited before it was ready; its last lines:\n{lines}") from None
        if state["ready"]:
            return
        if state["code"] is not None:
            raise LaunchError(
                f"{name} exited with code {_reason(state['code'])} before it was ready; its last "
                f"lines:\n{state['tail']}"
            )
        if run.learner_alive() is not None:
            raise LaunchError(f"the learner ended before {name} was ready")
        time.sleep(POLL_S)
    raise LaunchError(f"{name} was not ready after {run.cfg.start_timeout_s:.0f}s (--start-timeout-s)")


def log_tail(path: Path, n: int = 20) -> str:
    """The last `n` lines of a side's log worth quoting (inflight/run/launch.py:worth_quoting)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(no log: {exc.strerror})"
    return "\n".join([line for line in lines if worth_quoting(line)][-n:])
