"""`python -m inflight.run --launcher ray`: the run's sides as Ray actors, on a real Ray cluster.

The end-to-end test builds a two-node cluster on this machine (`ray.cluster_utils.Cluster`: two raylets, each node a
custom resource so the learner lands on one and the serve on the other) and drives a real run on tiny-llama through
its faults: a serve killed with -9 (Ray restarts its actor, the new serve rejoins at the current version), a serve
added while the run goes on (`inflight.run.scale`), the learner killed with -9 (the job ends, naming it), and
`--resume true` going on from the learner's checkpoint. The refusals (no Ray, a RAY_ADDRESS that does not answer,
more GPUs than the cluster has) are fast tests: one line, exit 1, nothing left running.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import zmq
from serve_support import TEST_KV_GIB, ServeProcess

from inflight.run.launch import free_ports
from inflight.run.ray_launcher import RUN_SECRET, may_leave_idle_class
from inflight.wire.secure import derive_keys, read_secret, secure_client

TESTS = Path(__file__).parent
TIMEOUT_S = 10  # the learner's --timeout-s: how long a weights collective waits on a dead serve
SERVE_ARGS = f"--progress-s 1 --max-inflight 16 --kv-cache-gib {TEST_KV_GIB} --reward serve_rewards:text_length"
FAST = ["--model", "tiny-llama", "--group-size", "4", "--groups-per-step", "2", "--max-tokens", "8",
        "--serve-args", SERVE_ARGS]  # fmt: skip
RAY_PROCESSES = ("raylet", "gcs_server")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def ours(*marks: str) -> list[psutil.Process]:
    """Running processes whose command line holds one of `marks` (zombies excluded)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(m in cmd for m in marks) and p.pid != os.getpid():
            found.append(p)
    return found


MARK = "INFLIGHT_TEST_MARK"  # set per test, inherited by every process it starts (Ray's workers too)


@pytest.fixture(autouse=True)
def mark_children(monkeypatch):
    monkeypatch.setenv(MARK, f"{os.getpid()}-{time.time_ns()}")


def _marked(p: psutil.Process) -> bool:
    try:
        return p.environ().get(MARK) == os.environ.get(MARK)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def side_processes() -> list[psutil.Process]:
    """This test's serves, learners and engines: not another test worker's, which start and stop meanwhile (xdist)."""
    return [p for p in ours("-m inflight.serve", "-m inflight.learn", "EngineCore") if _marked(p)]


def ray_processes() -> set[int]:
    """Ray's running daemons: a zombie (exited, its parent not reaping yet, as in a container whose init does not)
    is not one, though psutil still names it raylet."""
    return {
        p.pid
        for p in psutil.process_iter(["name", "status"])
        if p.info["name"] in RAY_PROCESSES and p.info["status"] != psutil.STATUS_ZOMBIE
    }


def wait_for_ray(allowed: set[int], timeout_s: float = 30.0) -> set[int]:
    """Ray's daemons once none but `allowed` runs, or as they are after `timeout_s`: a refused run's own Ray exits in
    the idle class on the serve's cores (inflight/run/ray_launcher.py), which on a busy machine takes seconds."""
    deadline = time.monotonic() + timeout_s
    while not (now := ray_processes()) <= allowed and time.monotonic() < deadline:
        time.sleep(0.5)
    return now


def assert_nothing_left(before: set[int], timeout_s: float = 30.0, ray: bool = True) -> None:
    """No side process (serve, learner, engine) and, with `ray`, no Ray process started since `before` still runs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        candidates = side_processes() + (ours(*RAY_PROCESSES) if ray else [])
        left = [p for p in candidates if p.pid not in before]
        if not left:
            return
        time.sleep(1)
    raise AssertionError([(p.pid, " ".join(p.cmdline())[:120]) for p in left])


def launcher(run_dir: Path, *flags: str, env: dict | None = None) -> ServeProcess:
    return ServeProcess(["--launcher", "ray", "--run-dir", str(run_dir), *flags], env=env, module="inflight.run")


def refused(run_dir: Path, *flags: str, env: dict | None = None) -> str:
    before = ray_processes()
    proc = launcher(run_dir, *FAST, *flags, env=env)
    assert proc.proc.wait(120) == 1, proc.tail()
    assert wait_for_ray(before) <= before, "a Ray process outlived the refused run by 30 s"
    return proc.tail()


def test_without_ray_the_ray_launcher_refuses_in_one_line_with_the_install_command(tmp_path):
    code = (
        "import sys; sys.modules['ray'] = None; from inflight.run.app import main; "
        f"sys.exit(main(['--launcher', 'ray', '--run-dir', {str(tmp_path)!r}, '--model', 'tiny-llama']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "--launcher ray needs Ray, which is not installed: pip install 'inflight[ray]'" in out.stderr


def test_a_ray_address_that_does_not_answer_is_refused_naming_it_and_the_fix(tmp_path):
    out = refused(tmp_path / "run", env={"RAY_ADDRESS": "127.0.0.1:9"})
    assert "RAY_ADDRESS='127.0.0.1:9' does not answer" in out and "ray start --head" in out


def test_more_gpus_than_the_cluster_has_are_refused_naming_the_flags_and_nothing_is_left_running(tmp_path):
    pytest.importorskip("ray")
    before = {p.pid for p in side_processes()}
    out = refused(tmp_path / "run", "--serve-gpus", "0", "--learn-gpus", "1,2", env={"RAY_ADDRESS": ""})
    assert "--learn-gpus '1,2' and --serve-gpus '0' (x --serves 1) ask for 3 GPUs; the Ray cluster has 0" in out
    assert_nothing_left(before)


@pytest.fixture
def ray_started():
    """A cluster a user left running with `ray start --head` (1 CPU); `ray stop` after, as the user would."""
    pytest.importorskip("ray")
    if ray_processes():
        pytest.skip("a Ray already runs on this machine: plain ray.init() would join it, not the one started here")
    ray_cli = str(Path(sys.executable).parent / "ray")
    port = free_ports(1, "127.0.0.1")[0]
    start = [ray_cli, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "1",
             "--include-dashboard", "false", "--disable-usage-stats"]  # fmt: skip
    sides_before = {p.pid for p in side_processes()}  # a serve running beside this test is not this test's
    subprocess.run(start, check=True, capture_output=True, timeout=120)
    head = ray_processes()
    try:
        yield {"address": f"127.0.0.1:{port}", "processes": head}
    finally:
        subprocess.run([ray_cli, "stop", "--force"], capture_output=True, timeout=120)
    assert_nothing_left(sides_before)


@pytest.mark.parametrize("address", ["", "auto"])
def test_with_a_ray_start_cluster_running_an_unset_or_auto_address_joins_it_and_leaves_it_running(
    tmp_path, ray_started, address
):
    out = refused_beside(ray_started, tmp_path / "run", "--serve-gpus", "0", "--learn-gpus", "1,2", address=address)
    port = ray_started["address"].rsplit(":", 1)[1]  # Ray records the head under the node's own address
    assert re.search(rf"Ray: joined the cluster at \S+:{port}\n", out), out
    assert "the Ray cluster has 0" in out and "num_cpus" not in out


def test_local_starts_a_ray_of_the_runs_own_beside_a_running_cluster_and_stops_only_that_one(tmp_path, ray_started):
    out = refused_beside(ray_started, tmp_path / "run", "--serve-gpus", "0", "--learn-gpus", "1,2", address="local")
    assert "Ray: started a local Ray for this run" in out and "joined" not in out
    if may_leave_idle_class():  # started in the normal class, then moved (into_idle_class, below)
        moved = re.search(r"; (\d+) threads of its processes in the idle class\), stopped with it", out)
        assert moved and int(moved[1]) > 10, out  # a GCS and a raylet run dozens


def test_auto_with_no_ray_running_is_refused_naming_the_three_fixes(tmp_path):
    pytest.importorskip("ray")
    if ray_processes():
        pytest.skip("a Ray already runs on this machine")
    out = refused(tmp_path / "run", env={"RAY_ADDRESS": "auto"})
    assert "RAY_ADDRESS=auto, and no Ray runs on this machine: start one (`ray start --head`)" in out


def refused_beside(cluster: dict, run_dir: Path, *flags: str, address: str) -> str:
    """A run refused after connecting (RAY_ADDRESS=`address`): the cluster's processes all still run, no other Ray
    process is left, and the process's output is returned."""
    before = {p.pid for p in side_processes()}
    proc = launcher(run_dir, *FAST, *flags, env={"RAY_ADDRESS": address})
    assert proc.proc.wait(120) == 1, proc.tail()
    assert_nothing_left(before | cluster["processes"])
    left = wait_for_ray(cluster["processes"])
    assert left == cluster["processes"], "the run stopped the cluster it joined, or left its own Ray"
    return proc.tail()


def test_several_serves_need_the_ray_launcher(tmp_path):
    bad = ServeProcess(["--run-dir", str(tmp_path), "--serves", "2", *FAST], module="inflight.run")
    assert bad.proc.wait(60) == 2
    assert "--serves is 2, expected 1 with --launcher local (several serves run under --launcher ray)" in bad.tail()


@pytest.fixture
def two_nodes(monkeypatch):
    """A Ray cluster of two nodes on this machine: the head advertises `learn_node`, the other `serve_node`."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    # the actors' children import the test's reward module (serve_rewards), like the local launcher's do
    monkeypatch.setenv("PYTHONPATH", f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    before = {p.pid for p in side_processes()} | ray_processes()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"learn_node": 1}, "include_dashboard": False},
    )
    try:
        serve_node = cluster.add_node(num_cpus=3, resources={"serve_node": 1})
        cluster.wait_for_nodes()
        yield {"address": cluster.address, "head": cluster.head_node.node_id, "serve": serve_node.node_id}
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    assert_nothing_left(before)


def handshakes(address: str, keys=None, wait_s: float = 3.0) -> bool:
    """Whether a DEALER (a CURVE client with `keys`, else plain) completes ZeroMQ's handshake with `address`."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    if keys is not None:
        secure_client(sock, keys)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(address)
    try:
        return bool(monitor.poll(int(wait_s * 1000)))
    finally:
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()


def placed(run_dir: Path) -> dict[str, str]:
    return {e["actor"]: e["node_id"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "placed"}


def serve_pid(run_dir: Path) -> int:
    """The pid of serve 0's `inflight.serve` process (the actor's child), from the log's newest ready line's id."""
    ready = [ln for ln in (run_dir / "serve.log").read_text().splitlines() if "inflight.serve ready: server" in ln]
    server = ready[-1].split("server ", 1)[1].split(",", 1)[0]  # <host>-<pid>@<tag>
    return int(server.split("@", 1)[0].rsplit("-", 1)[1])


@pytest.mark.engine
def test_a_run_on_two_ray_nodes_survives_a_killed_serve_grows_a_serve_resumes_after_its_learner_dies_and_stops_clean(
    two_nodes, tmp_path
):
    run_dir, env = tmp_path / "run", {"RAY_ADDRESS": two_nodes["address"]}
    http_port = free_ports(1, "127.0.0.1")[0]  # serve-1, added on the same node, answers on the next port
    flags = [*FAST, "--ray-learn-resource", "learn_node", "--ray-serve-resource", "serve_node", "--steps", "0",
             "--http-port", str(http_port), "--learn-args",
             f"--checkpoint-every 2 --timeout-s {TIMEOUT_S}"]  # fmt: skip
    sides_before = {p.pid for p in side_processes()}
    run = launcher(run_dir, *flags, env=env)
    resumed = None
    try:
        run.wait_for("step 2 v2", 400)
        # placement: the learner on the head node, the serve on the other one, and rollouts crossed between them
        assert placed(run_dir) == {"learn": two_nodes["head"], "serve": two_nodes["serve"]}, placed(run_dir)
        # the learner's sockets on the cluster address take only this run's serves: CURVE, from the run's own secret
        control = (run_dir / "serve.cmd").read_text().split("--control ", 1)[1].split()[0]
        assert not handshakes(control) and handshakes(control, derive_keys(read_secret(str(run_dir / RUN_SECRET))))
        assert "sockets: CURVE (--socket-secret-file" in (run_dir / "learn.log").read_text()
        first = serve_pid(run_dir)
        # not at Ray's worker niceness (15): the sides run at normal priority, as under the local launcher
        learner = [p for p in ours("-m inflight.learn") if str(run_dir) in " ".join(p.cmdline())]
        assert [os.getpriority(os.PRIO_PROCESS, p) for p in (first, learner[0].pid)] == [0, 0]
        os.kill(first, signal.SIGKILL)
        killed_at = len(read_jsonl(run_dir / "metrics.jsonl"))
        run.wait_for("serve died; Ray restarts it (restart 1)", 60)
        run.wait_for("inflight.serve ready", 300, count=2)  # the new serve, in the restarted actor
        assert serve_pid(run_dir) != first
        steps_before = len(read_jsonl(run_dir / "metrics.jsonl"))
        run.wait_for(f"step {steps_before + 2} v{steps_before + 2}", 300)  # trained on the new serve's rollouts

        scale = subprocess.run([sys.executable, "-m", "inflight.run.scale", "--run-dir", str(run_dir), "--serves",
                                "2"], capture_output=True, text=True, timeout=200)  # fmt: skip
        assert scale.returncode == 0, scale.stderr
        run.wait_for("[serve-1] inflight.serve ready", 300)
        assert placed(run_dir)["serve-1"] == two_nodes["serve"]
        assert f"OpenAI API on http://127.0.0.1:{http_port + 1}/v1" in (run_dir / "serve-1.log").read_text()
        assert [e["serves"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "scaled"] == [2]
        grown = len(read_jsonl(run_dir / "metrics.jsonl"))
        deadline = time.monotonic() + 300
        while True:  # until a step trained on a group of the added serve
            server_ids = {e["server_id"] for e in read_jsonl(run_dir / "serve-1-metrics.jsonl") if "server_id" in e}
            trained = [g for s in read_jsonl(run_dir / "metrics.jsonl")[grown:] for g in s["groups"]]
            if server_ids and any(g.rsplit("-g", 1)[0] in server_ids for g in trained):
                break
            assert time.monotonic() < deadline, "the added serve's rollouts were never trained on"
            time.sleep(1)
        learner = [p for p in ours("-m inflight.learn") if str(run_dir) in " ".join(p.cmdline())]
        assert len(learner) == 1, learner
        os.kill(learner[0].pid, signal.SIGKILL)
        died_at = time.monotonic()
        assert run.proc.wait(60) == 1
        assert time.monotonic() - died_at < 30
    finally:
        run.stop()
    # the driver's own lines: a stopping serve's engine traceback can outnumber them at the end
    out = "\n".join(line for line in run.lines if not line.startswith("[serve"))
    assert "learner actor learn" in out and "exited with code -9 (SIGKILL)" in out and "on node" in out, out
    assert_nothing_left(sides_before, 60, ray=False)  # the serves and their engines went with the job

    steps = read_jsonl(run_dir / "metrics.jsonl")
    groups = [g for s in steps for g in s["groups"]]
    assert len(groups) == len(set(groups)), "a rollout was trained twice"
    assert all(s["publish_s"] < TIMEOUT_S + 15 for s in steps if s.get("publish_s") is not None)
    # the restarted serve joined at the learner's current version, not at the model it loaded
    updates = [e for e in read_jsonl(run_dir / "serve-metrics.jsonl") if e["event"] == "update" and e["ok"]]
    servers = list(dict.fromkeys(u["server_id"] for u in updates))
    assert len(servers) == 2, servers
    first_of_new = next(u["version"] for u in updates if u["server_id"] == servers[1])
    assert first_of_new >= killed_at, (first_of_new, killed_at)
    new_steps = [s for s in steps if s["groups"] and all(g.startswith(servers[1]) for g in s["groups"])]
    assert new_steps and all(int(lag) <= 4 for s in new_steps for lag in s["lag_histogram"]), new_steps

    last = steps[-1]["step"]
    try:  # the same command with --resume true goes on from the checkpoint; Ctrl-C then stops every actor and child
        resumed = launcher(run_dir, *flags[:-2], "--learn-args",
                           f"--checkpoint-every 2 --timeout-s {TIMEOUT_S} --resume true", env=env)  # fmt: skip
        resumed.wait_for(f"step {last + 2} v{last + 2}", 400)
        resumed.proc.send_signal(signal.SIGINT)
        assert resumed.proc.wait(300) == 130, resumed.tail()
    finally:
        if resumed is not None:
            resumed.stop()
    assert_nothing_left(sides_before, 60, ray=False)
    after = read_jsonl(run_dir / "metrics.jsonl")[len(steps) :]
    assert after and last - 4 < after[0]["step"] <= last + 1, (last, after[0]["step"])  # from its last checkpoint
    assert (run_dir / "hf-final" / "model.safetensors").exists()
    assert json.loads((run_dir / "summary.json").read_text())["steps"] >= 2


def test_bundles_ask_a_cpu_per_rank_and_a_serves_gpus_and_a_missing_role_resource_is_refused_by_name():
    from inflight.run.config import RunConfig
    from inflight.run.ray_launcher import LaunchError, check_capacity, demand, learn_bundles, serve_bundle

    cfg = RunConfig(learn_gpus="0,1", serve_gpus="2,3", serves=2, ray_serve_resource="serve_node")
    assert learn_bundles(cfg) == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert serve_bundle(cfg) == {"CPU": 1.0, "GPU": 2.0, "serve_node": 0.001}
    assert demand(cfg, 2)["GPU"] == 6
    check_capacity(cfg, {"CPU": 8, "GPU": 6, "serve_node": 1})
    with pytest.raises(LaunchError, match=r"--ray-serve-resource 'serve_node': no node of the Ray cluster"):
        check_capacity(cfg, {"CPU": 8, "GPU": 8})
    with pytest.raises(LaunchError, match=r"ask for 6 GPUs; the Ray cluster has 4"):
        check_capacity(cfg, {"CPU": 8, "GPU": 4, "serve_node": 1})


def test_a_learner_bound_to_every_interface_needs_a_secret():
    from inflight.learn.config import LearnConfig

    with pytest.raises(ValueError, match=r"--host is '0.0.0.0', expected a specific address"):
        LearnConfig(host="0.0.0.0").validate()
    LearnConfig(host="10.0.0.5").validate()  # a node's own address: allowed (docs/multi-node.md, "Bind rules")


def _niced_then_normal(out) -> None:
    """In a child: be a Ray worker of a local Ray (nice 15, the idle scheduling class), then `normal_priority`; report
    what it said, this process's nice and class, and those its own child inherits."""
    from inflight.run.ray_actor import normal_priority

    os.setpriority(os.PRIO_PROCESS, 0, 15)
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    refused = normal_priority()
    probe = "import os; print(os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0))"
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    mine = (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0))
    out.put((refused, mine, tuple(int(x) for x in child.stdout.split())))


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a process's priority needs root (CAP_SYS_NICE)")
def test_an_actor_at_rays_worker_niceness_and_in_the_idle_class_starts_its_side_at_normal_priority():
    """Ray starts its workers at nice 15, a local Ray the run starts in the idle class; a serve that inherits either
    yields its core to any other thread at once."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_niced_then_normal, args=(out,))
    proc.start()
    refused, mine, child = out.get(timeout=60)
    proc.join(10)
    assert (refused, mine, child) == (None, (0, os.SCHED_OTHER), (0, os.SCHED_OTHER))


def test_an_actor_that_may_not_raise_its_priority_says_so_naming_the_ray_setting(monkeypatch):
    from inflight.run import ray_actor

    def denied(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(ray_actor.os, "getpriority", lambda *a: 15)
    monkeypatch.setattr(ray_actor.os, "setpriority", denied)
    refused = ray_actor.normal_priority()
    assert "nice 15" in refused and "RAY_worker_niceness=0 ray start" in refused, refused


def test_a_local_rays_own_processes_run_idle_class_on_the_serves_cores_or_normal_class_off_them():
    from inflight.run.ray_launcher import ray_system_cores

    # the idle class: on the serve's cores, where the engine waits for the learner and is never preempted by them
    assert ray_system_cores([0, 1], [0], idle_class=True) == [0]  # the demo's split: the serve on core 0
    assert ray_system_cores([0, 1, 2, 3], [0, 1], idle_class=True) == [0, 1]
    assert ray_system_cores([0, 1], None, idle_class=True) == [0, 1]  # a serve on GPUs is not pinned
    # the normal class (the idle class refused): off the serve's cores, beside the learner
    assert ray_system_cores([0, 1], [0], idle_class=False) == [1]
    assert ray_system_cores([0, 1, 2, 3], [0, 1], idle_class=False) == [2, 3]
    assert ray_system_cores([0, 1], None, idle_class=False) == [0, 1]
    assert ray_system_cores([0], [0], idle_class=False) == [0]  # one core: nowhere else to go


def test_a_started_rays_processes_move_into_the_idle_class_every_thread_and_what_they_start_later():
    """A local Ray starts in the normal class (its raylet has a fixed 30 s to register, which an idle-class start on
    busy cores missed) and is then moved: every thread of a real process with a thread and a child of its own, and a
    process each of them starts afterwards, runs in SCHED_IDLE."""
    from inflight.run.ray_launcher import into_idle_class, psutil_children

    code = (
        "import os, subprocess, sys, threading, time\n"
        "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('up', flush=True); sys.stdin.readline()\n"
        "probe = [sys.executable, '-c', 'import os; print(os.sched_getscheduler(0))']\n"
        "print(subprocess.run(probe, capture_output=True, text=True).stdout.strip(), flush=True)\n"
        "kid.kill()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        pids = [proc.pid, *psutil_children(proc.pid)]
        tids = [(pid, int(tid)) for pid in pids for tid in os.listdir(f"/proc/{pid}/task")]
        assert len(pids) == 2 and len(tids) >= 3, "the process, its thread and its child"
        assert all(os.sched_getscheduler(tid) == os.SCHED_OTHER for _, tid in tids)
        assert into_idle_class(pids) == len(tids)
        assert all(os.sched_getscheduler(tid) == os.SCHED_IDLE for _, tid in tids)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert int(proc.stdout.readline()) == os.SCHED_IDLE, "a process started later inherits the idle class"
    finally:
        proc.kill()
        proc.wait(10)
    assert into_idle_class([proc.pid]) == 0, "a process that exited is skipped"


def test_the_idle_class_is_used_only_where_a_thread_may_leave_it_again(monkeypatch):
    """Linux lets a thread leave SCHED_IDLE only with CAP_SYS_NICE or RLIMIT_NICE 20: without, a local Ray's daemons
    stay in the normal class rather than leave the driver's thread, or a side, stuck in the idle one."""
    from inflight.run import ray_launcher

    assert ray_launcher.may_leave_idle_class() == (
        os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20
    )
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the probe ran on a thread of its own
    real = os.sched_setscheduler

    def no_leaving(pid, policy, param):
        if policy != os.SCHED_IDLE:
            raise PermissionError(1, "Operation not permitted")
        real(pid, policy, param)

    monkeypatch.setattr(ray_launcher.os, "sched_setscheduler", no_leaving)
    assert ray_launcher.may_leave_idle_class() is False


@pytest.mark.parametrize("name", ["serve", "serve-1", "learn-2"])
def test_every_serve_of_a_run_is_ready_on_its_entry_points_ready_line(tmp_path, name):
    """`--serves 2` from the start: the driver waits for each serve's actor to say its child is ready, and serve-1's
    waited for "inflight.serve-1 ready", which no serve prints (the run failed once its start timeout passed)."""
    from inflight.run.launch import Side

    role = name.partition("-")[0]
    child = f"print('inflight.{role} ready', flush=True); import time; time.sleep(60)"
    side = Side(name, [sys.executable, "-c", child], dict(os.environ), None, tmp_path / f"{name}.log", "none")
    try:
        assert side.ready.wait(30), side.last_lines()
    finally:
        side.stop(10)


def test_stopping_a_side_waits_as_long_as_its_actor_may_take_to_stop_it():
    """The actor's `stop` waits up to --stop-timeout-s for its process; the driver's wait for that answer covers it (a
    learner finishing a 40 s step on a busy machine outlasted a fixed 30 s wait, and the driver died of the timeout)."""
    import types

    from inflight.run.config import RunConfig
    from inflight.run.ray_run import CALL_TIMEOUT_S, RayRun, stop_side

    waits = []
    method = types.SimpleNamespace(remote=lambda *args: ("stop", args))
    ray = types.SimpleNamespace(get=lambda ref, timeout: waits.append((ref, timeout)) or 0)
    run = RayRun.__new__(RayRun)
    run.ray, run.cfg = ray, RunConfig(stop_timeout_s=120.0)
    assert stop_side(run, types.SimpleNamespace(stop=method)) == 0
    assert waits == [(("stop", (120.0,)), 120.0 + CALL_TIMEOUT_S)]


def test_a_serve_whose_actor_is_gone_before_it_was_ready_fails_the_run_with_its_logs_last_lines(tmp_path):
    """A serve's actor ends itself once its child exits (so that Ray restarts it); the driver, waiting for the serve
    to be ready, got Ray's ActorUnavailableError from its poll and died of the traceback. Now the run says which
    serve and quotes its log. (The whole path by hand: `--serves 2 --http-port P` with P+1 taken, 2026-12-06.)"""
    import types

    import ray.exceptions

    from inflight.run.config import RunConfig
    from inflight.run.ray_launcher import LaunchError
    from inflight.run.ray_run import RayRun, wait_ready

    (tmp_path / "serve-1.log").write_text(
        "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 18001): address already in use\n"
        "nanobind: leaked 4 instances!\n# [ray] serve-1 exited with code 3: ending its actor so Ray restarts it\n"
    )

    def restarting(ref, timeout):
        raise ray.exceptions.ActorUnavailableError("The actor is restarting", None)

    run = RayRun.__new__(RayRun)
    run.ray = types.SimpleNamespace(get=restarting, exceptions=ray.exceptions)
    run.cfg, run.run_dir, run.interrupted = RunConfig(), tmp_path, []
    actor = types.SimpleNamespace(poll=types.SimpleNamespace(remote=lambda: "poll"))
    said = r"serve-1 exited before it was ready; its last lines:\n.*already in use"
    with pytest.raises(LaunchError, match=said) as e:
        wait_ready(run, actor, "serve-1")
    assert "nanobind" not in str(e.value)


def test_every_serve_after_the_first_gets_its_own_openai_api_port_whichever_way_the_port_was_given(tmp_path):
    """Serves may share a node (placed SPREAD over fewer nodes, or added by inflight.run.scale): serve i answers on
    --http-port + i, so the second no longer dies binding the first's port."""
    from inflight.run.config import RunConfig
    from inflight.run.ray_launcher import serve_argv

    base = ["-m", "inflight.serve", "--model", "tiny-llama", "--http-port", "8000"]
    cfg = RunConfig(seed=5)
    assert serve_argv(base, cfg, tmp_path, 0) == base
    for index in (1, 2):
        argv = serve_argv(base, cfg, tmp_path, index)
        assert argv[-2:] == ["--http-port", str(8000 + index)] and argv[argv.index("--seed") + 1] == str(5 + index)
    given = ["-m", "inflight.serve", "--http-port=9000", "--kv-cache-gib", "0.25"]  # as --serve-args may give it
    assert serve_argv(given, cfg, tmp_path, 1)[-2:] == ["--http-port", "9001"]
    assert "--http-port" not in serve_argv(["-m", "inflight.serve"], cfg, tmp_path, 1)  # no API, no port


def test_a_ray_run_gives_both_sides_a_socket_secret_of_its_own_unless_one_was_given(tmp_path):
    """Under Ray the learner binds a cluster address: its sockets take only this run's serves (CURVE), from a secret
    the launcher writes into the run directory, readable by its owner only; a secret the user gave is left alone."""
    from inflight.run.config import RunConfig
    from inflight.run.launch import side_commands
    from inflight.run.ray_launcher import with_run_secret

    commands = side_commands(RunConfig(model="tiny-llama"), tmp_path, (20001, 20002, 20003))
    given = with_run_secret(commands, tmp_path)
    path = tmp_path / RUN_SECRET
    assert all(argv[-2:] == ["--socket-secret-file", str(path)] for argv in given.values())
    assert path.stat().st_mode & 0o777 == 0o600 and len(read_secret(str(path))) >= 32
    again = read_secret(str(path))
    with_run_secret(commands, tmp_path)
    assert read_secret(str(path)) != again  # a new run, a new secret

    own = tmp_path / "mine"
    own.write_text("a secret of the user's own, 16+ bytes\n")
    mine = RunConfig(model="tiny-llama", learn_args=f"--secret-file {own}", serve_args=f"--secret-file {own}")
    commands = side_commands(mine, tmp_path, (20001, 20002, 20003))
    assert with_run_secret(commands, tmp_path) == commands


def test_scale_returns_once_the_driver_takes_the_request_and_names_the_timeout_when_it_does_not(tmp_path):
    import threading

    from inflight.run.scale import main as scale

    (tmp_path / "run-config.json").write_text(json.dumps({"launcher": "ray"}))
    (tmp_path / "events.jsonl").write_text(json.dumps({"event": "placed", "actor": "serve", "node_id": "n"}) + "\n")
    assert scale(["--run-dir", str(tmp_path), "--serves", "2", "--timeout-s", "1"]) == 1  # no driver answers
    assert json.loads((tmp_path / "scale.json").read_text()) == {"serves": 2}

    def driver_takes_it():  # the driver acknowledges before it places anything (placing can take minutes)
        time.sleep(1)
        with (tmp_path / "events.jsonl").open("a") as f:
            f.write(json.dumps({"event": "scaling", "serves": 2}) + "\n")

    threading.Thread(target=driver_takes_it).start()
    started = time.monotonic()
    assert scale(["--run-dir", str(tmp_path), "--serves", "2", "--timeout-s", "30"]) == 0
    assert time.monotonic() - started < 10
